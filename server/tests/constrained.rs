//! Constrained decoding (`response_format`) on a real vocabulary: a tiny generated Hugging Face
//! model, whose random weights would never write JSON by themselves. The output follows the
//! schema whole and streamed, greedy and sampled, alone and in a crowd (each request equal to
//! itself alone); what the server cannot enforce is a 400; and a router with a prefill and a
//! decode worker, three `lockstep serve` processes, gives the output of one process: the grammar
//! crosses the wire, and the decode worker's matcher starts from the prefill worker's token.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;
#[path = "common/process.rs"]
mod process;
#[path = "../../gpu/tests/tiny/mod.rs"]
mod tiny;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{TestServer, counter, streamed_text};
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::SyntheticMatcher;
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_gpu::llama::CpuExecutor;
use lockstep_gpu::model::Model;
use lockstep_server::client::Connection;
use lockstep_server::engine::{EngineConfig, StepCost, ThreadRunner};
use lockstep_server::http::AppConfig;
use lockstep_server::reasoning::ReasoningFormat;
use lockstep_server::text::ModelCodec;
use lockstep_server::tool_calls::ToolFormat;
use process::{Process, free_port, free_ports, serve_model};
use serde_json::{Value, json};
use tokio::time::Instant;

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "sure": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["answer", "sure", "count"],
        "additionalProperties": false,
        // No blanks between tokens: random weights love them (the default allows 20 a gap).
        "x-guidance": {"whitespace_flexible": false},
    })
}

fn request(temperature: f64, seed: u64) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Is it raining?"}],
        "max_tokens": 120,
        "temperature": temperature,
        "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema()}},
    })
}

/// The reply's content, checked against `schema()` by hand.
fn checked(out: &Value) -> String {
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "the grammar ends the output: {out}");
    let content = choice["message"]["content"].as_str().unwrap();
    let reply: Value =
        serde_json::from_str(content).unwrap_or_else(|e| panic!("not JSON ({e}): {content:?}"));
    let fields = reply.as_object().unwrap_or_else(|| panic!("not an object: {content:?}"));
    assert_eq!(fields.len(), 3, "{content:?}");
    assert!(["yes", "no", "maybe"].contains(&reply["answer"].as_str().unwrap()), "{content:?}");
    assert!(reply["sure"].is_boolean(), "{content:?}");
    assert!((0..=99).contains(&reply["count"].as_u64().unwrap()), "{content:?}");
    content.to_owned()
}

