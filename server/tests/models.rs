//! The server on real models over 127.0.0.1: the CPU executor on its own thread behind the
//! engine, a tiny generated Hugging Face model and the bundled default model; and tool calls in
//! every supported format, from a scripted executor (the models here cannot be made to write
//! them) through a real byte-level tokenizer.

#![allow(clippy::unwrap_used, reason = "test helpers: a failure is the test failing")]

mod common;
#[path = "../../gpu/tests/tiny/mod.rs"]
mod tiny;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{ScriptedExecutor, TestServer, streamed_text};
use lockstep_core::kv::PoolConfig;
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_gpu::llama::CpuExecutor;
use lockstep_gpu::model::Model;
use lockstep_server::engine::{EngineConfig, InlineRunner, StepCost, ThreadRunner};
use lockstep_server::http::AppConfig;
use lockstep_server::reasoning::ReasoningFormat;
use lockstep_server::text::{ModelCodec, TextCodec};
use lockstep_server::tool_calls::ToolFormat;
use serde_json::{Value, json};

fn sched(model: &Model, mode: StepMode) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 128, page_tokens: 16, pins_max: 0 },
        mode,
        waiting_max: 16,
        running_max: 4,
        step_tokens_max: 64,
        prefill_chunk_tokens_max: 32,
        scored_tokens_max: 32,
        request_tokens_max: (model.weights.config.context_length as u32).min(512),
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: model.stop_tokens.clone(),
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    }
}

/// A node running `model` on the CPU executor, on its own thread.
async fn cpu_server(model: Arc<Model>, mode: StepMode) -> TestServer {
    let config = sched(&model, mode);
    let executor =
        CpuExecutor::with_threads(model.weights.clone(), config.pool, config.running_max, 2);
    let mut engine = EngineConfig::new(config.clone());
    engine.check_invariants = true;
    let runner = ThreadRunner::spawn(executor, engine.executor_jobs_max()).unwrap();
    let app = AppConfig::new("m", config.request_tokens_max);
    TestServer::start(engine, runner, Arc::new(ModelCodec(model)), app).await
}

fn tiny_model() -> Arc<Model> {
    // A folder per call: tests run in parallel, and one removing its folder must not pull the
    // model from under another that is loading it.
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let variant = tiny::variants().into_iter().next().unwrap();
    let dir: PathBuf =
        std::env::temp_dir().join(format!("lockstep-server-tiny-{}-{call}", std::process::id()));
    variant.write(&dir);
    let model = Model::load(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(model)
}

fn default_model() -> Option<Arc<Model>> {
    let Ok(path) = std::env::var("LOCKSTEP_DEFAULT_MODEL") else {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_MODEL").is_none(),
            "LOCKSTEP_DEFAULT_MODEL is required"
        );
        eprintln!("skipped: set LOCKSTEP_DEFAULT_MODEL (ci/fetch-default-model.sh prints it)");
        return None;
    };
    Some(Arc::new(Model::load(std::path::Path::new(&path)).unwrap()))
}

/// Chat and completions, whole and streamed, at temperature 0: streamed equals whole, and a
/// request equals itself in a crowd of four.
async fn stream_equals_whole(server: &TestServer, max_tokens: u32) {
    let chat = |content: &str| json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0});
    let questions = ["Name the three primary colors.", "What is 2+2?", "Say hi.", "Count to five."];
    let mut whole = Vec::new();
    for q in questions {
        let (status, out) = server.post("/v1/chat/completions", &chat(q)).await;
        assert_eq!(status, 200, "{out}");
        let text = out["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        assert!(out["usage"]["completion_tokens"].as_u64().unwrap() > 0);
        let mut body = chat(q);
        body["stream"] = json!(true);
        let events = server.stream("/v1/chat/completions", &body).await;
        assert_eq!(streamed_text(&events), text, "{q}: streamed differs from whole");
        whole.push(text);
    }
    let tasks: Vec<_> =
        questions.iter().map(|q| server.post_in_task("/v1/chat/completions", chat(q))).collect();
    for (task, expected) in tasks.into_iter().zip(&whole) {
        let out: Value = task.await.unwrap();
        assert_eq!(
            out["choices"][0]["message"]["content"].as_str().unwrap(),
            expected,
            "differs in a crowd"
        );
    }
    let completion =
        json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let (status, out) = server.post("/v1/completions", &completion).await;
    assert_eq!(status, 200, "{out}");
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_model_streams_what_it_answers_whole() {
    let model = tiny_model();
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let server = cpu_server(model.clone(), mode).await;
        stream_equals_whole(&server, 12).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_model_streams_what_it_answers_whole() {
    let Some(model) = default_model() else { return };
    let server = cpu_server(model, StepMode::Overlap).await;
    stream_equals_whole(&server, 16).await;
    let (_, out) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}),
        )
        .await;
    assert_eq!(out["choices"][0]["text"], " Paris");
}

