//! The command-line client (`dedupd claim|commit|release|renew|lookup|
//! forget|rekey`): one call to a running sidecar (a page of calls for
//! `rekey`), its answer printed for a person
//! or, with `--json`, for a script. `dedupd claim` exits with a code per
//! outcome so shell consumers can branch on it.

use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::Interceptor,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
    Code, Status,
};
use tonic_types::StatusExt;

use crate::listen::unix_socket_path;
use crate::proto::v1::claim_and_commit_server::SERVICE_NAME;
use crate::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};

/// Exit code of `dedupd claim` for each outcome (0 is CLAIMED).
pub mod exit_code {
    /// The call failed (connection, invalid argument, lost lease, ...).
    pub const ERROR: i32 = 1;
    /// DUPLICATE.
    pub const DUPLICATE: i32 = 10;
    /// IN_PROGRESS.
    pub const IN_PROGRESS: i32 = 11;
    /// FINGERPRINT_MISMATCH.
    pub const FINGERPRINT_MISMATCH: i32 = 12;
    /// STALE.
    pub const STALE: i32 = 13;
}

/// Options every client command takes.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// The sidecar's address.
    #[arg(long, env = "DEDUPD_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// Namespace (empty: the server's default namespace).
    #[arg(short = 'n', long, default_value = "")]
    pub namespace: String,
    /// Print the answer as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Bearer token, when the sidecar requires one.
    #[arg(long, env = "DEDUPD_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM CA that signed the sidecar's certificate (use an https:// --addr).
    #[arg(long, env = "DEDUPD_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// PEM client certificate, for mTLS (with --tls-key).
    #[arg(long, env = "DEDUPD_TLS_CLIENT_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "DEDUPD_TLS_CLIENT_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
}

impl Connection {
    /// The client TLS settings the flags ask for, if any.
    fn tls(&self) -> Result<Option<ClientTlsConfig>, Status> {
        if !self.addr.starts_with("https://") {
            return Ok(None);
        }
        let read = |path: &std::path::Path| {
            std::fs::read(path)
                .map_err(|e| Status::invalid_argument(format!("{}: {e}", path.display())))
        };
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &self.tls_ca {
            tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        Ok(Some(tls))
    }
}

/// The client commands.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Claim a correlation ID before processing its event.
    Claim {
        #[command(flatten)]
        connection: Connection,
        /// The producer's correlation ID.
        correlation_id: String,
        /// Lease (e.g. 30s); default: the server's.
        #[arg(long)]
        lease_ttl: Option<humantime::Duration>,
        /// Retention (e.g. 7days); default: the namespace's or server's.
        #[arg(long)]
        retention: Option<humantime::Duration>,
        /// Event type, kept for lookup.
        #[arg(long, default_value = "")]
        event_type: String,
        /// Consumer version, kept for lookup.
        #[arg(long, default_value = "")]
        consumer_version: String,
        /// Who is claiming (e.g. the pod name).
        #[arg(long, default_value = "")]
        owner: String,
        /// Payload fingerprint (e.g. a hex SHA-256).
        #[arg(long, default_value = "")]
        fingerprint: String,
        /// Ordering key for the ordering guard (needs --sequence).
        #[arg(long, default_value = "", requires = "sequence")]
        ordering_key: String,
        /// Sequence within the ordering key.
        #[arg(long)]
        sequence: Option<u64>,
        /// Your ID for this claim (e.g. a UUID per delivery): retried with
        /// the same ID while its lease lives, the same claim comes back.
        #[arg(long, default_value = "")]
        request_id: String,
    },
    /// Commit a claim after the business write.
    Commit {
        #[command(flatten)]
        connection: Connection,
        /// The correlation ID.
        correlation_id: String,
        /// The lease token printed by `claim`.
        #[arg(long)]
        lease_token: String,
        /// Response to cache for duplicates.
        #[arg(long, default_value = "")]
        response: String,
        /// Retention overriding the claim's.
        #[arg(long)]
        retention: Option<humantime::Duration>,
    },
    /// Release a claim after a failure, so a redelivery can retry at once.
    Release {
        #[command(flatten)]
        connection: Connection,
        /// The correlation ID.
        correlation_id: String,
        /// The lease token printed by `claim`.
        #[arg(long)]
        lease_token: String,
    },
    /// Extend a claim's lease.
    Renew {
        #[command(flatten)]
        connection: Connection,
        /// The correlation ID.
        correlation_id: String,
        /// The lease token printed by `claim`.
        #[arg(long)]
        lease_token: String,
        /// New lease from now; default: the server's.
        #[arg(long)]
        lease_ttl: Option<humantime::Duration>,
    },
    /// Show the record of a correlation ID.
    Lookup {
        #[command(flatten)]
        connection: Connection,
        /// The correlation ID.
        correlation_id: String,
    },
    /// Delete a correlation ID so its event can be processed again.
    Forget {
        #[command(flatten)]
        connection: Connection,
        /// The correlation ID.
        correlation_id: String,
    },
    /// Re-seal every stored answer with its namespace's current sealing key
    /// (after adding a key), page after page, printing progress; once it
    /// exits 0 no live answer is under an old key and the old key can go.
    /// Needs the admin token. Exits 1 if answers could not be opened.
    Rekey {
        #[command(flatten)]
        connection: Connection,
        /// Records per call (the sidecar's default: 500; at most 10000).
        #[arg(long, default_value_t = 500)]
        page_size: u32,
    },
    /// Ask the sidecar's gRPC health service; exits 0 only when SERVING.
    Health {
        #[command(flatten)]
        connection: Connection,
        /// The service to ask about (empty: the whole server).
        #[arg(long, default_value = SERVICE_NAME)]
        service: String,
        /// Ask `GET /readyz` on this ops address (HOST:PORT) instead: plain
        /// HTTP whatever TLS the gRPC port speaks (the image's HEALTHCHECK).
        #[arg(long, conflicts_with = "service")]
        readyz: Option<std::net::SocketAddr>,
    },
}

