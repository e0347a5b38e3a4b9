//! A router with one or more prefill and decode nodes in memory, each node with a provenance model,
//! a network that tests and fuzz targets may reorder, drop and delay, and a data plane whose
//! one-sided writes land when the caller says (at most a write flight after they were issued),
//! checked against the decode side's lease as the real data plane checks them. Workers and the
//! router may restart, as a new incarnation with nothing of the old one's state. Invariants of
//! every machine are checked after every action; outputs the router passes on are recorded per
//! request, and the messages that tell a retry or a failure per machine (`Sent`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::Time;
use crate::kv::PageRef;
use crate::model::{Executor, PageStore, ProvenanceModel, TokenLogprobs};
use crate::node::{DecodeNode, DecodeNodeOutput, PrefillNode, PrefillNodeOutput};
use crate::pd::{DecodeConfig, PrefillConfig, Router, RouterConfig, RouterError, RouterOutput};
use crate::sched::{FinishReason, RequestId, SchedConfig};
use crate::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Incarnation, Message, PageSlot, RequestSpec, Role,
    TransferId, TransferKey, WorkerId,
};

use super::VOCAB_SIZE;

pub const ROUTER: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };
/// The first prefill and decode workers' first lives (every cluster has them).
pub const PREFILL: Endpoint = prefill_endpoint(0);
pub const DECODE: Endpoint = decode_endpoint(0);

/// Prefill worker `i`'s first life. Prefill workers have the odd ids and decode workers the even
/// ones, so the first of each keeps its id however many workers a cluster has.
pub const fn prefill_endpoint(i: u32) -> Endpoint {
    Endpoint { worker: WorkerId(1 + 2 * i), incarnation: Incarnation(1) }
}

/// Decode worker `i`'s first life (see `prefill_endpoint`).
pub const fn decode_endpoint(i: u32) -> Endpoint {
    Endpoint { worker: WorkerId(2 + 2 * i), incarnation: Incarnation(1) }
}

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub prefill_sched: SchedConfig,
    pub decode_sched: SchedConfig,
    pub prefill: PrefillConfig,
    pub decode: DecodeConfig,
    pub router: RouterConfig,
    /// How many workers of each role: at least one.
    pub prefill_workers: u32,
    pub decode_workers: u32,
}

impl ClusterConfig {
    /// One prefill and one decode worker; lease 40 ms, write flight 10 ms, transfer deadline
    /// 400 ms, both schedulers as given.
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
            prefill_workers: 1,
            decode_workers: 1,
        }
    }
}

/// A one-sided write on its way.
#[derive(Clone, Debug)]
pub struct FlyingWrite {
    /// The prefill worker's life that issued it: it hears the outcome, if it still lives.
    pub from: Endpoint,
    /// The decode worker's life it is aimed at: a restarted one has none of its pages.
    pub to: Endpoint,
    pub key: TransferKey,
    pub ordinal: u32,
    pub page: PageSlot,
    pub data: Vec<u8>,
    /// It lands or fails by then, at the latest.
    pub land_by: Time,
}

