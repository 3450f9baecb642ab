//! The real `dedupd` binary as a child process: crash safety under `kill -9`,
//! graceful shutdown on SIGTERM, configuration errors (exit 64) and the CLI.

use std::{
    collections::HashMap,
    net::SocketAddr,
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

mod common;

use common::{
    claim_and_commit,
    faultshim::{Fault, FaultyDisk},
    sidecar::{open_descriptors, terminate, Sidecar, BINARY},
};
use dedupd::proto::v1 as pb;
use rand::Rng;
use serde_json::Value;

fn claim_request(id: &str) -> pb::ClaimRequest {
    pb::ClaimRequest {
        correlation_id: id.to_owned(),
        event_type: "PaymentReceived".into(),
        ..Default::default()
    }
}

/// Commits under concurrent load, `kill -9`s the sidecar at a random moment,
/// restarts it, and checks that every acknowledged commit survived and that
/// fencing tokens kept growing. Ten cycles; in every other one the store
/// checkpoints every 100 ms, so kills land during checkpoints too (and the
/// write-ahead log is replayed over a sled that has some of it, or all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_commit_survives_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let acknowledged: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut highest_fencing = 0u64;
    for cycle in 0..10 {
        let checkpoint_interval = if cycle % 2 == 1 { "100ms" } else { "30s" };
        let sidecar =
            Sidecar::start_with(dir.path(), &["--checkpoint-interval", checkpoint_interval]);
        let mut client = sidecar.client().await;

        // Everything acknowledged before any earlier crash is still committed.
        let expected: Vec<(String, u64)> = acknowledged
            .lock()
            .unwrap()
            .iter()
            .map(|(id, fencing)| (id.clone(), *fencing))
            .collect();
        for (id, fencing) in &expected {
            let duplicate = client.claim(claim_request(id)).await.unwrap().into_inner();
            assert_eq!(
                duplicate.outcome,
                pb::ClaimOutcome::Duplicate as i32,
                "cycle {cycle}: acknowledged commit {id} was lost"
            );
            assert_eq!(duplicate.fencing_token, *fencing);
        }
        let probe = client
            .claim(claim_request(&format!("probe-{cycle}")))
            .await
            .unwrap()
            .into_inner();
        assert!(
            probe.fencing_token > highest_fencing,
            "cycle {cycle}: fencing token {} after {highest_fencing}",
            probe.fencing_token
        );

        let mut workers = Vec::new();
        for worker in 0..8 {
            let mut client = sidecar.client().await;
            let acknowledged = Arc::clone(&acknowledged);
            workers.push(tokio::spawn(async move {
                let mut highest = 0;
                for n in 0..100_000 {
                    let id = format!("c{cycle}-w{worker}-{n}");
                    let Ok(claimed) = client.claim(claim_request(&id)).await else {
                        break;
                    };
                    let claimed = claimed.into_inner();
                    highest = highest.max(claimed.fencing_token);
                    let commit = pb::CommitRequest {
                        correlation_id: id.clone(),
                        lease_token: claimed.lease_token,
                        response: id.clone().into_bytes(),
                        ..Default::default()
                    };
                    if client.commit(commit).await.is_err() {
                        break;
                    }
                    acknowledged
                        .lock()
                        .unwrap()
                        .insert(id, claimed.fencing_token);
                }
                highest
            }));
        }
        let delay = rand::rng().random_range(50..400);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        sidecar.kill_9();
        for worker in workers {
            highest_fencing = highest_fencing.max(worker.await.unwrap());
        }
        highest_fencing = highest_fencing.max(probe.fencing_token);
    }
    let count = acknowledged.lock().unwrap().len();
    assert!(
        count > 100,
        "the load was too light to prove anything: {count} commits"
    );

    let sidecar = Sidecar::start(dir.path());
    let mut client = sidecar.client().await;
    let expected: Vec<String> = acknowledged.lock().unwrap().keys().cloned().collect();
    for id in expected {
        let lookup = client
            .lookup(pb::LookupRequest {
                namespace: String::new(),
                correlation_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let record = lookup.record.unwrap_or_else(|| panic!("{id} lost"));
        assert_eq!(record.state, pb::RecordState::Committed as i32);
        assert_eq!(record.response, id.as_bytes());
    }
}

/// SIGTERM while eight Claims wait for a disk sync (the sync held by the
/// fault shim until the SIGTERM is in): the calls are drained — every one
/// answered CLAIMED, none cut off — the process exits 0 within the grace
/// having synced the store, the ready file is gone, and after a restart
/// every one of those claims is there.
// Multi-threaded: `terminate` blocks this thread while the client's
// connection tasks must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_syncs_and_exits_zero() {
    let disk = FaultyDisk::new();
    let mut sidecar = disk.start(&["--shutdown-grace", "10s"]);
    let client = sidecar.client().await;
    // The syncs hang (not merely slow down): however slow the machine, no
    // claim can be answered before the SIGTERM.
    disk.switch_on(Fault::HangSync);
    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .claim(claim_request(&format!("drained-{i}")))
                    .await
                    .map(|answer| answer.into_inner().outcome)
                    .map_err(|status| status.code())
            })
        })
        .collect();
    disk.until_tripped(Fault::HangSync).await;
    // The other claims reach the sidecar (a request sent before the
    // SIGTERM is served even if it arrives after: HTTP/2's graceful GOAWAY).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        in_flight.iter().all(|call| !call.is_finished()),
        "the claims must still wait for their sync at SIGTERM"
    );
    // The disk comes back once the SIGTERM is in: the drain finds the
    // claims still waiting.
    let release = std::thread::spawn({
        let (signalled, trigger) = (
            sidecar.logged("SIGTERM received"),
            disk.trigger(Fault::HangSync),
        );
        move || {
            let started = std::time::Instant::now();
            while !signalled() {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "no SIGTERM logged"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            std::fs::remove_file(trigger).unwrap();
        }
    });
    let (code, log) = terminate(&mut sidecar, Duration::from_secs(10 + 2 + 2));
    release.join().unwrap();
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(log.contains("store synced"), "{log}");
    for (i, call) in in_flight.into_iter().enumerate() {
        assert_eq!(
            call.await.unwrap(),
            Ok(pb::ClaimOutcome::Claimed as i32),
            "drained-{i} was in flight at SIGTERM: {log}"
        );
    }
    assert!(
        !sidecar.ready_dir.path().join("ready.json").exists(),
        "the ready file is removed on exit"
    );
    drop(sidecar);

    // What was claimed before and during SIGTERM is there after the restart.
    let sidecar = Sidecar::start(&disk.data());
    let mut client = sidecar.client().await;
    for i in 0..8 {
        let again = client
            .claim(claim_request(&format!("drained-{i}")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            again.outcome,
            pb::ClaimOutcome::InProgress as i32,
            "drained-{i}"
        );
    }
}

#[test]
fn bad_configuration_exits_64_with_one_line_before_touching_anything() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("never-created");
    let key_file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let not_a_key = key_file("not-a-key", "correct horse battery staple\n");
    // 16 bytes, as `openssl rand -base64 16` writes them: too short.
    let short_key = key_file("short.key", "AAECAwQFBgcICQoLDA0ODw==\n");
    let good_key = key_file("good.key", &format!("{}\n", "ab".repeat(32)));
    let twin_key = key_file("twin.key", &"AB".repeat(32));
    let payments_key = format!("payments={}", key_file("payments.key", &"cd".repeat(32)));
    let payments_twin = format!("payments={twin_key}");
    let no_namespace = format!("={twin_key}");
    let good_key_id = dedupd::sealing::Keyring::from_bytes(&[[0xab; 32]])
        .unwrap()
        .sealing_id()
        .to_string();
    let no_keys = dir.path().join("no-keys");
    std::fs::create_dir(&no_keys).unwrap();
    let no_keys = no_keys.to_str().unwrap().to_owned();
    /// Arguments, environment, and a word the error line must contain.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--default-lease-ttl", "2h"],
            vec![],
            "--default-lease-ttl",
        ),
        (vec!["--max-lease-ttl", "2h"], vec![], "--max-lease-ttl"),
        (vec!["--listen", "nowhere"], vec![], "--listen"),
        (vec![], vec![("DEDUPD_SYNC", "sometimes")], "sometimes"),
        (
            vec!["--max-response-bytes", "2000000"],
            vec![],
            "--max-response-bytes",
        ),
        (vec!["--namespace-retention", "bad ns=1d"], vec![], "bad ns"),
        (
            vec!["--default-retention", "400days"],
            vec![],
            "--default-retention",
        ),
        (vec!["--log", "info,[["], vec![], "--log"),
        (vec!["--max-batch-size", "0"], vec![], "--max-batch-size"),
        (vec!["--listen", "unix://relative.sock"], vec![], "absolute"),
        (
            vec!["--listen", "unix:///no/such/dir/d.sock"],
            vec![],
            "does not exist",
        ),
        (
            vec!["--metrics-listen", "nowhere"],
            vec![],
            "--metrics-listen",
        ),
        (
            vec![],
            vec![("DEDUPD_AUTH_TOKEN", "short")],
            "at least 16 bytes",
        ),
        (
            vec![],
            vec![("DEDUPD_ADMIN_TOKEN", "0123456789abcdef0")],
            "needs a client token",
        ),
        (
            vec!["--auth-token-file", "/no/such/token"],
            vec![],
            "--auth-token-file",
        ),
        (
            vec!["--tls-cert", "/no/such.pem", "--tls-key", "/no/such.key"],
            vec![],
            "--tls-cert",
        ),
        (
            vec!["--tls-client-ca", "/no/such.pem"],
            vec![],
            "needs --tls-cert",
        ),
        (
            vec!["--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"],
            vec![],
            "not a PEM",
        ),
        // A retention for no namespace would never apply.
        (
            vec!["--namespace-retention", "=30days"],
            vec![],
            "names no namespace",
        ),
        // Reachable beyond the host with nobody authenticated.
        (
            vec!["--listen", "0.0.0.0:50051"],
            vec![],
            "--allow-unauthenticated",
        ),
        (
            vec!["--listen", "127.0.0.1:0,[::]:50051"],
            vec![],
            "no caller is authenticated",
        ),
        (
            vec!["--ready-file", "/no/such/dir/ready.json"],
            vec![],
            "--ready-file",
        ),
        // Limits print the way flags are written.
        (
            vec!["--default-retention", "400days"],
            vec![],
            "must be at most 365days, got 400days",
        ),
        (vec!["--default-lease-ttl", "500us"], vec![], "at least 1ms"),
        // The shared store's URL: required, checked, its password never shown.
        (vec!["--store", "postgres"], vec![], "needs --store-url"),
        (
            vec![
                "--store",
                "postgres",
                "--store-url",
                "mysql://app:s3cret@db/x",
            ],
            vec![],
            "not a postgres://",
        ),
        (
            vec![
                "--store",
                "postgres",
                "--store-url",
                "postgres://app:s3cret@db:notaport/x",
            ],
            vec![],
            "app:…@db",
        ),
        (
            vec!["--store-url", "postgres://app@db/x"],
            vec![],
            "--store-url is for --store postgres",
        ),
        (
            vec!["--store", "postgres", "--store-url-file", "/no/such/url"],
            vec![],
            "--store-url-file",
        ),
        (
            vec![
                "--store",
                "postgres",
                "--store-url",
                "postgres://app@db/x",
                "--store-schema",
                "Bad-Name",
            ],
            vec![],
            "--store-schema",
        ),
        (vec!["--store", "redis"], vec![], "needs --store-url"),
        (
            vec![
                "--store",
                "redis",
                "--store-url",
                "postgres://app:s3cret@db/x",
            ],
            vec![],
            "is not a redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel:// URL",
        ),
        (
            vec![
                "--store",
                "redis",
                "--store-url",
                "redis://:s3cret@cache1:6379,cache2:6379",
            ],
            vec![],
            "redis+cluster://",
        ),
        (
            vec![
                "--store",
                "postgres",
                "--store-url",
                "postgres://app@db/x",
                "--store-cluster",
            ],
            vec![],
            "are for --store redis",
        ),
        (
            vec![
                "--store",
                "redis",
                "--store-url",
                "rediss://:s3cret@cache:6380/0#insecure",
            ],
            vec![],
            "--store-ca-file",
        ),
        (
            vec![
                "--store",
                "redis",
                "--store-url",
                "redis://cache:6379",
                "--local-tier-max-age",
                "0s",
            ],
            vec![],
            "--local-tier-max-age",
        ),
        (vec!["--store", "mongodb"], vec![], "--store"),
        (
            vec!["--encryption-key-file", "/no/such.key"],
            vec![],
            "--encryption-key-file /no/such.key",
        ),
        (
            vec!["--encryption-key-file", &not_a_key],
            vec![],
            "neither base64 nor 64 hexadecimal digits",
        ),
        (
            vec![],
            vec![("DEDUPD_ENCRYPTION_KEY_FILE", &short_key)],
            "holds 16 bytes",
        ),
        (
            vec!["--encryption-key-file", &no_keys],
            vec![],
            "names no key file",
        ),
        (
            vec!["--encryption-key-file", &good_key, "--encryption-key-file", &twin_key],
            vec![],
            "holds the same key as",
        ),
        (
            vec!["--namespace-key", &payments_key],
            vec![],
            "--namespace-key needs --encryption-key-file",
        ),
        (
            vec!["--encryption-key-file", &good_key, "--namespace-key", &payments_twin],
            vec![],
            "holds the same key as",
        ),
        (
            vec!["--namespace-key", "payments"],
            vec![],
            "is not NAMESPACE=FILE",
        ),
        (
            vec!["--encryption-key-file", &good_key, "--namespace-key", &no_namespace],
            vec![],
            "names no namespace",
        ),
        (
            vec!["--encryption-key-file", &good_key],
            vec![("DEDUPD_NAMESPACE_KEY", "orders=/no/orders.key,payments=/no/p.key")],
            "--namespace-key orders /no/orders.key",
        ),
        (
            vec!["--erased-key-id", "not-an-id"],
            vec![],
            "is not a key ID",
        ),
        (
            vec!["--encryption-key-file", &good_key, "--erased-key-id", &good_key_id],
            vec![],
            "which --erased-key-id declares destroyed",
        ),
        (
            vec!["--hash-correlation-ids", &not_a_key],
            vec![],
            "--hash-correlation-ids",
        ),
        (
            vec!["--decryption-key-file", &no_keys],
            vec![],
            "--decryption-key-file names no key file",
        ),
        (vec!["--memory-budget", "12XB"], vec![], "unknown unit"),
        (
            vec![],
            vec![("DEDUPD_MEMORY_BUDGET", "1.5Gi")],
            "--memory-budget",
        ),
        (
            vec!["--memory-budget", "16MiB"],
            vec![],
            "below the minimum of 32MiB",
        ),
        (
            vec!["--cache-mb", "0"],
            vec![],
            "--cache-mb must be at least 1",
        ),
    ];
    for (args, env, mentioned) in cases {
        let output = Command::new(BINARY)
            .args(&args)
            .arg("--data-dir")
            .arg(&data_dir)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?} {env:?}: {stderr}");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "one line, got: {stderr}"
        );
        assert!(
            stderr.contains(mentioned),
            "{stderr:?} should mention {mentioned}"
        );
        assert!(!stderr.contains("s3cret"), "a password leaked: {stderr}");
    }
    assert!(
        !data_dir.exists(),
        "bad configuration must not create the data directory"
    );
}

