//! The deletion feed: every deleting statement notifies
//! `dedupd_deleted` at its commit; each sidecar listens on a connection of
//! its own and hands the deleted keys to its local tier.

use tokio::sync::mpsc;
use tokio_postgres::NoTls;

use super::{Listen, PostgresStore};
use crate::{
    domain::Key,
    error::Error,
    store::shared::{parse_deletion, DeletionFeed, FEED_BUFFER, HEARTBEAT},
};

/// The channel every dedupd over one database notifies deletions on; the
/// payload names the schema, so sidecars over other schemas ignore it.
pub(super) const DELETION_CHANNEL: &str = "dedupd_deleted";

impl DeletionFeed for PostgresStore {
    async fn subscribe(&self) -> Result<mpsc::Receiver<Key>, Error> {
        let (notices, mut noticed) = mpsc::unbounded_channel();
        // A channel of this subscription's own, for probes: see below.
        let probe_channel = format!("dedupd_probe_{:016x}", rand::random::<u64>());
        let connected = tokio::time::timeout(self.inner.timeout, async {
            let client = match &self.inner.listen {
                Listen::Plain(config) => {
                    let (client, connection) = config.connect(NoTls).await?;
                    tokio::spawn(forward_notices(connection, notices));
                    client
                }
                Listen::Tls(config, tls) => {
                    let (client, connection) = config.connect(tls.clone()).await?;
                    tokio::spawn(forward_notices(connection, notices));
                    client
                }
            };
            client
                .batch_execute(&format!(
                    "LISTEN {DELETION_CHANNEL}; LISTEN {probe_channel}"
                ))
                .await?;
            Ok(client)
        })
        .await
        .map_err(|_| Error::Unavailable("PostgreSQL did not answer LISTEN".into()))?;
        let client = self.observe(connected)?;
        // LISTEN can succeed and still hear nothing: behind a pooler in
        // transaction mode (PgBouncer's usual setting) the listening server
        // session goes back to the pool. So the feed proves itself the way
        // other sidecars' deletions would reach it: a probe notified from a
        // pooled connection must arrive on the listening one, at start and
        // on every heartbeat, or the feed is given up (and the local tier
        // stays off).
        let probe = 0u64;
        self.notify_probe(&probe_channel, probe).await?;
        let mut early = Vec::new();
        let heard = tokio::time::timeout(self.inner.timeout, async {
            while let Some(notice) = noticed.recv().await {
                if notice.channel() == probe_channel {
                    if notice.payload() == probe.to_string() {
                        return true;
                    }
                } else {
                    early.push(notice);
                }
            }
            false
        })
        .await;
        if matches!(heard, Ok(false)) {
            return Err(Error::Unavailable(
                "the LISTEN connection closed while proving itself".into(),
            ));
        }
        if heard.is_err() {
            let reason = "a NOTIFY sent by this sidecar never reached its own LISTEN connection \
                          (is a connection pooler in transaction mode, such as PgBouncer, between \
                          dedupd and PostgreSQL?): no deletion feed, so the local tier stays off";
            tracing::warn!("{reason}");
            return Err(Error::Unavailable(reason.into()));
        }
        let store = self.clone();
        let schema = self.inner.schema.clone();
        let (deleted, receiver) = mpsc::channel(FEED_BUFFER);
        tokio::spawn(async move {
            let _listening = client;
            let forward = |notice: tokio_postgres::Notification| {
                notice
                    .payload()
                    .split_once(' ')
                    .filter(|(from, _)| *from == schema)
                    .and_then(|(_, key)| parse_deletion(key))
            };
            for notice in early {
                if let Some(key) = forward(notice) {
                    if deleted.send(key).await.is_err() {
                        return;
                    }
                }
            }
            let mut heartbeat = tokio::time::interval(HEARTBEAT);
            heartbeat.tick().await;
            let (mut sent, mut heard) = (probe, probe);
            loop {
                tokio::select! {
                    // A notice already here is taken before the heartbeat
                    // judges the probes.
                    biased;
                    notice = noticed.recv() => {
                        let Some(notice) = notice else { break };
                        if notice.channel() == probe_channel {
                            if let Ok(number) = notice.payload().parse::<u64>() {
                                heard = heard.max(number);
                            }
                        } else if let Some(key) = forward(notice) {
                            if deleted.send(key).await.is_err() {
                                break;
                            }
                        }
                    }
                    () = deleted.closed() => break,
                    _ = heartbeat.tick() => {
                        // Each probe has two heartbeats to come back: a
                        // connection that died without a word, or one that
                        // stopped hearing, is found within three.
                        if sent > heard + 1 {
                            tracing::debug!(sent, heard, "the deletion feed missed its probes");
                            break;
                        }
                        sent += 1;
                        // Sent beside the loop: a busy pool delays a probe,
                        // it does not hold up the notices.
                        let (store, channel) = (store.clone(), probe_channel.clone());
                        tokio::spawn(async move {
                            let _ = store.notify_probe(&channel, sent).await;
                        });
                    }
                }
            }
        });
        Ok(receiver)
    }
}

impl PostgresStore {
    /// Notifies `channel` with `probe` from a pooled connection, by the
    /// simple protocol (no prepared statement: it must pass a pooler in
    /// transaction mode to show what that pooler does to LISTEN). Both are
    /// ours: a `dedupd_probe_<hex>` identifier and a number.
    async fn notify_probe(&self, channel: &str, probe: u64) -> Result<(), Error> {
        let client = self.client().await?;
        let notify = format!("NOTIFY {channel}, '{probe}'");
        self.bounded(&client, client.batch_execute(&notify)).await
    }
}

/// Drives the listening connection, handing its notifications on; returns
/// when the connection ends.
async fn forward_notices<S, T>(
    mut connection: tokio_postgres::Connection<S, T>,
    notices: mpsc::UnboundedSender<tokio_postgres::Notification>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
        match message {
            Ok(tokio_postgres::AsyncMessage::Notification(notice)) => {
                if notices.send(notice).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(%error, "PostgreSQL deletion feed connection ended");
                return;
            }
        }
    }
}
