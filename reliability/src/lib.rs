//! dedupd's reliability suite (issue 16): what backs "never processed
//! twice, never an acknowledged commit lost" beyond the unit and crash
//! tests. It lives beside the product, not in it.
//!
//! - [`history`]: the operations of a recorded run and their answers.
//! - [`checker`]: the linearizability checker of such histories against
//!   protocol §2's state machine.
//! - [`runner`]: records histories against the real binary, with SIGKILLs.

pub mod checker;
pub mod history;
pub mod runner;
