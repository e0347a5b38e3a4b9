//! Arbitrary operation sequences on the scheduler, through the single-worker harness with the
//! provenance model: submits (admissible or not), aborts of any id, steps, time passing, and
//! outputs for the wrong step. No panic, invariants and one terminal event per request after
//! every operation (the harness checks both), every naturally finished request equal to its
//! output alone, and nothing held once idle.

#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::sched::{FinishReason, NewRequest, RequestId, StepId, StepMode, StepOutputs};
use lockstep_core::testing::{Harness, run_alone, small_config};

#[derive(Arbitrary, Debug)]
enum Op {
    Submit {
        id: u8,
        family: u8,
        shared: u8,
        suffix: u8,
        max_tokens: u8,
        priority: i8,
        ignore_eos: bool,
    },
    Abort(u8),
    Step,
    Advance(u16),
    BogusOutputs {
        step: u8,
        tokens: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    overlap: bool,
    pages_total: u8,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let mode = if input.overlap { StepMode::Overlap } else { StepMode::Sync };
    let config = small_config(mode, u32::from(input.pages_total % 40) + 1);
    let mut h = Harness::new(config.clone());
    let mut submitted: BTreeMap<RequestId, NewRequest> = BTreeMap::new();
    for op in input.ops.into_iter().take(500) {
        match op {
            Op::Submit { id, family, shared, suffix, max_tokens, priority, ignore_eos } => {
                let shared = (0..u32::from(shared % 20))
                    .map(|i| 1 + (u32::from(family % 3) * 13 + i * 7) % 90);
                let suffix =
                    (0..u32::from(suffix % 12)).map(|i| 1 + (u32::from(id) * 29 + i * 11) % 90);
                let req = NewRequest {
                    id: RequestId(u64::from(id)),
                    prompt: shared.chain(suffix).collect(),
                    max_tokens: u32::from(max_tokens % 16),
                    stop_token_ids: Vec::new(),
                    ignore_eos,
                    priority: i32::from(priority % 3),
                    cache_salt: 0,
                };
                if h.submit(req.clone()).is_ok() {
                    submitted.insert(req.id, req);
                }
            }
            Op::Abort(id) => {
                h.abort(RequestId(u64::from(id)));
            }
            Op::Step => {
                h.step();
            }
            Op::Advance(ms) => h.advance(Duration::from_millis(u64::from(ms))),
            Op::BogusOutputs { step, tokens } => {
                let bogus = StepOutputs {
                    step: StepId(u64::from(step) + 1_000),
                    sampled: vec![7; usize::from(tokens % 4)],
                    logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                };
                assert!(
                    h.sched.apply_outputs(&bogus, h.now).is_err(),
                    "outputs for an unknown step were accepted"
                );
                h.sched.check_invariants().expect("a refused input changes nothing");
            }
        }
    }
    h.run_until_idle(20_000);
    assert_eq!(h.sched.pool().held_count(), 0, "pages leaked");
    for (id, req) in &submitted {
        match h.finished.get(id) {
            Some(FinishReason::Aborted | FinishReason::QueueTimeout) => {}
            Some(_) => assert_eq!(
                h.tokens[id],
                run_alone(&config, req),
                "{id} differs from its output alone"
            ),
            None => panic!("{id} never finished"),
        }
    }
});
