//! The fuzz checks: what must hold for *any* input to the parts of dedupd
//! that read bytes it did not write itself this run — records and stored
//! answers read back from disk or a shared store, protobuf requests off the
//! wire, and the command line. Each check panics (the fuzzer's crash) when a
//! property fails; a panic inside dedupd is a crash too.
//!
//! The libFuzzer entry points in `fuzz_targets/` call these (`fuzz/run.sh`
//! runs them with `cargo fuzz`); `tests/corpus.rs` runs them over the
//! checked-in corpus and every input that ever failed, in plain `cargo test`.

use std::{ffi::OsString, os::unix::ffi::OsStringExt, time::Duration};

use clap::Parser;
use dedupd::{
    api::Limits,
    command::{Cli, Command},
    config::one_line_error,
    domain::{Key, MAX_CORRELATION_ID_BYTES, MAX_NAMESPACE_BYTES},
    proto::v1 as pb,
    proxy::idempotency::StoredResponse,
    store::codec,
    Error,
};
use prost::Message;

/// Stored bytes (a record, an ordering mark, a proxy's stored answer):
/// decoding never panics, and whatever decodes encodes back to bytes that
/// decode to the same value. Returns whether any decoder accepted `data`.
pub fn record_codec(data: &[u8]) -> bool {
    let mut accepted = false;
    if let Ok(record) = codec::decode_record(data) {
        accepted = true;
        let encoded = codec::encode_record(&record);
        assert_eq!(codec::decode_record(&encoded).ok(), Some(record.clone()));
        assert_eq!(
            codec::record_retain_until(&encoded).ok(),
            Some(record.retain_until),
            "the reaper's prefix read disagrees with the decoder"
        );
        assert_eq!(
            codec::record_retain_until(data).ok(),
            Some(record.retain_until)
        );
    }
    if let Ok(mark) = codec::decode_mark(data) {
        accepted = true;
        assert_eq!(codec::encode_mark(mark).as_slice(), data);
    }
    if let Ok(response) = StoredResponse::decode(data) {
        let encoded = response.encode();
        assert_eq!(StoredResponse::decode(&encoded).ok(), Some(response));
        accepted = true;
    }
    accepted
}

/// A protobuf request as the wire brings it, the first byte choosing which
/// call: validation never panics, accepts only what is within the limits,
/// and refuses with INVALID_ARGUMENT naming at least one field. Returns
/// whether the request was accepted.
pub fn request_validation(data: &[u8]) -> bool {
    let Some((&which, message)) = data.split_first() else {
        return false;
    };
    // Small limits, so the fuzzer reaches them.
    let limits = Limits {
        max_response_bytes: 256,
        max_batch_size: 4,
        ..Limits::default()
    };
    let outcome = match which % 7 {
        0 => decode::<pb::ClaimRequest>(message).map(|r| {
            limits.claim(r).map(|claim| {
                check_key(&claim.key);
                check_duration(claim.lease_ttl, limits.max_lease_ttl);
                check_duration(claim.retention, limits.max_retention);
            })
        }),
        1 => decode::<pb::CommitRequest>(message).map(|r| {
            limits.commit(r).map(|commit| {
                check_key(&commit.key);
                assert!(commit.response.len() <= limits.max_response_bytes);
                if let Some(retention) = commit.retention {
                    check_duration(retention, limits.max_retention);
                }
            })
        }),
        2 => decode::<pb::ReleaseRequest>(message)
            .map(|r| limits.release(r).map(|release| check_key(&release.key))),
        3 => decode::<pb::RenewRequest>(message).map(|r| {
            limits.renew(r).map(|renew| {
                check_key(&renew.key);
                check_duration(renew.lease_ttl, limits.max_lease_ttl);
            })
        }),
        4 => decode::<pb::LookupRequest>(message).map(|r| {
            limits
                .key(&r.namespace, &r.correlation_id)
                .map(|key| check_key(&key))
        }),
        5 => decode::<pb::ClaimBatchRequest>(message).map(|r| {
            let items = r.items.len();
            limits.claim_batch(r.items).map(|claims| {
                assert!(items <= limits.max_batch_size);
                assert_eq!(claims.len(), items, "a batch item went missing");
                claims.iter().for_each(|claim| check_key(&claim.key));
            })
        }),
        _ => decode::<pb::CommitBatchRequest>(message).map(|r| {
            let items = r.items.len();
            limits.commit_batch(r.items).map(|commits| {
                assert!(items <= limits.max_batch_size);
                assert_eq!(commits.len(), items, "a batch item went missing");
                commits.iter().for_each(|commit| check_key(&commit.key));
            })
        }),
    };
    let Some(Err(error)) = outcome else {
        return outcome.is_some();
    };
    {
        let Error::InvalidArgument(violations) = &error else {
            panic!("validation failed with something other than InvalidArgument: {error:?}");
        };
        assert!(!violations.is_empty(), "a refusal names no field");
        for violation in violations {
            assert!(!violation.field.is_empty() && !violation.description.is_empty());
        }
        assert_eq!(
            tonic::Status::from(error).code(),
            tonic::Code::InvalidArgument
        );
    }
    false
}

