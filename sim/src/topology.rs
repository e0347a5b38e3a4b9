//! The deployment a run simulates, built from the server's own pieces: each turmoil host runs
//! what `lockstep serve` runs for its role (the engine loop or the router's engine, the peer
//! transport, the axum app), assembled through `roles::launch`'s functions, with turmoil's network
//! in place of tokio's (`net`) and the simulated device in place of the CPU executor (`device`).
//! A crashed host restarts as a new incarnation, as a restarted process would.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::ProvenanceModel;
use lockstep_core::sched::SchedConfig;
use lockstep_core::wire::{Endpoint, Incarnation, LinkIdentity, Role, WorkerId};
use lockstep_server::engine::{EngineConfig, EngineStats, InlineRunner, first_request_id};
use lockstep_server::http::AppConfig;
use lockstep_server::metrics::{Metrics, MetricsRole};
use lockstep_server::node;
use lockstep_server::peer::{PeerConfig, Transport};
use lockstep_server::roles::launch::{
    PROVENANCE_KV_LAYOUT, provenance_fingerprint, router_engine_config, transfers_max, worker_app,
    worker_node, worker_places, worker_sched,
};
use lockstep_server::roles::spawn_worker;
use lockstep_server::serve::ServeOptions;
use lockstep_server::text::SyntheticCodec;

use crate::device::{CostModel, SlowRunner, SlowSteps};
use crate::events::{Event, EventLog};
use crate::knobs::{Knobs, Topology};
use crate::net::{TurmoilDial, TurmoilListener};
use crate::rng::SimRng;
use crate::sabotage::Sabotage;
use crate::slow_lane::KvLaneDelay;

pub const HTTP_PORT: u16 = 8000;
pub const PEER_PORT: u16 = 9000;
const MODEL_NAME: &str = "provenance";

/// What a run needs to know of the hosts it built.
#[derive(Clone, Debug)]
pub struct Deployment {
    /// The host clients send HTTP requests to.
    pub entry: String,
    /// Every server host, in a fixed order.
    pub hosts: Vec<String>,
    /// Pairs of hosts that talk to each other (partition and hold targets).
    pub links: Vec<(String, String)>,
    /// Workers: hosts that may crash and restart, as `entry` may.
    pub workers: Vec<String>,
    /// Each prefill host's KV lanes, by host: what the slow-KV-lane fault slows.
    pub kv_lanes: BTreeMap<String, KvLaneDelay>,
    pub probes: Probes,
}

/// Each host's engine statistics, replaced at every (re)start: what the leak oracle reads.
#[derive(Clone, Debug, Default)]
pub struct Probes(Arc<Mutex<BTreeMap<String, Probe>>>);

#[derive(Clone, Debug)]
pub struct Probe {
    /// This life's.
    pub stats: Arc<EngineStats>,
    /// How many times the host has started.
    pub starts: u32,
    /// Transfers its earlier lives retried (a router's).
    pub retried_before: u64,
}

impl Probe {
    /// Transfers every life of the host retried.
    pub fn transfers_retried(&self) -> u64 {
        self.retried_before + self.stats.transfers_retried()
    }
}

impl Probes {
    fn started(&self, host: &str, stats: Arc<EngineStats>, log: &EventLog) {
        log.log(Event::Started { host: host.to_owned() });
        let mut probes = self.0.lock().expect("hosts run one at a time");
        let earlier = probes.get(host);
        let starts = earlier.map_or(0, |p| p.starts) + 1;
        let retried_before = earlier.map_or(0, Probe::transfers_retried);
        probes.insert(host.to_owned(), Probe { stats, starts, retried_before });
    }

    pub fn snapshot(&self) -> BTreeMap<String, Probe> {
        self.0.lock().expect("hosts run one at a time").clone()
    }
}

/// Everything a host's software is built from; cloned into each host's start closure.
#[derive(Clone, Debug)]
struct HostSetup {
    options: ServeOptions,
    sched: SchedConfig,
    knobs: Knobs,
    cost: CostModel,
    slow: SlowSteps,
    kv_lanes: BTreeMap<String, KvLaneDelay>,
    sabotage: Option<Sabotage>,
    vocab: u32,
    seed: u64,
    probes: Probes,
    log: EventLog,
}

