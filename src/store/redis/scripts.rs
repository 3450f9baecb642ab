//! The Lua scripts and how calls run them: the compare-and-set write of a
//! record (the [`Conditional`] half of [`crate::store::optimistic`]'s
//! loop) and of an ordering mark, and reads (plain commands, or on a
//! cluster with `--store-replicas` a script that leaves the call's
//! witness).

use redis::{FromRedisValue, ScriptInvocation};

use super::{
    records::{
        decode_mark, decode_stored, encode_mark, encode_without_token, parse_token, Held, Stored,
    },
    Attempt, RedisStore,
};
use crate::{
    clock::UnixMillis,
    domain::{FencingToken, Key},
    error::Error,
    machine::{Change, SequenceMark},
    store::{
        optimistic::{Conditional, Swapped},
        shared::deletion_message,
    },
};

/// The first lines of every script a witnessed call runs (see
/// [`RedisStore::fence`]): this call's witness key, in its key's slot, is
/// written in the same atomic step as what the call reads or writes.
macro_rules! witness_lua {
    () => {
        "
-- KEYS[2], when given: this call's witness key (in KEYS[1]'s slot);
-- ARGV[#ARGV] its time to live in ms
if KEYS[2] then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[#ARGV])
end
"
    };
}

/// Writes a record if it still is what the caller read; otherwise answers
/// with what it is. Draws the fencing token when asked to.
pub(super) const UPDATE_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] the record; ARGV[1], ARGV[2]: its bytes and token as believed ('' = absent)
-- ARGV[3] 'put': ARGV[4] new bytes, ARGV[5] token ('' = draw one), ARGV[6] ttl ms
-- ARGV[3] 'delete': ARGV[4] channel, ARGV[5] message
local now = redis.call('HMGET', KEYS[1], 'r', 'f')
local bytes, token = now[1] or '', now[2] or ''
if bytes ~= ARGV[1] or token ~= ARGV[2] then
  return {0, bytes, token}
end
if ARGV[3] == 'delete' then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return {1, '', ''}
end
local new_token = ARGV[5]
if new_token == '' then
  local clock = redis.call('TIME')
  local micros = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  new_token = string.format('%.0f', math.max(micros, (tonumber(token) or 0) + 1))
end
redis.call('HSET', KEYS[1], 'r', ARGV[4], 'f', new_token)
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return {1, new_token, ''}
"
);

/// The same for an ordering mark (a plain string).
pub(super) const MARK_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] the mark; ARGV[1] as believed ('' = absent); ARGV[2] new; ARGV[3] ttl ms
local now = redis.call('GET', KEYS[1]) or ''
if now ~= ARGV[1] then
  return {0, now}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {1, ''}
"
);

/// A read that leaves its witness (only on a cluster with
/// `--store-replicas`; elsewhere reads are plain commands).
pub(super) const READ_SCRIPT: &str = concat!(
    witness_lua!(),
    r"
-- KEYS[1] a record ('record': its bytes and token) or a mark (ARGV[1] 'mark')
if ARGV[1] == 'record' then
  return redis.call('HMGET', KEYS[1], 'r', 'f')
end
return redis.call('GET', KEYS[1])
"
);

/// What a read fetches.
#[derive(Clone, Copy)]
pub(super) enum Fetch {
    /// A record's bytes and token (`HMGET r f`).
    Record,
    /// An ordering mark (`GET`).
    Mark,
}

/// What the update script is asked to write.
pub(super) enum Write {
    /// The record's bytes at rest (see [`encode_without_token`]), its
    /// fencing token (`None`: draw one), and when it stops being live.
    Put {
        bytes: Vec<u8>,
        token: Option<FencingToken>,
        retain_until: UnixMillis,
    },
    Delete,
}

/// What the update script answered.
pub(super) enum Swap {
    /// Written; the fencing token the record now has (empty for a delete).
    Done(String),
    /// The record was not what the caller believed: here is what it is.
    Conflict(Option<Box<Stored>>),
}

