//! Behaviour of the scheduler, driven through the single-worker harness.

use std::time::Duration;

use super::*;
use crate::Time;
use crate::model::Executor;
use crate::testing::{Harness, request, run_alone, small_config};

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1 + (seed * 31 + i * 7) % 90).collect()
}

fn assert_matches_alone(h: &Harness, reqs: &[NewRequest]) {
    for req in reqs {
        let alone = run_alone(h.sched.config(), req);
        assert_eq!(h.tokens[&req.id], alone, "{} differs from its output when run alone", req.id);
    }
}

#[test]
fn one_request_runs_to_max_tokens() {
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    let mut req = request(1, prompt(1, 5), 6);
    req.ignore_eos = true;
    h.submit(req).unwrap();
    h.run_until_idle(100);
    assert_eq!(h.tokens[&RequestId(1)].len(), 6);
    assert_eq!(h.finished[&RequestId(1)], FinishReason::Length);
    assert_eq!(h.sched.pool().held_count(), 0, "nothing leaks");
}

#[test]
fn crowd_equals_alone_in_both_modes_and_modes_agree() {
    let reqs: Vec<NewRequest> = (0..8)
        .map(|i| request(i, prompt(i as u32, 3 + (i as u32 * 5) % 13), 4 + i as u32 % 5))
        .collect();
    let mut outputs = Vec::new();
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let mut h = Harness::new(small_config(mode, 24));
        for req in &reqs {
            h.submit(req.clone()).unwrap();
        }
        h.run_until_idle(1_000);
        assert_eq!(h.finished.len(), reqs.len());
        assert_matches_alone(&h, &reqs);
        assert_eq!(h.sched.pool().held_count(), 0);
        outputs.push(h.tokens.clone());
    }
    assert_eq!(outputs[0], outputs[1], "sync and overlap modes must give the same tokens");
}

#[test]
fn long_prompts_are_chunked_and_only_the_last_chunk_samples() {
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    h.submit(request(1, prompt(2, 20), 2)).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let plan = h.sched.plan_step(h.now).unwrap();
        let row = &plan.rows[0];
        chunks.push((row.positions.clone(), row.sample));
        let out = h.model.execute(&plan).unwrap();
        h.sched.apply_outputs(&out, h.now).unwrap();
        h.sched.check_invariants().unwrap();
    }
    assert_eq!(chunks, vec![(0..8, false), (8..16, false), (16..20, true)]);
}

#[test]
fn decode_rows_come_before_prefill_and_admission_follows_order() {
    let mut h = Harness::new(small_config(StepMode::Sync, 64));
    h.submit(request(5, prompt(5, 3), 8)).unwrap();
    assert!(h.step());
    // Now 5 decodes. Submit three more; 9 has the best priority, 7 and 8 tie on priority and
    // arrival, so the lower id goes first.
    let mut low = request(9, prompt(9, 3), 4);
    low.priority = -1;
    h.submit(request(8, prompt(8, 3), 4)).unwrap();
    h.submit(request(7, prompt(7, 3), 4)).unwrap();
    h.submit(low).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    let order: Vec<u64> = plan.rows.iter().map(|r| r.request.0).collect();
    assert_eq!(order, vec![5, 9, 7, 8]);
    assert_eq!(plan.rows[0].positions.len(), 1, "the decode row is first");
}

#[test]
fn admission_refuses_with_a_reason() {
    let mut h = Harness::new(small_config(StepMode::Sync, 8));
    assert_eq!(h.submit(request(1, vec![], 4)), Err(AdmissionError::EmptyPrompt));
    assert_eq!(h.submit(request(1, vec![1], 0)), Err(AdmissionError::ZeroMaxTokens));
    assert_eq!(
        h.submit(request(1, prompt(1, 64), 1)),
        Err(AdmissionError::PromptTooLong { prompt_tokens: 64, request_tokens_max: 64 })
    );
    assert_eq!(
        h.submit(request(1, prompt(1, 30), 10)),
        Err(AdmissionError::NeverFits { pages_needed: 10, pages_total: 8 })
    );
    h.submit(request(1, prompt(1, 3), 2)).unwrap();
    assert_eq!(
        h.submit(request(1, prompt(1, 3), 2)),
        Err(AdmissionError::DuplicateId(RequestId(1)))
    );
    for id in 2..=8 {
        h.submit(request(id, prompt(1, 3), 2)).unwrap();
    }
    assert_eq!(
        h.submit(request(9, prompt(1, 3), 2)),
        Err(AdmissionError::QueueFull { waiting_max: 8 })
    );
    assert_eq!(h.sched.requests_held(), 8, "refusals leave no trace");
}

