//! What the load generator talks to: the dedupd sidecar or the no-op server
//! over gRPC, or the same operations done directly on Redis or PostgreSQL
//! (the obvious alternatives to a sidecar).

use std::{fmt, str::FromStr, sync::Arc, time::Duration};

use tokio_postgres::{NoTls, Statement};
use tonic::transport::{Channel, Endpoint};

use dedupd::proto::v1::{self as pb, claim_and_commit_client::ClaimAndCommitClient};

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// The PostgreSQL table the benchmark owns (created and emptied by it).
pub const PG_TABLE: &str = "dedupd_bench_processed_events";

/// A benchmark target, parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `dedupd://HOST:PORT`: the sidecar.
    Dedupd(String),
    /// `noop://HOST:PORT`: `dedupd-bench noop-server`.
    Noop(String),
    /// `redis://…` (or `redis+cluster://h1:p1,h2:p2` for a Redis Cluster,
    /// each command sent to its key's primary): SET NX PX, then SET PX.
    Redis(String),
    /// `postgres://…`: INSERT … ON CONFLICT DO NOTHING, then UPDATE.
    Postgres(String),
}

impl FromStr for Target {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| format!("{url:?} is not SCHEME://…"))?;
        match scheme {
            "dedupd" => Ok(Target::Dedupd(rest.to_owned())),
            "noop" => Ok(Target::Noop(rest.to_owned())),
            "redis" | "redis+cluster" => Ok(Target::Redis(url.to_owned())),
            "postgres" | "postgresql" => Ok(Target::Postgres(url.to_owned())),
            other => Err(format!(
                "unknown target scheme {other:?} (dedupd, noop, redis or postgres)"
            )),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Dedupd(address) => write!(f, "dedupd://{address}"),
            Target::Noop(address) => write!(f, "noop://{address}"),
            // Strip credentials: the URL goes into reports.
            Target::Redis(url) | Target::Postgres(url) => match url.split_once('@') {
                Some((scheme_and_user, host)) => {
                    let scheme = scheme_and_user.split("://").next().unwrap_or_default();
                    write!(f, "{scheme}://…@{host}")
                }
                None => f.write_str(url),
            },
        }
    }
}

/// What one call reported, per item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Outcome {
    /// CLAIMED.
    Claimed,
    /// DUPLICATE (for Redis and PostgreSQL: the key already existed).
    Duplicate,
    /// IN_PROGRESS.
    InProgress,
    /// STALE, FINGERPRINT_MISMATCH or an unknown outcome.
    Other,
    /// COMMITTED or ALREADY_COMMITTED.
    Committed,
    /// LEASE_LOST.
    LeaseLost,
}

impl Outcome {
    /// Upper-case name, as the API spells it.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Claimed => "CLAIMED",
            Outcome::Duplicate => "DUPLICATE",
            Outcome::InProgress => "IN_PROGRESS",
            Outcome::Other => "OTHER",
            Outcome::Committed => "COMMITTED",
            Outcome::LeaseLost => "LEASE_LOST",
        }
    }
}

/// One connection to the target.
#[derive(Clone)]
pub enum Connection {
    /// dedupd or the no-op server.
    Grpc(ClaimAndCommitClient<Channel>),
    /// Redis: one primary, or a cluster (the transport dedupd's store uses;
    /// the commands are the peer's own).
    Redis(dedupd::store::redis::Connection),
    /// PostgreSQL, with its prepared statements.
    Postgres(Arc<PgConnection>),
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Connection::Grpc(_) => "Connection::Grpc",
            Connection::Redis(_) => "Connection::Redis",
            Connection::Postgres(_) => "Connection::Postgres",
        })
    }
}

/// A PostgreSQL client with the benchmark's statements prepared.
#[derive(Debug)]
pub struct PgConnection {
    client: tokio_postgres::Client,
    claim: Statement,
    commit: Statement,
    claim_batch: Statement,
    commit_batch: Statement,
}

type Failure = String;

