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
//! lease (and a second) after its `retain_until` — once the index is whole
//! (below).
//!
//! Kept lazily, so that a write seldom pays for it ([`record_entry`]): a
//! claim files one at its `retain_until`; the claim's commit, release or
//! renewal files none (the commit ends sooner than the claim would have,
//! by what was left of the lease, so a committed record is reaped at most
//! one lease late, in one read); a commit that shortens the retention
//! files its own. An entry whose record went (released, forgotten, taken
//! over) is dropped when it comes due.
//!
//! The entry is filed right after the compare-and-swap that needs it (so
//! a swap that loses — every DUPLICATE a fresh-key guess runs into —
//! writes nothing more), before the write counts as finished; a clean
//! close refuses new writes and waits for those in flight, so it finds
//! every entry filed. A crash can fall between
//! the two (sled may write the record out and not the entry), so the
//! index is known whole only after a clean close: it then leaves a marker,
//! removed at open. Opened without it — after a crash, on a data directory
//! from before the index, or after an older dedupd ran on it — the store
//! serves at once and files the missing entries in the background
//! ([`DueIndex::cover_all`]), while the reaper works on those it has.
//! The replay files an entry for each record it restores
//! ([`DueIndex::cover`]).

use sled::IVec;

use super::{
    codec::{decode_mark, decode_record, record_retain_until},
    wal::Tree,
};
use crate::{clock::UnixMillis, domain::Record, error::Error, machine::SequenceMark};

/// The index's tree.
const TREE_NAME: &[u8] = b"due";

/// Set in sled's default tree at a clean close when every record and mark
/// had an entry (holding the number of records); removed at open.
const WHOLE_KEY: &[u8] = b"meta/due-index-whole";

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

    /// The number of records the last run left, if it closed with every
    /// record and mark in the index; the marker is removed, so a crash from
    /// now on leaves it absent. Absent also on a data directory from before
    /// the index, and ignored when `older_ran` (an older dedupd opened the
    /// directory since: it files no entries).
    pub fn was_left_whole(db: &sled::Db, older_ran: bool) -> Result<Option<u64>, Error> {
        let marker = db.remove(WHOLE_KEY)?;
        Ok(marker
            .filter(|_| !older_ran)
            .and_then(|bytes| Some(u64::from_le_bytes(bytes[..].try_into().ok()?))))
    }

    /// Marks the index whole, with the number of records, at a clean close
    /// (before its last flush).
    pub fn mark_whole(db: &sled::Db, records: u64) -> Result<(), Error> {
        db.insert(WHOLE_KEY, &records.to_le_bytes()[..])?;
        Ok(())
    }

    /// Files an entry for every record and mark of `trees` that has none,
    /// until `stop` says so; the entries of each tree it went through. Runs
    /// in the background while the store serves: a record changed
    /// meanwhile has the entry its write filed, and one removed leaves an
    /// entry dropped when due.
    pub fn cover_all(
        &self,
        trees: [(Tree, &sled::Tree); 2],
        stop: impl Fn() -> bool,
    ) -> Result<Option<[u64; 2]>, Error> {
        let mut counts = [0u64; 2];
        for (count, (tree, entries_of)) in counts.iter_mut().zip(trees) {
            for entry in entries_of.iter() {
                if stop() {
                    return Ok(None);
                }
                let (key, value) = entry?;
                self.cover(tree, &key, &value)?;
                *count += 1;
            }
        }
        Ok(Some(counts))
    }

    /// Makes sure `key` of `tree`, holding `value`, has an entry (the
    /// replay, the background filing): the one its claim filed (a commit
    /// keeps the claim's lease end, which with the retention gives the
    /// claim's `retain_until`), or else one at its own `retain_until`. A
    /// released or renewed record, or one committed with a longer
    /// retention, may so get a second entry (read once more, when due). An
    /// unreadable value gets none: the reaper would skip it anyway.
    pub fn cover(&self, tree: Tree, key: &[u8], value: &[u8]) -> Result<(), Error> {
        let Some(Ok(retain_until)) = retain_until_of(tree, value) else {
            return Ok(());
        };
        let claims = match tree {
            Tree::Records => decode_record(value)
                .ok()
                .map(|record| record.lease_expires_at.saturating_add(record.retention)),
            Tree::Marks | Tree::Meta => None,
        };
        for at in claims.into_iter().filter(|&at| at != retain_until) {
            if self.tree.get(encode(at, tree, key))?.is_some() {
                return Ok(());
            }
        }
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