/// Runs one client command; returns the process exit code.
pub async fn run(command: ClientCommand) -> i32 {
    let connection = match &command {
        ClientCommand::Claim { connection, .. }
        | ClientCommand::Commit { connection, .. }
        | ClientCommand::Release { connection, .. }
        | ClientCommand::Renew { connection, .. }
        | ClientCommand::Lookup { connection, .. }
        | ClientCommand::Forget { connection, .. }
        | ClientCommand::Rekey { connection, .. }
        | ClientCommand::Health { connection, .. } => connection.clone(),
    };
    match call(command, &connection).await {
        Ok((code, answer)) => {
            print_answer(&answer, connection.json);
            code
        }
        Err(status) => {
            print_error(&status, connection.json);
            exit_code::ERROR
        }
    }
}

async fn call(command: ClientCommand, connection: &Connection) -> Result<(i32, Value), Status> {
    if let ClientCommand::Health {
        readyz: Some(address),
        ..
    } = &command
    {
        return readyz(*address).await;
    }
    let channel = channel_with_tls(&connection.addr, connection.tls()?).await?;
    if let ClientCommand::Health { service, .. } = &command {
        return health(channel, service).await;
    }
    let mut client = ClaimAndCommitClient::with_interceptor(
        channel,
        BearerToken::new(connection.token.as_deref())?,
    );
    let namespace = connection.namespace.clone();
    let proto_duration = |d: Option<humantime::Duration>| d.map(|d| crate::api::duration(d.into()));
    match command {
        ClientCommand::Claim {
            correlation_id,
            lease_ttl,
            retention,
            event_type,
            consumer_version,
            owner,
            fingerprint,
            ordering_key,
            sequence,
            request_id,
            ..
        } => {
            let answer = client
                .claim(pb::ClaimRequest {
                    namespace,
                    correlation_id,
                    lease_ttl: proto_duration(lease_ttl),
                    retention: proto_duration(retention),
                    event_type,
                    consumer_version,
                    owner,
                    payload_fingerprint: fingerprint,
                    ordering_key,
                    sequence,
                    request_id,
                })
                .await?
                .into_inner();
            Ok(claim_answer(&answer))
        }
        ClientCommand::Commit {
            correlation_id,
            lease_token,
            response,
            retention,
            ..
        } => {
            let answer = client
                .commit(pb::CommitRequest {
                    namespace,
                    correlation_id,
                    lease_token,
                    response: response.into_bytes(),
                    retention: proto_duration(retention),
                })
                .await?
                .into_inner();
            let mut value = json!({ "outcome": commit_outcome_name(answer.outcome) });
            if let Some(record) = &answer.record {
                value["record"] = record_json(record);
            }
            Ok((0, value))
        }
        ClientCommand::Release {
            correlation_id,
            lease_token,
            ..
        } => {
            let answer = client
                .release(pb::ReleaseRequest {
                    namespace,
                    correlation_id,
                    lease_token,
                })
                .await?
                .into_inner();
            let outcome = pb::ReleaseOutcome::try_from(answer.outcome).map_or("UNKNOWN", |o| {
                o.as_str_name().trim_start_matches("RELEASE_OUTCOME_")
            });
            Ok((0, json!({ "outcome": outcome })))
        }
        ClientCommand::Renew {
            correlation_id,
            lease_token,
            lease_ttl,
            ..
        } => {
            let answer = client
                .renew(pb::RenewRequest {
                    namespace,
                    correlation_id,
                    lease_token,
                    lease_ttl: proto_duration(lease_ttl),
                })
                .await?
                .into_inner();
            Ok((
                0,
                json!({ "outcome": "RENEWED", "lease_expires_at": time_json(answer.lease_expires_at.as_ref()) }),
            ))
        }
        ClientCommand::Lookup { correlation_id, .. } => {
            let answer = client
                .lookup(pb::LookupRequest {
                    namespace,
                    correlation_id,
                })
                .await?
                .into_inner();
            let mut value = json!({ "found": answer.found });
            if let Some(record) = &answer.record {
                value["record"] = record_json(record);
            }
            Ok((0, value))
        }
        ClientCommand::Health { .. } => unreachable!("answered above"),
        ClientCommand::Forget { correlation_id, .. } => {
            let answer = client
                .forget(pb::ForgetRequest {
                    namespace,
                    correlation_id,
                })
                .await?
                .into_inner();
            Ok((0, json!({ "existed": answer.existed })))
        }
        ClientCommand::Rekey { page_size, .. } => {
            rekey(&mut client, page_size, connection.json).await
        }
    }
}

