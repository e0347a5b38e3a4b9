//! The prefill worker: computes each transfer's prompt as a one-token request of its scheduler,
//! keeps the prompt's pages until the protocol side has pinned them, and lets the driver write
//! them to the decode side.

use std::collections::{BTreeMap, VecDeque};

use super::{local_id, logprobs_by_request, new_request, sampling_spec};
use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::kv::PageRef;
use crate::model::{SamplingSpec, TokenLogprobs};
use crate::pd::{PrefillConfig, PrefillOutput, PrefillSide, Sampled};
use crate::sched::{
    ApplyError, NewRequest, RequestId, SchedConfig, SchedConfigError, SchedEvent, Scheduler,
    StepId, StepOutputs, StepPlan,
};
use crate::wire::{Endpoint, Envelope, PageSlot, TransferKey};

/// What the prefill node asks its driver to do. Drained with `poll_output` after every input.
#[derive(Clone, Debug, PartialEq)]
pub enum PrefillNodeOutput {
    Send(Envelope),
    /// Tell the executor how `request` samples, before the first plan naming it.
    Start {
        request: RequestId,
        spec: SamplingSpec,
    },
    /// The executor may forget `request` once the steps already launched have run.
    End {
        request: RequestId,
    },
    /// Read page `source` from the executor's store and write it one-sided into the decode
    /// side's `page`; report with `handle_write_completion(key, ordinal, ..)`.
    Write {
        key: TransferKey,
        to: Endpoint,
        ordinal: u32,
        source: PageRef,
        page: PageSlot,
        first_token: u32,
    },
}

#[derive(Clone, Debug)]
pub(super) struct Computation {
    key: TransferKey,
    first_token: Option<u32>,
    /// Its log-probabilities, when the request asked for them.
    first_logprobs: Option<TokenLogprobs>,
    /// The prompt's tokens' log-probabilities so far (from the second token on), when the
    /// request asked for them.
    prompt_logprobs: Vec<TokenLogprobs>,
    /// The most positions it ever had computed. A preempted prompt recomputes what it lost, and
    /// that is not progress: only passing this mark is (a worker thrashing between prompts that
    /// preempt each other must look stalled, or a transfer pinning pages would never time out).
    pub(super) computed_high: u32,
    /// Planted `EmptyHandOff` only (else always false): preempted while its last step was in
    /// flight, so the buggy hand-off takes its page list as that preemption left it.
    planted_preempted_in_last_step: bool,
}

#[derive(Clone, Debug)]
pub struct PrefillNode {
    pub(super) sched: Scheduler,
    side: PrefillSide,
    /// Prompts being computed, by the scheduler's id (`local_id`).
    pub(super) computing: BTreeMap<RequestId, Computation>,
    /// The step being applied's log-probabilities, by request, until its `Token` events take
    /// them (empty between inputs).
    step_logprobs: BTreeMap<RequestId, TokenLogprobs>,
    outputs: VecDeque<PrefillNodeOutput>,
}

