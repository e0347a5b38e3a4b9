//! A single-worker harness for tests and fuzz targets: a scheduler and a provenance model driven
//! step by step with a virtual clock, checking invariants after every input and recording each
//! request's tokens and its one terminal event. Compiled for tests and under feature `testing`.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use crate::Time;
use crate::kv::PoolConfig;
use crate::model::{Executor, Grammar, ProvenanceModel, SamplingSpec, TokenLogprobs};
use crate::sched::{
    AdmissionError, FinishReason, NewRequest, RequestId, SchedConfig, SchedEvent, Scheduler,
    StepMode, StepOutputs,
};
use crate::wire::{RequestSpec, Sampling};

mod cluster;

pub use cluster::{
    Cluster, ClusterConfig, ClusterOp, DECODE, End, FlyingWrite, PREFILL, ROUTER, Sent, Worker,
    decode_endpoint, prefill_endpoint,
};

pub const VOCAB_SIZE: u32 = 97;

/// A small configuration that exercises chunking, preemption and the cache.
pub fn small_config(mode: StepMode, pages_total: u32) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total, page_tokens: 4, pins_max: 16 },
        mode,
        waiting_max: 8,
        running_max: 4,
        step_tokens_max: 16,
        prefill_chunk_tokens_max: 8,
        // Below a chunk: a scored prompt's chunks are cut by it, and two share it.
        scored_tokens_max: 6,
        request_tokens_max: 64,
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: vec![0],
        queue_wait_max: Duration::from_secs(5),
        prefix_cache: true,
    }
}

pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt,
        max_tokens,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        priority: 0,
        cache_salt: 0,
    }
}

#[derive(Debug)]
pub struct Harness {
    pub sched: Scheduler,
    pub model: ProvenanceModel,
    pub now: Time,
    /// Executed steps whose outputs are not applied yet, oldest first.
    pub pending: VecDeque<StepOutputs>,
    pub tokens: BTreeMap<RequestId, Vec<u32>>,
    /// Each token's log-probabilities, for the requests that asked (`logprobs`).
    pub logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    /// Each prompt token's from the second on, each once, for the requests that asked
    /// (`prompt_logprobs`).
    pub prompt_logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    /// The step being applied's log-probabilities until its `Token` events take them: a row
    /// whose token is discarded (its request ended in an earlier step) reports none.
    step_logprobs: BTreeMap<RequestId, TokenLogprobs>,
    pub finished: BTreeMap<RequestId, FinishReason>,
    pub preemptions: u32,
    pub steps: u64,
}

impl Harness {
    pub fn new(config: SchedConfig) -> Harness {
        let model = ProvenanceModel::new(config.pool, config.running_max, VOCAB_SIZE);
        let sched = Scheduler::new(config).expect("harness config is valid");
        Harness {
            sched,
            model,
            now: Time::ZERO,
            pending: VecDeque::new(),
            tokens: BTreeMap::new(),
            logprobs: BTreeMap::new(),
            prompt_logprobs: BTreeMap::new(),
            step_logprobs: BTreeMap::new(),
            finished: BTreeMap::new(),
            preemptions: 0,
            steps: 0,
        }
    }

    pub fn submit(&mut self, req: NewRequest) -> Result<(), AdmissionError> {
        let (id, spec) = (req.id, SamplingSpec::for_prompt(sampling(req.id), &req.prompt));
        let scoring = prompt_logprobs(id).map(|top| (req.prompt.clone(), top));
        let result = match scoring {
            Some(_) => self.sched.submit_scoring(req, self.now),
            None => self.sched.submit(req, self.now),
        };
        if result.is_ok() {
            let spec = SamplingSpec {
                logit_bias: logit_bias(id),
                grammar: grammar(id),
                logprobs: logprobs(id),
                ..spec
            };
            let spec = match scoring {
                Some((prompt, top)) => spec.scoring(&prompt, top),
                None => spec,
            };
            self.prompt_logprobs.insert(id, Vec::new());
            self.model.start_request(id, spec);
            self.tokens.insert(id, Vec::new());
            self.logprobs.insert(id, Vec::new());
            self.finished.remove(&id);
        }
        self.after_input();
        result
    }

