//! Every check of `Scheduler::check_invariants` fires on a state broken by hand: each test builds a
//! legitimate state through the harness, sees the checks pass, breaks one thing through the
//! crate-private fields and sees that very check report it (matched by its message).
//!
//! | check | message | test |
//! |---|---|---|
//! | the pool's own checks | (see `kv/pool/invariant_tests.rs`) | `kv/pool/invariant_tests.rs`: the pool's API cannot break them, so no test here |
//! | `check_bounds` | | |
//! | free slots within running_max | "{n} slots on the free list, over running_max {m}" | `more_slots_are_free_than_there_are` |
//! | running hold slots | "{n} running but {m} slots held" | `more_requests_run_than_hold_slots` |
//! | steps in flight bound | "{n} steps in flight in {mode:?} mode" | `too_many_steps_are_in_flight` |
//! | running order sorted | "running order is not sorted" | `the_running_order_is_not_sorted` |
//! | entries accounted | "{n} requests + {m} free entries != {total}" | `an_entry_is_lost` |
//! | queue deadlines | "{n} waiting, {m} queue deadlines" | `a_queue_deadline_is_lost` |
//! | kept pages bounded, of ended requests | "{n} kept page sets, or one of a request still held" | `hand_over_tests.rs`: `pages_kept_for_a_request_still_held_are_caught` |
//! | `check_requests` | | |
//! | free slot in range | "free slot {slot} out of range" | `a_free_slot_is_out_of_range` |
//! | free slot once | "slot {slot} is free twice" | `a_slot_is_free_twice` |
//! | id names a request | "{id} maps to empty entry {entry}" | `an_id_maps_to_an_empty_entry` |
//! | id names its request | "{id} maps to entry {entry} holding {other}" | `an_id_maps_to_another_request` |
//! | waiting is in the waiting order only | "{id} is waiting but not (only) in the waiting order" | `a_waiting_request_is_also_running` |
//! | waiting holds nothing | "{id} waits holding {n} pages, {m} computed" | `a_waiting_request_holds_computed_positions` |
//! | waiting has no step | "{id} waits with {n} steps in flight" | `a_waiting_request_has_a_step_in_flight` |
//! | running is in the running order only | "{id} is running but not (only) in the running order" | `a_running_request_is_out_of_the_running_order` |
//! | reserved is unordered | "{id} is reserved but ordered: …" | `hand_over_tests.rs`: `a_reserved_request_in_an_order_is_caught` |
//! | reserved holds nothing | "{id} is reserved holding {n} pages, …" | `hand_over_tests.rs`: `a_reserved_request_holding_pages_is_caught` |
//! | draining is unordered | "{id} is draining but still ordered" | `a_draining_request_is_still_ordered` |
//! | draining has a step | "{id} drains with no step in flight" | `a_draining_request_has_no_step_in_flight` |
//! | one holder per slot | "{id}'s slot {slot} is out of range, free, or held twice" | `a_slot_is_out_of_range_free_or_held_twice` (all three ways) |
//! | computed within tokens | "{id} computed {n} of {m} tokens" | `more_is_computed_than_there_are_tokens` |
//! | planned within tokens | "{id} plans KV for {n} positions of {m}" | `more_is_planned_than_there_will_be_tokens` |
//! | pages cover the plan | "{id} has {n} pages for {m} planned positions" | `the_pages_do_not_cover_the_planned_positions` |
//! | sent within pages | "{id} sent {n} of {m} pages" | `more_pages_are_sent_than_held` |
//! | cached only computed pages | "{id} cached {n} pages of {m} computed tokens" | `pages_are_cached_before_they_are_computed` |
//! | output within max_tokens | "{id} produced {n} tokens over max {m}" | `the_output_exceeds_max_tokens` |
//! | within the context | "{id} is longer than the context" | `a_request_is_longer_than_the_context` |
//! | no draft row | "{id} has a draft row outside planning" | `a_draft_row_outlives_planning` |
//! | every slot free or held | "a slot is neither free nor held" | `a_slot_is_neither_free_nor_held` |
//! | orders name their requests | "an order names entry {entry}, which holds another request or none" | `an_order_names_no_request` |
//! | `check_page_references` | | |
//! | listed pages live | "{id} lists page {page:?}, which was freed or evicted" | `a_listed_page_was_freed` |
//! | transfers' pages live | "a transfer holds page {page:?}, which was freed or evicted" | `hand_over_tests.rs`: `a_transfers_reference_is_counted_only_when_listed` |
//! | references match listings | "page {page:?} has {n} references but {m} page-table and transfer entries" | `a_page_has_a_reference_nobody_lists` |
//! | reference totals | "the pool counts {n} page references, page tables and transfers hold {m}" | `an_unlisted_page_is_referenced` |
//! | `check_in_flight` | | |
//! | steps were planned | "step {step:?} in flight was never planned" | `a_step_in_flight_was_never_planned` |
//! | sampling rows counted | "step {step:?} miscounts its sampling rows" | `a_step_miscounts_its_sampling_rows` |
//! | rows name live requests | "step {step:?} names {id}, which is gone: its pages may be reused" | `a_step_names_a_request_that_is_gone` |
//! | tokens within the step's bound | "step {step:?} computes {n} tokens, over step_tokens_max {m}" | `a_step_computes_more_tokens_than_a_step_may` |
//! | scored positions within their bound | "step {step:?} scores {n} prompt positions, over scored_tokens_max {m}" | `a_step_scores_more_prompt_positions_than_a_step_may` |
//! | steps counted | "{id} counts {n} steps in flight, {m} name it" | `a_request_miscounts_its_steps_in_flight` |
//! | positions counted | "{id} counts {n} positions in flight, steps hold {m}" | `a_request_miscounts_its_positions_in_flight` |
//! | samples counted | "{id} counts {n} samples in flight, steps hold {m}" | `a_request_miscounts_its_samples_in_flight` |
//! | placeholder source | "{id} has samples in flight but no source for its next input" | `a_sample_in_flight_has_no_source` |
//!
//! `Scheduler::check_invariants_incremental` runs the same checks on the requests the steps work
//! on (running, and draining with a step in flight); each fires from it too. The tests below
//! break the legitimate state after an incremental check emptied the pool's log.
//!
//! | check (incremental) | message | test |
//! |---|---|---|
//! | the pool's incremental check | (see `kv/pool/incremental_tests.rs`) | there: the pool's API cannot break it |
//! | `check_bounds`, all six | as above | `the_incremental_check_checks_the_bounds` |
//! | orders name their requests (running order) | "an order names entry {entry}, …" | `incremental_a_running_order_names_no_request` |
//! | steps in flight (planned, sampling rows, live rows, tokens, scored positions) | as above | `the_incremental_check_checks_the_steps_in_flight` |
//! | free slot in range, once | "free slot {slot} out of range", "slot {slot} is free twice" | `the_incremental_check_checks_the_free_slots` |
//! | request filed under its entry | "{id} in entry {entry} is filed under entry {filed:?}" | `incremental_a_running_request_is_filed_elsewhere` |
//! | phase | "{id} is draining but still ordered" (and the others) | `incremental_a_draining_request_is_still_ordered` |
//! | one holder per slot | "{id}'s slot {slot} is out of range, free, or held twice" | `incremental_a_slot_is_out_of_range_free_or_held_twice` |
//! | counters | "{id} computed {n} of {m} tokens" (and the others) | `the_incremental_check_checks_the_counters` |
//! | in-flight counts | "{id} counts {n} steps in flight, {m} name it" (and the others) | `the_incremental_check_checks_the_in_flight_counts` |
//! | reference total | "the pool counts {n} page references, running and draining requests, kept pages and transfers hold {m}" | `incremental_an_unlisted_page_is_referenced`, `incremental_a_page_has_a_reference_nobody_lists`, `incremental_a_listed_page_was_freed`, `incremental_kept_pages_count_in_the_reference_total` |

