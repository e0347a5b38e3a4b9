//! One simulated run: the deployment and its clients on turmoil, the seed's faults applied
//! between steps, then a quiet phase to quiescence; what every client saw, what every host holds
//! at the end, and every panic, for the oracles.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_core::planted::PlantedBug;
use lockstep_server::http::SSE_KEEP_ALIVE;

use crate::client::{self, ClientBoard, ClientPlan, Observed};
use crate::device::{CostModel, SlowSteps};
use crate::events::{Event, EventLog, Logged};
use crate::faults::{self, FaultAction, FaultLevel, FaultMix, ScheduledFault};
use crate::knobs::{Knobs, Topology};
use crate::panics;
use crate::rng::SimRng;
use crate::sabotage::Sabotage;
use crate::server_events;
use crate::slow_lane::KvLaneDelay;
use crate::topology::{self, Deployment, Probe};
use crate::trace::SimTrace;

/// How to run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub seed: u64,
    pub topology: Topology,
    pub faults: FaultLevel,
    pub cost: CostModel,
    /// The servers' settings; `None`: drawn from the seed.
    pub knobs: Option<Knobs>,
    /// The faults' mix; `None`: drawn from the seed at the `faults` level.
    pub mix: Option<FaultMix>,
    /// A bug planted in every worker's device (`sabotage`): for showing the oracles fire.
    pub sabotage: Option<Sabotage>,
    /// A bug class of shared/bugs.md put back for this run (`planted!`); only a build with
    /// feature `planted-bugs` can plant one.
    pub plant: Option<PlantedBug>,
    /// Only these of the seed's scheduled faults (their indices in the schedule); `None`: all.
    /// What `sim explore --shrink` takes away.
    pub only_faults: Option<BTreeSet<usize>>,
    /// turmoil's step: every host runs this much virtual time per step.
    pub tick: Duration,
    /// The longest a client waits for its answer.
    pub client_timeout: Duration,
    /// The longest a client waits for the next bytes of its answer, as real clients' read
    /// timeouts: what tells it that the host it talks to went away without closing. Four of the
    /// servers' keep-alive intervals (production's, which the simulated servers keep: a shorter
    /// one sends more messages, and every message moves the seed's later draws).
    pub client_read_timeout: Duration,
    /// After the last client is done, how long hosts get to let go of everything.
    pub settle_max: Duration,
    /// The run stops here whatever happens (a wedge shows as timed-out clients).
    pub virtual_time_max: Duration,
    /// Clients start this long after the hosts, as a load balancer waits for a new deployment's
    /// links to come up; the fault window starts with them.
    pub warmup: Duration,
    /// Steps through idle spans (nothing on the network, nothing held, no request out) in one
    /// long turmoil step each instead of tick by tick (`idle_step`); off: every step is a tick.
    pub fast_forward: bool,
    /// The device fails a share of its steps in the fault window, when the seed's coin says so
    /// (`FaultMix::draw`); off by default.
    pub failed_steps: bool,
}

impl RunConfig {
    pub fn new(seed: u64, topology: Topology, faults: FaultLevel) -> RunConfig {
        RunConfig {
            seed,
            topology,
            faults,
            cost: CostModel::default_model(),
            knobs: None,
            mix: None,
            sabotage: None,
            plant: None,
            only_faults: None,
            tick: Duration::from_millis(1),
            client_timeout: Duration::from_secs(600),
            client_read_timeout: 4 * SSE_KEEP_ALIVE,
            settle_max: Duration::from_secs(30),
            virtual_time_max: Duration::from_secs(4 * 3600),
            warmup: Duration::from_secs(2),
            fast_forward: true,
            failed_steps: false,
        }
    }
}

/// What a run left behind.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub seed: u64,
    pub topology: Topology,
    pub knobs: Knobs,
    pub mix: FaultMix,
    pub faults: Vec<ScheduledFault>,
    /// When the last fault ended (and slow steps stopped): the liveness phase starts here.
    pub healed_at: Duration,
    /// When the host clients talk to crashed, if it did: the requests it held went with it.
    pub entry_crashed_at: Vec<Duration>,
    pub observed: Vec<Observed>,
    pub log: Vec<Logged>,
    pub log_hash: u64,
    /// Panics in any host (an invariant broken, or a bug), in order.
    pub panics: Vec<String>,
    /// What each host still held at the end, if anything.
    pub held_at_end: Vec<String>,
    /// Transfers the router started again after an attempt failed, over all its lives (zero for
    /// one server).
    pub router_retries: u64,
    /// turmoil's own error, if the run ended on one (a host's software failed).
    pub sim_error: Option<String>,
    pub virtual_time: Duration,
    pub wall_time: Duration,
    pub steps: u64,
    /// Steps longer than a tick (the idle fast-forward), and the virtual time they covered.
    pub long_steps: u64,
    pub fast_forwarded: Duration,
}

