//! Disk faults, against the real binary. A full disk (a small tmpfs mounted
//! for the test; that needs root, as CI runs: elsewhere those tests report
//! themselves skipped, and under `CI=true` fail) must be refused before sled
//! meets it, under load too, with reads and duplicates going on and writes
//! resuming by themselves when space returns; a store that wedges anyway
//! must fail stop, and SIGTERM must end the process within the grace period
//! whatever the store does. A disk that fails, hangs or slows down — from an
//! LD_PRELOAD shim (`tests/common/faultshim.rs`) — must stop the store
//! without acknowledging anything it could not sync, and large responses
//! are synced before their answer; a read-only data directory is refused at
//! start. Whatever the fault, every commit acknowledged before it is there
//! after a restart.

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
    faultshim::{Fault, FaultyDisk},
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
    /// `None` (the test reported skipped; a failure under `CI=true`) when
    /// this process may not mount a tmpfs.
    fn mount(megabytes: u32) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m"), "tmpfs"])
            .arg(dir.path())
            .output();
        match mounted {
            Ok(output) if output.status.success() => Some(SmallDisk { dir }),
            Ok(output) => {
                dedupd_testkit::skip(&format!(
                    "mounting a tmpfs failed (it needs root, as CI runs the tests): {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
                None
            }
            Err(error) => {
                dedupd_testkit::skip(&format!("cannot run mount: {error}"));
                None
            }
        }
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

    let (mut committed, refused) = fill(&mut client, "fill").await;
    assert_eq!(refused, Code::ResourceExhausted);
    assert!(
        committed.len() > 10,
        "{} writes before the reserve",
        committed.len()
    );
    // sled compacts in the background now (the write-ahead log is the
    // durability point), so free space may rise back past the reserve a
    // moment after the refusal: write on until it stays below.
    for round in 1..=10 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if common::health_of(sidecar.addr).await == NOT_SERVING {
            break;
        }
        let (more, refused) = fill(&mut client, &format!("fill{round}")).await;
        assert_eq!(refused, Code::ResourceExhausted);
        committed.extend(more);
    }

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
    let exit = terminate(&mut sidecar, Duration::from_secs(3 + 2 + 2));
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
/// sync. A disk that stopped answering (every sync blocks) with the stall
/// timeout far away: the process is alive and a write hangs at SIGTERM, and
/// the process still ends within the grace (3 s) plus the final sync's 2 s,
/// saying it exits without that sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_even_on_a_wedged_store() {
    let disk = FaultyDisk::new();
    let mut sidecar = disk.start(&["--store-stall-timeout", "10m", "--shutdown-grace", "3s"]);
    let mut client = sidecar.client().await;
    write(&mut client, "before-the-wedge").await.unwrap();
    disk.switch_on(Fault::HangSync);
    // A write now waits for a sync that never returns: in flight at SIGTERM.
    let mut stuck = client.clone();
    let in_flight = tokio::spawn(async move { write(&mut stuck, "into-the-wedge").await });
    disk.until_tripped(Fault::HangSync).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !in_flight.is_finished(),
        "the write must hang on the wedged disk"
    );
    assert!(
        sidecar.child.try_wait().unwrap().is_none(),
        "the process must be alive at SIGTERM: {}",
        sidecar.log_text()
    );
    // The grace, the final sync's 2 s, the runtime's 1 s for blocked
    // threads, and slack.
    let (code, log) = terminate(&mut sidecar, Duration::from_secs(3 + 2 + 1 + 2));
    assert_eq!(code, Some(1), "the final sync failed: {log}");
    assert!(
        log.contains("the final store sync did not finish"),
        "the store was wedged at shutdown: {log}"
    );
    let answer = tokio::time::timeout(Duration::from_secs(5), in_flight)
        .await
        .expect("the call in flight ends with the process")
        .unwrap();
    assert!(
        answer.is_err(),
        "a write that never synced was acknowledged"
    );
}

