//! proptest-state-machine: the scheduler against a small reference model, over sequences of up to
//! 500 operations (submit with shared prefixes, abort in any phase, steps, time passing), in both
//! step modes and with pools small enough to force preemption. After every operation: the
//! scheduler's invariants, every request's tokens a prefix of its output when run alone, one
//! terminal event per request. At the end: everything finishes, with its whole output when it
//! ended naturally, and no page leaks.
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::collections::BTreeMap;
use std::time::Duration;

use lockstep_core::sched::{
    AdmissionError, FinishReason, NewRequest, RequestId, SchedConfig, StepMode,
};
use lockstep_core::testing::{Alone, Harness, run_alone_with_logprobs, small_config};
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

#[derive(Clone, Debug)]
struct Spec {
    id: u64,
    family: u32,
    shared_len: u32,
    suffix_len: u32,
    max_tokens: u32,
    priority: i32,
    ignore_eos: bool,
}

impl Spec {
    fn request(&self) -> NewRequest {
        let shared = (0..self.shared_len).map(|i| 1 + (self.family * 13 + i * 7) % 90);
        let suffix = (0..self.suffix_len).map(|i| 1 + (self.id as u32 * 29 + i * 11) % 90);
        NewRequest {
            id: RequestId(self.id),
            prompt: shared.chain(suffix).collect(),
            max_tokens: self.max_tokens,
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            priority: self.priority,
            cache_salt: 0,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Submit(Spec),
    Abort(u64),
    Step,
    Advance(u64),
}

#[derive(Clone, Debug)]
struct Model {
    mode: StepMode,
    pages_total: u32,
    next_id: u64,
}

impl Model {
    fn config(&self) -> SchedConfig {
        small_config(self.mode, self.pages_total)
    }
}

struct SchedReference;

impl ReferenceStateMachine for SchedReference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (prop_oneof![Just(StepMode::Sync), Just(StepMode::Overlap)], 2..32u32)
            .prop_map(|(mode, pages_total)| Model { mode, pages_total, next_id: 0 })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        let id = state.next_id;
        let ids = state.next_id.max(1);
        let spec = (0..3u32, 0..14u32, 1..10u32, 1..12u32, -1..2i32, any::<bool>()).prop_map(
            move |(family, shared_len, suffix_len, max_tokens, priority, ignore_eos)| Spec {
                id,
                family,
                shared_len,
                suffix_len,
                max_tokens,
                priority,
                ignore_eos,
            },
        );
        prop_oneof![
            3 => spec.prop_map(Op::Submit),
            1 => (0..ids).prop_map(Op::Abort),
            8 => Just(Op::Step),
            1 => (1..3_000u64).prop_map(Op::Advance),
        ]
        .boxed()
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        if let Op::Submit(spec) = op {
            state.next_id = spec.id + 1;
        }
        state
    }
}

struct Sut {
    harness: Harness,
    expected: BTreeMap<RequestId, Alone>,
}

struct SchedTest;

impl StateMachineTest for SchedTest {
    type SystemUnderTest = Sut;
    type Reference = SchedReference;

    fn init_test(model: &Model) -> Sut {
        Sut { harness: Harness::new(model.config()), expected: BTreeMap::new() }
    }

    fn apply(mut sut: Sut, model: &Model, op: Op) -> Sut {
        match op {
            Op::Submit(spec) => {
                let req = spec.request();
                let config = model.config();
                let pages_needed = (req.prompt.len() as u32 + req.max_tokens - 1)
                    .min(config.request_tokens_max)
                    .div_ceil(config.pool.page_tokens);
                match sut.harness.submit(req.clone()) {
                    Ok(()) => {
                        assert!(
                            pages_needed <= config.pool.pages_total,
                            "admitted a request that can never fit"
                        );
                        sut.expected.insert(req.id, run_alone_with_logprobs(&config, &req));
                    }
                    Err(AdmissionError::NeverFits { .. }) => {
                        assert!(pages_needed > config.pool.pages_total)
                    }
                    Err(AdmissionError::QueueFull { .. }) => {
                        assert!(sut.harness.sched.waiting_count() >= config.waiting_max as usize)
                    }
                    // Ids are unique as generated; a shrunk case may repeat one, which is
                    // refused and changes nothing (the harness checked that).
                    Err(AdmissionError::DuplicateId(_)) => {}
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
            }
            Op::Abort(id) => {
                let id = RequestId(id);
                let live =
                    sut.expected.contains_key(&id) && !sut.harness.finished.contains_key(&id);
                assert_eq!(sut.harness.abort(id), live, "abort of {id}");
            }
            Op::Step => {
                sut.harness.step();
            }
            Op::Advance(ms) => sut.harness.advance(Duration::from_millis(ms)),
        }
        sut
    }

    fn check_invariants(sut: &Sut, _: &Model) {
        // The harness already checked the scheduler's invariants and the event stream.
        // The harness asks for log-probabilities on some requests, and for their prompts' on
        // some (read no cache; a preempted one scores its prompt again as it recomputes it):
        // held to the request alone's like the tokens.
        for (id, tokens) in &sut.harness.tokens {
            let alone = &sut.expected[id];
            let (logprobs, scores) = (&sut.harness.logprobs[id], &sut.harness.prompt_logprobs[id]);
            assert!(
                alone.tokens.starts_with(tokens),
                "{id}: {tokens:?} is not a prefix of its output alone {:?}",
                alone.tokens
            );
            assert!(alone.logprobs.starts_with(logprobs), "{id}: log-probabilities not its own");
            assert!(alone.prompt_logprobs.starts_with(scores), "{id}: prompt scores not its own");
            match sut.harness.finished.get(id) {
                Some(FinishReason::Aborted | FinishReason::QueueTimeout) | None => {}
                Some(reason) => {
                    assert_eq!(
                        tokens, &alone.tokens,
                        "{id} finished ({reason:?}) with another output than alone"
                    );
                    assert_eq!(logprobs, &alone.logprobs, "{id}: other log-probabilities");
                    assert_eq!(scores, &alone.prompt_logprobs, "{id}: other prompt scores");
                }
            }
        }
    }

    fn teardown(mut sut: Sut, _: Model) {
        sut.harness.run_until_idle(5_000);
        for id in sut.expected.keys() {
            assert!(sut.harness.finished.contains_key(id), "{id} never finished");
        }
        SchedTest::check_invariants(
            &sut,
            &Model { mode: StepMode::Sync, pages_total: 0, next_id: 0 },
        );
        assert_eq!(sut.harness.sched.pool().held_count(), 0, "pages leaked");
        assert_eq!(sut.harness.sched.slots_held(), 0, "slots leaked");
    }
}

prop_state_machine! {
    #![proptest_config(Config { max_shrink_iters: 4096, ..Config::default() })]
    #[test]
    fn scheduler_matches_its_model(sequential 1..500 => SchedTest);
}
