//! Sealed answers (issue 43): with `--encryption-key-file`, no answer
//! reaches a store in plaintext — read back through each store's raw bytes
//! (sled's files, the PostgreSQL rows, the Redis values, the shared stores'
//! local tier) — while every duplicate still gets its answer; an answer
//! altered in the store, or moved onto another record, is refused, never
//! replayed and never claimed afresh.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use common::{postgres, redis, *};
use dedupd::{
    domain::Key,
    hashed_ids::IdHasher,
    machine::Change,
    proto::v1 as pb,
    sealing::{KeyId, Keyring},
    store::{Attempt, ScanCursor, Store},
};

fn keyring() -> Arc<Keyring> {
    Arc::new(Keyring::from_bytes(&[[0x5a; 32]]).expect("a key"))
}

/// A marker no store holds by chance.
fn marker() -> String {
    format!("MARKER-{}", uuid_like())
}

fn uuid_like() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Commits `answer` for `id`, then checks a duplicate gets it back.
async fn commit_and_replay<S: Store + TestSpace>(server: &TestServer<S>, id: &str, answer: &[u8]) {
    let mut client = server.client().await;
    claim_and_commit(&mut client, id, answer.to_vec())
        .await
        .expect("claim and commit");
    let again = claim(&mut client, claim_request(id)).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Duplicate);
    assert_eq!(again.record.expect("a record").response, answer);
}

/// Every column of every row of `schema`'s tables, as PostgreSQL's text.
async fn postgres_rows_hold(schema: &str, needle: &str) -> bool {
    let (client, connection) = tokio_postgres::connect(postgres::url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);
    let tables = client
        .query(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
            &[&schema],
        )
        .await
        .expect("tables");
    let mut found = false;
    for table in tables {
        let table: String = table.get(0);
        // `bytea` as text is hex: look for both spellings.
        let hex: String = needle.bytes().map(|b| format!("{b:02x}")).collect();
        let rows = client
            .query(&format!("SELECT t::text FROM {schema}.{table} t"), &[])
            .await
            .expect("rows");
        for row in rows {
            let text: String = row.get(0);
            found |= text.contains(needle) || text.contains(&hex);
        }
    }
    drop(client);
    let _ = connection.await;
    found
}

/// Every value under `prefix`, whatever its type.
async fn redis_values_hold(prefix: &str, needle: &[u8]) -> bool {
    let mut connection = redis::connection().await;
    let mut found = false;
    for key in redis::keys(prefix).await {
        let kind: String = ::redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut connection)
            .await
            .expect("TYPE");
        let command = match kind.as_str() {
            "string" => ::redis::cmd("GET").arg(&key).clone(),
            "hash" => ::redis::cmd("HGETALL").arg(&key).clone(),
            "zset" => ::redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .clone(),
            "set" => ::redis::cmd("SMEMBERS").arg(&key).clone(),
            "list" => ::redis::cmd("LRANGE").arg(&key).arg(0).arg(-1).clone(),
            other => panic!("{key}: a {other} the test cannot read"),
        };
        let value: ::redis::Value = command.query_async(&mut connection).await.expect("read");
        found |= value_holds(&value, needle);
    }
    found
}

fn value_holds(value: &::redis::Value, needle: &[u8]) -> bool {
    match value {
        ::redis::Value::BulkString(bytes) => bytes.windows(needle.len()).any(|w| w == needle),
        ::redis::Value::Array(items) | ::redis::Value::Set(items) => {
            items.iter().any(|item| value_holds(item, needle))
        }
        ::redis::Value::Map(pairs) => pairs
            .iter()
            .any(|(k, v)| value_holds(k, needle) || value_holds(v, needle)),
        ::redis::Value::SimpleString(text) => {
            text.as_bytes().windows(needle.len()).any(|w| w == needle)
        }
        _ => false,
    }
}

/// The store's raw bytes hold the answer and the correlation ID exactly
/// when they are not protected (answers sealed, IDs hashed): the check that
/// finds nothing with the keys finds both markers without them.
async fn raw_bytes_show_the_answer(space: Option<Space>, protected: bool) {
    let builder = TestServer::builder().config(move |config| {
        config.keyring = protected.then(keyring);
        config.hashed_ids = protected.then(|| Arc::new(IdHasher::from_bytes(&[0x6b; 32])));
    });
    match space {
        // sled itself, whichever store the suite runs on.
        None => {
            let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
            let store = Arc::new(open_store(&dir.path().join("data")));
            let server = builder
                .in_dir(dir, dedupd::clock::ManualClock::new(START))
                .start_with_store(store)
                .await;
            look_for_the_answer(server, None, protected).await;
        }
        Some(space) => {
            let server = builder.in_space(Some(space.clone())).start().await;
            look_for_the_answer(server, Some(space), protected).await;
        }
    }
}