impl RedisStore {
    pub(super) async fn read(&self, redis_key: &str) -> Result<Option<Stored>, Error> {
        let (bytes, token): (Option<Vec<u8>>, Option<String>) =
            self.fetch(redis_key, Fetch::Record).await?;
        decode_stored(bytes.unwrap_or_default(), token.unwrap_or_default())
    }

    /// Reads a record or a mark: a plain command, or on a cluster with
    /// `--store-replicas` the read script, which leaves the call's witness.
    pub(super) async fn fetch<T: FromRedisValue>(
        &self,
        redis_key: &str,
        what: Fetch,
    ) -> Result<T, Error> {
        if self.witnessing() {
            let mut invocation = self.inner.read.key(redis_key);
            invocation.arg(match what {
                Fetch::Record => "record",
                Fetch::Mark => "mark",
            });
            self.add_witness(&mut invocation, redis_key)?;
            let invocation = &invocation;
            return self
                .call(
                    |mut connection| async move { invocation.invoke_async(&mut connection).await },
                )
                .await;
        }
        let read = match what {
            Fetch::Record => redis::cmd("HMGET").arg(redis_key).arg("r").arg("f").clone(),
            Fetch::Mark => redis::cmd("GET").arg(redis_key).clone(),
        };
        let read = &read;
        self.call(|mut connection| async move { read.query_async(&mut connection).await })
            .await
    }

    /// Makes `write` if the record is still `believed`.
    pub(super) async fn swap(
        &self,
        key: &Key,
        redis_key: &str,
        believed: Option<&Stored>,
        write: &Write,
    ) -> Result<Attempt<Swap>, Error> {
        let mut invocation = self.inner.update.key(redis_key);
        match believed {
            Some(stored) => invocation
                .arg(&stored.version.bytes[..])
                .arg(&stored.version.token),
            None => invocation.arg("").arg(""),
        };
        match write {
            Write::Put {
                bytes,
                token,
                retain_until,
            } => {
                invocation
                    .arg("put")
                    .arg(&bytes[..])
                    .arg(token.map_or_else(String::new, |token| token.0.to_string()))
                    .arg(self.ttl_ms(*retain_until));
            }
            Write::Delete => {
                invocation
                    .arg("delete")
                    .arg(self.channel())
                    .arg(deletion_message(key));
            }
        }
        self.add_witness(&mut invocation, redis_key)?;
        let attempt = self
            .write_script::<(i64, Vec<u8>, String)>(&invocation)
            .await?;
        let (done, bytes, token) = attempt.answer;
        let answer = if done == 1 {
            // `bytes` is empty here; the second field is the token.
            Swap::Done(
                String::from_utf8(bytes)
                    .map_err(|_| Error::Corrupt("fencing token is not text".into()))?,
            )
        } else {
            Swap::Conflict(decode_stored(bytes, token)?.map(Box::new))
        };
        Ok(Attempt {
            answer,
            retried: attempt.retried,
        })
    }