impl PrefillNode {
    pub fn new(
        me: Endpoint,
        sched: SchedConfig,
        pd: PrefillConfig,
    ) -> Result<PrefillNode, SchedConfigError> {
        if sched.pool.pins_max < pd.transfers_max {
            return Err(SchedConfigError::new(format!(
                "pins_max {} is below transfers_max {}: a transfer pins its pages",
                sched.pool.pins_max, pd.transfers_max
            )));
        }
        Ok(PrefillNode {
            sched: Scheduler::new(sched)?,
            side: PrefillSide::new(me, pd),
            computing: BTreeMap::new(),
            step_logprobs: BTreeMap::new(),
            outputs: VecDeque::new(),
        })
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// See `Scheduler::take_freed_pages`: the transfer side frees into the same pool.
    pub fn take_freed_pages(&mut self, out: &mut Vec<u32>) {
        self.sched.take_freed_pages(out);
    }

    pub fn side(&self) -> &PrefillSide {
        &self.side
    }

    pub fn poll_output(&mut self) -> Option<PrefillNodeOutput> {
        self.outputs.pop_front()
    }

    pub fn handle_envelope(&mut self, envelope: Envelope, now: Time) {
        self.side.handle_envelope(envelope, self.sched.pool_mut(), now);
        self.after_input(now);
    }

    /// The link to a worker broke (the transport gave up on it): transfers to it end.
    pub fn handle_peer_down(&mut self, worker: crate::wire::WorkerId, now: Time) {
        self.side.handle_peer_down(worker, self.sched.pool_mut(), now);
        self.after_input(now);
    }

    /// A write issued earlier completed (`landed`) or failed.
    pub fn handle_write_completion(
        &mut self,
        key: TransferKey,
        ordinal: u32,
        landed: bool,
        now: Time,
    ) {
        self.side.handle_write_completion(key, ordinal, landed, self.sched.pool_mut(), now);
        self.after_input(now);
    }

    pub fn plan_step(&mut self, now: Time) -> Option<StepPlan> {
        let plan = self.sched.plan_step(now);
        self.after_input(now);
        plan
    }

    pub fn apply_outputs(&mut self, outputs: &StepOutputs, now: Time) -> Result<(), ApplyError> {
        logprobs_by_request(&self.sched, outputs, &mut self.step_logprobs);
        for scored in &outputs.prompt_logprobs {
            let Some(c) = self.computing.get_mut(&scored.request) else { continue };
            // A recomputed position's repeat is dropped; a gap never comes (a prompt is
            // computed in order), and would leave the scores short, which the decode side
            // passes on as they are.
            let next = c.prompt_logprobs.len() as u32 + 1;
            if let Some(fresh) = scored.from_position(next) {
                c.prompt_logprobs.extend_from_slice(fresh);
            }
        }
        let result = self.sched.apply_outputs(outputs, now);
        if result.is_ok() && self.passed_high_water_marks() {
            self.side.handle_compute_progress(now);
        }
        self.after_input(now);
        self.step_logprobs.clear();
        result
    }

    /// Whether some prompt has now more positions computed than ever before, raising the marks.
    /// A prompt the step finished counts too: its computed positions reached its length.
    fn passed_high_water_marks(&mut self) -> bool {
        let mut passed = false;
        for (&id, c) in self.computing.iter_mut() {
            match self.sched.computed_tokens(id) {
                Some(computed) if computed > c.computed_high => {
                    c.computed_high = computed;
                    passed = true;
                }
                Some(_) => {}
                // Ended in this step, which sampled its one token: the prompt is complete. (A
                // cancelled one is gone from `computing` before the next step is applied.)
                None => passed = true,
            }
        }
        passed
    }

    pub fn fail_step(&mut self, step: StepId, now: Time) -> Result<(), ApplyError> {
        let result = self.sched.fail_step(step, now);
        self.after_input(now);
        result
    }

    pub fn next_timeout(&self) -> Option<Time> {
        Time::earliest(self.side.next_timeout(), self.sched.next_timeout())
    }

    /// The protocol side's heartbeats, drains and deadlines first, then the scheduler's queue
    /// deadlines.
    pub fn handle_timeout(&mut self, now: Time) {
        self.side.handle_timeout(self.sched.pool_mut(), now);
        self.after_input(now);
        self.sched.handle_timeout(now);
        self.after_input(now);
    }

    fn after_input(&mut self, now: Time) {
        // Each side's outputs can feed the other (a cancel aborts a request; a request's end
        // completes a computation), so go round until both are quiet.
        loop {
            let pd = self.after_pd(now);
            let sched = self.after_sched(now);
            if !pd && !sched {
                break;
            }
        }
    }

    fn after_pd(&mut self, now: Time) -> bool {
        let mut any = false;
        while let Some(output) = self.side.poll_output() {
            any = true;
            match output {
                PrefillOutput::Send(envelope) => {
                    self.outputs.push_back(PrefillNodeOutput::Send(envelope))
                }
                PrefillOutput::Compute { key, request } => {
                    // One token: the first output token, sampled where the prompt's KV is. Stop
                    // conditions are the decode side's to apply.
                    let prompt = NewRequest {
                        max_tokens: 1,
                        stop_token_ids: Vec::new(),
                        ignore_eos: true,
                        ..new_request(key, &request)
                    };
                    let id = prompt.id;
                    match self.sched.submit_keeping_pages(prompt, now) {
                        Ok(()) => {
                            let mut spec = sampling_spec(&request);
                            if let Some(top) = request.prompt_logprobs {
                                // Every position computed here, whose logits score the prompt.
                                self.sched.skip_prefix_cache_reads(id);
                                spec = spec.scoring(&request.prompt, top);
                            }
                            self.outputs.push_back(PrefillNodeOutput::Start { request: id, spec });
                            self.computing.insert(
                                id,
                                Computation {
                                    key,
                                    first_token: None,
                                    first_logprobs: None,
                                    prompt_logprobs: Vec::new(),
                                    computed_high: 0,
                                    planted_preempted_in_last_step: false,
                                },
                            );
                        }
                        Err(_) => self.side.handle_compute_failed(key, self.sched.pool_mut(), now),
                    }
                }
                PrefillOutput::Cancel { key } => {
                    let id = local_id(key);
                    if self.computing.get(&id).is_some_and(|c| c.key == key) {
                        // Its pages come back through `PagesKept`, and are released there.
                        let _ = self.sched.abort(id, now);
                    }
                }
                PrefillOutput::Write { key, to, ordinal, source, page, first_token } => {
                    self.outputs.push_back(PrefillNodeOutput::Write {
                        key,
                        to,
                        ordinal,
                        source,
                        page,
                        first_token,
                    })
                }
                PrefillOutput::Ended { .. } => {}
            }
        }
        any
    }

    fn after_sched(&mut self, now: Time) -> bool {
        let mut any = false;
        while let Some(event) = self.sched.poll_event() {
            any = true;
            match event {
                SchedEvent::Token { request, token } => {
                    if let Some(c) = self.computing.get_mut(&request) {
                        c.first_token = Some(token);
                        c.first_logprobs = self.step_logprobs.remove(&request);
                    }
                }
                SchedEvent::Finished { request, .. } => {
                    self.outputs.push_back(PrefillNodeOutput::End { request })
                }
                SchedEvent::PagesKept { request } => self.hand_pages_over(request, now),
                SchedEvent::Preempted { request } => {
                    if crate::planted!(EmptyHandOff) {
                        // vllm#50297: a prompt preempted while its last step is in flight still
                        // finishes with that step, but the hand-off remembers the pages as the
                        // preemption left them (none).
                        let last_step_in_flight = self
                            .sched
                            .by_id
                            .get(&request)
                            .is_some_and(|&e| self.sched.entry(e).in_flight_samples > 0);
                        if let Some(c) = self.computing.get_mut(&request) {
                            c.planted_preempted_in_last_step |= last_step_in_flight;
                        }
                    }
                }
            }
        }
        any
    }

    /// The prompt's pages, kept by the scheduler: pinned by the transfer if its KV is complete
    /// and it still wants it, then let go of by the scheduler.
    fn hand_pages_over(&mut self, request: RequestId, now: Time) {
        let pages = self.sched.take_kept_pages(request).unwrap_or_default();
        if let Some(c) = self.computing.remove(&request) {
            let pool = self.sched.pool_mut();
            match c.first_token {
                Some(first_token) if self.side.is_computing(c.key) => {
                    let sampled = Sampled {
                        first_token,
                        first_logprobs: c.first_logprobs,
                        prompt_logprobs: c.prompt_logprobs,
                    };
                    if crate::planted!(EmptyHandOff) && c.planted_preempted_in_last_step {
                        // vllm#50297: the page list taken after the preemption released it.
                        self.side.handle_computed(c.key, sampled, &[], pool, now)
                    } else {
                        self.side.handle_computed(c.key, sampled, &pages, pool, now)
                    }
                }
                _ => self.side.handle_compute_failed(c.key, pool, now),
            }
        }
        for page in pages {
            self.sched.pool_mut().release(page).expect("kept pages are held");
        }
    }

    /// Each part's checks, then across them: the pool's pins are the transfers'; every prompt
    /// being computed is a request the scheduler holds, for a transfer that waits for it.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.sched.check_invariants()?;
        self.side.check_invariants(self.sched.pool())?;
        self.check_across()
    }