/// Registers the deployment's hosts on `sim`.
#[allow(clippy::too_many_arguments)]
pub fn install(
    sim: &mut turmoil::Sim<'_>,
    topology: Topology,
    knobs: &Knobs,
    cost: CostModel,
    slow: SlowSteps,
    sabotage: Option<Sabotage>,
    vocab: u32,
    seed: u64,
    log: EventLog,
) -> Deployment {
    let (prefills, decodes) = topology.workers();
    let prefill_hosts: Vec<String> = (1..=prefills).map(|i| format!("prefill{i}")).collect();
    let decode_hosts: Vec<String> = (1..=decodes).map(|i| format!("decode{i}")).collect();
    let mut options = serve_options(knobs);
    options.prefills = prefill_hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (prefill_id(i), format!("{h}:{PEER_PORT}")))
        .collect();
    options.decodes = decode_hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (decode_id(i), format!("{h}:{PEER_PORT}")))
        .collect();
    let mut sched = options.sched_config(knobs.context_tokens, vec![]);
    sched.capture_sizes = knobs.capture_sizes.clone();
    let probes = Probes::default();
    let kv_lanes: BTreeMap<String, KvLaneDelay> =
        prefill_hosts.iter().map(|h| (h.clone(), KvLaneDelay::default())).collect();
    let setup = HostSetup {
        options,
        sched,
        knobs: knobs.clone(),
        cost,
        slow,
        kv_lanes: kv_lanes.clone(),
        sabotage,
        vocab,
        seed,
        probes: probes.clone(),
        log,
    };
    if topology == Topology::Single {
        let s = setup;
        sim.host("server", move || single(s.clone()));
        return Deployment {
            entry: "server".into(),
            hosts: vec!["server".into()],
            links: vec![],
            workers: vec![],
            kv_lanes,
            probes,
        };
    }
    let s = setup.clone();
    sim.host("router", move || router(s.clone()));
    for (i, host) in prefill_hosts.iter().enumerate() {
        let (s, name) = (setup.clone(), host.clone());
        sim.host(host.as_str(), move || {
            worker(s.clone(), name.clone(), Role::Prefill, prefill_id(i))
        });
    }
    for (i, host) in decode_hosts.iter().enumerate() {
        let (s, name) = (setup.clone(), host.clone());
        sim.host(host.as_str(), move || {
            worker(s.clone(), name.clone(), Role::Decode, decode_id(i))
        });
    }
    let workers: Vec<String> = prefill_hosts.iter().chain(&decode_hosts).cloned().collect();
    let mut links: Vec<(String, String)> =
        workers.iter().map(|w| ("router".to_owned(), w.clone())).collect();
    let data_links: Vec<(String, String)> = prefill_hosts
        .iter()
        .flat_map(|p| decode_hosts.iter().map(move |d| (p.clone(), d.clone())))
        .collect();
    links.extend(data_links.iter().cloned());
    let mut hosts = vec!["router".to_owned()];
    hosts.extend(workers.iter().cloned());
    Deployment { entry: "router".into(), hosts, links, workers, kv_lanes, probes }
}

fn prefill_id(i: usize) -> u32 {
    10 + i as u32
}

fn decode_id(i: usize) -> u32 {
    20 + i as u32
}

/// The options a command line would give `lockstep serve --executor provenance` with these
/// knobs, invariants checked after every input.
fn serve_options(knobs: &Knobs) -> ServeOptions {
    let mut options = ServeOptions::parse(&["--executor".into(), "provenance".into()])
        .expect("the provenance executor needs no model");
    options.max_running = knobs.max_running;
    options.max_waiting = knobs.max_waiting;
    options.kv_pages = knobs.kv_pages;
    options.page_tokens = knobs.page_tokens;
    options.step_tokens = knobs.step_tokens;
    options.prefill_chunk_tokens = Some(knobs.prefill_chunk_tokens);
    options.scored_tokens = knobs.scored_tokens;
    options.overlap = knobs.overlap;
    options.prefix_cache = knobs.prefix_cache;
    options.prefill_slots = knobs.prefill_slots;
    options.check_invariants = true;
    options.seed = Some(0);
    options
}

fn app_config(setup: &HostSetup) -> AppConfig {
    let mut app = AppConfig::new(MODEL_NAME, setup.sched.request_tokens_max);
    app.seed = setup.seed;
    // Requests take the priority their trace gives them (all 0: arrival order).
    app.priority_scheduling = true;
    app
}

