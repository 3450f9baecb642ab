//! The HTTP idempotency-proxy face (`dedupd http-proxy`, issue 14), being
//! built. What exists so far is the part the draft
//! (draft-ietf-httpapi-idempotency-key-header) defines, as pure functions:
//!
//! - [`idempotency`]: the `Idempotency-Key` header, the record a keyed
//!   request maps to, the payload fingerprint, which responses are replayed
//!   and their stored form.
//!
//! The server (forwarding, lease renewal, replay, 409/422/400 answers, gRPC)
//! is not built yet: no command serves it.

pub mod idempotency;
pub mod server;
