//! Micro-benchmarks of the hot path without the network: the pure state
//! machine, and the engine's read-modify-write on each store. A regression
//! here shows up without running the gRPC benchmark (`cargo bench`).

use std::{
    convert::Infallible,
    hint::black_box,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use criterion::{criterion_group, criterion_main, Criterion};
use dedupd::{
    api::Limits,
    clock::{SystemClock, UnixMillis},
    domain::{ClaimRequest, CommitRequest, FencingToken, LeaseToken},
    engine::Engine,
    machine,
    proto::v1 as pb,
    sealing::Keyring,
    store::{
        memory::MemoryStore,
        sled::{SledConfig, SledStore, SyncMode},
        Store,
    },
};

// The same allocator as the dedupd binary, so the figures match its hot path.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn claim_request(limits: &Limits, id: &str) -> ClaimRequest {
    limits
        .claim(pb::ClaimRequest {
            namespace: "bench".into(),
            correlation_id: id.into(),
            event_type: "PaymentReceived".into(),
            consumer_version: "1.0.0".into(),
            ..Default::default()
        })
        .expect("valid")
}

fn state_machine(c: &mut Criterion) {
    let limits = Limits::default();
    let request = claim_request(&limits, "evt-1");
    let now = UnixMillis(1_767_225_600_000);
    let (_, claimed) = machine::claim(None, &request, now, LeaseToken(1), None, || {
        Ok::<_, Infallible>(FencingToken(1))
    })
    .unwrap();
    let dedupd::domain::ClaimOutcome::Claimed { record, .. } = claimed else {
        unreachable!()
    };
    let commit = CommitRequest {
        key: request.key.clone(),
        lease_token: LeaseToken(1),
        response: b"ok".to_vec(),
        retention: None,
    };
    let (machine::Change::Put(committed), _) = machine::commit(Some(&record), &commit, now) else {
        unreachable!()
    };
    c.bench_function("machine/claim absent", |b| {
        b.iter(|| {
            machine::claim(None, black_box(&request), now, LeaseToken(2), None, || {
                Ok::<_, Infallible>(FencingToken(2))
            })
        })
    });
    c.bench_function("machine/claim duplicate", |b| {
        b.iter(|| {
            machine::claim(
                Some(black_box(&committed)),
                &request,
                now,
                LeaseToken(2),
                None,
                || Ok::<_, Infallible>(FencingToken(2)),
            )
        })
    });
    c.bench_function("machine/commit", |b| {
        b.iter(|| machine::commit(Some(black_box(&record)), &commit, now))
    });
}

/// Claim (and optionally commit) a fresh key per iteration through `engine`.
fn engine_paths<S: Store>(c: &mut Criterion, name: &str, engine: Engine<S>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = Limits::default();
    let counter = AtomicU64::new(0);
    let fresh = || {
        claim_request(
            &limits,
            &format!("evt-{}", counter.fetch_add(1, Ordering::Relaxed)),
        )
    };
    c.bench_function(&format!("{name}/claim fresh"), |b| {
        b.iter(|| runtime.block_on(engine.claim(&fresh())).unwrap())
    });
    c.bench_function(&format!("{name}/claim+commit fresh"), |b| {
        b.iter(|| {
            runtime.block_on(async {
                let request = fresh();
                let dedupd::domain::ClaimOutcome::Claimed { record, .. } =
                    engine.claim(&request).await.unwrap()
                else {
                    panic!("fresh key not claimed");
                };
                let commit = CommitRequest {
                    key: request.key,
                    lease_token: record.lease_token,
                    response: Vec::new(),
                    retention: None,
                };
                engine.commit(&commit).await.unwrap()
            })
        })
    });
    let duplicate = fresh();
    runtime.block_on(async {
        let dedupd::domain::ClaimOutcome::Claimed { record, .. } =
            engine.claim(&duplicate).await.unwrap()
        else {
            panic!("not claimed")
        };
        let commit = CommitRequest {
            key: duplicate.key.clone(),
            lease_token: record.lease_token,
            response: Vec::new(),
            retention: None,
        };
        engine.commit(&commit).await.unwrap();
    });
    c.bench_function(&format!("{name}/claim duplicate"), |b| {
        b.iter(|| runtime.block_on(engine.claim(&duplicate)).unwrap())
    });
}

fn stores(c: &mut Criterion) {
    engine_paths(
        c,
        "memory",
        Engine::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock)),
    );
    for (name, sync) in [
        ("sled sync=none", SyncMode::None),
        ("sled sync=always", SyncMode::Always),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&SledConfig {
            sync,
            ..SledConfig::new(dir.path())
        })
        .unwrap();
        engine_paths(c, name, Engine::new(Arc::new(store), Arc::new(SystemClock)));
    }
}

/// What sealing answers costs (issue 43): Claim+Commit of a fresh key and
/// the replay of a committed one (a duplicate Claim: what the proxy's
/// replay does in the store), with 1 KiB and 64 KiB answers, plaintext
/// and sealed side by side, on sled with `--sync none` so the cipher is not
/// hidden behind the disk.
fn sealing(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let limits = Limits::default();
    let counter = AtomicU64::new(0);
    for size in [1 << 10, 64 << 10] {
        let answer: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        for sealed in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let store = SledStore::open(&SledConfig {
                sync: SyncMode::None,
                ..SledConfig::new(dir.path())
            })
            .unwrap();
            let keyring = sealed.then(|| Arc::new(Keyring::from_bytes(&[[7; 32]]).unwrap()));
            let engine = Engine::new(Arc::new(store), Arc::new(SystemClock)).with_keyring(keyring);
            let name = format!(
                "sealing/{} KiB {}",
                size >> 10,
                if sealed { "sealed" } else { "plaintext" }
            );
            let claim_and_commit = |id: String| {
                let request = claim_request(&limits, &id);
                let answer = answer.clone();
                let engine = &engine;
                async move {
                    let dedupd::domain::ClaimOutcome::Claimed { record, .. } =
                        engine.claim(&request).await.unwrap()
                    else {
                        panic!("fresh key not claimed");
                    };
                    engine
                        .commit(&CommitRequest {
                            key: request.key,
                            lease_token: record.lease_token,
                            response: answer,
                            retention: None,
                        })
                        .await
                        .unwrap()
                }
            };
            c.bench_function(&format!("{name}/claim+commit"), |b| {
                b.iter(|| {
                    let id = format!("evt-{}", counter.fetch_add(1, Ordering::Relaxed));
                    runtime.block_on(claim_and_commit(id))
                })
            });
            let replayed = claim_request(&limits, "replayed");
            runtime.block_on(claim_and_commit("replayed".into()));
            c.bench_function(&format!("{name}/replay"), |b| {
                b.iter(|| {
                    let outcome = runtime.block_on(engine.claim(&replayed)).unwrap();
                    let dedupd::domain::ClaimOutcome::Duplicate { record } = outcome else {
                        panic!("not a duplicate");
                    };
                    assert_eq!(record.response.len(), size);
                })
            });
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = state_machine, stores, sealing
}
criterion_main!(benches);
