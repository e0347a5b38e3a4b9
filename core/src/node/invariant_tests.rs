//! Every check the nodes add to their parts' own fires on a state broken by hand: each test
//! builds a legitimate state through `testing::Cluster`, sees the checks pass, breaks one thing
//! through the crate-private fields and sees that very check report it.
//!
//! | check | message | test |
//! |---|---|---|
//! | decode: pool pins are the transfers' | "the pool holds {n} pins, the transfers {m}" | `decode_a_pin_nobody_holds` |
//! | decode: references are requests' or transfers' | (the scheduler's, counting the transfers' references) | `decode_a_reference_nobody_holds` |
//! | decode: stream under its transfer's id | "stream {id} filed under another id" | `decode_a_stream_under_another_id` |
//! | decode: stream of a live request | "stream {id} outlives its request" | `decode_a_stream_outlives_its_request` |
//! | decode: reserved stream has its transfer | "{id} is reserved for a transfer the protocol side does not hold" | `decode_a_reservation_without_its_transfer` |
//! | prefill: pool pins are the transfers' | "the pool holds {n} pins, the transfers {m}" | `prefill_a_pin_nobody_holds` |
//! | prefill: computation under its transfer's id | "computation {id} filed under another id" | `prefill_a_computation_under_another_id` |
//! | prefill: computation of a held request | "computation {id} has no request in the scheduler: …" | `prefill_a_computation_without_its_request` |
//! | prefill: progress mark within the prompt | "computation {id} passed {n} positions of {len}" | `prefill_a_progress_mark_past_the_prompt` |
//!
//! Each node's `check_invariants_incremental` runs its parts' incremental checks and the same
//! checks across them (tests: `incremental_*`): the decode node's counts the transfers'
//! references (`DecodeSide::page_refs_count`) beside the requests'.

use crate::Time;
use crate::sched::{RequestId, StepMode};
use crate::testing::{Cluster, ClusterConfig, small_config};
use crate::wire::{Message, RequestSpec};

fn cluster() -> Cluster {
    Cluster::new(ClusterConfig::new(small_config(StepMode::Sync, 24)))
}

/// Moves the cluster on (messages, writes, steps) until `done` holds.
fn until(c: &mut Cluster, done: impl Fn(&Cluster) -> bool) {
    for _ in 0..200 {
        if done(c) {
            return;
        }
        c.tick();
    }
    panic!("the state to break was never reached");
}

fn spec(id: u64) -> RequestSpec {
    RequestSpec { ignore_eos: true, ..RequestSpec::new(RequestId(id), (1..=9).collect(), 30) }
}

/// Request 1 decodes on the decode node.
fn decoding() -> Cluster {
    let mut c = cluster();
    c.submit(spec(1)).unwrap();
    until(&mut c, |c| c.outputs[&RequestId(1)].len() >= 2);
    c.check_invariants();
    c
}

/// Request 1's transfer is reserved on the decode node, its prompt computing on the prefill node.
fn reserved() -> Cluster {
    let mut c = cluster();
    c.submit(spec(1)).unwrap();
    // Reserve to the decode side, then its Prepare to the prefill side, which starts computing.
    for _ in 0..2 {
        c.deliver(0);
    }
    assert!(c.network.iter().any(|e| matches!(e.body, Message::Heartbeat { .. })));
    c.check_invariants();
    c
}

