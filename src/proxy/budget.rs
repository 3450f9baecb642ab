//! The proxy's memory budgets: the bytes of keyed request bodies it holds
//! (buffered to be fingerprinted, then forwarded whole) and of answers it
//! gathers to store, each bounded over every connection, and request
//! bodies also per caller — so that a few clients sending large bodies
//! slowly can neither exhaust the pod's memory nor starve other callers
//! (issue 40: eight slow 8 MiB bodies used to spend the whole shared
//! budget, and answers gathered meanwhile were stored "not replayable").

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of keyed request bodies the proxy holds at once, over every
/// connection (raised to one `--max-request-bytes`), and, separately, bytes
/// of answers it gathers to store: past either, a keyed request is
/// answered 503 rather than buffered (an answer streams on, not stored).
pub const KEYED_BODY_BUDGET_BYTES: usize = 64 << 20;

/// How long a gathered answer waits for budget before it streams on
/// unstored: a moment's peak should not make an answer unreplayable.
const ANSWER_BUDGET_WAIT: Duration = Duration::from_secs(1);

/// The budgets of one proxy.
#[derive(Debug)]
pub(super) struct Budgets {
    requests: Arc<Semaphore>,
    answers: Arc<Semaphore>,
    /// Request-body bytes each identified caller holds; `None`: callers
    /// are not told apart (`--scope none`), and only the total bounds them.
    callers: Option<Arc<CallerShares>>,
}

impl Budgets {
    /// Budgets for bodies of at most `max_request_bytes`; per caller when
    /// `per_caller`.
    pub(super) fn new(max_request_bytes: usize, per_caller: bool) -> Budgets {
        let requests = KEYED_BODY_BUDGET_BYTES.max(max_request_bytes);
        Budgets {
            requests: Arc::new(Semaphore::new(requests)),
            answers: Arc::new(Semaphore::new(KEYED_BODY_BUDGET_BYTES)),
            // A quarter of the total, and at least one whole body: four
            // callers must fill it together.
            callers: per_caller.then(|| {
                Arc::new(CallerShares {
                    held: Mutex::new(HashMap::new()),
                    cap: (requests / 4).max(max_request_bytes),
                })
            }),
        }
    }

    /// An empty share of the request budget for `caller` (its identity
    /// hash), grown as the body arrives; `None` once the proxy closed.
    pub(super) fn request_share(&self, caller: Option<[u8; 32]>) -> Option<RequestShare> {
        let total = Arc::clone(&self.requests).try_acquire_many_owned(0).ok()?;
        let caller = match (&self.callers, caller) {
            (Some(shares), Some(caller)) => Some(CallerShare {
                shares: Arc::clone(shares),
                caller,
                bytes: 0,
            }),
            _ => None,
        };
        Some(RequestShare {
            requests: Arc::clone(&self.requests),
            total,
            caller,
        })
    }

    /// An empty share of the answer budget; `None` once the proxy closed.
    pub(super) fn answer_share(&self) -> Option<AnswerShare> {
        let held = Arc::clone(&self.answers).try_acquire_many_owned(0).ok()?;
        Some(AnswerShare {
            answers: Arc::clone(&self.answers),
            held,
        })
    }
}

/// Why a request body could not grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Spent {
    /// Every caller's bodies together fill the budget.
    Total,
    /// This caller's bodies fill its share.
    Caller,
}

/// The bytes of one keyed request body, held until it has been forwarded
/// (dropped: given back).
#[derive(Debug)]
pub(super) struct RequestShare {
    requests: Arc<Semaphore>,
    total: OwnedSemaphorePermit,
    caller: Option<CallerShare>,
}

impl RequestShare {
    /// Takes `bytes` more, from the caller's share and the total.
    pub(super) fn grow(&mut self, bytes: usize) -> Result<(), Spent> {
        let permits = u32::try_from(bytes).map_err(|_| Spent::Total)?;
        if let Some(caller) = &mut self.caller {
            caller.grow(bytes)?;
        }
        match Arc::clone(&self.requests).try_acquire_many_owned(permits) {
            Ok(more) => {
                self.total.merge(more);
                Ok(())
            }
            Err(_) => {
                if let Some(caller) = &mut self.caller {
                    caller.shrink(bytes);
                }
                Err(Spent::Total)
            }
        }
    }
}

