//! Nodes on real sockets (127.0.0.1, a free port) for the end-to-end tests, test executors, and
//! a client that speaks to them.

#![allow(dead_code, reason = "each test file uses part")]
#![allow(clippy::unwrap_used, reason = "test helpers: a failure is the test failing")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{ExecError, Executor, ProvenanceModel, SamplingSpec};
use lockstep_core::sched::{RequestId, SchedConfig, StepMode, StepOutputs, StepPlan};
use lockstep_server::client::Connection;
use lockstep_server::engine::{EngineConfig, EngineStats, InlineRunner, StepCost, StepRunner};
use lockstep_server::http::{AppConfig, AppState};
use lockstep_server::node::{self, Drained};
use lockstep_server::text::{SyntheticCodec, TextCodec};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const VOCAB: u32 = 1000;

/// A counter's value in a Prometheus text page (its first line, whatever its labels).
pub fn counter(page: &str, name: &str) -> u64 {
    let line = page.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}
pub const CONTEXT: u32 = 256;

pub fn sched_config(mode: StepMode) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 256, page_tokens: 4, pins_max: 0 },
        mode,
        waiting_max: 32,
        running_max: 8,
        step_tokens_max: 64,
        prefill_chunk_tokens_max: 16,
        scored_tokens_max: 16,
        request_tokens_max: CONTEXT,
        capture_sizes: vec![1, 2, 4, 8],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: Option<oneshot::Sender<()>>,
    pub served: JoinHandle<std::io::Result<Drained>>,
}

impl TestServer {
    pub async fn start<R: StepRunner>(
        engine: EngineConfig,
        runner: R,
        codec: Arc<dyn TextCodec>,
        app: AppConfig,
    ) -> TestServer {
        let node = node::start(engine, runner, codec, app).unwrap();
        Self::serve(node).await
    }

    /// Serves a node that is already started (a single engine or a router) on a free port.
    pub async fn serve(node: node::Node) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = node.state.clone();
        let (shutdown, signal) = oneshot::channel::<()>();
        let served = tokio::spawn(async move {
            let signal = async move {
                let _ = signal.await;
            };
            node.serve(listener, signal, Duration::from_secs(5)).await
        });
        TestServer { addr, state, shutdown: Some(shutdown), served }
    }

    /// A provenance-model node: synthetic vocabulary, invariants checked after every input.
    pub async fn provenance(mode: StepMode, cost: StepCost) -> TestServer {
        let config = sched_config(mode);
        Self::provenance_with(config, cost, |_| {}).await
    }

    pub async fn provenance_with(
        config: SchedConfig,
        cost: StepCost,
        tweak: impl FnOnce(&mut AppConfig),
    ) -> TestServer {
        let model = ProvenanceModel::new(config.pool, config.running_max, VOCAB);
        Self::with_executor(config, model, cost, tweak).await
    }

    pub async fn with_executor<E: Executor + Send + 'static>(
        config: SchedConfig,
        executor: E,
        cost: StepCost,
        tweak: impl FnOnce(&mut AppConfig),
    ) -> TestServer {
        let mut engine = EngineConfig::new(config.clone());
        engine.check_invariants = true;
        let mut app = AppConfig::new("test-model", config.request_tokens_max);
        tweak(&mut app);
        let codec = Arc::new(SyntheticCodec::new(VOCAB));
        TestServer::start(engine, InlineRunner::new(executor, cost), codec, app).await
    }

    pub fn stats(&self) -> &EngineStats {
        self.state.engine.stats()
    }

    /// Waits (at most 10 s) until the engine holds no request and no page.
    pub async fn quiescent(&self) {
        for _ in 0..1000 {
            if self.stats().requests_held() == 0 && self.stats().pages_held() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "not quiescent: {} requests and {} pages held",
            self.stats().requests_held(),
            self.stats().pages_held()
        );
    }

    pub async fn shut_down(mut self) -> Drained {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.served.await.unwrap().unwrap()
    }

    pub async fn connect(&self) -> Connection {
        let io = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        Connection::new(io).await.unwrap()
    }

    /// POSTs JSON; the status and the body as JSON.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut c = self.connect().await;
        let response = c.post(path, &body.to_string()).await.unwrap();
        let status = response.status.as_u16();
        (status, response.json().await.unwrap())
    }

    /// POSTs a streaming request; every event's JSON, `[DONE]` checked last and left out.
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let mut c = self.connect().await;
        let response = c.post(path, &body.to_string()).await.unwrap();
        assert_eq!(response.status.as_u16(), 200);
        let mut events = response.events().await.unwrap();
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "a stream ends with [DONE]");
        events.iter().map(|e| serde_json::from_str(e).unwrap()).collect()
    }

    /// POSTs JSON from a task of its own, on a connection of its own: many of these at once
    /// make a crowd. The task yields the body as JSON.
    pub fn post_in_task(&self, path: &'static str, body: Value) -> JoinHandle<Value> {
        let addr = self.addr;
        tokio::spawn(async move {
            let io = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut c = Connection::new(io).await.unwrap();
            c.post(path, &body.to_string()).await.unwrap().json().await.unwrap()
        })
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let mut c = self.connect().await;
        let response = c.get(path).await.unwrap();
        let status = response.status.as_u16();
        (status, response.text().await.unwrap())
    }
}

