//! `lockstep serve --device cuda` as a newcomer runs it, on a tiny generated model: one server,
//! the same with every CUDA launch option, and a router with a prefill and a decode worker both
//! on the device (KV pages leave one worker's device memory and enter the other's through
//! `PageStore`) give the same greedy completion, token for token. The CPU server's completion is
//! printed beside them (the CPU backend agrees within a tolerance, not bit for bit:
//! gpu/tests/cuda_device.rs holds that). A completion held to a JSON schema is valid on each and
//! the same on every CUDA deployment: the grammar compiler reaches the CUDA executors.
//!
//! Needs a CUDA device: a GPU, or the CUDA emulator (`ci/cuda-emulator.sh` runs this with it on
//! LD_LIBRARY_PATH); without one it skips, unless `LOCKSTEP_REQUIRE_CUDA=1`.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

#[path = "common/process.rs"]
mod process;
#[path = "../../gpu/tests/tiny/mod.rs"]
mod tiny;

use std::path::{Path, PathBuf};
use std::time::Duration;

use lockstep_gpu::cuda::probe;
use lockstep_server::client::Connection;
use process::{free_port, free_ports, serve_model};
use serde_json::{Value, json};
use tokio::time::Instant;

/// A greedy completion of 12 tokens from the server on `port`, once it answers (two minutes at
/// most: the emulator compiles the kernels on a cold cache), as its text. Past that, the servers'
/// `log` is the failure report (a worker that could not start says why there).
async fn complete(port: u16, log: &Path) -> String {
    let body = json!({"prompt": "hello there", "max_tokens": 12, "temperature": 0});
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(answer) = post(port, &body).await {
            return answer["choices"][0]["text"].as_str().unwrap().to_string();
        }
        if Instant::now() >= deadline {
            let log_text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("no completion from port {port}; the servers' log:\n{log_text}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A greedy completion held to a JSON schema (constrained decoding: the grammar compiler must
/// reach the CUDA executor, on a worker too), checked and returned as its text.
async fn complete_json(port: u16) -> String {
    let schema = json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["he", "t"]}},
        "required": ["ok", "tag"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false},
    });
    let body = json!({
        "prompt": "hello there", "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    });
    let answer = post(port, &body).await.expect("a constrained completion");
    let text = answer["choices"][0]["text"].as_str().unwrap().to_string();
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(value["ok"].is_boolean() && value["tag"].is_string(), "{text:?}");
    text
}

async fn post(port: u16, body: &Value) -> Option<Value> {
    let io = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let mut c = Connection::new(io).await.ok()?;
    let response = c.post("/v1/completions", &body.to_string()).await.ok()?;
    (response.status.as_u16() == 200).then_some(())?;
    response.json().await.ok()
}

#[tokio::test]
async fn one_cuda_server_and_a_cuda_prefill_decode_pair_answer_alike() {
    if let Err(e) = probe::probe(0) {
        assert!(std::env::var("LOCKSTEP_REQUIRE_CUDA").as_deref() != Ok("1"), "{e}");
        eprintln!("skipped: {e}");
        return;
    }
    let dir: PathBuf =
        std::env::temp_dir().join(format!("lockstep-cuda-roles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = dir.join("model");
    tiny::variants()[0].write(&model);
    let log = dir.join("serve.log");
    let small = ["--kv-pages", "64", "--page-tokens", "4"];
    let mut answers = Vec::new();
    let mut constrained = Vec::new();
    for device in [
        &["--device", "cpu"][..],
        &["--device", "cuda"],
        &["--device", "cuda", "--cuda-launch", "all"],
    ] {
        let port = free_port().to_string();
        let _server = serve_model(&model, &[device, &small, &["--port", &port]].concat(), &log);
        answers.push(complete(port.parse().unwrap(), &log).await);
        constrained.push(complete_json(port.parse().unwrap()).await);
    }
    let [decode_port, decode_peer, prefill_port, prefill_peer, router_port] =
        free_ports().map(|port| port.to_string());
    let decode_at = format!("2@127.0.0.1:{decode_peer}");
    let prefill_at = format!("1@127.0.0.1:{prefill_peer}");
    let mut decode = vec!["--device", "cuda", "--role", "decode", "--worker-id", "2"];
    decode.extend(["--port", &decode_port, "--peer-port", &decode_peer]);
    let mut prefill = vec!["--device", "cuda", "--role", "prefill", "--worker-id", "1"];
    prefill.extend(["--port", &prefill_port, "--peer-port", &prefill_peer, "--decode", &decode_at]);
    let mut router = vec!["--role", "router", "--worker-id", "0", "--port", &router_port];
    router.extend(["--prefill", &prefill_at, "--decode", &decode_at]);
    let _decode = serve_model(&model, &[&decode[..], &small].concat(), &log);
    let _prefill = serve_model(&model, &[&prefill[..], &small].concat(), &log);
    let _router = serve_model(&model, &[&router[..], &small].concat(), &log);
    answers.push(complete(router_port.parse().unwrap(), &log).await);
    constrained.push(complete_json(router_port.parse().unwrap()).await);
    let [cpu, cuda, with_options, split] = <[String; 4]>::try_from(answers).unwrap();
    eprintln!(
        "cpu: {cpu:?}\ncuda: {cuda:?}\ncuda, every launch option: {with_options:?}\n\
         prefill + decode on cuda: {split:?}"
    );
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(cuda, with_options, "the launch options changed the completion\n{log_text}");
    assert_eq!(cuda, split, "the split deployment's completion differs\n{log_text}");
    assert!(!cuda.is_empty(), "an empty completion\n{log_text}");
    eprintln!("held to a schema (cpu, cuda, cuda with options, split): {constrained:?}");
    assert_eq!(constrained[1], constrained[2], "the launch options changed the constrained one");
    assert_eq!(constrained[1], constrained[3], "the split deployment's constrained one differs");
    let _ = std::fs::remove_dir_all(&dir);
}
