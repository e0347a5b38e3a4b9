//! `lockstep bench-serve`: replays a Mooncake-format trace against a running server over HTTP and
//! reports throughput, time to first token (TTFT), inter-token latency (ITL) and end-to-end time.
//!
//! A trace line is `{"timestamp": ms from start, "input_length", "output_length", "hash_ids"}`,
//! where each hash id names a 512-token block of the prompt and equal leading ids are a shared
//! prefix. Traces carry no text, so prompts are token ids made from the hash ids: each id becomes
//! its own block of tokens drawn from a seeded mix of the id, so equal ids give equal blocks and a
//! shared prefix in the trace is a shared prefix on the server (its prefix cache sees what the
//! trace's would). `--scale-tokens` scales the lengths and the block size together, so the share
//! of each prompt that is a shared prefix survives the scaling.
//!
//! Every request asks for `temperature: 0` and `ignore_eos: true`, so its output length is the
//! trace's. TTFT counts from the moment a request is written to its connection (a request that
//! waits for a free slot under `--concurrency` starts its clock when it gets one), ITL between
//! chunks that carry text, end to end until the stream's end.
//!
//! Bounds: `--concurrency` requests in flight, a dispatch queue of the same size, a time limit per
//! request, a bounded number of retries after 429, a bounded SSE event size.
//!
//! Time comes from tokio's clock: this is a client at the IO edge, and tokio's `Instant` keeps the
//! workspace's ban on `std::time::Instant::now` (meant for the deterministic core) intact.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

use crate::client::{Connection, Response, sse_data};
use crate::http::ApiKey;

pub const USAGE: &str = "\
usage: lockstep bench-serve --trace PATH [--url http://127.0.0.1:8000] [--limit N]
                            [--scale-tokens F] [--max-input N] [--max-output N] [--vocab N]
                            [--time-scale F] [--concurrency N] [--retries N]
                            [--request-timeout S] [--seed S] [--json] [--api-key KEY]