    pub fn abort(&mut self, id: RequestId) -> bool {
        let ok = self.sched.abort(id, self.now).is_ok();
        self.after_input();
        ok
    }

    /// Plans and executes a step if one can be planned, and applies the oldest executed step
    /// when no further step may be planned before it. Returns whether anything happened.
    pub fn step(&mut self) -> bool {
        self.now = self.now.saturating_add(Duration::from_millis(1));
        self.sched.handle_timeout(self.now);
        let planned = match self.sched.plan_step(self.now) {
            Some(plan) => {
                // Planning may free pages (preemption, eviction) and hand them to this plan:
                // their poison goes first, as the engine loops do it.
                self.release_freed();
                let outputs = self.model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
                self.pending.push_back(outputs);
                self.steps += 1;
                true
            }
            None => false,
        };
        self.after_input();
        let in_flight_max = self.sched.config().mode.steps_in_flight_max();
        let applied = if !planned || self.pending.len() >= in_flight_max {
            self.apply_oldest()
        } else {
            false
        };
        planned || applied
    }

    pub fn apply_oldest(&mut self) -> bool {
        let Some(outputs) = self.pending.pop_front() else { return false };
        for scored in &outputs.prompt_logprobs {
            let Some(so_far) = self.prompt_logprobs.get_mut(&scored.request) else { continue };
            // A preempted prompt scores again as it recomputes: the repeats are dropped.
            let fresh = scored.from_position(so_far.len() as u32 + 1);
            so_far.extend_from_slice(fresh.expect("a prompt is scored in order"));
        }
        if let Some(requests) = self.sched.step_sampling(outputs.step) {
            for (request, l) in requests.zip(&outputs.logprobs) {
                if let Some(l) = l {
                    self.step_logprobs.insert(request, l.clone());
                }
            }
        }
        self.sched.apply_outputs(&outputs, self.now).unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        self.step_logprobs.clear();
        true
    }

    /// Steps until nothing is held, or panics after `steps_max` steps: a wedge.
    pub fn run_until_idle(&mut self, steps_max: u64) {
        for _ in 0..steps_max {
            if !self.step() && self.sched.requests_held() == 0 {
                return;
            }
        }
        panic!("not idle after {steps_max} steps: {:?}", self.sched);
    }

    pub fn advance(&mut self, by: Duration) {
        self.now = self.now.saturating_add(by);
        self.sched.handle_timeout(self.now);
        self.after_input();
    }

    /// Hands the pages the pool freed to the model, which poisons them: a missing write then
    /// cannot hide behind the KV the last owner left.
    fn release_freed(&mut self) {
        let mut freed = Vec::new();
        self.sched.take_freed_pages(&mut freed);
        self.model.release_pages(&freed);
    }

    fn after_input(&mut self) {
        self.release_freed();
        // Both checks after every input: the incremental one must pass wherever the full one
        // does, whatever the inputs (it runs alone after most inputs in the simulator).
        if let Err(e) = self.sched.check_invariants_incremental() {
            panic!("incremental check: {e}");
        }
        if let Err(e) = self.sched.check_invariants() {
            panic!("{e}");
        }
        while let Some(event) = self.sched.poll_event() {
            match event {
                SchedEvent::Token { request, token } => {
                    assert!(
                        !self.finished.contains_key(&request),
                        "{request} got a token after it finished"
                    );
                    self.tokens
                        .get_mut(&request)
                        .expect("tokens only for submitted requests")
                        .push(token);
                    if let Some(l) = self.step_logprobs.remove(&request) {
                        self.logprobs.get_mut(&request).expect("submitted").push(l);
                    }
                }
                SchedEvent::Finished { request, reason, output_tokens } => {
                    // Every step naming it has executed: the harness executes at planning.
                    self.model.end_request(request);
                    let previous = self.finished.insert(request, reason);
                    assert_eq!(previous, None, "{request} finished twice");
                    assert_eq!(
                        self.tokens[&request].len() as u32,
                        output_tokens,
                        "{request} finished with a wrong count"
                    );
                }
                SchedEvent::Preempted { .. } => self.preemptions += 1,
                SchedEvent::PagesKept { request } => {
                    panic!("{request} kept its pages: the harness never asks for that")
                }
            }
        }
        // The count the metrics of every role read equals the events a single process sees.
        assert_eq!(
            self.sched.preemptions_total(),
            u64::from(self.preemptions),
            "preemptions counted apart from their events"
        );
    }
}

