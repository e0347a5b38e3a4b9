//! A test server whose model always answers with the same Hermes tool call, for clients that must
//! be shown receiving tool calls (the openai Python client in ci/api-conformance.sh): the real
//! engine, app and tool-call parser, with a scripted executor in place of a model that could be
//! asked to call a tool. Test infrastructure only: it is not part of the `lockstep` binary.
//!
//!   cargo run -p lockstep-server --example scripted_tool_server -- --port 8123

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports, reason = "test code, shared with the tests")]
mod common;
#[path = "../../gpu/tests/tiny/mod.rs"]
mod tiny;

use std::sync::Arc;
use std::time::Duration;

use common::ScriptedExecutor;
use lockstep_core::kv::PoolConfig;
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_gpu::model::Model;
use lockstep_server::engine::{EngineConfig, InlineRunner, StepCost};
use lockstep_server::http::AppConfig;
use lockstep_server::node;
use lockstep_server::text::{ModelCodec, TextCodec};
use lockstep_server::tool_calls::ToolFormat;

const ANSWER: &str = "Let me look that up.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = match args.iter().position(|a| a == "--port") {
        Some(i) => args.get(i + 1).and_then(|p| p.parse().ok()).ok_or("--port needs a number")?,
        None => 8123,
    };
    let dir = std::env::temp_dir().join(format!("lockstep-scripted-{}", std::process::id()));
    tiny::variants().into_iter().next().ok_or("no tiny model")?.write(&dir);
    let model = Arc::new(Model::load(&dir).map_err(|e| e.to_string())?);
    let _ = std::fs::remove_dir_all(&dir);
    let codec = ModelCodec(model.clone());
    let script = codec.encode(ANSWER)?;
    let sched = SchedConfig {
        pool: PoolConfig { pages_total: 1024, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max: 8,
        step_tokens_max: 1024,
        prefill_chunk_tokens_max: 1024,
        scored_tokens_max: 1024,
        request_tokens_max: 8192,
        capture_sizes: vec![1, 2, 4, 8],
        eos_token_ids: model.stop_tokens.clone(),
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: false,
    };
    let executor = ScriptedExecutor::new(script, model.stop_tokens[0]);
    let mut app = AppConfig::new("scripted", sched.request_tokens_max);
    app.tool_format = Some(ToolFormat::Hermes);
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let engine = EngineConfig::new(sched);
        let runner = InlineRunner::new(executor, StepCost::ZERO);
        let node = node::start(engine, runner, Arc::new(codec), app)?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .map_err(|e| format!("binding port {port}: {e}"))?;
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        node.serve(listener, stop, Duration::from_secs(5)).await.map_err(|e| e.to_string())?;
        Ok(())
    })
}
