//! The fuzz checks in plain `cargo test`: every seed (valid inputs of each
//! kind, [`dedupd_fuzz::seeds`]) must pass *and be accepted*, so a change that
//! stops them decoding or validating is seen here and the fuzzer never starts
//! from refusals; every input that ever made a check fail
//! (`fuzz/regressions/<target>/`, one file per defect fixed, named after
//! what it found) must pass.

use std::{fs, path::Path};

fn inputs(kind: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(kind)
        .join(target);
    let Ok(entries) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut inputs: Vec<_> = entries
        .map(|entry| entry.expect("a readable directory").path())
        .map(|path| {
            let bytes = fs::read(&path).expect("a readable input");
            (path.display().to_string(), bytes)
        })
        .collect();
    inputs.sort();
    inputs
}

/// Runs the seeds and the regressions of `target` through `check`; returns
/// how many seeds there were.
fn replay(target: &str, check: fn(&[u8]) -> bool) -> usize {
    let seeds = dedupd_fuzz::seeds(target);
    for (index, seed) in seeds.iter().enumerate() {
        assert!(check(seed), "seed {index} of {target} is refused: {seed:?}");
    }
    for (name, bytes) in inputs("regressions", target) {
        if std::panic::catch_unwind(|| check(&bytes)).is_err() {
            panic!("{name} fails the {target} check again");
        }
    }
    seeds.len()
}

#[test]
fn record_codec_inputs_pass() {
    assert!(replay("record_codec", dedupd_fuzz::record_codec) >= 5);
}

#[test]
fn request_validation_inputs_pass() {
    assert!(replay("request_validation", dedupd_fuzz::request_validation) >= 7);
}

#[test]
fn config_parser_inputs_pass() {
    assert!(replay("config_parser", dedupd_fuzz::config_parser) >= 8);
}
