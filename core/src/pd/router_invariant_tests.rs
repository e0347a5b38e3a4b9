//! Every check of `Router::check_invariants` fires on a state broken by hand: each test builds a
//! legitimate router by driving it, sees the check pass, breaks one thing through the private
//! fields and sees that very check report it (matched by its message).
//!
//! | check | message | test |
//! |---|---|---|
//! | requests match transfers | "{n} requests for {m} transfers" | `a_request_loses_its_transfer` |
//! | deadlines match transfers | "{n} deadlines for {m} transfers" | `a_deadline_is_lost` |
//! | idle deadlines indexed | "{n} idle deadlines for {m} decoding requests" | `an_idle_deadline_is_lost` |
//! | decoding is not in transfer | "{id} is decoding and in transfer at once" | `a_request_decodes_and_transfers_at_once` |
//! | each decoding request's deadline | "{id} is missing from the idle deadlines" | `a_decoding_request_misses_its_idle_deadline` |
//! | queued once, not in flight | "{id} is queued and in flight, or queued twice" | `a_request_is_queued_and_in_transfer` |
//! | queued attempts bounded | "{id} is queued for attempt {n} of {m}" | `a_queued_attempt_is_over_the_bound` |
//! | transfers bounded | "{n} transfers, {m} decoding and {q} queued over the bound" | `more_transfers_than_requests_max` |
//! | filed under its id | "transfer {id:?} filed under another id" | `a_transfer_is_filed_under_another_id` |
//! | ids of this incarnation | "transfer {id:?} outside this incarnation's ids" | `an_id_is_not_below_the_next_one` |
//! | request maps back | "{request} does not map to its transfer {id:?}" | `a_request_maps_to_another_transfer` |
//! | deadline indexed | "transfer {id:?} missing from the deadlines" | `a_deadline_is_not_indexed` |
//! | attempts bounded | "transfer {id:?} is attempt {n} of {max}" | `an_attempt_exceeds_retries_max` |
//! | prefill loads indexed | "prefill loads {index:?} are not the transfers' {scan:?}" | `a_prefill_load_is_off` |
//! | decode loads indexed | "decode loads {index:?} are not the transfers' and decoding requests' {scan:?}" | `a_decode_load_is_off` |
//! | queue indexed | "the queue index is not the queue's: {index:?}" | `the_queue_index_names_a_request_not_queued` |
//! | changed set bounded | "{n} requests noted as changed, over the bound" | `the_changed_set_outgrows_its_bound` |
//!
//! `Router::check_invariants_incremental` runs the checks of one request above on each request
//! changed since it last ran, and the counts:
//!
//! | check (incremental) | message | test |
//! |---|---|---|
//! | queued and in flight | "{id} is queued and in flight, or queued twice" | `incremental_a_request_is_queued_and_in_transfer` |
//! | decoding request's checks | "{id} is decoding and in transfer at once", "{id} is missing from the idle deadlines" | `the_incremental_check_checks_decoding_requests` |
//! | request maps to its transfer | "{id} maps to transfer {t:?}, which is not live or not its" | `incremental_a_request_maps_to_another_transfer` |
//! | transfer's checks | "transfer {id:?} is attempt {n} of {max}" (and the others) | `incremental_an_attempt_exceeds_retries_max` |
//! | counts | "{n} requests for {m} transfers" (and the other two) | `incremental_a_request_loses_its_transfer` |
//! | bound | "{n} transfers, {m} decoding and {q} queued over the bound" | `incremental_more_transfers_than_requests_max` |
//! | earliest deadline right | "the earliest deadline ({t:?}, {id:?}) names a transfer due at {u:?}" | `incremental_the_earliest_deadline_is_wrong` |
//! | earliest idle deadline right | "the earliest idle deadline ({t:?}, {id}) names a request idle at {u:?}" | `incremental_the_earliest_idle_deadline_is_wrong` |
//! | loads add up | "loads of {p} on prefill and {d} on decode workers for {n} transfers and {m} decoding requests" | `incremental_the_loads_do_not_add_up` |
//! | queue index size | "the queue index holds {a}, {b} and {c} entries for {n} queued requests" | `incremental_the_queue_index_misses_a_request` |
//! | too much changed: the full check | (the full check's) | `too_many_changes_make_the_incremental_check_a_full_one` |