Replays a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids of
512-token prefix blocks) against a running server's POST /v1/completions, streaming, and reports
requests/s, output tokens/s, TTFT, ITL and end-to-end latency.

  --trace PATH         the trace (e.g. traces/mooncake_conversation_200.jsonl)
  --url URL            the server (default http://127.0.0.1:8000); GET /v1/models gives the model
                       and its max_model_len, which caps every request's prompt plus output
  --limit N            replay the first N requests only (default: all)
  --scale-tokens F     multiply input and output lengths, and the 512-token block size, by F
                       (default 1): a small model's context cannot hold 100k-token prompts
  --max-input N        prompt tokens of one request, at most (the prompt is cut, prefix kept)
  --max-output N       output tokens of one request, at most
  --vocab N            token ids are drawn below N (default 32000). The server does not publish
                       its vocabulary: give the model's (or less)
  --time-scale F       0 (the default): send as fast as --concurrency allows; 1: at the trace's
                       own arrival times; 0.5: twice as fast
  --concurrency N      requests in flight, at most (default 64)
  --retries N          retries of a request answered 429, after its Retry-After (default 3)
  --request-timeout S  seconds one request may take, end to end (default 600)
  --seed S             seed of the synthesized prompts (default 0)
  --json               print the summary as one JSON object
  --api-key KEY        the server's --api-key, sent as `Authorization: Bearer KEY`
                       ($LOCKSTEP_API_KEY when the flag is not given)";

/// Tokens in one block of a Mooncake trace's `hash_ids`.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;
/// A trace file larger than this is refused (the whole public conversation trace is 3 MB).
pub const TRACE_BYTES_MAX: u64 = 1 << 30;
/// Requests replayed in one run, at most.
pub const REQUESTS_MAX: usize = 1_000_000;
pub const CONCURRENCY_MAX: usize = 4096;
pub const RETRIES_MAX: u32 = 100;
/// The longest wait a Retry-After answer may impose.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(60);
/// One server-sent event larger than this ends the request with an error.
const SSE_EVENT_BYTES_MAX: usize = 1 << 20;
/// Error messages kept for the summary, at most (all are counted).
const ERRORS_KEPT_MAX: usize = 8;

#[derive(Clone, Debug, PartialEq)]
pub struct BenchOptions {
    pub trace: PathBuf,
    pub url: String,
    pub limit: Option<usize>,
    pub scale_tokens: f64,
    pub max_input: Option<u32>,
    pub max_output: Option<u32>,
    pub vocab: u32,
    pub time_scale: f64,
    pub concurrency: usize,
    pub retries: u32,
    pub request_timeout: Duration,
    pub seed: u64,
    pub json: bool,
    /// Sent as `Authorization: Bearer KEY` (`--api-key`, else `$LOCKSTEP_API_KEY`).
    pub api_key: Option<ApiKey>,
}

impl BenchOptions {
    /// The defaults, for `trace`.
    pub fn new(trace: impl Into<PathBuf>) -> BenchOptions {
        BenchOptions {
            trace: trace.into(),
            url: "http://127.0.0.1:8000".into(),
            limit: None,
            scale_tokens: 1.0,
            max_input: None,
            max_output: None,
            vocab: 32_000,
            time_scale: 0.0,
            concurrency: 64,
            retries: 3,
            request_timeout: Duration::from_secs(600),
            seed: 0,
            json: false,
            api_key: None,
        }
    }

    pub fn parse(args: &[String]) -> Result<BenchOptions, String> {
        let mut o = BenchOptions::new("");
        let mut trace = None;
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().cloned().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--trace" => trace = Some(PathBuf::from(value()?)),
                "--url" => o.url = value()?,
                "--limit" => o.limit = Some(number(&value()?, flag)?),
                "--scale-tokens" => o.scale_tokens = factor(&value()?, flag)?,
                "--max-input" => o.max_input = Some(number(&value()?, flag)?),
                "--max-output" => o.max_output = Some(number(&value()?, flag)?),
                "--vocab" => o.vocab = number(&value()?, flag)?,
                "--time-scale" => o.time_scale = factor(&value()?, flag)?,
                "--concurrency" => o.concurrency = number(&value()?, flag)?,
                "--retries" => o.retries = number(&value()?, flag)?,
                "--request-timeout" => {
                    o.request_timeout = Duration::from_secs(number(&value()?, flag)?)
                }
                "--seed" => o.seed = number(&value()?, flag)?,
                "--json" => o.json = true,
                "--api-key" => {
                    o.api_key = Some(ApiKey::new(&value()?).map_err(|e| format!("--api-key: {e}"))?)
                }
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        o.trace = trace.ok_or("--trace PATH is required")?;
        o.check()?;
        Ok(o)
    }

    /// Without `--api-key`, the key in `$LOCKSTEP_API_KEY`, if set (the binary's edge).
    pub fn with_key_from_env(mut self) -> Result<BenchOptions, String> {
        if self.api_key.is_none() {
            self.api_key = ApiKey::from_env()?;
        }
        Ok(self)
    }

    /// Refuses options that cannot run: each bound positive and within its maximum.
    pub fn check(&self) -> Result<(), String> {
        if !(self.scale_tokens > 0.0 && self.scale_tokens.is_finite()) {
            return Err("--scale-tokens must be positive".into());
        }
        if !(self.time_scale >= 0.0 && self.time_scale.is_finite()) {
            return Err("--time-scale must be 0 or positive".into());
        }
        if self.vocab < 2 {
            return Err("--vocab must be at least 2".into());
        }
        if !(1..=CONCURRENCY_MAX).contains(&self.concurrency) {
            return Err(format!("--concurrency must be within 1..={CONCURRENCY_MAX}"));
        }
        if self.retries > RETRIES_MAX {
            return Err(format!("--retries must be at most {RETRIES_MAX}"));
        }
        if self.max_input == Some(0) || self.max_output == Some(0) {
            return Err("--max-input and --max-output must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return Err("--request-timeout must be at least 1 s".into());
        }
        authority(&self.url).map(|_| ())
    }
}

fn number<T: std::str::FromStr>(text: &str, name: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{name}: {text:?} is not a valid number"))
}

fn factor(text: &str, name: &str) -> Result<f64, String> {
    let f: f64 = number(text, name)?;
    if f.is_finite() { Ok(f) } else { Err(format!("{name}: {text:?} is not finite")) }
}

/// `host:port` of an `http://host:port[/]` URL (the client speaks plain HTTP/1.1 only).
fn authority(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url {url:?}: only http://host:port is supported"))?;
    let host = rest.trim_end_matches('/');
    if host.is_empty() || host.contains('/') {
        return Err(format!("--url {url:?}: give http://host:port, without a path"));
    }
    Ok(if host.contains(':') { host.to_owned() } else { format!("{host}:80") })
}

/// One line of a Mooncake trace. Other fields are ignored.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival, in milliseconds from the trace's start.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    /// One id per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

/// The first `limit` requests of a JSONL trace. Blank lines are skipped; a bad line is an error
/// that names its (1-based) line number and what is wrong.
pub fn parse_trace(text: &str, limit: usize) -> Result<Vec<TraceRecord>, String> {
    let limit = limit.min(REQUESTS_MAX);
    let mut records: Vec<TraceRecord> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if records.len() == limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let n = index + 1;
        let record: TraceRecord =
            serde_json::from_str(line).map_err(|e| format!("line {n}: {e}"))?;
        if record.input_length == 0 {
            return Err(format!("line {n}: input_length is 0"));
        }
        let covered = record.hash_ids.len() as u64 * u64::from(MOONCAKE_BLOCK_TOKENS);
        if covered < u64::from(record.input_length) {
            return Err(format!(
                "line {n}: {} hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens cover {covered} tokens, \
                 fewer than input_length {}",
                record.hash_ids.len(),
                record.input_length
            ));
        }
        if let Some(last) = records.last()
            && record.timestamp < last.timestamp
        {
            return Err(format!(
                "line {n}: timestamp {} is before the previous line's {}",
                record.timestamp, last.timestamp
            ));
        }
        records.push(record);
    }
    Ok(records)
}

/// Reads and parses the trace at `options.trace`, within `TRACE_BYTES_MAX`.
pub fn load_trace(options: &BenchOptions) -> Result<Vec<TraceRecord>, String> {
    let path = options.trace.display();
    let bytes = std::fs::metadata(&options.trace).map_err(|e| format!("{path}: {e}"))?.len();
    if bytes > TRACE_BYTES_MAX {
        return Err(format!("{path}: {bytes} bytes, over the {TRACE_BYTES_MAX} allowed"));
    }
    let text = std::fs::read_to_string(&options.trace).map_err(|e| format!("{path}: {e}"))?;
    let records = parse_trace(&text, options.limit.unwrap_or(REQUESTS_MAX))
        .map_err(|e| format!("{path}: {e}"))?;
    if records.is_empty() {
        return Err(format!("{path}: no requests"));
    }
    Ok(records)
}

/// splitmix64's finalizer: a fixed, portable mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The prompt of a request: `tokens` token ids below `vocab`, block by block, each hash id giving
/// `block_tokens` tokens that depend only on (`seed`, the id, the place in the block). Equal
/// leading ids therefore give equal leading tokens. Should the ids not cover `tokens` (a trace
/// `parse_trace` would refuse), the last block runs on.
pub fn synthesize_prompt(
    hash_ids: &[u64],
    tokens: u32,
    block_tokens: u32,
    vocab: u32,
    seed: u64,
) -> Vec<u32> {
    let (tokens, block_tokens) = (tokens as usize, block_tokens.max(1) as usize);
    let vocab = u64::from(vocab.max(1));
    let ids: &[u64] = if hash_ids.is_empty() { &[0] } else { hash_ids };
    let mut prompt = Vec::with_capacity(tokens);
    for (b, &id) in ids.iter().enumerate() {
        let block = mix(seed ^ mix(id));
        let last = b + 1 == ids.len();
        let take =
            if last { tokens - prompt.len() } else { block_tokens.min(tokens - prompt.len()) };
        prompt.extend((0..take as u64).map(|j| (mix(block.wrapping_add(j)) % vocab) as u32));
        if prompt.len() == tokens {
            break;
        }
    }
    prompt
}

/// How trace lengths become request lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub scale_tokens: f64,
    pub max_input: Option<u32>,
    pub max_output: Option<u32>,
    /// The server's `max_model_len`: prompt plus output of one request.
    pub context: u32,
}