/// A non-loopback gRPC address starts once callers are authenticated, or
/// when the operator says the network is private.
#[test]
fn non_loopback_listen_starts_with_a_token_or_explicit_consent() {
    for extra in [
        vec!["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
        vec![
            "--listen",
            "0.0.0.0:0",
            "--auth-token-file",
            "/proc/sys/kernel/random/boot_id",
        ],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let sidecar = Sidecar::start_with(dir.path(), &extra);
        assert_eq!(sidecar.addr.ip().to_string(), "0.0.0.0", "{extra:?}");
    }
}

/// `dedupd health --readyz` (the image's HEALTHCHECK) asks the ops port over
/// plain HTTP: 0 while ready, 1 once nothing answers.
#[test]
fn health_readyz_asks_the_ops_port() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path());
    let ready: Value = serde_json::from_str(
        &std::fs::read_to_string(sidecar.ready_dir.path().join("ready.json")).unwrap(),
    )
    .unwrap();
    let metrics = ready["metrics"]
        .as_str()
        .expect("an ops address")
        .to_owned();
    let health = |address: &str| {
        let output = Command::new(BINARY)
            .args(["health", "--readyz", address])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        (output.status.code(), stdout)
    };
    let (code, stdout) = health(&metrics);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("200"), "{stdout}");
    sidecar.kill_9();
    let (code, stdout) = health(&metrics);
    assert_eq!(code, Some(1), "{stdout}");
}

