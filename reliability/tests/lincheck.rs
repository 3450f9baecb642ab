//! The checker catches planted violations and passes what the protocol
//! allows; then a real run: 16 clients on 4 keys against the `dedupd`
//! binary on sled, SIGKILLed mid-run, checked to be linearizable.

use std::{path::PathBuf, time::Duration};

use dedupd_reliability::{
    checker::{check, check_within},
    history::{Answer, Call, Operation, Released, State},
    runner::{generations, run, CallError, Run, RunConfig},
};

fn op(client: usize, call: Call, invoked_ms: u64, completed_ms: u64, answer: Answer) -> Operation {
    Operation {
        client,
        key: 0,
        call,
        invoked_ms,
        completed_ms,
        answer,
    }
}

fn claimed(
    token: u128,
    fencing: u64,
    attempt: u32,
    recovered: bool,
    lease_expires_ms: u64,
) -> Answer {
    Answer::Claimed {
        token,
        fencing,
        attempt,
        recovered,
        lease_expires_ms,
    }
}

/// `client`'s Commit with `token`, acknowledged as a first commit.
fn committed(client: usize, token: u128, invoked_ms: u64, completed_ms: u64) -> Operation {
    op(
        client,
        Call::Commit { token },
        invoked_ms,
        completed_ms,
        Answer::Committed { already: false },
    )
}

const LEASE: Call = Call::Claim { lease_ms: 100 };

fn linearizable(history: &[Operation]) -> bool {
    check(history).violations.is_empty()
}

#[test]
fn a_sequential_life_is_linearizable() {
    let history = [
        op(0, Call::Lookup, 0, 1, Answer::Absent),
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 20, 21, Answer::InProgress { retry_after_ms: 91 }),
        op(
            0,
            Call::Renew {
                token: 7,
                lease_ms: 100,
            },
            30,
            31,
            Answer::Renewed {
                lease_expires_ms: 130,
            },
        ),
        committed(0, 7, 40, 42),
        op(
            0,
            Call::Commit { token: 7 },
            43,
            44,
            Answer::Committed { already: true },
        ),
        op(
            1,
            LEASE,
            50,
            51,
            Answer::Duplicate {
                fencing: 1,
                attempt: 1,
            },
        ),
        op(1, Call::Release { token: 7 }, 52, 53, Answer::LeaseLost),
        op(
            1,
            Call::Lookup,
            60,
            61,
            Answer::Found {
                state: State::Committed,
                fencing: 1,
                attempt: 1,
            },
        ),
    ];
    assert!(linearizable(&history));
}

#[test]
fn two_holders_at_once_are_caught() {
    // Both claims granted within the first one's lease, nothing released.
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 20, 22, claimed(8, 2, 2, true, 121)),
    ];
    assert!(!linearizable(&history));
    // After the lease ran out the takeover is fine (and says recovered).
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 120, 122, claimed(8, 2, 2, true, 221)),
    ];
    assert!(linearizable(&history));
}

/// On a shared store a sidecar's time is an interval up to the tolerance
/// wide: a takeover whose `latest` is past the old lease while the call
/// ended before it (an engine deciding by the wrong end) is caught, and so
/// is time left counted past the lease from a `latest`; the right ends,
/// however far apart, pass.
#[test]
fn a_sidecar_deciding_by_the_wrong_end_of_its_interval_is_caught() {
    let tolerance = 21;
    let tolerant = |history: &[Operation]| {
        dedupd_reliability::checker::check_tolerating(history, tolerance)
            .violations
            .is_empty()
    };
    // The first lease ends at 111. A takeover decided at `latest` = 115
    // by a call that ended at 105: on the store's clock the lease still
    // ran — two holders (it would pass a tolerance applied to both sides).
    let wrong = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 100, 105, claimed(8, 2, 2, true, 215)),
    ];
    assert!(!tolerant(&wrong));
    // The same takeover by a call that ended after 111, `latest` up to
    // the tolerance later: fine.
    let right = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 108, 112, claimed(8, 2, 2, true, 230)),
    ];
    assert!(tolerant(&right));
    // IN_PROGRESS with time left counted from `earliest` (here 36, up to
    // the tolerance before the call): fine; counted from a `latest` after
    // the call (71), it puts the lease's end before 111: caught.
    let earliest = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 50, 52, Answer::InProgress { retry_after_ms: 75 }),
    ];
    assert!(tolerant(&earliest));
    let latest = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(1, LEASE, 50, 52, Answer::InProgress { retry_after_ms: 40 }),
    ];
    assert!(!tolerant(&latest));
}