/// Calls Rekey page after page until the pass is through, a progress line
/// per page on stderr (unless `--json`); the totals are the answer.
async fn rekey(
    client: &mut ClaimAndCommitClient<
        tonic::service::interceptor::InterceptedService<Channel, BearerToken>,
    >,
    page_size: u32,
    quiet: bool,
) -> Result<(i32, Value), Status> {
    let mut totals = [0u64; 5];
    let mut cursor = Vec::new();
    let mut pages = 0u64;
    let retired = loop {
        let request = pb::RekeyRequest {
            cursor: std::mem::take(&mut cursor),
            page_size,
            // Retire the old keys only after a pass where all opened.
            retire_old_keys: totals[4] == 0,
        };
        // A page the sidecar could not answer (its store away a moment) is
        // asked again from the same place, not the whole pass.
        let mut pause = Duration::from_millis(200);
        let page = loop {
            match client.rekey(request.clone()).await {
                Err(status)
                    if status.code() == Code::Unavailable && pause < Duration::from_secs(5) =>
                {
                    eprintln!("rekey: page {}: {}; retrying", pages + 1, status.message());
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                answered => break answered?.into_inner(),
            }
        };
        pages += 1;
        for (total, figure) in totals.iter_mut().zip([
            page.examined,
            page.resealed,
            page.current,
            page.erased,
            page.unreadable,
        ]) {
            *total += figure;
        }
        if !quiet {
            let [examined, resealed, current, erased, unreadable] = totals;
            eprintln!(
                "rekey: page {pages}: {examined} records examined, {resealed} answers re-sealed, \
                 {current} already current, {erased} erased, {unreadable} unreadable"
            );
        }
        if page.next_cursor.is_empty() {
            break page.retired_old_keys;
        }
        cursor = page.next_cursor;
    };
    let [examined, resealed, current, erased, unreadable] = totals;
    let code = if unreadable == 0 { 0 } else { exit_code::ERROR };
    Ok((
        code,
        json!({
            "pages": pages,
            "examined": examined,
            "resealed": resealed,
            "current": current,
            "erased": erased,
            "unreadable": unreadable,
            "retired_old_keys": retired,
        }),
    ))
}

/// Connects to `addr`: `HOST:PORT`, `http://HOST:PORT` or `unix:///path`.
pub async fn channel(addr: &str) -> Result<Channel, Status> {
    channel_with_tls(addr, None).await
}

/// Like [`channel`]; `https://HOST:PORT` with `tls` speaks TLS.
pub async fn channel_with_tls(addr: &str, tls: Option<ClientTlsConfig>) -> Result<Channel, Status> {
    let unavailable =
        |e: tonic::transport::Error| Status::unavailable(format!("cannot connect to {addr}: {e}"));
    if let Some(path) = unix_socket_path(addr) {
        // The URI is required but unused: the connector dials the socket.
        return Endpoint::from_static("http://localhost")
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .map_err(unavailable);
    }
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|e| Status::invalid_argument(format!("--addr {addr:?}: {e}")))?
        .connect_timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| Status::invalid_argument(format!("TLS settings: {e}")))?;
    }
    endpoint.connect().await.map_err(unavailable)
}

