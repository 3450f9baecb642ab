//! The linearizability checker: is there an order of the operations, each
//! placed at some moment between its call and its answer, in which the
//! state machine of protocol §2 gives every answer observed?
//!
//! Keys are independent (every call touches one key), and linearizability
//! is local, so each key's history is checked alone (P-compositionality).
//! The search is Wing & Gong's, with Lowe's memoization of (operations
//! linearized, model state) as in Porcupine. Time is part of the model: a
//! lease's end is known as an interval when it came from a call whose
//! answer was lost, and comparisons against it branch.
//!
//! The sidecars' clock may differ from the recording clock: on a shared store
//! a sidecar decides by the store's clock as it measured it, an interval
//! [earliest, latest] at most the tolerance wide (twice its
//! `--max-clock-uncertainty`, plus 1 ms; docs/protocol.md, "Time"). Ends it
//! sets come from `latest`, within the call or up to the tolerance after
//! it; time left it counts from `earliest`, within the call or up to the
//! tolerance before it; and a takeover needs the old lease over, on the
//! store's (the recording) clock, by the end of the call (see [`step`]).
//! Calls whose answer was lost keep the window widened on both sides. The
//! sidecars' own readings (a lease's end, the moment a claim was decided)
//! are compared with each other as they are.
//!
//! The engine reads the clock before its atomic read-modify-write, so two
//! concurrent calls may take effect in the other order than their clock
//! readings; the model therefore checks each operation's moment against its
//! own call interval only, not against the moments of operations placed
//! before it.

use std::{
    collections::{hash_map::DefaultHasher, BTreeMap, HashSet},
    hash::{Hash, Hasher},
};

use crate::history::{Answer, Call, Operation, Released, State, Token};

/// A lease token in the model: one a client holds, or one made by a Claim
/// whose answer was lost (nobody can use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Holder {
    Known(Token),
    Lost,
}

/// One key's record in the model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Rec {
    state: State,
    holder: Holder,
    /// The fencing token, unless it came from a lost answer; then the last
    /// one known, which it exceeds.
    fencing: Fencing,
    attempt: u32,
    /// The lease's end lies in [lo, hi].
    lease_lo: u64,
    lease_hi: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Fencing {
    Exactly(u64),
    Above(u64),
}

impl Fencing {
    fn admits(self, observed: u64) -> bool {
        match self {
            Fencing::Exactly(value) => value == observed,
            Fencing::Above(floor) => observed > floor,
        }
    }

    fn floor(self) -> u64 {
        match self {
            Fencing::Exactly(value) | Fencing::Above(value) => value,
        }
    }
}

type Model = Option<Rec>;

/// A violation: a key whose history no order explains (or that the search
/// could not decide within its budget — reported, never passed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The key.
    pub key: u32,
    /// True when the search ran out of budget before deciding.
    pub undecided: bool,
    /// How many of its operations the longest explained prefix placed.
    pub longest_linearized: usize,
    /// Its operations, for the report.
    pub operations: usize,
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    /// Operations checked.
    pub operations: usize,
    /// Of which answered (the rest had no answer).
    pub answered: usize,
    /// Keys checked.
    pub keys: usize,
    /// States the search visited.
    pub states_explored: usize,
    /// Keys whose history is not linearizable.
    pub violations: Vec<Violation>,
}

/// States one key's search may visit before it gives up (undecided). A
/// linearizable history is usually found in about one state per operation;
/// the budget only bounds the hopeless search of a broken one.
pub const STATES_PER_KEY: usize = 1_000_000;

/// Checks a whole history, key by key, the sidecars' clock being the
/// recording clock (one sidecar on sled).
pub fn check(history: &[Operation]) -> Report {
    check_within(history, STATES_PER_KEY)
}

/// [`check`] with another budget of states per key.
pub fn check_within(history: &[Operation], states_per_key: usize) -> Report {
    check_with(history, states_per_key, 0)
}