#[test]
fn a_lost_commit_is_caught() {
    // Committed (acknowledged), then the key is claimable again: the
    // commit did not survive (a restart lost it).
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        committed(0, 7, 20, 21),
        op(1, LEASE, 500, 510, claimed(9, 2, 2, true, 600)),
    ];
    assert!(!linearizable(&history));
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        committed(0, 7, 20, 21),
        op(
            1,
            Call::Lookup,
            500,
            510,
            Answer::Found {
                state: State::Claimed,
                fencing: 1,
                attempt: 1,
            },
        ),
    ];
    assert!(!linearizable(&history), "a stale read of the commit");
}

#[test]
fn fencing_tokens_going_back_are_caught() {
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 5, 1, false, 111)),
        op(
            0,
            Call::Release { token: 7 },
            20,
            21,
            Answer::Release(Released::Released),
        ),
        op(1, LEASE, 30, 31, claimed(8, 4, 2, false, 130)),
    ];
    assert!(!linearizable(&history));
}

#[test]
fn overlapping_calls_may_take_effect_in_either_order() {
    // The lookup overlaps the claim: it may have happened before it.
    let history = [
        op(0, LEASE, 10, 20, claimed(7, 1, 1, false, 115)),
        op(1, Call::Lookup, 12, 18, Answer::Absent),
        op(
            2,
            Call::Lookup,
            13,
            19,
            Answer::Found {
                state: State::Claimed,
                fencing: 1,
                attempt: 1,
            },
        ),
    ];
    assert!(linearizable(&history));
    // Not once the claim had answered.
    let history = [
        op(0, LEASE, 10, 20, claimed(7, 1, 1, false, 115)),
        op(1, Call::Lookup, 21, 22, Answer::Absent),
    ];
    assert!(!linearizable(&history));
}

#[test]
fn an_unanswered_claim_may_have_taken_effect() {
    // The sidecar died before answering; a later claimer finds the key
    // held (by nobody who knows the token) until that lease runs out.
    let history = [
        op(0, LEASE, 10, 30, Answer::Unknown),
        op(1, LEASE, 40, 41, Answer::InProgress { retry_after_ms: 75 }),
        op(1, LEASE, 200, 201, claimed(9, 2, 2, true, 300)),
    ];
    assert!(linearizable(&history));
    // ... or not: then nothing holds it.
    let history = [
        op(0, LEASE, 10, 30, Answer::Unknown),
        op(1, LEASE, 40, 41, claimed(9, 1, 1, false, 140)),
    ];
    assert!(linearizable(&history));
    // But an in-progress lease longer than the lost claim could have made
    // is not explained by it.
    let history = [
        op(0, LEASE, 10, 30, Answer::Unknown),
        op(1, LEASE, 40, 41, Answer::InProgress { retry_after_ms: 95 }),
    ];
    assert!(!linearizable(&history));
}

#[test]
fn a_search_out_of_budget_is_undecided_never_passed() {
    // Ten overlapping lookups that saw a record nothing ever created.
    let mut history: Vec<Operation> = (0..10)
        .map(|client| op(client, Call::Lookup, 0, 100, Answer::Absent))
        .collect();
    history.push(op(
        10,
        Call::Lookup,
        0,
        100,
        Answer::Found {
            state: State::Committed,
            fencing: 1,
            attempt: 1,
        },
    ));
    let exhaustive = check_within(&history, usize::MAX);
    assert_eq!(exhaustive.violations.len(), 1);
    assert!(!exhaustive.violations[0].undecided);
    let bounded = check_within(&history, 5);
    assert_eq!(bounded.violations.len(), 1, "out of budget is not a pass");
    assert!(bounded.violations[0].undecided);
}

