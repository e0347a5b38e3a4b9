//! The engine of a prefill or decode worker: one task owning the worker's node (scheduler, pool
//! and protocol side, `core::node`), its executor through a `PageRunner`, and its end of the peer
//! transport. It runs the same step loop as a single process, and moves KV as one-sided writes:
//! the prefill side reads a computed page and sends it; the decode side lands it straight in the
//! executor's page store, whatever its state machine thinks, once it checked the write's lease
//! (a write whose transfer let go of the page is dropped and counted, as a revoked RDMA memory
//! key drops it), and acknowledges it either way.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::node::{DecodeNode, DecodeNodeOutput, PrefillNode, PrefillNodeOutput};
use lockstep_core::sched::{StepId, StepOutputs, StepPlan};
use lockstep_core::wire::{Endpoint, Envelope, Message, PageSlot, TransferId, TransferKey};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine::{EngineStats, PageRead, PageRunner, StepOrRead, StepResult};
use crate::metrics::{Metrics, observe};
use crate::peer::{PeerEvent, Transport};

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

    fn scheduler(&self) -> &lockstep_core::sched::Scheduler {
        match self {
            WorkerNode::Prefill(n) => n.scheduler(),
            WorkerNode::Decode(n) => n.scheduler(),
        }
    }
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
    /// Writes sent and not acknowledged: which ordinal of which transfer a page's ack completes.
    writes_out: BTreeMap<(TransferId, u32), (TransferKey, u32)>,
    check_invariants: bool,
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
            check_invariants,
            stats,
            metrics,
        }
    }

    /// Runs until the transport's event channel closes (the transport was dropped).
    pub async fn run(mut self) {
        loop {
            self.launch_ready();
            let timer = self.node.next_timeout().and_then(|t| self.instant_of(t));
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
                    Some(PeerEvent::Up { peer }) => tracing::info!(?peer, "peer up"),
                    Some(PeerEvent::Down { peer, reason }) => {
                        tracing::warn!(?peer, %reason, "peer down");
                        let now = self.now();
                        self.node.handle_peer_down(peer.worker, now);
                    }
                    None => return self.shut_down().await,
                },
                () = sleep_until_or_never(timer) => {
                    let now = self.now();
                    self.node.handle_timeout(now);
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
            self.launched.push_back((plan.step, Instant::now()));
            self.runner.launch(plan);
            self.after_input();
        }
    }

    fn on_step_done(&mut self, (step, result): StepResult) {
        let (launched, at) =
            self.launched.pop_front().expect("a step completes only once launched");
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
                let landed = allowed && self.runner.write_page(page.index, data).is_ok();
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
                if let Some((k, ordinal)) = self.writes_out.remove(&(key.transfer, page.index))
                    && k == key
                {
                    node.handle_write_completion(key, ordinal, landed, now);
                }
            }
            _ => self.node.handle_envelope(envelope, now),
        }
    }

    fn on_page_read(&mut self, (tag, result): PageRead) {
        let Some(w) = self.reads.remove(&tag) else { return };
        let now = self.now();
        let sent = result.map_err(|e| e.0).and_then(|data| {
            let bytes = data.len() as u64;
            let body = Message::KvWrite { key: w.key, page: w.page, first_token: w.position, data };
            let envelope = Envelope { from: self.transport.me(), to: w.to, body };
            self.transport.try_send(&envelope).map_err(|e| e.to_string())?;
            self.metrics.kv_bytes_sent.increment(bytes);
            Ok(())
        });
        match sent {
            Ok(()) => {
                self.writes_out.insert((w.key.transfer, w.page.index), (w.key, w.ordinal));
            }
            Err(why) => {
                tracing::debug!(transfer = w.key.transfer.0, %why, "a KV write was not sent");
                if let WorkerNode::Prefill(node) = &mut self.node {
                    node.handle_write_completion(w.key, w.ordinal, false, now);
                }
            }
        }
    }

    fn after_input(&mut self) {
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
        if self.check_invariants
            && let Err(e) = self.node.check_invariants()
        {
            panic!("worker: {e}");
        }
        let sched = self.node.scheduler();
        let pool = sched.pool();
        self.stats.set_requests_held(sched.requests_held());
        self.stats.set_pages_held(pool.held_count());
        self.stats.record_progress(sched.requests_held());
        self.metrics.requests_running.set(sched.slots_held() as f64);
        self.metrics.requests_waiting.set(sched.waiting_count() as f64);
        self.metrics
            .kv_cache_usage
            .set(f64::from(pool.held_count()) / f64::from(pool.pages_total()));
    }

    /// A message the transport cannot take now is lost, as on a lossy network: the protocol's
    /// timeouts and retries are what recover from it.
    fn send(&self, envelope: Envelope) {
        if let Err(e) = self.transport.try_send(&envelope) {
            self.metrics.peer_send_failures.increment(1);
            tracing::debug!(to = ?envelope.to, error = %e, "a peer message was not sent");
        }
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