/// [`check`] for sidecars whose clocks may be up to `clock_tolerance_ms` off
/// the recording clock (the shared stores: `--max-clock-uncertainty`).
pub fn check_tolerating(history: &[Operation], clock_tolerance_ms: u64) -> Report {
    check_with(history, STATES_PER_KEY, clock_tolerance_ms)
}

fn check_with(history: &[Operation], states_per_key: usize, clock_tolerance_ms: u64) -> Report {
    let mut by_key: BTreeMap<u32, Vec<&Operation>> = BTreeMap::new();
    for operation in history {
        by_key.entry(operation.key).or_default().push(operation);
    }
    let mut report = Report {
        operations: history.len(),
        answered: history
            .iter()
            .filter(|op| op.answer != Answer::Unknown)
            .count(),
        keys: by_key.len(),
        ..Report::default()
    };
    for (key, mut operations) in by_key {
        operations.sort_by_key(|op| (op.invoked_ms, op.completed_ms));
        let (outcome, explored) = check_key(&operations, states_per_key, clock_tolerance_ms);
        report.states_explored += explored;
        if let Err((longest, undecided)) = outcome {
            report.violations.push(Violation {
                key,
                undecided,
                longest_linearized: longest,
                operations: operations.len(),
            });
        }
    }
    report
}

/// One key: Ok, or Err((the most operations any order placed, whether the
/// budget ran out)); and the states visited.
fn check_key(
    operations: &[&Operation],
    budget: usize,
    clock_tolerance_ms: u64,
) -> (Result<(), (usize, bool)>, usize) {
    let count = operations.len();
    let words = count.div_ceil(64);
    // The placed set is remembered by a 128-bit hash: memory stays small,
    // and a collision could only prune a path (a false alarm, never a
    // false pass).
    let mut seen: HashSet<(u128, Model)> = HashSet::new();
    let fingerprint = |placed: &[u64]| {
        let mut hasher = DefaultHasher::new();
        placed.hash(&mut hasher);
        let low = hasher.finish();
        0x9e37_79b9_7f4a_7c15_u64.hash(&mut hasher);
        (u128::from(hasher.finish()) << 64) | u128::from(low)
    };
    // Depth-first search over (placed set, model); each frame remembers
    // which successors it has yet to try.
    struct Frame {
        placed: Vec<u64>,
        successors: Vec<(usize, Model)>,
    }
    let is_placed = |placed: &[u64], index: usize| placed[index / 64] & (1 << (index % 64)) != 0;
    let first_unplaced = |placed: &[u64]| {
        placed
            .iter()
            .enumerate()
            .find(|(_, word)| **word != u64::MAX)
            .map_or(count, |(w, word)| w * 64 + word.trailing_ones() as usize)
    };
    let successors = |placed: &[u64], model: &Model| -> Vec<(usize, Model)> {
        let first = first_unplaced(placed);
        // An operation may go next only if it was called before every
        // operation still to place had answered (or, unanswered, stopped
        // being able to take effect: placing it as "did not happen" is
        // always possible). Sorted by call time, the scan stops at the
        // first one called after the earliest answer seen so far.
        let mut earliest = u64::MAX;
        for (index, operation) in operations.iter().enumerate().skip(first) {
            if operation.invoked_ms > earliest {
                break;
            }
            if !is_placed(placed, index) {
                earliest = earliest.min(operation.completed_ms);
            }
        }
        let mut next = Vec::new();
        for (index, operation) in operations.iter().enumerate().skip(first) {
            if operation.invoked_ms > earliest {
                break;
            }
            if is_placed(placed, index) {
                continue;
            }
            let models = step(model, operation, clock_tolerance_ms);
            // A read (a lookup, a refusal, a duplicate) that leaves the
            // model exactly as it is can go now without loss: any order
            // placing it later works with it moved here. No branching.
            // (Not a write that happens to leave the same model here — a
            // renewal to the same end, say: later it may not.)
            if reads_only(operation) && models.len() == 1 && models[0] == *model {
                return models.into_iter().map(|model| (index, model)).collect();
            }
            for model in models {
                next.push((index, model));
            }
        }
        // Tried last-first: put the earliest-answered operation last, so
        // the search follows real time first.
        next.sort_by_key(|(index, _)| std::cmp::Reverse(operations[*index].completed_ms));
        next
    };
    let done = |placed: &[u64]| {
        (0..count).all(|i| is_placed(placed, i) || operations[i].answer == Answer::Unknown)
    };
    let placed_count = |placed: &[u64]| {
        placed
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum::<usize>()
    };

    let start = vec![0u64; words];
    if done(&start) {
        return (Ok(()), 0);
    }
    let first = successors(&start, &None);
    let mut stack = vec![Frame {
        placed: start,
        successors: first,
    }];
    let mut longest = 0;
    while let Some(frame) = stack.last_mut() {
        let Some((index, model)) = frame.successors.pop() else {
            stack.pop();
            continue;
        };
        let mut placed = frame.placed.clone();
        placed[index / 64] |= 1 << (index % 64);
        if done(&placed) {
            return (Ok(()), seen.len());
        }
        if !seen.insert((fingerprint(&placed), model.clone())) {
            continue;
        }
        if seen.len() > budget {
            return (Err((longest, true)), seen.len());
        }
        longest = longest.max(placed_count(&placed));
        let next = successors(&placed, &model);
        stack.push(Frame {
            placed,
            successors: next,
        });
    }
    (Err((longest, false)), seen.len())
}