/// Found by a real run (a false alarm, fixed): a renewal that happens to
/// leave the lease where it is at some point of the search is still a
/// write, and must not be moved ahead of the renewal before it.
#[test]
fn a_renewal_back_to_an_earlier_end_keeps_its_place() {
    let history = [
        op(
            14,
            Call::Claim { lease_ms: 222 },
            759,
            760,
            claimed(7, 1, 1, false, 981),
        ),
        op(
            15,
            Call::Claim { lease_ms: 339 },
            760,
            761,
            Answer::InProgress {
                retry_after_ms: 221,
            },
        ),
        op(
            14,
            Call::Renew {
                token: 7,
                lease_ms: 259,
            },
            760,
            761,
            Answer::Renewed {
                lease_expires_ms: 1019,
            },
        ),
        op(
            15,
            Call::Claim { lease_ms: 172 },
            760,
            762,
            Answer::InProgress {
                retry_after_ms: 259,
            },
        ),
        op(
            11,
            Call::Lookup,
            760,
            762,
            Answer::Found {
                state: State::Claimed,
                fencing: 1,
                attempt: 1,
            },
        ),
        op(
            2,
            Call::Claim { lease_ms: 123 },
            761,
            762,
            Answer::InProgress {
                retry_after_ms: 258,
            },
        ),
        op(
            14,
            Call::Renew {
                token: 7,
                lease_ms: 220,
            },
            761,
            762,
            Answer::Renewed {
                lease_expires_ms: 981,
            },
        ),
        op(
            2,
            Call::Claim { lease_ms: 268 },
            761,
            763,
            Answer::InProgress {
                retry_after_ms: 220,
            },
        ),
        op(
            10,
            Call::Claim { lease_ms: 212 },
            762,
            763,
            Answer::InProgress {
                retry_after_ms: 219,
            },
        ),
        op(
            14,
            Call::Release { token: 7 },
            762,
            763,
            Answer::Release(Released::Released),
        ),
    ];
    assert!(linearizable(&history));
}

#[test]
fn a_renewal_must_come_from_the_holder() {
    let history = [
        op(0, LEASE, 10, 12, claimed(7, 1, 1, false, 111)),
        op(
            1,
            Call::Renew {
                token: 8,
                lease_ms: 100,
            },
            20,
            21,
            Answer::Renewed {
                lease_expires_ms: 120,
            },
        ),
    ];
    assert!(!linearizable(&history));
}