use super::*;
use crate::wire::{Incarnation, WorkerId};

const ME: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(3) };
const P: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const D1: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const D2: Endpoint = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };

fn id(n: u64) -> TransferId {
    TransferId((3 << Router::ID_BITS) + n)
}

/// Two requests in transfer (the bound), one retry allowed: request 1's first transfer failed and
/// its retry (transfer 2, attempt 1) is live, as is request 2's transfer 1.
fn legit() -> Router {
    let config = RouterConfig {
        outcome_timeout: Duration::from_millis(500),
        requests_max: 2,
        retries_max: 1,
        decode_idle_timeout: Duration::from_secs(5),
        decode_slots: 8,
        prefill_slots: 8,
        queue_wait_max: Duration::from_secs(5),
        busy_backoff: Duration::from_millis(5),
    };
    let mut r = Router::new(ME, config, vec![P], vec![D1, D2]);
    r.submit(RequestSpec::new(RequestId(1), vec![1, 2, 3], 4), Time::ZERO).unwrap();
    let first = r.transfer_of(RequestId(1)).unwrap();
    r.submit(RequestSpec::new(RequestId(2), vec![4, 5, 6], 4), Time::ZERO).unwrap();
    let failure = Some(AbortReason::DecodeFailed);
    let outcome = Envelope { from: D1, to: ME, body: Message::Outcome { key: first, failure } };
    r.handle_envelope(outcome, Time::from_millis(1));
    while r.poll_output().is_some() {}
    assert_eq!(r.transfers.keys().copied().collect::<Vec<_>>(), vec![id(1), id(2)]);
    assert_eq!((r.transfers[&id(2)].request.id, r.transfers[&id(2)].attempt), (RequestId(1), 1));
    r
}

