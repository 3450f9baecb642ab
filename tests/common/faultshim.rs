//! A data directory whose disk fails or hangs on demand: the real
//! binary run under `tests/fixtures/faultshim.c` (an LD_PRELOAD shim, built
//! once per test process with the C compiler every Rust toolchain on Linux
//! links with), which also records every file it saw synced.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
    time::Duration,
};

use super::sidecar::Sidecar;

/// The shim, built for this test process.
fn shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("faultshim-{}.so", std::process::id()));
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/faultshim.c");
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&out)
            .arg(&source)
            .arg("-ldl")
            .status()
            .expect("a C compiler (cc) for the fault shim");
        assert!(built.success(), "building {}", source.display());
        out
    })
}

/// The faults the shim knows (see tests/fixtures/faultshim.c).
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// fsync and friends fail with EIO.
    FailSync,
    /// fsync and fdatasync alone fail with EIO (`sync_file_range` does not).
    FailDataSync,
    /// Writes fail with EROFS.
    ReadOnly,
    /// fsync and friends block until the fault is switched off.
    HangSync,
    /// Writes block until the fault is switched off.
    HangWrite,
    /// unlink blocks until the fault is switched off.
    HangUnlink,
}

impl Fault {
    fn trigger(self) -> &'static str {
        match self {
            Fault::FailSync => "fault-fsync",
            Fault::FailDataSync => "fault-fdatasync",
            Fault::ReadOnly => "fault-erofs",
            Fault::HangSync => "fault-hang-sync",
            Fault::HangWrite => "fault-hang-write",
            Fault::HangUnlink => "fault-hang-unlink",
        }
    }
}

/// A temporary directory holding `data/` (the sidecar's) and the shim's
/// trigger files and sync log beside it.
pub struct FaultyDisk {
    dir: tempfile::TempDir,
    trip_pause: Option<Duration>,
    only: Option<String>,
}

impl FaultyDisk {
    pub fn new() -> FaultyDisk {
        FaultyDisk {
            dir: tempfile::tempdir().unwrap(),
            trip_pause: None,
            only: None,
        }
    }

    /// Faults act only on files whose path contains `part` (`"/wal/"`: the
    /// write-ahead log alone).
    pub fn only(mut self, part: &str) -> FaultyDisk {
        self.only = Some(part.to_owned());
        self
    }

    /// The first call a fault acts on pauses this long once the marker is
    /// written (see the shim): answers sent before it arrive meanwhile.
    pub fn pause_at_trip(mut self, pause: Duration) -> FaultyDisk {
        self.trip_pause = Some(pause);
        self
    }

    /// The sidecar's data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn sync_log(&self) -> PathBuf {
        self.dir.path().join("synced.log")
    }

    /// The binary on `data()` under the shim, with `flags`.
    pub fn start(&self, flags: &[&str]) -> Sidecar {
        let preload = format!("LD_PRELOAD={}", shim().display());
        let fault_path = format!("DEDUPD_FAULT_PATH={}", self.data().display());
        let sync_log = format!("DEDUPD_SYNC_LOG={}", self.sync_log().display());
        let pause = format!(
            "DEDUPD_FAULT_TRIP_PAUSE_MS={}",
            self.trip_pause.unwrap_or_default().as_millis()
        );
        let only = format!("DEDUPD_FAULT_MATCH={}", self.only.as_deref().unwrap_or(""));
        Sidecar::start_under(
            &["env", &preload, &fault_path, &sync_log, &pause, &only],
            &self.data(),
            flags,
        )
    }

    /// Switches `fault` on: its next call on a data file acts.
    pub fn switch_on(&self, fault: Fault) {
        std::fs::write(self.dir.path().join(fault.trigger()), b"").unwrap();
    }

    /// Switches `fault` off (a hung call goes on).
    pub fn switch_off(&self, fault: Fault) {
        std::fs::remove_file(self.trigger(fault)).unwrap();
    }

    /// The file whose existence switches `fault` on, to switch it off from
    /// another thread.
    pub fn trigger(&self, fault: Fault) -> PathBuf {
        self.dir.path().join(fault.trigger())
    }

    /// Whether `fault` has acted at least once (the shim marks it before
    /// the call returns).
    pub fn tripped(&self, fault: Fault) -> bool {
        self.dir
            .path()
            .join(format!("{}.tripped", fault.trigger()))
            .exists()
    }

    /// Waits (bounded: 10 s) until `fault` has acted.
    pub async fn until_tripped(&self, fault: Fault) {
        let started = std::time::Instant::now();
        while !self.tripped(fault) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{fault:?} never acted: no call reached the disk"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The path of the marker [`FaultyDisk::tripped`] looks at, to check
    /// from another task.
    pub fn tripped_marker(&self, fault: Fault) -> PathBuf {
        self.dir.path().join(format!("{}.tripped", fault.trigger()))
    }

    /// [`FaultyDisk::tripped_marker`] and [`FaultyDisk::returned_marker`].
    pub fn markers(&self, fault: Fault) -> (PathBuf, PathBuf) {
        (self.tripped_marker(fault), self.returned_marker(fault))
    }

    /// The marker the shim writes when the first call `fault` acted on
    /// returns, after its pause (see [`FaultyDisk::pause_at_trip`]).
    pub fn returned_marker(&self, fault: Fault) -> PathBuf {
        self.dir
            .path()
            .join(format!("{}.returned", fault.trigger()))
    }

    /// Every data file the shim saw synced successfully so far.
    pub fn synced_files(&self) -> Vec<PathBuf> {
        std::fs::read_to_string(self.sync_log())
            .unwrap_or_default()
            .lines()
            .map(PathBuf::from)
            .collect()
    }
}