/// One request as sent: when (trace time), its prompt's and its output's lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    pub at_ms: u64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Whether the server's context cut it shorter than the options asked.
    pub capped_by_context: bool,
}

impl Shape {
    /// The scaled block size: rounded up, so the scaled hash ids still cover the scaled prompt.
    pub fn block_tokens(&self) -> u32 {
        scaled(MOONCAKE_BLOCK_TOKENS, self.scale_tokens, f64::ceil)
    }

    /// Lengths at least 1, scaled, capped by the options, then by the context (a prompt leaves
    /// room for at least one output token).
    pub fn plan(&self, record: &TraceRecord) -> Planned {
        let context = self.context.max(2);
        let input = scaled(record.input_length, self.scale_tokens, f64::round)
            .min(self.max_input.unwrap_or(u32::MAX));
        let output = scaled(record.output_length, self.scale_tokens, f64::round)
            .min(self.max_output.unwrap_or(u32::MAX));
        let input_tokens = input.min(context - 1);
        let output_tokens = output.min(context - input_tokens);
        Planned {
            at_ms: record.timestamp,
            input_tokens,
            output_tokens,
            capped_by_context: input_tokens < input || output_tokens < output,
        }
    }
}

fn scaled(length: u32, factor: f64, round: fn(f64) -> f64) -> u32 {
    let v = round(f64::from(length) * factor);
    // `as` saturates: a huge factor gives u32::MAX, which the caps then cut.
    (v as u32).max(1)
}

