//! Router + prefill worker + decode worker on 127.0.0.1, each with its own transport, engine and
//! provenance model, talking over real TCP: what goes through them equals what one process
//! gives; concurrent multi-turn sessions with shared prefixes equal their runs one at a time;
//! clients that leave mid-transfer leave nothing held on either worker; a decode worker killed
//! mid-transfer ends every request within the bound and the prefill side's pages come back.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{TestServer, VOCAB, sched_config};
use lockstep_core::model::ProvenanceModel;
use lockstep_core::node::{DecodeNode, PrefillNode};
use lockstep_core::pd::{DecodeConfig, PrefillConfig, RouterConfig};
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_core::wire::{Endpoint, Incarnation, KvLayout, LinkIdentity, Role, WorkerId};
use lockstep_server::engine::{EngineStats, InlineRunner, StepCost};
use lockstep_server::http::AppConfig;
use lockstep_server::metrics::{Metrics, MetricsRole};
use lockstep_server::node;
use lockstep_server::peer::{PeerConfig, TcpDial, Transport};
use lockstep_server::roles::router::RouterEngineConfig;
use lockstep_server::roles::spawn_worker;
use lockstep_server::roles::worker::WorkerNode;
use lockstep_server::text::SyntheticCodec;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

const ROUTER: WorkerId = WorkerId(0);
const PREFILL: WorkerId = WorkerId(1);
const DECODE: WorkerId = WorkerId(2);

fn at(worker: WorkerId) -> Endpoint {
    Endpoint { worker, incarnation: Incarnation(1) }
}

fn identity(role: Role) -> LinkIdentity {
    // The provenance model keeps one 8-byte value per position.
    let kv_layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 1, element_bytes: 8 };
    LinkIdentity { role, page_tokens: 4, kv_layout, model: 0x1234 }
}

fn sched(mode: StepMode) -> SchedConfig {
    let mut config = sched_config(mode);
    config.pool.pins_max = 64;
    config
}

fn peer(me: WorkerId, role: Role, dial: Vec<(WorkerId, String)>) -> PeerConfig {
    let mut config = PeerConfig::new(at(me), identity(role), dial);
    config.ping_interval = Duration::from_millis(50);
    config.dead_after = Duration::from_millis(300);
    config.backoff_min = Duration::from_millis(10);
    config.backoff_max = Duration::from_millis(100);
    config
}

const LEASE_MS: u64 = 200;

struct Cluster {
    router: TestServer,
    prefill_metrics: Arc<Metrics>,
    prefill: (JoinHandle<()>, Arc<EngineStats>),
    decode: (JoinHandle<()>, Arc<EngineStats>),
}

async fn cluster(mode: StepMode) -> Cluster {
    cluster_with(mode, 16, |_| {}).await
}