/// A refusal's text is what a client reads in its 400 (`http::respond`): it names the numbers
/// that made the request wrong.
#[test]
fn each_refusal_says_what_was_wrong_with_its_numbers() {
    let said = |e: AdmissionError| e.to_string();
    assert_eq!(said(AdmissionError::EmptyPrompt), "the prompt is empty");
    assert_eq!(said(AdmissionError::ZeroMaxTokens), "max_tokens is zero");
    assert_eq!(
        said(AdmissionError::PromptTooLong { prompt_tokens: 70, request_tokens_max: 64 }),
        "prompt of 70 tokens reaches the context length 64"
    );
    assert_eq!(
        said(AdmissionError::NeverFits { pages_needed: 10, pages_total: 8 }),
        "request needs 10 KV pages, the pool has 8"
    );
    assert_eq!(
        said(AdmissionError::TooManyStopTokens { count: 40, max: 32 }),
        "40 stop tokens, at most 32"
    );
    assert_eq!(
        said(AdmissionError::QueueFull { waiting_max: 8 }),
        "queue full (8 requests waiting)"
    );
    assert!(said(AdmissionError::NoSlot { running_max: 4 }).contains('4'));
    assert!(said(AdmissionError::DuplicateId(RequestId(3))).contains("req-3"));
}

#[test]
fn stop_tokens_eos_and_ignore_eos() {
    let config = small_config(StepMode::Sync, 64);
    let base = request(1, prompt(3, 4), 12);
    let mut free = base.clone();
    free.ignore_eos = true;
    let natural = run_alone(&config, &free);
    assert_eq!(natural.len(), 12);
    let stop_at = natural[3];
    let first = natural.iter().position(|&t| t == stop_at).unwrap();
    let mut with_stop = free.clone();
    with_stop.stop_token_ids = vec![stop_at];
    let mut h = Harness::new(config.clone());
    h.submit(with_stop).unwrap();
    h.run_until_idle(100);
    assert_eq!(h.tokens[&RequestId(1)], natural[..=first].to_vec());
    assert_eq!(h.finished[&RequestId(1)], FinishReason::StopToken(stop_at));

    // The same token as an end-of-sequence id ends it the same way, unless ignored.
    let mut h = Harness::new(SchedConfig { eos_token_ids: vec![stop_at], ..config });
    h.submit(base).unwrap();
    h.submit(NewRequest { id: RequestId(2), ..free }).unwrap();
    h.run_until_idle(100);
    assert_eq!(h.finished[&RequestId(1)], FinishReason::EndOfSequence(stop_at));
    assert_eq!(h.finished[&RequestId(2)], FinishReason::Length);
}

#[test]
fn context_length_ends_a_request() {
    let config = SchedConfig { request_tokens_max: 10, ..small_config(StepMode::Sync, 64) };
    let mut h = Harness::new(config);
    let mut req = request(1, prompt(4, 7), 50);
    req.ignore_eos = true;
    h.submit(req).unwrap();
    h.run_until_idle(100);
    assert_eq!(h.finished[&RequestId(1)], FinishReason::ContextLength);
    assert_eq!(h.tokens[&RequestId(1)].len(), 3);
}

#[test]
fn prefix_cache_skips_shared_full_pages_and_changes_nothing() {
    let mut h = Harness::new(small_config(StepMode::Sync, 64));
    let shared = prompt(6, 13);
    let first = request(1, shared.clone(), 3);
    h.submit(first.clone()).unwrap();
    h.run_until_idle(100);
    assert!(h.sched.pool().cached_count() >= 3);
    let mut second_prompt = shared.clone();
    second_prompt.extend([40, 41]);
    let second = request(2, second_prompt, 3);
    h.submit(second.clone()).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    assert_eq!(plan.rows[0].positions, 12..15, "three cached pages of four tokens are skipped");
    assert_eq!(plan.rows[0].page_table_from, 0);
    assert_eq!(plan.row_page_updates(&plan.rows[0]).len(), 4);
    let out = h.model.execute(&plan).unwrap();
    h.sched.apply_outputs(&out, h.now).unwrap();
    h.run_until_idle(100);
    assert_matches_alone(&h, &[first, second]);
}

#[test]
fn the_last_prompt_token_is_always_computed_even_when_every_page_is_cached() {
    let mut h = Harness::new(small_config(StepMode::Sync, 64));
    let exact = prompt(7, 8);
    h.submit(request(1, exact.clone(), 2)).unwrap();
    h.run_until_idle(100);
    h.submit(request(2, exact, 2)).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    assert_eq!(
        plan.rows[0].positions,
        4..8,
        "the page holding the last token is recomputed, not shared"
    );
}

#[test]
fn buckets_follow_capture_sizes() {
    let mut h = Harness::new(small_config(StepMode::Sync, 64));
    for id in 0..3 {
        h.submit(request(id, prompt(id as u32, 2), 8)).unwrap();
    }
    let plan = h.sched.plan_step(h.now).unwrap();
    assert_eq!(plan.bucket, Bucket::Eager, "prefill runs eagerly");
    let out = h.model.execute(&plan).unwrap();
    h.sched.apply_outputs(&out, h.now).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    assert_eq!(plan.rows.len(), 3);
    assert_eq!(plan.bucket, Bucket::Graph { padded_rows: 4 });
}