fn failed(error: impl fmt::Display) -> Failure {
    error.to_string()
}

impl Target {
    /// Opens `channels` connections (HTTP/2 connections, Redis or
    /// PostgreSQL connections); prepares the PostgreSQL table once.
    pub async fn connect(&self, channels: usize) -> Result<Vec<Connection>, Failure> {
        let mut connections = Vec::with_capacity(channels);
        if let Target::Postgres(url) = self {
            prepare_table(url).await?;
        }
        for _ in 0..channels {
            connections.push(match self {
                Target::Dedupd(address) | Target::Noop(address) => {
                    let channel = Endpoint::from_shared(format!("http://{address}"))
                        .map_err(failed)?
                        .tcp_nodelay(true)
                        .connect()
                        .await
                        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
                    Connection::Grpc(
                        ClaimAndCommitClient::new(channel)
                            .max_decoding_message_size(64 << 20)
                            .max_encoding_message_size(64 << 20),
                    )
                }
                Target::Redis(url) if dedupd::store::redis::is_cluster_url(url) => {
                    let nodes = dedupd::store::redis::nodes(url, true)?;
                    // redis-rs's defaults, as for one primary: what an
                    // application writing this by hand gets.
                    let cluster = redis::cluster::ClusterClientBuilder::new(nodes)
                        .build()
                        .map_err(failed)?;
                    Connection::Redis(dedupd::store::redis::Connection::Cluster(
                        cluster.get_async_connection().await.map_err(failed)?,
                    ))
                }
                Target::Redis(url) => {
                    let client = redis::Client::open(url.as_str()).map_err(failed)?;
                    Connection::Redis(dedupd::store::redis::Connection::Primary(
                        redis::aio::ConnectionManager::new(client)
                            .await
                            .map_err(failed)?,
                    ))
                }
                Target::Postgres(url) => Connection::Postgres(Arc::new(pg_connect(url).await?)),
            });
        }
        Ok(connections)
    }
}

async fn pg_client(url: &str) -> Result<tokio_postgres::Client, Failure> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

async fn prepare_table(url: &str) -> Result<(), Failure> {
    let client = pg_client(url).await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {PG_TABLE} (
                 correlation_id   VARCHAR(256) PRIMARY KEY,
                 event_type       VARCHAR(128) NOT NULL,
                 processed_at     TIMESTAMPTZ,
                 consumer_version VARCHAR(64)  NOT NULL,
                 state            VARCHAR(16)  NOT NULL,
                 lease_until      TIMESTAMPTZ  NOT NULL);
             TRUNCATE {PG_TABLE};"
        ))
        .await
        .map_err(failed)
}

async fn pg_connect(url: &str) -> Result<PgConnection, Failure> {
    let client = pg_client(url).await?;
    let lease_seconds = LEASE.as_secs();
    let claim = client
        .prepare(&format!(
            "INSERT INTO {PG_TABLE} (correlation_id, event_type, consumer_version, state, lease_until)
             VALUES ($1, 'bench', 'bench', 'claimed', now() + interval '{lease_seconds} seconds')
             ON CONFLICT DO NOTHING"
        ))
        .await
        .map_err(failed)?;
    let commit = client
        .prepare(&format!(
            "UPDATE {PG_TABLE} SET state = 'committed', processed_at = now()
             WHERE correlation_id = $1 AND state = 'claimed'"
        ))
        .await
        .map_err(failed)?;
    let claim_batch = client
        .prepare(&format!(
            "INSERT INTO {PG_TABLE} (correlation_id, event_type, consumer_version, state, lease_until)
             SELECT id, 'bench', 'bench', 'claimed', now() + interval '{lease_seconds} seconds'
             FROM unnest($1::text[]) AS id
             ON CONFLICT DO NOTHING RETURNING correlation_id"
        ))
        .await
        .map_err(failed)?;
    let commit_batch = client
        .prepare(&format!(
            "UPDATE {PG_TABLE} SET state = 'committed', processed_at = now()
             WHERE correlation_id = ANY($1::text[]) AND state = 'claimed'"
        ))
        .await
        .map_err(failed)?;
    Ok(PgConnection {
        client,
        claim,
        commit,
        claim_batch,
        commit_batch,
    })
}