    /// Runs a write script, telling whether it took a second attempt.
    async fn write_script<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<Attempt<T>, Error> {
        self.call_tracked(self.connection(), |mut connection| async move {
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    /// [`Store::update_mark`](crate::store::Store::update_mark) inside its witness scope.
    pub(super) async fn update_mark_witnessed<F>(
        &self,
        redis_key: &str,
        mut apply: F,
    ) -> Result<(), Error>
    where
        F: FnMut(Option<SequenceMark>) -> Option<SequenceMark> + Send,
    {
        let mut current = self
            .fetch::<Option<String>>(redis_key, Fetch::Mark)
            .await?
            .unwrap_or_default();
        while let Some(next) = apply(decode_mark(&current)?) {
            let mut invocation = self.inner.mark.key(redis_key);
            invocation
                .arg(&current)
                .arg(encode_mark(next))
                .arg(self.ttl_ms(next.retain_until));
            self.add_witness(&mut invocation, redis_key)?;
            let (done, now): (i64, String) = self.write_script(&invocation).await?.answer;
            if done == 1 || now == encode_mark(next) {
                break;
            }
            current = now;
        }
        self.fence(redis_key).await
    }
}

/// Whether what the update script found is our own `write`, carried out by
/// an attempt whose answer was lost:
/// - a claim (`draw_token`): the bytes hold the lease token this call drew at
///   random, so equal bytes are ours, retried or not;
/// - any other write, only if the call was `retried`: other changes are
///   deterministic, so equal bytes could be another sidecar's identical
///   write, but after a retry our first attempt may have landed — a Commit
///   answers COMMITTED (not ALREADY_COMMITTED), a Forget finds the record it
///   deleted.
fn is_our_write(write: &Write, found: Option<&Stored>, draw_token: bool, retried: bool) -> bool {
    match (write, found) {
        (Write::Put { bytes, token, .. }, Some(found)) if found.version.bytes == *bytes => {
            draw_token
                || (retried
                    && token.is_some_and(|token| token.0.to_string() == found.version.token))
        }
        (Write::Delete, None) => retried,
        _ => false,
    }
}

impl Conditional for RedisStore {
    type Version = Held;

    async fn read(&self, key: &Key) -> Result<Option<Stored>, Error> {
        RedisStore::read(self, &self.record_key(key)).await
    }

    async fn write_if(
        &self,
        key: &Key,
        believed: Option<&Stored>,
        change: &Change,
        draw_token: bool,
    ) -> Result<Swapped<Held>, Error> {
        let write = match change {
            Change::Keep => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
            Change::Delete if believed.is_none() => {
                return Ok(Swapped::Done {
                    token: None,
                    version: None,
                })
            }
            Change::Delete => Write::Delete,
            Change::Put(next) => Write::Put {
                bytes: encode_without_token(next),
                token: (!draw_token).then_some(next.fencing_token),
                retain_until: next.retain_until,
            },
        };
        let swapped = self
            .swap(key, &self.record_key(key), believed, &write)
            .await?;
        let token = match swapped.answer {
            Swap::Done(token) => token,
            // Our own write, made by an attempt whose answer was lost.
            Swap::Conflict(current)
                if is_our_write(&write, current.as_deref(), draw_token, swapped.retried) =>
            {
                current
                    .map(|stored| stored.version.token)
                    .unwrap_or_default()
            }
            Swap::Conflict(current) => return Ok(Swapped::Conflict(current)),
        };
        let drawn = if draw_token {
            Some(parse_token(&token)?)
        } else {
            None
        };
        // The bytes written hold no token, so they are those of the record
        // re-run with the drawn one too.
        let version = match write {
            Write::Put { bytes, .. } => Some(Held { bytes, token }),
            Write::Delete => None,
        };
        Ok(Swapped::Done {
            token: drawn,
            version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Record;

    #[test]
    fn a_retried_write_that_landed_is_recognised_as_ours() {
        let record = |bytes: &[u8], token: &str| Stored {
            version: Held {
                bytes: bytes.to_vec(),
                token: token.to_owned(),
            },
            record: Record::committed_for_tests(Vec::new()),
        };
        let put = |token: Option<u64>| Write::Put {
            bytes: b"committed".to_vec(),
            token: token.map(FencingToken),
            retain_until: UnixMillis(1),
        };
        // A Commit (token kept) found written after a retry: ours, COMMITTED.
        let found = record(b"committed", "7");
        assert!(is_our_write(&put(Some(7)), Some(&found), false, true));
        // Without a retry the same bytes may be another sidecar's write.
        assert!(!is_our_write(&put(Some(7)), Some(&found), false, false));
        assert!(!is_our_write(&put(Some(8)), Some(&found), false, true));
        // A claim's bytes hold its random lease token: equal bytes are ours.
        assert!(is_our_write(&put(None), Some(&found), true, false));
        assert!(!is_our_write(
            &put(None),
            Some(&record(b"other", "7")),
            true,
            true
        ));
        // A Forget that finds nothing after a retry deleted it itself.
        assert!(is_our_write(&Write::Delete, None, false, true));
        assert!(!is_our_write(&Write::Delete, None, false, false));
        assert!(!is_our_write(&Write::Delete, Some(&found), false, true));
    }
}