/// One action of a fault schedule: what a proptest strategy or a fuzz input drives the cluster
/// with. Indices pick among what is in flight, or among the workers, modulo its length.
#[derive(Clone, Debug)]
pub enum ClusterOp {
    /// A request with a prompt of `len` tokens, the first `shared` common to all requests.
    Submit {
        len: u8,
        shared: u8,
        max_tokens: u8,
    },
    /// Delivers any message in flight: one overtaking another on its link is a reordering,
    /// which TCP never does but a fault schedule may.
    Deliver(u8),
    /// Delivers the oldest message on one of the links with messages in flight, as a transport
    /// in order per link does (links still interleave as they like).
    DeliverInOrder(u8),
    Drop(u8),
    Duplicate(u8),
    Land(u8),
    FailWrite(u8),
    /// A step on the `i`th prefill (decode) worker.
    StepPrefill(u8),
    StepDecode(u8),
    /// A step that ran and whose outputs were lost: the node fails it (even: a prefill worker,
    /// odd: a decode worker; the rest picks which).
    FailStep(u8),
    /// Moves the clock without firing any timer: a driver running late.
    Advance(u8),
    Abort(u8),
    /// Fires one machine's due timers, in whatever order the schedule says.
    RouterTimers,
    PrefillTimers(u8),
    DecodeTimers(u8),
    /// A link breaks and comes back at once (among router–prefill, router–decode and prefill–
    /// decode links, in that order): what was on its way over it is lost, and both ends hear
    /// that it went down. Writes already issued still land or fail within their flight.
    LinkDown(u8),
    /// A worker's process dies and starts again as its next incarnation, with nothing of the
    /// old one's state (among the prefill workers, then the decode workers). What was on its
    /// way to it over its links is lost; writes already issued still land or fail within their
    /// flight, and the outcome of one it issued reaches nobody. Its peers hear its links go down,
    /// then the router hears the new life come up. The second lap picks the same workers with
    /// every link-down event lost (the transport drops events its owner is too slow to take):
    /// the router learns of the new life only when it comes up, and the workers only from its
    /// messages. On the first two laps what the old life sent is lost too; on the next two it
    /// is still on its way, and may arrive after the new life's messages (each link is its own
    /// connection, read by its own task: nothing orders the dead one's last bytes before them).
    Restart(u8),
    /// The router's process dies and starts again as its next incarnation, with none of the old
    /// one's requests: their clients' streams broke with it. Even: its workers hear its links go
    /// down; odd: those events are lost, and the workers learn of the new life only from its
    /// messages, while what they hold for the old one must still end by itself.
    RestartRouter(u8),
}

impl ClusterOp {
    /// What a schedule without faults does in this op's place: a delivery in order on its link,
    /// or nothing for a fault (a loss, a duplicate, a failed write or step, the clock jumping, a
    /// link breaking, a worker's restart). Clients still abort, and the router still restarts:
    /// that ends what it held, but what is submitted to its next life must meet no fault of the
    /// old one's leftovers on the workers.
    pub fn calm(&self) -> Option<ClusterOp> {
        match *self {
            ClusterOp::Deliver(i) => Some(ClusterOp::DeliverInOrder(i)),
            ClusterOp::Drop(_)
            | ClusterOp::Duplicate(_)
            | ClusterOp::FailWrite(_)
            | ClusterOp::FailStep(_)
            | ClusterOp::Advance(_)
            | ClusterOp::LinkDown(_)
            | ClusterOp::Restart(_) => None,
            ref calm => Some(calm.clone()),
        }
    }
}

/// How a request ended at the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Finished(FinishReason),
    Failed(AbortReason),
    /// The router it was submitted to died: its client's stream broke there.
    RouterRestarted,
}

impl End {
    /// Whether its client aborted it, or its router died: an end the machines that served it
    /// had no part in.
    pub fn by_its_client_or_router(self) -> bool {
        matches!(
            self,
            End::Finished(FinishReason::Aborted)
                | End::Failed(AbortReason::Client)
                | End::RouterRestarted
        )
    }

    /// Whether the request ran to its end: its whole output passed on.
    pub fn ran_to_its_end(self) -> bool {
        matches!(
            self,
            End::Finished(
                FinishReason::Length
                    | FinishReason::ContextLength
                    | FinishReason::EndOfSequence(_)
                    | FinishReason::StopToken(_)
            )
        )
    }
}

/// A prefill or decode worker of the cluster.
#[derive(Debug)]
pub struct Worker<N> {
    /// Its current life: a restart moves it to the next incarnation.
    pub me: Endpoint,
    pub node: N,
    /// What its steps run on and the writes land in: a restart starts a fresh one, as a new
    /// process starts with fresh device memory.
    pub model: ProvenanceModel,
    /// Requests this life started on its model: a prefill worker's prompts, a decode worker's
    /// streams.
    pub started: u64,
}

/// Which machine a worker id names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Router,
    Prefill(usize),
    Decode(usize),
}

#[derive(Debug)]
pub struct Cluster {
    pub now: Time,
    pub router: Router,
    /// In worker-id order.
    pub prefills: Vec<Worker<PrefillNode>>,
    pub decodes: Vec<Worker<DecodeNode>>,
    pub network: VecDeque<Envelope>,
    pub writes: VecDeque<FlyingWrite>,
    config: ClusterConfig,
    /// What the router passed on, per request, and how it ended.
    pub outputs: BTreeMap<RequestId, Vec<u32>>,
    /// The log-probabilities the router passed on with them, and its prompt's.
    pub logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    pub prompt_logprobs: BTreeMap<RequestId, Vec<TokenLogprobs>>,
    pub ends: BTreeMap<RequestId, End>,
    /// The transfer each request's stream came from last, and the decode worker it went to, as
    /// the router said.
    pub decoding: BTreeMap<RequestId, (TransferKey, Endpoint)>,
    specs: BTreeMap<RequestId, RequestSpec>,
    /// The transfers of writes dropped on arrival: their pages were let go of, or their target's
    /// life ended.
    pub writes_late: Vec<TransferKey>,
    /// What the machines sent that only a fault, a client or an overload should make them send.
    pub sent: Sent,
}