    /// The cheap check, for after every input: each part's incremental check
    /// (`Scheduler::check_invariants_incremental`, `PrefillSide::check_invariants_incremental`),
    /// then the same checks across them as `check_invariants`, which cost O(prompts being
    /// computed · log requests). Run the full check at quiescence and every so many inputs.
    pub fn check_invariants_incremental(&mut self) -> Result<(), InvariantViolation> {
        self.sched.check_invariants_incremental()?;
        self.side.check_invariants_incremental(self.sched.pool())?;
        self.check_across()
    }

    fn check_across(&self) -> Result<(), InvariantViolation> {
        const NODE: &str = "node-prefill";
        let pins = self.sched.pool().pins_live_count() as usize;
        ensure_invariant!(
            NODE,
            pins == self.side.pins_held(),
            "the pool holds {pins} pins, the transfers {}",
            self.side.pins_held()
        );
        for (&id, c) in &self.computing {
            ensure_invariant!(
                NODE,
                id == local_id(c.key),
                "computation {id} filed under another id"
            );
            let tokens = self.sched.request_tokens(id);
            ensure_invariant!(
                NODE,
                tokens.is_some(),
                "computation {id} has no request in the scheduler: its transfer would wait forever"
            );
            let tokens = tokens.map_or(0, <[u32]>::len);
            ensure_invariant!(
                NODE,
                c.computed_high as usize <= tokens,
                "computation {id} passed {} positions of {tokens}",
                c.computed_high
            );
        }
        Ok(())
    }
}
