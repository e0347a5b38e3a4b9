//! One test per single-worker bug class of shared/bugs.md. Each shows the scheduler refuses the
//! bad sequence, then breaks the state by hand the way the bug did and shows the invariant check
//! fires.

use super::request::{AfterDrain, Phase};
use super::*;
use crate::model::Executor;
use crate::testing::{Harness, request, run_alone, small_config};

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1 + (seed * 17 + i * 5) % 90).collect()
}

fn long(id: u64, len: u32) -> NewRequest {
    NewRequest { ignore_eos: true, ..request(id, prompt(id as u32, len), 6) }
}

fn violation(h: &Harness) -> String {
    match h.sched.check_invariants() {
        Ok(()) => panic!("the invariant check missed a broken state"),
        Err(e) => e.what().to_owned(),
    }
}

/// vllm#45357, vllm#47728, sglang#18803: blocks freed while the step in flight still read them.
#[test]
fn free_before_the_last_reader_sync() {
    let mut h = Harness::new(small_config(StepMode::Sync, 8));
    h.submit(long(1, 6)).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    let pages: Vec<_> = plan.page_updates.clone();
    h.sched.abort(RequestId(1), h.now).unwrap();
    // Aborted, but the step still writes its pages: they stay held, and a newcomer gets others.
    for &page in &pages {
        assert_eq!(h.sched.pool().refs(page), Ok(1), "page {page:?} freed under a running step");
    }
    h.sched.check_invariants().unwrap();
    let out = h.model.execute(&plan).unwrap();
    h.sched.apply_outputs(&out, h.now).unwrap();
    assert_eq!(h.sched.pool().held_count(), 0, "released once the step is applied");
    assert_eq!(
        h.sched.poll_event(),
        Some(SchedEvent::Finished {
            request: RequestId(1),
            reason: FinishReason::Aborted,
            output_tokens: 0
        })
    );
    assert_eq!(h.sched.poll_event(), None, "the discarded step reports nothing");
}

#[test]
fn free_before_the_last_reader_overlap() {
    let mut h = Harness::new(small_config(StepMode::Overlap, 16));
    let victim = long(1, 3);
    let bystander = long(2, 3);
    h.submit(victim).unwrap();
    h.submit(bystander.clone()).unwrap();
    // Step N prefills both; step N+1 is planned before N is applied.
    let n = h.sched.plan_step(h.now).unwrap();
    let n_out = h.model.execute(&n).unwrap();
    let n1 = h.sched.plan_step(h.now).unwrap();
    let n1_out = h.model.execute(&n1).unwrap();
    h.sched.abort(RequestId(1), h.now).unwrap();
    h.sched.apply_outputs(&n_out, h.now).unwrap();
    // Step N is applied, but N+1 still writes request 1's pages: slot and pages stay taken.
    let entry = h.sched.by_id[&RequestId(1)];
    assert!(matches!(h.sched.entry(entry).phase, Phase::Draining { then: AfterDrain::Remove, .. }));
    let victim_pages: Vec<_> = n
        .rows
        .iter()
        .filter(|r| r.request == RequestId(1))
        .flat_map(|r| n.row_page_updates(r).to_vec())
        .collect();
    h.submit(long(3, 3)).unwrap();
    let n2 = h.sched.plan_step(h.now).unwrap();
    assert!(n2.rows.iter().all(|r| r.request != RequestId(1)), "an aborted request gets no row");
    assert!(
        n2.page_updates.iter().all(|p| !victim_pages.contains(p)),
        "pages still written by step N+1 were handed out"
    );
    assert!(
        n2.rows.iter().all(|r| r.slot != 0 || r.request != RequestId(3)),
        "slot 0 is still draining"
    );
    let n2_out = h.model.execute(&n2).unwrap();
    h.sched.apply_outputs(&n1_out, h.now).unwrap();
    assert!(!h.sched.by_id.contains_key(&RequestId(1)), "gone once the last reader is applied");
    h.pending.push_back(n2_out);
    h.apply_oldest();
    h.run_until_idle(200);
    assert_eq!(h.tokens[&RequestId(2)], run_alone(h.sched.config(), &bystander));

    // By hand: free the aborted request's pages while N+1 is in flight, as the bug did.
    let mut h = Harness::new(small_config(StepMode::Overlap, 16));
    h.submit(long(1, 3)).unwrap();
    let _n = h.sched.plan_step(h.now).unwrap();
    let _n1 = h.sched.plan_step(h.now).unwrap();
    let entry = h.sched.by_id[&RequestId(1)];
    let pages = std::mem::take(&mut h.sched.entry_mut(entry).pages);
    for page in pages {
        h.sched.pool.release(page).unwrap();
    }
    let what = violation(&h);
    assert!(what.contains("page"), "{what}");
    // And removing the request itself while its steps are in flight.
    let mut h = Harness::new(small_config(StepMode::Overlap, 16));
    h.submit(long(1, 3)).unwrap();
    let _n = h.sched.plan_step(h.now).unwrap();
    let entry = h.sched.by_id[&RequestId(1)];
    for page in h.sched.entry_mut(entry).pages.clone() {
        h.sched.pool.release(page).unwrap();
    }
    h.sched.entries[entry as usize] = None;
    h.sched.by_id.clear();
    h.sched.running.clear();
    h.sched.free_entries.push(entry);
    h.sched.free_slots.push(0);
    let what = violation(&h);
    assert!(what.contains("gone"), "{what}");
}