/// Percentiles (nearest rank) and mean of a set of latencies, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Latency {
    pub fn of(samples: &mut [Duration]) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort_unstable();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let rank = |p: f64| {
            let r = (p / 100.0 * samples.len() as f64).ceil() as usize;
            ms(samples[r.clamp(1, samples.len()) - 1])
        };
        let total: Duration = samples.iter().sum();
        Latency {
            count: samples.len(),
            mean: ms(total) / samples.len() as f64,
            p50: rank(50.0),
            p90: rank(90.0),
            p99: rank(99.0),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub model: String,
    pub max_model_len: u32,
    pub requests: usize,
    pub ok: usize,
    /// Errors: a status other than 200 and 429, a broken stream, a time-out, a short output.
    pub failed: usize,
    /// Still answered 429 after every retry.
    pub refused: usize,
    /// 429 answers that were retried.
    pub retries_429: u64,
    /// Requests that the server's context cut shorter than the trace and options asked.
    pub capped_by_context: usize,
    pub duration_s: f64,
    /// Requests that succeeded, per second of the whole run.
    pub requests_per_s: f64,
    pub input_tokens: u64,
    /// Output tokens of the requests that succeeded, as their `usage` reports.
    pub output_tokens: u64,
    /// What those requests asked for: equal to `output_tokens` when every output ran its length.
    pub output_tokens_asked: u64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Latency,
    pub itl_ms: Latency,
    pub e2e_ms: Latency,
    /// The first few error messages.
    pub errors: Vec<String>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let line = |f: &mut std::fmt::Formatter<'_>, name: &str, l: &Latency| {
            writeln!(
                f,
                "{name:<13} mean {:>9.2}  p50 {:>9.2}  p90 {:>9.2}  p99 {:>9.2}   ({} samples)",
                l.mean, l.p50, l.p90, l.p99, l.count
            )
        };
        writeln!(f, "model         {} (max_model_len {})", self.model, self.max_model_len)?;
        writeln!(
            f,
            "requests      {}: {} ok, {} failed, {} refused (429 after retries; {} retries), {} \
             capped by the context",
            self.requests,
            self.ok,
            self.failed,
            self.refused,
            self.retries_429,
            self.capped_by_context
        )?;
        writeln!(
            f,
            "duration      {:.2} s: {:.2} requests/s, {:.1} output tokens/s",
            self.duration_s, self.requests_per_s, self.output_tokens_per_s
        )?;
        writeln!(
            f,
            "tokens        {} in, {} out (of {} asked)",
            self.input_tokens, self.output_tokens, self.output_tokens_asked
        )?;
        line(f, "TTFT ms", &self.ttft_ms)?;
        line(f, "ITL ms", &self.itl_ms)?;
        line(f, "e2e ms", &self.e2e_ms)?;
        for e in &self.errors {
            writeln!(f, "error         {e}")?;
        }
        Ok(())
    }
}

/// What one request came to.
#[derive(Debug)]
enum Outcome {
    Ok(Measured),
    Failed(String),
    Refused,
}

#[derive(Debug)]
struct Measured {
    ttft: Duration,
    itl: Vec<Duration>,
    e2e: Duration,
    output_tokens: u32,
}