/// A disk that stops answering (every sync blocks) with a 2 s stall
/// timeout: the write waiting for the sync is answered UNAVAILABLE soon
/// after the stall timeout — never left hanging — and the process exits
/// non-zero by itself, saying why; a restart on the healed disk finds what
/// was acknowledged before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_that_never_returns_fails_the_store_within_the_stall_timeout() {
    let disk = FaultyDisk::new();
    let mut sidecar = disk.start(&["--store-stall-timeout", "2s", "--shutdown-grace", "3s"]);
    let mut client = sidecar.client().await;
    write(&mut client, "before-the-wedge").await.unwrap();
    disk.switch_on(Fault::HangSync);
    let started = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        write(&mut client, "into-the-wedge"),
    )
    .await
    .expect("a call on a wedged store is answered, not left hanging");
    assert_eq!(answer, Err(Code::Unavailable));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "refused before the stall timeout: {:?}",
        started.elapsed()
    );
    let status = until_exit(
        &mut sidecar,
        started,
        Duration::from_secs(2 + 1 + 3 + 2 + 2),
        "a stalled store must stop the process",
    )
    .await;
    assert_eq!(status.code(), Some(1), "{}", sidecar.log_after_exit());
    let log = sidecar.log_after_exit();
    assert!(log.contains("a disk sync has run for"), "says why: {log}");
    disk.switch_off(Fault::HangSync);
    drop(sidecar);
    let restarted = Sidecar::start_with(&disk.data(), &["--shutdown-grace", "3s"]);
    every_commit_survived(&restarted, &["before-the-wedge".to_owned()]).await;
}

/// A disk whose writes stop returning, under load: sled's calls then block
/// inside the runtime's worker threads, so nothing on the runtime may be
/// able to notice. The store must still be found stalled and the process
/// end by itself, non-zero, within the stall timeout plus the grace and the
/// final sync's time; no call may be acknowledged after the disk hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_whose_writes_hang_still_ends_the_process() {
    let disk = FaultyDisk::new().pause_at_trip(TRIP_PAUSE);
    // A short grace: with every worker thread inside sled, the fail-stop
    // watchdog ends the process a grace (plus 3 s) after the stall.
    let mut sidecar = disk.start(&["--store-stall-timeout", "2s", "--shutdown-grace", "1s"]);
    let load = Load::start(sidecar.addr, "load", Some(disk.markers(Fault::HangWrite))).await;
    load.until("acknowledged 100 commits", |load| {
        load.acknowledged() >= 100
    })
    .await;
    disk.switch_on(Fault::HangWrite);
    let started = Instant::now();
    let status = until_exit(
        &mut sidecar,
        started,
        Duration::from_secs(2 + 1 + 1 + 2 + 1 + 3),
        "a store whose disk hangs must end the process",
    )
    .await;
    let exited_after = started.elapsed();
    let (acknowledged, after_fault, refusals) = load.stop().await;
    let log = sidecar.log_after_exit();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("stopped answering"), "says why: {log}");
    assert!(
        after_fault.is_empty(),
        "acknowledged after the disk hung: {after_fault:?}"
    );
    disk.switch_off(Fault::HangWrite);
    let restarted = Sidecar::start_with(&disk.data(), &["--shutdown-grace", "3s"]);
    every_commit_survived(&restarted, &acknowledged).await;
    eprintln!(
        "writes hung: exit {status} after {exited_after:?}, {} commits acknowledged before, {} calls refused",
        acknowledged.len(),
        refusals.len()
    );
}

