//! dedupd: a deduplication sidecar. Consumers claim a producer's correlation
//! ID before processing an event, commit it after the business write and
//! release it on failure, so that a redelivered event becomes a no-op. The
//! protocol is written down in `docs/protocol.md`.
//!
//! Module map, from the inside out:
//! - [`clock`]: injectable time.
//! - [`time_policy`]: on a shared store, the store's clock decides
//!   ([`time_policy::StoreClock`], measured against the store).
//! - [`domain`]: keys, tokens, records, validated requests and outcomes.
//! - [`machine`]: the protocol's state machine, pure functions only.
//! - [`store`]: the storage contract and its backends ([`store::sled`],
//!   embedded, made durable by its own write-ahead log (`store/wal.rs`);
//!   [`store::postgres`] and [`store::redis`], shared by every
//!   sidecar, with what they share in [`store::shared`];
//!   [`store::tiered`], a sidecar's local tier in front of a shared store;
//!   [`store::memory`], the reference model).
//! - [`engine`]: runs requests through the machine on a store, durably.
//! - [`api`]: protobuf ↔ domain, with every field validated.
//! - `service`: the gRPC handlers (internal).
//! - `guard`: the tower stack in front of the dedup service: timing, load
//!   shedding, one concurrency limit, the timeout, the token check (internal;
//!   [`GuardConfig`] and [`Tokens`] configure it).
//! - [`server`]: assembles the servers and runs them until shutdown.
//! - `listen`: TCP and Unix-socket listeners ([`ListenAddr`], [`Listener`]).
//! - `ops`: `/metrics`, `/healthz`, `/readyz` over HTTP (internal).
//! - `metrics`: the Prometheus metrics ([`Metrics`]).
//! - [`command`]: the command line as a whole, one command per face (each
//!   face's flags live with it; only `main` parses here).
//! - [`config`]: the server's flags and `DEDUPD_*` variables → plain
//!   settings.
//! - [`credentials`]: tokens and TLS material read from their files.
//! - [`cli`]: the command-line client.
//! - [`inject`]: `dedupd inject`, the admission webhook that adds the
//!   sidecar to labelled pods (a face of its own: it never touches a store).
//! - [`proxy`]: the HTTP idempotency proxy (`--http-proxy-listen`), a face
//!   of its own on the same engine: the Idempotency-Key rules and the
//!   server that forwards, commits and replays.
//! - [`telemetry`]: OpenTelemetry traces: the spans, W3C propagation, OTLP
//!   export through a queue that drops rather than waits.
//! - `error`: the error type and its gRPC status mapping ([`Error`]).
//! - [`proto`]: generated code.

pub mod api;
pub mod cli;
pub mod clock;
pub mod command;
pub mod config;
pub mod credentials;
pub mod domain;
pub mod engine;
mod error;
mod guard;
pub mod hashed_ids;
pub mod inject;
pub mod key_registry;
mod listen;
pub mod machine;
pub mod memory_budget;
mod metrics;
mod ops;
pub mod proto;
pub mod proxy;
pub mod sealing;
pub mod server;
mod service;
pub mod store;
pub mod telemetry;
pub mod time_policy;

pub use error::{Error, FieldViolation};
pub use guard::{GuardConfig, Tokens, DEFAULT_READ_BUDGET_BYTES};
pub use listen::{ListenAddr, Listener};
pub use metrics::Metrics;
pub use server::{run, Listeners, ServerConfig};