/// sglang#38355: a prefix cached mid chunked prefill, then the request aborted and its pages
/// freed: the cache pointed at pages that were not (or no longer) its KV.
#[test]
fn poisoned_cached_prefix_after_abort_mid_chunked_prefill() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let mut h = Harness::new(small_config(mode, 32));
        let shared = prompt(9, 20);
        h.submit(NewRequest { ignore_eos: true, ..request(1, shared.clone(), 4) }).unwrap();
        h.step(); // first chunk planned (and in overlap, also the second)
        h.step();
        h.abort(RequestId(1));
        let cached = h.sched.pool().cached_count();
        assert!(cached <= 4, "{mode:?}: only pages of applied chunks may be cached, got {cached}");
        h.run_until_idle(100);
        // Whatever stayed cached is whole: a request with the same prompt gets its output alone.
        let again = NewRequest { ignore_eos: true, ..request(2, shared.clone(), 4) };
        h.submit(again.clone()).unwrap();
        h.run_until_idle(100);
        assert_eq!(h.tokens[&RequestId(2)], run_alone(h.sched.config(), &again), "{mode:?}");
    }
    // By hand: a request that claims more cached pages than it has computed.
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    h.submit(long(1, 20)).unwrap();
    h.step();
    let entry = h.sched.by_id[&RequestId(1)];
    h.sched.entry_mut(entry).pages_cached = 4;
    assert!(violation(&h).contains("cached"));
}

/// vllm#46240: an aborted request's completions both arrived; an assertion killed the engine.
#[test]
fn double_completion() {
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(long(1, 3)).unwrap();
    h.step();
    h.step();
    assert!(h.abort(RequestId(1)));
    assert!(!h.abort(RequestId(1)), "a second terminal is refused, not reported");
    h.run_until_idle(100); // the in-flight outputs arrive after the abort: ignored
    assert_eq!(h.finished[&RequestId(1)], FinishReason::Aborted);
    // By hand: a request that ended yet still sits in the running order.
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(long(1, 3)).unwrap();
    h.sched.plan_step(h.now).unwrap();
    let entry = h.sched.by_id[&RequestId(1)];
    h.sched.entry_mut(entry).phase = Phase::Draining { slot: 0, then: AfterDrain::Remove };
    assert!(violation(&h).contains("still ordered"));
}

/// vllm#25067: an abort raced completion.
#[test]
fn abort_races_completion() {
    // Abort first: the step that would end the request is applied after it, and is discarded.
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(NewRequest { ignore_eos: true, ..request(1, prompt(1, 3), 1) }).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    let out = h.model.execute(&plan).unwrap();
    h.sched.abort(RequestId(1), h.now).unwrap();
    h.sched.apply_outputs(&out, h.now).unwrap();
    h.sched.check_invariants().unwrap();
    let events: Vec<_> = std::iter::from_fn(|| h.sched.poll_event()).collect();
    assert_eq!(
        events,
        vec![SchedEvent::Finished {
            request: RequestId(1),
            reason: FinishReason::Aborted,
            output_tokens: 0
        }]
    );
    // Completion first: the abort finds nothing and reports nothing.
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(NewRequest { ignore_eos: true, ..request(1, prompt(1, 3), 1) }).unwrap();
    h.run_until_idle(10);
    assert_eq!(h.finished[&RequestId(1)], FinishReason::Length);
    assert_eq!(h.sched.abort(RequestId(1), h.now), Err(AbortError::Unknown(RequestId(1))));
    assert_eq!(h.sched.poll_event(), None);
    // By hand: in-flight bookkeeping that lost a step, as a racing completion path would.
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(long(1, 3)).unwrap();
    h.sched.plan_step(h.now).unwrap();
    let entry = h.sched.by_id[&RequestId(1)];
    h.sched.entry_mut(entry).in_flight_steps = 0;
    assert!(violation(&h).contains("steps in flight"));
}
