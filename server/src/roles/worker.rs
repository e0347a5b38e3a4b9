//! The engine of a prefill or decode worker: one task owning the worker's node (scheduler, pool
//! and protocol side, `core::node`), its executor through a `PageRunner`, and its end of the peer
//! transport. It runs the same step loop as a single process, and moves KV as one-sided writes:
//! the prefill side reads a computed page and sends it on the KV lane (its own connection,
//! unordered with the protocol's messages, as RDMA writes are with a TCP control channel); the
//! decode side lands it straight in the executor's page store, whatever its state machine
//! thinks, once it checked the write's lease (a write whose transfer let go of the page is
//! dropped and counted, as a revoked RDMA memory key drops it), and acknowledges it either way.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::node::{DecodeNode, DecodeNodeOutput, PrefillNode, PrefillNodeOutput};
use lockstep_core::sched::{StepId, StepOutputs, StepPlan};
use lockstep_core::wire::{Endpoint, Envelope, Message, PageSlot, TransferId, TransferKey};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine::{EngineStats, InvariantCadence, PageRead, PageRunner, StepOrRead, StepResult};
use crate::metrics::{Metrics, observe};
use crate::peer::{PeerEvent, SendError, Transport};

/// The node a worker runs.
#[derive(Debug)]
pub enum WorkerNode {
    Prefill(PrefillNode),
    Decode(DecodeNode),
}

/// What either node asks its driver to do.
enum Todo {
    Send(Envelope),
    Start(lockstep_core::sched::RequestId, lockstep_core::model::SamplingSpec),
    End(lockstep_core::sched::RequestId),
    Write {
        key: TransferKey,
        to: Endpoint,
        ordinal: u32,
        source: u32,
        page: PageSlot,
        position: u32,
    },
}

impl WorkerNode {
    fn plan_step(&mut self, now: Time) -> Option<StepPlan> {
        match self {
            WorkerNode::Prefill(n) => n.plan_step(now),
            WorkerNode::Decode(n) => n.plan_step(now),
        }
    }

    fn apply_outputs(&mut self, outputs: &StepOutputs, now: Time) -> Result<(), String> {
        match self {
            WorkerNode::Prefill(n) => n.apply_outputs(outputs, now),
            WorkerNode::Decode(n) => n.apply_outputs(outputs, now),
        }
        .map_err(|e| e.to_string())
    }

    fn fail_step(&mut self, step: StepId, now: Time) {
        let failed = match self {
            WorkerNode::Prefill(n) => n.fail_step(step, now),
            WorkerNode::Decode(n) => n.fail_step(step, now),
        };
        failed.expect("the oldest step in flight fails");
    }

    fn next_timeout(&self) -> Option<Time> {
        match self {
            WorkerNode::Prefill(n) => n.next_timeout(),
            WorkerNode::Decode(n) => n.next_timeout(),
        }
    }

    fn handle_timeout(&mut self, now: Time) {
        match self {
            WorkerNode::Prefill(n) => n.handle_timeout(now),
            WorkerNode::Decode(n) => n.handle_timeout(now),
        }
    }

    fn handle_peer_down(&mut self, worker: lockstep_core::wire::WorkerId, now: Time) {
        match self {
            WorkerNode::Prefill(n) => n.handle_peer_down(worker, now),
            WorkerNode::Decode(n) => n.handle_peer_down(worker, now),
        }
    }

    fn handle_envelope(&mut self, envelope: Envelope, now: Time) {
        match self {
            WorkerNode::Prefill(n) => n.handle_envelope(envelope, now),
            WorkerNode::Decode(n) => n.handle_envelope(envelope, now),
        }
    }

    fn poll(&mut self) -> Option<Todo> {
        match self {
            WorkerNode::Prefill(n) => n.poll_output().map(|o| match o {
                PrefillNodeOutput::Send(e) => Todo::Send(e),
                PrefillNodeOutput::Start { request, spec } => Todo::Start(request, spec),
                PrefillNodeOutput::End { request } => Todo::End(request),
                PrefillNodeOutput::Write { key, to, ordinal, source, page, first_token } => {
                    Todo::Write {
                        key,
                        to,
                        ordinal,
                        source: source.index(),
                        page,
                        position: first_token,
                    }
                }
            }),
            WorkerNode::Decode(n) => n.poll_output().map(|o| match o {
                DecodeNodeOutput::Send(e) => Todo::Send(e),
                DecodeNodeOutput::Start { request, spec } => Todo::Start(request, spec),
                DecodeNodeOutput::End { request } => Todo::End(request),
            }),
        }
    }