/// Everything the workers share, read-only.
#[derive(Debug)]
struct Run {
    authority: String,
    model: String,
    /// The server's `max_model_len`.
    context: u32,
    records: Vec<TraceRecord>,
    planned: Vec<Planned>,
    block_tokens: u32,
    options: BenchOptions,
}

/// `lockstep bench-serve`: runs the benchmark on a runtime of its own and prints the summary.
pub fn run(options: &BenchOptions) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let summary = runtime.block_on(bench(options))?;
    if options.json {
        let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{summary}");
    }
    Ok(())
}

/// The library entry point: loads the trace, asks the server for its model and context, replays
/// the trace and returns the summary. Reads the trace file before its first wait.
pub async fn bench(options: &BenchOptions) -> Result<Summary, String> {
    options.check()?;
    let records = load_trace(options)?;
    let authority = authority(&options.url)?;
    let (model, context) =
        server_model(&authority, options.api_key.as_ref(), options.request_timeout).await?;
    let shape = Shape {
        scale_tokens: options.scale_tokens,
        max_input: options.max_input,
        max_output: options.max_output,
        context,
    };
    let planned = records.iter().map(|r| shape.plan(r)).collect();
    let run = Arc::new(Run {
        authority,
        model,
        context,
        records,
        planned,
        block_tokens: shape.block_tokens(),
        options: options.clone(),
    });
    let start = Instant::now();
    let outcomes = replay(run.clone(), start).await?;
    Ok(summarize(&run, outcomes, start.elapsed()))
}

/// The served model's name and `max_model_len`, from `GET /v1/models`.
async fn server_model(
    authority: &str,
    api_key: Option<&ApiKey>,
    wait_max: Duration,
) -> Result<(String, u32), String> {
    let asked = async {
        let mut c = connect(authority, api_key).await?;
        let response = c.get("/v1/models").await?;
        if response.status != hyper::StatusCode::OK {
            return Err(format!("status {}", response.status));
        }
        response.json().await
    };
    let body = tokio::time::timeout(wait_max, asked)
        .await
        .map_err(|_| "no answer in time".to_owned())
        .and_then(|r| r)
        .map_err(|e| format!("GET http://{authority}/v1/models: {e}"))?;
    let model = &body["data"][0];
    let name = model["id"].as_str().ok_or("GET /v1/models: no model id")?;
    let context = model["max_model_len"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or("GET /v1/models: no max_model_len")?;
    Ok((name.to_owned(), context))
}

async fn connect(authority: &str, api_key: Option<&ApiKey>) -> Result<Connection, String> {
    let io = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("connecting to {authority}: {e}"))?;
    // Tokens go out one small write at a time; Nagle would hold them back.
    io.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    let connection = Connection::new(io).await?;
    Ok(match api_key {
        Some(key) => connection.with_api_key(key.as_str()),
        None => connection,
    })
}

/// Sends each request at its (scaled) trace time to `concurrency` workers, each with a
/// connection of its own, through a queue as long as there are workers; returns every outcome.
async fn replay(run: Arc<Run>, start: Instant) -> Result<Vec<(Outcome, u32)>, String> {
    let concurrency = run.options.concurrency.min(run.records.len()).max(1);
    let (jobs, inbox) = mpsc::channel::<usize>(concurrency);
    let inbox = Arc::new(Mutex::new(inbox));
    let workers: Vec<_> =
        (0..concurrency).map(|_| tokio::spawn(worker(run.clone(), inbox.clone()))).collect();
    for (index, planned) in run.planned.iter().enumerate() {
        if run.options.time_scale > 0.0 {
            let at_s = planned.at_ms as f64 / 1e3 * run.options.time_scale;
            let at = Duration::try_from_secs_f64(at_s).unwrap_or(Duration::MAX);
            tokio::time::sleep_until(start.checked_add(at).unwrap_or(start)).await;
        }
        if jobs.send(index).await.is_err() {
            break; // Every worker is gone; their joins below say why.
        }
    }
    drop(jobs);
    let mut outcomes = Vec::with_capacity(run.records.len());
    for w in workers {
        outcomes.extend(w.await.map_err(|e| format!("a worker failed: {e}"))?);
    }
    Ok(outcomes)
}

