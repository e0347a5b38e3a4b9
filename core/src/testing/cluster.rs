//! A router, a prefill node and a decode node in memory, each with a provenance model, a network
//! that tests and fuzz targets may reorder, drop and delay, and a data plane whose one-sided
//! writes land when the caller says (at most a write flight after they were issued), checked
//! against the decode side's lease as the real data plane checks them. Invariants of every
//! machine are checked after every action; outputs the router passes on are recorded per request.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use crate::Time;
use crate::model::{Executor, PageStore, ProvenanceModel, TokenLogprobs};
use crate::node::{DecodeNode, DecodeNodeOutput, PrefillNode, PrefillNodeOutput};
use crate::pd::{DecodeConfig, PrefillConfig, Router, RouterConfig, RouterError, RouterOutput};
use crate::sched::{FinishReason, RequestId, SchedConfig};
use crate::wire::{
    AbortReason, Endpoint, Envelope, Incarnation, PageSlot, RequestSpec, Role, TransferKey,
    WorkerId,
};

use super::VOCAB_SIZE;

pub const ROUTER: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };
pub const PREFILL: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
pub const DECODE: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub prefill_sched: SchedConfig,
    pub decode_sched: SchedConfig,
    pub prefill: PrefillConfig,
    pub decode: DecodeConfig,
    pub router: RouterConfig,
}

impl ClusterConfig {
    /// Lease 40 ms, write flight 10 ms, transfer deadline 400 ms, both schedulers as given.
    pub fn new(sched: SchedConfig) -> ClusterConfig {
        ClusterConfig {
            prefill_sched: sched.clone(),
            decode_sched: sched.clone(),
            prefill: PrefillConfig {
                heartbeat_interval: Duration::from_millis(10),
                write_flight_max: Duration::from_millis(10),
                transfer_deadline: Duration::from_millis(400),
                done_retransmit: Duration::from_millis(20),
                transfers_max: 4,
            },
            decode: DecodeConfig {
                lease: Duration::from_millis(40),
                write_flight_max: Duration::from_millis(10),
                transfers_max: 4,
                prefix_cache: true,
                live_report_interval: Duration::from_millis(200),
            },
            router: RouterConfig {
                outcome_timeout: Duration::from_millis(500),
                requests_max: 16,
                retries_max: 2,
                decode_idle_timeout: Duration::from_millis(2_000),
                decode_slots: sched.running_max,
                prefill_slots: 4,
                queue_wait_max: Duration::from_millis(5_000),
                busy_backoff: Duration::from_millis(2),
            },
        }
    }
}

/// A one-sided write on its way.
#[derive(Clone, Debug)]
pub struct FlyingWrite {
    pub key: TransferKey,
    pub ordinal: u32,
    pub page: PageSlot,
    pub data: Vec<u8>,
    /// It lands or fails by then, at the latest.
    pub land_by: Time,
}

/// One action of a fault schedule: what a proptest strategy or a fuzz input drives the cluster
/// with. Indices pick among what is in flight, modulo its length.
#[derive(Clone, Debug)]
pub enum ClusterOp {
    /// A request with a prompt of `len` tokens, the first `shared` common to all requests.
    Submit {
        len: u8,
        shared: u8,
        max_tokens: u8,
    },
    Deliver(u8),
    Drop(u8),
    Duplicate(u8),
    Land(u8),
    FailWrite(u8),
    StepPrefill,
    StepDecode,
    /// A step that ran and whose outputs were lost: the node fails it (0: prefill, 1: decode).
    FailStep(u8),
    /// Moves the clock without firing any timer: a driver running late.
    Advance(u8),
    Abort(u8),
    /// Fires one machine's due timers, in whatever order the schedule says.
    RouterTimers,
    PrefillTimers,
    DecodeTimers,
    /// A link breaks and comes back at once (0: router–prefill, 1: router–decode, 2: prefill–
    /// decode): what was on its way over it is lost, and both ends hear that it went down.
    /// Writes already issued still land or fail within their flight.
    LinkDown(u8),
}

/// How a request ended at the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Finished(FinishReason),
    Failed(AbortReason),
}

#[derive(Debug)]
pub struct Cluster {
    pub now: Time,
    pub router: Router,
    pub prefill: PrefillNode,
    pub prefill_model: ProvenanceModel,
    pub decode: DecodeNode,
    pub decode_model: ProvenanceModel,
    pub network: VecDeque<Envelope>,
    pub writes: VecDeque<FlyingWrite>,
    write_flight: Duration,
    /// What the router passed on, per request, and how it ended.
    pub outputs: BTreeMap<RequestId, Vec<u32>>,
    /// The log-probabilities the router passed on with them, and its prompt's.
    pub logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    pub prompt_logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    pub ends: BTreeMap<RequestId, End>,
    specs: BTreeMap<RequestId, RequestSpec>,
    pub writes_late: u64,
}