    fn check_invariants(&self) -> Result<(), lockstep_core::InvariantViolation> {
        match self {
            WorkerNode::Prefill(n) => n.check_invariants(),
            WorkerNode::Decode(n) => n.check_invariants(),
        }
    }

    fn check_invariants_incremental(&mut self) -> Result<(), lockstep_core::InvariantViolation> {
        match self {
            WorkerNode::Prefill(n) => n.check_invariants_incremental(),
            WorkerNode::Decode(n) => n.check_invariants_incremental(),
        }
    }

    /// Transfers the node's protocol side holds, and the pool pins they hold.
    fn transfers_and_pins(&self) -> (usize, usize) {
        match self {
            WorkerNode::Prefill(n) => (n.side().transfers_live(), n.side().pins_held()),
            WorkerNode::Decode(n) => (n.side().transfers_live(), n.side().pins_held()),
        }
    }

    fn take_freed_pages(&mut self, out: &mut Vec<u32>) {
        match self {
            WorkerNode::Prefill(n) => n.take_freed_pages(out),
            WorkerNode::Decode(n) => n.take_freed_pages(out),
        }
    }

    fn scheduler(&self) -> &lockstep_core::sched::Scheduler {
        match self {
            WorkerNode::Prefill(n) => n.scheduler(),
            WorkerNode::Decode(n) => n.scheduler(),
        }
    }
}

/// The `tracing` target of a decode worker's KV write events (`kv write arrived`, `kv write
/// landed`, with the transfer's id): what the simulator's timeline draws each transfer's writes
/// from.
pub const KV_WRITES: &str = "lockstep_server::roles::worker::kv_writes";

/// How long a message waits for room on a full link before it counts as lost: well under a
/// lease, so a heartbeat that waits still extends one.
const MESSAGE_WAIT_MAX: Duration = Duration::from_millis(100);

/// A KV write the link had no room for yet: sent as soon as it has, in issue order, or failed
/// once its flight bound has passed (the prefill side counts on every write issued landing or
/// failing within it).
struct HeldWrite {
    write: PendingWrite,
    envelope: Envelope,
    give_up_at: Time,
}

/// A write on its way: its ack completes `ordinal` of `key`.
#[derive(Clone, Copy)]
struct SentWrite {
    key: TransferKey,
    ordinal: u32,
    to: Endpoint,
}

/// A page read for a write, waiting for its bytes.
struct PendingWrite {
    key: TransferKey,
    to: Endpoint,
    ordinal: u32,
    page: PageSlot,
    position: u32,
}

pub struct WorkerEngine<R> {
    node: WorkerNode,
    runner: R,
    transport: Transport,
    events: mpsc::Receiver<PeerEvent>,
    steps_in_flight_max: usize,
    launched: VecDeque<(StepId, Instant)>,
    /// Reads issued for writes, by tag.
    reads: BTreeMap<u64, PendingWrite>,
    next_tag: u64,
    /// Writes sent and not acknowledged: which ordinal of which transfer a page's ack completes,
    /// and whom the write went to.
    writes_out: BTreeMap<(TransferId, u32), SentWrite>,
    /// Writes waiting for room on their KV lane: the data plane's back-pressure.
    held: VecDeque<HeldWrite>,
    /// Other messages waiting for room on their link (protocol messages, write acks), in order.
    held_messages: VecDeque<(Envelope, Time)>,
    /// Planted `DecodeReadsUnfinishedTransfer` only (always empty otherwise): KV writes
    /// acknowledged on arrival and not landed yet; they land once no step is running.
    unlanded: VecDeque<(TransferKey, u32, Vec<u8>)>,
    check_invariants: bool,
    cadence: InvariantCadence,
    stats: Arc<EngineStats>,
    metrics: Arc<Metrics>,
}

impl<R> std::fmt::Debug for WorkerEngine<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerEngine")
            .field("node", &self.node)
            .field("launched", &self.launched.len())
            .field("reads", &self.reads.len())
            .field("writes_out", &self.writes_out.len())
            .finish()
    }
}