#[test]
fn preemption_takes_the_newest_and_outputs_still_match() {
    // 10 pages of 4 tokens; three requests that each grow to 4 pages cannot all fit.
    let mut config = small_config(StepMode::Sync, 10);
    config.prefix_cache = false;
    let reqs: Vec<NewRequest> = (1..=3)
        .map(|i| NewRequest { ignore_eos: true, ..request(i, prompt(i as u32, 6), 10) })
        .collect();
    let mut h = Harness::new(config);
    for req in &reqs {
        h.submit(req.clone()).unwrap();
        h.now = h.now.saturating_add(Duration::from_millis(1));
    }
    let mut first_preempted = None;
    for _ in 0..500 {
        h.step();
        while first_preempted.is_none() && h.preemptions > 0 {
            first_preempted = Some(());
            assert_eq!(
                h.sched.entry(h.sched.by_id[&RequestId(3)]).preemptions,
                1,
                "the newest goes first"
            );
        }
        if h.sched.requests_held() == 0 {
            break;
        }
    }
    assert!(h.preemptions > 0, "the pool was meant to run out");
    assert_matches_alone(&h, &reqs);
    assert_eq!(h.sched.pool().held_count(), 0);
}

#[test]
fn overlap_preemption_waits_for_pages_in_flight() {
    let mut config = small_config(StepMode::Overlap, 10);
    config.prefix_cache = false;
    let reqs: Vec<NewRequest> = (1..=4)
        .map(|i| NewRequest { ignore_eos: true, ..request(i, prompt(i as u32, 5), 12) })
        .collect();
    let mut h = Harness::new(config);
    for req in &reqs {
        h.submit(req.clone()).unwrap();
    }
    h.run_until_idle(2_000);
    assert!(h.preemptions > 0);
    assert_matches_alone(&h, &reqs);
}

#[test]
fn abort_in_every_phase_reports_once_and_frees_everything() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let mut h = Harness::new(small_config(mode, 32));
        for id in 1..=5 {
            h.submit(NewRequest { ignore_eos: true, ..request(id, prompt(id as u32, 9), 20) })
                .unwrap();
        }
        // Four run (running_max), one waits.
        h.step();
        assert!(h.abort(RequestId(5)), "waiting");
        h.step();
        assert!(h.abort(RequestId(1)), "running, maybe mid prefill, maybe in flight");
        assert!(!h.abort(RequestId(1)), "a second abort is refused");
        h.step();
        h.step();
        assert!(h.abort(RequestId(2)));
        h.run_until_idle(500);
        assert_eq!(h.finished[&RequestId(5)], FinishReason::Aborted);
        assert_eq!(h.finished[&RequestId(1)], FinishReason::Aborted);
        assert_eq!(h.finished[&RequestId(2)], FinishReason::Aborted);
        assert_eq!(h.sched.pool().held_count(), 0, "{mode:?}: pages leaked");
        assert!(!h.abort(RequestId(3)), "finished requests are gone");
    }
}

#[test]
fn queue_waits_are_bounded() {
    let mut config = small_config(StepMode::Sync, 32);
    config.running_max = 1;
    config.step_tokens_max = 4;
    config.queue_wait_max = Duration::from_millis(50);
    let mut h = Harness::new(config);
    h.submit(NewRequest { ignore_eos: true, ..request(1, prompt(1, 2), 40) }).unwrap();
    h.step();
    h.submit(request(2, prompt(2, 2), 4)).unwrap();
    assert_eq!(h.sched.next_timeout(), Some(h.now.saturating_add(Duration::from_millis(50))));
    h.advance(Duration::from_millis(49));
    assert!(!h.finished.contains_key(&RequestId(2)));
    h.advance(Duration::from_millis(1));
    assert_eq!(h.finished[&RequestId(2)], FinishReason::QueueTimeout);
    assert_eq!(h.sched.next_timeout(), None);
}

#[test]
fn outputs_for_the_wrong_step_or_count_are_refused() {
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    h.submit(request(1, prompt(1, 3), 5)).unwrap();
    assert_eq!(
        h.sched.apply_outputs(&StepOutputs::tokens(StepId(0), vec![]), h.now),
        Err(ApplyError::UnexpectedStep { got: StepId(0), expected: None })
    );
    let first = h.sched.plan_step(h.now).unwrap();
    let second = h.sched.plan_step(h.now).unwrap();
    assert!(h.sched.plan_step(h.now).is_none(), "two steps in flight at most");
    assert_eq!(
        h.sched.apply_outputs(&StepOutputs::tokens(second.step, vec![1]), h.now),
        Err(ApplyError::UnexpectedStep { got: second.step, expected: Some(first.step) })
    );
    assert_eq!(
        h.sched.apply_outputs(&StepOutputs::tokens(first.step, vec![]), h.now),
        Err(ApplyError::WrongTokenCount { step: first.step, expected: 1, got: 0 })
    );
    h.sched.check_invariants().unwrap();
    assert_eq!(second.input_tokens, vec![InputToken::FromStep { step: first.step, row: 0 }]);
}

