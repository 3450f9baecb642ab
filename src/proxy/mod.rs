//! The HTTP idempotency proxy face: dedupd in front of an HTTP or gRPC
//! service, deduplicating requests that carry an `Idempotency-Key`
//! (draft-ietf-httpapi-idempotency-key-header) on the same engine, store
//! and state machine as the gRPC API. `serve --http-proxy-listen` runs it.
//!
//! - [`idempotency`]: the draft's rules as pure functions — the key header,
//!   the record a keyed request maps to (scoped by the caller's
//!   credentials), the payload fingerprint, which answers are replayed and
//!   what is stored (an answer, or "outcome unknown").
//! - [`budget`]: the bytes of request bodies and gathered answers held at
//!   once, in total and per caller.
//! - `keyed`: a keyed request's life (claim, the one forward, settling);
//!   `forward`: the upstream call and the answer's body; `answer`: what the
//!   client is answered; `send_deadline`: HTTP/2 answers under the
//!   deadline HTTP/1's get from the socket.
//! - [`server`]: the HTTP/1.1 + HTTP/2 server that forwards a keyed request
//!   at most once, commits, releases, replays and streams, behind the same
//!   connection defences as the gRPC listener.

mod answer;
pub mod budget;
mod forward;
pub mod idempotency;
mod keyed;
mod send_deadline;
pub mod server;