fn claim_outcome(response: &pb::ClaimResponse) -> Outcome {
    match pb::ClaimOutcome::try_from(response.outcome) {
        Ok(pb::ClaimOutcome::Claimed) => Outcome::Claimed,
        Ok(pb::ClaimOutcome::Duplicate) => Outcome::Duplicate,
        Ok(pb::ClaimOutcome::InProgress) => Outcome::InProgress,
        _ => Outcome::Other,
    }
}

fn commit_outcome(response: &pb::CommitResponse) -> Outcome {
    match pb::CommitOutcome::try_from(response.outcome) {
        Ok(pb::CommitOutcome::Committed | pb::CommitOutcome::AlreadyCommitted) => {
            Outcome::Committed
        }
        Ok(pb::CommitOutcome::LeaseLost) => Outcome::LeaseLost,
        _ => Outcome::Other,
    }
}

fn claim_request(namespace: &str, id: &str) -> pb::ClaimRequest {
    pb::ClaimRequest {
        namespace: namespace.to_owned(),
        correlation_id: id.to_owned(),
        event_type: "bench".into(),
        consumer_version: "bench".into(),
        ..Default::default()
    }
}

fn commit_request(
    namespace: &str,
    id: &str,
    lease_token: &str,
    response: &[u8],
) -> pb::CommitRequest {
    pb::CommitRequest {
        namespace: namespace.to_owned(),
        correlation_id: id.to_owned(),
        lease_token: lease_token.to_owned(),
        response: response.to_vec(),
        ..Default::default()
    }
}

fn redis_key(namespace: &str, id: &str) -> String {
    format!("dedup:{namespace}:{id}")
}

fn claim_command(namespace: &str, id: &str) -> redis::Cmd {
    let mut command = redis::cmd("SET");
    command
        .arg(redis_key(namespace, id))
        .arg("claimed")
        .arg("NX")
        .arg("PX")
        .arg(LEASE.as_millis() as u64);
    command
}

fn commit_command(namespace: &str, id: &str) -> redis::Cmd {
    let mut command = redis::cmd("SET");
    command
        .arg(redis_key(namespace, id))
        .arg("committed")
        .arg("PX")
        .arg(RETENTION.as_millis() as u64);
    command
}

impl Connection {
    /// Claims one ID; returns the outcome and the lease token (empty for
    /// Redis and PostgreSQL, which have none).
    pub async fn claim(&mut self, namespace: &str, id: &str) -> Result<(Outcome, String), Failure> {
        match self {
            Connection::Grpc(client) => {
                let response = client
                    .claim(claim_request(namespace, id))
                    .await
                    .map_err(failed)?
                    .into_inner();
                Ok((claim_outcome(&response), response.lease_token))
            }
            Connection::Redis(connection) => {
                let set: Option<String> = claim_command(namespace, id)
                    .query_async(connection)
                    .await
                    .map_err(failed)?;
                let outcome = if set.is_some() {
                    Outcome::Claimed
                } else {
                    Outcome::Duplicate
                };
                Ok((outcome, String::new()))
            }
            Connection::Postgres(pg) => {
                let inserted = pg.client.execute(&pg.claim, &[&id]).await.map_err(failed)?;
                let outcome = if inserted == 1 {
                    Outcome::Claimed
                } else {
                    Outcome::Duplicate
                };
                Ok((outcome, String::new()))
            }
        }
    }

