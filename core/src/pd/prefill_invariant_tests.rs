//! Every check of `PrefillSide::check_invariants` fires on a state broken by hand: each test
//! builds a legitimate state by driving the side, sees the check pass, breaks one thing through
//! the private fields (or the pool) and sees that very check report it (matched by its message).
//! The `Draining` phase has no check of its own.
//!
//! | check | message | test |
//! |---|---|---|
//! | transfers bounded | "{n} transfers over the bound" | `more_transfers_than_transfers_max` |
//! | filed under its id | "transfer {id:?} filed under another id" | `a_transfer_is_filed_under_another_id` |
//! | something to write | "transfer {id:?} has nothing to write: an empty hand-off" | `a_transfer_has_nothing_to_write` |
//! | heartbeats remembered bounded | "transfer {id:?} remembers too many heartbeats" | `too_many_heartbeats_are_remembered` |
//! | writes only under a lease | "transfer {id:?} has writes out without ever holding a lease" | `writes_are_out_without_a_lease` |
//! | Computing: no KV, no write | "transfer {id:?} writes before its KV exists" | `a_computing_transfer_has_sources` |
//! | Writing: issued within pages | "transfer {id:?} issued {n} writes for {m} pages" | `more_writes_are_issued_than_pages` |
//! | Writing: outstanding were issued | "transfer {id:?} has an outstanding write it never issued" | `an_outstanding_write_was_never_issued` |
//! | DoneSent: nothing outstanding | "transfer {id:?} sent Done with {n} writes unresolved" | `done_is_sent_with_writes_outstanding` |
//! | DoneSent: every write completed | "transfer {id:?} sent Done after {n} of {m} writes" | `done_is_sent_before_every_write_completed` |
//! | sources pinned while read | "transfer {id:?} reads unpinned pages" | `writes_read_without_a_source_pin` |
//! | each source pinned | "source page {page:?} of {id:?} unpinned while a write reads it" | `a_source_page_is_unpinned_under_a_write` |
//! | filed under its due time | "transfer {id:?} is filed as due at {t:?} but is due at {u:?}" | `a_transfer_is_filed_under_a_stale_due_time` |
//! | in the due index | "transfer {id:?} is missing from the due index" | `a_transfer_is_missing_from_the_due_index` |
//! | due index size | "{n} due times for {m} transfers" | `the_due_index_holds_an_extra_entry` |
//! | changed ones live | "transfer {id:?} is noted as changed but is not live" | `a_dead_transfer_is_noted_as_changed` |
//! | source pins counted | "{n} source pins counted, {m} transfers hold one" | `the_source_pins_are_miscounted` |
//!
//! `PrefillSide::check_invariants_incremental` runs the checks of one transfer above on each
//! transfer changed since it last ran, and the counts:
//!
//! | check (incremental) | message | test |
//! |---|---|---|
//! | changed ones live | "transfer {id:?} is noted as changed but is not live" | `incremental_a_dead_transfer_is_noted_as_changed` |
//! | each changed transfer's own checks | as above | `the_incremental_check_checks_changed_transfers` |
//! | each changed transfer filed | "transfer {id:?} is filed as due at …", "… missing from the due index" | `the_incremental_check_checks_changed_transfers` |
//! | transfers bounded | "{n} transfers over the bound" | `incremental_more_transfers_than_transfers_max` |
//! | due index size | "{n} due times for {m} transfers" | `incremental_the_due_index_holds_an_extra_entry` |
//! | earliest entry right | "the earliest due entry ({t:?}, {id:?}) names a transfer due at {u:?}" | `incremental_the_earliest_due_entry_is_wrong` |

use super::*;
use crate::kv::PoolConfig;
use crate::sched::RequestId;
use crate::wire::{Epoch, Incarnation, WorkerId};

const P: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const D: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const ID: TransferId = TransferId(1);
const KEY: TransferKey = TransferKey { transfer: ID, epoch: Epoch(0) };

#[derive(Clone, Copy, PartialEq, PartialOrd)]
enum Stage {
    /// `Prepare` taken (a 10-token prompt, 3 pages to write); the KV is being computed.
    Computing,
    /// Computed and granted a lease: all 3 writes issued, none completed.
    Writing,
    /// Every write completed: `Done` sent.
    DoneSent,
}

fn prepare(id: u64) -> Message {
    Message::Prepare {
        key: TransferKey { transfer: TransferId(id), epoch: Epoch(0) },
        request: RequestSpec::new(RequestId(id), (0..10).collect(), 4),
        cached_tokens: 0,
        page_tokens: 4,
        pages: (0..3).map(|i| PageSlot { index: 10 + i, generation: 0 }).collect(),
        lease_ms: 100,
    }
}

fn deliver(side: &mut PrefillSide, pool: &mut PagePool, body: Message) {
    side.handle_envelope(Envelope { from: D, to: P, body }, pool, Time::ZERO);
}