/// Defect: running out of file descriptors used to kill the store until a
/// restart (a failed `read_dir` in the group commit was taken for a failed
/// disk sync) while the accept loop spun. Now the soft limit is raised at
/// start, the connection cap fits it, and when descriptors still run out (the
/// limit lowered under a running process) calls succeed or get
/// RESOURCE_EXHAUSTED, the accept loop backs off, and everything works again once connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_is_an_overload_that_passes() {
    let dir = tempfile::tempdir().unwrap();
    let mut sidecar = Sidecar::start_under(
        &["prlimit", "--nofile=200:1000"],
        dir.path(),
        &["--max-connections", "5000", "--shutdown-grace", "3s"],
    );
    let log = sidecar.log_text();
    assert!(
        log.contains("raised the open-file limit") && log.contains("\"to\":1000"),
        "{log}"
    );
    assert!(log.contains("\"allowed\":872"), "{log}");

    let mut client = sidecar.client().await;
    claim_and_commit(&mut client, "fd-before", Vec::new())
        .await
        .expect("claim and commit");
    // Now the limit drops under the running process, below what it holds
    // plus what the connections below will take.
    let pid = sidecar.child.id();
    let lowered = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), "--nofile=120:120"])
        .status()
        .unwrap();
    assert!(lowered.success());
    let idle: Vec<_> = (0..200)
        .map(|_| std::net::TcpStream::connect(sidecar.addr).unwrap())
        .collect();
    let started = Instant::now();
    while open_descriptors(pid) < 118 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "descriptors never ran out: {}",
            open_descriptors(pid)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A call on an open connection needs no new descriptor (the
    // write-ahead log's file is open): it succeeds or meets the shortage,
    // never fails.
    for i in 0..10 {
        match client.claim(claim_request(&format!("fd-during-{i}"))).await {
            Ok(_) => {}
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {}
            Err(status) => panic!("out of descriptors must be an overload: {status:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let backoffs = sidecar
        .log_text()
        .matches("out of file descriptors: not accepting")
        .count();
    assert!(backoffs >= 1, "the accept loop never met the shortage");
    assert!(
        backoffs < 200,
        "the accept loop must back off, not spin: {backoffs} warnings"
    );

    drop(idle);
    let started = Instant::now();
    while open_descriptors(pid) > 100 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "connections never closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    claim_and_commit(&mut client, "fd-after", Vec::new())
        .await
        .expect("claim and commit");

    // SIGTERM with the descriptors exhausted again ends within the grace.
    let lowered = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), "--nofile=120:120"])
        .status()
        .unwrap();
    assert!(lowered.success());
    let _idle: Vec<_> = (0..200)
        .map(|_| std::net::TcpStream::connect(sidecar.addr).unwrap())
        .collect();
    let (code, log) = terminate(&mut sidecar, Duration::from_secs(3 + 2 + 2));
    assert_eq!(code, Some(0), "{log}");
}