use super::request::{AfterDrain, Phase, Request};
use super::*;
use crate::Time;
use crate::model::Executor;
use crate::testing::{Harness, request, small_config};

fn long(id: u64, len: u32) -> NewRequest {
    let prompt = (0..len).map(|i| 1 + (id as u32 * 17 + i * 5) % 90).collect();
    NewRequest { ignore_eos: true, ..request(id, prompt, 6) }
}

/// Sync mode, 4 tokens a page. Requests 1 (6-token prompt, pages 0 and 1, page 0 cached) and 4
/// (3 tokens, page 3) run, 3 (3 tokens, page 2) drains after an abort, each with one output token
/// and a decode row in the step in flight; 2 waits. Slots: 1 has 0, 3 has 1, 4 has 2; 3 is free.
fn legit() -> Harness {
    let mut h = Harness::new(small_config(StepMode::Sync, 16));
    for (id, len) in [(1, 6), (3, 3), (4, 3)] {
        h.submit(long(id, len)).unwrap();
    }
    let prefill = h.sched.plan_step(h.now).unwrap();
    let out = h.model.execute(&prefill).unwrap();
    h.sched.apply_outputs(&out, h.now).unwrap();
    let decode = h.sched.plan_step(h.now).unwrap();
    assert_eq!(decode.rows.len(), 3);
    assert!(h.abort(RequestId(3)));
    h.submit(long(2, 5)).unwrap();
    assert_eq!((h.sched.waiting_count(), h.sched.running_count()), (1, 2));
    assert_eq!((h.sched.slots_held(), h.sched.steps_in_flight()), (3, 1));
    assert!(matches!(r(&mut h.sched, 3).phase, Phase::Draining { then: AfterDrain::Remove, .. }));
    assert_eq!(r(&mut h.sched, 1).pages_cached, 1);
    h
}

