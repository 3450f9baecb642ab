//! The embedded store's memory against its cache setting, on the real
//! binary: reading back more stored answers than `--cache-mb` holds must
//! not keep them all in memory (issue 39; `docs/memory.md`).

mod common;

use common::sidecar::Sidecar;
use dedupd::proto::v1 as pb;

/// Answers stored, and their size: 64 MiB, eight times the cache below, in
/// sled leaves of sixteen answers (pages over 128 KiB, written as blobs).
const ANSWERS: usize = 8192;
const ANSWER_BYTES: usize = 8192;

/// Reading every stored answer once after a restart grows the sidecar by
/// about its cache, not by what it read. Before sled's cache counted a
/// blob page at its size in memory and evicted without a 16 384-access
/// lag (vendor/sled/DEDUPD.md, changes 4 and 5), the 64 MiB read here all
/// stayed resident: the growth was over 64 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_back_more_than_the_cache_holds_grows_by_the_cache() {
    let data = tempfile::tempdir().unwrap();
    let flags = ["--cache-mb", "8"];
    let sidecar = Sidecar::start_with(data.path(), &flags);
    let client = sidecar.client().await;
    let writers: Vec<_> = (0..4)
        .map(|writer| {
            let mut client = client.clone();
            tokio::spawn(async move {
                for i in (writer..ANSWERS).step_by(4) {
                    let id = format!("answer-{i:05}");
                    let claimed = client
                        .claim(pb::ClaimRequest {
                            correlation_id: id.clone(),
                            ..Default::default()
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    client
                        .commit(pb::CommitRequest {
                            correlation_id: id,
                            lease_token: claimed.lease_token,
                            response: vec![(i % 251) as u8; ANSWER_BYTES],
                            ..Default::default()
                        })
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    drop(sidecar);

    // jemalloc hands freed pages back at once: the growth measured is what
    // is held, not what the allocator keeps for reuse (its default decay
    // keeps up to about 10 s of frees resident).
    let sidecar = Sidecar::start_in_environment(
        &[],
        data.path(),
        &flags,
        &[("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0")],
    );
    let pid = sidecar.child.id();
    let mut client = sidecar.client().await;
    // The peak counts from here, not from the open (which replays the log
    // the kill left): Linux resets VmHWM to VmRSS when 5 is written here.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let before_kib = sidecar.status_kib("VmRSS");
    for i in 0..ANSWERS {
        let found = client
            .lookup(pb::LookupRequest {
                correlation_id: format!("answer-{i:05}"),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let record = found.record.expect("every answer is stored");
        assert_eq!(record.response, vec![(i % 251) as u8; ANSWER_BYTES]);
    }
    let grown_mib = (sidecar.status_kib("VmHWM").saturating_sub(before_kib)) / 1024;
    let read_mib = (ANSWERS * ANSWER_BYTES) >> 20;
    eprintln!("reading {read_mib} MiB of answers back grew the sidecar by {grown_mib} MiB");
    // The cache (8 MiB) and what its eviction lags by, with room for the
    // allocator: well under what was read.
    assert!(
        grown_mib <= 32,
        "reading {read_mib} MiB of answers back grew the sidecar by {grown_mib} MiB \
         with --cache-mb 8"
    );
}
