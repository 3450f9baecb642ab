//! `dedupd-bench`: the load generator and the no-op server dedupd is measured
//! against. It lives beside the product, not in it: the sidecar's library,
//! binary and image carry no benchmark code and no database client that only
//! the benchmark needs.
//!
//! - [`load`]: drives a workload against a target and reports figures.
//! - [`target`]: the targets (dedupd, the no-op server, Redis, PostgreSQL).
//! - [`noop`]: the dedup API answered without a store.
//! - [`otlp_sink`]: an OTLP/gRPC collector that counts spans.
//! - [`sync_floor`]: an append and its `fdatasync`, the device's floor.
//! - [`tier`]: the local tier's DUPLICATE against Redis's, without gRPC.
//! - [`upstream`]: a trivial HTTP service to put the proxy in front of.

pub mod load;
pub mod noop;
pub mod otlp_sink;
pub mod sync_floor;
pub mod target;
pub mod tier;
pub mod upstream;
