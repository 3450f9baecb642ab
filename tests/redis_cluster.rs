//! The Redis store on a Redis Cluster (three primaries, a replica each:
//! `DEDUPD_TEST_REDIS_CLUSTER_URL`, or one the harness starts): records
//! spread over every primary, `--store-replicas 1` fenced on each key's own
//! primary, the deletion feed heard from every primary (and ended when one
//! stops taking its probes), and the eviction
//! check made on every primary. (The wire suite and the shared-store
//! scenarios run on the cluster too, with `DEDUPD_TEST_STORE=redis-cluster`;
//! a primary killed mid-run: examples/python/failure_sequence.)

mod common;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use dedupd::{
    clock::SystemClock,
    domain::{ClaimOutcome, ClaimRequest, CommitRequest, Key},
    engine::Engine,
    machine::Change,
    store::{
        redis::{Connection, RedisConfig, RedisStore},
        shared::DeletionFeed,
        Store,
    },
};
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo, SingleNodeRoutingInfo,
};

fn cluster_url() -> Option<&'static str> {
    dedupd_testkit::services::require_redis_cluster()
}

fn config(url: &str, prefix: &str, replicas: u32) -> RedisConfig {
    RedisConfig {
        url: url.to_owned(),
        prefix: prefix.to_owned(),
        connections: 2,
        timeout: Duration::from_secs(5),
        ca_pem: None,
        replicas,
        allow_eviction: false,
        cluster: false,
    }
}

/// `command` on every primary: its answer by node address.
async fn on_every_primary(
    connection: &mut Connection,
    command: &redis::Cmd,
) -> BTreeMap<String, redis::Value> {
    let answer = connection
        .route(
            command.clone(),
            RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::Special),
            )),
        )
        .await
        .expect("every primary answers");
    let redis::Value::Map(by_node) = answer else {
        panic!("not an answer by node: {answer:?}")
    };
    by_node
        .into_iter()
        .map(|(node, value)| (redis::from_redis_value(node).unwrap(), value))
        .collect()
}

/// `CONFIG SET <name> <value>` on the node at `address`.
async fn config_set(connection: &mut Connection, address: &str, name: &str, value: &str) {
    let (host, port) = address.rsplit_once(':').unwrap();
    connection
        .route(
            redis::cmd("CONFIG").arg("SET").arg(name).arg(value).clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.to_owned(),
                port: port.parse().unwrap(),
            }),
        )
        .await
        .unwrap();
}

/// How many `WAIT`s each primary has run (only fences wait).
async fn fences_by_primary(connection: &mut Connection) -> BTreeMap<String, u64> {
    on_every_primary(connection, redis::cmd("INFO").arg("commandstats"))
        .await
        .into_iter()
        .map(|(node, info)| {
            let info: String = redis::from_redis_value(info).unwrap();
            let calls = info
                .lines()
                .find_map(|line| line.strip_prefix("cmdstat_wait:calls="))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |calls| calls.parse().unwrap());
            (node, calls)
        })
        .collect()
}

fn key(n: usize) -> Key {
    Key::from_bytes(format!("payments\0pay-{n}").as_bytes()).unwrap()
}