    /// Commits one claimed ID with `response` (stored by dedupd only).
    pub async fn commit(
        &mut self,
        namespace: &str,
        id: &str,
        lease_token: &str,
        response: &[u8],
    ) -> Result<Outcome, Failure> {
        match self {
            Connection::Grpc(client) => {
                let response = client
                    .commit(commit_request(namespace, id, lease_token, response))
                    .await
                    .map_err(failed)?
                    .into_inner();
                Ok(commit_outcome(&response))
            }
            Connection::Redis(connection) => {
                let _: String = commit_command(namespace, id)
                    .query_async(connection)
                    .await
                    .map_err(failed)?;
                Ok(Outcome::Committed)
            }
            Connection::Postgres(pg) => {
                let updated = pg
                    .client
                    .execute(&pg.commit, &[&id])
                    .await
                    .map_err(failed)?;
                Ok(if updated == 1 {
                    Outcome::Committed
                } else {
                    Outcome::LeaseLost
                })
            }
        }
    }

    /// Claims many IDs in one call (a pipeline for Redis, one statement for
    /// PostgreSQL); returns per-item outcomes and lease tokens.
    pub async fn claim_batch(
        &mut self,
        namespace: &str,
        ids: &[String],
    ) -> Result<Vec<(Outcome, String)>, Failure> {
        match self {
            Connection::Grpc(client) => {
                let items = ids.iter().map(|id| claim_request(namespace, id)).collect();
                let response = client
                    .claim_batch(pb::ClaimBatchRequest { items })
                    .await
                    .map_err(failed)?
                    .into_inner();
                Ok(response
                    .results
                    .into_iter()
                    .map(|r| (claim_outcome(&r), r.lease_token))
                    .collect())
            }
            Connection::Redis(connection) => {
                let mut pipe = redis::pipe();
                for id in ids {
                    pipe.add_command(claim_command(namespace, id));
                }
                let set: Vec<Option<String>> =
                    pipe.query_async(connection).await.map_err(failed)?;
                Ok(set
                    .into_iter()
                    .map(|s| {
                        let outcome = if s.is_some() {
                            Outcome::Claimed
                        } else {
                            Outcome::Duplicate
                        };
                        (outcome, String::new())
                    })
                    .collect())
            }
            Connection::Postgres(pg) => {
                let rows = pg
                    .client
                    .query(&pg.claim_batch, &[&ids])
                    .await
                    .map_err(failed)?;
                let inserted: std::collections::HashSet<String> =
                    rows.iter().map(|row| row.get::<_, String>(0)).collect();
                Ok(ids
                    .iter()
                    .map(|id| {
                        let outcome = if inserted.contains(id) {
                            Outcome::Claimed
                        } else {
                            Outcome::Duplicate
                        };
                        (outcome, String::new())
                    })
                    .collect())
            }
        }
    }

    /// Commits many claims in one call, each with `response` (stored by
    /// dedupd only).
    pub async fn commit_batch(
        &mut self,
        namespace: &str,
        claims: &[(String, String)],
        response: &[u8],
    ) -> Result<Vec<Outcome>, Failure> {
        match self {
            Connection::Grpc(client) => {
                let items = claims
                    .iter()
                    .map(|(id, token)| commit_request(namespace, id, token, response))
                    .collect();
                let response = client
                    .commit_batch(pb::CommitBatchRequest { items })
                    .await
                    .map_err(failed)?
                    .into_inner();
                Ok(response.results.iter().map(commit_outcome).collect())
            }
            Connection::Redis(connection) => {
                let mut pipe = redis::pipe();
                for (id, _) in claims {
                    pipe.add_command(commit_command(namespace, id)).ignore();
                }
                let () = pipe.query_async(connection).await.map_err(failed)?;
                Ok(vec![Outcome::Committed; claims.len()])
            }
            Connection::Postgres(pg) => {
                let ids: Vec<&str> = claims.iter().map(|(id, _)| id.as_str()).collect();
                let updated = pg
                    .client
                    .execute(&pg.commit_batch, &[&ids])
                    .await
                    .map_err(failed)?;
                let outcome = if updated as usize == claims.len() {
                    Outcome::Committed
                } else {
                    Outcome::LeaseLost
                };
                Ok(vec![outcome; claims.len()])
            }
        }
    }
}
