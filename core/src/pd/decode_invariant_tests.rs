//! Every check of `DecodeSide::check_invariants` fires on a state broken by hand: each test
//! builds a legitimate state by driving the side, sees the check pass, breaks one thing through
//! the private fields (or the pool) and sees that very check report it (matched by its message).
//!
//! | check | message | test |
//! |---|---|---|
//! | transfers bounded | "{n} transfers over the bound" | `more_transfers_than_transfers_max` |
//! | leases match transfers | "{n} leases for {m} transfers" | `a_lease_is_lost` |
//! | filed under its id | "transfer {id:?} filed under another id" | `a_transfer_is_filed_under_another_id` |
//! | lease indexed | "transfer {id:?} missing from the lease index" | `a_lease_is_not_indexed` |
//! | something reserved | "transfer {id:?} reserved no page: an empty hand-off" | `a_transfer_reserved_no_page` |
//! | pages live | "transfer {id:?} holds page {page:?}, which was freed or reused" | `a_reserved_page_was_freed` |
//! | pages referenced | "transfer {id:?} holds page {page:?} without a reference" | `a_reserved_page_lost_its_reference` |
//! | one transfer per page | "page {index} reserved by {a:?} and {b:?}" | `a_page_is_reserved_twice` |
//! | reserved pages pinned | "reserved page {page:?} of {id:?} is not pinned while a write may land" | `a_reserved_page_is_unpinned` |
//! | ended memory bounded | "ended memory over its bound" | `the_ended_memory_outgrows_its_bound` |
//! | references counted | "{n} page references counted, the transfers hold {m}" | `the_page_references_are_miscounted` |
//! | changed ones live | "transfer {id:?} is noted as changed but is not live" | `a_dead_transfer_is_noted_as_changed` |
//!
//! `DecodeSide::check_invariants_incremental` runs the checks of one transfer above on each
//! transfer changed since it last ran, and the counts:
//!
//! | check (incremental) | message | test |
//! |---|---|---|
//! | changed ones live | "transfer {id:?} is noted as changed but is not live" | `incremental_a_dead_transfer_is_noted_as_changed` |
//! | each changed transfer's own checks | as above | `the_incremental_check_checks_changed_transfers` |
//! | transfers bounded, leases match | "{n} transfers over the bound", "{n} leases for {m} transfers" | `the_incremental_check_checks_the_counts` |
//! | earliest lease right | "the earliest lease ({t:?}, {id:?}) names a transfer leased until {u:?}" | `incremental_the_earliest_lease_is_wrong` |
//! | ended memory bounded | "ended memory over its bound" | `incremental_the_ended_memory_outgrows_its_bound` |

use super::*;
use crate::kv::PoolConfig;
use crate::sched::RequestId;
use crate::wire::{Epoch, Incarnation, WorkerId};

const D: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const R: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };
const P: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };

fn key(id: u64) -> TransferKey {
    TransferKey { transfer: TransferId(id), epoch: Epoch(0) }
}

/// Transfers 1 (a 10-token prompt: pages 0, 1, 2, lease extended by a heartbeat) and 2 (4 tokens:
/// page 3) awaiting the prefill side, at the bound of two.
fn legit() -> (DecodeSide, PagePool) {
    let config = DecodeConfig {
        lease: Duration::from_millis(100),
        write_flight_max: Duration::from_millis(20),
        transfers_max: 2,
        prefix_cache: true,
        live_report_interval: Duration::from_millis(200),
    };
    let mut side = DecodeSide::new(D, config);
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 8, page_tokens: 4, pins_max: 4 }).unwrap();
    for (id, len) in [(1, 10), (2, 4)] {
        let request = RequestSpec::new(RequestId(id), (1..=len).collect(), 8);
        let body = Message::Reserve { key: key(id), request, prefill: P };
        side.handle_envelope(Envelope { from: R, to: D, body }, &mut pool, Time::ZERO);
    }
    let body = Message::Heartbeat { key: key(1), seq: 0, progress: 0 };
    side.handle_envelope(Envelope { from: P, to: D, body }, &mut pool, Time::from_millis(10));
    while side.poll_output().is_some() {}
    let indices = |id: u64| side.transfers[&TransferId(id)].reserved.iter().map(|p| p.index());
    assert_eq!(indices(1).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(indices(2).collect::<Vec<_>>(), vec![3]);
    (side, pool)
}

