//! `lockstep serve --role router|prefill|decode`: one process per role. The router serves the
//! HTTP API through the same app as a single process; a worker serves `/health` and `/metrics`
//! over HTTP and takes peer links on its own port.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use lockstep_core::model::ProvenanceModel;
use lockstep_core::node::{DecodeNode, PrefillNode};
use lockstep_core::pd::{DecodeConfig, PrefillConfig, RouterConfig};
use lockstep_core::sched::SchedConfig;
use lockstep_core::wire::{Endpoint, Incarnation, KvLayout, LinkIdentity, Role, WorkerId};

use super::router::RouterEngineConfig;
use super::worker::WorkerNode;
use crate::engine::{
    EngineConfig, EngineStats, InlineRunner, StepCost, ThreadRunner, first_request_id,
};
use crate::metrics::{Metrics, MetricsRole};
use crate::node;
use crate::peer::{PeerConfig, TcpDial, Transport};
use crate::serve::{self, Device, ServeOptions};
use crate::text::{SyntheticCodec, TextCodec};

/// The data plane's bounds: how long a decode worker's lease lets a prefill worker write, how long
/// one write may take in flight, and how long a whole transfer may take. The binary serves the
/// defaults; the simulator draws other values per seed through the same assembly below.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataPlaneTiming {
    pub lease: Duration,
    pub write_flight_max: Duration,
    pub transfer_deadline: Duration,
}

impl Default for DataPlaneTiming {
    fn default() -> DataPlaneTiming {
        DataPlaneTiming {
            lease: Duration::from_secs(2),
            write_flight_max: Duration::from_secs(1),
            transfer_deadline: Duration::from_secs(60),
        }
    }
}

/// The KV layout peers compare for the provenance executor: one 8-byte value per position
/// (`ProvenanceModel`'s `PageStore`).
pub const PROVENANCE_KV_LAYOUT: KvLayout =
    KvLayout { layers: 1, kv_heads: 1, head_dim: 1, element_bytes: 8 };

/// What peers compare to know they serve the same provenance model.
pub fn provenance_fingerprint(vocab_size: u32) -> u64 {
    fnv1a(format!("provenance|{vocab_size}").as_bytes())
}

/// Transfers a worker runs at once: twice its batch, so the next batch's KV moves while one runs.
pub fn transfers_max(options: &ServeOptions) -> u32 {
    options.max_running * 2
}

/// What a worker's `Hello` tells the router it takes at once (`PeerConfig::places`): a prefill
/// worker its transfers, a decode worker its batch (the router's `--prefill-slots` and
/// `--max-running` bound them further).
pub fn worker_places(role: Role, options: &ServeOptions) -> u32 {
    match role {
        Role::Prefill => transfers_max(options),
        Role::Decode => options.max_running,
        // Takes no transfers; no router reads another's.
        Role::Router => 0,
    }
}

/// A worker's scheduler: the served one, with room in the pool for every transfer's pins.
pub fn worker_sched(options: &ServeOptions, served: &SchedConfig) -> SchedConfig {
    let mut sched = served.clone();
    sched.pool.pins_max = transfers_max(options);
    sched
}

/// The engine of the router started as `incarnation` (its start in milliseconds, which its
/// request ids count from) for the workers `options` names.
pub fn router_engine_config(
    options: &ServeOptions,
    timing: DataPlaneTiming,
    incarnation: Incarnation,
) -> RouterEngineConfig {
    let mut workers = BTreeMap::new();
    workers.extend(options.prefills.iter().map(|(w, _)| (WorkerId(*w), Role::Prefill)));
    workers.extend(options.decodes.iter().map(|(w, _)| (WorkerId(*w), Role::Decode)));
    RouterEngineConfig {
        router: RouterConfig {
            // Past the prefill side's deadline and the lease, counted from the decode worker's
            // last report that the transfer is at work (`live_report_interval`), so the router
            // does not give up on a transfer the workers are still finishing.
            outcome_timeout: timing.transfer_deadline + timing.lease + 2 * timing.write_flight_max,
            requests_max: options.max_waiting
                + options.max_running * options.decodes.len().max(1) as u32,
            retries_max: 2,
            decode_idle_timeout: Duration::from_secs(60),
            decode_slots: options.max_running,
            prefill_slots: options.prefill_slots.max(1),
            queue_wait_max: Duration::from_secs(300),
            busy_backoff: Duration::from_millis(20),
        },
        workers,
        inbox_max: 256,
        submit_wait_max: Duration::from_secs(10),
        check_invariants: options.check_invariants,
        first_request_id: first_request_id(Duration::from_millis(incarnation.0)),
    }
}

