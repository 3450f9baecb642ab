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

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    targets = state_machine, stores
}
criterion_main!(benches);
