//! The OpenAI-compatible HTTP API (axum), served from any `axum::serve::Listener`.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `POST
//! /tokenize` and `POST /detokenize` (vLLM's: the tokens a request would be computed from, and
//! token ids' text), `GET /health`
//! (fails when the engine holds work and completes no step for `health_stall_max`), `GET
//! /metrics` (Prometheus text), `GET /openapi.json` (what the server accepts).

mod auth;
mod chat;
mod completions;
mod error;
mod generation;
mod held_grammar;
mod info;
mod logprobs;
pub mod openapi;
mod protocol;
mod respond;
mod response_format;
mod tokenize;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use auth::{ApiKey, OPEN_PATHS};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
pub use error::ApiError;
pub use generation::QUEUE_TIMEOUT_MESSAGE;
pub use protocol::GenerationParams;

use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::reasoning::ReasoningFormat;
use crate::record::Recorder;
use crate::text::TextCodec;
use crate::tool_calls::ToolFormat;

/// `AppConfig::sse_keep_alive`'s default: axum's, and what proxies' 60 s idle timeouts leave room
/// for.
pub const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// What the app serves and its limits.
#[derive(Clone, Debug)]
pub struct AppConfig {
    /// The model's name in requests and in `/v1/models`.
    pub model_name: String,
    /// Prompt plus output tokens of one request.
    pub context_tokens: u32,
    /// The tool-call markup to parse out of chat output; `None`: tool calls are not parsed.
    pub tool_format: Option<ToolFormat>,
    /// The reasoning markers to read chat output's thinking by; `None`: there is no reasoning,
    /// and responses carry no `reasoning_content`.
    pub reasoning_format: Option<ReasoningFormat>,
    /// Request bodies larger than this are refused with 413.
    pub body_bytes_max: usize,
    /// A request still running after this is ended with an error and aborted.
    pub request_time_max: Duration,
    /// `/health` fails once the engine has held work this long without completing a step.
    pub health_stall_max: Duration,
    /// A stream with nothing to send for this long sends an SSE comment (`:`), which clients
    /// ignore: a proxy or client with an idle timeout keeps a request that waits long in the
    /// queue or between tokens, and a client can tell a live server from one that went away
    /// without closing its connection (a machine that lost power sends no FIN).
    pub sse_keep_alive: Duration,
    /// What 429 and 503 answers tell clients to wait, in seconds.
    pub retry_after_s: u32,
    /// Unix time at start (read once at the edge, 0 in simulations): `created` fields count
    /// from it on tokio's clock.
    pub unix_time_at_start: u64,
    /// Seeds for requests that give none derive from it.
    pub seed: u64,
    /// Where served requests are recorded (`--record-trace`); `None`: nothing is recorded and
    /// recording costs nothing.
    pub recorder: Option<Recorder>,
    /// The key every request but to `auth::OPEN_PATHS` must bear (`--api-key`); `None`: no key.
    pub api_key: Option<ApiKey>,
    /// Whether requests may set `priority` (`--scheduling-policy priority`, as vLLM's); if not,
    /// one that sets another than 0 is refused, and every request is taken in arrival order.
    pub priority_scheduling: bool,
}

impl AppConfig {
    pub fn new(model_name: impl Into<String>, context_tokens: u32) -> AppConfig {
        AppConfig {
            model_name: model_name.into(),
            context_tokens,
            tool_format: None,
            reasoning_format: None,
            body_bytes_max: 8 << 20,
            request_time_max: Duration::from_secs(600),
            health_stall_max: Duration::from_secs(30),
            sse_keep_alive: SSE_KEEP_ALIVE,
            retry_after_s: 1,
            unix_time_at_start: 0,
            seed: 0,
            recorder: None,
            api_key: None,
            priority_scheduling: false,
        }
    }
}

#[derive(Debug)]
pub struct AppState {
    pub config: AppConfig,
    pub engine: EngineHandle,
    pub codec: Arc<dyn TextCodec>,
    pub metrics: Arc<Metrics>,
    /// Requests seen, for seeds of requests that give none.
    requests: AtomicU64,
}

impl AppState {
    pub fn new(
        config: AppConfig,
        engine: EngineHandle,
        codec: Arc<dyn TextCodec>,
        metrics: Arc<Metrics>,
    ) -> AppState {
        AppState { config, engine, codec, metrics, requests: AtomicU64::new(0) }
    }

    /// A seed for a request that gave none: distinct per request, reproducible per run.
    fn next_seed(&self) -> u64 {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let mut z = self.config.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z ^ (z >> 31)
    }

    /// Seconds since the Unix epoch, as OpenAI's `created`.
    fn created(&self) -> u64 {
        let since_start = self.engine.stats().now_ns() / 1_000_000_000;
        self.config.unix_time_at_start + since_start
    }
}

/// The whole app.
pub fn router(state: Arc<AppState>) -> Router {
    let body_max = state.config.body_bytes_max;
    Router::new()
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/models", get(info::models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .route("/openapi.json", get(info::openapi))
        .fallback(info::not_found)
        .method_not_allowed_fallback(info::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_max))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_key))
        .with_state(state)
}