/// lm-eval-harness's loglikelihood request: `echo` with `logprobs` over a prompt of token ids
/// (`max_tokens` 1). At each prompt position the top alternatives are exactly those a
/// completion of the prompt up to there reports for its first token (the same logits, computed
/// in another chunk, batch and request), and a prompt token that completion draws scores what
/// it reports for it.
async fn echo_scores_equal_each_prefix_s(server: &TestServer, prompt: &[u32]) {
    let score = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
        "echo": true});
    let (status, out) = server.post("/v1/completions", &score).await;
    assert_eq!(status, 200, "{out}");
    let lp = &out["choices"][0]["logprobs"];
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), prompt.len() + 1);
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    let mut matched = 0;
    for k in 1..prompt.len() {
        let first = json!({"prompt": &prompt[..k], "max_tokens": 1, "temperature": 0,
            "logprobs": 5, "return_token_ids": true});
        let (_, prefix) = server.post("/v1/completions", &first).await;
        let drawn = &prefix["choices"][0];
        assert_eq!(lp["top_logprobs"][k], drawn["logprobs"]["top_logprobs"][0], "position {k}");
        if drawn["token_ids"][0] == prompt[k] {
            let reported = &drawn["logprobs"]["token_logprobs"][0];
            assert_eq!(lp["token_logprobs"][k], *reported, "prompt token {k}");
            matched += 1;
        }
    }
    assert!(matched > 0, "no prompt token is what its prefix draws: {lp}");
    // The legacy form, `max_tokens` 0: the same scores, and nothing generated.
    let mut only = score.clone();
    only["max_tokens"] = json!(0);
    let (status, only) = server.post("/v1/completions", &only).await;
    assert_eq!(status, 200, "{only}");
    let scores = |lp: &Value, n: usize| lp["token_logprobs"].as_array().unwrap()[..n].to_vec();
    let only_lp = &only["choices"][0]["logprobs"];
    assert_eq!(only_lp["token_logprobs"].as_array().unwrap().len(), prompt.len());
    assert_eq!(scores(only_lp, prompt.len()), scores(lp, prompt.len()));
    assert_eq!(only["usage"]["completion_tokens"], 0);
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_a_prompt_with_the_logits_of_each_prefix() {
    let tiny = cpu_server(tiny_model(), StepMode::Overlap).await;
    // Its greedy continuation of a few tokens, so that some prompt tokens are its first choice.
    let start = [5u32, 9, 200, 14, 3];
    let (_, drawn) = tiny
        .post(
            "/v1/completions",
            &json!({"prompt": start, "max_tokens": 40, "temperature": 0, "return_token_ids": true}),
        )
        .await;
    let mut prompt = start.to_vec();
    let continuation = drawn["choices"][0]["token_ids"].as_array().unwrap();
    prompt.extend(continuation.iter().map(|t| t.as_u64().unwrap() as u32));
    echo_scores_equal_each_prefix_s(&tiny, &prompt).await;
    let Some(model) = default_model() else { return };
    let server = cpu_server(model.clone(), StepMode::Overlap).await;
    let codec = ModelCodec(model);
    let prompt = codec.encode("The capital of France is Paris. The capital of Italy is").unwrap();
    echo_scores_equal_each_prefix_s(&server, &prompt).await;
}

