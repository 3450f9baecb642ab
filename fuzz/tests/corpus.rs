//! The fuzz checks in plain `cargo test`: every seed (valid inputs of each
//! kind, [`dedupd_fuzz::seeds`]) must pass *and be accepted*, so a change that
//! stops them decoding or validating is seen here and the fuzzer never starts
//! from refusals. Every file of `fuzz/regressions/<target>/` must pass its
//! check without a panic and keep its verdict: `accepted-*` accepted,
//! `refused-*` refused (boundary inputs: over a limit, not UTF-8, truncated);
//! an input that ever made a check fail goes there too, named after what it
//! found. The folder must exist and hold inputs: a missing or misspelt one
//! is a failure, not an empty replay.

use std::{fs, path::Path};

fn regressions(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("regressions")
        .join(target);
    let entries = fs::read_dir(&dir).unwrap_or_else(|error| panic!("{}: {error}", dir.display()));
    let mut inputs: Vec<_> = entries
        .map(|entry| entry.expect("a readable directory").path())
        .map(|path| {
            let bytes = fs::read(&path).expect("a readable input");
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, bytes)
        })
        .collect();
    assert!(!inputs.is_empty(), "{} holds no inputs", dir.display());
    inputs.sort();
    inputs
}

/// Runs the seeds and the regressions of `target` through `check`; returns
/// how many seeds there were and how many regression inputs.
fn replay(target: &str, check: fn(&[u8]) -> bool) -> (usize, usize) {
    let seeds = dedupd_fuzz::seeds(target);
    for (index, seed) in seeds.iter().enumerate() {
        assert!(check(seed), "seed {index} of {target} is refused: {seed:?}");
    }
    let regressions = regressions(target);
    for (name, bytes) in &regressions {
        let verdict = std::panic::catch_unwind(|| check(bytes)).unwrap_or_else(|_| {
            panic!("regressions/{target}/{name} fails the {target} check again")
        });
        if name.starts_with("accepted-") {
            assert!(verdict, "regressions/{target}/{name} is refused");
        }
        if name.starts_with("refused-") {
            assert!(!verdict, "regressions/{target}/{name} is accepted");
        }
    }
    (seeds.len(), regressions.len())
}

#[test]
fn record_codec_inputs_pass() {
    let (seeds, regressions) = replay("record_codec", dedupd_fuzz::record_codec);
    assert!(
        seeds >= 5 && regressions >= 3,
        "{seeds} seeds, {regressions} regressions"
    );
}

#[test]
fn request_validation_inputs_pass() {
    let (seeds, regressions) = replay("request_validation", dedupd_fuzz::request_validation);
    assert!(
        seeds >= 7 && regressions >= 7,
        "{seeds} seeds, {regressions} regressions"
    );
}

#[test]
fn config_parser_inputs_pass() {
    let (seeds, regressions) = replay("config_parser", dedupd_fuzz::config_parser);
    assert!(
        seeds >= 8 && regressions >= 5,
        "{seeds} seeds, {regressions} regressions"
    );
}