fn tiny_model_dir(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("lockstep-constrained-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tiny::variants()[0].write(&dir);
    dir
}

async fn cpu_server(
    model: Arc<Model>,
    tool_format: Option<ToolFormat>,
    reasoning_format: Option<ReasoningFormat>,
) -> TestServer {
    let config = SchedConfig {
        pool: PoolConfig { pages_total: 1024, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Overlap,
        waiting_max: 16,
        running_max: 4,
        step_tokens_max: 64,
        prefill_chunk_tokens_max: 32,
        scored_tokens_max: 32,
        // Beyond the tiny model's own context: the tools' system message is long in bytes,
        // which are its tokens.
        request_tokens_max: 2048,
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: model.stop_tokens.clone(),
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    };
    let executor =
        CpuExecutor::with_threads(model.weights.clone(), config.pool, config.running_max, 2)
            .with_grammars(model.grammars().unwrap());
    let mut engine = EngineConfig::new(config.clone());
    engine.check_invariants = true;
    let runner = ThreadRunner::spawn(executor, engine.executor_jobs_max()).unwrap();
    let mut app = AppConfig::new("m", config.request_tokens_max);
    app.tool_format = tool_format;
    app.reasoning_format = reasoning_format;
    TestServer::start(engine, runner, Arc::new(ModelCodec(model)), app).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_output_follows_the_schema_whole_streamed_and_in_a_crowd() {
    let dir = tiny_model_dir("http");
    let model = Arc::new(Model::load(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let server = cpu_server(model, None, None).await;
    let mut alone = Vec::new();
    for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)] {
        let body = request(temperature, seed);
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        if seed == 0 {
            // The HTTP edge compiled the schema (to check it) and the executor got it kept.
            let (_, page) = server.get("/metrics").await;
            assert_eq!(counter(&page, "lockstep:grammar_cache_queries_total"), 2, "{page}");
            assert_eq!(counter(&page, "lockstep:grammar_cache_hits_total"), 1, "{page}");
        }
        let content = checked(&out);
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = server.stream("/v1/chat/completions", &streamed).await;
        assert_eq!(streamed_text(&events), content, "streamed differs from whole");
        alone.push(content);
    }
    assert!(alone.iter().any(|c| c != &alone[0]), "sampling drew one output for four seeds");
    // The same four at once (a shared prefix, overlap steps): each equals itself alone.
    let tasks: Vec<_> = [(0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)]
        .into_iter()
        .map(|(t, seed)| server.post_in_task("/v1/chat/completions", request(t, seed)))
        .collect();
    for (task, expected) in tasks.into_iter().zip(&alone) {
        assert_eq!(&checked(&task.await.unwrap()), expected, "differs in a crowd");
    }
    // The completions endpoint takes it too (as vLLM's does).
    let completion = json!({
        "prompt": "Is it raining?", "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema()}},
    });
    let (status, out) = server.post("/v1/completions", &completion).await;
    assert_eq!(status, 200, "{out}");
    let text = out["choices"][0]["text"].as_str().unwrap();
    let as_chat = json!({"choices": [{"finish_reason": out["choices"][0]["finish_reason"], "message": {"content": text}}]});
    checked(&as_chat);
    // Any JSON object: the reply parses as one, or was cut by max_tokens inside one.
    let mut body = request(1.0, 9);
    body["response_format"] = json!({"type": "json_object"});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let content = out["choices"][0]["message"]["content"].as_str().unwrap();
    // Blanks between tokens (outside strings) come 20 at most at a time.
    let (mut blanks, mut in_string, mut escaped) = (0, false, false);
    for c in content.chars() {
        (in_string, escaped) = match (in_string, escaped, c) {
            (true, false, '\\') => (true, true),
            (true, false, '"') | (false, _, '"') => (!in_string, false),
            (s, _, _) => (s, false),
        };
        blanks = if !in_string && c.is_ascii_whitespace() { blanks + 1 } else { 0 };
        assert!(blanks <= 20, "a gap of over 20 blanks: {content:?}");
    }
    match out["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => {
            assert!(serde_json::from_str::<Value>(content).unwrap().is_object(), "{content:?}")
        }
        _ => assert!(content.trim_start().starts_with('{'), "{content:?}"),
    }
    for (format, why) in [
        (json!({"type": "xml"}), "type must be"),
        (json!({"type": "json_schema", "json_schema": {"name": "x"}}), "schema is required"),
        (json!({"type": "json_schema", "json_schema": {"schema": 7}}), "must be a JSON Schema"),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "sometimes"}}}),
            "schema",
        ),
    ] {
        body["response_format"] = format;
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], "response_format", "{out}");
        assert!(out["error"]["message"].as_str().unwrap().contains(why), "{why}: {out}");
    }
    body["response_format"] = json!({"type": "text"});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    server.quiescent().await;
}

/// A template whose turn opens the thinking with `thinking: true` (DeepSeek V3.1's way) and
/// closes it with `enable_thinking: false` (Qwen 3's), and otherwise leaves it to the model.
const THINKING_TEMPLATE: &str = concat!(
    "{% for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{% endfor %}{% if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
    "{% if thinking is defined and thinking %}{{- '<think>\\n' }}",
    "{% elif enable_thinking is defined and enable_thinking is false %}",
    "{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
);

