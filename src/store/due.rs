//! The embedded store's expiry index: which records and ordering marks are
//! due for the reaper, so that a pass reads what is due and nothing else.
//!
//! One sled tree, `due`: key = a time (8 bytes, big-endian, so the tree is
//! in time order; rounded up to the second) ‖ tree tag (1 byte) ‖ the
//! entry's key; value empty.
//! Entries are hints, never truth: the reaper reads the record an entry
//! names and decides on what it finds — absent: the entry goes; expired:
//! the record is removed by compare-and-swap; not yet: it is filed again at
//! its `retain_until`. **Every record and mark has an entry**, at most one
//! lease (and a second) after its `retain_until`.
//!
//! Kept lazily, so that a write seldom pays for it ([`record_entry`]): a
//! claim files one at its `retain_until`; the claim's commit, release or
//! renewal files none (the commit ends sooner than the claim would have,
//! by what was left of the lease, so a committed record is reaped at most
//! one lease late, in one read); a commit that shortens the retention
//! files its own. An entry whose record went (released, forgotten, taken
//! over) is dropped when it comes due.
//!
//! The entry is filed right after the compare-and-swap that needs it,
//! under the log's lock: a checkpoint (which takes that lock to collect
//! frames) never falls between them, so a record sled has checkpointed has
//! its entry, and one it has not is in the log. With `--sync none` (no
//! log) it is filed just before the swap instead: sled recovers a prefix of
//! its own writes, so a record it kept has its entry (a swap that loses
//! leaves one without a record, dropped when due).
//!
//! Entries are not in the write-ahead log: the replay files an entry for
//! each record it restores ([`DueIndex::cover`]). A data directory from
//! before the index is indexed once at open
//! ([`DueIndex::build_unless_built`]), crash-safely: the marker that says
//! it is done is written only after the entries are checkpointed.

use sled::IVec;

use super::{
    codec::{decode_mark, record_retain_until},
    wal::Tree,
};
use crate::{clock::UnixMillis, domain::Record, error::Error, machine::SequenceMark};

/// The index's tree.
const TREE_NAME: &[u8] = b"due";

/// Set in sled's default tree once every record and mark has an entry.
pub const BUILT_KEY: &[u8] = b"meta/due-index-built";

/// The expiry index (see the module docs).
#[derive(Debug, Clone)]
pub struct DueIndex {
    tree: sled::Tree,
}

/// One entry, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueEntry {
    /// When it is due (a `retain_until` rounded up).
    pub at: UnixMillis,
    pub tree: Tree,
    pub key: Vec<u8>,
}

/// When an entry of `tree` stops being live; `None` for trees without
/// expiry.
pub fn retain_until_of(tree: Tree, bytes: &[u8]) -> Option<Result<UnixMillis, Error>> {
    match tree {
        Tree::Records => Some(record_retain_until(bytes)),
        Tree::Marks => Some(decode_mark(bytes).map(|mark| mark.retain_until)),
        Tree::Meta => None,
    }
}

/// The entry a write of `new` over `current` must file, if any: one at
/// `new`'s `retain_until` when the write starts a claim (the key was
/// absent or expired, or a recovered claim took it over) or shortens the
/// retention. The other writes of one claim — renew, release, commit with
/// the same retention — leave the claim's entry to cover them: it is at
/// most one lease after their `retain_until` (a commit or release ends the
/// lease early), so a record is reaped at most one lease late.
pub fn record_entry(current: Option<&Record>, new: &Record) -> Option<UnixMillis> {
    let starts_a_claim = current.is_none_or(|old| old.lease_token != new.lease_token);
    let shortens = current.is_some_and(|old| new.retention < old.retention);
    (starts_a_claim || shortens).then_some(new.retain_until)
}

/// The entry a write of an ordering mark must file: when the mark is new or
/// its `retain_until` moves earlier (it never does: marks keep the latest).
pub fn mark_entry(current: Option<SequenceMark>, new: SequenceMark) -> Option<UnixMillis> {
    current
        .is_none_or(|old| new.retain_until < old.retain_until)
        .then_some(new.retain_until)
}

fn tag(tree: Tree) -> u8 {
    match tree {
        Tree::Records => 0,
        Tree::Marks => 1,
        Tree::Meta => unreachable!("the meta tree has no expiry"),
    }
}

/// Entry times are rounded up to this: the entries of one second sort by
/// key, so concurrent claims file theirs across the tree's leaves instead
/// of all at its right edge (and a record is reaped up to a second later).
const GRANULARITY_MS: u64 = 1000;

fn encode(retain_until: UnixMillis, tree: Tree, key: &[u8]) -> Vec<u8> {
    let at = retain_until
        .0
        .div_ceil(GRANULARITY_MS)
        .saturating_mul(GRANULARITY_MS);
    let mut bytes = Vec::with_capacity(9 + key.len());
    bytes.extend_from_slice(&at.to_be_bytes());
    bytes.push(tag(tree));
    bytes.extend_from_slice(key);
    bytes
}