/// The bytes of one answer gathered to be stored.
#[derive(Debug)]
pub(super) struct AnswerShare {
    answers: Arc<Semaphore>,
    held: OwnedSemaphorePermit,
}

impl AnswerShare {
    /// Takes `bytes` more, waiting a moment for them (and no later than
    /// `deadline`); `false`: the budget stayed spent.
    pub(super) async fn grow(&mut self, bytes: usize, deadline: tokio::time::Instant) -> bool {
        let Ok(permits) = u32::try_from(bytes) else {
            return false;
        };
        let wait = (tokio::time::Instant::now() + ANSWER_BUDGET_WAIT).min(deadline);
        let more = Arc::clone(&self.answers).acquire_many_owned(permits);
        match tokio::time::timeout_at(wait, more).await {
            Ok(Ok(more)) => {
                self.held.merge(more);
                true
            }
            _ => false,
        }
    }
}

/// Request-body bytes held per caller.
#[derive(Debug)]
struct CallerShares {
    held: Mutex<HashMap<[u8; 32], usize>>,
    /// The most one caller may hold.
    cap: usize,
}

/// One request's part of its caller's bytes.
#[derive(Debug)]
struct CallerShare {
    shares: Arc<CallerShares>,
    caller: [u8; 32],
    bytes: usize,
}

impl CallerShare {
    fn grow(&mut self, bytes: usize) -> Result<(), Spent> {
        let mut held = self.shares.held.lock().expect("caller shares");
        let now = held.get(&self.caller).copied().unwrap_or(0);
        if now + bytes > self.shares.cap {
            return Err(Spent::Caller);
        }
        held.insert(self.caller, now + bytes);
        self.bytes += bytes;
        Ok(())
    }

    fn shrink(&mut self, bytes: usize) {
        let mut held = self.shares.held.lock().expect("caller shares");
        if let Some(caller) = held.get_mut(&self.caller) {
            *caller -= bytes;
            if *caller == 0 {
                held.remove(&self.caller);
            }
        }
        self.bytes -= bytes;
    }
}

impl Drop for CallerShare {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.shrink(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_caller_holds_at_most_its_share_and_gives_it_back() {
        let budgets = Budgets::new(8 << 20, true);
        let (alice, bob) = ([1; 32], [2; 32]);
        let mut first = budgets.request_share(Some(alice)).unwrap();
        first.grow(8 << 20).unwrap();
        let mut second = budgets.request_share(Some(alice)).unwrap();
        second.grow(8 << 20).unwrap();
        let mut third = budgets.request_share(Some(alice)).unwrap();
        assert_eq!(third.grow(1), Err(Spent::Caller), "16 MiB is alice's share");
        let mut other = budgets.request_share(Some(bob)).unwrap();
        other.grow(8 << 20).unwrap();
        drop(first);
        third.grow(8 << 20).unwrap();
        drop((second, third, other));
        assert!(budgets
            .callers
            .as_ref()
            .unwrap()
            .held
            .lock()
            .unwrap()
            .is_empty());
        assert_eq!(
            budgets.requests.available_permits(),
            KEYED_BODY_BUDGET_BYTES
        );
    }

    #[tokio::test]
    async fn the_total_bounds_every_caller_together_and_unidentified_ones() {
        let budgets = Budgets::new(8 << 20, false);
        let mut shares = Vec::new();
        for _ in 0..8 {
            let mut share = budgets.request_share(None).unwrap();
            share.grow(8 << 20).unwrap();
            shares.push(share);
        }
        let mut one_more = budgets.request_share(None).unwrap();
        assert_eq!(one_more.grow(1), Err(Spent::Total));
        // Answers have their own budget.
        let mut answer = budgets.answer_share().unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        assert!(futures_util::FutureExt::now_or_never(answer.grow(1 << 20, deadline)).unwrap());
    }
}
