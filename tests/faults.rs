//! Disk faults, against the real binary. A full disk (a small tmpfs mounted
//! for the test; CI runs as root, elsewhere those tests say they need root
//! and stop) must be refused before sled meets it, under load too, with
//! reads and duplicates going on and writes resuming by themselves when
//! space returns; a store that wedges anyway must fail stop, and SIGTERM
//! must end the process within the grace period whatever the store does.
//! A disk that fails — fsync returning EIO, writes returning EROFS, from an
//! LD_PRELOAD shim (`tests/fixtures/faultshim.c`) — must stop the store; a
//! read-only data directory is refused at start. Whatever the fault, every
//! commit acknowledged before it is there after a restart.

mod common;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc, Mutex,
    },
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

/// Writers claiming and committing fresh keys (32 KiB answers) from 8 tasks
/// over 2 connections until stopped: every commit acknowledged is kept, with
/// the code of every refusal.
struct Load {
    acknowledged: Arc<Mutex<Vec<String>>>,
    refusals: Arc<Mutex<Vec<Code>>>,
    stop: Arc<AtomicBool>,
    writers: tokio::task::JoinSet<()>,
}

impl Load {
    async fn start(addr: SocketAddr, prefix: &str) -> Load {
        let acknowledged = Arc::new(Mutex::new(Vec::new()));
        let refusals = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = tokio::task::JoinSet::new();
        for connection in 0..2 {
            let channel = Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .expect("connect");
            for task in 0..4 {
                let mut client = ClaimAndCommitClient::new(channel.clone());
                let (acknowledged, refusals, stop) =
                    (acknowledged.clone(), refusals.clone(), stop.clone());
                let prefix = format!("{prefix}-{connection}-{task}");
                writers.spawn(async move {
                    for i in 0.. {
                        if stop.load(SeqCst) {
                            return;
                        }
                        let id = format!("{prefix}-{i}");
                        let answer =
                            tokio::time::timeout(Duration::from_secs(10), write(&mut client, &id))
                                .await
                                .unwrap_or_else(|_| {
                                    panic!("{id}: a call hung instead of being answered")
                                });
                        match answer {
                            Ok(()) => acknowledged.lock().unwrap().push(id),
                            Err(code) => {
                                refusals.lock().unwrap().push(code);
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                    }
                });
            }
        }
        Load {
            acknowledged,
            refusals,
            stop,
            writers,
        }
    }

    fn acknowledged(&self) -> usize {
        self.acknowledged.lock().unwrap().len()
    }

    fn refusals(&self) -> Vec<Code> {
        self.refusals.lock().unwrap().clone()
    }

    /// Waits (bounded) until `done` holds of the load.
    async fn until(&self, what: &str, done: impl Fn(&Load) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "never {what}: {} acknowledged, refusals {:?}",
                self.acknowledged(),
                self.refusals().iter().take(5).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the writers; the acknowledged commits and the refusals.
    async fn stop(mut self) -> (Vec<String>, Vec<Code>) {
        self.stop.store(true, SeqCst);
        while let Some(joined) = self.writers.join_next().await {
            joined.expect("a writer panicked");
        }
        let acknowledged = std::mem::take(&mut *self.acknowledged.lock().unwrap());
        (acknowledged, self.refusals())
    }
}

/// After a restart, every acknowledged commit must answer DUPLICATE.
async fn every_commit_survived(sidecar: &Sidecar, acknowledged: &[String]) {
    let mut client = sidecar.client().await;
    for id in acknowledged {
        let again = client
            .claim(common::claim_request(id))
            .await
            .unwrap_or_else(|status| panic!("{id} after the restart: {status}"))
            .into_inner();
        assert_eq!(
            common::outcome(&again),
            pb::ClaimOutcome::Duplicate,
            "{id} was acknowledged as committed, and is not after the restart"
        );
    }
}

/// Issue 16: the disk fills *under load* (8 writers). Writes are refused with
/// RESOURCE_EXHAUSTED and nothing else, reads and duplicates go on, writes
/// resume by themselves once space returns — and after a SIGKILL and a
/// restart every commit that was ever acknowledged is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filled_under_load_loses_no_acknowledged_commit() {
    let Some(disk) = SmallDisk::mount(24) else {
        return;
    };
    let ballast = disk.path().join("ballast");
    std::fs::write(&ballast, vec![0u8; 8 << 20]).unwrap();
    let flags = ["--disk-reserve-mb", "6", "--shutdown-grace", "3s"];
    let sidecar = Sidecar::start_with(&disk.data(), &flags);
    let load = Load::start(sidecar.addr, "load").await;
    load.until("refused a write", |load| {
        load.refusals().contains(&Code::ResourceExhausted)
    })
    .await;
    // The writers keep pressing on the full disk for a while.
    tokio::time::sleep(Duration::from_millis(500)).await;
    until_health(sidecar.addr, NOT_SERVING).await;
    let mut client = sidecar.client().await;
    let first = load.acknowledged.lock().unwrap()[0].clone();
    let again = client
        .claim(common::claim_request(&first))
        .await
        .expect("duplicates are answered on a full disk")
        .into_inner();
    assert_eq!(common::outcome(&again), pb::ClaimOutcome::Duplicate);

    // Health turns SERVING again (a_full_disk_refuses_writes_and_recovers_by_itself
    // sees it), but 8 writers fill the space given back again within a health
    // tick: the writes going through are what is checked.
    std::fs::remove_file(&ballast).unwrap();
    let before = load.acknowledged();
    load.until("wrote again once space returned", |load| {
        load.acknowledged() > before + 50
    })
    .await;
    let (acknowledged, refusals) = load.stop().await;
    assert!(
        refusals.iter().all(|code| *code == Code::ResourceExhausted),
        "a full disk refuses with RESOURCE_EXHAUSTED only: {:?}",
        refusals
            .iter()
            .filter(|code| **code != Code::ResourceExhausted)
            .take(5)
            .collect::<Vec<_>>()
    );
    sidecar.kill_9();
    let restarted = Sidecar::start_with(&disk.data(), &flags);
    every_commit_survived(&restarted, &acknowledged).await;
    eprintln!(
        "disk full under load: {} commits acknowledged, {} writes refused, all {} there after SIGKILL + restart",
        acknowledged.len(),
        refusals.len(),
        acknowledged.len()
    );
}

/// The fault shim (tests/fixtures/faultshim.c) built for this test run.
fn fault_shim() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("faultshim.so");
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
}

/// A sidecar under load on a data directory whose disk starts failing
/// (`fault`: the shim's trigger file) once 100 commits are acknowledged.
/// The store must stop serving — the process exits, not zero, saying why —
/// and a restart on the healed disk must find every acknowledged commit.
async fn a_failing_disk_stops_the_store(fault: &str, says: &str) {
    let shim = fault_shim();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let preload = format!("LD_PRELOAD={}", shim.display());
    let fault_path = format!("DEDUPD_FAULT_PATH={}", data.display());
    let mut sidecar = Sidecar::start_under(
        &["env", &preload, &fault_path],
        &data,
        &["--shutdown-grace", "3s"],
    );
    let load = Load::start(sidecar.addr, "load").await;
    load.until("acknowledged 100 commits", |load| {
        load.acknowledged() >= 100
    })
    .await;
    let trigger = dir.path().join(fault);
    std::fs::write(&trigger, b"").unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = sidecar.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the store kept serving on a failing disk: {}",
            sidecar.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (acknowledged, refusals) = load.stop().await;
    assert_ne!(status.code(), Some(0), "{}", sidecar.log_text());
    let log = sidecar.log_text();
    assert!(log.contains(says), "the log says why ({says}): {log}");
    assert!(!refusals.is_empty(), "no call met the failing disk");

    std::fs::remove_file(&trigger).unwrap();
    let restarted = Sidecar::start_with(&data, &["--shutdown-grace", "3s"]);
    every_commit_survived(&restarted, &acknowledged).await;
    let mut client = restarted.client().await;
    write(&mut client, "after-the-disk-healed")
        .await
        .expect("the restarted sidecar writes");
    eprintln!(
        "{fault}: {} commits acknowledged, {} calls refused, exit {status}, all acknowledged there after the restart",
        acknowledged.len(),
        refusals.len()
    );
}

/// Issue 16: fsync fails (EIO, as a disk that lost writes reports it). The
/// kernel may have dropped the dirty pages, so the store must not retry and
/// report success: it fails for good and the process stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fsync_stops_the_store_and_loses_nothing_acknowledged() {
    a_failing_disk_stops_the_store("fault-fsync", "disk sync failed").await;
}