/// Runs `trace` once.
pub fn run(trace: &SimTrace, config: &RunConfig) -> RunOutcome {
    // The one wall-clock read: how fast the simulation itself ran, for the report.
    #[allow(clippy::disallowed_methods)]
    let started = Instant::now();
    // The run is this thread's: every host, the reference never (it runs alone, unplanted).
    #[cfg(feature = "planted-bugs")]
    let _planting = lockstep_core::planted::plant(config.plant);
    #[cfg(not(feature = "planted-bugs"))]
    assert!(config.plant.is_none(), "planting a bug needs a build with feature planted-bugs");
    let knobs = config
        .knobs
        .clone()
        .unwrap_or_else(|| Knobs::draw(config.seed, context_needed(trace), trace.requests.len()));
    let mix = config.mix.clone().unwrap_or_else(|| {
        let flight = knobs.timing.write_flight_max;
        FaultMix::draw(config.seed, config.faults, config.topology, flight, config.failed_steps)
    });
    let mut sim = turmoil::Builder::new()
        .rng_seed(config.seed)
        .tick_duration(config.tick)
        .simulation_duration(config.virtual_time_max)
        .min_message_latency(Duration::ZERO)
        .max_message_latency(mix.latency_max)
        // turmoil's listen backlog (64 by default) panics when exceeded: a real kernel's is
        // 4096 (somaxconn), and a trace's sessions may all connect at once.
        .tcp_capacity(4096)
        .build();
    let log = EventLog::default();
    let healed_at = config.warmup + mix.window;
    let slow = SlowSteps {
        rate: mix.slow_step_rate,
        extra: mix.slow_step_extra,
        failure_rate: mix.failed_step_rate,
        until: healed_at,
    };
    let deployment = topology::install(
        &mut sim,
        config.topology,
        &knobs,
        config.cost,
        slow,
        config.sabotage,
        trace.vocab_size,
        config.seed,
        log.clone(),
    );
    let slowable: Vec<String> = deployment.kv_lanes.keys().cloned().collect();
    let (links, workers, entry) = (&deployment.links, &deployment.workers, &deployment.entry);
    let mut faults = faults::schedule(config.seed, &mix, links, workers, entry, &slowable);
    if let Some(only) = &config.only_faults {
        faults = faults
            .into_iter()
            .enumerate()
            .filter(|(i, _)| only.contains(i))
            .map(|(_, f)| f)
            .collect();
    }
    for fault in &mut faults {
        fault.at += config.warmup;
    }
    let seen = Arc::new(Mutex::new(vec![Observed::default(); trace.requests.len()]));
    let plan = ClientPlan {
        requests: trace.requests.clone(),
        cancel_after: cancellations(config.seed, &mix, trace.requests.len()),
        entry: deployment.entry.clone(),
        timeout: config.client_timeout,
        read_timeout: config.client_read_timeout,
        start_offset: config.warmup,
    };
    let board = ClientBoard::default();
    client::install(&mut sim, plan, seen.clone(), log.clone(), board.clone());
    let cap = fast_forward_cap(&knobs);

    panics::start_capture();
    let router_events = server_events::capture(log.clone());
    let mut applier = FaultApplier::new(deployment.kv_lanes.clone());
    let mut entry_crashed_at = Vec::new();
    let mut next_fault = 0;
    let mut steps = 0u64;
    let (mut long_steps, mut fast_forwarded) = (0u64, Duration::ZERO);
    let mut sim_error = None;
    let mut settling_since = None;
    loop {
        let now = sim.elapsed();
        while next_fault < faults.len() && faults[next_fault].at <= now {
            let fault = &faults[next_fault];
            if applier.apply(&mut sim, fault) {
                log.log_at(now, Event::Fault(fault.action.to_string()));
                if matches!(&fault.action, FaultAction::Crash(h) if *h == deployment.entry) {
                    entry_crashed_at.push(now);
                }
            }
            next_fault += 1;
        }
        steps += 1;
        let long = config.fast_forward.then(|| {
            let mut horizon = config.virtual_time_max;
            if let Some(fault) = faults.get(next_fault) {
                horizon = horizon.min(fault.at);
            }
            if now < config.warmup {
                horizon = horizon.min(config.warmup);
            }
            idle_step(&mut sim, &deployment, &board, now, horizon.min(now + cap), config.tick)
        });
        let long = long.flatten();
        if let Some(span) = long {
            long_steps += 1;
            fast_forwarded += span;
        }
        let step = |sim: &mut turmoil::Sim<'_>| match long {
            Some(span) => sim.step_for(span),
            None => sim.step(),
        };
        match catch_unwind(AssertUnwindSafe(|| step(&mut sim))) {
            Ok(Ok(clients_done)) => {
                if clients_done && next_fault >= faults.len() {
                    let since = *settling_since.get_or_insert(now);
                    if quiescent(&deployment) || now.saturating_sub(since) >= config.settle_max {
                        break;
                    }
                }
            }
            Ok(Err(e)) => {
                sim_error = Some(e.to_string());
                break;
            }
            // The hook captured it.
            Err(_) => break,
        }
        if panics::captured_so_far() > 0 {
            // An engine stopped on a broken invariant: what follows is its symptoms.
            break;
        }
    }
    let virtual_time = sim.elapsed();
    let panics = panics::finish_capture();
    drop(router_events);
    let held_at_end = held(&deployment);
    let probes = deployment.probes.snapshot();
    let router_retries = probes.get("router").map_or(0, Probe::transfers_retried);
    drop(sim);
    let observed = seen.lock().expect("the run is over").clone();
    RunOutcome {
        seed: config.seed,
        topology: config.topology,
        knobs,
        mix,
        faults,
        healed_at,
        entry_crashed_at,
        observed,
        log_hash: log.hash(),
        log: log.entries(),
        panics,
        held_at_end,
        router_retries,
        sim_error,
        virtual_time,
        wall_time: started.elapsed(),
        steps,
        long_steps,
        fast_forwarded,
    }
}

