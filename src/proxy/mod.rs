//! The HTTP idempotency proxy face: dedupd in front of an HTTP or gRPC
//! service, deduplicating requests that carry an `Idempotency-Key`
//! (draft-ietf-httpapi-idempotency-key-header) on the same engine, store
//! and state machine as the gRPC API. `serve --http-proxy-listen` runs it.
//!
//! - [`idempotency`]: the draft's rules as pure functions — the key header,
//!   the record a keyed request maps to, the payload fingerprint, which
//!   answers are replayed and their stored form.
//! - [`server`]: the HTTP/1.1 + HTTP/2 server that forwards, commits,
//!   releases and replays.

pub mod idempotency;
pub mod server;