/// A prefill or decode worker's state machines, as `role` runs them.
pub fn worker_node(
    role: Role,
    me: Endpoint,
    sched: SchedConfig,
    timing: DataPlaneTiming,
    transfers_max: u32,
) -> Result<WorkerNode, String> {
    match role {
        Role::Prefill => {
            let config = PrefillConfig {
                heartbeat_interval: timing.lease / 4,
                write_flight_max: timing.write_flight_max,
                transfer_deadline: timing.transfer_deadline,
                done_retransmit: Duration::from_millis(500),
                transfers_max,
            };
            PrefillNode::new(me, sched, config).map(WorkerNode::Prefill).map_err(|e| e.to_string())
        }
        Role::Decode => {
            let config = DecodeConfig {
                lease: timing.lease,
                write_flight_max: timing.write_flight_max,
                transfers_max,
                prefix_cache: sched.prefix_cache,
                // Half the prefill side's deadline: the router's outcome timeout (that deadline,
                // a lease and two flights) always hears a report of a transfer still at work.
                live_report_interval: timing.transfer_deadline / 2,
            };
            DecodeNode::new(me, sched, config).map(WorkerNode::Decode).map_err(|e| e.to_string())
        }
        Role::Router => Err("a router is not a worker".into()),
    }
}

/// A worker's HTTP app: `/health` and `/metrics`.
pub fn worker_app(stats: Arc<EngineStats>, metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .with_state((stats, metrics))
}

pub async fn serve(
    options: &ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let role = options.role.ok_or("no --role")?;
    let id = WorkerId(options.worker_id.ok_or("no --worker-id")?);
    let me = Endpoint { worker: id, incarnation: incarnation_now() };
    let served = Served::load(options, role)?;
    let timing = DataPlaneTiming::default();
    let sched = worker_sched(options, &served.sched);
    let identity = LinkIdentity {
        role,
        page_tokens: sched.pool.page_tokens,
        kv_layout: served.kv_layout,
        model: served.fingerprint,
    };
    let metrics = Arc::new(
        Metrics::for_role(&served.name, MetricsRole::Worker)
            .with_grammars(served.codec.grammars().ok()),
    );
    let dial =
        |list: &[(u32, String)]| list.iter().map(|(w, a)| (WorkerId(*w), a.clone())).collect();
    match role {
        Role::Router => {
            let mut peers: Vec<(WorkerId, String)> = dial(&options.prefills);
            peers.extend(dial(&options.decodes));
            let (transport, events) =
                Transport::start(PeerConfig::new(me, identity, peers), TcpDial)
                    .map_err(|e| e.to_string())?;
            let config = router_engine_config(options, timing, me.incarnation);
            let app = serve::app_config(
                options,
                served.name.clone(),
                sched.request_tokens_max,
                served.formats,
            );
            // Opened first, so that a path that cannot be written fails at once.
            let trace = serve::open_trace(options).await?;
            let mut node = node::start_router(config, transport, events, served.codec.clone(), app);
            let recording =
                trace.map(|file| serve::start_recording(&mut node, file)).transpose()?;
            let listener = bind(&options.host, options.port).await?;
            tracing::info!(worker = id.0, port = options.port, "router serving");
            let served = node.serve(listener, shutdown, options.drain_timeout).await;
            serve::finish_recording(recording).await;
            let drained = served.map_err(|e| format!("serving: {e}"))?;
            tracing::info!(?drained, "stopped");
            Ok(())
        }
        Role::Prefill | Role::Decode => {
            let dial_to = if role == Role::Prefill { dial(&options.decodes) } else { Vec::new() };
            let mut peer = PeerConfig::new(me, identity, dial_to);
            peer.places = worker_places(role, options);
            // Small protocol messages go out at once: Nagle's wait for the peer's delayed ACK
            // costs tens of milliseconds per transfer.
            let peer_listener = bind(&options.host, options.peer_port).await?;
            let node = worker_node(role, me, sched.clone(), timing, transfers_max(options))?;
            let (task, stats) = match served.executor {
                Executor::None => return Err("a worker without an executor".into()),
                Executor::Provenance(model) => super::spawn_worker(
                    node,
                    InlineRunner::new(model, StepCost::ZERO),
                    peer,
                    TcpDial,
                    peer_listener,
                    options.check_invariants,
                    metrics.clone(),
                ),
                threaded => {
                    // Page reads and writes of the data plane queue beside the steps.
                    let jobs_max = EngineConfig::new(sched.clone()).executor_jobs_max()
                        + sched.pool.pages_total as usize;
                    super::spawn_worker(
                        node,
                        threaded.thread_runner(jobs_max)?,
                        peer,
                        TcpDial,
                        peer_listener,
                        options.check_invariants,
                        metrics.clone(),
                    )
                }
            }
            .map_err(|e| e.to_string())?;
            let listener = bind(&options.host, options.port).await?;
            tracing::info!(
                worker = id.0,
                ?role,
                port = options.port,
                peer_port = options.peer_port,
                "worker serving"
            );
            let app = worker_app(stats, metrics);
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .map_err(|e| format!("serving: {e}"))?;
            task.abort();
            Ok(())
        }
    }
}

type WorkerState = (Arc<EngineStats>, Arc<Metrics>);