/// Whether an operation cannot change the record, whatever the model.
fn reads_only(operation: &Operation) -> bool {
    matches!(operation.call, Call::Lookup)
        || matches!(
            operation.answer,
            Answer::Duplicate { .. }
                | Answer::InProgress { .. }
                | Answer::LeaseLost
                | Answer::Committed { already: true }
                | Answer::Release(Released::NotFound | Released::AlreadyReleased)
        )
}

/// The models an operation can leave behind, from `model`, given what it
/// answered; empty when the answer is impossible here.
fn step(model: &Model, operation: &Operation, clock_tolerance_ms: u64) -> Vec<Model> {
    let (invoked, completed) = (operation.invoked_ms, operation.completed_ms);
    // On a shared store a sidecar's time is an interval around the store's
    // (the recording clock here), at most `clock_tolerance_ms` wide: it
    // sets ends from its `latest` — not before the call, up to the
    // tolerance after it — and counts time left from its `earliest` — up
    // to the tolerance before the call, not after it (1 ms of rounding
    // either way). Each is checked on its own side, so an engine that took
    // the wrong end would show.
    let rounding = clock_tolerance_ms.min(1);
    let moments = Moments {
        latest: (
            invoked.saturating_sub(rounding),
            completed.saturating_add(clock_tolerance_ms),
        ),
        earliest: (
            invoked.saturating_sub(clock_tolerance_ms),
            completed.saturating_add(rounding),
        ),
        by: completed.saturating_add(rounding),
    };
    match (&operation.call, &operation.answer) {
        (call, Answer::Unknown) => {
            // It happened (at some moment in [from, to]) or it did not.
            let (from, to) = (moments.earliest.0, moments.latest.1);
            let mut models = vec![model.clone()];
            models.extend(unanswered(model, call, from, to));
            models
        }
        (Call::Claim { lease_ms }, answer) => claim(model, *lease_ms, &moments, answer),
        (Call::Commit { token }, answer) => commit(model, *token, answer).into_iter().collect(),
        (Call::Release { token }, answer) => release(model, *token, answer).into_iter().collect(),
        (Call::Renew { token, lease_ms }, answer) => {
            let (from, to) = moments.latest;
            renew(model, *token, *lease_ms, from, to, answer)
                .into_iter()
                .collect()
        }
        (Call::Lookup, answer) => lookup(model, answer).into_iter().collect(),
    }
}

