//! Redis Sentinel: the primary is found by name through the sentinels
//! (`redis+sentinel://h1:26379,h2:26379/<name>`), and found again whenever
//! a connection to it fails or it stops being the primary, so the store
//! follows a failover without a fixed address in between.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use redis::{
    aio::{ConnectionLike, MultiplexedConnection},
    sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType},
    AsyncConnectionConfig, IntoConnectionInfo, RedisError, RedisResult, TlsCertificates,
};

use super::config::SentinelTarget;

/// How to ask the sentinels for the primary; shared by every connection.
pub(super) struct Sentinel {
    /// A fresh Sentinel client per lookup, asking the one sentinel given
    /// by its index: redis-rs's needs `&mut` for one, and lookups are rare
    /// (a connection's first use, and after a failure), so none is shared
    /// under a lock.
    build: Box<dyn Fn(usize) -> RedisResult<SentinelClient> + Send + Sync>,
    /// How many sentinels there are, and which one a lookup asks first
    /// (each lookup starts one further on).
    sentinels: usize,
    next: AtomicUsize,
    /// Each connection's timeouts (a lookup and a connection attempt are
    /// bounded by `timeout` together).
    config: AsyncConnectionConfig,
    timeout: Duration,
    db: i64,
}

impl Sentinel {
    /// The sentinels of `target`, their primary reached with the URL's
    /// credentials and database (TLS to both for `rediss+sentinel://`,
    /// trusting `certificates` if given).
    pub(super) fn new(
        target: &SentinelTarget,
        certificates: Option<TlsCertificates>,
        tcp: redis::io::tcp::TcpSettings,
        timeout: Duration,
    ) -> RedisResult<Arc<Sentinel>> {
        let infos = target
            .sentinels
            .iter()
            .map(|url| url.as_str().into_connection_info())
            .collect::<RedisResult<Vec<_>>>()?;
        let first = infos
            .first()
            .ok_or_else(|| {
                RedisError::from((redis::ErrorKind::InvalidClientConfig, "no sentinel"))
            })?
            .redis_settings()
            .clone();
        let addresses: Vec<_> = infos.iter().map(|info| info.addr().clone()).collect();
        let (name, tls, db) = (target.master.clone(), target.tls, target.db);
        let sentinels = addresses.len();
        let build = move |index: usize| {
            let asked = [addresses[index % addresses.len()].clone()];
            let mut builder = SentinelClientBuilder::new(asked, &name, SentinelServerType::Master)?
                .set_client_to_redis_db(db)
                .set_client_to_redis_tcp_settings(tcp.clone())
                .set_client_to_sentinel_tcp_settings(tcp.clone());
            if let Some(username) = first.username() {
                builder = builder
                    .set_client_to_redis_username(username)
                    .set_client_to_sentinel_username(username);
            }
            if let Some(password) = first.password() {
                builder = builder
                    .set_client_to_redis_password(password)
                    .set_client_to_sentinel_password(password);
            }
            if tls {
                builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
                if let Some(certificates) = &certificates {
                    builder = builder
                        .set_client_to_redis_certificates(certificates.clone())
                        .set_client_to_sentinel_certificates(certificates.clone());
                }
            }
            builder.build()
        };
        // Built once for each sentinel here, so a bad combination is an
        // error at start.
        for index in 0..sentinels {
            build(index)?;
        }
        Ok(Arc::new(Sentinel {
            build: Box::new(build),
            sentinels,
            next: AtomicUsize::new(0),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            timeout,
            db,
        }))
    }

    /// A client for the server the sentinels name as the primary now (one
    /// that says it is, asked by redis-rs before it is returned). The
    /// sentinels are asked one at a time, each for what is left of the
    /// timeout shared among those not asked yet, starting one further on
    /// each lookup: redis-rs asks them in order and waits on one that went
    /// silent (its host down, no reset) with no timeout of its own, so the
    /// others would never be heard.
    pub(super) async fn primary(&self) -> RedisResult<redis::Client> {
        let first = self.next.fetch_add(1, Relaxed);
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut failed = timed_out("no sentinel named the primary");
        for turn in 0..self.sentinels {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let turns_left = u32::try_from(self.sentinels - turn).unwrap_or(u32::MAX);
            let share = (left / turns_left).max(Duration::from_millis(100));
            let asked = match (self.build)(first + turn) {
                Ok(mut client) => tokio::time::timeout(share, client.async_get_client()).await,
                Err(error) => Ok(Err(error)),
            };
            match asked {
                Ok(Ok(primary)) => return Ok(primary),
                Ok(Err(error)) => failed = error,
                Err(_) => {
                    failed =
                        timed_out("a sentinel, or the primary it named, did not answer in time")
                }
            }
        }
        Err(failed)
    }

    /// One connection of the store's pool, through these sentinels.
    pub(super) fn connection(self: &Arc<Self>) -> SentinelConnection {
        SentinelConnection {
            sentinel: Arc::clone(self),
            current: Arc::new(Mutex::new(Current::default())),
        }
    }
}

/// Whether `value` is an error reply saying the server is no longer (or
/// not yet) the primary.
fn server_moved_on(value: &redis::Value) -> bool {
    let redis::Value::ServerError(error) = value else {
        return false;
    };
    matches!(error.code(), "READONLY" | "MASTERDOWN")
        // Before Redis 7 a script's write refused by a replica comes back
        // as a script error carrying the READONLY reply.
        || (error.code() == "ERR"
            && error
                .details()
                .is_some_and(|details| details.contains("READONLY") || details.contains("MASTERDOWN")))
}

fn timed_out(what: &'static str) -> RedisError {
    RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
}