/// Large responses are synced before their answer: once a 1 MiB commit is
/// acknowledged, the shim has seen the write-ahead log segment holding it
/// synced. sled keeps the response in a blob file of its own, which it never
/// syncs: a checkpoint (here the final one, at SIGTERM) syncs every blob file
/// and the blobs directory before the log that covered them goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_response_is_synced_before_its_answer() {
    let disk = FaultyDisk::new();
    let mut sidecar = disk.start(&["--max-response-bytes", "1048576"]);
    let mut client = sidecar.client().await;
    let response: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    claim_and_commit(&mut client, "large", response.clone())
        .await
        .expect("a 1 MiB commit");
    let synced = disk.synced_files();
    let log_dir = disk.data().join("wal");
    let holding: Vec<PathBuf> = std::fs::read_dir(&log_dir)
        .expect("the write-ahead log")
        .map(|entry| entry.unwrap().path())
        .filter(|segment| {
            let bytes = std::fs::read(segment).unwrap();
            bytes
                .windows(4096)
                .any(|window| window == &response[..4096])
        })
        .collect();
    assert_eq!(holding.len(), 1, "one segment holds the response");
    assert!(
        synced.contains(&holding[0]),
        "{} was answered unsynced; synced: {synced:?}",
        holding[0].display()
    );

    assert_eq!(terminate(&mut sidecar, Duration::from_secs(30)).0, Some(0));
    let blobs = disk.data().join("blobs");
    let present: Vec<PathBuf> = std::fs::read_dir(&blobs)
        .expect("sled wrote the response to a blob file")
        .map(|entry| entry.unwrap().path())
        .collect();
    assert!(!present.is_empty(), "sled wrote no blob file");
    let synced = disk.synced_files();
    for blob in &present {
        assert!(synced.contains(blob), "{} never synced", blob.display());
    }
    assert!(
        synced.contains(&blobs),
        "the blobs directory was not synced"
    );
    assert!(
        std::fs::read_dir(&log_dir).unwrap().next().is_none(),
        "the final checkpoint leaves no log to replay"
    );
}

/// Writers claiming and committing fresh keys (32 KiB answers) from 8 tasks
/// over 2 connections until stopped: every commit acknowledged is kept, with
/// the code and message of every refusal, and — given the markers a fault
/// leaves when it first acts — every commit acknowledged although its call
/// began after the disk failed.
struct Load {
    acknowledged: Arc<Mutex<Vec<String>>>,
    acknowledged_after_fault: Arc<Mutex<Vec<String>>>,
    refusals: Arc<Mutex<Vec<(Code, String)>>>,
    stop: Arc<AtomicBool>,
    writers: tokio::task::JoinSet<()>,
}

impl Load {
    /// `markers`: the fault's tripped and returned markers.
    async fn start(addr: SocketAddr, prefix: &str, markers: Option<(PathBuf, PathBuf)>) -> Load {
        let acknowledged = Arc::new(Mutex::new(Vec::new()));
        let acknowledged_after_fault = Arc::new(Mutex::new(Vec::new()));
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
                let (acknowledged, after_fault, refusals, stop, markers) = (
                    acknowledged.clone(),
                    acknowledged_after_fault.clone(),
                    refusals.clone(),
                    stop.clone(),
                    markers.clone(),
                );
                let prefix = format!("{prefix}-{connection}-{task}");
                writers.spawn(async move {
                    for i in 0.. {
                        if stop.load(SeqCst) {
                            return;
                        }
                        let id = format!("{prefix}-{i}");
                        let began_after_fault = markers
                            .as_ref()
                            .is_some_and(|(tripped, _)| tripped.exists());
                        let returned = markers.as_ref().map(|(_, returned)| returned.as_path());
                        let answer = tokio::time::timeout(
                            Duration::from_secs(10),
                            write_explained(&mut client, &id, returned, &after_fault),
                        )
                        .await
                        .unwrap_or_else(|_| panic!("{id}: a call hung instead of being answered"));
                        match answer {
                            Ok(()) => {
                                if began_after_fault {
                                    after_fault.lock().unwrap().push(id.clone());
                                }
                                acknowledged.lock().unwrap().push(id);
                            }
                            Err(refusal) => {
                                refusals.lock().unwrap().push(refusal);
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                    }
                });
            }
        }
        Load {
            acknowledged,
            acknowledged_after_fault,
            refusals,
            stop,
            writers,
        }
    }

    fn acknowledged(&self) -> usize {
        self.acknowledged.lock().unwrap().len()
    }

    fn refusal_codes(&self) -> Vec<Code> {
        self.refusals
            .lock()
            .unwrap()
            .iter()
            .map(|(code, _)| *code)
            .collect()
    }

