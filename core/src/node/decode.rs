//! The decode worker: reserves a batch slot and pages for each transfer, hands the request to
//! its scheduler once the KV arrived whole, tells the router only then, and streams the
//! request's tokens to the router until it ends or the router cancels it.

use std::collections::{BTreeMap, VecDeque};

use super::{local_id, logprobs_by_request, new_request, sampling_spec};
use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::kv::PageRef;
use crate::model::{SamplingSpec, TokenLogprobs};
use crate::pd::{DecodeConfig, DecodeOutput, DecodeSide};
use crate::sched::{
    ApplyError, FinishReason, RequestId, SchedConfig, SchedConfigError, SchedEvent, Scheduler,
    StepId, StepOutputs, StepPlan,
};
use crate::wire::{AbortReason, Endpoint, Envelope, Message, PageSlot, TransferKey};

/// What the decode node asks its driver to do. Drained with `poll_output` after every input.
#[derive(Clone, Debug, PartialEq)]
pub enum DecodeNodeOutput {
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
}

/// A request whose tokens go to a router: reserved, or handed over and decoding.
#[derive(Clone, Debug)]
pub(super) struct Stream {
    pub(super) key: TransferKey,
    router: Endpoint,
    /// The router's id of the request.
    request: RequestId,
    /// Handed over to the scheduler (else only reserved).
    running: bool,
    /// Index of the next output token to send.
    next_index: u32,
    /// Tokens not sent yet, each with its log-probabilities if the request asked for them.
    pending: Vec<(u32, Option<TokenLogprobs>)>,
    /// The prompt's tokens' log-probabilities, from the hand-over until the first `Tokens`
    /// message takes them (if the request asked).
    prompt_logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
}

#[derive(Clone, Debug)]
pub struct DecodeNode {
    me: Endpoint,
    pub(super) sched: Scheduler,
    side: DecodeSide,
    /// By the scheduler's id (`local_id`).
    pub(super) streams: BTreeMap<RequestId, Stream>,
    /// The log-probabilities of the tokens being reported (a step's, or a hand-over's first
    /// token), by request, until their `Token` events take them (empty between inputs).
    token_logprobs: BTreeMap<RequestId, TokenLogprobs>,
    outputs: VecDeque<DecodeNodeOutput>,
}