fn cli(addr: SocketAddr, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(BINARY)
        .args(args)
        .env("DEDUPD_ADDR", addr.to_string())
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Claims `id` and commits `response` through the CLI.
fn cli_commit(addr: SocketAddr, id: &str, response: &str) {
    let (_, stdout, _) = cli(addr, &["claim", id, "--json"]);
    let claimed: Value = serde_json::from_str(&stdout).unwrap();
    let token = claimed["lease_token"].as_str().unwrap().to_owned();
    let (code, stdout, _) = cli(
        addr,
        &[
            "commit",
            id,
            "--lease-token",
            &token,
            "--response",
            response,
        ],
    );
    assert_eq!(code, 0, "{stdout}");
}

#[test]
fn cli_claims_commits_and_reports_outcomes_with_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(dir.path());
    let addr = sidecar.addr;

    let (code, stdout, _) = cli(
        addr,
        &["claim", "order-1", "--event-type", "OrderPlaced", "--json"],
    );
    assert_eq!(code, 0);
    let claimed: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(claimed["outcome"], "CLAIMED");
    let token = claimed["lease_token"].as_str().unwrap().to_owned();

    let (code, stdout, _) = cli(addr, &["claim", "order-1"]);
    assert_eq!(code, 11, "IN_PROGRESS exit code");
    assert!(stdout.starts_with("outcome: IN_PROGRESS"), "{stdout}");

    let (code, stdout, _) = cli(
        addr,
        &[
            "commit",
            "order-1",
            "--lease-token",
            &token,
            "--response",
            "created",
        ],
    );
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains("outcome: COMMITTED"), "{stdout}");

    let (code, stdout, _) = cli(addr, &["claim", "order-1", "--json"]);
    assert_eq!(code, 10, "DUPLICATE exit code");
    let duplicate: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(duplicate["record"]["response"], "created");
    assert_eq!(duplicate["record"]["event_type"], "OrderPlaced");

    let (code, stdout, _) = cli(addr, &["lookup", "order-1"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("state: COMMITTED"), "{stdout}");
    assert!(stdout.contains("committed_at: "), "{stdout}");

    let (code, stdout, _) = cli(addr, &["health"]);
    assert_eq!((code, stdout.trim()), (0, "status: SERVING"));

    let (code, stdout, _) = cli(addr, &["forget", "order-1", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&stdout).unwrap()["existed"],
        true
    );

    let (code, _, stderr) = cli(addr, &["claim", "bad\u{1}id"]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("INVALID_ARGUMENT") && stderr.contains("correlation_id"),
        "{stderr}"
    );

    let (code, _, stderr) = cli(
        addr,
        &["commit", "order-2", "--lease-token", &"0".repeat(32)],
    );
    assert_eq!(code, 1);
    assert!(
        stderr.contains("FAILED_PRECONDITION") && stderr.contains("LEASE_LOST"),
        "{stderr}"
    );

    let (code, stdout, _) = cli(
        addr,
        &[
            "claim",
            "-n",
            "statuses",
            "s-2",
            "--ordering-key",
            "link",
            "--sequence",
            "2",
        ],
    );
    assert_eq!(code, 0, "{stdout}");
    let token = stdout
        .lines()
        .find_map(|line| line.strip_prefix("lease_token: "))
        .unwrap()
        .to_owned();
    assert_eq!(
        cli(
            addr,
            &["commit", "-n", "statuses", "s-2", "--lease-token", &token]
        )
        .0,
        0
    );
    let (code, stdout, _) = cli(
        addr,
        &[
            "claim",
            "-n",
            "statuses",
            "s-1",
            "--ordering-key",
            "link",
            "--sequence",
            "1",
        ],
    );
    assert_eq!(code, 13, "STALE exit code: {stdout}");
    assert!(stdout.contains("highest_committed_sequence: 2"), "{stdout}");
}

