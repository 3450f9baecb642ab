//! A full disk, against the real binary on a small tmpfs mounted for the
//! test (CI runs as root; elsewhere these tests say they need root and stop).
//! A full disk must be refused before sled meets it, reads and duplicates
//! must go on, writes must resume by themselves when space returns, and a
//! store that wedges anyway must fail stop — and SIGTERM must end the process
//! within the grace period whatever the store does.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::{
    claim_and_commit,
    sidecar::{terminate, Sidecar},
    until_health, NOT_SERVING, SERVING,
};
use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};
use tonic::{transport::Channel, Code};

/// A tmpfs of `megabytes` MiB mounted on a fresh directory, unmounted when
/// dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// `None` when this process may not mount (not root).
    fn mount(megabytes: u32) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|status| status.success());
        if !mounted {
            eprintln!("skipped: mounting a tmpfs needs root (CI runs as root)");
            return None;
        }
        Some(SmallDisk { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn data(&self) -> PathBuf {
        self.path().join("data")
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// 32 KiB, as the probe used.
fn response() -> Vec<u8> {
    (0..32 * 1024u32).map(|i| (i % 251) as u8).collect()
}

/// Claims and commits `id` with a 32 KiB response; the error code of the
/// first call that fails.
async fn write(client: &mut ClaimAndCommitClient<Channel>, id: &str) -> Result<(), Code> {
    claim_and_commit(client, id, response()).await
}

/// Writes until a write is refused; returns the IDs that were committed.
async fn fill(client: &mut ClaimAndCommitClient<Channel>, prefix: &str) -> (Vec<String>, Code) {
    let mut committed = Vec::new();
    for i in 0..5000 {
        let id = format!("{prefix}-{i}");
        let answer = tokio::time::timeout(Duration::from_secs(10), write(client, &id))
            .await
            .unwrap_or_else(|_| panic!("{id}: a write hung instead of being refused"));
        match answer {
            Ok(()) => committed.push(id),
            Err(code) => return (committed, code),
        }
    }
    panic!("the disk never filled");
}

/// Defect 1: a full disk used to wedge the store (every later call hung,
/// health said SERVING). With a reserve, writes are refused first, reads and
/// duplicates go on, health says NOT_SERVING, and once space returns writes
/// resume without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_and_recovers_by_itself() {
    let Some(disk) = SmallDisk::mount(24) else {
        return;
    };
    // Room to give back later.
    let ballast = disk.path().join("ballast");
    std::fs::write(&ballast, vec![0u8; 8 << 20]).unwrap();
    let data = disk.data();
    let mut sidecar =
        Sidecar::start_with(&data, &["--disk-reserve-mb", "6", "--shutdown-grace", "3s"]);
    let mut client = sidecar.client().await;

    let (committed, refused) = fill(&mut client, "fill").await;
    assert_eq!(refused, Code::ResourceExhausted);
    assert!(
        committed.len() > 10,
        "{} writes before the reserve",
        committed.len()
    );

    // Reads and duplicates are unaffected.
    let first = &committed[0];
    let lookup = client
        .lookup(pb::LookupRequest {
            namespace: String::new(),
            correlation_id: first.clone(),
        })
        .await
        .expect("reads work on a full disk")
        .into_inner();
    assert!(lookup.found);
    let again = client
        .claim(pb::ClaimRequest {
            correlation_id: first.clone(),
            ..Default::default()
        })
        .await
        .expect("duplicates are answered on a full disk")
        .into_inner();
    assert_eq!(again.outcome, pb::ClaimOutcome::Duplicate as i32);
    until_health(sidecar.addr, NOT_SERVING).await;
    let log = sidecar.log_text();
    assert!(log.contains("disk-reserve"), "health says why: {log}");

    // Space returns: writes resume by themselves.
    std::fs::remove_file(&ballast).unwrap();
    until_health(sidecar.addr, SERVING).await;
    write(&mut client, "after-space-returned")
        .await
        .expect("writes resume without a restart");

    // And the process still stops cleanly within its grace.
    let exit = terminate(&mut sidecar);
    assert_eq!(exit.0, Some(0), "{}", exit.1);
}

/// A sidecar on an 8 MiB tmpfs with the disk reserve off, filled until a
/// write fails, so sled has met the full disk; `None` without root. Also
/// the IDs committed before.
async fn wedged(
    stall_timeout: &str,
) -> Option<(
    SmallDisk,
    Sidecar,
    ClaimAndCommitClient<Channel>,
    Vec<String>,
)> {
    let disk = SmallDisk::mount(8)?;
    let sidecar = Sidecar::start_with(
        &disk.data(),
        &[
            "--disk-reserve-mb",
            "0",
            "--store-stall-timeout",
            stall_timeout,
            "--shutdown-grace",
            "3s",
            "--request-timeout",
            "30s",
        ],
    );
    let mut client = sidecar.client().await;
    let (committed, _) = fill(&mut client, "wedge").await;
    Some((disk, sidecar, client, committed))
}

/// Defects 1 and 2 without the reserve: sled meets the full disk and its
/// flush never returns. The store must fail stop — callers answered, health
/// NOT_SERVING, the process gone within the grace so it is restarted — and
/// never hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_store_fails_stop_and_the_process_exits() {
    let Some((_disk, mut sidecar, mut client, committed)) = wedged("2s").await else {
        return;
    };
    // Whatever sled does next, every call is answered (no hang) and the
    // process ends by itself, not zero.
    for id in committed.iter().take(3) {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            client.lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: id.clone(),
            }),
        )
        .await
        .expect("a call on a wedged store is answered, not left hanging");
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = sidecar.child.try_wait().unwrap() {
            break status;
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            write(
                &mut client,
                &format!("poke-{}", started.elapsed().as_millis()),
            ),
        )
        .await;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a wedged store must stop the process: {}",
            sidecar.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_ne!(status.code(), Some(0), "{}", sidecar.log_text());
    let log = sidecar.log_text();
    assert!(
        log.contains("the store failed") || log.contains("disk sync failed"),
        "{log}"
    );
}

/// Defect 2: SIGTERM on a wedged store used to wait forever for the final
/// sync. It ends within the grace (plus the final sync's 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_even_on_a_wedged_store() {
    let Some((_disk, mut sidecar, client, _)) = wedged("10m").await else {
        return;
    };
    // A call that may hang on the wedged store, in flight during SIGTERM.
    let mut stuck = client.clone();
    tokio::spawn(async move {
        let _ = stuck
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: "wedge-0".into(),
            })
            .await;
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (code, log) = terminate(&mut sidecar);
    assert!(code.is_some(), "exited by itself: {log}");
}