/// Issue 16: the data directory turns read-only under the running process
/// (writes fail with EROFS, as after ext4 remounts itself on an error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_turning_read_only_stops_the_store() {
    a_failing_disk_stops_the_store("fault-erofs", "Read-only file system").await;
}

/// Issue 16: a data directory that is read-only from the start (a read-only
/// bind mount, fresh or holding records) is refused at start with a line
/// saying so, before anything is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_data_directory_is_refused_at_start() {
    // Above the default 64 MiB disk reserve: only what is written takes memory.
    let Some(disk) = SmallDisk::mount(96) else {
        return;
    };
    let fresh = disk.path().join("fresh");
    let used = disk.path().join("used");
    std::fs::create_dir_all(&fresh).unwrap();
    {
        let mut sidecar = Sidecar::start(&used);
        let mut client = sidecar.client().await;
        write(&mut client, "kept").await.unwrap();
        assert_eq!(terminate(&mut sidecar).0, Some(0));
    }
    for dir in [&fresh, &used] {
        let read_only = disk
            .path()
            .join(format!("ro-{}", dir.file_name().unwrap().to_string_lossy()));
        std::fs::create_dir_all(&read_only).unwrap();
        let _unmount = BindMount::read_only(dir, &read_only);
        let ready = disk.path().join("ready.json");
        let output = Command::new(common::sidecar::BINARY)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(&read_only)
            .arg("--ready-file")
            .arg(&ready)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("Read-only file system"),
            "says why: {stderr}"
        );
        assert!(!ready.exists(), "it must not have served");
    }
    // The records are still there once the directory is writable again.
    let sidecar = Sidecar::start(&used);
    every_commit_survived(&sidecar, &["kept".to_owned()]).await;
}

/// `source` bind-mounted read-only on `target`, unmounted when dropped.
struct BindMount(PathBuf);

impl BindMount {
    fn read_only(source: &Path, target: &Path) -> BindMount {
        for args in [
            vec!["--bind".as_ref(), source.as_os_str(), target.as_os_str()],
            vec![
                "-o".as_ref(),
                "remount,bind,ro".as_ref(),
                target.as_os_str(),
            ],
        ] {
            let status = Command::new("mount").args(args).status().unwrap();
            assert!(status.success(), "mount {}", target.display());
        }
        BindMount(target.to_owned())
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}
