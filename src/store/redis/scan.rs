//! A pass over every record under the store's prefix ([`Store::scan`]):
//! `SCAN … MATCH <prefix>:r:*` on one primary, or on each primary of a
//! cluster in turn (a node's `SCAN` sees only its own keys). The cursor is
//! the node's place in the cluster's list of primaries (by their first
//! slot) and that node's `SCAN` cursor. `SCAN` may hand a key back more
//! than once; a key there through the whole pass is handed back at least
//! once, unless a cluster's slots move during it (then run the pass again).
//!
//! [`Store::scan`]: crate::store::Store::scan

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use super::RedisStore;
use crate::{
    domain::Key,
    error::Error,
    store::{ScanCursor, ScanPage, Store},
};

impl RedisStore {
    pub(super) async fn scan_page(
        &self,
        cursor: &ScanCursor,
        limit: usize,
    ) -> Result<ScanPage, Error> {
        let (node, at) = parse_cursor(&cursor.0)?;
        let nodes = self.scan_nodes().await?;
        let Some(&slot) = nodes.get(node) else {
            // The cluster shrank since the pass began: it is through.
            return Ok(ScanPage::default());
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
            // Read as any call reads (witnessed and fenced where it must be).
            if let Some(record) = self.get(&key).await? {
                page.records.push((key, record));
            }
        }
        page.next = match (next_at, node + 1 < nodes.len()) {
            (0, false) => None,
            (0, true) => Some(cursor_of(node + 1, 0)),
            (at, _) => Some(cursor_of(node, at)),
        };
        Ok(page)
    }

    /// The nodes a pass goes through: one primary (`None`: wherever the
    /// connection goes), or on a cluster each primary named by its first
    /// slot, in slot order.
    async fn scan_nodes(&self) -> Result<Vec<Option<u16>>, Error> {
        if !self.is_cluster() {
            return Ok(vec![None]);
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
        Ok(primaries.into_iter().map(|(slot, _)| Some(slot)).collect())
    }
}

fn cursor_of(node: usize, at: u64) -> ScanCursor {
    ScanCursor(format!("{node}:{at}").into_bytes())
}

fn parse_cursor(bytes: &[u8]) -> Result<(usize, u64), Error> {
    if bytes.is_empty() {
        return Ok((0, 0));
    }
    let text = std::str::from_utf8(bytes).ok();
    text.and_then(|text| text.split_once(':'))
        .and_then(|(node, at)| Some((node.parse().ok()?, at.parse().ok()?)))
        .ok_or_else(|| {
            Error::InvalidArgument(vec![crate::error::FieldViolation::new(
                "cursor",
                "is not a cursor this store gave",
            )])
        })
}