/// Prompt plus output tokens of the trace's largest request.
pub fn context_needed(trace: &SimTrace) -> u32 {
    trace.requests.iter().map(|r| r.input.len() as u32 + r.max_tokens).max().unwrap_or(1)
}

/// Which requests' clients go away, and when after sending (to the millisecond).
fn cancellations(seed: u64, mix: &FaultMix, requests: usize) -> Vec<Option<Duration>> {
    let mut rng = SimRng::stream(seed, "cancellations");
    (0..requests)
        .map(|_| rng.chance(mix.cancel_rate).then(|| rng.millis(Duration::ZERO, mix.cancel_within)))
        .collect()
}

/// The longest step the idle fast-forward takes: a sixteenth of the lease (18 ms at the shortest
/// lease drawn, 300 ms; 125 ms at 2 s). Inside a long step every host's timers still fire at their
/// own times (each host's clock is paused and moves from timer to timer), but what they send
/// (heartbeats every lease/4, peer-link pings, reconnects) is stamped and delivered at the step's
/// end: up to this much later than with tick-by-tick stepping. That is the fast-forward's one cost
/// in fidelity: of the order of the faults' message latency (up to 20 ms by default), and well
/// inside every timeout it could trip (a lease runs out after 4 heartbeats, a peer link is dead
/// after 2 s without a ping).
pub fn fast_forward_cap(knobs: &Knobs) -> Duration {
    knobs.timing.lease / 16
}