#[test]
fn same_inputs_same_plans_bit_for_bit() {
    let run = || {
        let mut h = Harness::new(small_config(StepMode::Overlap, 12));
        let mut plans = Vec::new();
        for id in 0..6 {
            h.submit(request(id, prompt(id as u32, 4 + id as u32), 6)).unwrap();
        }
        for _ in 0..200 {
            if let Some(plan) = h.sched.plan_step(h.now) {
                let out = h.model.execute(&plan).unwrap();
                plans.push(plan);
                h.pending.push_back(out);
            } else if !h.apply_oldest() {
                break;
            }
            if h.pending.len() == 2 {
                h.apply_oldest();
            }
        }
        (plans, h.tokens)
    };
    assert_eq!(run(), run());
}

#[test]
fn time_is_only_an_argument() {
    // Submitting at another clock offset changes nothing but the times themselves.
    let outputs = |offset: u64| {
        let mut h = Harness::new(small_config(StepMode::Sync, 32));
        h.now = Time::from_millis(offset);
        for id in 0..3 {
            h.submit(request(id, prompt(id as u32, 5), 5)).unwrap();
        }
        h.run_until_idle(200);
        h.tokens
    };
    assert_eq!(outputs(0), outputs(123_456));
}

#[test]
fn a_request_preempted_while_its_last_token_is_in_flight_finishes_and_lets_go() {
    // Two pages: A needs a second page for step 1 while B's final token is still in flight in
    // step 0, so B is preempted while draining, then finishes when step 0 is applied.
    let mut config = small_config(StepMode::Overlap, 2);
    config.prefix_cache = false;
    let a = NewRequest { ignore_eos: true, ..request(1, prompt(1, 4), 4) };
    let b = NewRequest { ignore_eos: true, ..request(2, prompt(2, 4), 1) };
    let mut h = Harness::new(config);
    h.submit(a.clone()).unwrap();
    h.now = h.now.saturating_add(Duration::from_millis(1));
    h.submit(b.clone()).unwrap();
    h.run_until_idle(100);
    assert!(h.preemptions > 0, "the scenario needs B preempted");
    assert_eq!(h.finished[&RequestId(2)], FinishReason::Length);
    assert_matches_alone(&h, &[a, b]);
    assert_eq!(h.sched.pool().held_count(), 0);
}

#[test]
fn a_failed_step_ends_its_requests_frees_their_pages_and_others_go_on() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let mut h = Harness::new(small_config(mode, 32));
        h.submit(request(1, prompt(1, 5), 6)).unwrap();
        h.submit(request(2, prompt(2, 6), 6)).unwrap();
        let failed = h.sched.plan_step(h.now).unwrap();
        assert_eq!(failed.rows.len(), 2);
        h.model.execute(&failed).unwrap();
        // Overlap: a third request arrives and is admitted in the next step, already in flight
        // when the first step fails. It ignores EOS so that it ends by length whatever tokens
        // the model samples.
        h.submit(NewRequest { ignore_eos: true, ..request(3, prompt(3, 4), 3) }).unwrap();
        let next = match mode {
            StepMode::Overlap => {
                let next = h.sched.plan_step(h.now).unwrap();
                Some((h.model.execute(&next).unwrap(), next))
            }
            StepMode::Sync => None,
        };
        assert!(h.sched.fail_step(StepId(99), h.now).is_err(), "only the oldest step fails");
        h.sched.fail_step(failed.step, h.now).unwrap();
        h.sched.check_invariants().unwrap();
        let mut ended = Vec::new();
        while let Some(event) = h.sched.poll_event() {
            if let SchedEvent::Finished { request, reason, .. } = event {
                ended.push((request, reason));
            }
        }
        let reason = FinishReason::StepFailed;
        assert_eq!(ended, vec![(RequestId(1), reason), (RequestId(2), reason)], "{mode:?}");
        if let Some((outputs, _)) = next {
            h.sched.apply_outputs(&outputs, h.now).unwrap();
            h.sched.check_invariants().unwrap();
        }
        for id in [1, 2] {
            h.model.end_request(RequestId(id));
            h.finished.insert(RequestId(id), reason);
        }
        h.run_until_idle(100);
        assert_eq!(h.finished[&RequestId(3)], FinishReason::Length, "{mode:?}");
        assert_eq!(h.sched.pool().held_count(), 0, "{mode:?}: the failed requests' pages return");
        assert_eq!(h.sched.requests_held(), 0);
    }
}

#[test]
fn stop_tokens_are_bounded_as_the_wire_bounds_them() {
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    let max = crate::wire::STOP_TOKENS_MAX;
    let mut req = request(1, prompt(1, 3), 2);
    req.stop_token_ids = vec![5; max + 1];
    assert_eq!(
        h.submit(req.clone()),
        Err(AdmissionError::TooManyStopTokens { count: max + 1, max })
    );
    req.stop_token_ids.truncate(max);
    h.submit(req).unwrap();
}