#[test]
fn cli_speaks_tls_to_a_tls_sidecar() {
    let dir = tempfile::tempdir().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server_cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let write = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (cert, key, ca) = (
        write("server.pem", &server_cert.pem()),
        write("server.key", &server_key.serialize_pem()),
        write("ca.pem", &ca_pem),
    );
    let sidecar = Sidecar::start_with(
        &dir.path().join("data"),
        &["--tls-cert", &cert, "--tls-key", &key],
    );
    let https = format!("https://localhost:{}", sidecar.addr.port());
    let output = Command::new(BINARY)
        .args([
            "claim",
            "tls-cli-1",
            "--json",
            "--addr",
            &https,
            "--tls-ca",
            &ca,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        serde_json::from_str::<Value>(&stdout).unwrap()["outcome"],
        "CLAIMED"
    );
    // Plaintext against the TLS port fails cleanly.
    let plain = Command::new(BINARY)
        .args(["claim", "tls-cli-2", "--addr", &sidecar.addr.to_string()])
        .output()
        .unwrap();
    assert_eq!(plain.status.code(), Some(1));
}

/// The CLI shows an erased answer as erased (`response_erased`), not as an
/// empty answer: the sidecar sealed it with a key since destroyed and
/// declared so with --erased-key-id.
#[test]
fn cli_shows_an_erased_answer_as_erased() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("a.key");
    std::fs::write(&key, "cd".repeat(32)).unwrap();
    let key_id = dedupd::sealing::Keyring::from_bytes(&[[0xcd; 32]])
        .unwrap()
        .sealing_id()
        .to_string();
    let data = dir.path().join("data");
    let mut sealing = Sidecar::start_with(&data, &["--encryption-key-file", key.to_str().unwrap()]);
    cli_commit(sealing.addr, "card-1", "4242");
    let (code, _) = common::sidecar::terminate(&mut sealing, Duration::from_secs(15));
    assert_eq!(code, Some(0));
    drop(sealing);

    let erased = Sidecar::start_with(&data, &["--erased-key-id", &key_id]);
    let (code, stdout, _) = cli(erased.addr, &["lookup", "card-1", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let looked: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(looked["record"]["response_erased"], true, "{stdout}");
    assert_eq!(looked["record"]["response"], "", "{stdout}");
}

/// `dedupd rekey` re-seals what the old key sealed, reporting progress,
/// and the old key can then be removed: the answer still replays.
#[test]
fn rekey_reseals_with_the_new_key_so_the_old_one_can_go() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("2026.key"), dir.path().join("2027.key"));
    std::fs::write(&old, "a1".repeat(32)).unwrap();
    std::fs::write(&new, "b2".repeat(32)).unwrap();
    let data = dir.path().join("data");
    let flag = |path: &std::path::Path| path.to_str().unwrap().to_owned();
    let commit =
        |sidecar: &Sidecar, id: &str| cli_commit(sidecar.addr, id, &format!("answer {id}"));
    let stop = |mut sidecar: Sidecar| {
        let (code, log) = common::sidecar::terminate(&mut sidecar, Duration::from_secs(15));
        assert_eq!(code, Some(0), "{log}");
    };

    let first = Sidecar::start_with(&data, &["--encryption-key-file", &flag(&old)]);
    for id in ["r-1", "r-2", "r-3"] {
        commit(&first, id);
    }
    stop(first);
    let both = [
        "--encryption-key-file",
        &flag(&old),
        "--encryption-key-file",
        &flag(&new),
    ];
    let rotated = Sidecar::start_with(&data, &both);
    commit(&rotated, "r-4");
    let (code, stdout, stderr) = cli(rotated.addr, &["rekey", "--page-size", "2"]);
    assert_eq!(code, 0, "{stdout} {stderr}");
    assert!(
        stderr.contains("rekey: page 2:"),
        "progress per page: {stderr}"
    );
    assert!(stdout.contains("resealed: 3"), "{stdout}");
    // The pass opened everything: the store forgets the old key, so the
    // sidecar below starts without it (it would exit 64 otherwise).
    assert!(stdout.contains("retired_old_keys: true"), "{stdout}");
    let (code, stdout, _) = cli(rotated.addr, &["rekey", "--json"]);
    assert_eq!(code, 0);
    let again: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (again["resealed"].as_u64(), again["current"].as_u64()),
        (Some(0), Some(4))
    );
    stop(rotated);

    let new_only = Sidecar::start_with(&data, &["--encryption-key-file", &flag(&new)]);
    for id in ["r-1", "r-2", "r-3", "r-4"] {
        let (code, stdout, _) = cli(new_only.addr, &["lookup", id, "--json"]);
        assert_eq!(code, 0, "{stdout}");
        let looked: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(
            looked["record"]["response"],
            format!("answer {id}"),
            "{stdout}"
        );
    }
}

