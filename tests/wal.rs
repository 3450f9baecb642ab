//! The embedded store's write-ahead log (issue 26), against the real binary
//! under the fault shim: the process is `kill -9`ed at the two moments the
//! log's design has to survive — a group written to the log but not yet
//! synced, and a checkpoint that synced sled but had not yet deleted the
//! segments it covers — and the log's tail is torn or corrupted before a
//! restart. Each time every acknowledged commit is there afterwards, with
//! its fencing token, and new tokens are above every one handed out.

mod common;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use common::{
    claim_and_commit, claim_request,
    faultshim::{Fault, FaultyDisk},
    outcome,
    sidecar::Sidecar,
};
use dedupd::proto::v1 as pb;

/// Commits `count` fresh IDs starting with `prefix`; their fencing tokens.
async fn commit_many(sidecar: &Sidecar, prefix: &str, count: usize) -> HashMap<String, u64> {
    let mut client = sidecar.client().await;
    let mut committed = HashMap::new();
    for i in 0..count {
        let id = format!("{prefix}-{i}");
        claim_and_commit(&mut client, &id, id.clone().into_bytes())
            .await
            .unwrap_or_else(|code| panic!("{id}: {code:?}"));
        let lookup = client
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        committed.insert(id, lookup.record.unwrap().fencing_token);
    }
    committed
}

/// Every commit in `committed` is a DUPLICATE with its response and token,
/// and a fresh claim's token is above all of them.
async fn all_there(sidecar: &Sidecar, committed: &HashMap<String, u64>) {
    let mut client = sidecar.client().await;
    for (id, fencing) in committed {
        let again = client.claim(claim_request(id)).await.unwrap().into_inner();
        assert_eq!(
            outcome(&again),
            pb::ClaimOutcome::Duplicate,
            "{id} was acknowledged and is lost"
        );
        assert_eq!(again.fencing_token, *fencing, "{id}");
        let record = again.record.unwrap_or_else(|| panic!("{id}: no record"));
        assert_eq!(record.response, id.as_bytes(), "{id}");
    }
    let fresh = client
        .claim(claim_request("fresh-after-restart"))
        .await
        .unwrap()
        .into_inner();
    let highest = committed.values().max().copied().unwrap_or(0);
    assert!(
        fresh.fencing_token > highest,
        "fencing went back: {} after {highest}",
        fresh.fencing_token
    );
}

fn segments(data: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(data.join("wal"))
        .map(|entries| entries.map(|entry| entry.unwrap().path()).collect())
        .unwrap_or_default();
    found.sort();
    found
}

/// A group is written to the log and its sync never returns (hung by the
/// shim, on the log alone): the process is killed there. The claims of
/// that group were never answered; everything answered before is there
/// after a restart, and the unanswered claims are either absent (claimable)
/// or held by a lease nobody got (IN_PROGRESS) — never an error, never a
/// store that will not open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_a_log_write_and_its_sync_loses_nothing_acknowledged() {
    let disk = FaultyDisk::new().only("/wal/");
    let sidecar = disk.start(&[]);
    let committed = commit_many(&sidecar, "before", 50).await;

    disk.switch_on(Fault::HangSync);
    let mut pending = Vec::new();
    for i in 0..8 {
        let mut client = sidecar.client().await;
        pending.push(tokio::spawn(async move {
            client.claim(claim_request(&format!("unsynced-{i}"))).await
        }));
    }
    disk.until_tripped(Fault::HangSync).await;
    // Let every claim reach the log (they wait for the hung sync).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        pending.iter().all(|claim| !claim.is_finished()),
        "a claim was answered although its sync never returned"
    );
    sidecar.kill_9();
    for claim in pending {
        assert!(
            claim.await.unwrap().is_err(),
            "answered by a killed process"
        );
    }
    disk.switch_off(Fault::HangSync);

    let restarted = disk.start(&[]);
    all_there(&restarted, &committed).await;
    let mut client = restarted.client().await;
    for i in 0..8 {
        let again = client
            .claim(claim_request(&format!("unsynced-{i}")))
            .await
            .unwrap()
            .into_inner();
        assert!(
            matches!(
                outcome(&again),
                pb::ClaimOutcome::Claimed | pb::ClaimOutcome::InProgress
            ),
            "unsynced-{i}: {:?}",
            outcome(&again)
        );
    }
}