/// A request whose prompt is scored computes every prompt position: its log-probabilities need
/// each position's logits, so it takes nothing from the prefix cache (a plain request with the
/// same prompt takes 12 of its 13 positions from there), and it still offers its pages.
#[test]
fn a_scored_prompt_reads_nothing_from_the_prefix_cache() {
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    let p = prompt(3, 13);
    h.submit(request(1, p.clone(), 2)).unwrap();
    h.run_until_idle(1_000);
    let (_, hit) = h.sched.prefix_cache_tokens();
    let spec = crate::model::SamplingSpec::for_prompt(crate::testing::sampling(RequestId(2)), &p);
    h.model.start_request(RequestId(2), spec.scoring(&p, 1));
    h.sched.submit_scoring(request(2, p.clone(), 2), h.now).unwrap();
    h.tokens.insert(RequestId(2), Vec::new());
    h.logprobs.insert(RequestId(2), Vec::new());
    h.run_until_idle(1_000);
    assert_eq!(h.sched.prefix_cache_tokens().1, hit, "the scored prompt read the cache");
    assert_eq!(h.tokens[&RequestId(2)], run_alone(h.sched.config(), &request(2, p.clone(), 2)));
    h.submit(request(3, p, 2)).unwrap();
    h.run_until_idle(1_000);
    assert_eq!(h.sched.prefix_cache_tokens().1, hit + 12, "a plain request reads the cache");
    // Every admission asked the cache about its whole prompt, the scored one too.
    assert_eq!(h.sched.prefix_cache_tokens().0, 3 * 13, "prompt tokens queried");
}

/// A step scores at most `scored_tokens_max` prompt positions (6 here, below a chunk of 8), all
/// scoring requests together: each such position's logits are kept until the step's scores are
/// taken. The prompts are still scored whole, and every output equals its run alone.
#[test]
fn a_step_scores_at_most_scored_tokens_max_positions() {
    let config = small_config(StepMode::Overlap, 64);
    assert!(config.scored_tokens_max < config.prefill_chunk_tokens_max);
    let mut h = Harness::new(config.clone());
    // 4 and 10 score their prompts (the harness's choice), 5 does not.
    let reqs: Vec<_> = [4, 10, 5].map(|id| request(id, prompt(id as u32, 20), 2)).into();
    for req in &reqs {
        h.submit(req.clone()).unwrap();
    }
    let (mut most, mut steps) = (0, h.steps);
    for _ in 0..1_000 {
        if !h.step() && h.sched.requests_held() == 0 {
            break;
        }
        if h.steps > steps {
            steps = h.steps;
            let outputs = h.pending.back().expect("the step just executed");
            let scored: usize = outputs.prompt_logprobs.iter().map(|s| s.logprobs.len()).sum();
            most = most.max(scored);
        }
    }
    assert_eq!(h.sched.requests_held(), 0);
    assert_eq!(most, config.scored_tokens_max as usize, "the bound is reached, never passed");
    assert_matches_alone(&h, &reqs);
    for scoring in &reqs[..2] {
        let alone = crate::testing::run_alone_with_logprobs(&config, scoring);
        assert_eq!(h.prompt_logprobs[&scoring.id], alone.prompt_logprobs);
        assert_eq!(h.prompt_logprobs[&scoring.id].len(), 19);
    }
}

/// A reader of prompt scores takes each position once: a repeat (a recomputed prompt) adds
/// nothing, an overlap adds its new part, a gap is refused.
#[test]
fn prompt_scores_are_taken_from_the_next_position_on() {
    let l = |token| crate::model::TokenLogprobs { token, logprob: -1.0, top: vec![] };
    let scored =
        PromptLogprobs { request: RequestId(1), from: 3, logprobs: vec![l(7), l(8), l(9)] };
    assert_eq!(scored.from_position(3), Some(&[l(7), l(8), l(9)][..]));
    assert_eq!(scored.from_position(4), Some(&[l(8), l(9)][..]));
    assert_eq!(scored.from_position(6), Some(&[][..]), "all seen");
    assert_eq!(scored.from_position(9), Some(&[][..]), "a repeat of earlier positions");
    assert_eq!(scored.from_position(2), None, "position 2 never came");
}