fn holds(rec: &Rec, token: Token) -> bool {
    rec.holder == Holder::Known(token)
}

/// Where an operation's moments may lie (see [`step`]).
struct Moments {
    /// Its `latest`, which new ends are set from.
    latest: (u64, u64),
    /// Its `earliest`, which time left is counted from.
    earliest: (u64, u64),
    /// By when, on the store's clock, it had happened.
    by: u64,
}

/// A Claim at some moment in the call.
fn claim(model: &Model, lease_ms: u64, moments: &Moments, answer: &Answer) -> Vec<Model> {
    match answer {
        Answer::Claimed {
            token,
            fencing,
            attempt,
            recovered,
            lease_expires_ms,
        } => {
            // The sidecar's `latest` said t = lease end - lease.
            let Some(t) = lease_expires_ms.checked_sub(lease_ms) else {
                return vec![];
            };
            if t < moments.latest.0 || t > moments.latest.1 {
                return vec![];
            }
            let (previous_attempt, floor, was_claimed) = match model {
                None => (0, 0, false),
                Some(rec) => match rec.state {
                    State::Committed => return vec![],
                    // Claimable only once the lease has run out, on the
                    // store's clock, by the time the call ended.
                    State::Claimed if rec.lease_lo > t || rec.lease_lo > moments.by => {
                        return vec![]
                    }
                    State::Claimed => (rec.attempt, rec.fencing.floor(), true),
                    State::Released => (rec.attempt, rec.fencing.floor(), false),
                },
            };
            // Fencing tokens only grow (an unknown one exceeds its floor,
            // and the new one exceeds it in turn).
            if *fencing <= floor || *attempt != previous_attempt + 1 || *recovered != was_claimed {
                return vec![];
            }
            vec![Some(Rec {
                state: State::Claimed,
                holder: Holder::Known(*token),
                fencing: Fencing::Exactly(*fencing),
                attempt: *attempt,
                lease_lo: *lease_expires_ms,
                lease_hi: *lease_expires_ms,
            })]
        }
        Answer::Duplicate { fencing, attempt } => match model {
            Some(rec)
                if rec.state == State::Committed
                    && rec.fencing.admits(*fencing)
                    && rec.attempt == *attempt =>
            {
                let mut rec = rec.clone();
                rec.fencing = Fencing::Exactly(*fencing);
                vec![Some(rec)]
            }
            _ => vec![],
        },
        Answer::InProgress { retry_after_ms } => match model {
            // Held at `earliest` = t, with lease end = t + retry_after:
            // narrow what is known of the lease's end.
            Some(rec) if rec.state == State::Claimed => {
                let (from, to) = moments.earliest;
                let lo = rec.lease_lo.max(from + retry_after_ms);
                let hi = rec.lease_hi.min(to + retry_after_ms);
                if lo > hi || *retry_after_ms == 0 {
                    return vec![];
                }
                let mut rec = rec.clone();
                rec.lease_lo = lo;
                rec.lease_hi = hi;
                vec![Some(rec)]
            }
            _ => vec![],
        },
        _ => vec![],
    }
}

fn commit(model: &Model, token: Token, answer: &Answer) -> Option<Model> {
    let held = model.as_ref().filter(|rec| holds(rec, token));
    match (answer, held) {
        (Answer::Committed { already: false }, Some(rec)) if rec.state == State::Claimed => {
            let mut rec = rec.clone();
            rec.state = State::Committed;
            Some(Some(rec))
        }
        (Answer::Committed { already: true }, Some(rec)) if rec.state == State::Committed => {
            Some(model.clone())
        }
        (Answer::LeaseLost, None) => Some(model.clone()),
        (Answer::LeaseLost, Some(rec)) if rec.state == State::Released => Some(model.clone()),
        _ => None,
    }
}