/// How the harnesses sample request `id`: greedy, and by `id`'s remainder by 3 with no penalty,
/// a presence penalty, or all three penalties, so that the output-so-far every executor keeps for
/// penalties (and the prompt's tokens the repetition penalty reads) is checked against the
/// request alone through preemption, overlap, prefix reuse and (`cluster`) the prefill-to-decode
/// hand-over.
pub fn sampling(id: RequestId) -> Sampling {
    let (presence_penalty, frequency_penalty, repetition_penalty) = match id.0 % 3 {
        0 => (0.0, 0.0, 1.0),
        1 => (2.0, 0.0, 1.0),
        _ => (-0.5, 1.25, 1.5),
    };
    Sampling { presence_penalty, frequency_penalty, repetition_penalty, ..Sampling::GREEDY }
}

/// Request `id`'s logit bias in the harnesses: on one request in four, a few tokens of the
/// vocabulary pushed up or down far enough to change greedy choices.
pub fn logit_bias(id: RequestId) -> Vec<(u32, f32)> {
    match id.0 % 4 {
        3 => vec![(5, 4.0), (17, -100.0), (40, 2.5), (u32::MAX, 1.0)],
        _ => Vec::new(),
    }
}

/// Request `id`'s grammar in the harnesses: on one request in five, one the provenance model's
/// synthetic compiler holds its draws to (a mask that follows the whole output).
pub fn grammar(id: RequestId) -> Option<Grammar> {
    (id.0 % 5 == 4).then_some(Grammar::JsonObject)
}

/// Request `id`'s log-probabilities in the harnesses: on three requests in seven, none, a few or
/// the most alternatives a request may ask for (which changes no draw).
pub fn logprobs(id: RequestId) -> Option<u8> {
    match id.0 % 7 {
        1 => Some(0),
        3 => Some(2),
        5 => Some(SamplingSpec::TOP_LOGPROBS_MAX),
        _ => None,
    }
}

/// Request `id`'s prompt log-probabilities in the harnesses: on one request in six, with two
/// alternatives (its scheduler then reads no cache for it).
pub fn prompt_logprobs(id: RequestId) -> Option<u8> {
    (id.0 % 6 == 4).then_some(2)
}

/// Request `id` as it travels between workers, sampled as the harnesses sample it (`sampling`,
/// `logit_bias`, `grammar`, `logprobs`, `prompt_logprobs`): `run_alone` of the same id and prompt
/// is its reference.
pub fn request_spec(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> RequestSpec {
    RequestSpec {
        sampling: sampling(id),
        logit_bias: logit_bias(id),
        grammar: grammar(id).map(Box::new),
        logprobs: logprobs(id),
        prompt_logprobs: prompt_logprobs(id),
        ..RequestSpec::new(id, prompt, max_tokens)
    }
}

/// A request's output when it runs alone in a fresh harness with the same config: the oracle.
pub fn run_alone(config: &SchedConfig, req: &NewRequest) -> Vec<u32> {
    run_alone_with_logprobs(config, req).tokens
}

/// A request's output alone: its tokens, and the log-probabilities it asks for, of each token
/// and of its prompt's (none when it does not ask).
#[derive(Clone, Debug, PartialEq)]
pub struct Alone {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// `run_alone`, with the log-probabilities.
pub fn run_alone_with_logprobs(config: &SchedConfig, req: &NewRequest) -> Alone {
    let mut alone = Harness::new(SchedConfig { prefix_cache: false, ..config.clone() });
    alone.submit(req.clone()).expect("the request is admissible alone");
    alone.run_until_idle(10_000);
    Alone {
        tokens: alone.tokens.remove(&req.id).unwrap_or_default(),
        logprobs: alone.logprobs.remove(&req.id).unwrap_or_default(),
        prompt_logprobs: alone.prompt_logprobs.remove(&req.id).unwrap_or_default(),
    }
}