fn fires(break_it: impl FnOnce(&mut Router), expected: &str) {
    let mut r = legit();
    if let Err(e) = r.check_invariants() {
        panic!("the legitimate router is refused: {e}");
    }
    break_it(&mut r);
    match r.check_invariants() {
        Ok(()) => panic!("the check {expected:?} missed a broken router"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn a_request_loses_its_transfer() {
    fires(
        |r| {
            r.by_request.remove(&RequestId(1));
        },
        "1 requests for 2 transfers",
    );
}

#[test]
fn a_deadline_is_lost() {
    fires(
        |r| {
            r.deadlines.pop_first();
        },
        "1 deadlines for 2 transfers",
    );
}

#[test]
fn more_transfers_than_requests_max() {
    // A third request in transfer, filed consistently everywhere: only the bound is broken.
    fires(
        |r| {
            let mut t = r.transfers[&id(1)].clone();
            t.key.transfer = TransferId(r.next_transfer);
            r.next_transfer += 1;
            t.request.id = RequestId(3);
            r.by_request.insert(t.request.id, t.key.transfer);
            r.deadlines.insert((t.deadline, t.key.transfer));
            r.transfers.insert(t.key.transfer, t);
        },
        "3 transfers, 0 decoding and 0 queued over the bound",
    );
}

#[test]
fn a_transfer_is_filed_under_another_id() {
    fires(
        |r| r.transfers.get_mut(&id(1)).unwrap().key.transfer = id(7),
        &format!("transfer {:?} filed under another id", id(1)),
    );
}

#[test]
fn an_id_is_not_below_the_next_one() {
    // The allocator wound back, as a router reborn under its old incarnation would be: the next
    // id handed out would reuse a live one.
    fires(
        |r| r.next_transfer = id(1).0,
        &format!("transfer {:?} outside this incarnation's ids", id(1)),
    );
}

#[test]
fn a_request_maps_to_another_transfer() {
    fires(
        |r| {
            r.by_request.insert(RequestId(1), id(1));
        },
        &format!("req-1 does not map to its transfer {:?}", id(2)),
    );
}

#[test]
fn a_deadline_is_not_indexed() {
    fires(
        |r| {
            let t = r.transfers.get_mut(&id(1)).unwrap();
            t.deadline = t.deadline.saturating_add(Duration::from_millis(1));
        },
        &format!("transfer {:?} missing from the deadlines", id(1)),
    );
}

#[test]
fn an_attempt_exceeds_retries_max() {
    fires(
        |r| r.transfers.get_mut(&id(2)).unwrap().attempt = 2,
        &format!("transfer {:?} is attempt 2 of 1", id(2)),
    );
}

// --- the decoding requests ---

fn decoding(r: &mut Router) {
    let key = r.transfers[&id(2)].key;
    r.handle_envelope(
        Envelope { from: D1, to: ME, body: Message::Outcome { key, failure: None } },
        Time::from_millis(2),
    );
    while r.poll_output().is_some() {}
    r.check_invariants().unwrap();
}

#[test]
fn an_idle_deadline_is_lost() {
    fires(
        |r| {
            decoding(r);
            r.idle_deadlines.clear();
        },
        "0 idle deadlines for 1 decoding requests",
    );
}

#[test]
fn a_request_decodes_and_transfers_at_once() {
    fires(
        |r| {
            let key = r.transfers[&id(1)].key;
            let idle_deadline = Time::from_millis(9);
            r.decoding
                .insert(RequestId(2), Decoding { key, decode: D1, next_index: 0, idle_deadline });
            r.idle_deadlines.insert((idle_deadline, RequestId(2)));
        },
        "req-2 is decoding and in transfer at once",
    );
}

#[test]
fn a_decoding_request_misses_its_idle_deadline() {
    fires(
        |r| {
            decoding(r);
            let (t, req) = r.idle_deadlines.pop_first().unwrap();
            r.idle_deadlines.insert((t.saturating_add(Duration::from_millis(1)), req));
        },
        "req-1 is missing from the idle deadlines",
    );
}

fn queued(request: u64, attempt: u32) -> Queued {
    let spec = RequestSpec::new(RequestId(request), vec![1, 2, 3], 4);
    Queued { request: spec, attempt, not_before: Time::ZERO, deadline: Time::from_millis(9) }
}

#[test]
fn a_request_is_queued_and_in_transfer() {
    fires(|r| r.queue.push_back(queued(2, 0)), "req-2 is queued and in flight, or queued twice");
}

#[test]
fn a_queued_attempt_is_over_the_bound() {
    fires(
        |r| {
            r.forget(id(1));
            r.queue.push_back(queued(2, 7));
        },
        "req-2 is queued for attempt 7 of 1",
    );
}

// --- the indexes ---

#[test]
fn a_prefill_load_is_off() {
    fires(
        |r| {
            r.index.prefill_loads.insert(WorkerId(1), 5);
        },
        "prefill loads {WorkerId(1): 5} are not the transfers' {WorkerId(1): 2}",
    );
}

#[test]
fn a_decode_load_is_off() {
    fires(
        |r| {
            r.index.decode_loads.remove(&WorkerId(3));
        },
        "decode loads {WorkerId(2): 1} are not the transfers' and decoding requests' \
         {WorkerId(2): 1, WorkerId(3): 1}",
    );
}

#[test]
fn the_queue_index_names_a_request_not_queued() {
    fires(
        |r| {
            r.index.queued.insert(RequestId(9));
        },
        "the queue index is not the queue's",
    );
}

#[test]
fn the_changed_set_outgrows_its_bound() {
    fires(
        |r| r.index.changed.extend([RequestId(7), RequestId(8), RequestId(9)]),
        "5 requests noted as changed, over the bound",
    );
}

// --- the incremental check ---

/// Breaks the legitimate router, after an incremental check emptied the set of changed
/// requests, and asserts the incremental check reports `expected`.
fn incremental_fires(break_it: impl FnOnce(&mut Router), expected: &str) {
    let mut r = legit();
    if let Err(e) = r.check_invariants_incremental() {
        panic!("the legitimate router is refused: {e}");
    }
    assert!(r.index.changed.is_empty());
    break_it(&mut r);
    match r.check_invariants_incremental() {
        Ok(()) => panic!("the incremental check {expected:?} missed a broken router"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn incremental_a_request_is_queued_and_in_transfer() {
    incremental_fires(
        |r| {
            r.index.queued.insert(RequestId(2));
            r.index.changed(RequestId(2));
        },
        "req-2 is queued and in flight, or queued twice",
    );
}

#[test]
fn the_incremental_check_checks_decoding_requests() {
    incremental_fires(
        |r| {
            let key = r.transfers[&id(1)].key;
            let idle_deadline = Time::from_millis(9);
            r.decoding
                .insert(RequestId(2), Decoding { key, decode: D1, next_index: 0, idle_deadline });
            r.idle_deadlines.insert((idle_deadline, RequestId(2)));
            r.index.changed(RequestId(2));
        },
        "req-2 is decoding and in transfer at once",
    );
    incremental_fires(
        |r| {
            decoding(r);
            r.check_invariants_incremental().unwrap();
            let (t, req) = r.idle_deadlines.pop_first().unwrap();
            r.idle_deadlines.insert((t.saturating_add(Duration::from_millis(1)), req));
            r.index.changed(RequestId(1));
        },
        "req-1 is missing from the idle deadlines",
    );
}

#[test]
fn incremental_a_request_maps_to_another_transfer() {
    incremental_fires(
        |r| {
            r.by_request.insert(RequestId(1), id(1));
            r.index.changed(RequestId(1));
        },
        &format!("req-1 maps to transfer {:?}, which is not live or not its", id(1)),
    );
}

#[test]
fn incremental_an_attempt_exceeds_retries_max() {
    incremental_fires(
        |r| {
            r.transfers.get_mut(&id(2)).unwrap().attempt = 2;
            r.index.changed(RequestId(1));
        },
        &format!("transfer {:?} is attempt 2 of 1", id(2)),
    );
}

#[test]
fn incremental_a_request_loses_its_transfer() {
    incremental_fires(
        |r| {
            r.by_request.remove(&RequestId(1));
        },
        "1 requests for 2 transfers",
    );
}

#[test]
fn incremental_more_transfers_than_requests_max() {
    incremental_fires(
        |r| {
            let mut t = r.transfers[&id(1)].clone();
            t.key.transfer = TransferId(r.next_transfer);
            r.next_transfer += 1;
            t.request.id = RequestId(3);
            r.by_request.insert(t.request.id, t.key.transfer);
            r.deadlines.insert((t.deadline, t.key.transfer));
            r.transfers.insert(t.key.transfer, t);
        },
        "3 transfers, 0 decoding and 0 queued over the bound",
    );
}

#[test]
fn incremental_the_earliest_deadline_is_wrong() {
    incremental_fires(
        |r| {
            let (at, first) = r.deadlines.pop_first().unwrap();
            r.deadlines.insert((Time::from_millis(499), first));
            assert_eq!(at, Time::from_millis(500));
        },
        "the earliest deadline (t+499000000ns",
    );
}

#[test]
fn incremental_the_earliest_idle_deadline_is_wrong() {
    incremental_fires(
        |r| {
            decoding(r);
            r.check_invariants_incremental().unwrap();
            let (t, req) = r.idle_deadlines.pop_first().unwrap();
            r.idle_deadlines.insert((t.saturating_add(Duration::from_millis(1)), req));
        },
        "the earliest idle deadline (t+5003000000ns, req-1) names a request idle at \
         Some(t+5002000000ns)",
    );
}

#[test]
fn incremental_the_loads_do_not_add_up() {
    incremental_fires(
        |r| {
            *r.index.prefill_loads.get_mut(&WorkerId(1)).unwrap() += 1;
        },
        "loads of 3 on prefill and 2 on decode workers for 2 transfers and 0 decoding requests",
    );
}

#[test]
fn incremental_the_queue_index_misses_a_request() {
    incremental_fires(
        |r| {
            r.forget(id(1));
            r.queue.push_back(queued(2, 0));
        },
        "the queue index holds 0, 0 and 0 entries for 1 queued requests",
    );
}

#[test]
fn too_many_changes_make_the_incremental_check_a_full_one() {
    // What only the full check sees: the id allocator wound back.
    let mut r = legit();
    r.check_invariants_incremental().unwrap();
    r.next_transfer = id(1).0;
    assert_eq!(r.check_invariants_incremental(), Ok(()));
    for request in 3..6 {
        r.index.changed(RequestId(request));
    }
    assert!(r.index.changed_overflow);
    let e = r.check_invariants_incremental().unwrap_err();
    assert!(e.what().contains("outside this incarnation's ids"), "{e}");
}