fn decode<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    M::decode(bytes).ok()
}

fn check_key(key: &Key) {
    assert!((1..=MAX_NAMESPACE_BYTES).contains(&key.namespace().len()));
    assert!((1..=MAX_CORRELATION_ID_BYTES).contains(&key.correlation_id().len()));
}

fn check_duration(duration: Duration, max: Duration) {
    assert!(
        !duration.is_zero() && duration <= max,
        "{duration:?} outside (0, {max:?}]"
    );
}

/// A command line, arguments separated by NUL bytes (any bytes, not only
/// UTF-8): parsing and validation never panic, and every refusal is the one
/// line `main` prints before exiting 64. Returns whether the command line
/// was accepted.
pub fn config_parser(data: &[u8]) -> bool {
    let arguments = std::iter::once(OsString::from("dedupd"))
        .chain(
            data.split(|&b| b == 0)
                .filter(|_| !data.is_empty())
                .map(|arg| OsString::from_vec(arg.to_vec())),
        )
        .take(64);
    let cli = match Cli::try_parse_from(arguments) {
        Ok(cli) => cli,
        Err(error) => {
            check_one_line(&one_line_error(&error));
            return false;
        }
    };
    let validated = match cli.command {
        None => cli.serve.validate().map(drop),
        Some(Command::Serve(args)) => args.validate().map(drop),
        Some(Command::HttpProxy(mut args)) => {
            args.http_proxy.standalone = true;
            args.validate().map(drop)
        }
        Some(Command::Inject(args)) => args.validate().map(drop),
        // A client command's flags are all parsed above; running it would
        // connect to a sidecar.
        Some(Command::Client(_)) => Ok(()),
    };
    if let Err(message) = &validated {
        check_one_line(message);
    }
    validated.is_ok()
}

fn check_one_line(message: &str) {
    assert!(!message.trim().is_empty(), "an empty error");
    assert!(
        !message.contains('\n'),
        "an error of several lines: {message:?}"
    );
}

/// Valid inputs of every kind each target reads, to start the fuzzer from
/// (`fuzz/run.sh` writes them into its corpus) and to replay in `cargo
/// test`: a change that stops them decoding or validating is seen there.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "record_codec" => record_seeds(),
        "request_validation" => request_seeds(),
        "config_parser" => [
            &[][..],
            &[
                "--store",
                "sled",
                "--data-dir",
                "/var/lib/dedupd",
                "--sync",
                "always",
            ],
            &[
                "--listen",
                "127.0.0.1:50051,unix:///run/dedupd.sock",
                "--max-lease-ttl",
                "5m",
                "--default-lease-ttl",
                "30s",
            ],
            &[
                "--namespace-retention",
                "payments=30d",
                "--max-retention",
                "365d",
                "--reaper-interval",
                "1m",
            ],
            &[
                "--store",
                "postgres",
                "--store-url",
                "postgres://127.0.0.1/test",
                "--local-tier-mb",
                "32",
            ],
            &[
                "http-proxy",
                "--listen",
                "127.0.0.1:8080",
                "--upstream",
                "http://127.0.0.1:3000",
                "--require-key",
                "POST /orders/**",
            ],
            &[
                "inject",
                "--tls-cert",
                "/tls/tls.crt",
                "--tls-key",
                "/tls/tls.key",
            ],
            &[
                "claim",
                "--namespace",
                "payments",
                "order-1",
                "--lease-ttl",
                "30s",
            ],
        ]
        .iter()
        // The command line as config_parser reads it: NUL-separated.
        .map(|arguments| arguments.join("\0").into_bytes())
        .collect(),
        _ => Vec::new(),
    }
}