/// Request `id`'s state.
fn r(s: &mut Scheduler, id: u64) -> &mut Request {
    let entry = s.by_id[&RequestId(id)];
    s.entry_mut(entry)
}

/// Breaks the legitimate state with `break_it` and asserts the check whose message contains
/// `expected` is the one that fires.
fn fires(break_it: impl FnOnce(&mut Scheduler), expected: &str) {
    let mut h = legit();
    if let Err(e) = h.sched.check_invariants() {
        panic!("the legitimate state is refused: {e}");
    }
    break_it(&mut h.sched);
    match h.sched.check_invariants() {
        Ok(()) => panic!("the check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

// --- check_bounds ---

#[test]
fn more_slots_are_free_than_there_are() {
    fires(|s| s.free_slots.extend([0, 1, 2, 3]), "5 slots on the free list, over running_max 4");
}

#[test]
fn more_requests_run_than_hold_slots() {
    // The running requests' slots back on the free list while they run.
    fires(|s| s.free_slots.extend([0, 2]), "2 running but 1 slots held");
}

#[test]
fn too_many_steps_are_in_flight() {
    fires(
        |s| {
            let again = s.in_flight[0].clone();
            s.in_flight.push_back(again);
        },
        "2 steps in flight in Sync mode",
    );
}

#[test]
fn the_running_order_is_not_sorted() {
    fires(|s| s.running.swap(0, 1), "running order is not sorted");
}

#[test]
fn an_entry_is_lost() {
    fires(
        |s| {
            s.free_entries.pop();
        },
        "4 requests + 7 free entries != 12",
    );
}

#[test]
fn a_queue_deadline_is_lost() {
    fires(
        |s| {
            s.waiting_deadlines.pop_first();
        },
        "1 waiting, 0 queue deadlines",
    );
}

// --- check_requests ---

#[test]
fn a_free_slot_is_out_of_range() {
    fires(|s| s.free_slots[0] = 9, "free slot 9 out of range");
}

#[test]
fn a_slot_is_free_twice() {
    fires(|s| s.free_slots.push(3), "slot 3 is free twice");
}

#[test]
fn an_id_maps_to_an_empty_entry() {
    fires(
        |s| {
            let entry = s.by_id[&RequestId(2)];
            s.entries[entry as usize] = None;
        },
        "req-2 maps to empty entry 3",
    );
}

#[test]
fn an_id_maps_to_another_request() {
    fires(|s| r(s, 1).id = RequestId(9), "req-1 maps to entry 0 holding req-9");
}

#[test]
fn a_waiting_request_is_also_running() {
    fires(
        |s| {
            let entry = s.by_id[&RequestId(2)];
            let key = (s.entry(entry).order, entry);
            let at = s.running.binary_search(&key).unwrap_err();
            s.running.insert(at, key);
        },
        "req-2 is waiting but not (only) in the waiting order",
    );
}

#[test]
fn a_waiting_request_holds_computed_positions() {
    fires(|s| r(s, 2).computed = 4, "req-2 waits holding 0 pages, 4 computed");
}

#[test]
fn a_waiting_request_has_a_step_in_flight() {
    fires(|s| r(s, 2).in_flight_steps = 1, "req-2 waits with 1 steps in flight");
}

#[test]
fn a_running_request_is_out_of_the_running_order() {
    fires(|s| s.running.truncate(1), "req-4 is running but not (only) in the running order");
}

#[test]
fn a_draining_request_is_still_ordered() {
    // Ended, yet still in the running order: it would be scheduled again (double completion).
    fires(
        |s| r(s, 1).phase = Phase::Draining { slot: 0, then: AfterDrain::Remove },
        "req-1 is draining but still ordered",
    );
}

#[test]
fn a_draining_request_has_no_step_in_flight() {
    fires(|s| r(s, 3).in_flight_steps = 0, "req-3 drains with no step in flight");
}

#[test]
fn a_slot_is_out_of_range_free_or_held_twice() {
    // Slot 9 does not exist, slot 3 is on the free list, slot 0 is request 1's.
    for slot in [9, 3, 0] {
        fires(
            |s| r(s, 4).phase = Phase::Running { slot },
            &format!("req-4's slot {slot} is out of range, free, or held twice"),
        );
    }
}

#[test]
fn more_is_computed_than_there_are_tokens() {
    fires(|s| r(s, 1).computed = 8, "req-1 computed 8 of 7 tokens");
}

#[test]
fn more_is_planned_than_there_will_be_tokens() {
    fires(|s| r(s, 1).in_flight_tokens = 3, "req-1 plans KV for 9 positions of 8");
}

#[test]
fn the_pages_do_not_cover_the_planned_positions() {
    fires(
        |s| {
            let page = r(s, 1).pages.pop().unwrap();
            s.pool.release(page).unwrap();
        },
        "req-1 has 1 pages for 7 planned positions",
    );
}

#[test]
fn more_pages_are_sent_than_held() {
    fires(|s| r(s, 1).pages_sent = 3, "req-1 sent 3 of 2 pages");
}

#[test]
fn pages_are_cached_before_they_are_computed() {
    // sglang#38355's shape: a page offered to the cache before its KV was written.
    fires(|s| r(s, 1).pages_cached = 2, "req-1 cached 2 pages of 6 computed tokens");
}

#[test]
fn the_output_exceeds_max_tokens() {
    fires(|s| r(s, 1).max_tokens = 0, "req-1 produced 1 tokens over max 0");
}

#[test]
fn a_request_is_longer_than_the_context() {
    fires(
        |s| {
            let waiting = r(s, 2);
            waiting.tokens.resize(70, 1);
            waiting.prompt_len = 70;
        },
        "req-2 is longer than the context",
    );
}

#[test]
fn a_draft_row_outlives_planning() {
    fires(|s| r(s, 1).draft_row = Some(0), "req-1 has a draft row outside planning");
}

#[test]
fn a_slot_is_neither_free_nor_held() {
    fires(|s| s.free_slots.clear(), "a slot is neither free nor held");
}

#[test]
fn an_order_names_no_request() {
    fires(
        |s| s.running.push(((0, Time::MAX, RequestId(7)), 9)),
        "an order names entry 9, which holds another request or none",
    );
}

// --- check_page_references ---

#[test]
fn a_listed_page_was_freed() {
    // vllm#45357's shape: a page freed while its request still lists it.
    fires(
        |s| {
            let page = r(s, 1).pages[1];
            s.pool.release(page).unwrap();
        },
        "which was freed or evicted",
    );
}

#[test]
fn a_page_has_a_reference_nobody_lists() {
    fires(
        |s| {
            let page = r(s, 1).pages[0];
            s.pool.retain(page).unwrap();
        },
        "has 2 references but 1 page-table and transfer entries",
    );
}

#[test]
fn an_unlisted_page_is_referenced() {
    // A leak: a page allocated that no page table lists.
    fires(
        |s| {
            s.pool.allocate().unwrap();
        },
        "the pool counts 5 page references, page tables and transfers hold 4",
    );
}

// --- check_in_flight ---

#[test]
fn a_step_in_flight_was_never_planned() {
    fires(|s| s.in_flight[0].step = StepId(99), "step StepId(99) in flight was never planned");
}

#[test]
fn a_step_miscounts_its_sampling_rows() {
    fires(|s| s.in_flight[0].sampling_rows += 1, "miscounts its sampling rows");
}

#[test]
fn a_step_names_a_request_that_is_gone() {
    fires(
        |s| s.in_flight[0].rows[0].request = RequestId(42),
        "names req-42, which is gone: its pages may be reused",
    );
}

#[test]
fn a_step_computes_more_tokens_than_a_step_may() {
    // Three decode rows of one token; the first now 14 longer: 17 of 16.
    fires(|s| s.in_flight[0].rows[0].end += 14, "computes 17 tokens, over step_tokens_max 16");
}

/// Request 1's row made a scoring request's row over its whole prompt of 6: positions 0 to 4
/// score (the last one's logits give the first token), under a bound of 4.
fn score_five_under_four(s: &mut Scheduler) {
    r(s, 1).reads_prefix_cache = false;
    s.in_flight[0].rows[0].start = 0;
    s.config.scored_tokens_max = 4;
}

#[test]
fn a_step_scores_more_prompt_positions_than_a_step_may() {
    fires(score_five_under_four, "scores 5 prompt positions, over scored_tokens_max 4");
}

#[test]
fn a_request_forgets_how_far_it_ever_computed() {
    fires(|s| r(s, 1).computed_high = 0, "req-1 computed 6, at most 0 ever");
}

#[test]
fn a_request_miscounts_its_steps_in_flight() {
    fires(|s| r(s, 1).in_flight_steps = 2, "req-1 counts 2 steps in flight, 1 name it");
}

#[test]
fn a_request_miscounts_its_positions_in_flight() {
    fires(|s| r(s, 1).in_flight_tokens = 0, "req-1 counts 0 positions in flight, steps hold 1");
}

#[test]
fn a_request_miscounts_its_samples_in_flight() {
    fires(|s| r(s, 1).in_flight_samples = 2, "req-1 counts 2 samples in flight, steps hold 1");
}

#[test]
fn a_sample_in_flight_has_no_source() {
    fires(
        |s| r(s, 1).last_sample = None,
        "req-1 has samples in flight but no source for its next input",
    );
}

// --- the incremental check ---

/// A way to break the scheduler's state.
type Break = fn(&mut Scheduler);

/// Breaks the legitimate state, after an incremental check emptied the pool's log, and asserts
/// the incremental check reports `expected`.
fn incremental_fires(break_it: impl FnOnce(&mut Scheduler), expected: &str) {
    let mut h = legit();
    if let Err(e) = h.sched.check_invariants_incremental() {
        panic!("the legitimate state is refused: {e}");
    }
    break_it(&mut h.sched);
    match h.sched.check_invariants_incremental() {
        Ok(()) => panic!("the incremental check {expected:?} missed a broken state"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn the_incremental_check_checks_the_bounds() {
    let cases: [(Break, &str); 6] = [
        (|s| s.free_slots.extend([0, 1, 2, 3]), "5 slots on the free list, over running_max 4"),
        (|s| s.free_slots.extend([0, 2]), "2 running but 1 slots held"),
        (
            |s| {
                let again = s.in_flight[0].clone();
                s.in_flight.push_back(again);
            },
            "2 steps in flight in Sync mode",
        ),
        (|s| s.running.swap(0, 1), "running order is not sorted"),
        (
            |s| {
                s.free_entries.pop();
            },
            "4 requests + 7 free entries != 12",
        ),
        (
            |s| {
                s.waiting_deadlines.pop_first();
            },
            "1 waiting, 0 queue deadlines",
        ),
    ];
    for (break_it, expected) in cases {
        incremental_fires(break_it, expected);
    }
}

#[test]
fn incremental_a_running_order_names_no_request() {
    incremental_fires(
        |s| s.running.push(((0, Time::MAX, RequestId(7)), 9)),
        "an order names entry 9, which holds another request or none",
    );
}

#[test]
fn the_incremental_check_checks_the_steps_in_flight() {
    let cases: [(Break, &str); 5] = [
        (|s| s.in_flight[0].step = StepId(99), "step StepId(99) in flight was never planned"),
        (|s| s.in_flight[0].sampling_rows += 1, "miscounts its sampling rows"),
        (
            |s| s.in_flight[0].rows[0].request = RequestId(42),
            "names req-42, which is gone: its pages may be reused",
        ),
        (|s| s.in_flight[0].rows[0].end += 14, "computes 17 tokens, over step_tokens_max 16"),
        (score_five_under_four, "scores 5 prompt positions, over scored_tokens_max 4"),
    ];
    for (break_it, expected) in cases {
        incremental_fires(break_it, expected);
    }
}

#[test]
fn the_incremental_check_checks_the_free_slots() {
    incremental_fires(|s| s.free_slots[0] = 9, "free slot 9 out of range");
    incremental_fires(|s| s.free_slots.push(3), "slot 3 is free twice");
}

#[test]
fn incremental_a_running_request_is_filed_elsewhere() {
    incremental_fires(
        |s| {
            let entry = s.by_id[&RequestId(2)];
            s.by_id.insert(RequestId(1), entry);
        },
        "req-1 in entry 0 is filed under entry Some(3)",
    );
}

#[test]
fn incremental_a_draining_request_is_still_ordered() {
    incremental_fires(
        |s| r(s, 1).phase = Phase::Draining { slot: 0, then: AfterDrain::Remove },
        "req-1 is draining but still ordered",
    );
}

#[test]
fn incremental_a_slot_is_out_of_range_free_or_held_twice() {
    for slot in [9, 3, 0] {
        incremental_fires(
            |s| r(s, 4).phase = Phase::Running { slot },
            &format!("req-4's slot {slot} is out of range, free, or held twice"),
        );
    }
}

#[test]
fn the_incremental_check_checks_the_counters() {
    let cases: [(Break, &str); 4] = [
        (|s| r(s, 1).computed = 8, "req-1 computed 8 of 7 tokens"),
        (|s| r(s, 4).pages_sent = 3, "req-4 sent 3 of 1 pages"),
        (|s| r(s, 1).pages_cached = 2, "req-1 cached 2 pages of 6 computed tokens"),
        (|s| r(s, 3).draft_row = Some(0), "req-3 has a draft row outside planning"),
    ];
    for (break_it, expected) in cases {
        incremental_fires(break_it, expected);
    }
}

#[test]
fn incremental_a_listed_page_was_freed() {
    incremental_fires(
        |s| {
            let page = r(s, 1).pages[1];
            s.pool.release(page).unwrap();
        },
        "the pool counts 3 page references, running and draining requests, kept pages and \
         transfers hold 4",
    );
}

#[test]
fn the_incremental_check_checks_the_in_flight_counts() {
    let cases: [(Break, &str); 4] = [
        (|s| r(s, 3).in_flight_steps = 2, "req-3 counts 2 steps in flight, 1 name it"),
        (|s| r(s, 1).in_flight_tokens = 0, "req-1 counts 0 positions in flight, steps hold 1"),
        (|s| r(s, 4).in_flight_samples = 2, "req-4 counts 2 samples in flight, steps hold 1"),
        (
            |s| r(s, 1).last_sample = None,
            "req-1 has samples in flight but no source for its next input",
        ),
    ];
    for (break_it, expected) in cases {
        incremental_fires(break_it, expected);
    }
}

#[test]
fn incremental_an_unlisted_page_is_referenced() {
    incremental_fires(
        |s| {
            s.pool.allocate().unwrap();
        },
        "the pool counts 5 page references, running and draining requests, kept pages and \
         transfers hold 4",
    );
}

#[test]
fn incremental_a_page_has_a_reference_nobody_lists() {
    // Which page has the extra reference only the full check says; the total tells there is one.
    incremental_fires(
        |s| {
            let page = r(s, 1).pages[0];
            s.pool.retain(page).unwrap();
        },
        "the pool counts 5 page references, running and draining requests, kept pages and \
         transfers hold 4",
    );
}

/// Kept page sets (a prefill worker's, of requests that ended) count in the incremental check's
/// total: a page kept for an ended request holds every check, and the page freed behind the set's
/// back fails the total.
#[test]
fn incremental_kept_pages_count_in_the_reference_total() {
    let mut h = legit();
    h.sched.check_invariants_incremental().unwrap();
    let page = h.sched.pool.allocate().unwrap();
    h.sched.kept.insert(RequestId(9), vec![page]);
    h.sched.check_invariants_incremental().unwrap();
    h.sched.check_invariants().unwrap();
    h.sched.pool.release(page).unwrap();
    let e = h.sched.check_invariants_incremental().unwrap_err();
    assert!(
        e.what().contains(
            "the pool counts 4 page references, running and draining requests, kept pages and \
             transfers hold 5"
        ),
        "{e}"
    );
}

#[test]
fn the_incremental_check_does_not_see_waiting_requests() {
    // The price of its cost: a waiting request no step touches is the full check's to see.
    let mut h = legit();
    h.sched.check_invariants_incremental().unwrap();
    r(&mut h.sched, 2).computed = 4;
    assert_eq!(h.sched.check_invariants_incremental(), Ok(()));
    assert!(h.sched.check_invariants().is_err());
}