/// The store remembers which keys sealed its answers: a sidecar started
/// without one of them (another key only, or none) exits 64 with one line
/// naming it, before serving; with the key as an opening key, or the key
/// declared destroyed, it starts.
#[test]
fn a_sidecar_without_a_key_its_store_needs_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.key"), dir.path().join("b.key"));
    std::fs::write(&a, "c3".repeat(32)).unwrap();
    std::fs::write(&b, "d4".repeat(32)).unwrap();
    let a_id = dedupd::sealing::Keyring::from_bytes(&[[0xc3; 32]])
        .unwrap()
        .sealing_id()
        .to_string();
    let data = dir.path().join("data");
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let mut sealing = Sidecar::start_with(&data, &["--encryption-key-file", &path(&a)]);
    cli_commit(sealing.addr, "k-1", "sealed");
    let (code, _) = common::sidecar::terminate(&mut sealing, Duration::from_secs(15));
    assert_eq!(code, Some(0));
    drop(sealing);

    for args in [vec!["--encryption-key-file".to_owned(), path(&b)], vec![]] {
        let output = Command::new(BINARY)
            .args(&args)
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        let line = stderr
            .lines()
            .find(|line| line.starts_with("dedupd: invalid configuration"))
            .unwrap_or_else(|| panic!("one configuration line: {stderr}"));
        assert!(line.contains(&a_id), "names the key: {line}");
    }
    for extra in [
        vec!["--decryption-key-file".to_owned(), path(&a)],
        vec!["--erased-key-id".to_owned(), a_id.clone()],
    ] {
        let mut flags = vec!["--encryption-key-file".to_owned(), path(&b)];
        flags.extend(extra);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut started = Sidecar::start_with(&data, &flags);
        let (code, stdout, _) = cli(started.addr, &["lookup", "k-1", "--json"]);
        assert_eq!(code, 0, "{flags:?}: {stdout}");
        let (code, _) = common::sidecar::terminate(&mut started, Duration::from_secs(15));
        assert_eq!(code, Some(0));
    }
}

