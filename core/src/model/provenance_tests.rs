//! The oracle's promise, shown directly: the same plans give the same tokens, and a request that
//! reads a page of another request, or a page of its own that was only partly written, samples
//! something else. (The proptest and fuzz suites rely on exactly this to catch scheduler bugs.)

use super::*;
use crate::Time;
use crate::kv::PageRef;
use crate::sched::{RequestId, Scheduler, StepMode};
use crate::testing::{request, small_config};

/// A vocabulary so large that two different KV histories sample the same token with odds of
/// 2^-32: a difference below is the model noticing, not luck.
const VOCAB: u32 = u32::MAX;

struct Run {
    sched: Scheduler,
    first: StepPlan,
    second: StepPlan,
}

/// A: six prompt tokens (two pages of four), B: three (one page, its last slot unwritten).
/// The first step prefills both, the second decodes both.
fn two_steps() -> Run {
    let config = small_config(StepMode::Sync, 16);
    let mut sched = Scheduler::new(config.clone()).unwrap();
    sched.submit(request(1, vec![11, 12, 13, 14, 15, 16], 4), Time::ZERO).unwrap();
    sched.submit(request(2, vec![21, 22, 23], 4), Time::ZERO).unwrap();
    let first = sched.plan_step(Time::ZERO).unwrap();
    assert_eq!(first.rows.len(), 2, "both prompts in one step");
    let mut model = ProvenanceModel::new(config.pool, config.running_max, VOCAB);
    let outputs = model.execute(&first).unwrap();
    sched.apply_outputs(&outputs, Time::ZERO).unwrap();
    let second = sched.plan_step(Time::ZERO).unwrap();
    assert!(second.rows.iter().all(|r| r.positions.len() == 1), "both decode");
    Run { sched, first, second }
}

fn model(run: &Run) -> ProvenanceModel {
    let config = run.sched.config();
    ProvenanceModel::new(config.pool, config.running_max, VOCAB)
}

fn row_of(plan: &StepPlan, id: u64) -> usize {
    plan.rows.iter().position(|r| r.request == RequestId(id)).unwrap()
}

/// A's token in the second step, after `first` and `second` as given.
fn a_second_token(run: &Run, first: &StepPlan, second: &StepPlan) -> u32 {
    let mut m = model(run);
    m.execute(first).unwrap();
    let outputs = m.execute(second).unwrap();
    let sampling_index = second.rows[..row_of(second, 1)].iter().filter(|r| r.sample).count();
    outputs.sampled[sampling_index]
}

#[test]
fn the_same_plans_give_the_same_tokens() {
    let run = two_steps();
    let honest = a_second_token(&run, &run.first, &run.second);
    assert_eq!(a_second_token(&run, &run.first, &run.second), honest);
}

#[test]
fn reading_another_requests_page_changes_the_output() {
    let run = two_steps();
    let honest = a_second_token(&run, &run.first, &run.second);
    // B's first page, from the first step's updates.
    let b = &run.first.rows[row_of(&run.first, 2)];
    let b_page: PageRef = run.first.page_updates[b.page_updates.start as usize];
    let a = &run.first.rows[row_of(&run.first, 1)];
    let a_second_page = run.first.page_updates[a.page_updates.start as usize + 1];
    // In the second step, A's table names B's page where its own first page was.
    let mut bad = run.second.clone();
    let at = bad.page_updates.len() as u32;
    bad.page_updates.extend([b_page, a_second_page]);
    let row = row_of(&bad, 1);
    bad.rows[row].page_table_from = 0;
    bad.rows[row].page_updates = at..at + 2;
    assert_ne!(a_second_token(&run, &run.first, &bad), honest);
}

#[test]
fn reading_a_partly_written_page_changes_the_output() {
    let run = two_steps();
    let honest = a_second_token(&run, &run.first, &run.second);
    // The first step writes only five of A's six prompt positions (as a transfer that has not
    // finished would leave them); the second step reads all six.
    let mut partial = run.first.clone();
    let row = row_of(&partial, 1);
    partial.rows[row].positions.end -= 1;
    partial.rows[row].inputs.end -= 1;
    assert_ne!(a_second_token(&run, &partial, &run.second), honest);
}