impl Cluster {
    pub fn new(config: ClusterConfig) -> Cluster {
        let model = |c: &SchedConfig| ProvenanceModel::new(c.pool, c.running_max, VOCAB_SIZE);
        Cluster {
            now: Time::ZERO,
            router: Router::new(ROUTER, config.router, vec![PREFILL], vec![DECODE]),
            prefill_model: model(&config.prefill_sched),
            decode_model: model(&config.decode_sched),
            prefill: PrefillNode::new(PREFILL, config.prefill_sched, config.prefill.clone())
                .expect("valid prefill config"),
            decode: DecodeNode::new(DECODE, config.decode_sched, config.decode)
                .expect("valid decode config"),
            network: VecDeque::new(),
            writes: VecDeque::new(),
            write_flight: config.prefill.write_flight_max,
            outputs: BTreeMap::new(),
            logprobs: BTreeMap::new(),
            prompt_logprobs: BTreeMap::new(),
            ends: BTreeMap::new(),
            specs: BTreeMap::new(),
            writes_late: 0,
        }
    }

    pub fn submit(&mut self, request: RequestSpec) -> Result<(), RouterError> {
        let id = request.id;
        self.router.submit(request.clone(), self.now)?;
        self.outputs.insert(id, Vec::new());
        self.logprobs.insert(id, Vec::new());
        self.prompt_logprobs.insert(id, Vec::new());
        self.specs.insert(id, request);
        self.after_input();
        Ok(())
    }

    pub fn abort(&mut self, request: RequestId) -> bool {
        let ok = self.router.abort(request, self.now).is_ok();
        self.after_input();
        ok
    }

    /// Delivers the `i`th message on the network (0 is the oldest).
    pub fn deliver(&mut self, i: usize) {
        let Some(envelope) = self.network.remove(i) else { return };
        match envelope.to.worker {
            w if w == ROUTER.worker => self.router.handle_envelope(envelope, self.now),
            w if w == PREFILL.worker => self.prefill.handle_envelope(envelope, self.now),
            _ => self.decode.handle_envelope(envelope, self.now),
        }
        self.after_input();
    }

    pub fn drop_message(&mut self, i: usize) {
        self.network.remove(i);
    }

    /// Lands (or, with `fail`, loses) the `i`th write in flight. A write whose pages the decode
    /// side let go of is dropped on arrival and counted, as a revoked memory key drops an RDMA
    /// write; either way the prefill side hears the outcome.
    pub fn land_write(&mut self, i: usize, fail: bool) {
        let Some(w) = self.writes.remove(i) else { return };
        let landed = !fail && self.decode.write_allowed(w.key, w.page);
        if landed {
            self.release_freed();
            self.decode_model.write_page(w.page.index, &w.data).expect("a page-sized write");
        } else if !fail {
            self.writes_late += 1;
        }
        self.prefill.handle_write_completion(w.key, w.ordinal, landed, self.now);
        self.after_input();
    }