async fn worker(run: Arc<Run>, inbox: Arc<Mutex<mpsc::Receiver<usize>>>) -> Vec<(Outcome, u32)> {
    let mut connection = None;
    let mut outcomes = Vec::new();
    loop {
        let next = inbox.lock().await.recv().await;
        let Some(index) = next else { return outcomes };
        outcomes.push(one_request(&run, index, &mut connection).await);
    }
}

/// The body of request `index`, its prompt made here from the trace.
fn request_body(run: &Run, index: usize) -> String {
    let (record, planned) = (&run.records[index], &run.planned[index]);
    let prompt = synthesize_prompt(
        &record.hash_ids,
        planned.input_tokens,
        run.block_tokens,
        run.options.vocab,
        run.options.seed,
    );
    json!({
        "model": run.model,
        "prompt": prompt,
        "max_tokens": planned.output_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": { "include_usage": true },
    })
    .to_string()
}

/// Sends request `index` (again after each 429, within the retries), over `connection` if it is
/// still open; a connection that failed is dropped, and the next request opens a new one. The
/// outcome, and how many 429s were retried.
async fn one_request(
    run: &Run,
    index: usize,
    connection: &mut Option<Connection>,
) -> (Outcome, u32) {
    let body = request_body(run, index);
    let asked = run.planned[index].output_tokens;
    let mut retried = 0;
    loop {
        if connection.is_none() {
            // Opened before the clock starts: TTFT is the server's, not the handshake's.
            let opened = tokio::time::timeout(
                run.options.request_timeout,
                connect(&run.authority, run.options.api_key.as_ref()),
            );
            match opened.await {
                Ok(Ok(c)) => *connection = Some(c),
                Ok(Err(e)) => return (failed(connection, index, e), retried),
                Err(_) => {
                    return (failed(connection, index, "no connection in time".into()), retried);
                }
            }
        }
        let Some(c) = connection.as_mut() else { continue };
        let sent = Instant::now();
        let deadline = sent + run.options.request_timeout;
        let response =
            match tokio::time::timeout_at(deadline, c.post("/v1/completions", &body)).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => return (failed(connection, index, e), retried),
                Err(_) => return (failed(connection, index, "no answer in time".into()), retried),
            };
        if response.status == hyper::StatusCode::TOO_MANY_REQUESTS {
            let wait = retry_after(&response.headers);
            // Read the answer out, so the connection can carry the next request.
            if !matches!(tokio::time::timeout_at(deadline, response.text()).await, Ok(Ok(_))) {
                *connection = None;
            }
            if retried == run.options.retries {
                return (Outcome::Refused, retried);
            }
            retried += 1;
            tokio::time::sleep(wait).await;
            continue;
        }
        if response.status != hyper::StatusCode::OK {
            let status = response.status;
            let text = match tokio::time::timeout_at(deadline, response.text()).await {
                Ok(Ok(text)) => text,
                _ => String::new(),
            };
            let why = format!("status {status}: {}", clip(&text));
            return (failed(connection, index, why), retried);
        }
        let outcome = match read_stream(response, sent, deadline).await {
            Ok(m) if m.output_tokens == asked => Outcome::Ok(m),
            Ok(m) => Outcome::Failed(format!(
                "request {index}: {} output tokens, {asked} asked",
                m.output_tokens
            )),
            Err(e) => failed(connection, index, e),
        };
        return (outcome, retried);
    }
}

/// A failed request; its connection may be in any state, so the next request opens a new one.
fn failed(connection: &mut Option<Connection>, index: usize, why: String) -> Outcome {
    *connection = None;
    Outcome::Failed(format!("request {index}: {why}"))
}

/// At most 200 characters of a message from the server.
fn clip(text: &str) -> &str {
    text.char_indices().nth(200).map_or(text, |(i, _)| &text[..i])
}

/// The wait a 429 asks for: its Retry-After in seconds, 1 s if absent or unreadable, at most
/// `RETRY_AFTER_MAX`.
fn retry_after(headers: &hyper::HeaderMap) -> Duration {
    let seconds = headers
        .get(hyper::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1);
    Duration::from_secs(seconds).min(RETRY_AFTER_MAX)
}