/// The messages that tell a retry or a failure: the router's reservations, whose epoch is the
/// attempt (a worker too busy to take a request sends it again under a new transfer and the same
/// attempt), and every side's aborts, with their reasons.
#[derive(Debug, Default)]
pub struct Sent {
    pub reserves: BTreeMap<RequestId, Vec<TransferKey>>,
    pub aborts: Vec<(Endpoint, TransferKey, AbortReason)>,
}

impl Sent {
    fn record(&mut self, envelope: &Envelope) {
        match &envelope.body {
            Message::Reserve { key, request, .. } => {
                self.reserves.entry(request.id).or_default().push(*key)
            }
            Message::Abort { key, reason } => self.aborts.push((envelope.from, *key, *reason)),
            _ => {}
        }
    }
}

fn new_model(sched: &SchedConfig) -> ProvenanceModel {
    ProvenanceModel::new(sched.pool, sched.running_max, VOCAB_SIZE)
}

fn prefill_worker(me: Endpoint, config: &ClusterConfig) -> Worker<PrefillNode> {
    let node = PrefillNode::new(me, config.prefill_sched.clone(), config.prefill.clone())
        .expect("valid prefill config");
    Worker { me, node, model: new_model(&config.prefill_sched), started: 0 }
}

fn decode_worker(me: Endpoint, config: &ClusterConfig) -> Worker<DecodeNode> {
    let node = DecodeNode::new(me, config.decode_sched.clone(), config.decode.clone())
        .expect("valid decode config");
    Worker { me, node, model: new_model(&config.decode_sched), started: 0 }
}

