//! `--record-trace`: a node with a recorder writes every request it serves (completions with
//! token-id and text prompts, chat turns of a session, streams, a client that leaves) in the
//! native trace format, read back with `record::read_trace`; a full channel drops and counts
//! instead of holding a request.

#![allow(clippy::unwrap_used, reason = "test helpers: a failure is the test failing")]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Bytes;
use common::{CONTEXT, TestServer, VOCAB, counter, sched_config};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use lockstep_core::sched::StepMode;
use lockstep_server::engine::StepCost;
use lockstep_server::node::Drained;
use lockstep_server::record::{
    self, RecordTask, Recorder, RecorderLimits, RequestInput, TRACE_FORMAT, TRACE_VERSION,
    TraceFinish, TraceHeader, TraceRecord,
};
use lockstep_server::serve::ServeOptions;
use lockstep_server::text::{ChatEnd, SyntheticCodec, TextCodec};
use lockstep_server::tool_calls::ToolFormat;
use serde_json::{Map, Value, json};

fn slow_steps() -> StepCost {
    StepCost {
        per_step: Duration::from_millis(2),
        per_prefill_token: Duration::ZERO,
        per_decode_token: Duration::ZERO,
    }
}

fn temp_trace(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockstep-record-{}-{name}.jsonl", std::process::id()))
}

/// A provenance node recording into `path` (Hermes tool calls, so chat takes tools).
async fn recording_server(
    path: &Path,
    limits: RecorderLimits,
) -> (TestServer, record::RecordWriter<tokio::fs::File>) {
    let file = record::create_file(path).await.unwrap();
    let header = TraceHeader::new("test-model", CONTEXT, VOCAB);
    let (recorder, writer) = Recorder::new(header, file, limits);
    let server = TestServer::provenance_with(sched_config(StepMode::Sync), slow_steps(), |app| {
        app.tool_format = Some(ToolFormat::Hermes);
        app.recorder = Some(recorder);
    })
    .await;
    (server, writer)
}

/// POSTs JSON with an `X-Session-Id` header; the body as JSON.
async fn post_in_session(addr: SocketAddr, path: &str, body: &Value, session: &str) -> Value {
    let io = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(io)).await.unwrap();
    tokio::spawn(connection);
    let request = Request::post(path)
        .header("host", "lockstep")
        .header("content-type", "application/json")
        .header("x-session-id", session)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// The engine's request id in a response's `id` (`cmpl-7`, `chatcmpl-7`).