/// A reasoning model held to a schema thinks first: the schema holds what follows its thinking.
/// The tiny model's random weights seldom close a thinking block, so a reply either stops inside
/// it (all reasoning, cut by `max_tokens`) or is JSON the schema accepts after it, whole and
/// streamed alike; with the thinking turned off the reply is the JSON.
/// The tiny model with `THINKING_TEMPLATE`, on a server that reads its reasoning by Qwen 3's
/// rules (the template's), with `tool_format`.
async fn thinking_server(name: &str, tool_format: Option<ToolFormat>) -> TestServer {
    let dir = tiny_model_dir(name);
    let mut model = Model::load(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    model.chat_template = Some(THINKING_TEMPLATE.to_owned());
    let format = ReasoningFormat::detect(THINKING_TEMPLATE);
    assert_eq!(format.map(|f| f.name), Some("qwen3"));
    cpu_server(Arc::new(model), tool_format, format).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_models_schema_holds_after_its_thinking() {
    let server = thinking_server("thinking", None).await;
    let (mut answered, mut thought) = (0, 0);
    for (variables, seed) in [
        // Seeds where the model opens a block (0, 1) and where it answers at once (10).
        (json!({}), 0),
        (json!({}), 1),
        (json!({}), 10),
        (json!({"thinking": true}), 4),
    ] {
        let mut body = request(1.0, seed);
        body["max_tokens"] = json!(60);
        body["chat_template_kwargs"] = variables.clone();
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        if seed == 0 {
            // One compile at the edge (the schema moved after the thinking), kept for the
            // executor: not the schema as sent as well.
            let (_, page) = server.get("/metrics").await;
            assert_eq!(counter(&page, "lockstep:grammar_cache_queries_total"), 2, "{page}");
            assert_eq!(counter(&page, "lockstep:grammar_cache_hits_total"), 1, "{page}");
        }
        let message = &out["choices"][0]["message"];
        let reasoning = message["reasoning_content"].as_str().unwrap_or("").to_owned();
        let content = match message["content"].as_str().unwrap() {
            "" => {
                assert_eq!(out["choices"][0]["finish_reason"], "length", "{out}");
                assert!(!reasoning.is_empty(), "{out}");
                thought += 1;
                String::new()
            }
            _ => {
                answered += 1;
                checked(&out)
            }
        };
        if variables.get("thinking").is_some() {
            assert!(!reasoning.is_empty(), "the prompt opened the thinking: {out}");
        }
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = server.stream("/v1/chat/completions", &streamed).await;
        assert_eq!(streamed_text(&events), content, "streamed content differs from whole");
        let streamed_reasoning: String = events
            .iter()
            .filter_map(|e| e["choices"].get(0)?["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(streamed_reasoning, reasoning, "streamed reasoning differs from whole");
    }
    assert!(answered > 0 && thought > 0, "answered {answered}, stopped thinking {thought}");
    let mut off = request(0.0, 0);
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (status, out) = server.post("/v1/chat/completions", &off).await;
    assert_eq!(status, 200, "{out}");
    checked(&out);
    assert_eq!(out["choices"][0]["message"]["reasoning_content"], Value::Null, "{out}");
    // A schema the compiler refuses is named as the client's, moved after the thinking or not.
    for variables in [json!({}), json!({"enable_thinking": false})] {
        let mut bad = request(0.0, 0);
        bad["response_format"] =
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "sometimes"}}});
        bad["chat_template_kwargs"] = variables;
        let (status, out) = server.post("/v1/chat/completions", &bad).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], "response_format", "{out}");
        assert!(out["error"]["message"].as_str().unwrap().starts_with("the schema: "), "{out}");
    }
    server.quiescent().await;
}

/// A named tool on a server that reads reasoning: the grammar, not the prompt, opens the call, so
/// a turn opened inside the thinking thinks first (all reasoning when the tiny model never
/// closes it, or a call after it), and with the thinking turned off the reply is the one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_model_thinks_before_a_named_call() {
    let server = thinking_server("thinking-named", Some(ToolFormat::Hermes)).await;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for seed in 0..2 {
        let body = json!({
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools(),
            "tool_choice": named, "max_tokens": 120, "temperature": 1.0, "seed": seed,
            "chat_template_kwargs": {"thinking": true},
        });
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        let message = &out["choices"][0]["message"];
        assert!(message["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()), "{out}");
        if out["choices"][0]["finish_reason"] == "tool_calls" {
            assert_eq!(check_calls(&out), 1, "{out}");
        } else {
            assert_eq!(out["choices"][0]["finish_reason"], "length", "{out}");
            assert!(message["tool_calls"].is_null(), "{out}");
        }
        let mut off = body.clone();
        off["chat_template_kwargs"] = json!({"enable_thinking": false});
        off["max_tokens"] = json!(300);
        let (status, out) = server.post("/v1/chat/completions", &off).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(check_calls(&out), 1, "{out}");
        let call = &out["choices"][0]["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather", "{out}");
        assert_eq!(out["choices"][0]["message"]["reasoning_content"], Value::Null, "{out}");
    }
    // A tool whose parameters the compiler refuses: the 400 names it (or `required`'s tools).
    let broken = json!([{"type": "function", "function": {"name": "broken", "parameters": {"type": "sometimes"}}}]);
    for (choice, why) in [
        (json!({"type": "function", "function": {"name": "broken"}}), "\"broken\"'s parameters: "),
        (json!("required"), "\"required\": the tools' schemas: "),
    ] {
        let body = json!({
            "messages": [{"role": "user", "content": "hi"}], "tools": broken, "tool_choice": choice,
        });
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{out}");
        assert_eq!(out["error"]["param"], "tool_choice", "{out}");
        assert!(out["error"]["message"].as_str().unwrap().starts_with(why), "{why}: {out}");
    }
    server.quiescent().await;
}

fn tools() -> Value {
    let tool = |name: &str, parameters: Value| json!({"type": "function", "function": {"name": name, "parameters": parameters}});
    json!([
        tool(
            "get_weather",
            json!({
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
                "additionalProperties": false,
            })
        ),
        tool(
            "get_time",
            json!({
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": false,
            })
        ),
    ])
}

/// Each call names a declared tool, with arguments its schema accepts.
fn check_calls(out: &Value) -> usize {
    let choice = &out["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{out}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{out}");
    for call in calls {
        let arguments: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match call["function"]["name"].as_str().unwrap() {
            "get_weather" => {
                assert!(["Paris", "Oslo"].contains(&arguments["city"].as_str().unwrap()), "{out}");
                assert!((1..=7).contains(&arguments["days"].as_u64().unwrap()), "{out}");
                assert_eq!(arguments.as_object().unwrap().len(), 2, "{out}");
            }
            "get_time" => assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap())),
            other => panic!("a call to {other}: {out}"),
        }
    }
    calls.len()
}