/// What a model writes to call `get_weather(city="Paris")` and then `get_time(zone="CET")`, in
/// each format, after a sentence of content.
fn scripted_calls(format: ToolFormat) -> String {
    let text = "Let me check.";
    match format {
        ToolFormat::Hermes => format!(
            "{text}<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{\"zone\": \"CET\"}}}}\n</tool_call>"
        ),
        ToolFormat::Llama3Json => "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"zone\": \"CET\"}}".to_owned(),
        ToolFormat::DeepSeekV3 => format!(
            "{text}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{{\"city\": \"Paris\"}}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{{\"zone\": \"CET\"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        ),
        ToolFormat::DeepSeekV31 => format!(
            "{text}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{\"city\": \"Paris\"}}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{{\"zone\": \"CET\"}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        ),
        ToolFormat::DsmlV32 | ToolFormat::DsmlV4 | ToolFormat::DsmlV41 => {
            let (s, block) = match format {
                ToolFormat::DsmlV32 => ("", "function_calls"),
                ToolFormat::DsmlV4 => ("", "tool_calls"),
                _ => (" ", " calls"),
            };
            format!(
                "{text}\n\n<｜DSML｜{block}>\n<｜DSML｜{s}invoke name=\"get_weather\">\n<｜DSML｜{s}parameter name=\"city\" string=\"true\">Paris</｜DSML｜{s}parameter>\n</｜DSML｜{s}invoke>\n<｜DSML｜{s}invoke name=\"get_time\">\n<｜DSML｜{s}parameter name=\"zone\" string=\"true\">CET</｜DSML｜{s}parameter>\n</｜DSML｜{s}invoke>\n</｜DSML｜{block}>"
            )
        }
    }
}

fn tools() -> Value {
    let tool = |name: &str, arg: &str| {
        json!({"type": "function", "function": {"name": name, "description": "look something up",
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}})
    };
    json!([tool("get_weather", "city"), tool("get_time", "zone")])
}

/// (name, arguments as JSON) of each call.
fn calls_of(calls: &Value) -> Vec<(String, Value)> {
    calls
        .as_array()
        .map(|list| {
            list.iter()
                .map(|c| {
                    let args = c["function"]["arguments"].as_str().unwrap();
                    (
                        c["function"]["name"].as_str().unwrap().to_owned(),
                        serde_json::from_str(args).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_in_every_format_whole_and_streamed() {
    let model = tiny_model();
    let expected = vec![
        ("get_weather".to_owned(), json!({"city": "Paris"})),
        ("get_time".to_owned(), json!({"zone": "CET"})),
    ];
    for format in ToolFormat::ALL {
        let codec = ModelCodec(model.clone());
        let text = scripted_calls(format);
        let script = codec.encode(&text).unwrap();
        assert_eq!(codec.decode(&script).unwrap(), text, "the tokenizer round-trips the markup");
        // The byte-level tokenizer spends a token per byte, and the scripted executor reads no
        // KV: a context far beyond the tiny model's own holds the tools' system message.
        let mut config = sched(&model, StepMode::Sync);
        config.request_tokens_max = 4096;
        config.pool.pages_total = 512;
        let eos = model.stop_tokens[0];
        let mut engine = EngineConfig::new(config.clone());
        engine.check_invariants = true;
        let runner = InlineRunner::new(ScriptedExecutor::new(script, eos), StepCost::ZERO);
        let mut app = AppConfig::new("m", config.request_tokens_max);
        app.tool_format = Some(format);
        let server =
            TestServer::start(engine, runner, Arc::new(ModelCodec(model.clone())), app).await;
        let body = json!({
            "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
            "tools": tools(), "max_tokens": 400, "temperature": 0,
        });
        let (status, out) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{format:?}: {out}");
        let choice = &out["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{format:?}: {out}");
        assert_eq!(calls_of(&choice["message"]["tool_calls"]), expected, "{format:?}: {out}");
        let content = choice["message"]["content"].as_str().unwrap_or("").trim().to_owned();
        assert!(!content.contains("get_weather"), "{format:?}: markup left in content {content:?}");

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = server.stream("/v1/chat/completions", &streamed).await;
        let (stream_content, stream_calls) = fold_chat_stream(&events);
        assert_eq!(stream_calls, expected, "{format:?}: streamed calls");
        assert_eq!(stream_content.trim(), content, "{format:?}: streamed content");
        let finish = events.iter().rev().find_map(|e| e["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("tool_calls"));

        // tool_choice none: the markup is content, not calls.
        let mut none = body.clone();
        none["tool_choice"] = json!("none");
        let (_, out) = server.post("/v1/chat/completions", &none).await;
        assert_eq!(out["choices"][0]["finish_reason"], "stop");
        assert_eq!(out["choices"][0]["message"]["content"], text.as_str());
        server.quiescent().await;
    }
}

/// A streamed chat as a client folds it: the content, and each call's name and arguments.
fn fold_chat_stream(events: &[Value]) -> (String, Vec<(String, Value)>) {
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for e in events {
        let Some(delta) = e["choices"].get(0).map(|c| &c["delta"]) else { continue };
        if let Some(text) = delta["content"].as_str() {
            content.push_str(text);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if calls.len() <= index {
                calls.resize(index + 1, (String::new(), String::new()));
            }
            if let Some(name) = call["function"]["name"].as_str() {
                calls[index].0 = name.to_owned();
                assert!(call["id"].is_string(), "a call's first delta carries its id");
            }
            calls[index].1.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    let calls = calls.into_iter().map(|(n, a)| (n, serde_json::from_str(&a).unwrap())).collect();
    (content, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_tool_choice_opens_the_call_and_an_unknown_name_is_refused() {
    let model = tiny_model();
    let codec = ModelCodec(model.clone());
    // The model continues inside the call the server opened for it.
    let script = codec.encode("{\"city\": \"Paris\"}}\n</tool_call>").unwrap();
    let mut config = sched(&model, StepMode::Sync);
    config.request_tokens_max = 4096;
    config.pool.pages_total = 512;
    let engine = EngineConfig::new(config.clone());
    let runner =
        InlineRunner::new(ScriptedExecutor::new(script, model.stop_tokens[0]), StepCost::ZERO);
    let mut app = AppConfig::new("m", config.request_tokens_max);
    app.tool_format = Some(ToolFormat::Hermes);
    let server = TestServer::start(engine, runner, Arc::new(codec), app).await;
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 100,
    });
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let calls = calls_of(&out["choices"][0]["message"]["tool_calls"]);
    assert_eq!(calls, vec![("get_weather".to_owned(), json!({"city": "Paris"}))], "{out}");
    body["stream"] = json!(true);
    let (_, streamed) = fold_chat_stream(&server.stream("/v1/chat/completions", &body).await);
    assert_eq!(streamed, calls);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{out}");
    assert!(out["error"]["message"].as_str().unwrap().contains("not in tools"), "{out}");
}

/// `/tokenize` counts what the generating routes compute from: a prompt as completions encode
/// it, messages and tools as chat renders them (with `add_generation_prompt` false, a prefix of
/// that); `/detokenize` gives a prompt's text back; bad bodies are 4xx that name the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_the_tokens_the_generating_routes_compute_from() {
    let model = templated(THINKING_TEMPLATE);
    let server = scripted_server(&model, &[], ToolFormat::Hermes, None).await;
    let text = "The quick brown fox, twice: the quick brown fox.";
    let (status, tokenized) = server.post("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(status, 200, "{tokenized}");
    let (_, completion) =
        server.post("/v1/completions", &json!({"prompt": text, "max_tokens": 1})).await;
    assert_eq!(tokenized["count"], completion["usage"]["prompt_tokens"], "{completion}");
    assert_eq!(tokenized["tokens"].as_array().unwrap().len() as u64, tokenized["count"]);
    assert_eq!(tokenized["max_model_len"], 4096);
    assert_eq!(tokenized["token_strs"], Value::Null);

    // Without the tokenizer's special tokens, the text comes back whole, and token by token.
    let plain = json!({"prompt": text, "add_special_tokens": false, "return_token_strs": true});
    let (_, plain) = server.post("/tokenize", &plain).await;
    let strs: Vec<&str> =
        plain["token_strs"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    assert_eq!(strs.concat(), text);
    let (status, back) =
        server.post("/detokenize", &json!({"tokens": plain["tokens"], "model": "m"})).await;
    assert_eq!((status, back["prompt"].as_str()), (200, Some(text)), "{back}");

    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = json!([{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"}]);
    for variables in [json!(null), json!({"enable_thinking": false})] {
        let body = json!({"messages": messages, "tools": tools,
            "chat_template_kwargs": variables});
        let (status, tokenized) = server.post("/tokenize", &body).await;
        assert_eq!(status, 200, "{tokenized}");
        let mut chat = body.clone();
        chat["max_tokens"] = json!(1);
        let (status, answer) = server.post("/v1/chat/completions", &chat).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(tokenized["count"], answer["usage"]["prompt_tokens"], "{variables}");
    }
    let open = |add_generation_prompt| json!({"messages": messages, "add_generation_prompt": add_generation_prompt});
    let (_, opened) = server.post("/tokenize", &open(true)).await;
    let (_, so_far) = server.post("/tokenize", &open(false)).await;
    let (opened, so_far) =
        (opened["tokens"].as_array().unwrap(), so_far["tokens"].as_array().unwrap());
    assert!(so_far.len() < opened.len() && opened.starts_with(so_far), "{so_far:?} {opened:?}");

    let vocab = model.weights.config.vocab_size;
    for (path, body, status, param) in [
        ("/tokenize", json!({"prompt": "a", "messages": messages}), 400, None),
        ("/tokenize", json!({"model": "m"}), 400, None),
        (
            "/tokenize",
            json!({"messages": messages, "add_special_tokens": true}),
            400,
            Some("add_special_tokens"),
        ),
        ("/tokenize", json!({"prompt": "a", "tools": tools}), 400, Some("tools")),
        ("/tokenize", json!({"messages": [{"role": "robot"}]}), 400, Some("messages")),
        ("/tokenize", json!({"prompt": "a", "model": "other"}), 404, None),
        ("/detokenize", json!({"tokens": [1, vocab]}), 400, Some("tokens")),
        ("/detokenize", json!({"tokens": [-1]}), 400, None),
    ] {
        let (got, error) = server.post(path, &body).await;
        assert_eq!(got, status, "{body}: {error}");
        if let Some(param) = param {
            assert_eq!(error["error"]["param"], param, "{body}: {error}");
        }
    }
}

/// The tiny model with `template` for its chat template.
fn templated(template: &str) -> Arc<Model> {
    let mut model = Arc::into_inner(tiny_model()).unwrap();
    model.chat_template = Some(template.to_owned());
    Arc::new(model)
}

/// A server whose model writes `script` and then its stop token, reading `tool_format`'s calls
/// and, where given, `reasoning`.
async fn scripted_server(
    model: &Arc<Model>,
    script: &[u32],
    tool_format: ToolFormat,
    reasoning: Option<ReasoningFormat>,
) -> TestServer {
    let mut config = sched(model, StepMode::Sync);
    config.request_tokens_max = 4096;
    config.pool.pages_total = 512;
    let engine = EngineConfig::new(config.clone());
    let runner = InlineRunner::new(
        ScriptedExecutor::new(script.to_vec(), model.stop_tokens[0]),
        StepCost::ZERO,
    );
    let mut app = AppConfig::new("m", config.request_tokens_max);
    app.tool_format = Some(tool_format);
    app.reasoning_format = reasoning;
    TestServer::start(engine, runner, Arc::new(ModelCodec(model.clone())), app).await
}

/// A Qwen 3 style template: Hermes tool calls, and thinking unless `enable_thinking` is false.
const THINKING_TEMPLATE: &str = concat!(
    "{% if tools %}{{- '<|im_start|>system\\nCall tools as <tool_call>{\"name\": ..., ",
    "\"arguments\": ...}</tool_call>:\\n' }}{% for tool in tools %}{{- tool | tojson }}",
    "{% endfor %}{{- '<|im_end|>\\n' }}{% endif %}",
    "{% for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{% endfor %}{% if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
    "{% if enable_thinking is defined and enable_thinking is false %}",
    "{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_models_reasoning_is_apart_from_its_answer_and_its_calls() {
    let model = templated(THINKING_TEMPLATE);
    let template = model.chat_template.as_deref().unwrap();
    let reasoning_format = ReasoningFormat::detect(template);
    assert_eq!(reasoning_format.map(|f| f.name), Some("qwen3"));
    assert_eq!(ToolFormat::for_template(template), Some(ToolFormat::Hermes));
    let codec = ModelCodec(model.clone());
    // A call written inside the thinking is thought, not a call.
    let text = "<think>\nMaybe <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>?\n\
                </think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\": \"Paris\"}}\n</tool_call>";
    let script = codec.encode(text).unwrap();
    // The tokens whose text lies wholly between the markers: what usage counts as reasoning.
    let (body_start, body_end) =
        (text.find("<think>").unwrap() + 7, text.find("</think>").unwrap());
    let offset = |n: usize| codec.decode(&script[..n]).unwrap().len();
    let thinking_tokens =
        (0..script.len()).filter(|&i| offset(i) >= body_start && offset(i + 1) <= body_end).count();
    assert!(thinking_tokens > 20, "{thinking_tokens}");
    let start = |reasoning| scripted_server(&model, &script, ToolFormat::Hermes, reasoning);
    let server = start(reasoning_format).await;
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(), "max_tokens": 400,
    });
    let weather = vec![("get_weather".to_owned(), json!({"city": "Paris"}))];
    let thought = "\nMaybe <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>?\n";
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], thought, "{out}");
    assert_eq!(message["content"], "\n\nChecking.", "{out}");
    assert_eq!(calls_of(&message["tool_calls"]), weather, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
    let details = &out["usage"]["completion_tokens_details"];
    assert_eq!(details["reasoning_tokens"], thinking_tokens, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], script.len() + 1, "{out}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/chat/completions", &streamed).await;
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage, &out["usage"], "{events:?}");
    let reasoning: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, thought);
    let (content, calls) = fold_chat_stream(&events);
    assert_eq!((content.as_str(), calls), ("\n\nChecking.", weather.clone()));

    // vLLM's include_reasoning: false hides the reasoning, which is still not content, and
    // still counted; SGLang's separate_reasoning: false reads none, as a server without a
    // reasoning format (below) does.
    let mut hidden = body.clone();
    hidden["include_reasoning"] = json!(false);
    let (status, out) = server.post("/v1/chat/completions", &hidden).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], Value::Null, "{out}");
    assert_eq!(message["content"], "\n\nChecking.", "{out}");
    assert_eq!(calls_of(&message["tool_calls"]), weather, "{out}");
    assert_eq!(out["usage"]["completion_tokens_details"]["reasoning_tokens"], thinking_tokens);
    hidden["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &hidden).await;
    assert!(events.iter().all(|e| e["choices"][0]["delta"].get("reasoning_content").is_none()));
    assert_eq!(fold_chat_stream(&events), ("\n\nChecking.".to_owned(), weather.clone()));
    let mut together = body.clone();
    together["separate_reasoning"] = json!(false);
    let (status, out) = server.post("/v1/chat/completions", &together).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{out}");
    assert!(message["content"].as_str().unwrap().starts_with("<think>\nMaybe"), "{out}");
    assert!(out["usage"].get("completion_tokens_details").is_none(), "{out}");

    // Thinking turned off by the template's variable: the prompt closes the block, so what the
    // model writes is all answer (here the block it wrote anyway, as text).
    let mut off = body.clone();
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (status, out) = server.post("/v1/chat/completions", &off).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], Value::Null, "{out}");
    assert!(message["content"].as_str().unwrap().starts_with("<think>\nMaybe"), "{out}");
    assert_eq!(out["usage"]["completion_tokens_details"]["reasoning_tokens"], 0, "{out}");
    off["chat_template_kwargs"] = json!({"add_generation_prompt": false});
    let (status, out) = server.post("/v1/chat/completions", &off).await;
    assert_eq!(status, 400, "{out}");
    assert!(out["error"]["message"].as_str().unwrap().contains("add_generation_prompt"), "{out}");
    server.quiescent().await;

    // A server that reads no reasoning: the thinking is content, and there is no such field.
    let server = start(None).await;
    let (_, out) = server.post("/v1/chat/completions", &body).await;
    let message = &out["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{out}");
    assert!(out["usage"].get("completion_tokens_details").is_none(), "{out}");
    assert!(message["content"].as_str().unwrap().starts_with("<think>"), "{out}");
    server.quiescent().await;
}

/// A DeepSeek V4.1 style template: DSML V4.1 tool calls, and thinking when `thinking` is true.
const DEEPSEEK_V41_TEMPLATE: &str = concat!(
    "{% if tools %}{{- '<｜System｜>Call tools as\\n\\n<｜DSML｜ calls>\\n<｜DSML｜ invoke ",
    "name=\"...\">...</｜DSML｜ invoke>\\n</｜DSML｜ calls>\\nTools: ' }}{% for tool in tools %}",
    "{{- tool | tojson }}{% endfor %}{% endif %}",
    "{% for m in messages %}{{- '<｜' + m.role + '｜>' + m.content }}{% endfor %}",
    "{% if add_generation_prompt %}{{- '<｜Assistant｜>' }}",
    "{% if thinking is defined and thinking %}{{- '<think>' }}{% else %}{{- '</think>' }}",
    "{% endif %}{% endif %}",
);

/// DeepSeek V4.1 may go from its thinking straight into its calls: the tool block ends the
/// reasoning, and the calls are read from what follows, whole and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_v41_thinks_straight_into_its_calls() {
    let model = templated(DEEPSEEK_V41_TEMPLATE);
    let template = model.chat_template.as_deref().unwrap();
    let reasoning_format = ReasoningFormat::detect(template);
    assert_eq!(reasoning_format.map(|f| f.name), Some("deepseek_v41"));
    assert_eq!(ToolFormat::for_template(template), Some(ToolFormat::DsmlV41));
    let codec = ModelCodec(model.clone());
    let thought = "Paris, so the weather tool.\n\n";
    let block = "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter \
                 name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n\
                 </｜DSML｜ calls>";
    // After the block: dropped, as V4.1's reference parser drops it.
    let text = format!("{thought}{block}</think>Done.");
    let script = codec.encode(&text).unwrap();
    let offset = |n: usize| codec.decode(&script[..n]).unwrap().len();
    let thinking_tokens = (0..script.len()).filter(|&i| offset(i + 1) <= thought.len()).count();
    let server = scripted_server(&model, &script, ToolFormat::DsmlV41, reasoning_format).await;
    let weather = vec![("get_weather".to_owned(), json!({"city": "Paris"}))];
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(), "max_tokens": 400, "chat_template_kwargs": {"thinking": true},
    });
    let (status, out) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], thought, "{out}");
    assert_eq!(message["content"], Value::Null, "{out}");
    assert_eq!(calls_of(&message["tool_calls"]), weather, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
    let details = &out["usage"]["completion_tokens_details"];
    assert_eq!(details["reasoning_tokens"], thinking_tokens, "{out}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/chat/completions", &streamed).await;
    assert_eq!(&events.last().unwrap()["usage"], &out["usage"], "{events:?}");
    let reasoning: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, thought);
    assert_eq!(fold_chat_stream(&events), (String::new(), weather.clone()));

    // Thinking off: the prompt closes the block, so the thought is the answer's content.
    let mut off = body.clone();
    off["chat_template_kwargs"] = json!({"thinking": false});
    let (status, out) = server.post("/v1/chat/completions", &off).await;
    assert_eq!(status, 200, "{out}");
    let message = &out["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], Value::Null, "{out}");
    assert_eq!(message["content"], thought.trim_end(), "{out}");
    assert_eq!(calls_of(&message["tool_calls"]), weather, "{out}");
    server.quiescent().await;
}