/// A prompt scored in a crowd that preempts it, in a pool its prompt alone fills (the scheduler
/// state machine's case at 4,000 cases): it resumes from the pages it computed itself (their
/// scores out already), so all finish. Reading nothing after a preemption, it and the others
/// restarted each other forever.
#[test]
fn a_scored_prompt_keeps_its_progress_through_preemptions() {
    // The state machine's requests: a family's shared prefix, then the request's own suffix.
    let spec = |id: u64, family: u32, shared: u32, suffix: u32, max_tokens: u32| {
        let shared = (0..shared).map(|i| 1 + (family * 13 + i * 7) % 90);
        let own = (0..suffix).map(|i| 1 + (id as u32 * 29 + i * 11) % 90);
        request(id, shared.chain(own).collect(), max_tokens)
    };
    let mut h = Harness::new(small_config(StepMode::Overlap, 6));
    // 16 scores its prompt (the harness's choice), of 21 tokens: six pages of four, all there are.
    let scored = spec(16, 0, 13, 8, 1);
    assert!(crate::testing::prompt_logprobs(scored.id).is_some());
    let reqs = [spec(0, 0, 0, 2, 5), scored.clone(), spec(22, 0, 2, 5, 3), spec(31, 1, 2, 3, 1)];
    h.submit(reqs[0].clone()).unwrap();
    h.submit(reqs[1].clone()).unwrap();
    for _ in 0..4 {
        h.step();
    }
    h.submit(reqs[2].clone()).unwrap();
    h.submit(reqs[3].clone()).unwrap();
    h.run_until_idle(2_000);
    assert_matches_alone(&h, &reqs);
    let alone = crate::testing::run_alone_with_logprobs(h.sched.config(), &scored);
    assert_eq!(h.prompt_logprobs[&scored.id], alone.prompt_logprobs);
    assert_eq!(h.prompt_logprobs[&scored.id].len(), 20);
}

/// Plans and executes one step, handing freed pages to the model first as the engine loops do,
/// and leaves its outputs pending; returns each row's request and positions, or `None` if no
/// step could be planned.
fn plan_and_execute(h: &mut Harness) -> Option<Vec<(RequestId, std::ops::Range<u32>)>> {
    let plan = h.sched.plan_step(h.now)?;
    let mut freed = Vec::new();
    h.sched.take_freed_pages(&mut freed);
    h.model.release_pages(&freed);
    h.pending.push_back(h.model.execute(&plan).unwrap());
    Some(plan.rows.iter().map(|row| (row.request, row.positions.clone())).collect())
}

/// Plans, executes and applies one step (sync); returns each row's request and positions.
fn step_rows(h: &mut Harness) -> Vec<(RequestId, std::ops::Range<u32>)> {
    let rows = plan_and_execute(h).expect("a step to plan");
    assert!(h.apply_oldest());
    h.sched.check_invariants().unwrap();
    rows
}

/// A scored prompt's last chunk takes its final position with it when its scored positions fill
/// the step's scoring budget exactly: 13 positions score 12 tokens, 6 a step, and sample at the
/// 13th, so two chunks (0..6, 6..13), not three.
#[test]
fn a_scored_chunk_that_fills_the_scoring_budget_exactly_takes_the_sampled_position_too() {
    let config = small_config(StepMode::Sync, 32);
    assert_eq!(config.scored_tokens_max, 6);
    let mut h = Harness::new(config);
    let scored = request(4, prompt(4, 13), 2);
    assert!(crate::testing::prompt_logprobs(scored.id).is_some(), "the harness scores it");
    h.submit(scored).unwrap();
    assert_eq!(step_rows(&mut h), vec![(RequestId(4), 0..6)]);
    assert_eq!(step_rows(&mut h), vec![(RequestId(4), 6..13)]);
}

/// A request preempted after its row was drafted gives the row's tokens back to the step: here
/// 2 prefills a long prompt, 3 decodes (with a row drafted, one token), 2 needs pages only 3's
/// preemption frees, and the admission after it gets a whole chunk, as if 3's row never was.
#[test]
fn a_row_cancelled_by_a_preemption_gives_its_tokens_back_to_the_step() {
    let config = small_config(StepMode::Sync, 12);
    assert_eq!((config.step_tokens_max, config.prefill_chunk_tokens_max), (16, 8));
    let mut h = Harness::new(config);
    let mut long = request(2, prompt(2, 40), 2);
    long.ignore_eos = true;
    let mut decoding = request(3, prompt(3, 17), 20);
    decoding.ignore_eos = true;
    h.submit(long).unwrap();
    h.submit(decoding).unwrap();
    for _ in 0..3 {
        step_rows(&mut h);
    }
    // 2 holds 6 pages (24 positions) and needs 2 more; 3 holds 5 and decodes; 1 page is free.
    assert_eq!(h.sched.pool().available_count(), 1);
    // Ahead of 3 in the waiting queue once 3 is preempted back into it.
    let mut urgent = request(5, prompt(5, 12), 2);
    urgent.priority = -1;
    h.submit(urgent).unwrap();
    assert_eq!(step_rows(&mut h), vec![(RequestId(2), 24..32), (RequestId(5), 0..8)]);
}

/// Runs the harness until nothing is held, planning as far ahead as its mode allows; returns
/// every row planned, in order, as its request and positions.
fn run_recording_rows(h: &mut Harness) -> Vec<(RequestId, std::ops::Range<u32>)> {
    let mut rows = Vec::new();
    let in_flight_max = h.sched.config().mode.steps_in_flight_max();
    for _ in 0..1_000 {
        match plan_and_execute(h) {
            Some(planned) => {
                rows.extend(planned);
                if h.pending.len() >= in_flight_max {
                    h.apply_oldest();
                }
            }
            None if h.apply_oldest() => {}
            None if h.sched.requests_held() == 0 => return rows,
            None => panic!("nothing to plan or apply, yet requests are held"),
        }
    }
    panic!("not idle after 1,000 steps");
}

