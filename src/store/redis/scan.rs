//! A pass over every record under the store's prefix ([`Store::scan`]):
//! `SCAN … MATCH <prefix>:r:*` on one primary, or on each primary of a
//! cluster in turn (a node's `SCAN` sees only its own keys). The cursor is
//! the node's place in the cluster's list of primaries (by their first
//! slot) and that node's `SCAN` cursor, with a fingerprint of the nodes (a
//! cluster's primaries and their ranges, or one primary's `run_id`): a
//! `SCAN` cursor means nothing on another node, so a pass that meets a
//! failover or moved slots stops (FAILED_PRECONDITION) rather than skip
//! keys. `SCAN` may hand a key back more than once; a key there through
//! the whole pass is handed back at least once.
//!
//! [`Store::scan`]: crate::store::Store::scan

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use super::RedisStore;
use crate::{
    domain::Key,
    error::{Error, FieldViolation},
    store::{ScanCursor, ScanPage},
};

impl RedisStore {
    pub(super) async fn scan_page(
        &self,
        cursor: &ScanCursor,
        limit: usize,
    ) -> Result<ScanPage, Error> {
        let (nodes, fingerprint) = self.scan_nodes().await?;
        let (node, at) = match parse_cursor(&cursor.0)? {
            None => (0, 0),
            Some((seen, node, at)) if seen == fingerprint => (node, at),
            Some(_) => {
                return Err(Error::FailedPrecondition(
                    "Redis's primaries changed during the pass (a failover, or slots moved): \
                     run it again from the start"
                        .into(),
                ))
            }
        };
        let Some(&slot) = nodes.get(node) else {
            return Err(not_a_cursor());
        };
        let pattern = format!("{}:r:*", self.inner.prefix);
        let mut scan = redis::cmd("SCAN");
        scan.arg(at)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(limit.max(1));
        let routing = RoutingInfo::SingleNode(match slot {
            Some(slot) => SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
            None => SingleNodeRoutingInfo::Random,
        });
        let scan = &scan;
        let (next_at, names): (u64, Vec<String>) = self
            .call(|mut connection| {
                let routing = routing.clone();
                async move {
                    let answer = connection.route(scan.clone(), routing).await?;
                    Ok(redis::from_redis_value(answer)?)
                }
            })
            .await?;
        let mut page = ScanPage::default();
        let prefix = format!("{}:r:", self.inner.prefix);
        for name in names {
            let key = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.split_once('/'))
                .map(|(namespace, id)| Key::new_unchecked(namespace.to_owned(), id.to_owned()))
                .ok_or_else(|| Error::Corrupt(format!("a record key {name:?}")))?;
            page.keys.push(key);
        }
        page.next = match (next_at, node + 1 < nodes.len()) {
            (0, false) => None,
            (0, true) => Some(cursor_of(&fingerprint, node + 1, 0)),
            (at, _) => Some(cursor_of(&fingerprint, node, at)),
        };
        Ok(page)
    }

    /// The nodes a pass goes through — one primary (`None`: wherever the
    /// connection goes), or on a cluster each primary named by its first
    /// slot, in slot order — and their fingerprint.
    async fn scan_nodes(&self) -> Result<(Vec<Option<u16>>, String), Error> {
        if !self.is_cluster() {
            let info = redis::cmd("INFO").arg("server").clone();
            let info = &info;
            let text: String = self
                .call(|mut connection| async move { info.query_async(&mut connection).await })
                .await?;
            let run_id = text
                .lines()
                .find_map(|line| line.strip_prefix("run_id:"))
                .unwrap_or_default()
                .trim();
            return Ok((vec![None], fingerprint(run_id)));
        }
        let slots = redis::cmd("CLUSTER").arg("SLOTS").clone();
        let slots = &slots;
        let ranges: Vec<redis::Value> = self
            .call(|mut connection| async move {
                let random = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                let answer = connection.route(slots.clone(), random).await?;
                Ok(redis::from_redis_value(answer)?)
            })
            .await?;
        // Each range: start, end, [host, port, node id, …], replicas…
        let mut primaries: Vec<(u16, String)> = Vec::new();
        for range in ranges {
            let redis::Value::Array(parts) = range else {
                return Err(Error::Store(
                    "CLUSTER SLOTS answered an unknown shape".into(),
                ));
            };
            let start: u16 = parts
                .first()
                .and_then(|start| redis::from_redis_value_ref(start).ok())
                .ok_or_else(|| Error::Store("CLUSTER SLOTS without a start slot".into()))?;
            let node = format!("{:?}", parts.get(2));
            match primaries.iter_mut().find(|(_, seen)| *seen == node) {
                Some((first, _)) => *first = (*first).min(start),
                None => primaries.push((start, node)),
            }
        }
        primaries.sort();
        let described: String = primaries
            .iter()
            .map(|(slot, node)| format!("{slot} {node}\n"))
            .collect();
        Ok((
            primaries.into_iter().map(|(slot, _)| Some(slot)).collect(),
            fingerprint(&described),
        ))
    }
}

/// 16 hex digits naming `nodes`.
fn fingerprint(nodes: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(nodes.as_bytes());
    digest[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

fn cursor_of(fingerprint: &str, node: usize, at: u64) -> ScanCursor {
    ScanCursor(format!("{fingerprint}:{node}:{at}").into_bytes())
}

fn not_a_cursor() -> Error {
    Error::InvalidArgument(vec![FieldViolation::new(
        "cursor",
        "is not a cursor this store gave",
    )])
}

/// `None` for the start of a pass; else the nodes' fingerprint, the node
/// and its `SCAN` cursor.
fn parse_cursor(bytes: &[u8]) -> Result<Option<(String, usize, u64)>, Error> {
    if bytes.is_empty() {
        return Ok(None);
    }
    let parts = std::str::from_utf8(bytes).ok().and_then(|text| {
        let mut parts = text.splitn(3, ':');
        let fingerprint = parts.next()?.to_owned();
        Some((
            fingerprint,
            parts.next()?.parse().ok()?,
            parts.next()?.parse().ok()?,
        ))
    });
    parts.map(Some).ok_or_else(not_a_cursor)
}