/// Reads a completion stream to its end: the time of each chunk that carries text (the first is
/// the TTFT, the gaps between them the ITLs), the usage's output tokens, and `[DONE]`. Chunks that
/// arrive in one read share its time.
async fn read_stream(
    mut response: Response,
    sent: Instant,
    deadline: Instant,
) -> Result<Measured, String> {
    let mut pending: Vec<u8> = Vec::new();
    let mut chunks = Chunks::default();
    loop {
        let frame = match tokio::time::timeout_at(deadline, response.frame()).await {
            Ok(frame) => frame?,
            Err(_) => return Err("the stream ran past --request-timeout".into()),
        };
        let Some(frame) = frame else { break };
        let now = Instant::now();
        pending.extend_from_slice(&frame);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let text = std::str::from_utf8(&event).map_err(|e| format!("event: {e}"))?;
            for data in sse_data(text) {
                chunks.take(&data, now)?;
            }
        }
        if pending.len() > SSE_EVENT_BYTES_MAX {
            return Err(format!("an event longer than {SSE_EVENT_BYTES_MAX} bytes"));
        }
    }
    chunks.measured(sent, Instant::now())
}

/// What a stream said so far.
#[derive(Debug, Default)]
struct Chunks {
    first: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<Duration>,
    text_chunks: u32,
    usage_tokens: Option<u32>,
    done: bool,
}

impl Chunks {
    fn take(&mut self, data: &str, now: Instant) -> Result<(), String> {
        if self.done {
            return Err("data after [DONE]".into());
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| format!("chunk: {e}"))?;
        if let Some(error) = chunk.get("error") {
            let message = error["message"].as_str().unwrap_or("no message");
            return Err(format!("error in the stream: {message}"));
        }
        if let Some(tokens) = chunk["usage"]["completion_tokens"].as_u64() {
            self.usage_tokens = Some(u32::try_from(tokens).unwrap_or(u32::MAX));
        }
        let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
        if !text.is_empty() {
            self.text_chunks += 1;
            match self.last {
                None => self.first = Some(now),
                Some(last) => self.itl.push(now.saturating_duration_since(last)),
            }
            self.last = Some(now);
        }
        Ok(())
    }

    fn measured(self, sent: Instant, ended: Instant) -> Result<Measured, String> {
        if !self.done {
            return Err("the stream ended without [DONE]".into());
        }
        let Some(first) = self.first else {
            return Err("the stream carried no text".into());
        };
        let output_tokens = self.usage_tokens.ok_or("the stream carried no usage")?;
        Ok(Measured {
            ttft: first.saturating_duration_since(sent),
            itl: self.itl,
            e2e: ended.saturating_duration_since(sent),
            output_tokens,
        })
    }
}

fn summarize(run: &Run, outcomes: Vec<(Outcome, u32)>, duration: Duration) -> Summary {
    let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ok, mut failed, mut refused, mut retries) = (0, 0, 0, 0);
    let (mut output_tokens, mut errors) = (0, Vec::new());
    for (outcome, retried) in outcomes {
        retries += u64::from(retried);
        match outcome {
            Outcome::Ok(m) => {
                ok += 1;
                output_tokens += u64::from(m.output_tokens);
                ttft.push(m.ttft);
                e2e.push(m.e2e);
                itl.extend(m.itl);
            }
            Outcome::Failed(why) => {
                failed += 1;
                if errors.len() < ERRORS_KEPT_MAX {
                    errors.push(why);
                }
            }
            Outcome::Refused => refused += 1,
        }
    }
    let seconds = duration.as_secs_f64().max(1e-9);
    Summary {
        model: run.model.clone(),
        max_model_len: run.context,
        requests: run.records.len(),
        ok,
        failed,
        refused,
        retries_429: retries,
        capped_by_context: run.planned.iter().filter(|p| p.capped_by_context).count(),
        duration_s: duration.as_secs_f64(),
        requests_per_s: ok as f64 / seconds,
        input_tokens: run.planned.iter().map(|p| u64::from(p.input_tokens)).sum(),
        output_tokens,
        output_tokens_asked: run.planned.iter().map(|p| u64::from(p.output_tokens)).sum(),
        output_tokens_per_s: output_tokens as f64 / seconds,
        ttft_ms: Latency::of(&mut ttft),
        itl_ms: Latency::of(&mut itl),
        e2e_ms: Latency::of(&mut e2e),
        errors,
    }
}
