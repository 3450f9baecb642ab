//! dedupd: a deduplication sidecar. Consumers claim a producer's correlation
//! ID before processing an event, commit it after the business write and
//! release it on failure, so that a redelivered event becomes a no-op.
//!
//! Module map, from the inside out:
//! - [`clock`]: injectable time.
//! - [`domain`]: keys, tokens, records, validated requests and outcomes.
//! - [`machine`]: the state machine of SPEC §2, pure functions only.
//! - [`store`]: the storage contract and its backends ([`store::sled`],
//!   [`store::memory`]).
//! - [`engine`]: runs requests through the machine on a store, durably.
//! - [`api`]: protobuf ↔ domain, with every field validated.
//! - [`service`]: the gRPC handlers.
//! - [`server`]: assembles the servers and runs them until shutdown.
//! - [`listen`]: TCP and Unix-socket listeners.
//! - [`guard`]: the tower layer for tokens, admission, timeouts and RPC timing.
//! - [`ops`]: `/metrics`, `/healthz`, `/readyz` over HTTP.
//! - [`metrics`]: the Prometheus metrics.
//! - [`config`]: flags and `DEDUPD_*` variables.
//! - [`cli`]: the command-line client.
//! - [`error`]: the error type and its gRPC status mapping.
//! - [`proto`]: generated code.

pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod domain;
pub mod engine;
pub mod error;
pub mod guard;
pub mod listen;
pub mod machine;
pub mod metrics;
pub mod ops;
pub mod proto;
pub mod server;
pub mod service;
pub mod store;

pub use error::Error;
pub use server::{run, Listeners, ServerConfig};
