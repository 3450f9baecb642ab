//! Test-only helpers shared by the workspace's test suites (dedupd's
//! `tests/`, the benchmark's smoke test), so `cargo test --workspace` runs
//! on any machine with Rust:
//!
//! - [`services`]: the PostgreSQL and Redis a test talks to. In order: the
//!   URL in `DEDUPD_TEST_POSTGRES_URL` / `DEDUPD_TEST_REDIS_URL` (it must
//!   answer: a URL given and silent is an error, never a skip); else the
//!   machine's service where the harness looks for it
//!   (`DEDUPD_TEST_POSTGRES_DEFAULT_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/test`;
//!   `DEDUPD_TEST_REDIS_DEFAULT_URL`, default `redis://127.0.0.1:6379`) if
//!   it answers; else a throwaway server started for this test process from
//!   the binaries found (`initdb` and `postgres` on `PATH` or under
//!   `/usr/lib/postgresql/*/bin`, `redis-server` on `PATH`;
//!   `DEDUPD_TEST_STORE_BINARIES` replaces those places), in a temporary
//!   directory on a free port and gone when the process ends; else none,
//!   and the test skips.
//! - [`skip`]: the one way a test that cannot run here says so — one line
//!   past the harness's output capture — and, under `CI=true` (or, for a
//!   missing store, `DEDUPD_TEST_REQUIRE_STORES=1`), fails instead.

pub mod services;
pub mod skip;

pub use services::{postgres, redis, redis_cluster, Service};
pub use skip::{skip, skip_for_store};
