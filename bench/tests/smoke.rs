//! A smoke run of every target and workload of `dedupd-bench load`: it works
//! and checks itself. Never a timing assertion. The sidecar and the no-op
//! server run in this process on `127.0.0.1:0`; Redis and PostgreSQL are the
//! tests' (see `dedupd-testkit`: given, the machine's, or started for the
//! run), each skipped loudly where there is none.

use std::{process::Command, sync::Arc};

use dedupd::{
    store::sled::{SledConfig, SledStore},
    ServerConfig,
};
use serde_json::Value;
use tokio::{net::TcpListener, sync::oneshot};

const BINARY: &str = env!("CARGO_BIN_EXE_dedupd-bench");

fn load_json(args: Vec<String>) -> Value {
    let output = Command::new(BINARY)
        .arg("load")
        .args(&args)
        .args([
            "--json",
            "--worker-threads",
            "1",
            "--concurrency",
            "8",
            "--channels",
            "2",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "load {args:?} failed: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&stdout).expect("one JSON object")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_target_and_workload_runs_and_checks_itself() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        SledStore::open(&SledConfig {
            cache_capacity_bytes: 16 << 20,
            ..SledConfig::new(dir.path())
        })
        .unwrap(),
    );
    let sidecar = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sidecar_addr = sidecar.local_addr().unwrap();
    let (stop_sidecar, sidecar_stopped) = oneshot::channel::<()>();
    let sidecar_task = tokio::spawn(dedupd::run(
        sidecar,
        store,
        ServerConfig::default(),
        async {
            let _ = sidecar_stopped.await;
        },
    ));
    let noop = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let noop_addr = noop.local_addr().unwrap();
    let (stop_noop, noop_stopped) = oneshot::channel::<()>();
    let noop_task = tokio::spawn(dedupd_bench::noop::serve(noop, async {
        let _ = noop_stopped.await;
    }));

    let mut targets = vec![
        format!("dedupd://{sidecar_addr}"),
        format!("noop://{noop_addr}"),
    ];
    let shared = tokio::task::spawn_blocking(|| {
        (
            dedupd_testkit::services::require_redis(),
            dedupd_testkit::services::require_postgres(),
        )
    })
    .await
    .unwrap();
    targets.extend(
        [shared.0, shared.1]
            .into_iter()
            .flatten()
            .map(|service| service.url.clone()),
    );
    for target in &targets {
        for (workload, extra) in [
            ("claim", vec![]),
            ("claim-commit", vec![]),
            ("duplicate-heavy", vec!["--duplicate-share", "0.5"]),
            ("batch", vec!["--batch-size", "50"]),
            ("batch-commit", vec!["--batch-size", "50"]),
        ] {
            let mut args = vec![
                "--target",
                target,
                "--workload",
                workload,
                "--requests",
                "400",
            ];
            args.extend(extra);
            let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
            let report = tokio::task::spawn_blocking(move || load_json(args))
                .await
                .unwrap();
            assert_eq!(
                report["checks_passed"], true,
                "{target} {workload}: {report}"
            );
            assert_eq!(report["errors"], 0, "{target} {workload}: {report}");
            assert!(
                report["ops"].as_u64().unwrap() >= 400,
                "{target} {workload}: {report}"
            );
            let claimed = report["outcomes"]["CLAIMED"].as_u64().unwrap_or(0);
            assert!(claimed > 0, "{target} {workload}: {report}");
            if workload == "duplicate-heavy" && !target.starts_with("noop") {
                assert!(
                    report["outcomes"]["DUPLICATE"].as_u64().unwrap_or(0) > 0,
                    "{report}"
                );
            }
        }
    }
    let _ = stop_sidecar.send(());
    let _ = stop_noop.send(());
    sidecar_task.await.unwrap().expect("sidecar stops cleanly");
    noop_task
        .await
        .unwrap()
        .expect("no-op server stops cleanly");
}