/// Transfer 1 at `stage`, on a pool holding its 3 source pages (and room for one more transfer).
fn legit(stage: Stage) -> (PrefillSide, PagePool) {
    let config = PrefillConfig {
        heartbeat_interval: Duration::from_millis(30),
        write_flight_max: Duration::from_millis(20),
        transfer_deadline: Duration::from_millis(1_000),
        done_retransmit: Duration::from_millis(50),
        transfers_max: 2,
    };
    let mut side = PrefillSide::new(P, config);
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 8, page_tokens: 4, pins_max: 4 }).unwrap();
    let sources: Vec<PageRef> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    deliver(&mut side, &mut pool, prepare(1));
    if stage >= Stage::Writing {
        side.handle_computed(KEY, Sampled::token(9), &sources, &mut pool, Time::ZERO);
        deliver(&mut side, &mut pool, Message::LeaseGrant { key: KEY, seq: 0, lease_ms: 100 });
    }
    if stage >= Stage::DoneSent {
        for ordinal in 0..3 {
            side.handle_write_completion(KEY, ordinal, true, &mut pool, Time::ZERO);
        }
    }
    while side.poll_output().is_some() {}
    let t = &side.transfers[&ID];
    let phase_is = match stage {
        Stage::Computing => t.phase == Phase::Computing,
        Stage::Writing => t.phase == Phase::Writing { first_token: 9, issued: 3 },
        Stage::DoneSent => matches!(t.phase, Phase::DoneSent { .. }),
    };
    assert!(phase_is, "{:?}", t.phase);
    (side, pool)
}