    /// Plans, executes and applies one prefill step; false if none could be planned.
    pub fn step_prefill(&mut self) -> bool {
        let Some(plan) = self.prefill.plan_step(self.now) else { return false };
        self.release_freed();
        let outputs = self.prefill_model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
        self.prefill.apply_outputs(&outputs, self.now).unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    /// Plans and executes one step on a node (`decode`, else the prefill node) whose outputs
    /// are then lost, as an executor failing after it ran (a device error, a lost readback):
    /// the node fails the step, and every request in it ends. False if none could be planned.
    pub fn fail_step(&mut self, decode: bool) -> bool {
        let plan =
            if decode { self.decode.plan_step(self.now) } else { self.prefill.plan_step(self.now) };
        let Some(plan) = plan else { return false };
        self.release_freed();
        let model = if decode { &mut self.decode_model } else { &mut self.prefill_model };
        model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
        let failed = if decode {
            self.decode.fail_step(plan.step, self.now)
        } else {
            self.prefill.fail_step(plan.step, self.now)
        };
        failed.unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    pub fn step_decode(&mut self) -> bool {
        let Some(plan) = self.decode.plan_step(self.now) else { return false };
        self.release_freed();
        let outputs = self.decode_model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
        self.decode.apply_outputs(&outputs, self.now).unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    /// Moves the clock and fires every machine's due timers, in the fixed order router, prefill,
    /// decode. Writes past their flight bound fail first: the transport guarantees the bound.
    /// A machine's timers fire only once its `next_timeout` says they are due, as the server's
    /// loops sleep until then: a timer that `next_timeout` forgets wedges here as it would there.
    /// (The schedules' `*Timers` actions fire them at any time, which must be harmless.)
    pub fn advance(&mut self, by: Duration) {
        self.now = self.now.saturating_add(by);
        while let Some(i) = self.writes.iter().position(|w| w.land_by <= self.now) {
            self.land_write(i, true);
        }
        let due = |next: Option<Time>, now: Time| next.is_some_and(|t| t <= now);
        // Once fired, nothing is due at the same instant: a driver would spin on it.
        let spin = "handled its timers and is due again at once";
        if due(self.router.next_timeout(), self.now) {
            self.router.handle_timeout(self.now);
            self.after_input();
            assert!(!due(self.router.next_timeout(), self.now), "the router {spin}");
        }
        if due(self.prefill.next_timeout(), self.now) {
            self.prefill.handle_timeout(self.now);
            self.after_input();
            assert!(!due(self.prefill.next_timeout(), self.now), "the prefill node {spin}");
        }
        if due(self.decode.next_timeout(), self.now) {
            self.decode.handle_timeout(self.now);
            self.after_input();
            assert!(!due(self.decode.next_timeout(), self.now), "the decode node {spin}");
        }
    }

    /// A fair turn without faults: every message delivered and every write landed, in order,
    /// until none is left; a step on each node; the clock 1 ms on.
    pub fn tick(&mut self) {
        while !self.network.is_empty() || !self.writes.is_empty() {
            while !self.network.is_empty() {
                self.deliver(0);
            }
            while !self.writes.is_empty() {
                self.land_write(0, false);
            }
        }
        self.step_prefill();
        self.step_decode();
        self.advance(Duration::from_millis(1));
    }

    /// Every request ended at the router, and nothing is in flight or held anywhere.
    pub fn is_quiet(&self) -> bool {
        self.ends.len() == self.outputs.len()
            && self.network.is_empty()
            && self.writes.is_empty()
            && self.prefill.side().transfers_live() == 0
            && self.decode.side().transfers_live() == 0
            && self.prefill.scheduler().requests_held() == 0
            && self.decode.scheduler().requests_held() == 0
    }

    /// Every message delivered and write landed in order, both nodes stepped, and the clock moved
    /// 1 ms, until every submitted request ended and the cluster is quiet; panics after
    /// `ticks_max` ticks: a wedge.
    pub fn run_until_done(&mut self, ticks_max: u32) {
        for _ in 0..ticks_max {
            if self.is_quiet() {
                return;
            }
            self.tick();
        }
        panic!(
            "not done after {ticks_max} ticks: {:?} of {:?} ended",
            self.ends,
            self.outputs.keys()
        );
    }

    /// Applies one action of a fault schedule.
    pub fn apply(&mut self, op: &ClusterOp) {
        let pick = |len: usize, i: u8| (len > 0).then(|| usize::from(i) % len);
        match *op {
            ClusterOp::Submit { len, shared, max_tokens } => {
                let id = self.outputs.len() as u64 + 1;
                let len = u32::from(len % 24) + 1;
                let shared = u32::from(shared) % (len + 1);
                let prompt = (0..len)
                    .map(
                        |i| if i < shared { 1 + i % 90 } else { 1 + (i * 7 + id as u32 * 13) % 90 },
                    )
                    .collect();
                let max_tokens = u32::from(max_tokens % 12) + 1;
                let _ = self.submit(super::request_spec(RequestId(id), prompt, max_tokens));
            }
            ClusterOp::Deliver(i) => {
                if let Some(i) = pick(self.network.len(), i) {
                    self.deliver(i)
                }
            }
            ClusterOp::Drop(i) => {
                if let Some(i) = pick(self.network.len(), i) {
                    self.drop_message(i)
                }
            }
            ClusterOp::Duplicate(i) => {
                if let Some(i) = pick(self.network.len(), i) {
                    self.network.push_back(self.network[i].clone());
                }
            }
            ClusterOp::Land(i) => {
                if let Some(i) = pick(self.writes.len(), i) {
                    self.land_write(i, false)
                }
            }
            ClusterOp::FailWrite(i) => {
                if let Some(i) = pick(self.writes.len(), i) {
                    self.land_write(i, true)
                }
            }
            ClusterOp::StepPrefill => {
                self.step_prefill();
            }
            ClusterOp::StepDecode => {
                self.step_decode();
            }
            ClusterOp::FailStep(which) => {
                self.fail_step(which % 2 == 1);
            }
            ClusterOp::Advance(ms) => {
                self.now = self.now.saturating_add(Duration::from_millis(u64::from(ms % 50)));
                // The transport's bound: a write lands or fails within its flight.
                while let Some(i) = self.writes.iter().position(|w| w.land_by <= self.now) {
                    self.land_write(i, true);
                }
            }
            ClusterOp::Abort(i) => {
                let live: Vec<RequestId> =
                    self.outputs.keys().filter(|r| !self.ends.contains_key(r)).copied().collect();
                if let Some(i) = pick(live.len(), i) {
                    self.abort(live[i]);
                }
            }
            ClusterOp::RouterTimers => {
                self.router.handle_timeout(self.now);
                self.after_input();
            }
            ClusterOp::PrefillTimers => {
                self.prefill.handle_timeout(self.now);
                self.after_input();
            }
            ClusterOp::DecodeTimers => {
                self.decode.handle_timeout(self.now);
                self.after_input();
            }
            ClusterOp::LinkDown(which) => {
                let (a, b) = [(ROUTER, PREFILL), (ROUTER, DECODE), (PREFILL, DECODE)]
                    [usize::from(which % 3)];
                self.network.retain(|e| {
                    !((e.from.worker == a.worker && e.to.worker == b.worker)
                        || (e.from.worker == b.worker && e.to.worker == a.worker))
                });
                for (end, other) in [(a, b), (b, a)] {
                    match end.worker {
                        w if w == ROUTER.worker => {
                            self.router.handle_worker_down(other.worker, self.now);
                            let role = if other == PREFILL { Role::Prefill } else { Role::Decode };
                            self.router.handle_worker_up(other, role, self.now);
                        }
                        w if w == PREFILL.worker => {
                            self.prefill.handle_peer_down(other.worker, self.now)
                        }
                        _ => self.decode.handle_peer_down(other.worker, self.now),
                    }
                    self.after_input();
                }
            }
        }
    }

    /// The oracles once the faults stop and everything ran to the end: every request ended; one
    /// that ran to its end passed on exactly its output alone, with the same log-probabilities
    /// bit for bit, one that failed or was cut short a prefix of both (never a token of another
    /// attempt or another request); no page, pin, slot or transfer is held, nor a freed page
    /// left unpoisoned.
    pub fn check_outcomes(&self, sched: &SchedConfig, specs: &BTreeMap<RequestId, RequestSpec>) {
        for (id, spec) in specs {
            let alone = super::run_alone_with_logprobs(
                sched,
                &super::request(id.0, spec.prompt.clone(), spec.max_tokens),
            );
            let (got, got_logprobs) = (&self.outputs[id], &self.logprobs[id]);
            let got_scores = &self.prompt_logprobs[id];
            match self.ends.get(id) {
                // Ran to its end: its whole output.
                Some(End::Finished(
                    FinishReason::Length
                    | FinishReason::ContextLength
                    | FinishReason::EndOfSequence(_)
                    | FinishReason::StopToken(_),
                )) => {
                    assert_eq!(got, &alone.tokens, "{id} finished with another output");
                    assert_eq!(got_logprobs, &alone.logprobs, "{id}: other log-probabilities");
                    assert_eq!(got_scores, &alone.prompt_logprobs, "{id}: other prompt scores");
                }
                // Cut short (a failed step, a decode worker that stopped): what came before.
                Some(End::Finished(_) | End::Failed(_)) => {
                    let alone_tokens = &alone.tokens;
                    assert!(
                        alone_tokens.starts_with(got),
                        "{id} passed on {got:?}, alone {alone_tokens:?}"
                    );
                    assert!(
                        alone.logprobs.starts_with(got_logprobs),
                        "{id} passed on log-probabilities that are not its own"
                    );
                    assert!(
                        got_scores.is_empty() || *got_scores == alone.prompt_logprobs,
                        "{id} passed on prompt scores that are not its own"
                    );
                }
                None => panic!("{id} never ended"),
            }
        }
        for (name, pool) in [
            ("prefill", self.prefill.scheduler().pool()),
            ("decode", self.decode.scheduler().pool()),
        ] {
            assert_eq!(pool.held_count(), 0, "{name}: a page is held at quiescence: {pool:?}");
            assert_eq!(pool.pins_live_count(), 0, "{name}: a pin is live at quiescence");
            assert_eq!(
                pool.freed_untaken_count(),
                0,
                "{name}: a freed page never went to its model to be poisoned"
            );
        }
        assert_eq!(self.prefill.side().transfers_live(), 0, "a prefill transfer is live");
        assert_eq!(self.decode.side().transfers_live(), 0, "a decode transfer is live");
        assert_eq!(self.decode.scheduler().requests_held(), 0, "the decode worker holds a request");
        assert_eq!(
            self.prefill.scheduler().requests_held(),
            0,
            "the prefill worker holds a request"
        );
    }

    /// The specs of every request submitted, for `check_outcomes`.
    pub fn submitted(&self) -> BTreeMap<RequestId, RequestSpec> {
        self.specs.clone()
    }

    pub fn check_invariants(&self) {
        self.router.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        self.prefill.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        self.decode.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Every machine's incremental check: it must pass wherever the full one does.
    pub fn check_invariants_incremental(&mut self) {
        let incremental = |r: Result<(), crate::InvariantViolation>| {
            r.unwrap_or_else(|e| panic!("incremental check: {e}"))
        };
        incremental(self.router.check_invariants_incremental());
        incremental(self.prefill.check_invariants_incremental());
        incremental(self.decode.check_invariants_incremental());
    }

    /// Hands each worker's freed pages to its model, which poisons them (in order with the
    /// steps and writes, as the engine loops do).
    fn release_freed(&mut self) {
        let mut freed = Vec::new();
        self.prefill.take_freed_pages(&mut freed);
        self.prefill_model.release_pages(&freed);
        freed.clear();
        self.decode.take_freed_pages(&mut freed);
        self.decode_model.release_pages(&freed);
    }

    fn after_input(&mut self) {
        self.release_freed();
        self.check_invariants_incremental();
        self.check_invariants();
        while let Some(output) = self.router.poll_output() {
            match output {
                RouterOutput::Send(envelope) => self.network.push_back(envelope),
                RouterOutput::Decoding { .. } => {}
                RouterOutput::Tokens { request, tokens, logprobs, prompt_logprobs } => {
                    let scores = self.prompt_logprobs.get_mut(&request).expect("submitted");
                    assert!(
                        prompt_logprobs.is_empty() || scores.is_empty(),
                        "{request}: its prompt's log-probabilities passed on twice"
                    );
                    scores.extend(prompt_logprobs);
                    assert!(!self.ends.contains_key(&request), "{request}: tokens after its end");
                    let asked = self.specs[&request].logprobs.is_some();
                    assert_eq!(
                        logprobs.len(),
                        if asked { tokens.len() } else { 0 },
                        "{request}: log-probabilities for {} of {} tokens (asked: {asked})",
                        logprobs.len(),
                        tokens.len()
                    );
                    self.outputs.get_mut(&request).expect("submitted").extend(tokens);
                    self.logprobs.get_mut(&request).expect("submitted").extend(logprobs);
                }
                RouterOutput::Finished { request, reason } => {
                    self.end(request, End::Finished(reason))
                }
                RouterOutput::Failed { request, reason } => self.end(request, End::Failed(reason)),
            }
        }
        while let Some(output) = self.prefill.poll_output() {
            match output {
                PrefillNodeOutput::Send(envelope) => self.network.push_back(envelope),
                PrefillNodeOutput::Start { request, spec } => {
                    self.prefill_model.start_request(request, spec)
                }
                PrefillNodeOutput::End { request } => self.prefill_model.end_request(request),
                PrefillNodeOutput::Write { key, ordinal, source, page, .. } => {
                    let mut data = Vec::new();
                    self.prefill_model.read_page(source.index(), &mut data).expect("a live page");
                    let land_by = self.now.saturating_add(self.write_flight);
                    self.writes.push_back(FlyingWrite { key, ordinal, page, data, land_by });
                }
            }
        }
        while let Some(output) = self.decode.poll_output() {
            match output {
                DecodeNodeOutput::Send(envelope) => self.network.push_back(envelope),
                DecodeNodeOutput::Start { request, spec } => {
                    self.decode_model.start_request(request, spec)
                }
                DecodeNodeOutput::End { request } => self.decode_model.end_request(request),
            }
        }
    }

    fn end(&mut self, request: RequestId, end: End) {
        let previous = self.ends.insert(request, end);
        assert_eq!(previous, None, "{request} ended twice");
    }
}