fn record_seeds() -> Vec<Vec<u8>> {
    use dedupd::{
        clock::UnixMillis,
        domain::{FencingToken, LeaseToken, OrderingPosition, Record, RecordState},
        machine::SequenceMark,
    };
    let committed = Record {
        state: RecordState::Committed,
        lease_token: LeaseToken(u128::MAX - 7),
        fencing_token: FencingToken(42),
        lease_expires_at: UnixMillis(1_000),
        attempt: 3,
        event_type: "PaymentReceived".into(),
        consumer_version: "1.2.3".into(),
        owner: "pod-a".into(),
        payload_fingerprint: "sha256:abc".into(),
        claimed_at: UnixMillis(900),
        committed_at: Some(UnixMillis(950)),
        retain_until: UnixMillis(10_000),
        retention: Duration::from_secs(9),
        response: b"{\"id\":7}".to_vec(),
        ordering: Some(OrderingPosition {
            ordering_key: "account-1".into(),
            sequence: 12,
        }),
        request_id: "7f1c".into(),
        recovered: true,
        response_erased: false,
    };
    let claimed = Record {
        state: RecordState::Claimed,
        committed_at: None,
        response: Vec::new(),
        ordering: None,
        ..committed.clone()
    };
    let stored_response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        body: Some(b"{\"order\":1}".to_vec()),
        trailers: vec![(
            http::HeaderName::from_static("grpc-status"),
            http::HeaderValue::from_static("0"),
        )],
    };
    vec![
        codec::encode_record(&committed),
        codec::encode_record(&claimed),
        codec::encode_mark(SequenceMark {
            highest: 12,
            retain_until: UnixMillis(10_000),
        })
        .to_vec(),
        stored_response.encode(),
        StoredResponse {
            body: None,
            ..stored_response
        }
        .encode(),
    ]
}

fn request_seeds() -> Vec<Vec<u8>> {
    let claim = pb::ClaimRequest {
        namespace: "payments".into(),
        correlation_id: "order-1".into(),
        lease_ttl: Some(prost_types::Duration {
            seconds: 30,
            nanos: 0,
        }),
        event_type: "OrderPlaced".into(),
        payload_fingerprint: "sha256:abc".into(),
        ..Default::default()
    };
    let commit = pb::CommitRequest {
        namespace: "payments".into(),
        correlation_id: "order-1".into(),
        lease_token: "00000000000000000000000000000001".into(),
        response: b"ok".to_vec(),
        ..Default::default()
    };
    let release = pb::ReleaseRequest {
        namespace: "payments".into(),
        correlation_id: "order-1".into(),
        lease_token: commit.lease_token.clone(),
    };
    let renew = pb::RenewRequest {
        namespace: "payments".into(),
        correlation_id: "order-1".into(),
        lease_token: commit.lease_token.clone(),
        lease_ttl: claim.lease_ttl,
    };
    let lookup = pb::LookupRequest {
        namespace: "payments".into(),
        correlation_id: "order-1".into(),
    };
    let with = |which: u8, message: Vec<u8>| [vec![which], message].concat();
    vec![
        with(0, claim.encode_to_vec()),
        with(1, commit.encode_to_vec()),
        with(2, release.encode_to_vec()),
        with(3, renew.encode_to_vec()),
        with(4, lookup.encode_to_vec()),
        with(
            5,
            pb::ClaimBatchRequest {
                items: vec![claim.clone(), claim],
            }
            .encode_to_vec(),
        ),
        with(
            6,
            pb::CommitBatchRequest {
                items: vec![commit],
            }
            .encode_to_vec(),
        ),
    ]
}