/// Adds `authorization: Bearer <token>` to every call, when a token is set.
#[derive(Debug, Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl BearerToken {
    /// An interceptor sending `token` (none: calls go without).
    pub fn new(token: Option<&str>) -> Result<Self, Status> {
        token
            .map(|token| {
                format!("Bearer {token}").parse().map_err(|_| {
                    Status::invalid_argument("--token holds characters a header cannot carry")
                })
            })
            .transpose()
            .map(BearerToken)
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

async fn health(channel: Channel, service: &str) -> Result<(i32, Value), Status> {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner()
        .status();
    let code = if status == ServingStatus::Serving {
        0
    } else {
        exit_code::ERROR
    };
    Ok((code, json!({ "status": status.as_str_name() })))
}

/// `GET /readyz` on the ops port: 200 is ready.
async fn readyz(address: std::net::SocketAddr) -> Result<(i32, Value), Status> {
    let unavailable = |e: &dyn std::fmt::Display| Status::unavailable(format!("{address}: {e}"));
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| unavailable(&e))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| unavailable(&e))?;
        tokio::spawn(connection);
        let request = http::Request::get("/readyz")
            .header(http::header::HOST, address.to_string())
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(|e| Status::internal(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unavailable(&e))?;
        Ok::<_, Status>(response.status())
    };
    let status = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| unavailable(&"no answer within 5s"))??;
    let code = if status == http::StatusCode::OK {
        0
    } else {
        exit_code::ERROR
    };
    Ok((code, json!({ "readyz": status.as_u16() })))
}

fn claim_answer(answer: &pb::ClaimResponse) -> (i32, Value) {
    let outcome =
        pb::ClaimOutcome::try_from(answer.outcome).unwrap_or(pb::ClaimOutcome::Unspecified);
    let mut value =
        json!({ "outcome": outcome.as_str_name().trim_start_matches("CLAIM_OUTCOME_") });
    let code = match outcome {
        pb::ClaimOutcome::Claimed => {
            value["lease_token"] = json!(answer.lease_token);
            value["fencing_token"] = json!(answer.fencing_token);
            value["attempt"] = json!(answer.attempt);
            value["recovered"] = json!(answer.recovered);
            value["lease_expires_at"] = time_json(answer.lease_expires_at.as_ref());
            0
        }
        pb::ClaimOutcome::Duplicate => exit_code::DUPLICATE,
        pb::ClaimOutcome::InProgress => {
            value["retry_after"] = answer
                .retry_after
                .and_then(|d| Duration::try_from(d).ok())
                .map_or(Value::Null, |d| {
                    json!(humantime::format_duration(d).to_string())
                });
            exit_code::IN_PROGRESS
        }
        pb::ClaimOutcome::FingerprintMismatch => exit_code::FINGERPRINT_MISMATCH,
        pb::ClaimOutcome::Stale => {
            value["highest_committed_sequence"] = json!(answer.highest_committed_sequence);
            exit_code::STALE
        }
        pb::ClaimOutcome::Unspecified => exit_code::ERROR,
    };
    if outcome != pb::ClaimOutcome::Claimed {
        if let Some(record) = &answer.record {
            value["record"] = record_json(record);
        }
    }
    (code, value)
}