/// A Claim, then a Commit, of `key` through the engine over `store`.
async fn claim_and_commit(engine: &Engine<RedisStore>, key: &Key) {
    let claim = ClaimRequest::plain(
        key.clone(),
        Duration::from_secs(30),
        Duration::from_secs(600),
    );
    let ClaimOutcome::Claimed { record, .. } = engine.claim(&claim).await.unwrap() else {
        panic!("{key} is new")
    };
    engine
        .commit(&CommitRequest {
            key: key.clone(),
            lease_token: record.lease_token,
            response: b"done".to_vec(),
            retention: None,
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_keeps_every_primarys_records_fenced_fed_and_checked() {
    let Some(url) = cluster_url() else {
        return;
    };
    let prefix = common::redis::fresh_prefix();
    // Two sidecars; the first waits for one replica of each key's primary.
    let fenced = RedisStore::new(&config(url, &prefix, 1), Arc::new(SystemClock)).unwrap();
    // (Its calls bounded by 1 s: the probe of a paused primary times out.)
    let other = RedisStore::new(
        &RedisConfig {
            timeout: Duration::from_secs(1),
            ..config(url, &prefix, 0)
        },
        Arc::new(SystemClock),
    )
    .unwrap();
    assert_eq!(fenced.eviction_refusal().await.unwrap(), None);
    assert_eq!(other.eviction_refusal().await.unwrap(), None);
    let mut inspect = fenced.inspection_connection();

    // The deletion feed, subscribed on one seed node, hears deletions made
    // on every primary (a classic PUBLISH reaches every node).
    let mut deleted = other.subscribe().await.unwrap();

    let (on_fenced, on_other) = (
        Engine::new(Arc::new(fenced.clone()), Arc::new(SystemClock)),
        Engine::new(Arc::new(other.clone()), Arc::new(SystemClock)),
    );
    let fences_before = fences_by_primary(&mut inspect).await;
    let keys: Vec<Key> = (0..60).map(key).collect();
    for key in &keys {
        claim_and_commit(&on_fenced, key).await;
        let claim = ClaimRequest::plain(
            key.clone(),
            Duration::from_secs(30),
            Duration::from_secs(600),
        );
        match on_other.claim(&claim).await.unwrap() {
            ClaimOutcome::Duplicate { record } => assert_eq!(record.response, b"done"),
            other => panic!("{key} on the other sidecar: {other:?}"),
        }
    }
    // Every primary holds some of them (60 keys over three primaries: all
    // on one or two would be a one-in-10^10 draw), and fenced some: each
    // fence ran on its key's own primary.
    let fences_after = fences_by_primary(&mut inspect).await;
    for (node, after) in &fences_after {
        let before = fences_before.get(node).copied().unwrap_or_default();
        assert!(
            *after > before,
            "no fence ran on {node}: {before} then {after} WAITs"
        );
    }
    let sizes = on_every_primary(&mut inspect, &redis::cmd("DBSIZE")).await;
    assert_eq!(sizes.len(), 3, "three primaries: {sizes:?}");
    let scan = |node: &str| {
        let (host, port) = node.rsplit_once(':').unwrap();
        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: host.to_owned(),
            port: port.parse().unwrap(),
        })
    };
    for node in sizes.keys() {
        let answer = inspect
            .route(
                redis::cmd("SCAN")
                    .arg(0)
                    .arg("MATCH")
                    .arg(format!("{prefix}:*"))
                    .arg("COUNT")
                    .arg(100_000)
                    .clone(),
                scan(node),
            )
            .await
            .unwrap();
        let (_, found): (u64, Vec<String>) = redis::from_redis_value(answer).unwrap();
        let records = found.iter().filter(|key| key.contains(":r:")).count();
        assert!(records > 0, "{node} holds none of the records: {found:?}");
    }

    // A Forget on any primary is heard.
    for key in &keys[..12] {
        let existed = fenced
            .update(key, |current, _| Ok((Change::Delete, current.is_some())))
            .await
            .unwrap();
        assert!(existed, "{key}");
        let heard = tokio::time::timeout(Duration::from_secs(5), deleted.recv())
            .await
            .unwrap_or_else(|_| panic!("the deletion of {key} was not heard within 5 s"))
            .expect("the feed is open");
        assert_eq!(&heard, key);
    }

    // The feed heard every primary's probes so far; a primary that stops
    // taking them (writes paused: PUBLISH waits) ends the feed within a
    // heartbeat and a store timeout (here 1 s, so about 2 s). (Echoes that
    // a bus link drops: the probes' unit test.) The pause outlasts the
    // wait, so a slow machine can only make the feed end late, never see
    // the primary answer again first.
    assert!(
        matches!(
            deleted.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty)
        ),
        "the feed is up and quiet"
    );
    let paused = sizes.keys().next().unwrap().clone();
    let (host, port) = paused.rsplit_once(':').unwrap();
    inspect
        .route(
            redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(30_000)
                .arg("WRITE")
                .clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.to_owned(),
                port: port.parse().unwrap(),
            }),
        )
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), deleted.recv()).await;
    inspect
        .route(
            redis::cmd("CLIENT").arg("UNPAUSE").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.to_owned(),
                port: port.parse().unwrap(),
            }),
        )
        .await
        .unwrap();
    assert!(
        matches!(ended, Ok(None)),
        "the feed did not end while {paused} took no probe: {ended:?}"
    );

    // One primary that may evict is enough to refuse the cluster, named.
    let evicting = sizes.keys().nth(1).unwrap().clone();
    config_set(&mut inspect, &evicting, "maxmemory", "1gb").await;
    config_set(&mut inspect, &evicting, "maxmemory-policy", "allkeys-lru").await;
    let refused = fenced.eviction_refusal().await;
    config_set(&mut inspect, &evicting, "maxmemory-policy", "noeviction").await;
    config_set(&mut inspect, &evicting, "maxmemory", "0").await;
    let refused = refused
        .unwrap()
        .expect("refused while one primary may evict");
    assert!(
        refused.contains(&evicting) && refused.contains("allkeys-lru"),
        "{refused}"
    );
    assert_eq!(fenced.eviction_refusal().await.unwrap(), None);

    common::redis::drop_prefix(&prefix).await;
}