/// `prefill_transfers_max` bounds the transfers the prefill side holds at once (the router sends
/// it up to 8); `tweak` adjusts the prefill worker's peer link (the one KV writes go out on).
async fn cluster_with(
    mode: StepMode,
    prefill_transfers_max: u32,
    tweak: impl FnOnce(&mut PeerConfig),
) -> Cluster {
    let sched = sched(mode);
    let model = || ProvenanceModel::new(sched.pool, sched.running_max, VOCAB);
    let metrics = || Arc::new(Metrics::for_role("test-model", MetricsRole::Worker));
    let decode_config = DecodeConfig {
        lease: Duration::from_millis(LEASE_MS),
        write_flight_max: Duration::from_millis(100),
        transfers_max: 16,
        prefix_cache: true,
        live_report_interval: Duration::from_millis(1_000),
    };
    let prefill_config = PrefillConfig {
        heartbeat_interval: Duration::from_millis(50),
        write_flight_max: Duration::from_millis(100),
        transfer_deadline: Duration::from_millis(2_000),
        done_retransmit: Duration::from_millis(100),
        transfers_max: prefill_transfers_max,
    };

    let decode_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decode_addr = decode_listener.local_addr().unwrap().to_string();
    let decode_listener = nodelay(decode_listener);
    let node =
        WorkerNode::Decode(DecodeNode::new(at(DECODE), sched.clone(), decode_config).unwrap());
    let runner = InlineRunner::new(model(), StepCost::ZERO);
    let decode = spawn_worker(
        node,
        runner,
        peer(DECODE, Role::Decode, vec![]),
        TcpDial,
        decode_listener,
        true,
        metrics(),
    )
    .unwrap();

    let prefill_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let prefill_addr = prefill_listener.local_addr().unwrap().to_string();
    let prefill_listener = nodelay(prefill_listener);
    let node =
        WorkerNode::Prefill(PrefillNode::new(at(PREFILL), sched.clone(), prefill_config).unwrap());
    let runner = InlineRunner::new(model(), StepCost::ZERO);
    let mut prefill_peer = peer(PREFILL, Role::Prefill, vec![(DECODE, decode_addr.clone())]);
    tweak(&mut prefill_peer);
    let prefill_metrics = metrics();
    let prefill = spawn_worker(
        node,
        runner,
        prefill_peer,
        TcpDial,
        prefill_listener,
        true,
        prefill_metrics.clone(),
    )
    .unwrap();

    let dial = vec![(PREFILL, prefill_addr), (DECODE, decode_addr)];
    let (transport, events) = Transport::start(peer(ROUTER, Role::Router, dial), TcpDial).unwrap();
    let config = RouterEngineConfig {
        router: RouterConfig {
            outcome_timeout: Duration::from_millis(3_000),
            requests_max: 256,
            retries_max: 1,
            decode_idle_timeout: Duration::from_millis(3_000),
            decode_slots: sched.running_max,
            prefill_slots: 8,
            queue_wait_max: Duration::from_secs(20),
            busy_backoff: Duration::from_millis(5),
        },
        workers: BTreeMap::from([(PREFILL, Role::Prefill), (DECODE, Role::Decode)]),
        inbox_max: 256,
        submit_wait_max: Duration::from_secs(5),
        check_invariants: true,
        first_request_id: 1,
    };
    let app = AppConfig::new("test-model", sched.request_tokens_max);
    let codec = Arc::new(SyntheticCodec::new(VOCAB));
    let router = TestServer::serve(node::start_router(config, transport, events, codec, app)).await;
    // Links come up within a few backoffs; until then the router answers 503.
    for _ in 0..200 {
        let (status, _) = router.post("/v1/completions", &completion(&[1, 2, 3], 1)).await;
        if status == 200 {
            return Cluster { router, prefill_metrics, prefill, decode };
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the router never paired its workers");
}

/// Peer links send small messages: without TCP_NODELAY each waits for a delayed ACK.
fn nodelay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Addr = std::net::SocketAddr> {
    axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    })
}