async fn look_for_the_answer<S: Store + TestSpace>(
    server: TestServer<S>,
    space: Option<Space>,
    protected: bool,
) {
    let answer = marker();
    // An ID that is personal data, and unique to this run.
    let person = format!("{}@example.com", uuid_like());
    commit_and_replay(&server, &person, answer.as_bytes()).await;
    // Lookup finds it by the ID the caller knows, hashed or not.
    let mut client = server.client().await;
    let looked = client
        .lookup(pb::LookupRequest {
            correlation_id: person.clone(),
            ..Default::default()
        })
        .await
        .expect("lookup")
        .into_inner();
    let record = looked.record.expect("found by its ID");
    assert_eq!(
        record.correlation_id, person,
        "the caller's ID, never the hash"
    );
    assert_eq!(record.response, answer.as_bytes());
    // The shared store's rows, values and key names, before stopping
    // removes them.
    let mut found = [false; 2];
    for (needle, found) in [answer.as_str(), person.as_str()]
        .into_iter()
        .zip(&mut found)
    {
        *found = match &space {
            Some(Space::Postgres(schema)) => postgres_rows_hold(schema, needle).await,
            Some(Space::Redis(prefix)) => {
                redis_values_hold(prefix, needle.as_bytes()).await
                    || redis::keys(prefix)
                        .await
                        .iter()
                        .any(|key| key.contains(needle))
            }
            None => false,
        };
    }
    // Then every file: sled's, or the shared store's local tier.
    let dir = Arc::clone(&server.dir);
    server.stop().await.expect("clean stop");
    found[0] |= files_hold(dir.path(), answer.as_bytes());
    found[1] |= files_hold(dir.path(), person.as_bytes());
    assert_eq!(
        found, [!protected; 2],
        "protected: {protected}; [answer, correlation ID] found in the store's raw bytes"
    );
}