fn fires(what: Result<(), crate::InvariantViolation>, expected: &str) {
    match what {
        Ok(()) => panic!("the check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn decode_a_pin_nobody_holds() {
    let mut c = decoding();
    let page = c.decodes[0].node.sched.pool_mut().allocate().unwrap();
    c.decodes[0].node.sched.pool_mut().pin(page, Time::MAX).unwrap();
    c.decodes[0].node.sched.pool_mut().release(page).unwrap();
    fires(c.decodes[0].node.check_invariants(), "the pool holds 1 pins, the transfers 0");
}

#[test]
fn decode_a_reference_nobody_holds() {
    let mut c = reserved();
    c.decodes[0].node.sched.pool_mut().allocate().unwrap();
    fires(c.decodes[0].node.check_invariants(), "page tables and transfers hold");
}

#[test]
fn decode_a_stream_under_another_id() {
    let mut c = decoding();
    let stream = c.decodes[0].node.streams.pop_first().unwrap().1;
    c.decodes[0].node.streams.insert(RequestId(77), stream);
    fires(c.decodes[0].node.check_invariants(), "filed under another id");
}

#[test]
fn decode_a_stream_outlives_its_request() {
    let mut c = decoding();
    let (&id, _) = c.decodes[0].node.streams.first_key_value().unwrap();
    c.decodes[0].node.sched.abort(id, c.now).unwrap();
    while c.decodes[0].node.sched.poll_event().is_some() {}
    fires(c.decodes[0].node.check_invariants(), "outlives its request");
}

#[test]
fn decode_a_reservation_without_its_transfer() {
    let mut c = reserved();
    let (_, stream) = c.decodes[0].node.streams.first_key_value().unwrap();
    let mut other = stream.clone();
    other.key.transfer.0 += 1_000;
    let id = crate::node::local_id(other.key);
    c.decodes[0]
        .node
        .sched
        .reserve(crate::testing::request(id.0, vec![1, 2, 3], 2), c.now)
        .unwrap();
    c.decodes[0].node.streams.insert(id, other);
    fires(
        c.decodes[0].node.check_invariants(),
        "reserved for a transfer the protocol side does not hold",
    );
}

#[test]
fn prefill_a_pin_nobody_holds() {
    let mut c = reserved();
    c.step_prefill(0);
    let page = c.prefills[0].node.sched.pool_mut().allocate().unwrap();
    c.prefills[0].node.sched.pool_mut().pin(page, Time::MAX).unwrap();
    c.prefills[0].node.sched.pool_mut().release(page).unwrap();
    fires(c.prefills[0].node.check_invariants(), "the pool holds 1 pins, the transfers 0");
}

#[test]
fn prefill_a_computation_under_another_id() {
    let mut c = reserved();
    let computation = c.prefills[0].node.computing.pop_first().unwrap().1;
    c.prefills[0].node.computing.insert(RequestId(77), computation);
    fires(c.prefills[0].node.check_invariants(), "filed under another id");
}

#[test]
fn prefill_a_progress_mark_past_the_prompt() {
    let mut c = reserved();
    let computation = c.prefills[0].node.computing.values_mut().next().unwrap();
    computation.computed_high = 1_000;
    fires(c.prefills[0].node.check_invariants(), "passed 1000 positions of");
}

#[test]
fn prefill_a_computation_without_its_request() {
    let mut c = reserved();
    let (&id, _) = c.prefills[0].node.computing.first_key_value().unwrap();
    c.prefills[0].node.sched.abort(id, c.now).unwrap();
    // The scheduler's own events (Finished, PagesKept) are swallowed: the node never hears.
    while c.prefills[0].node.sched.poll_event().is_some() {}
    if let Some(pages) = c.prefills[0].node.sched.take_kept_pages(id) {
        for page in pages {
            c.prefills[0].node.sched.pool_mut().release(page).unwrap();
        }
    }
    fires(c.prefills[0].node.check_invariants(), "has no request in the scheduler");
}

#[test]
fn incremental_decode_a_pin_nobody_holds() {
    let mut c = decoding();
    let page = c.decodes[0].node.sched.pool_mut().allocate().unwrap();
    c.decodes[0].node.sched.pool_mut().pin(page, Time::MAX).unwrap();
    c.decodes[0].node.sched.pool_mut().release(page).unwrap();
    fires(
        c.decodes[0].node.check_invariants_incremental(),
        "the pool holds 1 pins, the transfers 0",
    );
}

#[test]
fn incremental_decode_a_reference_nobody_holds() {
    // Reserved: the transfer holds references, which the count must include to pass, and does.
    let mut c = reserved();
    assert!(c.decodes[0].node.side().page_refs_count() > 0);
    c.decodes[0].node.check_invariants_incremental().unwrap();
    c.decodes[0].node.sched.pool_mut().allocate().unwrap();
    fires(
        c.decodes[0].node.check_invariants_incremental(),
        "running and draining requests, kept pages and transfers hold",
    );
}

#[test]
fn incremental_decode_a_stream_outlives_its_request() {
    let mut c = decoding();
    let (&id, _) = c.decodes[0].node.streams.first_key_value().unwrap();
    c.decodes[0].node.sched.abort(id, c.now).unwrap();
    while c.decodes[0].node.sched.poll_event().is_some() {}
    fires(c.decodes[0].node.check_invariants_incremental(), "outlives its request");
}

#[test]
fn incremental_prefill_a_pin_nobody_holds() {
    let mut c = reserved();
    c.step_prefill(0);
    let page = c.prefills[0].node.sched.pool_mut().allocate().unwrap();
    c.prefills[0].node.sched.pool_mut().pin(page, Time::MAX).unwrap();
    c.prefills[0].node.sched.pool_mut().release(page).unwrap();
    fires(
        c.prefills[0].node.check_invariants_incremental(),
        "the pool holds 1 pins, the transfers 0",
    );
}

#[test]
fn incremental_prefill_a_computation_under_another_id() {
    let mut c = reserved();
    let computation = c.prefills[0].node.computing.pop_first().unwrap().1;
    c.prefills[0].node.computing.insert(RequestId(77), computation);
    fires(c.prefills[0].node.check_invariants_incremental(), "filed under another id");
}
