//! A test that cannot run on this machine returns early after one line on
//! stderr: `SKIP <test>: <why> (<n> skipped in this test binary)`. It is
//! written to the stream itself, past libtest's capture (which only takes
//! `print!`/`eprint!` output), so a plain `cargo test` shows it.
//!
//! Under `CI=true` a skip is a failure instead: CI runs where every test can
//! run, and a test that silently stops checking is worse than none.
//! `DEDUPD_TEST_REQUIRE_STORES=1` does the same for tests that skip for
//! want of PostgreSQL or Redis.

use std::{
    io::Write,
    sync::atomic::{AtomicUsize, Ordering},
};

static SKIPPED: AtomicUsize = AtomicUsize::new(0);

fn enabled(variable: &str) -> bool {
    matches!(
        std::env::var(variable)
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Ok("true" | "1" | "yes")
    )
}

/// Whether skips fail (`CI=true`).
pub fn in_ci() -> bool {
    enabled("CI")
}

/// The running test's name: libtest names each test's thread after it.
fn test_name() -> String {
    std::thread::current()
        .name()
        .filter(|name| *name != "main")
        .unwrap_or("a test")
        .to_owned()
}

/// The running test cannot run here because of `why` (which says what to
/// install or do): prints the skip line, or panics under `CI=true`. The
/// caller returns right after.
pub fn skip(why: &str) {
    if in_ci() {
        panic!(
            "{}: cannot run here: {why} (under CI=true a skip is a failure)",
            test_name()
        );
    }
    announce(why);
}

/// Like [`skip`], for a test that needs PostgreSQL or Redis: also a failure
/// under `DEDUPD_TEST_REQUIRE_STORES=1`.
pub fn skip_for_store(why: &str) {
    if enabled("DEDUPD_TEST_REQUIRE_STORES") {
        panic!(
            "{}: {why} (DEDUPD_TEST_REQUIRE_STORES=1: a missing store is a failure)",
            test_name()
        );
    }
    skip(why);
}

fn announce(why: &str) {
    let count = SKIPPED.fetch_add(1, Ordering::SeqCst) + 1;
    let line = format!(
        "SKIP {}: {why} ({count} skipped in this test binary)\n",
        test_name()
    );
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