#[tokio::test]
async fn sled_files_hold_no_sealed_answer_nor_hashed_id() {
    raw_bytes_show_the_answer(None, false).await;
    raw_bytes_show_the_answer(None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_hold_no_sealed_answer_nor_hashed_id() {
    if !postgres::available() {
        return;
    }
    raw_bytes_show_the_answer(Some(Space::postgres()), false).await;
    raw_bytes_show_the_answer(Some(Space::postgres()), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_values_hold_no_sealed_answer_nor_hashed_id() {
    if !redis::available() {
        return;
    }
    raw_bytes_show_the_answer(Some(Space::redis()), false).await;
    raw_bytes_show_the_answer(Some(Space::redis()), true).await;
}

/// Rewrites `id`'s stored answer with `change`, straight in the store.
async fn tamper<S: Store>(store: &S, id: &str, change: impl FnOnce(&mut Vec<u8>)) {
    let key = Key::from_bytes(format!("default\0{id}").as_bytes()).expect("a key");
    let mut record = store
        .get(&key)
        .await
        .expect("get")
        .expect("a stored record");
    change(&mut record.response);
    store
        .update(&key, |_, _: Attempt<'_>| {
            Ok((Change::Put(record.clone()), ()))
        })
        .await
        .expect("rewrite");
    store.durable().await.expect("durable");
}

async fn stored_answer<S: Store>(store: &S, id: &str) -> Vec<u8> {
    let key = Key::from_bytes(format!("default\0{id}").as_bytes()).expect("a key");
    store
        .get(&key)
        .await
        .expect("get")
        .expect("a record")
        .response
}

/// A flipped byte anywhere in a stored answer, or an answer copied from
/// another record, is refused — INTERNAL (logged once), never the altered
/// answer, never a fresh claim — and the record stays committed.
#[tokio::test]
async fn an_altered_or_moved_answer_is_refused() {
    let server = TestServer::builder()
        .config(|config| config.keyring = Some(keyring()))
        .start()
        .await;
    let mut client = server.client().await;
    commit_and_replay(&server, "flipped", b"refund 100 EUR").await;
    commit_and_replay(&server, "moved-from", b"token for alice").await;
    commit_and_replay(&server, "moved-to", b"token for bob").await;
    let sealed = stored_answer(server.store.as_ref(), "flipped").await;

    // The magic, both ends of the key ID (another key: one this sidecar
    // does not have, UNAVAILABLE like a key not mounted yet), the nonce,
    // the ciphertext and the tag.
    for index in [0, 2, 4, 11, 12, sealed.len() / 2, sealed.len() - 1] {
        let refused = if (4..12).contains(&index) {
            tonic::Code::Unavailable
        } else {
            tonic::Code::Internal
        };
        tamper(server.store.as_ref(), "flipped", |answer| {
            *answer = sealed.clone();
            answer[index] ^= 0x20;
        })
        .await;
        let status = client
            .claim(claim_request("flipped"))
            .await
            .expect_err("an altered answer is refused");
        assert_eq!(status.code(), refused, "byte {index}: {status:?}");
        assert!(!status.message().contains("refund"), "{status:?}");
        let looked = client
            .lookup(pb::LookupRequest {
                correlation_id: "flipped".into(),
                ..Default::default()
            })
            .await
            .expect_err("lookup refuses it too");
        assert_eq!(looked.code(), refused);
    }

    let alice = stored_answer(server.store.as_ref(), "moved-from").await;
    tamper(server.store.as_ref(), "moved-to", |answer| {
        *answer = alice.clone()
    })
    .await;
    let status = client
        .claim(claim_request("moved-to"))
        .await
        .expect_err("an answer moved from another record is refused");
    assert_eq!(status.code(), tonic::Code::Internal);
    // Alice's own record still answers.
    let alice_again = claim(&mut client, claim_request("moved-from")).await;
    assert_eq!(alice_again.record.unwrap().response, b"token for alice");

    // Put back, the answer is replayed: the record never left COMMITTED.
    tamper(server.store.as_ref(), "flipped", |answer| {
        *answer = sealed.clone()
    })
    .await;
    let restored = claim(&mut client, claim_request("flipped")).await;
    assert_eq!(outcome(&restored), pb::ClaimOutcome::Duplicate);
    assert_eq!(restored.record.unwrap().response, b"refund 100 EUR");
    server.stop().await.expect("clean stop");
}

/// Sealed answers survive a restart with the keys. Without them (no keys,
/// or another key: a wrong Secret, a key removed too early) each read is
/// UNAVAILABLE, naming the key — never an empty answer, never replayed as its
/// ciphertext, never claimed afresh — until the key is back. Only a key
/// declared destroyed (`--erased-key-id`) makes them erased: DUPLICATE, no
/// response, `response_erased`, counted. An added key seals new answers
/// while the old one still opens the old.
#[tokio::test]
async fn without_its_key_a_sealed_answer_is_refused_unless_declared_erased() {
    let old_key = [0x11; 32];
    let new_key = [0x22; 32];
    let old_id = Keyring::from_bytes(&[old_key]).unwrap().sealing_id();
    let with = |keyring: Option<Keyring>| {
        let keyring = keyring.map(Arc::new);
        move |config: &mut dedupd::server::ServerConfig| config.keyring = keyring
    };
    let mut server = TestServer::builder()
        .config(with(Some(Keyring::from_bytes(&[old_key]).unwrap())))
        .start()
        .await;
    commit_and_replay(&server, "paid", b"receipt 17").await;
    let (dir, clock) = (Arc::clone(&server.dir), server.clock.clone());
    let space = server.store.test_space();
    let restart = |keyring: Option<Keyring>| {
        TestServer::builder()
            .in_dir(Arc::clone(&dir), clock.clone())
            .in_space(space.clone())
            .config(with(keyring))
    };
    server.stop_in_place().await.expect("clean stop");
    drop(server);

    let other = || Keyring::from_bytes(&[new_key]).unwrap();
    for (case, keyring) in [("no keys", None), ("another key", Some(other()))] {
        let mut server = restart(keyring).start().await;
        let mut client = server.client().await;
        let status = client
            .claim(claim_request("paid"))
            .await
            .expect_err("an answer whose key is missing is refused");
        // UNAVAILABLE naming the key: redeliver once it is mounted.
        assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "{case}: {status:?}"
        );
        assert!(status.message().contains(&old_id.to_string()), "{status:?}");
        assert!(!status.message().contains("receipt"), "{case}: {status:?}");
        // In a batch it fails the call; the claim an earlier item took is
        // given back, so the redelivered batch's fresh item is not stuck
        // IN_PROGRESS until its lease ends.
        let fresh = format!("fresh-{}", case.replace(' ', "-"));
        let status = client
            .claim_batch(pb::ClaimBatchRequest {
                items: vec![claim_request(&fresh), claim_request("paid")],
            })
            .await
            .expect_err("the batch fails with its item");
        assert_eq!(
            status.code(),
            tonic::Code::Unavailable,
            "{case}: {status:?}"
        );
        let again = claim(&mut client, claim_request(&fresh)).await;
        assert_eq!(
            outcome(&again),
            pb::ClaimOutcome::Claimed,
            "{case}: {again:?}"
        );
        server.stop_in_place().await.expect("clean stop");
    }

    for (case, keyring) in [
        ("another key", other().with_erased(&[old_id]).unwrap()),
        ("sealing off", Keyring::erased_only(&[old_id])),
    ] {
        let mut server = restart(Some(keyring)).start().await;
        let mut client = server.client().await;
        let again = claim(&mut client, claim_request("paid")).await;
        assert_eq!(outcome(&again), pb::ClaimOutcome::Duplicate, "{case}");
        let record = again.record.unwrap();
        assert!(record.response_erased, "{case}: {record:?}");
        assert!(record.response.is_empty());
        let erased = server
            .metrics
            .render()
            .contains("dedupd_answers_erased_total{dedup_namespace=\"default\"} 1");
        assert!(erased, "{case}: counted\n{}", server.metrics.render());
        server.stop_in_place().await.expect("clean stop");
    }

    // Rotated: the new key seals, the old one still opens (never
    // destroyed, the erased declarations above were only those restarts').
    let server = restart(Some(Keyring::from_bytes(&[old_key, new_key]).unwrap()))
        .start()
        .await;
    let mut client = server.client().await;
    let replay = claim(&mut client, claim_request("paid")).await;
    assert_eq!(replay.record.unwrap().response, b"receipt 17");
    commit_and_replay(&server, "paid-later", b"receipt 18").await;
    let sealed = stored_answer(server.store.as_ref(), "paid-later").await;
    assert_eq!(Keyring::key_id(&sealed).unwrap(), other().sealing_id());
    assert_ne!(other().sealing_id(), old_id);
    server.stop().await.expect("clean stop");
}

/// Every way an answer leaves the sidecar opens it: a Commit retried
/// (ALREADY_COMMITTED gets the first answer, not the retry's), Lookup, a
/// ClaimBatch duplicate and a fingerprint mismatch; an answer committed
/// empty before sealing was on still reads as empty; and a sidecar without
/// keys refuses to store an answer it could not tell from a sealed one.
#[tokio::test]
async fn every_face_opens_a_sealed_answer() {
    let server = TestServer::builder()
        .config(|config| config.keyring = Some(keyring()))
        .start()
        .await;
    let mut client = server.client().await;
    let first = claim(
        &mut client,
        pb::ClaimRequest {
            payload_fingerprint: "sha256:aa".into(),
            ..claim_request("order-7")
        },
    )
    .await;
    let commit = |response: &[u8]| pb::CommitRequest {
        response: response.to_vec(),
        ..commit_request("order-7", &first.lease_token)
    };
    client.commit(commit(b"shipped 7")).await.expect("commit");
    let retried = client
        .commit(commit(b"another answer"))
        .await
        .expect("retry")
        .into_inner();
    assert_eq!(retried.outcome, pb::CommitOutcome::AlreadyCommitted as i32);
    assert_eq!(retried.record.unwrap().response, b"shipped 7");

    let looked = client
        .lookup(pb::LookupRequest {
            correlation_id: "order-7".into(),
            ..Default::default()
        })
        .await
        .expect("lookup")
        .into_inner();
    assert_eq!(looked.record.unwrap().response, b"shipped 7");

    let batch = client
        .claim_batch(pb::ClaimBatchRequest {
            items: vec![claim_request("order-8"), claim_request("order-7")],
        })
        .await
        .expect("batch")
        .into_inner()
        .results;
    assert_eq!(outcome(&batch[0]), pb::ClaimOutcome::Claimed);
    assert_eq!(outcome(&batch[1]), pb::ClaimOutcome::Duplicate);
    assert_eq!(batch[1].record.as_ref().unwrap().response, b"shipped 7");

    let mismatch = claim(
        &mut client,
        pb::ClaimRequest {
            payload_fingerprint: "sha256:bb".into(),
            ..claim_request("order-7")
        },
    )
    .await;
    assert_eq!(outcome(&mismatch), pb::ClaimOutcome::FingerprintMismatch);
    assert_eq!(mismatch.record.unwrap().response, b"shipped 7");

    // Committed with no answer while sealing was off: still a duplicate.
    let plain = TestServer::builder().start().await;
    let mut plain_client = plain.client().await;
    claim_and_commit(&mut plain_client, "no-answer", Vec::new())
        .await
        .expect("commit");
    let sealed_looking = [&[0xD5, 0xED, 0xFF, 0x01][..], &[0u8; 60][..]].concat();
    assert_eq!(
        claim_and_commit(&mut plain_client, "looks-sealed", sealed_looking).await,
        Err(tonic::Code::InvalidArgument),
        "a sidecar without keys stores no answer it would later take for a sealed one"
    );
    let (dir, clock, space) = (
        Arc::clone(&plain.dir),
        plain.clock.clone(),
        plain.store.test_space(),
    );
    let mut plain = plain;
    plain.stop_in_place().await.expect("clean stop");
    drop(plain);
    let resealed = TestServer::builder()
        .in_dir(dir, clock)
        .in_space(space)
        .config(|config| config.keyring = Some(keyring()))
        .start()
        .await;
    let mut client = resealed.client().await;
    let again = claim(&mut client, claim_request("no-answer")).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Duplicate);
    assert!(again.record.unwrap().response.is_empty());
    resealed.stop().await.expect("clean stop");
    server.stop().await.expect("clean stop");
}

/// Commits `answer` to `id` in `namespace`.
async fn commit_in(client: &mut Client, namespace: &str, id: &str, answer: &str) {
    let claimed = claim(
        client,
        pb::ClaimRequest {
            namespace: namespace.into(),
            ..claim_request(id)
        },
    )
    .await;
    client
        .commit(pb::CommitRequest {
            namespace: namespace.into(),
            response: answer.into(),
            ..commit_request(id, &claimed.lease_token)
        })
        .await
        .expect("commit");
}

/// A namespace's own key, removed and declared destroyed, erases that
/// namespace's answers at once (DUPLICATE, `response_erased`, never
/// processed again; in a ClaimBatch too, beside items that still open)
/// while every other namespace's answers still replay; removed without the
/// declaration, its answers are refused (UNAVAILABLE). What the default key
/// sealed before the namespace had its own still opens, and outlives the
/// namespace's key.
#[tokio::test]
async fn destroying_a_namespace_key_erases_only_its_answers() {
    let default_key = [0x31; 32];
    let payments_key = [0x32; 32];
    let default_only = || Keyring::from_bytes(&[default_key]).unwrap();
    let both = default_only()
        .with_namespace_key_bytes("payments", &[payments_key])
        .unwrap();
    let payments_id = both.sealing_id_for("payments");
    assert_ne!(payments_id, both.sealing_id_for("orders"));

    // Before payments had a key of its own.
    let mut server = TestServer::builder()
        .config(move |config| config.keyring = Some(Arc::new(default_only())))
        .start()
        .await;
    let mut client = server.client().await;
    commit_in(&mut client, "payments", "evt-0", "card 1111").await;
    // Never read while payments has a key of its own: no lazy re-seal
    // moves it under that key, so it outlives that key.
    commit_in(&mut client, "payments", "evt-00", "card 2222").await;
    let (dir, clock, space) = (
        Arc::clone(&server.dir),
        server.clock.clone(),
        server.store.test_space(),
    );
    server.stop_in_place().await.expect("clean stop");
    drop(server);
    let restart = |keyring: Keyring| {
        TestServer::builder()
            .in_dir(Arc::clone(&dir), clock.clone())
            .in_space(space.clone())
            .config(move |config| config.keyring = Some(Arc::new(keyring)))
            .start()
    };
    let replay = |namespace: &str, id: &str| pb::ClaimRequest {
        namespace: namespace.into(),
        ..claim_request(id)
    };

    let mut server = restart(both).await;
    let mut client = server.client().await;
    commit_in(&mut client, "payments", "evt-1", "card 4242").await;
    commit_in(&mut client, "orders", "evt-1", "parcel 9").await;
    let before = claim(&mut client, replay("payments", "evt-0")).await;
    assert_eq!(
        before.record.unwrap().response,
        b"card 1111",
        "the default key still opens"
    );
    server.stop_in_place().await.expect("clean stop");
    drop(server);

    let mut removed = restart(default_only()).await;
    let mut client = removed.client().await;
    let status = client
        .claim(replay("payments", "evt-1"))
        .await
        .expect_err("a key removed but not declared destroyed is an error");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    removed.stop_in_place().await.expect("clean stop");
    drop(removed);

    let server = restart(default_only().with_erased(&[payments_id]).unwrap()).await;
    let mut client = server.client().await;
    let payments = claim(&mut client, replay("payments", "evt-1")).await;
    assert_eq!(outcome(&payments), pb::ClaimOutcome::Duplicate);
    let payments = payments.record.unwrap();
    assert!(
        payments.response_erased && payments.response.is_empty(),
        "{payments:?}"
    );
    let orders = claim(&mut client, replay("orders", "evt-1")).await;
    assert_eq!(outcome(&orders), pb::ClaimOutcome::Duplicate);
    let orders = orders.record.unwrap();
    assert!(!orders.response_erased);
    assert_eq!(orders.response, b"parcel 9");
    let batch = client
        .claim_batch(pb::ClaimBatchRequest {
            items: vec![replay("payments", "evt-1"), replay("payments", "evt-00")],
        })
        .await
        .expect("an erased item does not fail the batch")
        .into_inner()
        .results;
    let erased = batch[0].record.as_ref().unwrap();
    assert_eq!(outcome(&batch[0]), pb::ClaimOutcome::Duplicate);
    assert!(erased.response_erased && erased.response.is_empty());
    assert_eq!(outcome(&batch[1]), pb::ClaimOutcome::Duplicate);
    let kept = batch[1].record.as_ref().unwrap();
    assert!(!kept.response_erased);
    assert_eq!(kept.response, b"card 2222");
    server.stop().await.expect("clean stop");
}

/// The key ID every committed answer of `store` is sealed with, by
/// correlation ID (a Redis SCAN may hand a key back twice).
async fn sealing_key_ids<S: Store>(store: &S) -> BTreeMap<String, KeyId> {
    let mut ids = BTreeMap::new();
    let mut cursor = ScanCursor::default();
    loop {
        let page = store.scan(&cursor, 64).await.expect("scan");
        for key in page.keys {
            // The store's record of which keys sealed answers is no answer.
            if key == dedupd::key_registry::registry_key() {
                continue;
            }
            let record = store.get(&key).await.expect("get").expect("a record");
            if record.state == dedupd::domain::RecordState::Committed {
                let id = Keyring::key_id(&record.response).expect("a sealed answer");
                ids.insert(key.correlation_id().to_owned(), id);
            }
        }
        match page.next {
            Some(next) => cursor = next,
            None => return ids,
        }
    }
}

/// Rotation under load: answers sealed with the old key, then a new key
/// added while consumers keep claiming, committing, replaying, forgetting
/// and committing again, and a rekey pass running through the store at the
/// same time (the load goes on until the pass is through). Nothing is lost
/// — every answer, old and new, replays as committed — nothing forgotten
/// comes back, nothing committed again is overwritten by its old answer,
/// no answer is left under the old key, and a sidecar without the old key
/// then answers every duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_under_load_then_rekey_leaves_nothing_under_the_old_key() {
    // old-0..KEPT stay; old-KEPT..FORGOTTEN are forgotten during the pass;
    // old-FORGOTTEN..OLD are forgotten and committed again.
    const KEPT: usize = 100;
    const FORGOTTEN: usize = 110;
    const OLD: usize = 120;
    const NEW_PER_WORKER: usize = 40;
    const WORKERS: usize = 4;
    let new_id = Keyring::from_bytes(&[[0x42; 32]]).unwrap().sealing_id();
    let with = |keys: &'static [[u8; 32]]| {
        move |config: &mut dedupd::server::ServerConfig| {
            config.keyring = Some(Arc::new(Keyring::from_bytes(keys).unwrap()));
            config.hashed_ids = Some(Arc::new(IdHasher::from_bytes(&[0x43; 32])));
        }
    };
    let mut server = TestServer::builder()
        .config(with(&[[0x41; 32]]))
        .start()
        .await;
    let mut client = server.client().await;
    for i in 0..OLD {
        claim_and_commit(
            &mut client,
            &format!("old-{i}"),
            format!("old answer {i}").into(),
        )
        .await
        .expect("commit");
    }
    let (dir, clock, space) = (
        Arc::clone(&server.dir),
        server.clock.clone(),
        server.store.test_space(),
    );
    server.stop_in_place().await.expect("clean stop");
    drop(server);

    let mut rotated = TestServer::builder()
        .in_dir(Arc::clone(&dir), clock.clone())
        .in_space(space.clone())
        .config(with(&[[0x41; 32], [0x42; 32]]))
        .start()
        .await;
    let through = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let mut client = rotated.client().await;
        let through = Arc::clone(&through);
        workers.push(tokio::spawn(async move {
            let mut i = 0;
            while i < NEW_PER_WORKER || !through.load(std::sync::atomic::Ordering::SeqCst) {
                if i < NEW_PER_WORKER {
                    let id = format!("new-{worker}-{i}");
                    claim_and_commit(&mut client, &id, format!("new answer {worker} {i}").into())
                        .await
                        .expect("commit under load");
                }
                let old = (worker * NEW_PER_WORKER + i) % KEPT;
                let replay = claim(&mut client, claim_request(&format!("old-{old}"))).await;
                assert_eq!(outcome(&replay), pb::ClaimOutcome::Duplicate);
                assert_eq!(
                    replay.record.unwrap().response,
                    format!("old answer {old}").as_bytes(),
                    "an old answer replays during the pass"
                );
                // One worker forgets some old records, and commits some of
                // them again, while the pass runs.
                let gone = KEPT + i;
                if worker == 0 && gone < OLD {
                    let id = format!("old-{gone}");
                    client
                        .forget(pb::ForgetRequest {
                            correlation_id: id.clone(),
                            ..Default::default()
                        })
                        .await
                        .expect("forget");
                    if gone >= FORGOTTEN {
                        claim_and_commit(&mut client, &id, format!("again {gone}").into())
                            .await
                            .expect("commit again");
                    }
                }
                i += 1;
            }
            i
        }));
    }
    let mut admin = rotated.client().await;
    let (mut cursor, mut resealed, mut pages) = (Vec::new(), 0, 0);
    loop {
        let page = admin
            .rekey(pb::RekeyRequest {
                cursor: std::mem::take(&mut cursor),
                page_size: 16,
                retire_old_keys: true,
            })
            .await
            .expect("a rekey page")
            .into_inner();
        assert_eq!((page.erased, page.unreadable), (0, 0), "{page:?}");
        resealed += page.resealed;
        pages += 1;
        if page.next_cursor.is_empty() {
            assert!(page.retired_old_keys, "{page:?}");
            break;
        }
        cursor = page.next_cursor;
        tokio::task::yield_now().await;
    }
    through.store(true, std::sync::atomic::Ordering::SeqCst);
    for worker in workers {
        let rounds = worker.await.expect("a worker");
        assert!(rounds >= NEW_PER_WORKER, "{rounds}");
    }
    assert!(pages > 1, "the pass went page by page");
    // Replays re-seal lazily too: the pass re-seals the rest.
    assert!(resealed <= OLD as u64, "{resealed}");
    // A second pass finds nothing to do.
    let mut cursor = Vec::new();
    loop {
        let again = admin
            .rekey(pb::RekeyRequest {
                cursor,
                page_size: 64,
                retire_old_keys: false,
            })
            .await
            .expect("rekey")
            .into_inner();
        assert_eq!(again.resealed, 0, "{again:?}");
        if again.next_cursor.is_empty() {
            break;
        }
        cursor = again.next_cursor;
    }
    rotated.stop_in_place().await.expect("clean stop");
    drop(rotated);

    // The old key removed: every answer still replays, the forgotten stay
    // forgotten, and those committed again keep their new answers.
    let server = TestServer::builder()
        .in_dir(dir, clock)
        .in_space(space)
        .config(with(&[[0x42; 32]]))
        .start()
        .await;
    // Read after the restart: a shared store's local tier (emptied by it)
    // may have kept, until then, a copy a replay read just before the
    // re-seal — valid under the old key, which is only removed by a restart.
    let ids = sealing_key_ids(server.store.as_ref()).await;
    let expected: BTreeSet<String> = (0..KEPT)
        .chain(FORGOTTEN..OLD)
        .map(|i| format!("old-{i}"))
        .chain((0..WORKERS).flat_map(|w| (0..NEW_PER_WORKER).map(move |i| format!("new-{w}-{i}"))))
        .collect();
    // With hashed IDs the store holds hashes: compare counts, then check
    // each by its ID below.
    assert_eq!(
        ids.len(),
        expected.len(),
        "nothing lost, nothing forgotten back"
    );
    assert!(
        ids.values().all(|id| *id == new_id),
        "no answer left under the old key: {ids:?}"
    );
    let mut client = server.client().await;
    let looked = |id: String| {
        let mut client = client.clone();
        async move {
            client
                .lookup(pb::LookupRequest {
                    correlation_id: id,
                    ..Default::default()
                })
                .await
                .expect("lookup")
                .into_inner()
                .record
                .map(|record| record.response)
        }
    };
    for i in 0..OLD {
        let answer = looked(format!("old-{i}")).await;
        let wanted = match i {
            i if i < KEPT => Some(format!("old answer {i}").into_bytes()),
            i if i < FORGOTTEN => None,
            i => Some(format!("again {i}").into_bytes()),
        };
        assert_eq!(answer, wanted, "old-{i}");
    }
    for worker in 0..WORKERS {
        for i in 0..NEW_PER_WORKER {
            let answer = looked(format!("new-{worker}-{i}")).await;
            assert_eq!(
                answer,
                Some(format!("new answer {worker} {i}").into_bytes())
            );
        }
    }
    let replay = claim(&mut client, claim_request("old-0")).await;
    assert_eq!(outcome(&replay), pb::ClaimOutcome::Duplicate);
    server.stop().await.expect("clean stop");
}