/// Key files are read again while the sidecar runs: a key added to the
/// directory (sorting last) seals from then on — `rekey` finds the answer
/// the first key sealed to re-seal — and a key taken away is kept until
/// the next restart (what it sealed still opens).
#[test]
fn a_key_added_to_the_directory_seals_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    std::fs::write(keys.join("2026.key"), "e5".repeat(32)).unwrap();
    let data = dir.path().join("data");
    let keys_flag = keys.to_str().unwrap().to_owned();
    let mut sidecar = Sidecar::start_with(
        &data,
        &[
            "--encryption-key-file",
            &keys_flag,
            "--key-reload-interval",
            "100ms",
        ],
    );
    let commit = |id: &str| cli_commit(sidecar.addr, id, &format!("answer {id}"));
    commit("k-1");
    std::fs::write(keys.join("2027.key"), "f6".repeat(32)).unwrap();
    // Re-sealing finds k-1 once the new key is in force.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, stdout, _) = cli(sidecar.addr, &["rekey", "--json"]);
        assert_eq!(code, 0, "{stdout}");
        let report: Value = serde_json::from_str(&stdout).unwrap();
        if report["resealed"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new key never sealed: {stdout}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    commit("k-2");
    std::fs::remove_file(keys.join("2027.key")).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    for id in ["k-1", "k-2"] {
        let (code, stdout, _) = cli(sidecar.addr, &["lookup", id, "--json"]);
        assert_eq!(code, 0, "{stdout}");
        let looked: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(
            looked["record"]["response"],
            format!("answer {id}"),
            "{stdout}"
        );
    }
    let (code, log) = common::sidecar::terminate(&mut sidecar, Duration::from_secs(15));
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("sealing keys reloaded"), "{log}");
    assert!(log.contains("is gone from the key files"), "{log}");
}