/// With steps in flight, a request whose samples in flight will end it gets no further row: the
/// step after its last sample is planned without it, not with a row whose token is thrown away.
#[test]
fn a_request_whose_samples_in_flight_end_it_gets_no_further_row() {
    let mut h = Harness::new(small_config(StepMode::Overlap, 32));
    let mut req = request(1, prompt(1, 3), 3);
    req.ignore_eos = true;
    h.submit(req).unwrap();
    let rows = run_recording_rows(&mut h);
    let id = RequestId(1);
    assert_eq!(rows, vec![(id, 0..3), (id, 3..4), (id, 4..5)]);
    assert_eq!(h.finished[&id], FinishReason::Length);
}

/// Likewise at the context's end: the row that samples the last token the context holds is the
/// last, even with a step in flight and tokens left to generate.
#[test]
fn no_row_computes_a_position_past_the_context() {
    let config = small_config(StepMode::Overlap, 32);
    assert_eq!(config.request_tokens_max, 64);
    let mut h = Harness::new(config);
    let mut req = request(1, prompt(1, 60), 20);
    req.ignore_eos = true;
    h.submit(req).unwrap();
    let rows = run_recording_rows(&mut h);
    assert_eq!(rows.iter().map(|(_, p)| p.end).max(), Some(63), "{rows:?}");
    assert_eq!(h.finished[&RequestId(1)], FinishReason::ContextLength);
}

/// Preemption stops once the pages coming back suffice. With the first step in flight, 1's next
/// chunk needs 2 pages and none is free: 3 (last in order, 2 pages of its own, in that step) is
/// preempted, and its pages come back once the step is applied, which is enough. So 1 waits a
/// step and 2 keeps decoding, rather than 2 and then 1 itself being preempted too.
#[test]
fn preemption_stops_once_the_pages_coming_back_suffice() {
    let config = small_config(StepMode::Overlap, 5);
    let mut h = Harness::new(config.clone());
    let reqs: Vec<NewRequest> = [(1, 16), (2, 3), (3, 5)]
        .map(|(id, len)| NewRequest { ignore_eos: true, ..request(id, prompt(id as u32, len), 4) })
        .into();
    for req in &reqs {
        h.submit(req.clone()).unwrap();
    }
    let plan_rows = |h: &mut Harness| {
        let rows = plan_and_execute(h).expect("a step to plan");
        rows.into_iter().map(|(request, positions)| (request.0, positions)).collect::<Vec<_>>()
    };
    assert_eq!(plan_rows(&mut h), vec![(1, 0..8), (2, 0..3), (3, 0..5)]);
    assert_eq!(h.sched.pool().available_count(), 0);
    assert_eq!(plan_rows(&mut h), vec![(2, 3..4)], "1 waits for 3's pages; 2 decodes");
    assert_eq!(h.sched.preemptions_total(), 1);
    assert_eq!(h.sched.steps_in_flight(), 2);
    h.run_until_idle(1_000);
    assert_eq!(h.sched.steps_in_flight(), 0);
    assert_matches_alone(&h, &reqs);
}

/// Without a step in flight nothing comes back later: a victim's pages are free at once, and
/// preemption goes on until the requester has what it needs. 1's next chunk needs 2 pages; 3 (one
/// page) and then 2 (two) are preempted, and 1 computes in the same step.
#[test]
fn without_steps_in_flight_preemption_goes_on_until_the_pages_are_there() {
    let mut h = Harness::new(small_config(StepMode::Sync, 5));
    let reqs: Vec<NewRequest> = [(1, 16), (2, 5), (3, 3)]
        .map(|(id, len)| NewRequest { ignore_eos: true, ..request(id, prompt(id as u32, len), 4) })
        .into();
    for req in &reqs {
        h.submit(req.clone()).unwrap();
    }
    let first = vec![(RequestId(1), 0..8), (RequestId(2), 0..5), (RequestId(3), 0..3)];
    assert_eq!(step_rows(&mut h), first);
    assert_eq!(h.sched.pool().available_count(), 0);
    assert_eq!(step_rows(&mut h), vec![(RequestId(1), 8..16)], "1 computes at once");
    assert_eq!(h.sched.preemptions_total(), 2);
    h.run_until_idle(1_000);
    assert_matches_alone(&h, &reqs);
}