/// Fails once the engine stopped, or holds requests and made no progress for 30 s.
async fn health(State((stats, _)): State<WorkerState>) -> (StatusCode, &'static str) {
    if stats.stopped() {
        (StatusCode::SERVICE_UNAVAILABLE, "the engine stopped")
    } else if stats.requests_held() > 0 && stats.stalled_for() > Duration::from_secs(30) {
        (StatusCode::SERVICE_UNAVAILABLE, "the engine makes no progress")
    } else {
        (StatusCode::OK, "ok")
    }
}

async fn metrics_text(State((_, metrics)): State<WorkerState>) -> String {
    metrics.render()
}

enum Executor {
    /// The router computes nothing.
    None,
    Provenance(ProvenanceModel),
    Cpu(Box<lockstep_gpu::llama::CpuExecutor>),
    #[cfg(feature = "cuda")]
    Cuda(Box<lockstep_gpu::cuda::executor::CudaExecutor>),
}

impl Executor {
    /// A model executor on a thread of its own, its pages open to the data plane.
    fn thread_runner(self, jobs_max: usize) -> Result<ThreadRunner, String> {
        let thread = |e: std::io::Error| format!("starting the executor thread: {e}");
        match self {
            Executor::Cpu(executor) => ThreadRunner::spawn_with_pages(*executor, jobs_max),
            #[cfg(feature = "cuda")]
            Executor::Cuda(executor) => ThreadRunner::spawn_with_pages(*executor, jobs_max),
            Executor::None | Executor::Provenance(_) => {
                return Err("not a model executor".into());
            }
        }
        .map_err(thread)
    }
}

/// What a role serves: the model, its scheduler, its executor and how peers recognize it.
struct Served {
    sched: SchedConfig,
    name: String,
    codec: Arc<dyn TextCodec>,
    formats: serve::OutputFormats,
    executor: Executor,
    kv_layout: KvLayout,
    fingerprint: u64,
}

impl Served {
    fn load(options: &ServeOptions, role: Role) -> Result<Served, String> {
        if options.provenance {
            let sched = options.sched_config(serve::PROVENANCE_CONTEXT, vec![]);
            let model =
                ProvenanceModel::new(sched.pool, sched.running_max, serve::PROVENANCE_VOCAB);
            let name = options.served_model_name.clone().unwrap_or_else(|| "provenance".into());
            return Ok(Served {
                codec: Arc::new(SyntheticCodec::new(serve::PROVENANCE_VOCAB)),
                formats: serve::OutputFormats::new(options, None),
                executor: Executor::Provenance(model),
                kv_layout: PROVENANCE_KV_LAYOUT,
                fingerprint: provenance_fingerprint(serve::PROVENANCE_VOCAB),
                sched,
                name,
            });
        }
        if role != Role::Router {
            options.device.check()?;
        }
        let loaded = serve::load_model(options)?;
        let (executor, kv_layout) = match (role, options.device) {
            // The router needs the tokenizer and template, not the KV: the link check skips it.
            (Role::Router, _) => {
                (Executor::None, KvLayout { layers: 0, kv_heads: 0, head_dim: 0, element_bytes: 0 })
            }
            (_, Device::Cpu) => {
                let executor = serve::cpu_executor(options, &loaded);
                let layout = executor.kv_layout();
                (Executor::Cpu(Box::new(executor)), layout)
            }
            #[cfg(feature = "cuda")]
            (_, Device::Cuda(n)) => {
                let weights = loaded.model.weights.clone();
                let mut executor =
                    serve::cuda_executor(weights, &loaded.sched, n, options.cuda_launch)?;
                if let Some(grammars) = serve::grammars(&loaded.model) {
                    executor = executor.with_grammars(grammars);
                }
                // The CPU executor's page layout: CPU and CUDA workers exchange pages.
                let layout = executor.kv_layout();
                (Executor::Cuda(Box::new(executor)), layout)
            }
            #[cfg(not(feature = "cuda"))]
            (_, Device::Cuda(_)) => return Err(options.device.check().err().unwrap_or_default()),
        };
        // The architecture, its sizes and the end tokens: two workers agreeing on these serve
        // the same model family; weights are not hashed (gigabytes at every start).
        let fingerprint = fnv1a(
            format!(
                "{:?}|{:?}|{}",
                loaded.model.weights.config, loaded.model.stop_tokens, loaded.name
            )
            .as_bytes(),
        );
        Ok(Served {
            kv_layout,
            executor,
            sched: loaded.sched,
            name: loaded.name,
            codec: loaded.codec,
            formats: loaded.formats,
            fingerprint,
        })
    }
}

async fn bind(
    host: &str,
    port: u16,
) -> Result<
    axum::serve::TapIo<
        tokio::net::TcpListener,
        impl FnMut(&mut tokio::net::TcpStream) + Send + 'static,
    >,
    String,
> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| format!("binding {host}:{port}: {e}"))?;
    Ok(axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    }))
}

/// A new incarnation for every start: the wall clock in milliseconds, which grows across restarts
/// of one worker (the IO edge: the one clock read outside tokio's).
fn incarnation_now() -> Incarnation {
    #[allow(clippy::disallowed_methods)]
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Incarnation(now.as_millis() as u64)
}

/// FNV-1a: stable across builds and platforms, unlike the std hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