/// A checkpoint flushes and syncs sled, then deletes the log segments it
/// covers; the deletion hangs (the shim) and the process is killed there.
/// The segments are replayed over the checkpointed sled at the restart —
/// a second time, harmlessly — and everything acknowledged is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_a_checkpoint_and_the_log_deletion_loses_nothing() {
    let disk = FaultyDisk::new().only("/wal/");
    let flags = ["--checkpoint-interval", "300ms"];
    let sidecar = disk.start(&flags);
    // Before the checkpoint: these are in sled's synced files and the log.
    disk.switch_on(Fault::HangUnlink);
    let mut committed = commit_many(&sidecar, "checkpointed", 100).await;
    disk.until_tripped(Fault::HangUnlink).await;
    // After it: in the next segment only.
    committed.extend(commit_many(&sidecar, "after", 50).await);
    let before_kill = segments(&disk.data());
    assert!(
        before_kill.len() >= 2,
        "the sealed segment and the next one: {before_kill:?}"
    );
    sidecar.kill_9();
    disk.switch_off(Fault::HangUnlink);

    let restarted = disk.start(&flags);
    let log = restarted.log_text();
    assert!(log.contains("replayed the write-ahead log"), "{log}");
    all_there(&restarted, &committed).await;
}

/// Writes into the last log segment, right after its last group, what
/// `tail` makes of the segment's group magic and the next group's number
/// (a segment: `dedupWAL`, the group magic u32, then groups of
/// `[magic u32][number u64][length u32][crc u32][frames]`; the
/// preallocated rest is zeros).
fn append_after_last_group(data: &Path, tail: impl Fn(u32, u64) -> Vec<u8>) {
    let last = segments(data).pop().expect("a log segment");
    let mut content = std::fs::read(&last).unwrap();
    assert!(
        content.starts_with(b"dedupWAL"),
        "a segment with group headers"
    );
    let magic = u32::from_le_bytes(content[8..12].try_into().unwrap());
    let (mut end, mut next) = (12, 0);
    while u32::from_le_bytes(content[end..end + 4].try_into().unwrap()) == magic {
        next = u64::from_le_bytes(content[end + 4..end + 12].try_into().unwrap()) + 1;
        end += 20 + u32::from_le_bytes(content[end + 12..end + 16].try_into().unwrap()) as usize;
    }
    assert!(end > 12, "the log holds groups");
    let bytes = tail(magic, next);
    content[end..end + bytes.len()].copy_from_slice(&bytes);
    std::fs::write(&last, content).unwrap();
}

/// Makes a log tail of a segment's group magic and the next group number.
type TailMaker = dyn Fn(u32, u64) -> Vec<u8>;

/// A group cut short by a power loss (a header promising more than is
/// there), or a whole group whose checksum fails, after the last good one:
/// the log ends there, the store opens, and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_or_corrupted_log_tail_is_dropped_at_recovery() {
    fn group(magic: u32, number: u64, length: u32, body: &[u8]) -> Vec<u8> {
        let mut bytes = magic.to_le_bytes().to_vec();
        bytes.extend_from_slice(&number.to_le_bytes());
        bytes.extend_from_slice(&length.to_le_bytes());
        bytes.extend_from_slice(&0xdead_beef_u32.to_le_bytes());
        bytes.extend_from_slice(body);
        bytes
    }
    let torn = |magic, next| group(magic, next, 200, &[1, 2, 3, 4, 5, 6, 7]);
    let corrupted = |magic, next| group(magic, next, 30, &[0xab; 30]);
    let tails: [(&str, &TailMaker); 2] = [("torn", &torn), ("corrupted", &corrupted)];
    for (what, tail) in tails {
        let dir = tempfile::tempdir().unwrap();
        let sidecar = Sidecar::start(dir.path());
        let committed = commit_many(&sidecar, what, 40).await;
        sidecar.kill_9();
        append_after_last_group(dir.path(), tail);

        let restarted = Sidecar::start(dir.path());
        let log = restarted.log_text();
        assert!(log.contains("torn frame"), "{what}: {log}");
        all_there(&restarted, &committed).await;
    }
}