/// A page shared through the prefix cache does not come back when one of its holders lets go.
/// 2 and 3 share their first page (3 found 2's prompt in the cache); with the second step in
/// flight, 1's next chunk needs 2 pages and none is free. 3 is preempted, but only its own page
/// comes back, so 2 is preempted too: its own page and the shared one's last holder.
#[test]
fn a_page_shared_through_the_prefix_cache_is_not_counted_as_coming_back() {
    let mut h = Harness::new(small_config(StepMode::Overlap, 7));
    let long = NewRequest { ignore_eos: true, ..request(1, prompt(1, 24), 4) };
    let first = NewRequest { ignore_eos: true, ..request(2, prompt(2, 5), 4) };
    let mut shares = prompt(2, 4);
    shares.extend([50, 51]);
    let second = NewRequest { ignore_eos: true, ..request(3, shares, 4) };
    let id = RequestId;
    h.submit(long.clone()).unwrap();
    h.submit(first.clone()).unwrap();
    assert_eq!(plan_and_execute(&mut h), Some(vec![(id(1), 0..8), (id(2), 0..5)]));
    assert!(h.apply_oldest());
    h.submit(second.clone()).unwrap();
    let rows = plan_and_execute(&mut h);
    assert_eq!(rows, Some(vec![(id(2), 5..6), (id(1), 8..16), (id(3), 4..6)]), "3 shares a page");
    assert_eq!(h.sched.pool().available_count(), 0);
    assert_eq!(plan_and_execute(&mut h), None, "1 waits for the pages of 3 and 2");
    assert_eq!(h.sched.preemptions_total(), 2);
    h.run_until_idle(1_000);
    assert_matches_alone(&h, &[long, first, second]);
}

/// The executor resolves an overlap placeholder from what that step sampled at that row, a known
/// token as itself, and refuses a placeholder whose step is too old to be kept or whose row
/// sampled nothing. (Every executor resolves through this; the harness's reference output runs
/// through it too, so a resolver that answered 0 for everything passed every comparison.)
#[test]
fn recent_samples_resolve_placeholders_from_the_steps_they_name() {
    let mut recent = RecentSamples::default();
    assert_eq!(recent.resolve(InputToken::Known(42)), Ok(42));
    for step in 1..=4 {
        recent.record(StepId(step), vec![Some(10 * step as u32), None]);
    }
    let from = |step, row| InputToken::FromStep { step: StepId(step), row };
    assert_eq!(recent.resolve(from(1, 0)), Ok(10), "four steps are kept");
    assert_eq!(recent.resolve(from(4, 0)), Ok(40));
    assert!(recent.resolve(from(4, 1)).is_err(), "row 1 sampled nothing");
    assert!(recent.resolve(from(4, 2)).is_err(), "step 4 had two rows");
    recent.record(StepId(5), vec![Some(50)]);
    assert!(recent.resolve(from(1, 0)).is_err(), "the oldest step went");
    assert_eq!(recent.resolve(from(2, 0)), Ok(20));
}

/// A plan counts the rows it samples: here one prompt's first chunk (no sample yet) and two
/// whole prompts (sampled), so the executor returns two tokens.
#[test]
fn a_plan_counts_its_sampling_rows() {
    let mut h = Harness::new(small_config(StepMode::Sync, 32));
    h.submit(request(1, prompt(1, 20), 2)).unwrap();
    h.submit(request(2, prompt(2, 3), 2)).unwrap();
    h.submit(request(3, prompt(3, 4), 2)).unwrap();
    let plan = h.sched.plan_step(h.now).unwrap();
    assert_eq!(plan.rows.len(), 3);
    assert_eq!(plan.sampling_rows(), 2);
}

/// An operator's scheduler flags are refused, each with what was wrong, at the edge of every
/// bound, and accepted just inside it. (`SchedConfig::validate` answering `Ok` to everything
/// survived every test of core: only the server's flag tests came near it.)
#[test]
fn a_scheduler_config_is_refused_at_each_bound_with_what_was_wrong() {
    let good = small_config(StepMode::Sync, 32);
    assert_eq!(good.validate(), Ok(()));
    let refused = |change: &dyn Fn(&mut SchedConfig), what: &str| {
        let mut config = good.clone();
        change(&mut config);
        let e = config.validate().expect_err(what).to_string();
        assert!(e.starts_with("invalid scheduler config: ") && e.contains(what), "{e}");
    };
    let accepted = |change: &dyn Fn(&mut SchedConfig)| {
        let mut config = good.clone();
        change(&mut config);
        assert_eq!(config.validate(), Ok(()));
    };
    refused(&|c| c.running_max = 0, "must be positive");
    refused(&|c| c.waiting_max = 0, "must be positive");
    let over = SchedConfig::REQUESTS_MAX - 3;
    refused(&|c| c.waiting_max = over, "running_max + waiting_max is over");
    accepted(&|c| c.waiting_max = over - 1);
    refused(&|c| c.step_tokens_max = 3, "step_tokens_max 3 is below running_max 4");
    accepted(&|c| c.step_tokens_max = 4);
    refused(&|c| c.prefill_chunk_tokens_max = 0, "prefill_chunk_tokens_max");
    refused(&|c| c.scored_tokens_max = 0, "scored_tokens_max");
    refused(&|c| c.request_tokens_max = 1, "request_tokens_max 1 leaves no room");
    accepted(&|c| c.request_tokens_max = 2);
    refused(&|c| c.capture_sizes = vec![1, 4, 4], "strictly ascending");
    refused(&|c| c.capture_sizes = vec![0, 2], "must be positive");
    accepted(&|c| c.capture_sizes = vec![3]);
    refused(&|c| c.pool.page_tokens = 0, "page_tokens");
}