/// A test a tool-call format, so that the formats run side by side: each is seconds of
/// constrained tokens on a CPU executor of its own.
macro_rules! tool_choice_tests {
    ($($name:ident: $format:expr,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                tool_choice_required_or_named_holds_the_output_to_calls_of_the_tools($format).await;
            }
        )*

        #[test]
        fn every_tool_call_format_has_its_tool_choice_test() {
            assert_eq!([$($format),*], ToolFormat::ALL);
        }
    };
}

tool_choice_tests! {
    tool_choice_holds_hermes_output_to_calls: ToolFormat::Hermes,
    tool_choice_holds_llama3_json_output_to_calls: ToolFormat::Llama3Json,
    tool_choice_holds_deepseek_v3_output_to_calls: ToolFormat::DeepSeekV3,
    tool_choice_holds_deepseek_v31_output_to_calls: ToolFormat::DeepSeekV31,
    tool_choice_holds_dsml_v32_output_to_calls: ToolFormat::DsmlV32,
    tool_choice_holds_dsml_v4_output_to_calls: ToolFormat::DsmlV4,
    tool_choice_holds_dsml_v41_output_to_calls: ToolFormat::DsmlV41,
}

async fn tool_choice_required_or_named_holds_the_output_to_calls_of_the_tools(format: ToolFormat) {
    let dir = tiny_model_dir(&format!("tools-{format:?}"));
    let model = Arc::new(Model::load(&dir).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let server = cpu_server(model, Some(format), None).await;
    // Three draws of the JSON dialects, one of the others (tests/tool_grammar.rs holds each
    // dialect's grammar to its parser).
    // The others' markers are spelled byte by byte (the vocabulary's tokens): more room.
    let (seeds, max_tokens) = match format {
        ToolFormat::Hermes | ToolFormat::Llama3Json => (0..3, 300),
        _ => (0..1, 1000),
    };
    for seed in seeds {
        let body = json!({
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools(),
            "tool_choice": "required", "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
        });
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        check_calls(&out);
        // Without the grammar the random weights write no call.
        let mut free = body.clone();
        free["tool_choice"] = json!("auto");
        free["max_tokens"] = json!(200);
        let (_, out) = server.post("/v1/chat/completions", &free).await;
        assert!(out["choices"][0]["message"]["tool_calls"].is_null(), "{format:?}: {out}");
        // Not parallel: exactly one call.
        let mut single = body.clone();
        single["parallel_tool_calls"] = json!(false);
        let (status, out) = server.post("/v1/chat/completions", &single).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(check_calls(&out), 1, "{format:?}: {out}");
        assert!(out["choices"][0]["message"]["content"].is_null(), "{format:?}: {out}");
        // A named function: exactly one call, to it.
        let mut named = body.clone();
        named["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
        let (status, out) = server.post("/v1/chat/completions", &named).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(check_calls(&out), 1, "{format:?}: {out}");
        let call = &out["choices"][0]["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "get_weather", "{out}");
    }
    let body = json!({
        "messages": [{"role": "user", "content": "hi"}], "tools": tools(), "tool_choice": "required",
        "response_format": {"type": "json_object"},
    });
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{out}");
    assert!(out["error"]["message"].as_str().unwrap().contains("give one"), "{out}");
    let mut named = body.clone();
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    assert_eq!(server.post("/v1/chat/completions", &named).await.0, 400);
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provenance_server_holds_its_draws_to_the_synthetic_grammar() {
    let server = TestServer::provenance(StepMode::Overlap, StepCost::ZERO).await;
    let ids = |out: &Value| -> Vec<u32> {
        let text = out["choices"][0]["text"].as_str().unwrap();
        text.split_whitespace().map(|w| w[1..].parse().unwrap()).collect()
    };
    let mut moved = false;
    for seed in 0..4 {
        let mut body = json!({
            "prompt": [1, 2, 3, 4, 5], "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_object"},
        });
        let (status, out) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        let output = ids(&out);
        for (i, &token) in output.iter().enumerate() {
            let ruled_out = SyntheticMatcher::ruled_out(&output[..i]);
            assert!(token == 0 || token % 3 != ruled_out, "token {i} of {output:?}");
        }
        body["response_format"] = json!({"type": "text"});
        let (_, free) = server.post("/v1/completions", &body).await;
        moved |= ids(&free) != output;
    }
    assert!(moved, "the grammar changed no draw in four requests");
    let body = json!({
        "prompt": [1, 2], "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
    });
    assert_eq!(server.post("/v1/completions", &body).await.0, 200);
    let mut body = json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}});
    assert_eq!(server.post("/v1/chat/completions", &body).await.0, 200);
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"schema": "{}"}});
    assert_eq!(server.post("/v1/chat/completions", &body).await.0, 400);
    server.quiescent().await;
}