/// How long the next step may be, if longer than two ticks: when no client request is out, every
/// host holds nothing (`quiescent`) and every message on the network is delayed (none held, none
/// already released to a running host), nothing can happen before the next timer or the next
/// delivery. The only timers that can change what happens next are the clients' sends (on
/// `board`), the faults, the warm-up's end and the run's end (`until` is the earliest of those and
/// `now` + the cap), rounded down to whole ticks so steps stay on the tick grid.
///
/// The step also ends where tick-by-tick stepping would deliver the earliest message in flight:
/// turmoil releases a message at the start of the first step that ends at or after its delivery
/// time, so one due `d` from now (more than a tick) is delivered by the tick that starts
/// `ceil(d / tick) - 1` ticks from now, and the long step ends there. Messages released to a
/// crashed host wait for its restart (a fault: `until` bounds it) and don't count.
fn idle_step(
    sim: &mut turmoil::Sim<'_>,
    deployment: &Deployment,
    board: &ClientBoard,
    now: Duration,
    until: Duration,
    tick: Duration,
) -> Option<Duration> {
    let next_send = {
        let board = board.lock().expect("the hosts are between steps");
        if board.outstanding() > 0 {
            return None;
        }
        board.next_send()
    };
    let until = next_send.map_or(until, |send| until.min(send));
    let tick_ns = tick.as_nanos().max(1);
    let mut ticks = until.saturating_sub(now).as_nanos() / tick_ns;
    if ticks < 2 {
        return None;
    }
    // `None`: something is held; else the earliest delivery and who has messages released.
    let mut in_flight = Some((None::<Duration>, Vec::new()));
    sim.links(|links| {
        for mut link in links {
            let Some((earliest, released)) = &mut in_flight else { return };
            released.extend(link.deliverable().map(|(_, dst)| dst.ip()));
            for sent in &mut link {
                match sent.deliver_in() {
                    Some(due) => *earliest = Some(earliest.map_or(due, |e: Duration| e.min(due))),
                    None => {
                        in_flight = None;
                        return;
                    }
                }
            }
        }
    });
    let (earliest, mut released) = in_flight?;
    if let Some(due) = earliest {
        // Ticks before the one that delivers it; 0 when the next tick does.
        ticks = ticks.min(due.as_nanos().div_ceil(tick_ns).saturating_sub(1));
        if ticks < 2 {
            return None;
        }
    }
    released.sort();
    released.dedup();
    if released.into_iter().any(|host| sim.is_host_running(host)) || !quiescent(deployment) {
        return None;
    }
    Some(tick * u32::try_from(ticks).unwrap_or(u32::MAX))
}

/// True when every host holds nothing: no request, page, transfer or pin.
fn quiescent(deployment: &Deployment) -> bool {
    held(deployment).is_empty()
}

fn held(deployment: &Deployment) -> Vec<String> {
    let mut held = Vec::new();
    for (host, probe) in deployment.probes.snapshot() {
        let s = &probe.stats;
        let (requests, pages, transfers, pins) =
            (s.requests_held(), s.pages_held(), s.transfers_held(), s.pins_held());
        if requests + pages + transfers + pins > 0 {
            held.push(format!(
                "{host}: {requests} requests, {pages} pages, {transfers} transfers, {pins} pins"
            ));
        }
    }
    held
}

/// Applies scheduled faults, skipping an outage of a link or host already out (and its end).
struct FaultApplier {
    out: BTreeSet<String>,
    skipped: BTreeSet<u32>,
    kv_lanes: BTreeMap<String, KvLaneDelay>,
}

impl FaultApplier {
    fn new(kv_lanes: BTreeMap<String, KvLaneDelay>) -> FaultApplier {
        FaultApplier { out: BTreeSet::new(), skipped: BTreeSet::new(), kv_lanes }
    }

    /// Applies `fault`; false when skipped.
    fn apply(&mut self, sim: &mut turmoil::Sim<'_>, fault: &ScheduledFault) -> bool {
        if self.skipped.contains(&fault.outage) {
            return false;
        }
        let target = match &fault.action {
            FaultAction::Partition(a, b)
            | FaultAction::Repair(a, b)
            | FaultAction::Hold(a, b)
            | FaultAction::Release(a, b) => format!("link {} {}", a.min(b), a.max(b)),
            FaultAction::Crash(h) | FaultAction::Restart(h) => format!("host {h}"),
            FaultAction::KvLanesSlow(h, _) => format!("KV lanes {h}"),
        };
        let starts = matches!(
            fault.action,
            FaultAction::Partition(..)
                | FaultAction::Hold(..)
                | FaultAction::Crash(_)
                | FaultAction::KvLanesSlow(_, Some(_))
        );
        if starts {
            if !self.out.insert(target) {
                self.skipped.insert(fault.outage);
                return false;
            }
        } else {
            self.out.remove(&target);
        }
        match &fault.action {
            FaultAction::Partition(a, b) => sim.partition(a.as_str(), b.as_str()),
            FaultAction::Repair(a, b) => sim.repair(a.as_str(), b.as_str()),
            FaultAction::Hold(a, b) => sim.hold(a.as_str(), b.as_str()),
            FaultAction::Release(a, b) => sim.release(a.as_str(), b.as_str()),
            FaultAction::Crash(h) => sim.crash(h.as_str()),
            FaultAction::Restart(h) => sim.bounce(h.as_str()),
            FaultAction::KvLanesSlow(host, delay) => {
                if let Some(lanes) = self.kv_lanes.get(host) {
                    lanes.set(delay.unwrap_or_default());
                }
            }
        }
        true
    }
}