fn decode(bytes: &[u8]) -> Option<DueEntry> {
    let (time, rest) = bytes.split_first_chunk::<8>()?;
    let (tag, key) = rest.split_first()?;
    let tree = match tag {
        0 => Tree::Records,
        1 => Tree::Marks,
        _ => return None,
    };
    Some(DueEntry {
        at: UnixMillis(u64::from_be_bytes(*time)),
        tree,
        key: key.to_vec(),
    })
}

impl DueIndex {
    /// Opens the index's tree in `db`.
    pub fn open(db: &sled::Db) -> Result<DueIndex, Error> {
        Ok(DueIndex {
            tree: db.open_tree(TREE_NAME)?,
        })
    }

    /// Builds the index from `trees` unless `db` holds the marker saying it
    /// was built (a data directory from before the index, or one whose
    /// build a crash cut short: entries are idempotent); `true` if it
    /// built. The caller checkpoints and then calls
    /// [`DueIndex::mark_built`].
    pub fn build_unless_built(
        &self,
        db: &sled::Db,
        trees: [(Tree, &sled::Tree); 2],
    ) -> Result<bool, Error> {
        if db.get(BUILT_KEY)?.is_some() {
            return Ok(false);
        }
        let started = std::time::Instant::now();
        let mut entries = 0u64;
        for (tree, entries_of) in trees {
            for entry in entries_of.iter() {
                let (key, value) = entry?;
                self.cover(tree, &key, &value)?;
                entries += 1;
            }
        }
        if entries > 0 {
            tracing::info!(
                entries,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "indexed the data directory's expiry times (once, for the reaper)"
            );
        }
        Ok(true)
    }

    /// Records that every entry has its index entry: called once what
    /// [`DueIndex::open`] built is checkpointed.
    pub fn mark_built(db: &sled::Db) -> Result<(), Error> {
        db.insert(BUILT_KEY, &[1u8][..])?;
        Ok(())
    }

    /// Makes sure `key` of `tree`, holding `value`, has an entry at its
    /// `retain_until` (the replay, the build). An unreadable value gets
    /// none: the reaper would skip it anyway.
    pub fn cover(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<(), Error> {
        let Some(Ok(retain_until)) = retain_until_of(tree, value) else {
            return Ok(());
        };
        let entry = encode(retain_until, tree, key);
        if self.tree.get(&entry)?.is_none() {
            self.tree.insert(entry, IVec::default())?;
        }
        Ok(())
    }

    /// Files an entry for `key` of `tree` at `retain_until`.
    pub fn file(
        &self,
        retain_until: UnixMillis,
        tree: Tree,
        key: &[u8],
    ) -> Result<(), sled::Error> {
        self.tree
            .insert(encode(retain_until, tree, key), IVec::default())?;
        Ok(())
    }

    /// The entries due by `now`, earliest first, as (raw key, parsed
    /// entry); `None` for an entry this version cannot read.
    pub fn due(
        &self,
        now: UnixMillis,
    ) -> impl Iterator<Item = Result<(IVec, Option<DueEntry>), sled::Error>> {
        let end = now.0.saturating_add(1).to_be_bytes();
        self.tree.range(..&end[..]).keys().map(|raw| {
            raw.map(|raw| {
                let entry = decode(&raw);
                (raw, entry)
            })
        })
    }

    /// Drops one entry by its raw key.
    pub fn drop_entry(&self, raw: &[u8]) -> Result<(), sled::Error> {
        self.tree.remove(raw)?;
        Ok(())
    }

    /// How many entries the index holds (tests).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.tree.len()
    }

    /// Empties the index (tests: a data directory from before it).
    #[cfg(test)]
    pub fn clear(&self) {
        self.tree.clear().unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_and_sorts_by_time() {
        let early = encode(UnixMillis(5), Tree::Records, b"zz");
        let late = encode(UnixMillis(1_001), Tree::Marks, b"aa");
        assert!(early < late, "time order, whatever the key");
        let same_second = encode(UnixMillis(999), Tree::Records, b"aa");
        assert!(same_second < early, "within a second, key order");
        assert_eq!(
            decode(&late),
            Some(DueEntry {
                at: UnixMillis(2_000),
                tree: Tree::Marks,
                key: b"aa".to_vec(),
            })
        );
        assert_eq!(decode(&[0; 8]), None, "no tag");
        assert_eq!(decode(&[0; 9][..8]), None);
        let mut unknown = encode(UnixMillis(1), Tree::Records, b"k");
        unknown[8] = 7;
        assert_eq!(decode(&unknown), None);
    }
}