fn fires(break_it: impl FnOnce(&mut DecodeSide, &mut PagePool), expected: &str) {
    let (mut side, mut pool) = legit();
    if let Err(e) = side.check_invariants(&pool) {
        panic!("the legitimate state is refused: {e}");
    }
    break_it(&mut side, &mut pool);
    match side.check_invariants(&pool) {
        Ok(()) => panic!("the check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

fn t(side: &mut DecodeSide, id: u64) -> &mut Transfer {
    side.transfers.get_mut(&TransferId(id)).unwrap()
}

#[test]
fn more_transfers_than_transfers_max() {
    // A third transfer with a page of its own, reserved, pinned and leased: only the bound broken.
    fires(
        |side, pool| {
            let mut third = side.transfers[&TransferId(2)].clone();
            third.key = key(3);
            third.reserved = vec![pool.allocate().unwrap()];
            third.pin = pool.pin_many(&third.reserved, Time::MAX).unwrap();
            side.leases.insert((third.lease_until, TransferId(3)));
            side.transfers.insert(TransferId(3), third);
        },
        "3 transfers over the bound",
    );
}

#[test]
fn a_lease_is_lost() {
    fires(
        |side, _| {
            side.leases.pop_first();
        },
        "1 leases for 2 transfers",
    );
}

#[test]
fn a_transfer_is_filed_under_another_id() {
    fires(|side, _| t(side, 1).key = key(9), "transfer TransferId(1) filed under another id");
}

#[test]
fn a_lease_is_not_indexed() {
    fires(
        |side, _| {
            let t = t(side, 1);
            t.lease_until = t.lease_until.saturating_add(Duration::from_millis(1));
        },
        "transfer TransferId(1) missing from the lease index",
    );
}

#[test]
fn a_transfer_reserved_no_page() {
    // vllm#50297's shape: a hand-off of no page.
    fires(
        |side, _| t(side, 2).reserved.clear(),
        "transfer TransferId(2) reserved no page: an empty hand-off",
    );
}

#[test]
fn a_reserved_page_was_freed() {
    // sglang#32564's shape: pages freed while a one-sided write may still land in them.
    fires(
        |side, pool| {
            let t = t(side, 1);
            pool.unpin(t.pin).unwrap();
            pool.release(t.reserved[1]).unwrap();
        },
        "transfer TransferId(1) holds page PageRef { index: 1, generation: 0 }, which was freed or reused",
    );
}

#[test]
fn a_reserved_page_lost_its_reference() {
    // The pin keeps the page held, so it is live, but the transfer's reference is gone.
    fires(
        |side, pool| pool.release(t(side, 1).reserved[0]).unwrap(),
        "transfer TransferId(1) holds page PageRef { index: 0, generation: 0 } without a reference",
    );
}

#[test]
fn a_page_is_reserved_twice() {
    fires(
        |side, _| {
            let page = t(side, 1).reserved[0];
            t(side, 2).reserved[0] = page;
        },
        "page 0 reserved by TransferId(1) and TransferId(2)",
    );
}

#[test]
fn a_reserved_page_is_unpinned() {
    fires(
        |side, pool| {
            pool.unpin(t(side, 1).pin).unwrap();
        },
        "reserved page PageRef { index: 0, generation: 0 } of TransferId(1) is not pinned while a write may land",
    );
}

#[test]
fn the_ended_memory_outgrows_its_bound() {
    fires(
        |side, _| side.ended.extend((4..7).map(|id| (key(id), true))),
        "ended memory over its bound",
    );
}

#[test]
fn the_page_references_are_miscounted() {
    fires(|side, _| side.page_refs_held += 1, "5 page references counted, the transfers hold 4");
}

#[test]
fn a_dead_transfer_is_noted_as_changed() {
    fires(
        |side, _| {
            side.changed.insert(TransferId(7));
        },
        "transfer TransferId(7) is noted as changed but is not live",
    );
}

// --- the incremental check ---

/// Breaks the legitimate state, after an incremental check emptied the set of changed
/// transfers, and asserts the incremental check reports `expected`.
fn incremental_fires(break_it: impl FnOnce(&mut DecodeSide, &mut PagePool), expected: &str) {
    let (mut side, mut pool) = legit();
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
        |side, _| {
            side.changed.insert(TransferId(7));
        },
        "transfer TransferId(7) is noted as changed but is not live",
    );
}

#[test]
fn the_incremental_check_checks_changed_transfers() {
    // Each broken as an input would leave it: the transfer noted as changed.
    type Break = fn(&mut DecodeSide, &mut PagePool);
    let cases: [(u64, Break, &str); 5] = [
        (1, |side, _| t(side, 1).key = key(9), "transfer TransferId(1) filed under another id"),
        (
            1,
            |side, _| {
                let t = t(side, 1);
                t.lease_until = t.lease_until.saturating_add(Duration::from_millis(1));
            },
            "transfer TransferId(1) missing from the lease index",
        ),
        (2, |side, _| t(side, 2).reserved.clear(), "transfer TransferId(2) reserved no page"),
        (
            1,
            |side, pool| pool.release(t(side, 1).reserved[0]).unwrap(),
            "transfer TransferId(1) holds page PageRef { index: 0, generation: 0 } without a reference",
        ),
        (
            1,
            |side, pool| {
                pool.unpin(t(side, 1).pin).unwrap();
            },
            "is not pinned while a write may land",
        ),
    ];
    for (id, break_it, expected) in cases {
        incremental_fires(
            |side, pool| {
                break_it(side, pool);
                side.changed.insert(TransferId(id));
            },
            expected,
        );
    }
}

#[test]
fn the_incremental_check_checks_the_counts() {
    incremental_fires(
        |side, pool| {
            let mut third = side.transfers[&TransferId(2)].clone();
            third.key = key(3);
            third.reserved = vec![pool.allocate().unwrap()];
            third.pin = pool.pin_many(&third.reserved, Time::MAX).unwrap();
            side.leases.insert((third.lease_until, TransferId(3)));
            side.transfers.insert(TransferId(3), third);
        },
        "3 transfers over the bound",
    );
    incremental_fires(
        |side, _| {
            side.leases.pop_first();
        },
        "1 leases for 2 transfers",
    );
}

#[test]
fn incremental_the_earliest_lease_is_wrong() {
    incremental_fires(
        |side, _| {
            let (until, id) = side.leases.pop_first().unwrap();
            side.leases.insert((until.saturating_add(Duration::from_millis(1)), id));
        },
        "the earliest lease (t+121000000ns, TransferId(2)) names a transfer leased until \
         Some(t+120000000ns)",
    );
}

#[test]
fn incremental_the_ended_memory_outgrows_its_bound() {
    incremental_fires(
        |side, _| side.ended.extend((4..7).map(|id| (key(id), true))),
        "ended memory over its bound",
    );
}
