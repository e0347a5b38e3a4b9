//! The lockstep node runtime and HTTP front end (DESIGN.md section 4).
//!
//! - `engine`: one task per worker that owns the scheduler and, through a `StepRunner`, the
//!   executor; everything else talks to it through bounded channels.
//! - `http`: the axum app (OpenAI-compatible completions and chat, streaming, tool calls,
//!   `/health`, `/metrics`, `/openapi.json`), served from any `axum::serve::Listener`: tokio's
//!   `TcpListener` in production, turmoil's in the simulator.
//! - `text`: incremental detokenization and stop strings; `tool_calls`: tool-call parsing.
//! - `peer`: links between workers carrying `wire` envelopes, over any stream (turmoil's too).
//! - `record`: `--record-trace`, served requests written in the native trace format.
//!
//! Nothing here reads a clock other than tokio's, spawns a blocking task, or branches on being
//! simulated: the simulator runs this same code. Binary: `lockstep`.

pub mod bench_serve;
pub mod client;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod node;
pub mod peer;
pub mod reasoning;
pub mod record;
pub mod roles;
pub mod serve;
pub mod text;
pub mod tool_calls;