fn release(model: &Model, token: Token, answer: &Answer) -> Option<Model> {
    match (answer, model) {
        (Answer::Release(Released::NotFound), None) => Some(None),
        (Answer::Release(Released::Released), Some(rec))
            if rec.state == State::Claimed && holds(rec, token) =>
        {
            let mut rec = rec.clone();
            rec.state = State::Released;
            Some(Some(rec))
        }
        (Answer::Release(Released::AlreadyReleased), Some(rec))
            if rec.state == State::Released && holds(rec, token) =>
        {
            Some(model.clone())
        }
        (Answer::LeaseLost, Some(rec)) if !holds(rec, token) || rec.state == State::Committed => {
            Some(model.clone())
        }
        _ => None,
    }
}

fn renew(
    model: &Model,
    token: Token,
    lease_ms: u64,
    from: u64,
    to: u64,
    answer: &Answer,
) -> Option<Model> {
    let held = model
        .as_ref()
        .filter(|rec| holds(rec, token) && rec.state == State::Claimed);
    match (answer, held) {
        (Answer::Renewed { lease_expires_ms }, Some(rec)) => {
            let t = lease_expires_ms.checked_sub(lease_ms)?;
            if t < from || t > to {
                return None;
            }
            let mut rec = rec.clone();
            rec.lease_lo = *lease_expires_ms;
            rec.lease_hi = *lease_expires_ms;
            Some(Some(rec))
        }
        (Answer::LeaseLost, None) => Some(model.clone()),
        _ => None,
    }
}

fn lookup(model: &Model, answer: &Answer) -> Option<Model> {
    match (answer, model) {
        (Answer::Absent, None) => Some(None),
        (
            Answer::Found {
                state,
                fencing,
                attempt,
            },
            Some(rec),
        ) if rec.state == *state && rec.fencing.admits(*fencing) && rec.attempt == *attempt => {
            let mut rec = rec.clone();
            rec.fencing = Fencing::Exactly(*fencing);
            Some(Some(rec))
        }
        _ => None,
    }
}

/// The models a call whose answer was lost leaves if it took effect at a
/// moment in [from, to].
fn unanswered(model: &Model, call: &Call, from: u64, to: u64) -> Vec<Model> {
    match call {
        Call::Claim { lease_ms } => {
            // Granted if nothing held the key at t; then a lease nobody
            // holds, ending somewhere in [t + lease].
            let grant = |rec: Option<&Rec>, t_lo: u64, t_hi: u64| {
                Some(Rec {
                    state: State::Claimed,
                    holder: Holder::Lost,
                    fencing: Fencing::Above(rec.map_or(0, |rec| rec.fencing.floor())),
                    attempt: rec.map_or(0, |rec| rec.attempt) + 1,
                    lease_lo: t_lo + lease_ms,
                    lease_hi: t_hi + lease_ms,
                })
            };
            match model {
                None => vec![grant(None, from, to)],
                Some(rec) => match rec.state {
                    State::Committed => vec![],
                    State::Released => vec![grant(Some(rec), from, to)],
                    // Only once the lease ran out: t >= its end.
                    State::Claimed if rec.lease_lo <= to => {
                        vec![grant(Some(rec), from.max(rec.lease_lo), to)]
                    }
                    State::Claimed => vec![],
                },
            }
        }
        Call::Commit { token } => commit(model, *token, &Answer::Committed { already: false })
            .into_iter()
            .collect(),
        Call::Release { token } => release(model, *token, &Answer::Release(Released::Released))
            .into_iter()
            .collect(),
        Call::Renew { token, lease_ms } => match model {
            Some(rec) if holds(rec, *token) && rec.state == State::Claimed => {
                let mut rec = rec.clone();
                rec.lease_lo = from + lease_ms;
                rec.lease_hi = to + lease_ms;
                vec![Some(rec)]
            }
            _ => vec![],
        },
        Call::Lookup => vec![],
    }
}
