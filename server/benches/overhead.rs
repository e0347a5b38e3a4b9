//! The server's own overhead (issue 8): lockstep's whole serving path with an executor that does
//! no work, against a bare axum SSE endpoint that streams the same events with no engine, side by
//! side in one process.
//!
//! - lockstep: a node on 127.0.0.1 running `InstantExecutor` (token `(position % 1000) + 1` for
//!   each sampling row, nothing else) through `InlineRunner` with `StepCost::ZERO`, scheduler
//!   sized for 256 running requests.
//! - bare: `POST /v1/completions` on axum that reads `max_tokens` from the body and streams that
//!   many chunks shaped as lockstep's (same fields, same text, so the same size), a final chunk
//!   and `[DONE]`, serializing each as it goes.
//!
//! 256 clients (the crate's hyper client over tokio `TcpStream`, one keep-alive connection each
//! per server) each stream 64 tokens from a short prompt, all at once, for `ROUNDS` rounds that
//! alternate between the two servers, so a noisy neighbour hits both alike. Reported: streamed
//! tokens/s of each, their ratio (target lockstep / bare >= 0.5), and what lockstep adds to the
//! time to the first event and to a request's duration (mean and p99). A benchmark, never an
//! assert on time; it does check that every stream carried its 64 tokens.
//!
//! `cargo bench -p lockstep-server --bench overhead`. Time is tokio's clock (`Instant::now` of
//! std is banned in the workspace; this is the IO edge).

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::{Listener, ListenerExt};
use futures_util::StreamExt;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{ExecError, Executor, SamplingSpec};
use lockstep_core::sched::{RequestId, SchedConfig, StepMode, StepOutputs, StepPlan};
use lockstep_server::client::Connection;
use lockstep_server::engine::{EngineConfig, InlineRunner, StepCost, StepResult, StepRunner};
use lockstep_server::http::AppConfig;
use lockstep_server::node;
use lockstep_server::text::SyntheticCodec;
use serde_json::{Value, json};
use tokio::time::Instant;

/// Concurrent streaming clients, and tokens each asks for.
const CLIENTS: usize = 256;
const TOKENS: u32 = 64;
const PROMPT_TOKENS: u32 = 8;
/// Measured rounds per server, after one warm-up round each.
const ROUNDS: usize = 30;
const VOCAB: u32 = 32_000;
const CONTEXT: u32 = 2048;
const MODEL: &str = "overhead";
/// Events per stream: one per token, the final chunk, `[DONE]`.
const EVENTS: usize = TOKENS as usize + 2;

/// Samples `(position % 1000) + 1` for each sampling row; nothing else.
#[derive(Debug)]
struct InstantExecutor;

impl Executor for InstantExecutor {
    fn start_request(&mut self, _request: RequestId, _spec: SamplingSpec) {}

    fn end_request(&mut self, _request: RequestId) {}

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        let sampled = plan
            .rows
            .iter()
            .filter(|r| r.sample)
            .map(|r| (r.positions.end - 1) % 1000 + 1)
            .collect();
        Ok(StepOutputs::tokens(plan.step, sampled))
    }
}

fn sched_config() -> SchedConfig {
    SchedConfig {
        // 256 requests of 72 tokens need 5 pages of 16 each: 1,280 of 4,096.
        pool: PoolConfig { pages_total: 4096, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 512,
        running_max: 256,
        step_tokens_max: 4096,
        prefill_chunk_tokens_max: 512,
        scored_tokens_max: 512,
        request_tokens_max: CONTEXT,
        capture_sizes: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    }
}

/// Serves `router`-like apps with Nagle off, as `axum::serve` on a plain address does: both
/// servers take the same listener.
async fn listener() -> impl Listener<Addr = SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
    listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    })
}

/// Like `InlineRunner` with `StepCost::ZERO`, except that a step is done the moment it is
/// launched instead of at a timer set for its end, which tokio rounds up to the next
/// millisecond. A diagnostic only (`OVERHEAD_RUNNER=ready`): it shows what that floor of about
/// 1 ms a step costs.
#[derive(Debug)]
struct ReadyRunner {
    executor: InstantExecutor,
    done: VecDeque<StepResult>,
}

impl StepRunner for ReadyRunner {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.executor.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.executor.end_request(request);
    }

    fn launch(&mut self, plan: StepPlan) {
        let result = self.executor.execute(&plan);
        self.done.push_back((plan.step, result));
    }

    fn completed(&mut self) -> Pin<Box<dyn Future<Output = StepResult> + Send + '_>> {
        Box::pin(async move {
            match self.done.pop_front() {
                Some(result) => result,
                None => std::future::pending().await,
            }
        })
    }
}