fn any_address(port: u16) -> (IpAddr, u16) {
    (IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
}

/// A new incarnation at every start: virtual milliseconds since the run began, plus one.
fn incarnation_now() -> Incarnation {
    Incarnation(turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64 + 1)
}

fn device(
    setup: &HostSetup,
    pool: PoolConfig,
    host: &str,
    starts: u32,
) -> SlowRunner<InlineRunner<ProvenanceModel>> {
    let model = ProvenanceModel::new(pool, setup.sched.running_max, setup.vocab);
    let salt = format!("slow-steps/{host}/{starts}");
    SlowRunner::new(
        InlineRunner::new(model, setup.cost.step_cost()),
        setup.slow,
        setup.sabotage,
        SimRng::stream(setup.seed, &salt),
        SimRng::stream(setup.seed, &format!("failed-steps/{host}/{starts}")),
        host.to_owned(),
        setup.log.clone(),
    )
}

fn starts_so_far(setup: &HostSetup, host: &str) -> u32 {
    setup.probes.snapshot().get(host).map_or(0, |p| p.starts)
}

/// One process serving everything: `lockstep serve`.
async fn single(setup: HostSetup) -> turmoil::Result {
    let mut engine = EngineConfig::new(setup.sched.clone());
    engine.check_invariants = true;
    engine.first_request_id = first_request_id(turmoil::sim_elapsed().unwrap_or_default());
    let runner = device(&setup, setup.sched.pool, "server", starts_so_far(&setup, "server"));
    let codec = Arc::new(SyntheticCodec::new(setup.vocab));
    let node = node::start(engine, runner, codec, app_config(&setup))?;
    setup.probes.started("server", node.state.engine.shared_stats(), &setup.log);
    let listener = TurmoilListener::bind(any_address(HTTP_PORT)).await?;
    node.serve(listener, std::future::pending(), Duration::from_secs(1)).await?;
    Ok(())
}

/// `lockstep serve --role router`.
async fn router(setup: HostSetup) -> turmoil::Result {
    let me = Endpoint { worker: WorkerId(1), incarnation: incarnation_now() };
    let identity = identity(&setup, Role::Router);
    let mut peers = setup.options.prefills.clone();
    peers.extend(setup.options.decodes.iter().cloned());
    let peers = peers.into_iter().map(|(w, a)| (WorkerId(w), a)).collect();
    let (transport, events) =
        Transport::start(PeerConfig::new(me, identity, peers), TurmoilDial::default())?;
    let config = router_engine_config(&setup.options, setup.knobs.timing, me.incarnation);
    let codec = Arc::new(SyntheticCodec::new(setup.vocab));
    let node = node::start_router(config, transport, events, codec, app_config(&setup));
    setup.probes.started("router", node.state.engine.shared_stats(), &setup.log);
    let listener = TurmoilListener::bind(any_address(HTTP_PORT)).await?;
    node.serve(listener, std::future::pending(), Duration::from_secs(1)).await?;
    Ok(())
}

/// `lockstep serve --role prefill|decode`.
async fn worker(setup: HostSetup, host: String, role: Role, id: u32) -> turmoil::Result {
    let me = Endpoint { worker: WorkerId(id), incarnation: incarnation_now() };
    let mut sched = worker_sched(&setup.options, &setup.sched);
    if role == Role::Prefill {
        // Its own `--kv-pages`, as separate processes have: a prefill pool smaller than the
        // decode side's is what squeezes prompts on the prefill worker.
        sched.pool.pages_total = setup.knobs.prefill_kv_pages;
    }
    let dial = if role == Role::Prefill {
        setup.options.decodes.iter().map(|(w, a)| (WorkerId(*w), a.clone())).collect()
    } else {
        Vec::new()
    };
    let mut peer = PeerConfig::new(me, identity(&setup, role), dial);
    peer.places = worker_places(role, &setup.options);
    let pool = sched.pool;
    let node = worker_node(role, me, sched, setup.knobs.timing, transfers_max(&setup.options))?;
    let runner = device(&setup, pool, &host, starts_so_far(&setup, &host));
    let peer_listener = TurmoilListener::bind(any_address(PEER_PORT)).await?;
    let metrics = Arc::new(Metrics::for_role(MODEL_NAME, MetricsRole::Worker));
    let dial = match setup.kv_lanes.get(&host) {
        Some(delay) => TurmoilDial::slowing_kv_lanes(delay.clone()),
        None => TurmoilDial::default(),
    };
    let (task, stats) =
        spawn_worker(node, runner, peer, dial, peer_listener, true, metrics.clone())?;
    setup.probes.started(&host, stats.clone(), &setup.log);
    let listener = TurmoilListener::bind(any_address(HTTP_PORT)).await?;
    axum::serve(listener, worker_app(stats, metrics)).await?;
    task.abort();
    Ok(())
}

fn identity(setup: &HostSetup, role: Role) -> LinkIdentity {
    LinkIdentity {
        role,
        page_tokens: setup.sched.pool.page_tokens,
        kv_layout: PROVENANCE_KV_LAYOUT,
        model: provenance_fingerprint(setup.vocab),
    }
}
