//! Several sidecars — the real binary — over the machine's PostgreSQL and
//! Redis, under the faults a cluster sees (issue 24): pods whose clocks
//! disagree by more than a lease, a store that goes silent, a Redis that may
//! evict keys or lose writes in a failover, a PostgreSQL sequence that goes
//! back. Every test targets loopback and is bounded in time.

use std::{
    ffi::OsString,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

mod common;

use common::{
    claim,
    forwarder::Forwarder,
    health_of, outcome, postgres, redis, seconds,
    sidecar::{Sidecar, BINARY},
    NOT_SERVING, SERVING,
};
use dedupd::proto::v1 as pb;

/// A space of its own on one of the machine's shared stores.
enum Space {
    Postgres(String),
    Redis(String),
}

impl Space {
    fn postgres() -> Option<Space> {
        postgres::available().then(|| Space::Postgres(postgres::fresh_schema()))
    }

    fn redis() -> Option<Space> {
        redis::available().then(|| Space::Redis(redis::fresh_prefix()))
    }

    /// The flags that put a sidecar on this space, reached at `url`.
    fn flags_via(&self, url: &str) -> Vec<String> {
        let (kind, schema) = match self {
            Space::Postgres(schema) => ("postgres", schema),
            Space::Redis(prefix) => ("redis", prefix),
        };
        [
            "--store",
            kind,
            "--store-url",
            url,
            "--store-schema",
            schema,
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn flags(&self) -> Vec<String> {
        match self {
            Space::Postgres(_) => self.flags_via(postgres::url()),
            Space::Redis(_) => self.flags_via(redis::url()),
        }
    }

    fn port(&self) -> u16 {
        match self {
            Space::Postgres(_) => postgres::port(),
            Space::Redis(_) => redis::port(),
        }
    }

    fn url_via(&self, port: u16) -> String {
        match self {
            Space::Postgres(_) => postgres::url_via(port),
            Space::Redis(_) => redis::url_via(port),
        }
    }

    async fn remove(&self) {
        match self {
            Space::Postgres(schema) => postgres::drop_schema(schema).await,
            Space::Redis(prefix) => redis::drop_prefix(prefix).await,
        }
    }
}

fn strings(flags: &[&str]) -> Vec<String> {
    flags.iter().map(|flag| (*flag).to_owned()).collect()
}

/// Starts the binary with `flags` (and `launcher` in front, e.g. faketime's
/// environment) and waits until it is SERVING: on a shared store that takes
/// its first reading of the store's clock.
async fn serving(launcher: &[&str], dir: &Path, flags: &[String]) -> Sidecar {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let sidecar = Sidecar::start_under(launcher, dir, &flags);
    let started = Instant::now();
    while health_of(sidecar.addr).await != SERVING {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "not SERVING within 15 s: {}",
            sidecar.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sidecar
}

/// libfaketime, from Debian's `faketime` package (`.ci/run` installs it);
/// `None` (the test skipped) where it is missing.
fn libfaketime() -> Option<PathBuf> {
    let found = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|path| path.exists());
    if found.is_none() {
        dedupd_testkit::skip::skip("libfaketime is missing: apt-get install faketime");
    }
    found
}

fn claim_for(id: &str, lease: i64, retention: i64) -> pb::ClaimRequest {
    pb::ClaimRequest {
        correlation_id: id.to_owned(),
        event_type: "PaymentReceived".into(),
        lease_ttl: seconds(lease),
        retention: seconds(retention),
        ..Default::default()
    }
}

/// Two sidecars over one store, the second one's wall clock 40 s ahead (then
/// stepped to 40 s behind while running): more than a lease. A lease granted
/// through either is held through the other, a retention committed through
/// one is not cut short by the other's reaper, and leases still end — by the
/// store's clock.
async fn clocks_that_disagree_change_nothing(space: Space) {
    let Some(faketime) = libfaketime() else {
        return;
    };
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut flags = space.flags();
    // Each reaper runs often: a wrong clock would show within the test.
    flags.extend(strings(&["--reaper-interval", "1s"]));
    let a = serving(&[], dir_a.path(), &flags).await;
    // libfaketime reads the offset from this file (uncached): the test can
    // step the clock of the running process.
    let offset_file = dir_b.path().join("faketime");
    std::fs::write(&offset_file, "+40s\n").unwrap();
    let environment = [
        "env".to_owned(),
        format!("LD_PRELOAD={}", faketime.display()),
        format!("FAKETIME_TIMESTAMP_FILE={}", offset_file.display()),
        "FAKETIME_NO_CACHE=1".to_owned(),
        "DONT_FAKE_MONOTONIC=1".to_owned(),
    ];
    let launcher: Vec<&str> = environment.iter().map(String::as_str).collect();
    let b = serving(&launcher, dir_b.path(), &flags).await;
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);

    // The skew is real: each sidecar measures its own clock against the
    // store's.
    async fn offset(sidecar: &Sidecar) -> Option<f64> {
        sidecar.metric("dedupd_store_clock_offset_seconds").await
    }
    let ahead = offset(&b).await.expect("B reports its clock offset");
    assert!((38.0..42.0).contains(&ahead), "B is {ahead} s ahead");
    let level = offset(&a).await.expect("A reports its clock offset");
    assert!(level.abs() < 2.0, "A is {level} s off");

    // A 30 s lease through A is held through B, and the other way round.
    let through_a = claim(&mut on_a, claim_for("lease-a", 30, 3600)).await;
    assert_eq!(outcome(&through_a), pb::ClaimOutcome::Claimed);
    let seen_by_b = claim(&mut on_b, claim_for("lease-a", 30, 3600)).await;
    assert_eq!(
        outcome(&seen_by_b),
        pb::ClaimOutcome::InProgress,
        "the fast pod granted a live lease again: {seen_by_b:?}"
    );
    let through_b = claim(&mut on_b, claim_for("lease-b", 30, 3600)).await;
    assert_eq!(outcome(&through_b), pb::ClaimOutcome::Claimed);
    // The lease's end is the store's: B's answer does not run 40 s late.
    let lease_end = through_b.lease_expires_at.as_ref().unwrap().seconds;
    let store_now = through_a.lease_expires_at.as_ref().unwrap().seconds - 30;
    assert!(
        (lease_end - 30 - store_now).abs() <= 5,
        "B's lease ends at {lease_end}, the store's now is about {store_now}"
    );
    let seen_by_a = claim(&mut on_a, claim_for("lease-b", 30, 3600)).await;
    assert_eq!(outcome(&seen_by_a), pb::ClaimOutcome::InProgress);

    // A 30 s retention committed through A outlives B's reaper passes.
    let kept = claim(&mut on_a, claim_for("kept", 30, 30)).await;
    on_a.commit(pb::CommitRequest {
        correlation_id: "kept".into(),
        lease_token: kept.lease_token.clone(),
        response: b"receipt-1".to_vec(),
        ..Default::default()
    })
    .await
    .expect("commit");
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (pod, client) in [("B", &mut on_b), ("A", &mut on_a)] {
        let again = claim(client, claim_for("kept", 30, 30)).await;
        assert_eq!(
            outcome(&again),
            pb::ClaimOutcome::Duplicate,
            "{pod}: a 3-second-old commit with a 30 s retention is gone: {again:?}"
        );
        assert_eq!(
            again
                .record
                .as_ref()
                .map(|record| record.response.as_slice()),
            Some(&b"receipt-1"[..])
        );
    }

    // B's clock steps to 40 s behind while it runs: nothing changes, and
    // the step is reported.
    std::fs::write(&offset_file, "-40s\n").unwrap();
    let stepped = Instant::now();
    loop {
        let behind = offset(&b).await.unwrap_or_default();
        if behind < -38.0 {
            break;
        }
        assert!(
            stepped.elapsed() < Duration::from_secs(10),
            "the step never showed: offset {behind}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        b.log_text().contains("wall clock stepped"),
        "the step is logged: {}",
        b.log_text()
    );
    let still_held = claim(&mut on_b, claim_for("lease-a", 30, 3600)).await;
    assert_eq!(outcome(&still_held), pb::ClaimOutcome::InProgress);

    // Leases still end, by the store's clock: a 2 s lease through A is
    // recovered through the slow pod B once it ended, not before (asked
    // until it is, however slow the machine: IN_PROGRESS changes nothing).
    let sent = Instant::now();
    let short = claim(&mut on_a, claim_for("short", 2, 3600)).await;
    assert_eq!(outcome(&short), pb::ClaimOutcome::Claimed);
    let early = claim(&mut on_b, claim_for("short", 2, 3600)).await;
    assert_eq!(outcome(&early), pb::ClaimOutcome::InProgress);
    let recovered = loop {
        let again = claim(&mut on_b, claim_for("short", 2, 3600)).await;
        match outcome(&again) {
            pb::ClaimOutcome::InProgress => assert!(
                sent.elapsed() < Duration::from_secs(30),
                "the slow pod never sees the lease end: {again:?}"
            ),
            pb::ClaimOutcome::Claimed => break again,
            other => panic!("{other:?}: {again:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The lease began after `sent`: it cannot have ended 2 s before that
    // (less the sidecars' clock uncertainty, 500 ms at most).
    assert!(
        sent.elapsed() >= Duration::from_millis(1500),
        "recovered {:?} after a 2 s lease was claimed",
        sent.elapsed()
    );
    assert!(recovered.recovered);
    assert!(recovered.fencing_token > short.fencing_token);
    drop((a, b));
    space.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_that_disagree_change_nothing_on_postgres() {
    if let Some(space) = Space::postgres() {
        clocks_that_disagree_change_nothing(space).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_that_disagree_change_nothing_on_redis() {
    if let Some(space) = Space::redis() {
        clocks_that_disagree_change_nothing(space).await;
    }
}

/// Waits until `addr`'s health is `status`, which must come before
/// `deadline`; how long it took from `since`.
async fn health_by(addr: SocketAddr, status: i32, since: Instant, deadline: Duration) -> Duration {
    loop {
        if health_of(addr).await == status {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < deadline,
            "health not {status} within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The network to the store goes silent (sockets open, nothing answers):
/// calls are UNAVAILABLE by --store-timeout (well before the request
/// timeout), health is NOT_SERVING, and serving again by itself once the
/// network is back (each bounded, with room for a loaded machine; the
/// figures are printed).
async fn a_silent_store_is_bounded(space: Space) {
    let dir = tempfile::tempdir().unwrap();
    let forwarder = Forwarder::start(space.port()).await;
    let mut flags = space.flags_via(&space.url_via(forwarder.port));
    flags.extend(strings(&["--store-timeout", "2s"]));
    let sidecar = serving(&[], dir.path(), &flags).await;
    let mut client = sidecar.client().await;
    assert_eq!(
        outcome(&claim(&mut client, claim_for("before", 30, 3600)).await),
        pb::ClaimOutcome::Claimed
    );

    forwarder.silence();
    let silenced = Instant::now();
    for attempt in 0..3 {
        let started = Instant::now();
        let refused = client
            .claim(claim_for(&format!("during-{attempt}"), 30, 3600))
            .await
            .expect_err("no answer while the store is silent");
        let took = started.elapsed();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        // The store timeout (2 s) ended it, not the request timeout (10 s):
        // allowed up to 8 s for a loaded machine.
        assert!(
            took <= Duration::from_secs(8),
            "attempt {attempt}: UNAVAILABLE only after {took:?} (--store-timeout 2s)"
        );
    }
    let unhealthy = health_by(sidecar.addr, NOT_SERVING, silenced, Duration::from_secs(15)).await;

    forwarder.restore();
    let restored = Instant::now();
    let healthy = health_by(sidecar.addr, SERVING, restored, Duration::from_secs(20)).await;
    assert_eq!(
        outcome(&claim(&mut client, claim_for("after", 30, 3600)).await),
        pb::ClaimOutcome::Claimed
    );
    assert_eq!(
        outcome(&claim(&mut client, claim_for("before", 30, 3600)).await),
        pb::ClaimOutcome::InProgress
    );
    eprintln!("silent store: NOT_SERVING after {unhealthy:?}, SERVING again {healthy:?} after the network returned");
    drop(sidecar);
    space.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_postgres_is_bounded() {
    if let Some(space) = Space::postgres() {
        a_silent_store_is_bounded(space).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_redis_is_bounded() {
    if let Some(space) = Space::redis() {
        a_silent_store_is_bounded(space).await;
    }
}

/// A throwaway Redis with `args`, or `None` (skipped) without redis-server.
fn throwaway_redis(args: &[&str]) -> Option<dedupd_testkit::services::Throwaway> {
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    match dedupd_testkit::services::start_redis(&args) {
        Ok(Some(server)) => Some(server),
        Ok(None) => {
            dedupd_testkit::skip::skip_for_store(
                "no redis-server to start a Redis of the test's own",
            );
            None
        }
        Err(error) => panic!("cannot start a Redis: {error}"),
    }
}

async fn redis_command(url: &str, args: &[&str]) -> String {
    let mut connection = ::redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut command = ::redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    let value: ::redis::Value = command.query_async(&mut connection).await.unwrap();
    match value {
        ::redis::Value::Int(number) => number.to_string(),
        ::redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        ::redis::Value::SimpleString(text) => text,
        ::redis::Value::VerbatimString { text, .. } => text,
        other => format!("{other:?}"),
    }
}

/// Runs the binary to its exit (bounded): its exit code and stderr.
fn run_to_exit(flags: &[String]) -> (Option<i32>, String) {
    let mut child = Command::new(BINARY)
        .args(flags)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("dedupd did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A Redis that may evict keys (`maxmemory` with `allkeys-lru`, the default
/// of several managed offerings) is refused at start with one line and exit
/// 64, unless --allow-redis-eviction; a running sidecar whose Redis starts to
/// evict reports NOT_SERVING and answers UNAVAILABLE until it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_is_refused() {
    let Some(evicting) =
        throwaway_redis(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut flags = strings(&[
        "--store",
        "redis",
        "--store-url",
        &evicting.url,
        "--data-dir",
    ]);
    flags.push(dir.path().display().to_string());
    let (code, stderr) = run_to_exit(&flags);
    assert_eq!(code, Some(64), "{stderr}");
    // One line says what is wrong and what to do (the rest is the usual
    // start-up log, nothing at error level).
    let said: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("dedupd: invalid configuration:"))
        .collect();
    assert_eq!(said.len(), 1, "one line: {stderr}");
    assert!(
        said[0].contains("maxmemory-policy allkeys-lru")
            && said[0].contains("--allow-redis-eviction"),
        "{stderr}"
    );
    assert!(!stderr.contains("ERROR"), "{stderr}");

    // Allowed by the operator: it serves.
    let mut allowed_flags = strings(&["--store", "redis", "--store-url", &evicting.url]);
    allowed_flags.push("--allow-redis-eviction".into());
    let allowed = serving(&[], dir.path(), &allowed_flags).await;
    let mut client = allowed.client().await;
    assert_eq!(
        outcome(&claim(&mut client, claim_for("allowed", 30, 3600)).await),
        pb::ClaimOutcome::Claimed
    );
    drop(allowed);

    // A Redis that starts evicting under a running sidecar.
    let Some(changing) = throwaway_redis(&[]) else {
        return;
    };
    let sidecar = serving(
        &[],
        dir.path(),
        &strings(&["--store", "redis", "--store-url", &changing.url]),
    )
    .await;
    let mut client = sidecar.client().await;
    assert_eq!(
        outcome(&claim(&mut client, claim_for("before", 30, 3600)).await),
        pb::ClaimOutcome::Claimed
    );
    redis_command(&changing.url, &["CONFIG", "SET", "maxmemory", "64mb"]).await;
    redis_command(
        &changing.url,
        &["CONFIG", "SET", "maxmemory-policy", "volatile-lru"],
    )
    .await;
    let changed = Instant::now();
    health_by(sidecar.addr, NOT_SERVING, changed, Duration::from_secs(10)).await;
    let refused = client
        .claim(claim_for("during", 30, 3600))
        .await
        .expect_err("refused while Redis may evict");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    redis_command(
        &changing.url,
        &["CONFIG", "SET", "maxmemory-policy", "noeviction"],
    )
    .await;
    health_by(
        sidecar.addr,
        SERVING,
        Instant::now(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        outcome(&claim(&mut client, claim_for("after", 30, 3600)).await),
        pb::ClaimOutcome::Claimed
    );
}

/// `--store-replicas 1` against a real replica (`redis-server --replicaof`):
/// every acknowledged write is on the replica when answered; with the
/// replica stopped, writes are UNAVAILABLE within --store-timeout + 1 s
/// instead of acknowledged on the primary alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_replicas_waits_for_a_real_replica() {
    let Some(primary) = throwaway_redis(&[]) else {
        return;
    };
    let port = primary.port.to_string();
    let Some(replica) = throwaway_redis(&["--replicaof", "127.0.0.1", &port]) else {
        return;
    };
    let linked = Instant::now();
    while !redis_command(&replica.url, &["INFO", "replication"])
        .await
        .contains("master_link_status:up")
    {
        assert!(
            linked.elapsed() < Duration::from_secs(15),
            "the replica never linked up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let sidecar = serving(
        &[],
        dir.path(),
        &strings(&[
            "--store",
            "redis",
            "--store-url",
            &primary.url,
            "--store-schema",
            "replicated",
            "--store-replicas",
            "1",
            "--store-timeout",
            "2s",
        ]),
    )
    .await;
    let mut client = sidecar.client().await;
    for i in 0..20 {
        let id = format!("evt-{i}");
        let claimed = claim(&mut client, claim_for(&id, 30, 3600)).await;
        assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed);
        client
            .commit(pb::CommitRequest {
                correlation_id: id.clone(),
                lease_token: claimed.lease_token,
                ..Default::default()
            })
            .await
            .expect("commit");
        // Answered only once the replica has it.
        let on_replica = redis_command(
            &replica.url,
            &["EXISTS", &format!("replicated:r:default/{id}")],
        )
        .await;
        assert_eq!(on_replica, "1", "{id} acknowledged but not on the replica");
    }

    drop(replica);
    let started = Instant::now();
    let refused = client
        .claim(claim_for("unreplicated", 30, 3600))
        .await
        .expect_err("a write no replica has is not acknowledged");
    let took = started.elapsed();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    // The store timeout (2 s), not the request timeout (10 s): up to 8 s
    // for a loaded machine.
    assert!(took <= Duration::from_secs(8), "UNAVAILABLE after {took:?}");
    assert!(refused.message().contains("replicas"), "{refused:?}");
    // An answer that only reads waits too: the claim just refused stands
    // on the primary, unreplicated; IN_PROGRESS is not answered for it
    // while no replica confirms what the primary holds (a failover would
    // lose it, and the event be processed twice at once). Nor was it
    // learned by this pod's local tier, which learns only what its
    // replication wait confirmed.
    let started = Instant::now();
    let refused = client
        .claim(claim_for("unreplicated", 30, 3600))
        .await
        .expect_err("a read is not answered past the replicas either");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(started.elapsed() <= Duration::from_secs(8));
}

/// PostgreSQL's fencing sequence reset below tokens already issued (a
/// switchover by logical replication, a restore): a key's next token is
/// still above its last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_never_go_back_when_the_sequence_does() {
    let Some(space) = Space::postgres() else {
        return;
    };
    let Space::Postgres(schema) = &space else {
        unreachable!()
    };
    let dir = tempfile::tempdir().unwrap();
    let sidecar = serving(&[], dir.path(), &space.flags()).await;
    let mut client = sidecar.client().await;
    for i in 0..5 {
        claim(&mut client, claim_for(&format!("warm-{i}"), 30, 3600)).await;
    }
    let expiring = claim(&mut client, claim_for("expiring", 1, 3600)).await;
    let released = claim(&mut client, claim_for("released", 30, 3600)).await;
    assert!(expiring.fencing_token > 1 && released.fencing_token > 1);
    client
        .release(pb::ReleaseRequest {
            correlation_id: "released".into(),
            lease_token: released.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("release");

    let (admin, connection) = tokio_postgres::connect(postgres::url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "ALTER SEQUENCE {schema}.fencing_tokens RESTART WITH 1"
        ))
        .await
        .unwrap();
    // The 1 s lease of "expiring" ends: asked until it has (bounded).
    let asked = Instant::now();
    let recovered = loop {
        let again = claim(&mut client, claim_for("expiring", 30, 3600)).await;
        if outcome(&again) != pb::ClaimOutcome::InProgress {
            break again;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(30),
            "a 1 s lease still held"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(outcome(&recovered), pb::ClaimOutcome::Claimed);
    assert!(recovered.recovered);
    assert!(
        recovered.fencing_token > expiring.fencing_token,
        "token went back: {} after {}",
        recovered.fencing_token,
        expiring.fencing_token
    );
    let again = claim(&mut client, claim_for("released", 30, 3600)).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Claimed);
    assert!(
        again.fencing_token > released.fencing_token,
        "token went back: {} after {}",
        again.fencing_token,
        released.fencing_token
    );
    drop(admin);
    let _ = connection.await;
    drop(sidecar);
    space.remove().await;
}

/// Issue 40 item 5, through the binary: the proxy's claim reaches
/// PostgreSQL but its answer is lost, so the client is told 503 and the
/// request is never forwarded. The claim is given back in the background:
/// the client's retry is forwarded once the network is back, never 409
/// for the lease and then 502 "outcome unknown" for a day. Then the same
/// with the claim itself held on a stuck connection while new ones work:
/// it lands after the give-back first looked and found nothing, and is
/// given back all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_claim_whose_answer_was_lost_is_given_back() {
    use common::proxy::{post, proxy_address, replayed, upstream};
    use http::StatusCode;

    let Some(space) = Space::postgres() else {
        return;
    };
    let Space::Postgres(schema) = &space else {
        unreachable!()
    };
    let dir = tempfile::tempdir().unwrap();
    let forwarder = Forwarder::start(space.port()).await;
    let upstream = upstream().await;
    let upstream_url = format!("http://{}", upstream.address);
    // The namespace is in the claim's statement (a parameter) and in no
    // statement before it: the forwarder's marker for "the claim".
    const NAMESPACE: &str = "orphaned-claims";
    let mut flags = space.flags_via(&space.url_via(forwarder.port));
    flags.extend(strings(&[
        "--store-timeout",
        "1s",
        "--http-proxy-listen",
        "127.0.0.1:0",
        "--http-proxy-upstream",
        &upstream_url,
        "--http-proxy-namespace",
        NAMESPACE,
    ]));
    let sidecar = serving(&[], dir.path(), &flags).await;
    let address = proxy_address(&sidecar);
    // The lease (--default-lease-ttl, 30 s) outlasts every wait below: a
    // retry that succeeds was given the key back, not the lease's end.
    let retried_until_forwarded = |key: &'static str| async move {
        let began = Instant::now();
        loop {
            let answer = post(address, "/orders", key, "{}").await;
            if answer.status == StatusCode::CREATED {
                assert!(!replayed(&answer), "{key}: {answer:?}");
                return began.elapsed();
            }
            assert!(
                matches!(
                    answer.status,
                    StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
                ),
                "{key}: {answer:?}"
            );
            assert!(
                began.elapsed() < Duration::from_secs(15),
                "{key}: still {} after 15 s; the lost claim was not given back",
                answer.status
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };

    // 1. Applied, its answer lost.
    forwarder.lose_answer_to(NAMESPACE.as_bytes());
    let lost = post(address, "/orders", "lost-answer", "{}").await;
    assert!(forwarder.sprung(), "the claim never went by");
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE, "{lost:?}");
    assert_eq!(upstream.calls.get("/orders"), 0, "nothing was forwarded");
    assert_eq!(postgres::rows(schema).await, 1, "the claim was applied");
    forwarder.restore();
    let took = retried_until_forwarded("lost-answer").await;
    assert_eq!(upstream.calls.get("/orders"), 1);

    // 2. Held on a stuck connection; new connections work, so the
    //    give-back's first lookups find nothing; then it lands.
    forwarder.hold_write(NAMESPACE.as_bytes());
    let held = post(address, "/orders", "held-claim", "{}").await;
    assert!(forwarder.sprung(), "the claim never went by");
    assert_eq!(held.status, StatusCode::SERVICE_UNAVAILABLE, "{held:?}");
    forwarder.restore_new_connections();
    let since = Instant::now();
    health_by(sidecar.addr, SERVING, since, Duration::from_secs(20)).await;
    // Room for the give-back to look (every second at most) and find
    // nothing; the claim is still held.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        postgres::rows(schema).await,
        1,
        "the held claim landed early"
    );
    forwarder.restore();
    let landed = Instant::now();
    while postgres::rows(schema).await < 2 {
        assert!(
            landed.elapsed() < Duration::from_secs(10),
            "the held claim never landed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took_held = retried_until_forwarded("held-claim").await;
    assert_eq!(upstream.calls.get("/orders"), 2, "each forwarded once");
    eprintln!(
        "lost claims given back: forwarded {took:?} after the network returned; \
         {took_held:?} after the held claim landed"
    );
    drop(sidecar);
    space.remove().await;
}

/// Waits until the Redis at `url` says its link to its primary is up.
async fn linked_up(url: &str) {
    let linked = Instant::now();
    while !redis_command(url, &["INFO", "replication"])
        .await
        .contains("master_link_status:up")
    {
        assert!(
            linked.elapsed() < Duration::from_secs(15),
            "{url} never linked up with its primary"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 41 item 3: the replication wait must run where the write did. A
/// primary (X) with a replica (Y) that has one of its own (Z); the pod
/// reaches Redis through a name (a forwarder) that moves to Y when Y is
/// promoted, while the pod's data connections stay on X. The claim is
/// written on X, which no longer has a replica; a fence on a connection
/// made after the move reached Y, whose `WAIT 1` Z satisfies: the claim
/// was acknowledged though a failover to Y had already lost it, and a pod
/// on Y was granted the same key. Each call's witness must be found where
/// the fence runs: the claim is UNAVAILABLE (not acknowledged), and its
/// retry too (nothing answered from the pod's own memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_wait_on_another_server_acknowledges_nothing() {
    let Some(x) = throwaway_redis(&[]) else {
        return;
    };
    let x_port = x.port.to_string();
    let Some(y) = throwaway_redis(&["--replicaof", "127.0.0.1", &x_port]) else {
        return;
    };
    let y_port = y.port.to_string();
    let Some(z) = throwaway_redis(&["--replicaof", "127.0.0.1", &y_port]) else {
        return;
    };
    linked_up(&y.url).await;
    linked_up(&z.url).await;
    let forwarder = Forwarder::start(x.port).await;
    let pod = |url: &str| {
        strings(&[
            "--store",
            "redis",
            "--store-url",
            url,
            "--store-schema",
            "moved",
            "--store-replicas",
            "1",
            "--store-timeout",
            "2s",
            // One data connection (made at start, by the clock's readings)
            // and one fence connection (made at the first fence).
            "--store-pool-size",
            "1",
        ])
    };
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = serving(
        &[],
        dir_a.path(),
        &pod(&format!("redis://127.0.0.1:{}", forwarder.port)),
    )
    .await;
    let mut client_a = a.client().await;

    // Y is promoted (Z still follows it); the name now leads to Y.
    let promoted = redis_command(&y.url, &["REPLICAOF", "NO", "ONE"]).await;
    assert!(promoted.eq_ignore_ascii_case("ok"), "{promoted}");
    forwarder.switch_to(y.port);

    let mut request = claim_for("moved-key", 30, 3600);
    request.request_id = "attempt-1".into();
    let on_a = client_a.claim(request.clone()).await;
    let on_x = redis_command(&x.url, &["EXISTS", "moved:r:default/moved-key"]).await;
    let b = serving(&[], dir_b.path(), &pod(&y.url)).await;
    let mut client_b = b.client().await;
    let on_b = claim(&mut client_b, claim_for("moved-key", 30, 3600)).await;
    assert_eq!(
        outcome(&on_b),
        pb::ClaimOutcome::Claimed,
        "Y never had the claim"
    );
    assert_eq!(on_x, "1", "the claim was written on X");
    let refused = on_a.expect_err(
        "a claim whose replication wait ran on another server was acknowledged, and a pod \
         on the promoted server was granted the same key",
    );
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let retried = client_a.claim(request).await;
    assert_eq!(
        retried.map_err(|status| status.code()).err(),
        Some(tonic::Code::Unavailable),
        "the retry was answered though still not replicated"
    );
}

/// A Redis Sentinel of the test's own, or `None` (skipped).
fn throwaway_sentinel(primary: u16) -> Option<dedupd_testkit::services::Throwaway> {
    match dedupd_testkit::services::start_redis_sentinel("dedupd", primary, 2, 1000) {
        Ok(Some(sentinel)) => Some(sentinel),
        Ok(None) => {
            dedupd_testkit::skip::skip_for_store("no redis-server to start a Sentinel");
            None
        }
        Err(error) => panic!("cannot start a Sentinel: {error}"),
    }
}

/// Polls `check` every 100 ms until it holds, for up to `within`.
async fn until(what: &str, within: Duration, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 41: Redis Sentinel. A primary with two replicas, three sentinels
/// (and, listed first, a fourth address that has gone silent), a sidecar
/// given only the sentinels (`redis+sentinel://…/dedupd`) with
/// `--store-replicas 1`. The primary is SIGKILLed; the sentinels promote a
/// replica; the sidecar follows them to it by itself: every commit it
/// acknowledged before is still a DUPLICATE, and new claims and commits go
/// through on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_is_followed_and_loses_no_acknowledged_commit() {
    let durable = ["--appendonly", "yes", "--appendfsync", "always"];
    let Some(primary) = throwaway_redis(&durable) else {
        return;
    };
    let port = primary.port.to_string();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut args = durable.to_vec();
        args.extend(["--replicaof", "127.0.0.1", &port]);
        let Some(replica) = throwaway_redis(&args) else {
            return;
        };
        linked_up(&replica.url).await;
        replicas.push(replica);
    }
    let mut sentinels = Vec::new();
    for _ in 0..3 {
        let Some(sentinel) = throwaway_sentinel(primary.port) else {
            return;
        };
        sentinels.push(sentinel);
    }
    // Each sentinel has found the replicas (from the primary's INFO) and
    // the other sentinels (over the primary's hello channel): without
    // them it could not agree on, or carry out, a failover.
    for sentinel in &sentinels {
        until(
            "the sentinel knows the topology",
            Duration::from_secs(30),
            async || {
                let replicas =
                    redis_command(&sentinel.url, &["SENTINEL", "REPLICAS", "dedupd"]).await;
                let others =
                    redis_command(&sentinel.url, &["SENTINEL", "SENTINELS", "dedupd"]).await;
                replicas.matches("\"ip\"").count() >= 2 && others.matches("\"ip\"").count() >= 2
            },
        )
        .await;
    }
    // The first sentinel listed is one whose host went silent (no reset):
    // it must not hold up every lookup of the primary.
    let silent = Forwarder::start(sentinels[0].port).await;
    silent.silence();
    let url = format!(
        "redis+sentinel://127.0.0.1:{},{}/dedupd",
        silent.port,
        sentinels
            .iter()
            .map(|sentinel| format!("127.0.0.1:{}", sentinel.port))
            .collect::<Vec<_>>()
            .join(",")
    );
    let dir = tempfile::tempdir().unwrap();
    let flags = strings(&[
        "--store",
        "redis",
        "--store-url",
        &url,
        "--store-schema",
        "sentinel",
        "--store-replicas",
        "1",
        "--store-timeout",
        "2s",
    ]);
    let sidecar = serving(&[], dir.path(), &flags).await;
    let mut client = sidecar.client().await;
    let commit = async |client: &mut common::Client, id: &str| -> Result<(), tonic::Status> {
        let claimed = client.claim(claim_for(id, 30, 3600)).await?.into_inner();
        assert_eq!(outcome(&claimed), pb::ClaimOutcome::Claimed, "{id}");
        client
            .commit(pb::CommitRequest {
                correlation_id: id.to_owned(),
                lease_token: claimed.lease_token,
                ..Default::default()
            })
            .await
            .map(drop)
    };
    for i in 0..10 {
        commit(&mut client, &format!("before-{i}"))
            .await
            .expect("committed");
    }

    // The primary dies at once (SIGKILL): no goodbye to anyone.
    let info = redis_command(&primary.url, &["INFO", "server"]).await;
    let pid = info
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .expect("INFO names the process")
        .trim()
        .to_owned();
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());
    let promoted = replicas
        .iter()
        .map(|replica| replica.port.to_string())
        .collect::<Vec<_>>();
    until("a replica promoted", Duration::from_secs(30), async || {
        let named = redis_command(
            &sentinels[0].url,
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "dedupd"],
        )
        .await;
        promoted.iter().any(|port| named.contains(port.as_str()))
    })
    .await;
    let failed_over = killed.elapsed();

    // The sidecar follows: a new event commits (once the other replica
    // follows the new primary, so a replica confirms it)...
    let mut after = 0;
    until(
        "a commit on the new primary",
        Duration::from_secs(30),
        async || {
            after += 1;
            // A claim refused while the sentinels fail over is given up;
            // the next try is a new event.
            commit(&mut client, &format!("after-{after}")).await.is_ok()
        },
    )
    .await;
    let serving_again = killed.elapsed();
    // ...and every commit acknowledged before the failover is there.
    for i in 0..10 {
        let id = format!("before-{i}");
        let again = claim(&mut client, claim_for(&id, 30, 3600)).await;
        assert_eq!(
            outcome(&again),
            pb::ClaimOutcome::Duplicate,
            "{id}, acknowledged before the failover, was lost"
        );
    }
    eprintln!(
        "sentinel failover: promoted {failed_over:?} after the SIGKILL; commits again after {serving_again:?}"
    );
}
