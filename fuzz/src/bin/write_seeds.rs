//! Writes [`dedupd_fuzz::seeds`] of one target into a corpus directory:
//! `write_seeds <target> <dir>` (used by `fuzz/run.sh`).

use std::{env, fs, path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    let arguments: Vec<String> = env::args().skip(1).collect();
    let [target, dir] = arguments.as_slice() else {
        eprintln!("usage: write_seeds <target> <corpus-dir>");
        return ExitCode::from(64);
    };
    let seeds = dedupd_fuzz::seeds(target);
    if seeds.is_empty() {
        eprintln!("write_seeds: no target named {target:?}");
        return ExitCode::from(64);
    }
    let dir = PathBuf::from(dir);
    if let Err(error) = fs::create_dir_all(&dir) {
        eprintln!("write_seeds: cannot create {}: {error}", dir.display());
        return ExitCode::FAILURE;
    }
    for (index, seed) in seeds.iter().enumerate() {
        let path = dir.join(format!("seed-{index}"));
        if let Err(error) = fs::write(&path, seed) {
            eprintln!("write_seeds: cannot write {}: {error}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
