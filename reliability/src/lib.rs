//! dedupd's reliability suite (issue 16): what backs "never processed
//! twice, never an acknowledged commit lost" beyond the unit and crash
//! tests. It lives beside the product, not in it.
//!
//! - [`history`]: the operations of a recorded run and their answers.
//! - [`checker`]: the linearizability checker of such histories against
//!   protocol §2's state machine.
//! - [`runner`]: records histories against the real binary, with SIGKILLs.
//! - [`failover`]: a Redis primary (a cluster's, or Sentinel's) SIGKILLed
//!   and failed over.
//! - [`delay`]: a forwarder that delays each direction of a store's traffic.
//! - [`sidecar`]: the binary as a child process, and its `/proc` figures.
//! - [`h2raw`]: HTTP/2 frames by hand, for clients that misbehave.
//! - [`hostile`]: hostile clients against a well-behaved one's latency.
//! - [`soak`]: long mixed load with churn, sampled, then checked.
//! - [`lazyfs`]: LazyFS, a file system that drops unsynced writes on command.
//! - [`powerloss`]: power cuts on LazyFS under load, then checked.

pub mod checker;
pub mod delay;
pub mod failover;
pub mod h2raw;
pub mod history;
pub mod hostile;
pub mod lazyfs;
pub mod powerloss;
pub mod runner;
pub mod sidecar;
pub mod soak;