fn request_id(body: &Value) -> u64 {
    body["id"].as_str().unwrap().rsplit('-').next().unwrap().parse().unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

fn output(record: &TraceRecord) -> (Vec<u32>, TraceFinish) {
    let out = record.output.as_ref().unwrap();
    (out.token_ids.clone(), out.finish_reason)
}

async fn stop(server: TestServer, task: RecordTask<tokio::fs::File>) -> u64 {
    server.quiescent().await;
    assert_eq!(server.shut_down().await, Drained::Cleanly);
    let totals = task.finish().await.unwrap();
    assert_eq!((totals.lost, totals.error), (0, None));
    totals.written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_recorded_as_sent_with_the_tokens_the_client_got() {
    let path = temp_trace("every");
    let (server, writer) = recording_server(&path, RecorderLimits::default()).await;
    let task = writer.spawn(&server.state.metrics);
    let codec = SyntheticCodec::new(VOCAB);

    // A completion with a token-id prompt, and one with a text prompt and every sampling knob.
    let ids_body = json!({
        "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": true,
    });
    let (status, by_ids) = server.post("/v1/completions", &ids_body).await;
    assert_eq!(status, 200, "{by_ids}");
    let text_body = json!({
        "model": "test-model", "prompt": "t5 t6 t9 hello", "max_tokens": 5, "temperature": 0.8,
        "top_p": 0.9, "top_k": 20, "seed": 7, "stop": ["zzz"], "return_token_ids": true,
        "logprobs": 2, "echo": true,
    });
    let (status, by_text) = server.post("/v1/completions", &text_body).await;
    assert_eq!(status, 200, "{by_text}");

    // Two turns of one session, the second with tools.
    let turn1 = vec![json!({"role": "user", "content": "hello there"})];
    let chat1 = json!({ "messages": turn1, "max_tokens": 3, "seed": 11, "return_token_ids": true });
    let chat1_out = post_in_session(server.addr, "/v1/chat/completions", &chat1, "sess-1").await;
    let reply = chat1_out["choices"][0]["message"]["content"].clone();
    let turn2 = vec![
        turn1[0].clone(),
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": [{"type": "text", "text": "and then?"}]}),
    ];
    let tools = vec![json!({"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}})];
    let chat2 = json!({
        "messages": turn2, "tools": tools, "tool_choice": "auto", "max_tokens": 3,
        "return_token_ids": true, "logprobs": true, "top_logprobs": 1,
    });
    let chat2_out = post_in_session(server.addr, "/v1/chat/completions", &chat2, "sess-1").await;

    // A stream, read to the end.
    let stream_body = json!({
        "prompt": [9, 8, 7, 6], "max_tokens": 6, "stream": true, "return_token_ids": true,
    });
    let events = server.stream("/v1/completions", &stream_body).await;
    let streamed: Vec<u32> =
        events.iter().flat_map(|e| ids(&e["choices"][0]["token_ids"])).collect();
    assert_eq!(streamed.len(), 6);

    // A stream whose client leaves after two events.
    let mut connection = server.connect().await;
    let left_body = json!({
        "prompt": [1, 2, 3], "max_tokens": 200, "stream": true, "return_token_ids": true,
    });
    let mut response = connection.post("/v1/completions", &left_body.to_string()).await.unwrap();
    let mut seen = String::new();
    while lockstep_server::client::sse_data(&seen).len() < 2 {
        seen.push_str(std::str::from_utf8(&response.frame().await.unwrap().unwrap()).unwrap());
    }
    let left_events: Vec<Value> = lockstep_server::client::sse_data(&seen)
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let left_id = request_id(&left_events[0]);
    let left_seen: Vec<u32> =
        left_events.iter().flat_map(|e| ids(&e["choices"][0]["token_ids"])).collect();
    drop(response);
    drop(connection);

    let (_, metrics) = server.get("/metrics").await;
    assert_eq!(stop(server, task).await, 6);
    let trace = record::read_trace(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(trace.header.format, TRACE_FORMAT);
    assert_eq!(trace.header.version, TRACE_VERSION);
    assert_eq!(trace.header.model, "test-model");
    assert_eq!((trace.header.context_tokens, trace.header.vocab_size), (CONTEXT, VOCAB));
    let records: BTreeMap<u64, &TraceRecord> =
        trace.records.iter().map(|r| (r.request_id, r)).collect();
    assert_eq!(records.len(), 6, "one record per request");

    let r = records[&request_id(&by_ids)];
    assert_eq!(
        r.request,
        Some(RequestInput::Completions { prompt: json!([5, 6, 7]), response_format: None })
    );
    assert_eq!(r.input_ids, [5, 6, 7]);
    assert_eq!((r.max_tokens, r.sampling.temperature, r.stream), (Some(4), 0.0, false));
    assert_eq!(output(r), (ids(&by_ids["choices"][0]["token_ids"]), TraceFinish::Length));
    assert_eq!((r.session.as_ref(), r.turn), (None, None));
    assert_eq!((r.logprobs, r.prompt_logprobs), (None, None));

    let r = records[&request_id(&by_text)];
    assert_eq!(
        r.request,
        Some(RequestInput::Completions { prompt: json!("t5 t6 t9 hello"), response_format: None })
    );
    assert_eq!(r.input_ids, ids(&by_text["prompt_token_ids"]));
    assert_eq!(r.input_ids, codec.encode("t5 t6 t9 hello").unwrap());
    let s = r.sampling;
    assert_eq!((s.temperature, s.top_p, s.top_k, s.seed), (0.8, 0.9, 20, 7));
    assert_eq!((r.max_tokens, r.stop.as_slice()), (Some(5), &["zzz".to_owned()][..]));
    assert_eq!(output(r), (ids(&by_text["choices"][0]["token_ids"]), TraceFinish::Length));
    // `logprobs` with `echo`: the output's and the prompt's, each with two alternatives.
    assert_eq!((r.logprobs, r.prompt_logprobs), (Some(2), Some(2)));

    let (r1, r2) = (records[&request_id(&chat1_out)], records[&request_id(&chat2_out)]);
    assert_eq!((r1.session.as_deref(), r1.turn), (Some("sess-1"), Some(1)));
    assert_eq!((r2.session.as_deref(), r2.turn), (Some("sess-1"), Some(2)));
    let sent = RequestInput::Chat {
        messages: turn1.clone(),
        tools: None,
        tool_choice: None,
        response_format: None,
        chat_template_kwargs: None,
    };
    assert_eq!(r1.request, Some(sent));
    let sent = RequestInput::Chat {
        messages: turn2.clone(),
        tools: Some(tools.clone()),
        tool_choice: Some(json!("auto")),
        response_format: None,
        chat_template_kwargs: None,
    };
    assert_eq!(r2.request, Some(sent));
    assert_eq!(
        r1.input_ids,
        codec.encode_chat(&turn1, None, &Map::new(), ChatEnd::AssistantTurn("")).unwrap().tokens
    );
    assert_eq!(
        r2.input_ids,
        codec
            .encode_chat(&turn2, Some(&tools), &Map::new(), ChatEnd::AssistantTurn(""))
            .unwrap()
            .tokens
    );
    assert_eq!(r1.sampling.seed, 11);
    assert_eq!(output(r1).0, ids(&chat1_out["choices"][0]["token_ids"]));
    assert_eq!(output(r2).0, ids(&chat2_out["choices"][0]["token_ids"]));
    assert_eq!((r1.logprobs, r2.logprobs, r2.prompt_logprobs), (None, Some(1), None));

    let r = records[&request_id(&events[0])];
    assert!(r.stream);
    assert_eq!(output(r), (streamed, TraceFinish::Length));

    let r = records[&left_id];
    let (tokens, finish) = output(r);
    assert_eq!(finish, TraceFinish::Abort, "the client left");
    assert!(tokens.starts_with(&left_seen) && tokens.len() < 200, "{tokens:?} {left_seen:?}");

    // Arrivals in the order sent; every timing within its request.
    let order = [&by_ids, &by_text, &chat1_out, &chat2_out, &events[0]].map(request_id);
    let arrivals: Vec<f64> =
        order.iter().chain([&left_id]).map(|id| records[id].arrival_ms).collect();
    assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "{arrivals:?}");
    for r in records.values() {
        let t = r.timings.unwrap();
        let ttft = t.ttft_ms.unwrap();
        assert!(ttft > 0.0 && ttft <= t.e2e_ms, "{t:?}");
    }
    assert_eq!(counter(&metrics, "lockstep:trace_records_dropped_total"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_channel_drops_and_counts_and_never_holds_a_request() {
    let path = temp_trace("full");
    let limits = RecorderLimits { records_queued_max: 2, ..RecorderLimits::default() };
    // The writer is not running: nothing leaves the channel.
    let (server, writer) = recording_server(&path, limits).await;
    for i in 0..5u32 {
        let body = json!({ "prompt": [1 + i, 2, 3], "max_tokens": 3 });
        let post = server.post("/v1/completions", &body);
        let (status, out) = tokio::time::timeout(Duration::from_secs(10), post).await.unwrap();
        assert_eq!(status, 200, "{out}");
    }
    let (_, metrics) = server.get("/metrics").await;
    assert_eq!(counter(&metrics, "lockstep:trace_records_dropped_total"), 3);
    assert_eq!(counter(&metrics, "lockstep:trace_records_written_total"), 0);

    let task = writer.spawn(&server.state.metrics);
    let metrics = server.state.metrics.clone();
    assert_eq!(stop(server, task).await, 2);
    assert_eq!(counter(&metrics.render(), "lockstep:trace_records_written_total"), 2);
    let trace = record::read_trace(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let prompts: Vec<&[u32]> = trace.records.iter().map(|r| r.input_ids.as_slice()).collect();
    assert_eq!(prompts, [&[1, 2, 3][..], &[2, 2, 3][..]], "the first two, in order");
}

#[test]
fn serve_takes_record_trace() {
    let args: Vec<String> = ["--record-trace", "/tmp/x.jsonl"].map(String::from).to_vec();
    let options = ServeOptions::parse(&args).unwrap();
    assert_eq!(options.record_trace, Some(PathBuf::from("/tmp/x.jsonl")));
    assert_eq!(ServeOptions::parse(&[]).unwrap().record_trace, None);
    assert!(ServeOptions::parse(&["--record-trace".to_owned()]).is_err());
}