impl DecodeNode {
    pub fn new(
        me: Endpoint,
        sched: SchedConfig,
        pd: DecodeConfig,
    ) -> Result<DecodeNode, SchedConfigError> {
        if sched.pool.pins_max < pd.transfers_max {
            return Err(SchedConfigError::new(format!(
                "pins_max {} is below transfers_max {}: a transfer pins its pages",
                sched.pool.pins_max, pd.transfers_max
            )));
        }
        Ok(DecodeNode {
            me,
            sched: Scheduler::new(sched)?,
            side: DecodeSide::new(me, pd),
            streams: BTreeMap::new(),
            token_logprobs: BTreeMap::new(),
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

    pub fn side(&self) -> &DecodeSide {
        &self.side
    }

    pub fn poll_output(&mut self) -> Option<DecodeNodeOutput> {
        self.outputs.pop_front()
    }

    /// See `DecodeSide::write_allowed`: the data plane's check before a one-sided write lands.
    pub fn write_allowed(&self, key: TransferKey, page: PageSlot) -> bool {
        self.side.write_allowed(key, page)
    }

    pub fn handle_envelope(&mut self, envelope: Envelope, now: Time) {
        if envelope.to != self.me {
            return;
        }
        match &envelope.body {
            Message::Reserve { key, request, .. } if !self.side.holds(key.transfer) => {
                let key = *key;
                let admitted = self.sched.reserve(new_request(key, request), now).is_ok();
                if admitted {
                    let router = envelope.from;
                    self.streams.insert(
                        local_id(key),
                        Stream {
                            key,
                            router,
                            request: request.id,
                            running: false,
                            next_index: 0,
                            pending: Vec::new(),
                            prompt_logprobs: Vec::new(),
                            finish: None,
                        },
                    );
                    self.side.handle_envelope(envelope, self.sched.pool_mut(), now);
                    if !self.side.holds(key.transfer) {
                        // Refused by the protocol side (no pages, a duplicate): no trace.
                        self.forget_reservation(key);
                    }
                } else {
                    self.side.refuse_reserve(envelope, self.sched.pool_mut(), now);
                }
            }
            Message::Cancel { key, .. } | Message::Abort { key, .. }
                if self
                    .streams
                    .get(&local_id(*key))
                    .is_some_and(|s| s.running && s.key == *key && s.router == envelope.from) =>
            {
                // After the hand-over the transfer is over; what ends now is the decoding.
                let id = local_id(*key);
                let _ = self.sched.abort(id, now);
                let is_abort = matches!(envelope.body, Message::Abort { .. });
                if is_abort {
                    self.side.handle_envelope(envelope, self.sched.pool_mut(), now);
                }
            }
            Message::Cancel { .. } => {}
            _ => self.side.handle_envelope(envelope, self.sched.pool_mut(), now),
        }
        self.after_input(now);
    }

    /// The link to a worker broke (the transport gave up on it). A prefill worker's transfers
    /// end; the requests a router was following stop, since their tokens have nowhere to go.
    pub fn handle_peer_down(&mut self, worker: crate::wire::WorkerId, now: Time) {
        self.side.handle_peer_down(worker);
        let orphans: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|(_, s)| s.running && s.router.worker == worker)
            .map(|(&id, _)| id)
            .collect();
        for id in orphans {
            let _ = self.sched.abort(id, now);
        }
        self.after_input(now);
    }

    pub fn plan_step(&mut self, now: Time) -> Option<StepPlan> {
        let plan = self.sched.plan_step(now);
        self.after_input(now);
        plan
    }

    pub fn apply_outputs(&mut self, outputs: &StepOutputs, now: Time) -> Result<(), ApplyError> {
        logprobs_by_request(&self.sched, outputs, &mut self.token_logprobs);
        let result = self.sched.apply_outputs(outputs, now);
        self.after_input(now);
        result
    }

    pub fn fail_step(&mut self, step: StepId, now: Time) -> Result<(), ApplyError> {
        let result = self.sched.fail_step(step, now);
        self.after_input(now);
        result
    }

    pub fn next_timeout(&self) -> Option<Time> {
        Time::earliest(self.side.next_timeout(), self.sched.next_timeout())
    }

    /// The protocol side's leases first, then the scheduler's queue deadlines.
    pub fn handle_timeout(&mut self, now: Time) {
        self.side.handle_timeout(self.sched.pool_mut(), now);
        self.after_pd(now);
        self.sched.handle_timeout(now);
        self.after_input(now);
    }

    fn after_input(&mut self, now: Time) {
        self.after_pd(now);
        self.after_sched();
        self.flush_streams();
        self.token_logprobs.clear();
    }

    fn after_pd(&mut self, now: Time) {
        while let Some(output) = self.side.poll_output() {
            match output {
                DecodeOutput::Send(envelope) => {
                    self.outputs.push_back(DecodeNodeOutput::Send(envelope))
                }
                DecodeOutput::Ready {
                    key,
                    router,
                    request,
                    pages,
                    cached_pages,
                    first_token,
                    first_logprobs,
                    prompt_logprobs,
                    ..
                } => {
                    if let Some(logprobs) = first_logprobs {
                        // For the hand-over's `Token` event of the first token.
                        self.token_logprobs.insert(local_id(key), logprobs);
                    }
                    if let Some(stream) = self.streams.get_mut(&local_id(key)) {
                        stream.prompt_logprobs = prompt_logprobs;
                    }
                    self.on_ready(key, router, &request, pages, cached_pages, first_token, now)
                }
                DecodeOutput::Ended { key, .. } => self.forget_reservation(key),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_ready(
        &mut self,
        key: TransferKey,
        router: Endpoint,
        request: &crate::wire::RequestSpec,
        pages: Vec<PageRef>,
        cached_pages: u32,
        first_token: u32,
        now: Time,
    ) {
        let id = local_id(key);
        let mut spec = sampling_spec(request);
        if crate::planted!(SamplerStateLostAtHandOver) {
            // The first output token (the prefill worker's) taken for the prompt's last.
            spec.prompt_tokens += 1;
        }
        if crate::planted!(GrammarLostAtHandOver) {
            spec.grammar = None;
        }
        self.outputs.push_back(DecodeNodeOutput::Start { request: id, spec });
        match self.sched.hand_over(id, pages.clone(), cached_pages, first_token, now) {
            Ok(()) => {
                if let Some(stream) = self.streams.get_mut(&id) {
                    stream.running = true;
                }
                self.send(router, Message::Outcome { key, failure: None });
            }
            Err(_) => {
                // The reservation is gone or the pages do not fit it: fail closed.
                for page in pages {
                    self.sched.pool_mut().release(page).expect("handed-over pages are held");
                }
                self.forget_reservation(key);
                self.outputs.push_back(DecodeNodeOutput::End { request: id });
                let failure = Some(AbortReason::DecodeFailed);
                self.send(router, Message::Outcome { key, failure });
            }
        }
    }

    fn forget_reservation(&mut self, key: TransferKey) {
        let id = local_id(key);
        if self.streams.get(&id).is_some_and(|s| s.key == key && !s.running) {
            self.streams.remove(&id);
            let _ = self.sched.cancel_reservation(id);
        }
    }

    fn after_sched(&mut self) {
        while let Some(event) = self.sched.poll_event() {
            match event {
                SchedEvent::Token { request, token } => {
                    if let Some(stream) = self.streams.get_mut(&request) {
                        stream.pending.push((token, self.token_logprobs.remove(&request)));
                    }
                }
                SchedEvent::Finished { request, reason, .. } => {
                    if let Some(stream) = self.streams.get_mut(&request) {
                        stream.finish = Some(reason);
                    }
                    self.outputs.push_back(DecodeNodeOutput::End { request });
                }
                SchedEvent::Preempted { .. } | SchedEvent::PagesKept { .. } => {}
            }
        }
    }

    /// One `Tokens` message per request with news, in id order.
    fn flush_streams(&mut self) {
        let mut ended = Vec::new();
        let mut messages = Vec::new();
        for (&id, stream) in &mut self.streams {
            if stream.pending.is_empty() && stream.finish.is_none() {
                continue;
            }
            let (tokens, logprobs): (Vec<u32>, Vec<Option<TokenLogprobs>>) =
                std::mem::take(&mut stream.pending).into_iter().unzip();
            // Every token has them when the request asked (the executor reports them for each
            // row it samples for such a request), none when it did not: a message carries all
            // or none.
            let logprobs = logprobs.into_iter().collect::<Option<Vec<_>>>().unwrap_or_default();
            let index = stream.next_index;
            stream.next_index += tokens.len() as u32;
            // They go with the first tokens; the codec refuses them past index 0.
            let prompt_logprobs = match index {
                0 => std::mem::take(&mut stream.prompt_logprobs),
                _ => Vec::new(),
            };
            messages.push((
                stream.router,
                Message::Tokens {
                    key: stream.key,
                    request: stream.request,
                    index,
                    tokens,
                    logprobs,
                    prompt_logprobs,
                    finish: stream.finish,
                },
            ));
            if stream.finish.is_some() {
                ended.push(id);
            }
        }
        for id in ended {
            self.streams.remove(&id);
        }
        for (to, body) in messages {
            self.send(to, body);
        }
    }

    fn send(&mut self, to: Endpoint, body: Message) {
        self.outputs.push_back(DecodeNodeOutput::Send(Envelope { from: self.me, to, body }));
    }

    /// Each part's checks, then across them: the pool's references are the requests' and the
    /// transfers', its pins the transfers'; every stream is a live request of the scheduler, and
    /// a reserved one a transfer the protocol side holds.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let transfer_refs: Vec<PageRef> = self.side.page_refs().collect();
        self.sched.check_invariants_sharing_pool(&transfer_refs)?;
        self.side.check_invariants(self.sched.pool())?;
        self.check_across()
    }

    /// The cheap check, for after every input: each part's incremental check (the scheduler's
    /// counting the transfers' references, `DecodeSide::check_invariants_incremental`), then the
    /// same checks across them as `check_invariants`, which cost O(streams · log requests): a
    /// stream is a request the steps work on, or one reserved. Run the full check at quiescence
    /// and every so many inputs.
    pub fn check_invariants_incremental(&mut self) -> Result<(), InvariantViolation> {
        let transfer_refs = self.side.page_refs_count();
        self.sched.check_invariants_incremental_sharing_pool(transfer_refs)?;
        self.side.check_invariants_incremental(self.sched.pool())?;
        self.check_across()
    }

    fn check_across(&self) -> Result<(), InvariantViolation> {
        const NODE: &str = "node-decode";
        let pins = self.sched.pool().pins_live_count() as usize;
        ensure_invariant!(
            NODE,
            pins == self.side.pins_held(),
            "the pool holds {pins} pins, the transfers {}",
            self.side.pins_held()
        );
        for (&id, stream) in &self.streams {
            ensure_invariant!(
                NODE,
                id == local_id(stream.key),
                "stream {id} filed under another id"
            );
            ensure_invariant!(
                NODE,
                self.sched.request_tokens(id).is_some() && stream.finish.is_none(),
                "stream {id} outlives its request"
            );
            ensure_invariant!(
                NODE,
                stream.running || self.side.holds(stream.key.transfer),
                "{id} is reserved for a transfer the protocol side does not hold"
            );
        }
        Ok(())
    }
}