impl Cluster {
    pub fn new(config: ClusterConfig) -> Cluster {
        assert!(
            config.prefill_workers >= 1 && config.decode_workers >= 1,
            "a cluster needs a worker of each role"
        );
        let prefills: Vec<_> = (0..config.prefill_workers)
            .map(|i| prefill_worker(prefill_endpoint(i), &config))
            .collect();
        let decodes: Vec<_> = (0..config.decode_workers)
            .map(|i| decode_worker(decode_endpoint(i), &config))
            .collect();
        let router = Router::new(
            ROUTER,
            config.router.clone(),
            prefills.iter().map(|w| w.me).collect(),
            decodes.iter().map(|w| w.me).collect(),
        );
        Cluster {
            now: Time::ZERO,
            router,
            prefills,
            decodes,
            network: VecDeque::new(),
            writes: VecDeque::new(),
            config,
            outputs: BTreeMap::new(),
            logprobs: BTreeMap::new(),
            prompt_logprobs: BTreeMap::new(),
            ends: BTreeMap::new(),
            decoding: BTreeMap::new(),
            specs: BTreeMap::new(),
            writes_late: Vec::new(),
            sent: Sent::default(),
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

    /// Which machine `worker` is, if it is one of this cluster's.
    fn place(&self, worker: WorkerId) -> Option<Place> {
        let id = usize::try_from(worker.0).ok()?;
        let place = match id {
            0 => Place::Router,
            _ if id % 2 == 1 => Place::Prefill(id / 2),
            _ => Place::Decode(id / 2 - 1),
        };
        match place {
            Place::Prefill(i) if i >= self.prefills.len() => None,
            Place::Decode(i) if i >= self.decodes.len() => None,
            _ => Some(place),
        }
    }

    /// Delivers the `i`th message on the network (0 is the oldest).
    pub fn deliver(&mut self, i: usize) {
        let Some(envelope) = self.network.remove(i) else { return };
        let now = self.now;
        match self.place(envelope.to.worker) {
            Some(Place::Router) => self.router.handle_envelope(envelope, now),
            Some(Place::Prefill(p)) => self.prefills[p].node.handle_envelope(envelope, now),
            Some(Place::Decode(d)) => self.decodes[d].node.handle_envelope(envelope, now),
            None => panic!("a message to a worker the cluster does not have: {envelope:?}"),
        }
        self.after_input();
    }

    /// The index of each link's oldest message in flight, in the network's order.
    fn link_heads(&self) -> Vec<usize> {
        let mut seen = BTreeSet::new();
        (0..self.network.len())
            .filter(|&i| seen.insert((self.network[i].from, self.network[i].to)))
            .collect()
    }

    pub fn drop_message(&mut self, i: usize) {
        self.network.remove(i);
    }

    /// Lands (or, with `fail`, loses) the `i`th write in flight. A write whose pages the decode
    /// side let go of, or whose target's life ended, is dropped on arrival and counted, as a
    /// revoked memory key drops an RDMA write; either way the issuing prefill worker hears the
    /// outcome, if that life still lives.
    pub fn land_write(&mut self, i: usize, fail: bool) {
        let Some(w) = self.writes.remove(i) else { return };
        let target = match self.place(w.to.worker) {
            Some(Place::Decode(d)) if self.decodes[d].me == w.to => Some(d),
            _ => None,
        };
        let landed =
            !fail && target.is_some_and(|d| self.decodes[d].node.write_allowed(w.key, w.page));
        if let (true, Some(d)) = (landed, target) {
            // The data plane's safety property, checked against the pool rather than the protocol
            // side that allowed the write: a write lands only in the allocation it was aimed at.
            // Once that allocation ended (the page freed, its generation moved on), the page is
            // free or someone else's, and a write landing there corrupts it whether or not any
            // output ever reads it.
            let aimed_at = PageRef::from_parts(w.page.index, w.page.generation);
            assert!(
                self.decodes[d].node.scheduler().pool().is_live(aimed_at),
                "a write of {:?} landed in {:?} on {:?} after that allocation ended",
                w.key,
                w.page,
                w.to
            );
            self.release_freed();
            self.decodes[d].model.write_page(w.page.index, &w.data).expect("a page-sized write");
        } else if !fail {
            self.writes_late.push(w.key);
        }
        if let Some(Place::Prefill(p)) = self.place(w.from.worker)
            && self.prefills[p].me == w.from
        {
            self.prefills[p].node.handle_write_completion(w.key, w.ordinal, landed, self.now);
        }
        self.after_input();
    }

    /// Plans, executes and applies one step on prefill worker `p`; false if none could be
    /// planned.
    pub fn step_prefill(&mut self, p: usize) -> bool {
        let now = self.now;
        let Some(plan) = self.prefills[p].node.plan_step(now) else { return false };
        self.release_freed();
        let worker = &mut self.prefills[p];
        let outputs = worker.model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
        worker.node.apply_outputs(&outputs, now).unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    pub fn step_decode(&mut self, d: usize) -> bool {
        let now = self.now;
        let Some(plan) = self.decodes[d].node.plan_step(now) else { return false };
        self.release_freed();
        let worker = &mut self.decodes[d];
        let outputs = worker.model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
        worker.node.apply_outputs(&outputs, now).unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    /// Plans and executes one step on worker `i` of a role (`decode`, else prefill) whose
    /// outputs are then lost, as an executor failing after it ran (a device error, a lost
    /// readback): the node fails the step, and every request in it ends. False if none could be
    /// planned.
    pub fn fail_step(&mut self, decode: bool, i: usize) -> bool {
        let now = self.now;
        let plan = if decode {
            self.decodes[i].node.plan_step(now)
        } else {
            self.prefills[i].node.plan_step(now)
        };
        let Some(plan) = plan else { return false };
        self.release_freed();
        let failed = if decode {
            let worker = &mut self.decodes[i];
            worker.model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
            worker.node.fail_step(plan.step, now)
        } else {
            let worker = &mut self.prefills[i];
            worker.model.execute(&plan).unwrap_or_else(|e| panic!("{e}"));
            worker.node.fail_step(plan.step, now)
        };
        failed.unwrap_or_else(|e| panic!("{e}"));
        self.after_input();
        true
    }

    /// Moves the clock and fires every machine's due timers, in the fixed order router, prefill
    /// workers, decode workers. Writes past their flight bound fail first: the transport
    /// guarantees the bound. A machine's timers fire only once its `next_timeout` says they are
    /// due, as the server's loops sleep until then: a timer that `next_timeout` forgets wedges
    /// here as it would there. (The schedules' `*Timers` actions fire them at any time, which
    /// must be harmless.)
    pub fn advance(&mut self, by: Duration) {
        self.now = self.now.saturating_add(by);
        self.fail_overdue_writes();
        let now = self.now;
        let due = |next: Option<Time>| next.is_some_and(|t| t <= now);
        // Once fired, nothing is due at the same instant: a driver would spin on it.
        let spin = "handled its timers and is due again at once";
        if due(self.router.next_timeout()) {
            self.router.handle_timeout(now);
            self.after_input();
            assert!(!due(self.router.next_timeout()), "the router {spin}");
        }
        for p in 0..self.prefills.len() {
            if due(self.prefills[p].node.next_timeout()) {
                self.prefills[p].node.handle_timeout(now);
                self.after_input();
                assert!(!due(self.prefills[p].node.next_timeout()), "prefill node {p} {spin}");
            }
        }
        for d in 0..self.decodes.len() {
            if due(self.decodes[d].node.next_timeout()) {
                self.decodes[d].node.handle_timeout(now);
                self.after_input();
                assert!(!due(self.decodes[d].node.next_timeout()), "decode node {d} {spin}");
            }
        }
    }

    /// The transport's bound: a write lands or fails within its flight.
    fn fail_overdue_writes(&mut self) {
        while let Some(i) = self.writes.iter().position(|w| w.land_by <= self.now) {
            self.land_write(i, true);
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
        for p in 0..self.prefills.len() {
            self.step_prefill(p);
        }
        for d in 0..self.decodes.len() {
            self.step_decode(d);
        }
        self.advance(Duration::from_millis(1));
    }

    /// Every request ended at the router, and nothing is in flight or held anywhere.
    pub fn is_quiet(&self) -> bool {
        self.ends.len() == self.outputs.len()
            && self.network.is_empty()
            && self.writes.is_empty()
            && self.prefills.iter().all(|w| {
                w.node.side().transfers_live() == 0 && w.node.scheduler().requests_held() == 0
            })
            && self.decodes.iter().all(|w| {
                w.node.side().transfers_live() == 0 && w.node.scheduler().requests_held() == 0
            })
    }

    /// Every message delivered and write landed in order, every node stepped, and the clock
    /// moved 1 ms, until every submitted request ended and the cluster is quiet; panics after
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

    /// Every link in the cluster, by its two ends: router–prefill, router–decode, then
    /// prefill–decode.
    fn links(&self) -> Vec<(Endpoint, Endpoint)> {
        let prefills = self.prefills.iter().map(|w| w.me);
        let decodes = self.decodes.iter().map(|w| w.me);
        prefills
            .clone()
            .chain(decodes.clone())
            .map(|w| (ROUTER, w))
            .chain(prefills.flat_map(|p| decodes.clone().map(move |d| (p, d))))
            .collect()
    }

    /// The link between `a` and `b` breaks and comes back at once: what was on its way over it
    /// is lost, and both ends hear that it went down (the router, that the worker came back).
    pub fn link_down(&mut self, a: Endpoint, b: Endpoint) {
        self.network.retain(|e| {
            !((e.from.worker == a.worker && e.to.worker == b.worker)
                || (e.from.worker == b.worker && e.to.worker == a.worker))
        });
        for (end, other) in [(a, b), (b, a)] {
            self.hear_down(end, other);
            if self.place(end.worker) == Some(Place::Router) {
                self.hear_up(other);
            }
        }
    }

    /// `end` hears that its link to `other` went down.
    fn hear_down(&mut self, end: Endpoint, other: Endpoint) {
        let now = self.now;
        match self.place(end.worker) {
            Some(Place::Router) => self.router.handle_worker_down(other.worker, now),
            Some(Place::Prefill(p)) => self.prefills[p].node.handle_peer_down(other.worker, now),
            Some(Place::Decode(d)) => self.decodes[d].node.handle_peer_down(other.worker, now),
            None => {}
        }
        self.after_input();
    }

    /// The router hears a link to `worker` come up, and the places its `Hello` says (as
    /// `roles::launch` gives them: a prefill worker's transfers, a decode worker's batch).
    fn hear_up(&mut self, worker: Endpoint) {
        let (role, places) = match self.place(worker.worker) {
            Some(Place::Prefill(_)) => (Role::Prefill, self.config.prefill.transfers_max),
            Some(Place::Decode(_)) => (Role::Decode, self.config.decode_sched.running_max),
            _ => return,
        };
        self.router.handle_worker_up(worker, role, places, self.now);
        self.after_input();
    }

    /// Worker `worker` dies and starts again as its next incarnation (see `ClusterOp::Restart`);
    /// with `events_lost`, no peer hears its links go down; with `sent_late`, what it sent is
    /// still on its way.
    pub fn restart(&mut self, worker: WorkerId, events_lost: bool, sent_late: bool) {
        let place = self.place(worker).expect("a worker of the cluster");
        let old = match place {
            Place::Prefill(p) => self.prefills[p].me,
            Place::Decode(d) => self.decodes[d].me,
            Place::Router => panic!("the router restarts through `restart_router`"),
        };
        let new = Endpoint { worker, incarnation: Incarnation(old.incarnation.0 + 1) };
        self.network.retain(|e| e.to != old && (sent_late || e.from != old));
        match place {
            Place::Prefill(p) => self.prefills[p] = prefill_worker(new, &self.config),
            Place::Decode(d) => self.decodes[d] = decode_worker(new, &self.config),
            Place::Router => unreachable!("refused above"),
        }
        // The dead life's requests and pages went with its process: nothing to hand back.
        self.after_input();
        if !events_lost {
            self.hear_down(ROUTER, old);
            let peers: Vec<Endpoint> = match place {
                Place::Prefill(_) => self.decodes.iter().map(|w| w.me).collect(),
                _ => self.prefills.iter().map(|w| w.me).collect(),
            };
            for peer in peers {
                self.hear_down(peer, old);
            }
        }
        self.hear_up(new);
    }

    /// The router dies and starts again as its next incarnation (see `ClusterOp::RestartRouter`):
    /// every request it held ends failed with what it passed on, since its client's stream broke;
    /// with `events_lost`, no worker hears its links go down.
    pub fn restart_router(&mut self, events_lost: bool) {
        let old = self.router.me();
        let new = Endpoint { worker: old.worker, incarnation: Incarnation(old.incarnation.0 + 1) };
        self.network.retain(|e| e.from != old && e.to != old);
        let held: Vec<RequestId> =
            self.outputs.keys().filter(|r| !self.ends.contains_key(r)).copied().collect();
        for request in held {
            self.end(request, End::RouterRestarted);
        }
        let (prefills, decodes): (Vec<Endpoint>, Vec<Endpoint>) = (
            self.prefills.iter().map(|w| w.me).collect(),
            self.decodes.iter().map(|w| w.me).collect(),
        );
        self.router =
            Router::new(new, self.config.router.clone(), prefills.clone(), decodes.clone());
        self.after_input();
        if !events_lost {
            for worker in prefills.into_iter().chain(decodes) {
                self.hear_down(worker, old);
            }
        }
    }

    /// Applies one action of a fault schedule.
    pub fn apply(&mut self, op: &ClusterOp) {
        let pick = |len: usize, i: u8| (len > 0).then(|| usize::from(i) % len);
        let (prefills, decodes) = (self.prefills.len(), self.decodes.len());
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
            ClusterOp::DeliverInOrder(i) => {
                let heads = self.link_heads();
                if let Some(i) = pick(heads.len(), i) {
                    self.deliver(heads[i])
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
            ClusterOp::StepPrefill(i) => {
                self.step_prefill(usize::from(i) % prefills);
            }
            ClusterOp::StepDecode(i) => {
                self.step_decode(usize::from(i) % decodes);
            }
            ClusterOp::FailStep(which) => {
                let (decode, i) = (which % 2 == 1, usize::from(which / 2));
                self.fail_step(decode, i % if decode { decodes } else { prefills });
            }
            ClusterOp::Advance(ms) => {
                self.now = self.now.saturating_add(Duration::from_millis(u64::from(ms % 50)));
                self.fail_overdue_writes();
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
            ClusterOp::PrefillTimers(i) => {
                self.prefills[usize::from(i) % prefills].node.handle_timeout(self.now);
                self.after_input();
            }
            ClusterOp::DecodeTimers(i) => {
                self.decodes[usize::from(i) % decodes].node.handle_timeout(self.now);
                self.after_input();
            }
            ClusterOp::LinkDown(which) => {
                let links = self.links();
                let (a, b) = links[usize::from(which) % links.len()];
                self.link_down(a, b);
            }
            ClusterOp::Restart(which) => {
                let workers = prefills + decodes;
                let (i, lap) = (usize::from(which) % workers, usize::from(which) / workers);
                let worker =
                    if i < prefills { self.prefills[i].me } else { self.decodes[i - prefills].me };
                self.restart(worker.worker, lap % 2 == 1, lap % 4 >= 2);
            }
            ClusterOp::RestartRouter(lap) => self.restart_router(lap % 2 == 1),
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
                // Cut short (a failed step, a decode worker that stopped, a router that died): what
                // came before.
                Some(End::Finished(_) | End::Failed(_) | End::RouterRestarted) => {
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
        for (role, sched) in self
            .prefills
            .iter()
            .map(|w| ("prefill", w.node.scheduler()))
            .chain(self.decodes.iter().map(|w| ("decode", w.node.scheduler())))
        {
            let pool = sched.pool();
            assert_eq!(pool.held_count(), 0, "{role}: a page is held at quiescence: {pool:?}");
            assert_eq!(pool.pins_live_count(), 0, "{role}: a pin is live at quiescence");
            assert_eq!(
                pool.freed_untaken_count(),
                0,
                "{role}: a freed page never went to its model to be poisoned"
            );
            assert_eq!(sched.requests_held(), 0, "a {role} worker holds a request");
        }
        for w in &self.prefills {
            assert_eq!(w.node.side().transfers_live(), 0, "{:?}: a prefill transfer is live", w.me);
        }
        for w in &self.decodes {
            assert_eq!(w.node.side().transfers_live(), 0, "{:?}: a decode transfer is live", w.me);
        }
    }

    /// The oracles of a schedule without faults (`ClusterOp::calm`), beyond `check_outcomes`:
    /// nothing fails but what a client aborts or a router's restart ends, so every other request
    /// ran to its end in its first attempt; no machine aborted a transfer but for those or a
    /// worker too busy to take it (which costs no attempt); and no write but theirs arrived after
    /// its pages were let go. A fault schedule cannot say this: any request there may have met a
    /// fault, so a failure or a retry always passes, and so does a machine that fails or retries
    /// what it need not.
    pub fn check_calm_outcomes(&self) {
        let Sent { reserves, aborts } = &self.sent;
        // What a client or a router's restart ended: its transfers may be aborted and their
        // writes come late, by any machine, for any reason.
        let excused: BTreeSet<TransferId> = self
            .ends
            .iter()
            .filter(|(_, end)| end.by_its_client_or_router())
            .flat_map(|(id, _)| reserves.get(id).into_iter().flatten().map(|key| key.transfer))
            .chain(
                aborts
                    .iter()
                    .filter(|(_, _, reason)| *reason == AbortReason::Client)
                    .map(|(_, key, _)| key.transfer),
            )
            .collect();
        for (from, key, reason) in aborts {
            let busy = matches!(reason, AbortReason::DecodeBusy | AbortReason::PrefillBusy);
            assert!(
                busy || excused.contains(&key.transfer),
                "{from:?} aborted {key:?} ({reason:?}) without a fault or a client's abort"
            );
        }
        for key in &self.writes_late {
            let late = excused.contains(&key.transfer);
            assert!(late, "a write of {key:?} came too late without a fault");
        }
        for (id, &end) in &self.ends {
            let excused = end.by_its_client_or_router();
            assert!(end.ran_to_its_end() || excused, "{id} ended {end:?} without a fault");
            let retried = reserves.get(id).into_iter().flatten().find(|key| key.epoch != Epoch(0));
            assert_eq!(retried, None, "{id} was retried without a fault");
        }
    }

    /// After the faults and the run to the end, the cluster serves again: three requests
    /// submitted into the quiet cluster, every worker up, each finish in their first attempt with
    /// their output alone. What the faults left in the router's or the workers' state (a worker
    /// forgotten, a transfer id at or below a worker's high-water mark, a lease or peer record
    /// of a dead life) would refuse, fail or retry them.
    pub fn check_serves_again(&mut self, sched: &SchedConfig) {
        let first = self.outputs.len() as u64 + 1;
        let ids: Vec<RequestId> = (first..first + 3).map(RequestId).collect();
        for &id in &ids {
            let prompt = (0..9).map(|i| 1 + (i * 5 + id.0 as u32 * 11) % 90).collect();
            let refused = self.submit(super::request_spec(id, prompt, 4)).err();
            assert_eq!(refused, None, "{id} was refused after the faults");
        }
        self.run_until_done(20_000);
        let specs: BTreeMap<RequestId, RequestSpec> =
            ids.iter().map(|id| (*id, self.specs[id].clone())).collect();
        self.check_outcomes(sched, &specs);
        for id in &ids {
            let end = self.ends[id];
            assert!(end.ran_to_its_end(), "{id}, submitted after the faults, ended {end:?}");
            let mut keys = self.sent.reserves.get(id).into_iter().flatten();
            let retried = keys.find(|key| key.epoch != Epoch(0));
            assert_eq!(retried, None, "{id}, submitted after the faults, was retried");
        }
    }

    /// The specs of every request submitted, for `check_outcomes`.
    pub fn submitted(&self) -> BTreeMap<RequestId, RequestSpec> {
        self.specs.clone()
    }

    pub fn check_invariants(&self) {
        self.router.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        for w in &self.prefills {
            w.node.check_invariants().unwrap_or_else(|e| panic!("{:?}: {e}", w.me));
        }
        for w in &self.decodes {
            w.node.check_invariants().unwrap_or_else(|e| panic!("{:?}: {e}", w.me));
        }
    }

    /// Every machine's incremental check: it must pass wherever the full one does.
    pub fn check_invariants_incremental(&mut self) {
        let incremental = |r: Result<(), crate::InvariantViolation>| {
            r.unwrap_or_else(|e| panic!("incremental check: {e}"))
        };
        incremental(self.router.check_invariants_incremental());
        for w in &mut self.prefills {
            incremental(w.node.check_invariants_incremental());
        }
        for w in &mut self.decodes {
            incremental(w.node.check_invariants_incremental());
        }
    }

    /// Hands each worker's freed pages to its model, which poisons them (in order with the
    /// steps and writes, as the engine loops do).
    fn release_freed(&mut self) {
        let mut freed = Vec::new();
        for w in &mut self.prefills {
            freed.clear();
            w.node.take_freed_pages(&mut freed);
            w.model.release_pages(&freed);
        }
        for w in &mut self.decodes {
            freed.clear();
            w.node.take_freed_pages(&mut freed);
            w.model.release_pages(&freed);
        }
    }

    fn after_input(&mut self) {
        self.release_freed();
        self.check_invariants_incremental();
        self.check_invariants();
        while let Some(output) = self.router.poll_output() {
            match output {
                RouterOutput::Send(envelope) => {
                    self.sent.record(&envelope);
                    self.network.push_back(envelope)
                }
                RouterOutput::Decoding { request, key, decode } => {
                    self.decoding.insert(request, (key, decode));
                }
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
        for w in &mut self.prefills {
            while let Some(output) = w.node.poll_output() {
                match output {
                    PrefillNodeOutput::Send(envelope) => {
                        self.sent.record(&envelope);
                        self.network.push_back(envelope)
                    }
                    PrefillNodeOutput::Start { request, spec } => {
                        w.started += 1;
                        w.model.start_request(request, spec)
                    }
                    PrefillNodeOutput::End { request } => w.model.end_request(request),
                    PrefillNodeOutput::Write { key, to, ordinal, source, page, .. } => {
                        let mut data = Vec::new();
                        w.model.read_page(source.index(), &mut data).expect("a live page");
                        let land_by = self.now.saturating_add(self.config.prefill.write_flight_max);
                        let from = w.me;
                        let write = FlyingWrite { from, to, key, ordinal, page, data, land_by };
                        self.writes.push_back(write);
                    }
                }
            }
        }
        for w in &mut self.decodes {
            while let Some(output) = w.node.poll_output() {
                match output {
                    DecodeNodeOutput::Send(envelope) => {
                        self.sent.record(&envelope);
                        self.network.push_back(envelope)
                    }
                    DecodeNodeOutput::Start { request, spec } => {
                        w.started += 1;
                        w.model.start_request(request, spec)
                    }
                    DecodeNodeOutput::End { request } => w.model.end_request(request),
                }
            }
        }
    }

    fn end(&mut self, request: RequestId, end: End) {
        let previous = self.ends.insert(request, end);
        assert_eq!(previous, None, "{request} ended twice");
    }
}