/// The store remembers the key its correlation IDs are hashed with: a
/// sidecar with another key, or none, exits 64 (it would find no record and
/// process every event again); with the same key it finds them.
#[test]
fn a_sidecar_with_another_id_hashing_key_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let (first, other) = (dir.path().join("ids.key"), dir.path().join("other.key"));
    std::fs::write(&first, "17".repeat(32)).unwrap();
    std::fs::write(&other, "28".repeat(32)).unwrap();
    let data = dir.path().join("data");
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let mut hashing = Sidecar::start_with(&data, &["--hash-correlation-ids", &path(&first)]);
    cli_commit(hashing.addr, "alice@example.com", "done");
    let (code, _) = common::sidecar::terminate(&mut hashing, Duration::from_secs(15));
    assert_eq!(code, Some(0));
    drop(hashing);

    for args in [
        vec!["--hash-correlation-ids".to_owned(), path(&other)],
        vec![],
    ] {
        let output = Command::new(BINARY)
            .args(&args)
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains("correlation IDs are hashed"),
            "{args:?}: {stderr}"
        );
    }
    let mut again = Sidecar::start_with(&data, &["--hash-correlation-ids", &path(&first)]);
    let (code, stdout, _) = cli(again.addr, &["lookup", "alice@example.com", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let looked: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(looked["record"]["response"], "done", "{stdout}");
    let (code, _) = common::sidecar::terminate(&mut again, Duration::from_secs(15));
    assert_eq!(code, Some(0));
}