async fn start_lockstep() -> SocketAddr {
    let sched = sched_config();
    let mut engine = EngineConfig::new(sched);
    engine.inbox_max = 2 * CLIENTS;
    let codec = Arc::new(SyntheticCodec::new(VOCAB));
    let app = AppConfig::new(MODEL, CONTEXT);
    let node = if std::env::var("OVERHEAD_RUNNER").is_ok_and(|r| r == "ready") {
        println!("diagnostic: ReadyRunner instead of InlineRunner");
        let runner = ReadyRunner { executor: InstantExecutor, done: VecDeque::new() };
        node::start(engine, runner, codec, app)
    } else {
        node::start(engine, InlineRunner::new(InstantExecutor, StepCost::ZERO), codec, app)
    };
    let node = node.expect("a valid node");
    let listener = listener().await;
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        let never = std::future::pending::<()>();
        let _ = node.serve(listener, never, Duration::from_secs(1)).await;
    });
    addr
}

/// The bare endpoint: lockstep's chunks without lockstep.
async fn bare_completions(body: Bytes) -> Response {
    static REQUESTS: AtomicU64 = AtomicU64::new(1);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let max_tokens = request["max_tokens"].as_u64().unwrap_or(16);
    let prompt = request["prompt"].as_array().map_or(1, Vec::len).max(1) as u64;
    let id = format!("cmpl-{}", REQUESTS.fetch_add(1, Ordering::Relaxed));
    let chunk = move |text: String, finish: Value| {
        let body = json!({
            "id": id,
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{ "index": 0, "text": text, "logprobs": null, "finish_reason": finish }],
        });
        Ok::<_, std::convert::Infallible>(Event::default().data(body.to_string()))
    };
    // As the instant executor: the token at position p is (p % 1000) + 1.
    let tokens = (0..max_tokens).map(move |i| (prompt - 1 + i) % 1000 + 1);
    let events = futures_util::stream::iter(tokens.map(Some).chain([None]))
        .map(move |token| match token {
            Some(t) => chunk(format!(" t{t}"), Value::Null),
            None => chunk(String::new(), json!("length")),
        })
        .chain(futures_util::stream::once(async { Ok(Event::default().data("[DONE]")) }));
    Sse::new(events).into_response()
}

