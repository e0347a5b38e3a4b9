//! `lockstep bench-serve`: prompts synthesized from hash ids (deterministic, shared prefixes
//! shared), trace errors that name their line, and a replay of the committed sample against a
//! provenance node on 127.0.0.1 in which every request succeeds.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::ProvenanceModel;
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_server::bench_serve::{
    self, BenchOptions, Latency, MOONCAKE_BLOCK_TOKENS, Shape, TraceRecord, parse_trace,
    synthesize_prompt,
};
use lockstep_server::client::Connection;
use lockstep_server::engine::{EngineConfig, InlineRunner, StepCost};
use lockstep_server::http::AppConfig;
use lockstep_server::node;
use lockstep_server::text::SyntheticCodec;
use tokio::sync::oneshot;

const VOCAB: u32 = 1000;
const CONTEXT: u32 = 512;

fn sample_trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces/mooncake_conversation_200.jsonl")
}

#[test]
fn synthesis_is_deterministic_and_shares_prefixes() {
    let a = synthesize_prompt(&[0, 1, 2], 30, 10, VOCAB, 7);
    assert_eq!(a, synthesize_prompt(&[0, 1, 2], 30, 10, VOCAB, 7), "same input, same prompt");
    assert_eq!(a.len(), 30);
    assert!(a.iter().all(|&t| t < VOCAB));
    // Shares the first two blocks with `a`, not the third.
    let b = synthesize_prompt(&[0, 1, 9], 30, 10, VOCAB, 7);
    assert_eq!(a[..20], b[..20]);
    assert_ne!(a[20..], b[20..]);
    // The first block differs: nothing shared from the start.
    let c = synthesize_prompt(&[5, 1, 2], 30, 10, VOCAB, 7);
    assert_ne!(a[..10], c[..10]);
    assert_eq!(a[10..], c[10..], "a block depends on its own id only");
    // Truncation keeps the prefix; another seed gives other tokens.
    assert_eq!(synthesize_prompt(&[0, 1, 2], 15, 10, VOCAB, 7), a[..15]);
    assert_ne!(synthesize_prompt(&[0, 1, 2], 30, 10, VOCAB, 8), a);
    // Blocks are not constant: the tokens of one block vary.
    assert!(a[..10].iter().any(|&t| t != a[0]));
}

#[test]
fn scaling_keeps_blocks_covering_prompts_and_caps_by_context() {
    let record = TraceRecord {
        timestamp: 0,
        input_length: 14 * MOONCAKE_BLOCK_TOKENS,
        output_length: 300,
        hash_ids: (0..14).collect(),
    };
    for scale in [0.0029, 0.01, 0.05, 0.5, 1.0, 2.0] {
        let shape =
            Shape { scale_tokens: scale, max_input: None, max_output: None, context: 1 << 20 };
        let planned = shape.plan(&record);
        let covered = record.hash_ids.len() as u32 * shape.block_tokens();
        assert!(covered >= planned.input_tokens, "scale {scale}: {covered} < {planned:?}");
        assert!(!planned.capped_by_context);
    }
    let shape =
        Shape { scale_tokens: 1.0, max_input: Some(100), max_output: Some(50), context: 120 };
    let planned = shape.plan(&record);
    assert_eq!((planned.input_tokens, planned.output_tokens), (100, 20));
    assert!(planned.capped_by_context);
    let shape = Shape { scale_tokens: 1e-6, max_input: None, max_output: None, context: 120 };
    let planned = shape.plan(&record);
    assert_eq!((planned.input_tokens, planned.output_tokens), (1, 1), "lengths are at least 1");
}

#[test]
fn bad_trace_lines_name_their_line() {
    let good = r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}"#;
    let cases = [
        ("{\"timestamp\": 0", "line 3:"),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5}"#,
            "missing field `hash_ids`",
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}"#,
            "fewer than input_length 600",
        ),
        (
            r#"{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": [0]}"#,
            "input_length is 0",
        ),
        (r#"{"timestamp": -1, "input_length": 6, "output_length": 5, "hash_ids": [0]}"#, "line 3:"),
        (
            r#"{"timestamp": 0, "input_length": "6", "output_length": 5, "hash_ids": [0]}"#,
            "invalid type",
        ),
    ];
    for (bad, expected) in cases {
        let text = format!("{good}\n\n{bad}\n{good}\n");
        let e = parse_trace(&text, usize::MAX).expect_err(bad);
        assert!(e.starts_with("line 3: "), "{e}");
        assert!(e.contains(expected), "{e} should say {expected}");
    }
    let late = r#"{"timestamp": 9, "input_length": 6, "output_length": 5, "hash_ids": [0]}"#;
    let e = parse_trace(&format!("{late}\n{good}"), usize::MAX).expect_err("time goes back");
    assert!(e.starts_with("line 2: timestamp 0 is before"), "{e}");
    // Lines past the limit are not read.
    assert_eq!(parse_trace(&format!("{good}\n{{oops"), 1).unwrap().len(), 1);
    // The file's name comes first.
    let mut options = BenchOptions::new(std::env::temp_dir().join("no-such-lockstep-trace.jsonl"));
    options.limit = Some(1);
    let e = bench_serve::load_trace(&options).expect_err("no such file");
    assert!(e.contains("no-such-lockstep-trace.jsonl"), "{e}");
}

#[test]
fn the_committed_sample_parses() {
    let mut options = BenchOptions::new(sample_trace());
    let records = bench_serve::load_trace(&options).unwrap();
    assert_eq!(records.len(), 200);
    assert_eq!(records[0].hash_ids.len(), 14);
    options.limit = Some(20);
    assert_eq!(bench_serve::load_trace(&options).unwrap().len(), 20);
}