/// With hashed IDs every call finds its record by the caller's ID: Renew,
/// Release, Commit, a ClaimBatch's duplicate, Lookup and Forget (and a
/// claim after Forget starts afresh) — each would miss it, or find a
/// record under the plain ID, if one store access skipped the hash.
#[tokio::test]
async fn hashed_ids_reach_every_call() {
    let server = TestServer::builder()
        .config(|config| config.hashed_ids = Some(Arc::new(IdHasher::from_bytes(&[0x77; 32]))))
        .start()
        .await;
    let mut client = server.client().await;
    let first = claim(&mut client, claim_request("alice@example.com")).await;
    client
        .renew(pb::RenewRequest {
            correlation_id: "alice@example.com".into(),
            lease_token: first.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("renew finds the claim");
    let released = client
        .release(pb::ReleaseRequest {
            correlation_id: "alice@example.com".into(),
            lease_token: first.lease_token.clone(),
            ..Default::default()
        })
        .await
        .expect("release")
        .into_inner();
    assert_eq!(released.outcome, pb::ReleaseOutcome::Released as i32);
    let again = claim(&mut client, claim_request("alice@example.com")).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Claimed);
    client
        .commit(pb::CommitRequest {
            response: b"done".to_vec(),
            ..commit_request("alice@example.com", &again.lease_token)
        })
        .await
        .expect("commit finds the claim");
    let batch = client
        .claim_batch(pb::ClaimBatchRequest {
            items: vec![
                claim_request("alice@example.com"),
                claim_request("bob@example.com"),
            ],
        })
        .await
        .expect("batch")
        .into_inner()
        .results;
    assert_eq!(outcome(&batch[0]), pb::ClaimOutcome::Duplicate);
    assert_eq!(batch[0].record.as_ref().unwrap().response, b"done");
    assert_eq!(
        batch[0].record.as_ref().unwrap().correlation_id,
        "alice@example.com"
    );
    assert_eq!(outcome(&batch[1]), pb::ClaimOutcome::Claimed);
    let forgotten = client
        .forget(pb::ForgetRequest {
            correlation_id: "alice@example.com".into(),
            ..Default::default()
        })
        .await
        .expect("forget")
        .into_inner();
    assert!(forgotten.existed);
    let looked = client
        .lookup(pb::LookupRequest {
            correlation_id: "alice@example.com".into(),
            ..Default::default()
        })
        .await
        .expect("lookup")
        .into_inner();
    assert!(!looked.found);
    let fresh = claim(&mut client, claim_request("alice@example.com")).await;
    assert_eq!(outcome(&fresh), pb::ClaimOutcome::Claimed);
    // The store holds the hash, never the ID.
    let plain = Key::from_bytes(b"default\0alice@example.com").unwrap();
    assert!(server.store.get(&plain).await.expect("get").is_none());
    server.stop().await.expect("clean stop");
}

/// A replayed answer under an older key is re-sealed under the current one
/// as it is read (in the background), and still replays; one under the
/// current key is left as it is.
#[tokio::test]
async fn a_replayed_answer_is_resealed_lazily_under_the_new_key() {
    let (old_key, new_key) = ([0x51; 32], [0x52; 32]);
    let new_id = Keyring::from_bytes(&[new_key]).unwrap().sealing_id();
    let mut server = TestServer::builder()
        .config(move |config| {
            config.keyring = Some(Arc::new(Keyring::from_bytes(&[old_key]).unwrap()))
        })
        .start()
        .await;
    commit_and_replay(&server, "lazy-1", b"answer one").await;
    let (dir, clock, space) = (
        Arc::clone(&server.dir),
        server.clock.clone(),
        server.store.test_space(),
    );
    server.stop_in_place().await.expect("clean stop");
    drop(server);

    let server = TestServer::builder()
        .in_dir(dir, clock)
        .in_space(space)
        .config(move |config| {
            let keyring = Keyring::from_bytes(&[old_key, new_key]).unwrap();
            config.keyring = Some(Arc::new(keyring))
        })
        .start()
        .await;
    let before = stored_answer(server.store.as_ref(), "lazy-1").await;
    assert_ne!(Keyring::key_id(&before).unwrap(), new_id);
    let mut client = server.client().await;
    let replay = claim(&mut client, claim_request("lazy-1")).await;
    assert_eq!(replay.record.unwrap().response, b"answer one");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let stored = stored_answer(server.store.as_ref(), "lazy-1").await;
        if Keyring::key_id(&stored).unwrap() == new_id {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never re-sealed");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let again = claim(&mut client, claim_request("lazy-1")).await;
    assert_eq!(outcome(&again), pb::ClaimOutcome::Duplicate);
    assert_eq!(again.record.unwrap().response, b"answer one");
    server.stop().await.expect("clean stop");
}