fn commit_outcome_name(outcome: i32) -> &'static str {
    pb::CommitOutcome::try_from(outcome).map_or("UNKNOWN", |o| {
        o.as_str_name().trim_start_matches("COMMIT_OUTCOME_")
    })
}

fn time_json(at: Option<&prost_types::Timestamp>) -> Value {
    at.and_then(|at| SystemTime::try_from(*at).ok())
        .map_or(Value::Null, |at| {
            json!(humantime::format_rfc3339_millis(at).to_string())
        })
}

fn record_json(record: &pb::Record) -> Value {
    let state = pb::RecordState::try_from(record.state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("RECORD_STATE_")
    });
    let mut value = json!({
        "namespace": record.namespace,
        "correlation_id": record.correlation_id,
        "state": state,
        "fencing_token": record.fencing_token,
        "attempt": record.attempt,
        "event_type": record.event_type,
        "consumer_version": record.consumer_version,
        "owner": record.owner,
        "payload_fingerprint": record.payload_fingerprint,
        "claimed_at": time_json(record.claimed_at.as_ref()),
        "lease_expires_at": time_json(record.lease_expires_at.as_ref()),
        "committed_at": time_json(record.committed_at.as_ref()),
        "retain_until": time_json(record.retain_until.as_ref()),
    });
    match std::str::from_utf8(&record.response) {
        Ok(text) => value["response"] = json!(text),
        Err(_) => {
            let hex: String = record.response.iter().map(|b| format!("{b:02x}")).collect();
            value["response_hex"] = json!(hex);
        }
    }
    if record.response_erased {
        // Not an empty answer: the one stored was erased (its key destroyed).
        value["response_erased"] = json!(true);
    }
    if !record.ordering_key.is_empty() {
        value["ordering_key"] = json!(record.ordering_key);
        value["sequence"] = json!(record.sequence);
    }
    value
}

fn print_answer(answer: &Value, as_json: bool) {
    if as_json {
        println!("{answer}");
        return;
    }
    print_fields(answer, "");
}

fn print_fields(value: &Value, indent: &str) {
    let Value::Object(fields) = value else {
        return;
    };
    for (name, field) in fields {
        match field {
            Value::Object(_) => {
                println!("{indent}{name}:");
                print_fields(field, &format!("{indent}  "));
            }
            Value::String(text) if text.is_empty() => {}
            Value::String(text) => println!("{indent}{name}: {text}"),
            Value::Null => {}
            other => println!("{indent}{name}: {other}"),
        }
    }
}

fn print_error(status: &Status, as_json: bool) {
    let details = status.get_error_details();
    let violations: Vec<(String, String)> = details
        .bad_request()
        .map(|bad| {
            bad.field_violations
                .iter()
                .map(|v| (v.field.clone(), v.description.clone()))
                .collect()
        })
        .unwrap_or_default();
    let reason = details.error_info().map(|info| info.reason.clone());
    if as_json {
        let value = json!({
            "error": format!("{:?}", status.code()),
            "message": status.message(),
            "reason": reason,
            "field_violations": violations
                .iter()
                .map(|(field, description)| json!({"field": field, "description": description}))
                .collect::<Vec<_>>(),
        });
        eprintln!("{value}");
        return;
    }
    let code = match status.code() {
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Unavailable => "UNAVAILABLE",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::Internal => "INTERNAL",
        _ => "ERROR",
    };
    if violations.is_empty() {
        eprintln!("error: {code}: {}", status.message());
    } else {
        eprintln!("error: {code}");
    }
    for (field, description) in violations {
        eprintln!("  {field}: {description}");
    }
}