impl<R: PageRunner> WorkerEngine<R> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node: WorkerNode,
        runner: R,
        transport: Transport,
        events: mpsc::Receiver<PeerEvent>,
        check_invariants: bool,
        stats: Arc<EngineStats>,
        metrics: Arc<Metrics>,
    ) -> WorkerEngine<R> {
        let steps_in_flight_max = node.scheduler().config().mode.steps_in_flight_max();
        WorkerEngine {
            node,
            runner,
            transport,
            events,
            steps_in_flight_max,
            launched: VecDeque::new(),
            reads: BTreeMap::new(),
            next_tag: 0,
            writes_out: BTreeMap::new(),
            held: VecDeque::new(),
            held_messages: VecDeque::new(),
            unlanded: VecDeque::new(),
            check_invariants,
            cadence: InvariantCadence::default(),
            stats,
            metrics,
        }
    }

    /// Runs until the transport's event channel closes (the transport was dropped).
    pub async fn run(mut self) {
        loop {
            self.launch_ready();
            let mut timer = self.node.next_timeout().and_then(|t| self.instant_of(t));
            if !self.held.is_empty() || !self.held_messages.is_empty() {
                // Held writes try again every millisecond: the link frees room as it writes.
                let retry = Instant::now() + Duration::from_millis(1);
                timer = Some(timer.map_or(retry, |t| t.min(retry)));
            }
            tokio::select! {
                biased;
                done = self.runner.step_or_read(), if !self.launched.is_empty() || !self.reads.is_empty() => {
                    match done {
                        StepOrRead::Step(result) => self.on_step_done(result),
                        StepOrRead::Read(read) => self.on_page_read(read),
                    }
                }
                event = self.events.recv() => match event {
                    Some(PeerEvent::Received(envelope)) => self.on_envelope(envelope),
                    Some(PeerEvent::Up { peer, .. }) => tracing::info!(?peer, "peer up"),
                    Some(PeerEvent::Down { peer, reason }) => {
                        tracing::warn!(?peer, %reason, "peer down");
                        let now = self.now();
                        self.node.handle_peer_down(peer.worker, now);
                    }
                    Some(PeerEvent::KvLaneDown { peer, reason }) => {
                        tracing::warn!(?peer, %reason, "KV lane down");
                        self.kv_lane_down(peer);
                    }
                    None => return self.shut_down().await,
                },
                () = sleep_until_or_never(timer) => {
                    let now = self.now();
                    self.node.handle_timeout(now);
                    self.send_held();
                }
            }
            self.after_input();
        }
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.stats.now_ns())
    }

    fn instant_of(&self, t: Time) -> Option<Instant> {
        self.stats.epoch().checked_add(Duration::from_nanos(t.as_nanos()))
    }

    fn launch_ready(&mut self) {
        while self.launched.len() < self.steps_in_flight_max {
            let now = self.now();
            let Some(plan) = self.node.plan_step(now) else { break };
            // Planning may have freed pages (a preemption, an eviction) and handed them to this
            // very plan: their poison goes first.
            self.release_freed();
            self.launched.push_back((plan.step, Instant::now()));
            self.runner.launch(plan);
            self.after_input();
        }
    }

    fn on_step_done(&mut self, (step, result): StepResult) {
        let (launched, at) =
            self.launched.pop_front().expect("a step completes only once launched");
        if self.launched.is_empty() {
            self.land_unlanded();
        }
        let now = self.now();
        self.metrics.steps.increment(1);
        observe(&self.metrics.step_seconds, at.elapsed());
        let applied = match result {
            Ok(outputs) if step == launched => self.node.apply_outputs(&outputs, now),
            Ok(_) => Err(format!("the runner reported {step:?} for {launched:?}")),
            Err(e) => Err(e.0),
        };
        if let Err(why) = applied {
            tracing::error!(step = launched.0, %why, "step failed");
            self.metrics.step_failures.increment(1);
            self.node.fail_step(launched, now);
        }
    }

    fn on_envelope(&mut self, envelope: Envelope) {
        let now = self.now();
        let from = envelope.from;
        match envelope.body {
            Message::KvWrite { key, page, data, .. } => {
                let WorkerNode::Decode(node) = &self.node else { return };
                // The lease check before landing: only into a page its transfer still holds.
                let allowed = node.write_allowed(key, page);
                let bytes = data.len() as u64;
                // Nothing was freed since the last input ended; releasing here anyway keeps the
                // rule local: every write to the executor comes after the releases before it.
                self.release_freed();
                tracing::debug!(target: KV_WRITES, transfer = key.transfer.0, "kv write arrived");
                let landed = if lockstep_core::planted!(DecodeReadsUnfinishedTransfer)
                    && allowed
                    && !self.launched.is_empty()
                {
                    // The incident (DeepSeek-V4 on SGLang, 1P1D, 80 agent sessions): the write
                    // is acknowledged on arrival but copied into the KV buffer only between
                    // steps, once none is running; `Done` follows the ack, and with overlap
                    // scheduling under load a step is always running, so decode reads the page
                    // before its bytes are there. At one request the device is idle: clean.
                    self.unlanded.push_back((key, page.index, data));
                    true
                } else {
                    let landed = allowed && self.runner.write_page(page.index, data).is_ok();
                    if landed {
                        tracing::debug!(target: KV_WRITES, transfer = key.transfer.0, "kv write landed");
                    }
                    landed
                };
                if landed {
                    self.metrics.kv_bytes_received.increment(bytes);
                } else {
                    self.metrics.kv_writes_dropped.increment(1);
                }
                let ack = Message::KvWriteAck { key, page, landed };
                self.send(Envelope { from: self.transport.me(), to: from, body: ack });
            }
            Message::KvWriteAck { key, page, landed } => {
                let WorkerNode::Prefill(node) = &mut self.node else { return };
                if let Some(sent) = self.writes_out.remove(&(key.transfer, page.index))
                    && sent.key == key
                {
                    node.handle_write_completion(key, sent.ordinal, landed, now);
                }
            }
            _ => self.node.handle_envelope(envelope, now),
        }
    }

    fn on_page_read(&mut self, (tag, result): PageRead) {
        let Some(w) = self.reads.remove(&tag) else { return };
        let data = match result {
            Ok(data) => data,
            Err(e) => return self.write_failed(&w, &e.0),
        };
        let body = Message::KvWrite { key: w.key, page: w.page, first_token: w.position, data };
        let envelope = Envelope { from: self.transport.me(), to: w.to, body };
        let flight = match &self.node {
            WorkerNode::Prefill(node) => node.side().config().write_flight_max,
            WorkerNode::Decode(_) => Duration::ZERO,
        };
        let give_up_at = self.now().saturating_add(flight);
        self.held.push_back(HeldWrite { write: w, envelope, give_up_at });
        self.send_held();
        if !self.held.is_empty() {
            self.metrics.kv_writes_held.increment(1);
        }
    }

    /// Sends held messages in order while their link has room, and held writes likewise (they
    /// travel on their own lane, so neither queue waits for the other); fails writes past their
    /// flight bound and drops messages past their wait.
    fn send_held(&mut self) {
        let now = self.now();
        while let Some((envelope, give_up_at)) = self.held_messages.front() {
            match self.transport.try_send(envelope) {
                Err(SendError::Full) if now < *give_up_at => break,
                Ok(()) => {
                    self.held_messages.pop_front();
                }
                Err(e) => {
                    let (envelope, _) = self.held_messages.pop_front().expect("looked at above");
                    self.lost(&envelope, &e);
                }
            }
        }
        while let Some(h) = self.held.front() {
            match self.transport.try_send(&h.envelope) {
                Err(SendError::Full) if now < h.give_up_at => return,
                sent => {
                    let h = self.held.pop_front().expect("looked at above");
                    match sent {
                        Ok(()) => {
                            if let Message::KvWrite { data, .. } = &h.envelope.body {
                                self.metrics.kv_bytes_sent.increment(data.len() as u64);
                            }
                            let w = h.write;
                            let sent = SentWrite { key: w.key, ordinal: w.ordinal, to: w.to };
                            self.writes_out.insert((w.key.transfer, w.page.index), sent);
                        }
                        Err(why) => self.write_failed(&h.write, &why.to_string()),
                    }
                }
            }
        }
    }

    /// The KV lane to `peer` ended: no ack will come for a write sent on it, so each fails now
    /// (its transfer drains, as for any failed write). One that did land is dropped by the decode
    /// side's lease check once the transfer lets go of its pages.
    fn kv_lane_down(&mut self, peer: Endpoint) {
        let now = self.now();
        let WorkerNode::Prefill(node) = &mut self.node else { return };
        let lost: Vec<(TransferId, u32)> =
            self.writes_out.iter().filter(|(_, sent)| sent.to == peer).map(|(at, _)| *at).collect();
        for at in lost {
            let sent = self.writes_out.remove(&at).expect("listed above");
            node.handle_write_completion(sent.key, sent.ordinal, false, now);
        }
    }

    fn write_failed(&mut self, w: &PendingWrite, why: &str) {
        tracing::debug!(transfer = w.key.transfer.0, %why, "a KV write was not sent");
        let now = self.now();
        if let WorkerNode::Prefill(node) = &mut self.node {
            node.handle_write_completion(w.key, w.ordinal, false, now);
        }
    }

    /// Planted `DecodeReadsUnfinishedTransfer`: the writes acknowledged while steps ran land now
    /// that none runs (nothing is ever queued otherwise).
    fn land_unlanded(&mut self) {
        while let Some((key, page, data)) = self.unlanded.pop_front() {
            self.release_freed();
            let _ = self.runner.write_page(page, data);
            tracing::debug!(target: KV_WRITES, transfer = key.transfer.0, "kv write landed");
        }
    }

    /// Hands the pages freed since the last call to the executor, to poison (see
    /// `Executor::release_pages`).
    ///
    /// Called at the end of every input (before its page reads are issued), between planning a
    /// step and launching it, and before landing a KV write: so before every call that may
    /// write KV (a launch, a landed write) and after every such call made before the free. A
    /// page freed and handed out again is then poisoned before its new owner's first write:
    /// whether it came back to this worker's own step or to a transfer's reservation, whose
    /// writes land in later inputs. And the poison lands after the steps launched before the
    /// free, which may still touch it for its old owner (the runner keeps call order).
    fn release_freed(&mut self) {
        let mut pages = Vec::new();
        self.node.take_freed_pages(&mut pages);
        if !pages.is_empty() {
            self.runner.release_pages(pages);
        }
    }

    fn after_input(&mut self) {
        self.release_freed();
        while let Some(todo) = self.node.poll() {
            match todo {
                Todo::Send(envelope) => self.send(envelope),
                Todo::Start(request, spec) => self.runner.start_request(request, spec),
                Todo::End(request) => self.runner.end_request(request),
                Todo::Write { key, to, ordinal, source, page, position } => {
                    let tag = self.next_tag;
                    self.next_tag += 1;
                    self.reads.insert(tag, PendingWrite { key, to, ordinal, page, position });
                    self.runner.read_page(tag, source);
                }
            }
        }
        if self.check_invariants {
            let holding_nothing = self.node.scheduler().requests_held() == 0
                && self.node.transfers_and_pins() == (0, 0);
            let checked = if self.cadence.full_check_now(holding_nothing) {
                self.node.check_invariants()
            } else {
                self.node.check_invariants_incremental()
            };
            if let Err(e) = checked {
                panic!("worker: {e}");
            }
        }
        let sched = self.node.scheduler();
        let pool = sched.pool();
        self.stats.set_requests_held(sched.requests_held());
        self.stats.set_pages_held(pool.held_count());
        let (transfers, pins) = self.node.transfers_and_pins();
        self.stats.set_transfers_held(transfers, pins);
        self.stats.record_progress(sched.requests_held());
        self.metrics.requests_running.set(sched.slots_held() as f64);
        self.metrics.requests_waiting.set(sched.waiting_count() as f64);
        self.metrics
            .kv_cache_usage
            .set(f64::from(pool.held_count()) / f64::from(pool.pages_total()));
        // A prefill worker's cache saves prompt compute and its preemptions recompute it; a
        // decode worker's cache saves transfers. Without these a worker's page showed zeros.
        let (queried, hit) = sched.prefix_cache_tokens();
        self.metrics.prefix_cache_queries.absolute(queried);
        self.metrics.prefix_cache_hits.absolute(hit);
        self.metrics.preemptions.absolute(sched.preemptions_total());
    }

    /// Sends a message other than a write; one that finds its link full waits, behind the held
    /// ones, for at most `MESSAGE_WAIT_MAX`. One the transport cannot take otherwise is lost, as
    /// on a lossy network: the protocol's timeouts and retries recover from it.
    fn send(&mut self, envelope: Envelope) {
        if self.held_messages.is_empty() {
            match self.transport.try_send(&envelope) {
                Ok(()) => return,
                Err(SendError::Full) => {}
                Err(e) => return self.lost(&envelope, &e),
            }
        }
        let give_up_at = self.now().saturating_add(MESSAGE_WAIT_MAX);
        self.held_messages.push_back((envelope, give_up_at));
    }

    fn lost(&self, envelope: &Envelope, e: &SendError) {
        self.metrics.peer_send_failures.increment(1);
        tracing::debug!(to = ?envelope.to, error = %e, "a peer message was not sent");
    }

    async fn shut_down(mut self) {
        // Steps in flight may still write their pages: wait for them before going.
        while !self.launched.is_empty() {
            let result = self.runner.completed().await;
            self.on_step_done(result);
        }
    }
}

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