/// `lockstep serve` on the CPU, one thread, a small pool.
fn serve(model: &Path, args: &[&str], log: &Path) -> Process {
    let cpu = ["--device", "cpu", "--threads", "1", "--kv-pages", "128", "--page-tokens", "4"];
    serve_model(model, &[&cpu[..], args].concat(), log)
}

/// `body`'s reply from the server on `port`, once it answers (a minute at most).
async fn reply(port: u16, body: &Value) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(io) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
            && let Ok(mut c) = Connection::new(io).await
            && let Ok(response) = c.post("/v1/chat/completions", &body.to_string()).await
            && response.status.as_u16() == 200
        {
            return response.json().await.unwrap();
        }
        assert!(Instant::now() < deadline, "no reply from port {port}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn a_router_prefill_and_decode_give_the_constrained_output_of_one_process() {
    let dir = tiny_model_dir("roles");
    let model = dir.join("model");
    tiny::variants()[0].write(&model);
    let log = dir.join("serve.log");
    let bodies = [request(0.0, 0), request(1.0, 5), request(1.5, 6)];
    let port = free_port().to_string();
    let one = serve(&model, &["--port", &port], &log);
    let mut alone = Vec::new();
    for body in &bodies {
        alone.push(checked(&reply(port.parse().unwrap(), body).await));
    }
    drop(one);
    let [decode_port, decode_peer, prefill_port, prefill_peer, router_port] =
        free_ports().map(|port| port.to_string());
    let decode_at = format!("2@127.0.0.1:{decode_peer}");
    let prefill_at = format!("1@127.0.0.1:{prefill_peer}");
    let decode = ["--role", "decode", "--worker-id", "2", "--port", &decode_port];
    let _decode = serve(&model, &[&decode[..], &["--peer-port", &decode_peer]].concat(), &log);
    let prefill = ["--role", "prefill", "--worker-id", "1", "--port", &prefill_port];
    let prefill_peers = ["--peer-port", &prefill_peer, "--decode", &decode_at];
    let _prefill = serve(&model, &[&prefill[..], &prefill_peers].concat(), &log);
    let router = ["--role", "router", "--worker-id", "0", "--port", &router_port];
    let router_peers = ["--prefill", &prefill_at, "--decode", &decode_at];
    let _router = serve(&model, &[&router[..], &router_peers].concat(), &log);
    for (body, expected) in bodies.iter().zip(&alone) {
        let split = checked(&reply(router_port.parse().unwrap(), body).await);
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(&split, expected, "the split deployment's output differs\n{log_text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