#[test]
fn options_parse_and_refuse() {
    let args = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let o =
        BenchOptions::parse(&args("--trace t.jsonl --limit 20 --scale-tokens 0.1 --json")).unwrap();
    assert_eq!((o.limit, o.scale_tokens, o.json, o.vocab), (Some(20), 0.1, true, 32_000));
    for (bad, says) in [
        ("--limit 20", "--trace"),
        ("--trace t --scale-tokens 0", "--scale-tokens"),
        ("--trace t --time-scale -1", "--time-scale"),
        ("--trace t --concurrency 0", "--concurrency"),
        ("--trace t --url https://x:1", "--url"),
        ("--trace t --limit many", "--limit"),
        ("--trace t --frobnicate", "unknown option"),
    ] {
        let e = BenchOptions::parse(&args(bad)).expect_err(bad);
        assert!(e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn percentiles_are_nearest_rank() {
    let mut samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
    samples.reverse();
    let l = Latency::of(&mut samples);
    assert_eq!((l.count, l.p50, l.p90, l.p99), (100, 50.0, 90.0, 99.0));
    assert!((l.mean - 50.5).abs() < 1e-9);
    assert_eq!(Latency::of(&mut []), Latency::default());
}

/// A provenance node on 127.0.0.1 (4-token pages, so the sample's shared first block is cached)
/// computing `running_max` requests at once with `waiting_max` queued, each step taking `cost`;
/// and what stops it.
async fn provenance_node(
    running_max: u32,
    waiting_max: u32,
    cost: StepCost,
) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let sched = SchedConfig {
        pool: PoolConfig { pages_total: 1024, page_tokens: 4, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max,
        running_max,
        step_tokens_max: 256,
        prefill_chunk_tokens_max: 64,
        scored_tokens_max: 64,
        request_tokens_max: CONTEXT,
        capture_sizes: vec![1, 2, 4, 8],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    };
    let model = ProvenanceModel::new(sched.pool, sched.running_max, VOCAB);
    let mut engine = EngineConfig::new(sched);
    engine.check_invariants = true;
    let runner = InlineRunner::new(model, cost);
    let codec = Arc::new(SyntheticCodec::new(VOCAB));
    let mut app = AppConfig::new("bench-model", CONTEXT);
    app.retry_after_s = 0; // 429s are retried at once.
    let node = node::start(engine, runner, codec, app).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        let signal = async move {
            let _ = stopped.await;
        };
        node.serve(listener, signal, Duration::from_secs(5)).await.unwrap();
    });
    (addr, stop, served)
}

/// The server's `vllm:prefix_cache_hits_total`.
async fn prefix_cache_hits(addr: SocketAddr) -> f64 {
    let io = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut c = Connection::new(io).await.unwrap();
    let text = c.get("/metrics").await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.starts_with("vllm:prefix_cache_hits_total")).unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// The committed sample's first 20 requests, scaled to fit `CONTEXT`, as fast as they go.
fn sample_options(addr: SocketAddr) -> BenchOptions {
    let mut options = BenchOptions::new(sample_trace());
    options.url = format!("http://{addr}");
    options.limit = Some(20);
    options.scale_tokens = 0.05;
    options.max_input = Some(256);
    options.max_output = Some(16);
    options.vocab = VOCAB;
    options.request_timeout = Duration::from_secs(60);
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_the_sample_against_a_provenance_node() {
    let (addr, stop, served) = provenance_node(8, 32, StepCost::ZERO).await;
    let mut options = sample_options(addr);
    options.concurrency = 4;
    let summary = bench_serve::bench(&options).await.unwrap();
    assert_eq!(summary.errors, Vec::<String>::new());
    assert_eq!((summary.requests, summary.ok, summary.failed, summary.refused), (20, 20, 0, 0));
    assert_eq!((summary.model.as_str(), summary.max_model_len), ("bench-model", CONTEXT));
    assert_eq!(summary.output_tokens, summary.output_tokens_asked);
    assert_eq!(summary.ttft_ms.count, 20);
    assert_eq!(summary.e2e_ms.count, 20);
    // One gap fewer than tokens per request, when every token comes in a chunk of its own.
    assert!(summary.itl_ms.count as u64 <= summary.output_tokens - 20);
    assert!(summary.ttft_ms.p50 <= summary.ttft_ms.p99 && summary.e2e_ms.p99 > 0.0);
    // Scaled by 0.05 the shared first block is 26 tokens: six 4-token pages hit per request.
    assert!(prefix_cache_hits(addr).await > 0.0, "the sample's shared prefix reached the cache");
    let json = serde_json::to_value(&summary).unwrap();
    assert_eq!(json["ok"], 20);
    let _ = stop.send(());
    served.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_retried_and_counted_apart_from_errors() {
    // One request computed and one queued, slowly: most of 12 at once get 429.
    let cost = StepCost { per_step: Duration::from_millis(2), ..StepCost::ZERO };
    let (addr, stop, served) = provenance_node(1, 1, cost).await;
    let mut options = sample_options(addr);
    options.concurrency = 12;
    options.limit = Some(12);
    options.retries = 2;
    let summary = bench_serve::bench(&options).await.unwrap();
    assert_eq!(summary.errors, Vec::<String>::new());
    assert_eq!(summary.failed, 0);
    assert_eq!(summary.ok + summary.refused, 12);
    assert!(summary.refused > 0, "{summary}");
    // Every refused request was retried twice first.
    assert!(summary.retries_429 >= 2 * summary.refused as u64, "{summary}");
    assert_eq!(summary.ttft_ms.count, summary.ok);
    let _ = stop.send(());
    served.await.unwrap();
}