/// A failed call fails a run unless it overlaps a kill window (any code)
/// or a failover window (UNAVAILABLE or DEADLINE_EXCEEDED only);
/// COMMITTED and CLAIMED answers must reach their floors.
#[test]
fn errors_count_outside_the_windows_and_thin_runs_fail() {
    let error_with = |code, invoked_ms, completed_ms| CallError {
        client: 3,
        key: 12,
        call: Call::Commit { token: 7 },
        invoked_ms,
        completed_ms,
        code,
        message: "boom".into(),
    };
    let error =
        |invoked_ms, completed_ms| error_with(tonic::Code::Internal, invoked_ms, completed_ms);
    let unavailable =
        |invoked_ms, completed_ms| error_with(tonic::Code::Unavailable, invoked_ms, completed_ms);
    let mut run = Run {
        history: Vec::new(),
        elapsed: Duration::from_secs(8),
        kills: 1,
        downtime: Duration::from_millis(100),
        kill_windows: vec![(1_000, 2_100)],
        errors: vec![
            error(900, 1_000),   // ends as the window opens
            error(1_500, 1_600), // inside
            error(2_100, 2_200), // starts as it closes
            error(500, 999),     // before
            error(2_101, 2_300), // after
            unavailable(1_500, 1_600),
            unavailable(2_500, 2_600),
        ],
        failovers: Vec::new(),
    };
    let outside = run.errors_outside_windows();
    assert_eq!(
        outside,
        [
            &error(500, 999),
            &error(2_101, 2_300),
            &unavailable(2_500, 2_600)
        ]
    );
    let named = outside[0].to_string();
    for part in ["Commit", "key 12", "Internal", "boom"] {
        assert!(named.contains(part), "{named}");
    }
    // A failover from 3 000 ms, settled 4 000 ms later: UNAVAILABLE is
    // excused until FAILOVER_SETTLE after that, INTERNAL never.
    run.failovers.push(dedupd_reliability::failover::Failover {
        killed: "127.0.0.1:7001".into(),
        promoted: "127.0.0.1:7004".into(),
        promotion: Duration::from_millis(2_500),
        settled: Duration::from_millis(4_000),
        killed_at_ms: 3_000,
    });
    let settle = dedupd_reliability::runner::FAILOVER_SETTLE.as_millis() as u64;
    let closes = 7_001 + settle;
    run.errors = vec![
        unavailable(3_100, 3_200),
        unavailable(closes, closes + 100),
        unavailable(closes + 1, closes + 100),
        error(3_100, 3_200),
    ];
    assert_eq!(
        run.errors_outside_windows(),
        [&unavailable(closes + 1, closes + 100), &error(3_100, 3_200)]
    );
    // Commits count after the last failover's window only.
    let commit = Answer::Committed { already: false };
    run.history.push(op(
        0,
        Call::Commit { token: 1 },
        closes,
        closes + 5,
        commit.clone(),
    ));
    assert_eq!(run.committed_after_failovers(), 0);
    run.history.push(op(
        0,
        Call::Commit { token: 1 },
        closes + 1,
        closes + 5,
        commit,
    ));
    assert_eq!(run.committed_after_failovers(), 1);
    run.history.clear();
    run.failovers.clear();
    run.errors.clear();

    let generations = generations(Duration::from_secs(8), Duration::from_millis(30));
    assert_eq!(generations, 267);
    assert!(run.below_floor(generations).is_some());
    for i in 0..267 {
        let claim = claimed(i, 1, 1, false, 111);
        run.history.push(op(0, LEASE, 10, 11, claim));
    }
    let thin = run.below_floor(generations).expect("no commits");
    assert!(thin.contains("0 COMMITTED (at least 14)"), "{thin}");
    for _ in 0..14 {
        let commit = Answer::Committed { already: false };
        run.history
            .push(op(0, Call::Commit { token: 1 }, 10, 11, commit));
    }
    assert_eq!(run.below_floor(generations), None);
}

fn binary() -> PathBuf {
    std::env::var_os("DEDUPD_BIN").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/debug/dedupd"
            ))
        },
        PathBuf::from,
    )
}

/// The figures issue 16 asks of a history: at least 16 clients, at least
/// 10 000 operations, leases that run out, a SIGKILL in the middle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_history_on_sled_with_a_kill_is_linearizable() {
    let dir = tempfile::tempdir().unwrap();
    let run = run(RunConfig {
        binary: binary(),
        // --sync always (the default): every acknowledged change is on disk
        // before the answer, so a SIGKILL may not lose one.
        store_flags: vec![],
        data_dir: dir.path().to_owned(),
        clients: 16,
        keys: 4,
        generation: Duration::from_millis(500),
        duration: Duration::from_secs(8),
        min_operations: 10_000,
        kills: 1,
        lease_ms: (50, 400),
        seed: rand::random(),
        clock_skews: Vec::new(),
        libfaketime: None,
        store_failovers: None,
        store_delays: Vec::new(),
    })
    .await
    .expect("the run");
    let report = check(&run.history);
    eprintln!(
        "{} operations ({} answered), {} kill(s), {} states explored: {:?}",
        report.operations,
        report.answered,
        run.kills,
        report.states_explored,
        dedupd_reliability::history::answer_counts(&run.history)
    );
    assert_eq!(run.kills, 1);
    assert!(report.operations >= 10_000, "{report:?}");
    let claims = run
        .history
        .iter()
        .filter(|op| {
            matches!(
                op.answer,
                Answer::Claimed {
                    recovered: true,
                    ..
                }
            )
        })
        .count();
    assert!(claims >= 10, "leases ran out and were taken over: {claims}");
    let errors = run.errors_outside_windows();
    assert!(
        errors.is_empty(),
        "failed calls away from the SIGKILL: {}",
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    let generations = generations(run.elapsed, Duration::from_millis(500));
    assert_eq!(run.below_floor(generations), None);
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}
