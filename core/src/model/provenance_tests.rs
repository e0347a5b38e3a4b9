//! The oracle's promise, shown directly: the same plans give the same tokens, and a request that
//! reads a page of another request, or a page of its own that was only partly written, samples
//! something else. (The proptest and fuzz suites rely on exactly this to catch scheduler bugs.)

use super::*;
use crate::Time;
use crate::kv::PageRef;
use crate::model::SamplingSpec;
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
    let mut model = started(ProvenanceModel::new(config.pool, config.running_max, VOCAB));
    let outputs = model.execute(&first).unwrap();
    sched.apply_outputs(&outputs, Time::ZERO).unwrap();
    let second = sched.plan_step(Time::ZERO).unwrap();
    assert!(second.rows.iter().all(|r| r.positions.len() == 1), "both decode");
    Run { sched, first, second }
}

fn model(run: &Run) -> ProvenanceModel {
    let config = run.sched.config();
    started(ProvenanceModel::new(config.pool, config.running_max, VOCAB))
}

/// The model with requests 1 and 2 started, greedy.
fn started(mut model: ProvenanceModel) -> ProvenanceModel {
    for id in [1, 2] {
        model.start_request(RequestId(id), SamplingSpec::GREEDY);
    }
    model
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

#[test]
fn a_sampling_row_of_a_request_never_started_is_an_error_not_greedy() {
    let run = two_steps();
    let config = run.sched.config();
    let mut m = ProvenanceModel::new(config.pool, config.running_max, VOCAB);
    m.start_request(RequestId(1), SamplingSpec::GREEDY);
    let err = m.execute(&run.first).unwrap_err();
    assert!(err.0.contains("never started"), "{err}");
}

#[test]
fn sampling_follows_the_seed_and_logprobs_come_when_asked() {
    let run = two_steps();
    let tokens = |seed: u64, logprobs: Option<u8>| {
        let config = run.sched.config();
        let mut m = ProvenanceModel::new(config.pool, config.running_max, 97);
        let sampling = crate::wire::Sampling { temperature: 1.5, top_p: 1.0, top_k: 0, seed };
        m.start_request(RequestId(1), SamplingSpec { sampling, logprobs });
        m.start_request(RequestId(2), SamplingSpec::GREEDY);
        let first = m.execute(&run.first).unwrap();
        let second = m.execute(&run.second).unwrap();
        (first.sampled, second.sampled, second.logprobs)
    };
    assert_eq!(tokens(5, None), tokens(5, None));
    let differs = (0..16).any(|seed| tokens(seed, None).0 != tokens(5, None).0);
    assert!(differs, "the seed chooses among the candidates");
    let (_, sampled, logprobs) = tokens(5, Some(3));
    let a = row_of(&run.second, 1);
    let l = logprobs[a].as_ref().expect("request 1 asked");
    assert_eq!((l.token, l.top.len()), (sampled[a], 3));
    assert!(l.logprob <= 0.0 && l.top.windows(2).all(|w| w[0].1 >= w[1].1));
    assert_eq!(logprobs[row_of(&run.second, 2)], None, "request 2 did not ask");
}