/// A stream's text, chunk by chunk (`text` of completions, `delta.content` of chat).
pub fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["text"].as_str().or_else(|| c["delta"]["content"].as_str()))
        .collect()
}

/// Emits a fixed token sequence for every request, then `eos`: for output the default model
/// cannot be made to produce (tool-call markup of every format). Reads no KV.
#[derive(Debug)]
pub struct ScriptedExecutor {
    pub script: Vec<u32>,
    pub eos: u32,
    emitted: BTreeMap<RequestId, usize>,
}

impl ScriptedExecutor {
    pub fn new(script: Vec<u32>, eos: u32) -> ScriptedExecutor {
        ScriptedExecutor { script, eos, emitted: BTreeMap::new() }
    }
}

impl Executor for ScriptedExecutor {
    fn start_request(&mut self, request: RequestId, _spec: SamplingSpec) {
        self.emitted.insert(request, 0);
    }

    fn end_request(&mut self, request: RequestId) {
        self.emitted.remove(&request);
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        let mut sampled = Vec::new();
        for row in plan.rows.iter().filter(|r| r.sample) {
            let n = self
                .emitted
                .get_mut(&row.request)
                .ok_or_else(|| ExecError(format!("{} never started", row.request)))?;
            sampled.push(self.script.get(*n).copied().unwrap_or(self.eos));
            *n += 1;
        }
        Ok(StepOutputs::tokens(plan.step, sampled))
    }
}

/// The provenance model, except that a step with a row of a request seeded `POISON_SEED` fails
/// (or panics, when `panic` is set): a stand-in for a kernel fault.
#[derive(Debug)]
pub struct FailingExecutor {
    pub inner: ProvenanceModel,
    pub panic: bool,
    poisoned: Vec<RequestId>,
}

pub const POISON_SEED: u64 = 666;

impl FailingExecutor {
    pub fn new(inner: ProvenanceModel, panic: bool) -> FailingExecutor {
        FailingExecutor { inner, panic, poisoned: Vec::new() }
    }
}

impl Executor for FailingExecutor {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        if spec.sampling.seed == POISON_SEED {
            self.poisoned.push(request);
        }
        self.inner.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.poisoned.retain(|&r| r != request);
        self.inner.end_request(request);
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        if plan.rows.iter().any(|r| self.poisoned.contains(&r.request)) {
            if self.panic {
                panic!("injected fault");
            }
            return Err(ExecError("injected fault".into()));
        }
        self.inner.execute(plan)
    }
}