fn completion(prompt: &[u32], max_tokens: u32) -> Value {
    json!({ "model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 })
}

fn text(body: &Value) -> String {
    body["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {body}")).to_owned()
}

fn prompt(i: u32, len: u32, shared: u32) -> Vec<u32> {
    (0..len).map(|p| if p < shared { 1 + p % 900 } else { 1 + (p * 7 + i * 131) % 900 }).collect()
}

async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_greedy_output_through_one_process_and_through_router_prefill_and_decode() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let single = TestServer::provenance(mode, StepCost::ZERO).await;
        let c = cluster(mode).await;
        for i in 0..12 {
            let mut body =
                completion(&prompt(i, 3 + i * 5, if i % 2 == 0 { 8 } else { 0 }), 1 + i % 9);
            // Penalties on a third: the decode worker's output so far starts with the token the
            // prefill worker sampled.
            if i % 3 == 1 {
                body["presence_penalty"] = json!(1.5);
                body["frequency_penalty"] = json!(0.75);
            }
            let (s1, alone) = single.post("/v1/completions", &body).await;
            let (s2, through) = c.router.post("/v1/completions", &body).await;
            assert_eq!((s1, s2), (200, 200), "{alone} {through}");
            assert_eq!(text(&through), text(&alone), "{mode:?} request {i}");
            assert_eq!(through["usage"], alone["usage"]);
        }
        // Long enough that rewarding repeats changes the output: the router must pass the
        // penalties on, and the decode worker count the prefill worker's token.
        let mut long = completion(&prompt(50, 9, 0), 150);
        let (_, plain) = single.post("/v1/completions", &long).await;
        long["presence_penalty"] = json!(-2.0);
        long["frequency_penalty"] = json!(0.5);
        long["repetition_penalty"] = json!(1.3);
        let (_, alone) = single.post("/v1/completions", &long).await;
        let (_, through) = c.router.post("/v1/completions", &long).await;
        assert_ne!(text(&alone), text(&plain), "the penalties changed nothing");
        assert_eq!(text(&through), text(&alone), "{mode:?}: penalties through the router");
        // A logit bias reaches both workers: the prefill worker's token and the decode worker's.
        let mut biased = completion(&prompt(52, 9, 0), 8);
        let (_, unbiased) = single.post("/v1/completions", &biased).await;
        let words: Vec<String> = text(&unbiased)
            .split_whitespace()
            .map(|w| w.trim_start_matches('t').to_owned())
            .collect();
        biased["logit_bias"] = json!({ words[0].clone(): -100, words[3].clone(): -100 });
        let (_, alone) = single.post("/v1/completions", &biased).await;
        let (_, through) = c.router.post("/v1/completions", &biased).await;
        assert_ne!(text(&alone), text(&unbiased));
        assert_eq!(text(&through), text(&alone), "{mode:?}: a logit bias through the router");
        // Stop token ids reach the decode worker: the output ends where the single server's does.
        let mut stopped = completion(&prompt(51, 9, 0), 40);
        let (_, unstopped) = single.post("/v1/completions", &stopped).await;
        let fifth =
            text(&unstopped).split_whitespace().nth(4).unwrap().trim_start_matches('t').to_owned();
        stopped["stop_token_ids"] = json!([fifth.parse::<u32>().unwrap()]);
        let (_, alone) = single.post("/v1/completions", &stopped).await;
        let (_, through) = c.router.post("/v1/completions", &stopped).await;
        assert_eq!(alone["choices"][0]["finish_reason"], "stop", "{alone}");
        assert_eq!(
            (text(&through), &through["choices"][0]["finish_reason"]),
            (text(&alone), &alone["choices"][0]["finish_reason"])
        );
        let streamed = c.router.stream("/v1/completions", &json!({
            "model": "test-model", "prompt": prompt(99, 17, 0), "max_tokens": 6, "temperature": 0, "stream": true
        })).await;
        let (_, alone) = single.post("/v1/completions", &completion(&prompt(99, 17, 0), 6)).await;
        assert_eq!(common::streamed_text(&streamed), text(&alone));
        wait_until("pages held on a worker", || {
            c.prefill.1.pages_held() == 0 && c.decode.1.requests_held() == 0
        })
        .await;
    }
}