fn fires(stage: Stage, break_it: impl FnOnce(&mut PrefillSide, &mut PagePool), expected: &str) {
    let (mut side, mut pool) = legit(stage);
    if let Err(e) = side.check_invariants(&pool) {
        panic!("the legitimate state is refused: {e}");
    }
    break_it(&mut side, &mut pool);
    match side.check_invariants(&pool) {
        Ok(()) => panic!("the check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

fn t(side: &mut PrefillSide) -> &mut Transfer {
    side.transfers.get_mut(&ID).unwrap()
}

#[test]
fn more_transfers_than_transfers_max() {
    // Two transfers (the bound) taken legitimately, a third filed by hand.
    fires(
        Stage::Computing,
        |side, pool| {
            deliver(side, pool, prepare(2));
            assert_eq!(side.transfers_live(), 2);
            let mut third = side.transfers[&ID].clone();
            third.key.transfer = TransferId(3);
            side.transfers.insert(TransferId(3), third);
        },
        "3 transfers over the bound",
    );
}

#[test]
fn a_transfer_is_filed_under_another_id() {
    fires(
        Stage::Computing,
        |side, _| t(side).key.transfer = TransferId(9),
        "transfer TransferId(1) filed under another id",
    );
}

#[test]
fn a_transfer_has_nothing_to_write() {
    // vllm#50297's shape: a hand-off of no page.
    fires(
        Stage::Computing,
        |side, _| t(side).pages.clear(),
        "transfer TransferId(1) has nothing to write: an empty hand-off",
    );
}

#[test]
fn too_many_heartbeats_are_remembered() {
    fires(
        Stage::Computing,
        |side, _| t(side).heartbeats_sent.extend((1..=8).map(|seq| (seq, Time::ZERO))),
        "transfer TransferId(1) remembers too many heartbeats",
    );
}

#[test]
fn writes_are_out_without_a_lease() {
    fires(
        Stage::Writing,
        |side, _| t(side).permission_until = None,
        "transfer TransferId(1) has writes out without ever holding a lease",
    );
}

#[test]
fn a_computing_transfer_has_sources() {
    fires(
        Stage::Computing,
        |side, pool| t(side).sources = vec![pool.allocate().unwrap()],
        "transfer TransferId(1) writes before its KV exists",
    );
}

#[test]
fn more_writes_are_issued_than_pages() {
    fires(
        Stage::Writing,
        |side, _| t(side).phase = Phase::Writing { first_token: 9, issued: 4 },
        "transfer TransferId(1) issued 4 writes for 3 pages",
    );
}

#[test]
fn an_outstanding_write_was_never_issued() {
    fires(
        Stage::Writing,
        |side, _| t(side).phase = Phase::Writing { first_token: 9, issued: 2 },
        "transfer TransferId(1) has an outstanding write it never issued",
    );
}

#[test]
fn done_is_sent_with_writes_outstanding() {
    // sglang#36707's shape: the transfer reported done while writes could still land.
    fires(
        Stage::Writing,
        |side, _| t(side).phase = Phase::DoneSent { first_token: 9, resend_at: Time::MAX },
        "transfer TransferId(1) sent Done with 3 writes unresolved",
    );
}

#[test]
fn done_is_sent_before_every_write_completed() {
    fires(
        Stage::DoneSent,
        |side, _| t(side).completed_writes = 2,
        "transfer TransferId(1) sent Done after 2 of 3 writes",
    );
}

#[test]
fn writes_read_without_a_source_pin() {
    fires(
        Stage::Writing,
        |side, _| t(side).source_pin = None,
        "transfer TransferId(1) reads unpinned pages",
    );
}

#[test]
fn a_source_page_is_unpinned_under_a_write() {
    // nixl#2067's shape: the source released while a one-sided write still reads it.
    fires(
        Stage::Writing,
        |side, pool| {
            pool.unpin(t(side).source_pin.unwrap()).unwrap();
        },
        "source page PageRef { index: 0, generation: 0 } of TransferId(1) unpinned while a write reads it",
    );
}

// --- the due index and the counts ---

#[test]
fn a_transfer_is_filed_under_a_stale_due_time() {
    fires(
        Stage::Computing,
        |side, _| t(side).next_heartbeat = Time::from_millis(5),
        "transfer TransferId(1) is filed as due at t+30000000ns but is due at t+5000000ns",
    );
}

#[test]
fn a_transfer_is_missing_from_the_due_index() {
    fires(
        Stage::Writing,
        |side, _| {
            side.due.clear();
        },
        "transfer TransferId(1) is missing from the due index",
    );
}

#[test]
fn the_due_index_holds_an_extra_entry() {
    fires(
        Stage::DoneSent,
        |side, _| {
            side.due.insert((Time::ZERO, TransferId(7)));
        },
        "2 due times for 1 transfers",
    );
}

#[test]
fn a_dead_transfer_is_noted_as_changed() {
    fires(
        Stage::Computing,
        |side, _| {
            side.changed.insert(TransferId(7));
        },
        "transfer TransferId(7) is noted as changed but is not live",
    );
}

#[test]
fn the_source_pins_are_miscounted() {
    fires(
        Stage::Writing,
        |side, _| side.source_pins += 1,
        "2 source pins counted, 1 transfers hold one",
    );
}

// --- the incremental check ---

/// Breaks the legitimate state, after an incremental check emptied the set of changed
/// transfers, and asserts the incremental check reports `expected`.
fn incremental_fires(
    stage: Stage,
    break_it: impl FnOnce(&mut PrefillSide, &mut PagePool),
    expected: &str,
) {
    let (mut side, mut pool) = legit(stage);
    if let Err(e) = side.check_invariants_incremental(&pool) {
        panic!("the legitimate state is refused: {e}");
    }
    assert!(side.changed.is_empty());
    break_it(&mut side, &mut pool);
    match side.check_invariants_incremental(&pool) {
        Ok(()) => panic!("the incremental check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn incremental_a_dead_transfer_is_noted_as_changed() {
    incremental_fires(
        Stage::Computing,
        |side, _| {
            side.changed.insert(TransferId(7));
        },
        "transfer TransferId(7) is noted as changed but is not live",
    );
}

#[test]
fn the_incremental_check_checks_changed_transfers() {
    // Each broken as an input would leave it: the transfer noted as changed.
    type Break = fn(&mut PrefillSide, &mut PagePool);
    let cases: [(Stage, Break, &str); 4] = [
        (
            Stage::Computing,
            |side, _| t(side).pages.clear(),
            "transfer TransferId(1) has nothing to write: an empty hand-off",
        ),
        (
            Stage::Writing,
            |side, pool| {
                pool.unpin(t(side).source_pin.unwrap()).unwrap();
            },
            "unpinned while a write reads it",
        ),
        (
            Stage::Computing,
            |side, _| t(side).next_heartbeat = Time::from_millis(5),
            "transfer TransferId(1) is filed as due at t+30000000ns but is due at t+5000000ns",
        ),
        (
            Stage::DoneSent,
            |side, _| {
                side.due.clear();
            },
            "transfer TransferId(1) is missing from the due index",
        ),
    ];
    for (stage, break_it, expected) in cases {
        incremental_fires(
            stage,
            |side, pool| {
                break_it(side, pool);
                side.changed.insert(ID);
            },
            expected,
        );
    }
}

#[test]
fn incremental_more_transfers_than_transfers_max() {
    incremental_fires(
        Stage::Computing,
        |side, pool| {
            deliver(side, pool, prepare(2));
            let mut third = side.transfers[&ID].clone();
            third.key.transfer = TransferId(3);
            side.due.insert((third.filed_due, TransferId(3)));
            side.transfers.insert(TransferId(3), third);
        },
        "3 transfers over the bound",
    );
}

#[test]
fn incremental_the_due_index_holds_an_extra_entry() {
    incremental_fires(
        Stage::Writing,
        |side, _| {
            side.due.insert((Time::MAX, TransferId(7)));
        },
        "2 due times for 1 transfers",
    );
}

#[test]
fn incremental_the_earliest_due_entry_is_wrong() {
    incremental_fires(
        Stage::Computing,
        |side, _| {
            let filed = t(side).filed_due;
            side.due.remove(&(filed, ID));
            side.due.insert((Time::ZERO, ID));
        },
        "the earliest due entry (t+0ns, TransferId(1)) names a transfer due at Some(t+30000000ns)",
    );
}
