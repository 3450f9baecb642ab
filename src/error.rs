//! The one error type of dedupd and its one mapping to gRPC status codes.
//!
//! Business outcomes (DUPLICATE, IN_PROGRESS, ...) are not errors; these are
//! malformed calls and store faults. Internal faults reach the client as a
//! generic message and are logged here, once, in full.

use std::io;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::listen::out_of_descriptors;

/// One problem with one request field, named as in the proto
/// (`items[3].correlation_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// The field's path in the request.
    pub field: String,
    /// What is wrong and what is allowed.
    pub description: String,
}

impl FieldViolation {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        FieldViolation {
            field: field.into(),
            description: description.into(),
        }
    }
}

/// Everything that can go wrong in dedupd.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed or over a limit.
    #[error("invalid argument: {}", describe(.0))]
    InvalidArgument(Vec<FieldViolation>),
    /// Commit, Release or Renew with a lease token that no longer holds the key.
    #[error("lease lost for {key}")]
    LeaseLost {
        /// The key, as `namespace/correlation_id`.
        key: String,
    },
    /// The disk is full: nothing was written.
    #[error("disk full: {0}")]
    DiskFull(#[source] io::Error),
    /// A resource other than disk space ran short (file descriptors); the
    /// change may be applied but is not yet durable: retry.
    #[error("resources exhausted: {0}")]
    Exhausted(String),
    /// The store cannot serve right now (failed sync, shutting down).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// An I/O fault in the store.
    #[error("store I/O error: {0}")]
    Io(#[source] io::Error),
    /// The store reported a fault of its own.
    #[error("store error: {0}")]
    Store(String),
    /// The gRPC server itself failed (bind, transport, reflection set-up).
    #[error("server error: {0}")]
    Server(String),
    /// A stored record could not be decoded.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// A stored answer is sealed with a key this sidecar does not have
    /// (not mounted yet, removed too early, a wrong Secret): the record is
    /// sound, the configuration is not. Answered UNAVAILABLE naming the key
    /// (an ID, not a secret), so a consumer redelivers later and the proxy
    /// does not forward; not retried inside the call.
    #[error("{0}")]
    KeyNotConfigured(String),
    /// The call cannot be made in this configuration (rekey without a
    /// sealing key).
    #[error("{0}")]
    FailedPrecondition(String),
}

fn describe(violations: &[FieldViolation]) -> String {
    violations
        .iter()
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect::<Vec<_>>()
        .join("; ")
}

impl From<io::Error> for Error {
    fn from(error: io::Error) -> Self {
        if error.kind() == io::ErrorKind::StorageFull {
            Error::DiskFull(error)
        } else if out_of_descriptors(&error) {
            // Opening or listing a file failed for want of descriptors (too
            // many connections): an overload that passes, not a broken disk.
            Error::Exhausted(format!("out of file descriptors ({error}); retry"))
        } else {
            Error::Io(error)
        }
    }
}

impl Error {
    /// Whether the same call may succeed if made again shortly: the store
    /// was unavailable, slow or short of a resource. A lost lease, a bad
    /// request or a damaged record stay as they are.
    pub fn may_pass(&self) -> bool {
        match self {
            Error::DiskFull(_)
            | Error::Exhausted(_)
            | Error::Unavailable(_)
            | Error::Io(_)
            | Error::Store(_) => true,
            Error::InvalidArgument(_)
            | Error::LeaseLost { .. }
            | Error::Server(_)
            | Error::Corrupt(_)
            | Error::KeyNotConfigured(_)
            | Error::FailedPrecondition(_) => false,
        }
    }
}

/// The reason in the `google.rpc.ErrorInfo` of a lost lease.
pub const LEASE_LOST_REASON: &str = "LEASE_LOST";
/// The domain in dedupd's `google.rpc.ErrorInfo` details.
pub const ERROR_DOMAIN: &str = "dedupd.io";

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        match error {
            Error::InvalidArgument(violations) => {
                let message = describe(&violations);
                let mut details = ErrorDetails::new();
                for violation in violations {
                    details.add_bad_request_violation(violation.field, violation.description);
                }
                Status::with_error_details(Code::InvalidArgument, message, details)
            }
            Error::LeaseLost { key } => {
                let details = ErrorDetails::with_error_info(
                    LEASE_LOST_REASON,
                    ERROR_DOMAIN,
                    [("key".to_owned(), key.clone())],
                );
                Status::with_error_details(
                    Code::FailedPrecondition,
                    format!("LEASE_LOST: the lease token no longer holds {key}"),
                    details,
                )
            }
            Error::DiskFull(source) => {
                tracing::error!(error = %source, "disk full");
                Status::resource_exhausted("disk full: the change was not stored")
            }
            Error::Exhausted(reason) => {
                tracing::warn!(%reason, "resources exhausted");
                Status::resource_exhausted(reason)
            }
            Error::Unavailable(reason) => {
                tracing::warn!(%reason, "store unavailable");
                Status::unavailable(format!("store unavailable: {reason}"))
            }
            Error::KeyNotConfigured(reason) => {
                tracing::warn!(%reason, "a stored answer's key is not configured");
                Status::unavailable(reason)
            }
            Error::FailedPrecondition(reason) => Status::failed_precondition(reason),
            error @ (Error::Io(_) | Error::Store(_) | Error::Server(_) | Error::Corrupt(_)) => {
                tracing::error!(%error, "internal error");
                Status::internal("internal error (logged by the sidecar)")
            }
        }
    }
}