/// A worker's `/metrics` counts its own scheduler's prefix-cache lookups and hits and its
/// preemptions, as a single process does (they showed zeros: only a single process published
/// them). The second prompt shares the first's 32 tokens, 8 pages the prefill worker still caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_workers_metrics_count_its_own_prefix_cache_hits() {
    let c = cluster(StepMode::Sync).await;
    let counter = |name: &str| {
        let page = c.prefill_metrics.render();
        let line = page.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}"));
        line.rsplit(' ').next().unwrap().parse::<f64>().unwrap()
    };
    let (queried, hit) =
        (counter("vllm:prefix_cache_queries_total"), counter("vllm:prefix_cache_hits_total"));
    for i in 0..2 {
        let (status, body) =
            c.router.post("/v1/completions", &completion(&prompt(i, 40, 32), 2)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(counter("vllm:prefix_cache_queries_total") - queried, 80.0, "two prompts of 40");
    assert_eq!(counter("vllm:prefix_cache_hits_total") - hit, 32.0, "the shared 32 tokens");
    assert_eq!(counter("vllm:num_preemptions_total"), 0.0, "a pool of 256 pages never preempts");
}

/// The router is where clients' requests are measured: its page times each request's wait for a
/// transfer and each output token (the first from arrival, every later one from the one before),
/// and has no engine series, which it would publish as zeros; a worker's has no client series.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_times_every_output_token_and_publishes_no_engine_series() {
    let c = cluster(StepMode::Sync).await;
    let value = |page: &str, name: &str| {
        let line = page.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}"));
        line.rsplit(' ').next().unwrap().parse::<f64>().unwrap()
    };
    let counts = |page: &str| {
        [
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:inter_token_latency_seconds_count",
            "vllm:request_queue_time_seconds_count",
        ]
        .map(|name| value(page, name))
    };
    // The cluster's start sent a request of one token to see the links up.
    let (_, page) = c.router.get("/metrics").await;
    let before = counts(&page);
    let mut tokens = 0;
    for i in 0..5u32 {
        let (status, body) =
            c.router.post("/v1/completions", &completion(&prompt(i, 9, 0), 2 + i)).await;
        assert_eq!(status, 200, "{body}");
        tokens += body["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(tokens, 20, "every request ran to its max_tokens");
    let (_, page) = c.router.get("/metrics").await;
    let after = counts(&page);
    let added: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    // 20 tokens: 5 first ones, 15 later ones; 5 waits in the router's queue.
    assert_eq!(added, [20.0, 5.0, 15.0, 5.0], "{page}");
    for engine in ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "lockstep:steps_total"]
    {
        assert!(!page.contains(engine), "the router publishes {engine}");
    }
    let worker = c.prefill_metrics.render();
    assert!(worker.contains("vllm:kv_cache_usage_perc"));
    assert!(!worker.contains("vllm:time_to_first_token_seconds"), "{worker}");
}