/// A multiplexed connection to the primary the sentinels name, made on
/// first use and made again (the primary asked for again) after a call
/// fails in a way that says the server is gone or no longer the primary.
#[derive(Clone)]
pub struct SentinelConnection {
    sentinel: Arc<Sentinel>,
    current: Arc<Mutex<Current>>,
}

/// The connection in use, numbered: a failure seen on one connection drops
/// that one only, never a newer one another task has made since.
#[derive(Default)]
struct Current {
    generation: u64,
    connection: Option<MultiplexedConnection>,
}

impl SentinelConnection {
    /// The connection in use and its number, made (the primary asked for)
    /// if there is none.
    async fn connected(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(in_use) = self.in_use() {
            return Ok(in_use);
        }
        let connect = async {
            let primary = self.sentinel.primary().await?;
            primary
                .get_multiplexed_async_connection_with_config(&self.sentinel.config)
                .await
        };
        let connection = tokio::time::timeout(self.sentinel.timeout, connect)
            .await
            .map_err(|_| timed_out("the primary did not answer"))??;
        let mut current = self.current.lock().expect("sentinel lock");
        // Another task made one meanwhile: that one stays.
        if let Some(theirs) = &current.connection {
            return Ok((current.generation, theirs.clone()));
        }
        current.generation += 1;
        current.connection = Some(connection.clone());
        Ok((current.generation, connection))
    }

    fn in_use(&self) -> Option<(u64, MultiplexedConnection)> {
        let current = self.current.lock().expect("sentinel lock");
        current
            .connection
            .clone()
            .map(|connection| (current.generation, connection))
    }

    /// Drops connection number `generation`, if it is still the one in use.
    fn forget(&self, generation: u64) {
        let mut current = self.current.lock().expect("sentinel lock");
        if current.generation == generation {
            current.connection = None;
        }
    }

    /// After `error`, whether to ask the sentinels again: the connection
    /// broke, or its server is no longer the primary (a demoted one
    /// answers READONLY to writes; one failing over, MASTERDOWN).
    fn note(&self, generation: u64, error: &RedisError) {
        let moved_on = matches!(error.code(), Some("READONLY" | "MASTERDOWN"));
        if moved_on
            || error.is_io_error()
            || error.is_unrecoverable_error()
            || error.is_connection_dropped()
            || error.is_timeout()
        {
            self.forget(generation);
        }
    }

    /// [`SentinelConnection::note`] for errors that come back as answers:
    /// redis-rs hands a server's error reply (READONLY from a demoted
    /// primary) to the caller as a value, turned into an error only later.
    fn note_answer(&self, generation: u64, values: &[redis::Value]) {
        if values.iter().any(server_moved_on) {
            self.forget(generation);
        }
    }

    /// Asks the server whether it still is the primary (`ROLE`), and if
    /// not drops the connection: a demoted primary still answers reads,
    /// from data the promoted replica may not have. Run each heartbeat by
    /// [`super::RedisStore::keep_connected`].
    pub(super) async fn check_role(&self) -> RedisResult<Demoted> {
        // One not made yet will ask the sentinels when it is.
        let Some((generation, mut connection)) = self.in_use() else {
            return Ok(Demoted::No);
        };
        // A server gone silent (its host down, no reset) answers nothing:
        // calls on it time out without a word that would drop it, so the
        // role check drops it, and the next call asks the sentinels.
        let asked = tokio::time::timeout(
            self.sentinel.timeout,
            redis::cmd("ROLE").query_async::<redis::Value>(&mut connection),
        )
        .await;
        let role = match asked {
            Ok(Ok(role)) => role,
            Ok(Err(error)) => {
                self.note(generation, &error);
                return Err(error);
            }
            Err(_) => {
                self.forget(generation);
                return Err(timed_out("the primary did not answer ROLE"));
            }
        };
        let is_primary = match &role {
            redis::Value::Array(parts) => matches!(
                parts.first(),
                Some(redis::Value::BulkString(role)) if role == b"master"
            ),
            _ => false,
        };
        if is_primary {
            return Ok(Demoted::No);
        }
        self.forget(generation);
        Ok(Demoted::Yes)
    }
}

/// Whether [`SentinelConnection::check_role`] found its server demoted.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Demoted {
    No,
    /// No longer the primary: the connection was dropped.
    Yes,
}

impl std::fmt::Debug for SentinelConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConnection")
            .field("connected", &self.in_use().is_some())
            .finish()
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(
        &'a mut self,
        command: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let (generation, mut connection) = self.connected().await?;
            let answer = connection.req_packed_command(command).await;
            match &answer {
                Err(error) => self.note(generation, error),
                Ok(value) => self.note_answer(generation, std::slice::from_ref(value)),
            }
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let (generation, mut connection) = self.connected().await?;
            let answer = connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            match &answer {
                Err(error) => self.note(generation, error),
                Ok(values) => self.note_answer(generation, values),
            }
            answer
        })
    }

    fn get_db(&self) -> i64 {
        self.sentinel.db
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What redis-rs hands back for a server's error line.
    fn reply(line: &[u8]) -> redis::Value {
        redis::parse_redis_value(line).expect("a RESP reply")
    }

    #[test]
    fn a_demoted_or_failing_over_primarys_replies_are_told_apart() {
        assert!(server_moved_on(&reply(
            b"-READONLY You can't write against a read only replica.\r\n"
        )));
        assert!(server_moved_on(&reply(
            b"-MASTERDOWN Link with MASTER is down\r\n"
        )));
        assert!(server_moved_on(&reply(
            b"-ERR Error running script (call to f_1): @user_script:5: -READONLY You can't write against a read only replica.\r\n"
        )));
        assert!(!server_moved_on(&reply(b"-ERR unknown command\r\n")));
        assert!(!server_moved_on(&reply(b"+OK\r\n")));
    }
}