    /// Waits (bounded) until `done` holds of the load.
    async fn until(&self, what: &str, done: impl Fn(&Load) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "never {what}: {} acknowledged, refusals {:?}",
                self.acknowledged(),
                self.refusals
                    .lock()
                    .unwrap()
                    .iter()
                    .take(5)
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the writers: the acknowledged commits, those acknowledged
    /// although begun after the fault, and the refusals.
    async fn stop(mut self) -> (Vec<String>, Vec<String>, Vec<(Code, String)>) {
        self.stop.store(true, SeqCst);
        while let Some(joined) = self.writers.join_next().await {
            joined.expect("a writer panicked");
        }
        let acknowledged = std::mem::take(&mut *self.acknowledged.lock().unwrap());
        let after_fault = std::mem::take(&mut *self.acknowledged_after_fault.lock().unwrap());
        let refusals = std::mem::take(&mut *self.refusals.lock().unwrap());
        (acknowledged, after_fault, refusals)
    }
}

/// How long the first call a fault acts on pauses before it fails (see the
/// shim): answers sent before the failure arrive meanwhile.
const TRIP_PAUSE: Duration = Duration::from_millis(1000);

/// Like [`write`], with the refusal's message; each call answered after
/// the first failing disk call returned (`returned` exists: see the shim)
/// is added to `late`.
async fn write_explained(
    client: &mut ClaimAndCommitClient<Channel>,
    id: &str,
    returned: Option<&Path>,
    late: &Mutex<Vec<String>>,
) -> Result<(), (Code, String)> {
    let refused = |status: tonic::Status| (status.code(), status.message().to_owned());
    let answered = |call: &str| {
        if returned.is_some_and(Path::exists) {
            late.lock().unwrap().push(format!("{id} ({call})"));
        }
    };
    let claimed = client
        .claim(common::claim_request(id))
        .await
        .map_err(refused)?
        .into_inner();
    answered("claim");
    assert_eq!(common::outcome(&claimed), pb::ClaimOutcome::Claimed, "{id}");
    client
        .commit(pb::CommitRequest {
            response: response(),
            ..common::commit_request(id, &claimed.lease_token)
        })
        .await
        .map_err(refused)?;
    answered("commit");
    Ok(())
}

/// Waits until the sidecar's process has exited, at most `bound` after
/// `started`; panics saying `what` (and the log) if it is still running.
async fn until_exit(
    sidecar: &mut Sidecar,
    started: Instant,
    bound: Duration,
    what: &str,
) -> std::process::ExitStatus {
    loop {
        if let Some(status) = sidecar.child.try_wait().unwrap() {
            return status;
        }
        assert!(started.elapsed() < bound, "{what}: {}", sidecar.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
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
    let load = Load::start(sidecar.addr, "load", None).await;
    load.until("refused a write", |load| {
        load.refusal_codes().contains(&Code::ResourceExhausted)
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
    let (acknowledged, _, refusals) = load.stop().await;
    assert!(
        refusals
            .iter()
            .all(|(code, _)| *code == Code::ResourceExhausted),
        "a full disk refuses with RESOURCE_EXHAUSTED only: {:?}",
        refusals
            .iter()
            .filter(|(code, _)| *code != Code::ResourceExhausted)
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

/// A sidecar under load on a data directory whose disk starts failing
/// (`fault`) once 100 commits are acknowledged. The store must stop
/// serving — answering at least one call with the reason (`says`) while
/// alive, then exiting, not zero, saying why — and acknowledge nothing
/// after the first failing call: no commit whose call began after it, and
/// no answer sent after it returned (the shim pauses that call
/// [`TRIP_PAUSE`], so answers sent before it arrive meanwhile). The bytes
/// of a group whose sync failed stay in the page cache, so a restart alone
/// could not tell. A restart on the healed disk finds every acknowledged
/// commit.
async fn a_failing_disk_stops_the_store(fault: Fault, says: &str) {
    a_failing_disk_stops_the_store_on(FaultyDisk::new(), fault, says).await;
}

/// [`a_failing_disk_stops_the_store`] on `disk` (whose faults may act on
/// some files only).
async fn a_failing_disk_stops_the_store_on(disk: FaultyDisk, fault: Fault, says: &str) {
    let disk = disk.pause_at_trip(TRIP_PAUSE);
    let mut sidecar = disk.start(&["--shutdown-grace", "1s", "--store-stall-timeout", "2s"]);
    let load = Load::start(sidecar.addr, "load", Some(disk.markers(fault))).await;
    load.until("acknowledged 100 commits", |load| {
        load.acknowledged() >= 100
    })
    .await;
    disk.switch_on(fault);
    let started = Instant::now();
    let status = until_exit(
        &mut sidecar,
        started,
        Duration::from_secs(30),
        "the store kept serving on a failing disk",
    )
    .await;
    let (acknowledged, mut after_fault, refusals) = load.stop().await;
    let log = sidecar.log_after_exit();
    assert_ne!(status.code(), Some(0), "{log}");
    // An answer that arrives after the first failing call returned is one
    // whose sync failed only when that call is the log's own sync: it holds
    // the committer, and answers made durable before it arrive during its
    // pause. A first failing call elsewhere (sled's blob sync, which holds
    // the lock writers frame under; sled's flusher) may delay answers made
    // durable before it past the pause: then only calls begun after the
    // fault are judged.
    let tripped_on = std::fs::read_to_string(disk.tripped_marker(fault)).unwrap_or_default();
    if !tripped_on.contains("/wal/") {
        after_fault.retain(|id| !id.ends_with(')'));
    }
    assert!(log.contains(says), "the log says why ({says}): {log}");
    assert!(disk.tripped(fault), "the fault never acted");
    // With writes refused (EROFS) a sync still works: a change written to
    // the log before the disk turned read-only is durable, and its answer
    // may leave after the failing call returned. A call begun after the
    // fault is never acknowledged.
    let wrong: Vec<&String> = after_fault
        .iter()
        .filter(|id| !(matches!(fault, Fault::ReadOnly) && id.ends_with(')')))
        .collect();
    assert!(
        wrong.is_empty(),
        "acknowledged although begun after the disk failed (the fault first acted on \
         {tripped_on:?}): {wrong:?}; the sidecar's log: {log}"
    );
    assert!(
        refusals
            .iter()
            .any(|(code, message)| *code == Code::Unavailable && message.contains(says)),
        "no call was answered with the reason while the process lived: {:?}",
        refusals.iter().take(5).collect::<Vec<_>>()
    );

    disk.switch_off(fault);
    let restarted = Sidecar::start_with(&disk.data(), &["--shutdown-grace", "3s"]);
    every_commit_survived(&restarted, &acknowledged).await;
    let mut client = restarted.client().await;
    write(&mut client, "after-the-disk-healed")
        .await
        .expect("the restarted sidecar writes");
    eprintln!(
        "{fault:?}: {} commits acknowledged, {} calls refused, exit {status}, all acknowledged there after the restart",
        acknowledged.len(),
        refusals.len()
    );
}

/// Issue 26: fdatasync fails on the write-ahead log alone (sled's files sync
/// fine): the group commit's callers are refused, the store stops for good,
/// and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_log_sync_stops_the_store_and_loses_nothing_acknowledged() {
    a_failing_disk_stops_the_store_on(
        FaultyDisk::new().only("/wal/"),
        Fault::FailDataSync,
        "disk sync failed",
    )
    .await;
}

/// Issue 16: fsync fails (EIO, as a disk that lost writes reports it). The
/// kernel may have dropped the dirty pages, so the store must not retry and
/// report success: it fails for good and the process stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fsync_stops_the_store_and_loses_nothing_acknowledged() {
    a_failing_disk_stops_the_store(Fault::FailSync, "Input/output error").await;
}

/// fsync and fdatasync fail, `sync_file_range` succeeds: whichever sync
/// meets the fault first — the group commit's, or our copy of sled's sync of
/// its log or of a blob file it writes for a large answer (issue 38) — fails
/// the store for good and refuses its callers. (The log's sync alone:
/// above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fdatasync_fails_the_group_commit_and_the_store() {
    a_failing_disk_stops_the_store(Fault::FailDataSync, "Input/output error").await;
}

/// Issue 16: the data directory turns read-only under the running process
/// (writes fail with EROFS, as after ext4 remounts itself on an error).
/// Issue 23: this used to hang callers for 30 s one run in three — sled
/// 0.34.7 does not wake a flush waiting on a log write that failed in its
/// I/O thread, and further calls could block every worker thread inside
/// sled — see `src/store/stall.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_turning_read_only_stops_the_store() {
    a_failing_disk_stops_the_store(Fault::ReadOnly, "Read-only file system").await;
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
        assert_eq!(terminate(&mut sidecar, Duration::from_secs(30)).0, Some(0));
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