/// 64 sessions at once, two turns each, every turn's prompt the shared system prefix, the
/// session's history and a new message: each answer equals the same conversation run one
/// request at a time through one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_multi_turn_sessions_equal_their_runs_one_at_a_time() {
    let c = Arc::new(cluster(StepMode::Overlap).await);
    let single = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let system: Vec<u32> = (0..12).map(|p| 1 + p).collect();
    let mut tasks = Vec::new();
    for session in 0..64u32 {
        let c = c.clone();
        let system = system.clone();
        tasks.push(tokio::spawn(async move {
            let mut history = system;
            let mut answers = Vec::new();
            for turn in 0..2u32 {
                history.extend((0..3).map(|p| 1 + (session * 17 + turn * 5 + p) % 900));
                let (status, body) =
                    c.router.post("/v1/completions", &completion(&history, 4)).await;
                assert_eq!(status, 200, "{body}");
                let answer = text(&body);
                // The answer's tokens go back into the history as the next turn's context.
                history.extend(answer.split_whitespace().map(|t| t[1..].parse::<u32>().unwrap()));
                answers.push((history.clone(), answer));
            }
            answers
        }));
    }
    for task in tasks {
        for (history, answer) in task.await.unwrap() {
            let answer_tokens = answer.split_whitespace().count();
            let asked = &history[..history.len() - answer_tokens];
            let (_, alone) = single.post("/v1/completions", &completion(asked, 4)).await;
            assert_eq!(answer, text(&alone));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_leave_mid_transfer_leave_nothing_held_on_either_worker() {
    let c = cluster(StepMode::Sync).await;
    for i in 0..40 {
        let body = completion(&prompt(i, 40, 0), 60).to_string();
        let mut conn = c.router.connect().await;
        let request = conn.post("/v1/completions", &body);
        // Gone after a moment: some before prefill, some mid-transfer, some while decoding.
        let _ = tokio::time::timeout(Duration::from_micros(200 * u64::from(i % 7)), request).await;
    }
    wait_until("the workers still hold requests or pages", || {
        c.prefill.1.pages_held() == 0
            && c.prefill.1.requests_held() == 0
            && c.decode.1.pages_held() == 0
            && c.decode.1.requests_held() == 0
    })
    .await;
    let (status, body) = c.router.post("/v1/completions", &completion(&[5, 6, 7], 3)).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_decode_worker_ends_every_request_and_the_prefill_side_lets_go() {
    let c = cluster(StepMode::Sync).await;
    let mut requests = Vec::new();
    for i in 0..16 {
        requests.push(c.router.post_in_task("/v1/completions", completion(&prompt(i, 30, 0), 200)));
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    c.decode.0.abort();
    let bound = Duration::from_millis(3_000 + 2 * LEASE_MS + 1_000);
    for request in requests {
        let body =
            tokio::time::timeout(bound, request).await.expect("a request never ended").unwrap();
        // Finished before the kill, or ended with an error: never hanging.
        assert!(body["choices"].is_array() || body["error"].is_object(), "{body}");
    }
    wait_until("the prefill side holds pages after the decode worker died", || {
        c.prefill.1.pages_held() == 0 && c.prefill.1.requests_held() == 0
    })
    .await;
    let (status, _) = c.router.post("/v1/completions", &completion(&[1, 2], 2)).await;
    assert_eq!(status, 503, "no decode worker: the router says so");
}

/// Log-probabilities through a router are one process's, bit for bit: the first token's from
/// the prefill worker (which samples it), the rest from the decode worker, each with its top
/// alternatives, whole and streamed, greedy and sampled; and with `echo`, the prompt's tokens',
/// which the prefill worker scores.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn log_probabilities_through_a_router_equal_one_process() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let single = TestServer::provenance(mode, StepCost::ZERO).await;
        let c = cluster(mode).await;
        for i in 0..6 {
            let mut body = completion(&prompt(200 + i, 5 + i * 3, 0), 1 + i * 3);
            body["logprobs"] = json!(i % 4);
            if i % 2 == 1 {
                body["temperature"] = json!(0.9);
                body["seed"] = json!(i);
            }
            let (s1, alone) = single.post("/v1/completions", &body).await;
            let (s2, through) = c.router.post("/v1/completions", &body).await;
            assert_eq!((s1, s2), (200, 200), "{alone} {through}");
            let logprobs = &alone["choices"][0]["logprobs"];
            let tokens = logprobs["token_logprobs"].as_array().unwrap().len();
            assert_eq!(tokens as u32, 1 + i * 3, "one per token alone: {alone}");
            assert_eq!(through["choices"][0]["logprobs"], *logprobs, "{mode:?} request {i}");
            assert_eq!(text(&through), text(&alone));
        }
        // Streamed: the chunks carry the same values, the first chunk's from the prefill worker.
        let chat = json!({
            "model": "test-model", "messages": [{"role": "user", "content": "t5 t9 t14"}],
            "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 3, "stream": true,
        });
        let content = |events: &[Value]| -> Vec<Value> {
            events
                .iter()
                .filter_map(|e| e["choices"].get(0)?["logprobs"]["content"].as_array().cloned())
                .flatten()
                .collect()
        };
        let alone = content(&single.stream("/v1/chat/completions", &chat).await);
        let through = content(&c.router.stream("/v1/chat/completions", &chat).await);
        assert_eq!(alone.len(), 5, "{alone:?}");
        assert_eq!(through, alone, "{mode:?}: streamed chat log-probabilities");
        // Echo: the prompt's text, and its tokens' scores from the prefill worker (which
        // computes every position of it, past a cached prefix too), whole and streamed.
        let long = prompt(7, 40, 24);
        let (_, _) = c.router.post("/v1/completions", &completion(&long, 2)).await;
        // The last: `max_tokens` 0, the prompt and its scores alone.
        for (top, max_tokens) in [(None, 3), (Some(0), 3), (Some(2), 3), (Some(2), 0)] {
            let mut echo = completion(&long, max_tokens);
            echo["echo"] = json!(true);
            if let Some(top) = top {
                echo["logprobs"] = json!(top);
            }
            let (_, alone) = single.post("/v1/completions", &echo).await;
            let (status, through) = c.router.post("/v1/completions", &echo).await;
            assert_eq!(status, 200, "{through}");
            assert_eq!(through["choices"][0], alone["choices"][0], "{mode:?}: echo {top:?}");
            assert_eq!(through["usage"], alone["usage"]);
            echo["stream"] = json!(true);
            let alone = single.stream("/v1/completions", &echo).await;
            let through = c.router.stream("/v1/completions", &echo).await;
            let choices = |events: &[Value]| -> Vec<Value> {
                events.iter().map(|e| e["choices"].clone()).collect()
            };
            assert_eq!(choices(&through), choices(&alone), "{mode:?}: streamed echo {top:?}");
        }
    }
}

/// Sixteen requests at once through the router, prompts of `prompt_len` tokens: each answer
/// equals one process's.
async fn sixteen_at_once_equal_one_process(c: &Cluster, prompt_len: u32) {
    let single = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let mut requests = Vec::new();
    for i in 0..16 {
        let body = completion(&prompt(i, prompt_len, 0), 4);
        requests.push((body.clone(), c.router.post_in_task("/v1/completions", body)));
    }
    for (body, request) in requests {
        let through = request.await.unwrap();
        let (_, alone) = single.post("/v1/completions", &body).await;
        assert_eq!(text(&through), text(&alone), "{through}");
    }
}

/// A counter's value on a `/metrics` page, if the page has it.
fn counter(page: &str, name: &str) -> Option<f64> {
    page.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A link whose byte budget holds a few pages at a time: writes wait for room (the data plane's
/// back-pressure) instead of failing their transfers, and every request gives its output alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_writes_wait_for_room_on_a_narrow_link_and_nothing_fails() {
    // A provenance page is 32 bytes of KV, its frame about 70: some thirty fit at once.
    let c = cluster_with(StepMode::Sync, 16, |p| p.send_bytes_max = 2048).await;
    sixteen_at_once_equal_one_process(&c, 60).await;
    let (_, page) = c.router.get("/metrics").await;
    let failed = counter(&page, "lockstep:kv_transfers_failed_total");
    assert_eq!(failed, Some(0.0), "a transfer failed for want of room");
    let held = counter(&c.prefill_metrics.render(), "lockstep:kv_writes_held_total");
    assert!(held.unwrap() > 0.0, "no write ever waited: the link was not narrow");
}

/// A prefill worker with fewer transfer places than the router sends it prompts (2 against 8, its
/// `Hello` not saying so: `PeerConfig::places` left unbounded) refuses the rest as busy: they go
/// again after the back-off, and nothing fails. (Refused as
/// failed, as it once was, each used up an attempt, and with `retries_max` 1 clients got errors
/// under mere load.) The router counts the refusals apart from retries, which stay at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_worker_short_of_transfer_places_refuses_as_busy_and_nothing_fails() {
    let c = cluster_with(StepMode::Sync, 2, |_| {}).await;
    sixteen_at_once_equal_one_process(&c, 40).await;
    let (_, page) = c.router.get("/metrics").await;
    assert_eq!(counter(&page, "lockstep:kv_transfers_failed_total"), Some(0.0), "{page}");
    assert_eq!(counter(&page, "lockstep:kv_transfer_retries_total"), Some(0.0), "{page}");
    let busy = counter(&page, "lockstep:kv_transfers_refused_busy_total").unwrap();
    assert!(busy > 0.0, "no transfer was refused: the prefill worker was not short of places");
}

/// The same worker whose `Hello` says its 2 places, as `roles::launch` has every worker say: the
/// router sends it no more than 2 prompts at once, whatever its own `prefill_slots` (8), so none
/// is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_router_sends_a_prefill_worker_no_more_than_the_places_its_hello_said() {
    let c = cluster_with(StepMode::Sync, 2, |peer| peer.places = 2).await;
    sixteen_at_once_equal_one_process(&c, 40).await;
    let (_, page) = c.router.get("/metrics").await;
    assert_eq!(counter(&page, "lockstep:kv_transfers_failed_total"), Some(0.0), "{page}");
    assert_eq!(counter(&page, "lockstep:kv_transfer_retries_total"), Some(0.0), "{page}");
    assert_eq!(counter(&page, "lockstep:kv_transfers_refused_busy_total"), Some(0.0), "{page}");
}