async fn start_bare() -> SocketAddr {
    let listener = listener().await;
    let addr = listener.local_addr().expect("an address");
    let app = Router::new().route("/v1/completions", post(bare_completions));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// One streamed request as the client saw it.
#[derive(Clone, Copy, Debug)]
struct Timing {
    first_event: Duration,
    duration: Duration,
}

async fn connect(addr: SocketAddr) -> Connection {
    let io = tokio::net::TcpStream::connect(addr).await.expect("connect");
    io.set_nodelay(true).expect("nodelay");
    Connection::new(io).await.expect("handshake")
}

/// Streams one request to its end, counting complete events; panics unless it carried
/// `EVENTS`, `TOKENS` of them tokens.
async fn stream_one(connection: &mut Connection, body: &str) -> Timing {
    let sent = Instant::now();
    let mut response = connection.post("/v1/completions", body).await.expect("send");
    assert_eq!(response.status.as_u16(), 200);
    let (mut first, mut events, mut tokens) = (None, 0, 0);
    let mut pending: Vec<u8> = Vec::new();
    while let Some(frame) = response.frame().await.expect("a frame") {
        first.get_or_insert_with(Instant::now);
        pending.extend_from_slice(&frame);
        let mut start = 0;
        while let Some(end) = pending[start..].windows(2).position(|w| w == b"\n\n") {
            let event = &pending[start..start + end];
            events += 1;
            tokens += usize::from(contains(event, b"\"finish_reason\":null"));
            start += end + 2;
        }
        pending.drain(..start);
    }
    let end = Instant::now();
    assert_eq!((events, tokens), (EVENTS, TOKENS as usize), "a stream's events");
    let first = first.expect("at least one frame");
    Timing { first_event: first - sent, duration: end - sent }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The body client `c` sends: a short prompt of its own.
fn request_body(c: usize) -> String {
    let prompt: Vec<u32> = (0..PROMPT_TOKENS).map(|i| (c as u32 * 31 + i * 7) % VOCAB).collect();
    json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string()
}

/// One round: every client streams one request at once. Its wall time and the timings.
async fn round(clients: &mut Vec<Connection>) -> (Duration, Vec<Timing>) {
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .drain(..)
        .enumerate()
        .map(|(c, mut connection)| {
            tokio::spawn(async move {
                let timing = stream_one(&mut connection, &request_body(c)).await;
                (connection, timing)
            })
        })
        .collect();
    let mut timings = Vec::with_capacity(tasks.len());
    for task in tasks {
        let (connection, timing) = task.await.expect("a client task");
        clients.push(connection);
        timings.push(timing);
    }
    (start.elapsed(), timings)
}

/// One measure of a `Timing`.
type Field = fn(&Timing) -> Duration;

/// All rounds of one server.
#[derive(Debug, Default)]
struct Side {
    wall: Duration,
    timings: Vec<Timing>,
}

impl Side {
    fn tokens_per_s(&self) -> f64 {
        (self.timings.len() * TOKENS as usize) as f64 / self.wall.as_secs_f64()
    }

    fn stat(&self, f: Field) -> (f64, f64) {
        let mut v: Vec<Duration> = self.timings.iter().map(f).collect();
        v.sort_unstable();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mean = ms(v.iter().sum::<Duration>()) / v.len() as f64;
        let p99 = ms(v[(v.len() * 99).div_ceil(100).max(1) - 1]);
        (mean, p99)
    }
}

async fn connections(addr: SocketAddr) -> Vec<Connection> {
    let mut all = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        all.push(connect(addr).await);
    }
    all
}

/// A chunk of each server, to show that their payloads are the same size.
async fn sample_chunk(addr: SocketAddr) -> String {
    let mut c = connect(addr).await;
    let events = c
        .post("/v1/completions", &request_body(0))
        .await
        .expect("send")
        .events()
        .await
        .expect("events");
    events.into_iter().next().expect("a chunk")
}

async fn bench() {
    let (lockstep_addr, bare_addr) = (start_lockstep().await, start_bare().await);
    let (l_chunk, b_chunk) = (sample_chunk(lockstep_addr).await, sample_chunk(bare_addr).await);
    println!("lockstep chunk ({} bytes): {l_chunk}", l_chunk.len());
    println!("bare chunk     ({} bytes): {b_chunk}", b_chunk.len());
    // For profiling one side alone: OVERHEAD_ONLY=lockstep or OVERHEAD_ONLY=bare.
    let only = std::env::var("OVERHEAD_ONLY").ok();
    let mut lockstep_clients = connections(lockstep_addr).await;
    let mut bare_clients = connections(bare_addr).await;
    let (mut lockstep, mut bare) = (Side::default(), Side::default());
    for r in 0..=ROUNDS {
        // Round 0 warms both up and is not counted.
        for (clients, side, name) in [
            (&mut lockstep_clients, &mut lockstep, "lockstep"),
            (&mut bare_clients, &mut bare, "bare"),
        ] {
            if only.as_deref().is_some_and(|o| o != name) {
                continue;
            }
            let (wall, timings) = round(clients).await;
            let tokens_per_s = (CLIENTS * TOKENS as usize) as f64 / wall.as_secs_f64();
            println!(
                "round {r} {name:<8} {:>8.1} ms  {tokens_per_s:>10.0} tokens/s",
                wall.as_secs_f64() * 1e3
            );
            if r > 0 {
                side.wall += wall;
                side.timings.extend(timings);
            }
        }
    }
    if only.is_none() {
        report(&lockstep, &bare);
    }
}

fn report(lockstep: &Side, bare: &Side) {
    let (l, b) = (lockstep.tokens_per_s(), bare.tokens_per_s());
    println!();
    println!("{CLIENTS} clients x {TOKENS} tokens, {ROUNDS} rounds each");
    println!("| | lockstep | bare axum SSE | lockstep - bare |");
    println!("|---|---|---|---|");
    println!("| streamed tokens/s | {l:.0} | {b:.0} | ratio {:.2} (target >= 0.5) |", l / b);
    let first_event: Field = |t| t.first_event;
    let duration: Field = |t| t.duration;
    let rows = [("time to first event", first_event), ("request duration", duration)];
    for (name, f) in rows {
        let ((lm, lp), (bm, bp)) = (lockstep.stat(f), bare.stat(f));
        println!(
            "| {name}, mean / p99 | {lm:.2} / {lp:.2} ms | {bm:.2} / {bp:.2} ms | {:+.2} / {:+.2} ms |",
            lm - bm,
            lp - bp
        );
    }
}

fn main() {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    runtime.block_on(bench());
}
