//! Router, prefill and decode as three `lockstep serve --role …` processes on 127.0.0.1 (the
//! provenance executor, so no model is needed): the same greedy output as one process, and the
//! router's recorded trace replays to the same outputs; 64 concurrent two-turn sessions equal
//! their prompts run alone; clients leaving at any moment leave nothing held on either worker;
//! `kill -9` of the decode worker mid-transfer ends every request, and the prefill worker lets go
//! of its pages; a prefill worker killed and started again (a new incarnation) is paired again.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

#[path = "common/process.rs"]
mod process;

use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use lockstep_server::client::Connection;
use process::{Process, free_port, free_ports};
use serde_json::{Value, json};

fn lockstep(args: &[&str]) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "--executor", "provenance", "--kv-pages", "256", "--page-tokens", "4"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Process(child)
}

async fn post(port: u16, path: &str, body: &Value) -> Option<(u16, Value)> {
    let io = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let mut c = Connection::new(io).await.ok()?;
    let response = c.post(path, &body.to_string()).await.ok()?;
    let status = response.status.as_u16();
    Some((status, response.json().await.ok()?))
}

async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let io = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let mut c = Connection::new(io).await.ok()?;
    let response = c.get(path).await.ok()?;
    let status = response.status.as_u16();
    Some((status, response.text().await.ok()?))
}

fn completion(prompt: &[u32], max_tokens: u32) -> Value {
    json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 })
}

fn prompt(i: u32, len: u32) -> Vec<u32> {
    (0..len).map(|p| 1 + (p * 7 + i * 131) % 900).collect()
}

/// Polls until `done` or the bound passes.
async fn within<F: std::future::Future<Output = bool>>(
    bound: Duration,
    mut done: impl FnMut() -> F,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

/// A metric's value in a Prometheus text page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

struct Deployment {
    router: (Process, u16),
    prefill: (Process, u16, u16),
    decode: (Process, u16, u16),
}

fn prefill_process(http: u16, peer: u16, decode_peer: u16) -> Process {
    let decode = format!("2@127.0.0.1:{decode_peer}");
    lockstep(&[
        "--role",
        "prefill",
        "--worker-id",
        "1",
        "--port",
        &http.to_string(),
        "--peer-port",
        &peer.to_string(),
        "--decode",
        &decode,
    ])
}

async fn deploy() -> Deployment {
    deploy_with(&[]).await
}

/// `router_args` go to the router's command line.
async fn deploy_with(router_args: &[&str]) -> Deployment {
    let [d_http, d_peer, p_http, p_peer, r_http] = free_ports();
    let decode = lockstep(&[
        "--role",
        "decode",
        "--worker-id",
        "2",
        "--port",
        &d_http.to_string(),
        "--peer-port",
        &d_peer.to_string(),
    ]);
    let prefill = prefill_process(p_http, p_peer, d_peer);
    let (prefill_at, decode_at) =
        (format!("1@127.0.0.1:{p_peer}"), format!("2@127.0.0.1:{d_peer}"));
    let port = r_http.to_string();
    let mut args = vec!["--role", "router", "--worker-id", "0", "--port", &port];
    args.extend(["--prefill", &prefill_at, "--decode", &decode_at]);
    args.extend(router_args);
    let router = lockstep(&args);
    let ready = within(Duration::from_secs(20), || async {
        matches!(post(r_http, "/v1/completions", &completion(&[1, 2, 3], 1)).await, Some((200, _)))
    })
    .await;
    assert!(ready, "the router never served through its workers");
    Deployment {
        router: (router, r_http),
        prefill: (prefill, p_http, p_peer),
        decode: (decode, d_http, d_peer),
    }
}

fn text(body: &Value) -> String {
    body["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("no text: {body}")).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_give_the_output_of_one_and_the_router_records_a_trace_that_replays() {
    let single_port = free_port();
    let _single = lockstep(&["--port", &single_port.to_string()]);
    let trace = std::env::temp_dir().join(format!("lockstep-router-trace-{}.jsonl", free_port()));
    let mut d = deploy_with(&["--record-trace", trace.to_str().unwrap()]).await;
    assert!(
        within(Duration::from_secs(20), || async { get(single_port, "/health").await.is_some() })
            .await
    );
    for i in 0..10 {
        let body = completion(&prompt(i, 3 + 7 * i), 1 + i % 12);
        let (s1, alone) = post(single_port, "/v1/completions", &body).await.unwrap();
        let (s2, through) = post(d.router.1, "/v1/completions", &body).await.unwrap();
        assert_eq!((s1, s2), (200, 200), "{alone} {through}");
        assert_eq!(text(&through), text(&alone), "request {i}");
    }
    let (_, page) = get(d.router.1, "/metrics").await.unwrap();
    assert!(metric(&page, "lockstep:kv_transfers_completed_total").unwrap() >= 10.0, "{page}");
    let (_, page) = get(d.decode.1, "/metrics").await.unwrap();
    assert!(metric(&page, "lockstep:kv_bytes_received_total").unwrap() > 0.0);

    // SIGTERM: the router drains and flushes its trace.
    let pid = d.router.0.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let _ = d.router.0.0.wait();
    let recorded = lockstep_server::record::read_trace(&trace).unwrap();
    let _ = std::fs::remove_file(&trace);
    assert!(recorded.records.len() >= 11, "{} records", recorded.records.len());
    // Replayed through one process, every recorded request gives its recorded output.
    for record in &recorded.records {
        let body = completion(&record.input_ids, record.max_tokens.unwrap());
        let (_, alone) = post(single_port, "/v1/completions", &body).await.unwrap();
        let recorded_text: String =
            record.output.as_ref().unwrap().token_ids.iter().map(|t| format!(" t{t}")).collect();
        assert_eq!(text(&alone), recorded_text, "request {}", record.request_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_decode_worker_ends_every_request_and_the_prefill_pages_return() {
    let mut d = deploy().await;
    let router = d.router.1;
    let mut requests = Vec::new();
    for i in 0..12 {
        requests.push(tokio::spawn(async move {
            post(router, "/v1/completions", &completion(&prompt(i, 200), 400)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    d.decode.0.0.kill().unwrap(); // SIGKILL
    // The router hears the link close at once; the bound is its dead-peer bound and a lease.
    let bound = Duration::from_secs(2 + 2 + 1 + 5);
    for request in requests {
        let ended =
            tokio::time::timeout(bound, request).await.expect("a request never ended").unwrap();
        let (status, body) = ended.expect("the router answered");
        assert!(status == 200 || status >= 500, "{status} {body}");
    }
    let prefill_http = d.prefill.1;
    let returned = within(Duration::from_secs(10), || async {
        let page = get(prefill_http, "/metrics").await.map(|(_, p)| p).unwrap_or_default();
        metric(&page, "vllm:kv_cache_usage_perc") == Some(0.0)
    })
    .await;
    assert!(returned, "the prefill worker still holds pages");
    let (status, _) = post(router, "/v1/completions", &completion(&[1, 2], 2)).await.unwrap();
    assert_eq!(status, 503, "no decode worker: the router says so");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_prefill_worker_is_paired_again() {
    let mut d = deploy().await;
    d.prefill.0.0.kill().unwrap();
    let _ = d.prefill.0.0.wait();
    let (p_http, p_peer, d_peer) = (d.prefill.1, d.prefill.2, d.decode.2);
    d.prefill.0 = prefill_process(p_http, p_peer, d_peer);
    let router = d.router.1;
    let paired = within(Duration::from_secs(20), || async {
        matches!(
            post(router, "/v1/completions", &completion(&prompt(7, 30), 5)).await,
            Some((200, _))
        )
    })
    .await;
    assert!(paired, "the router never paired the new prefill worker");
}

/// 64 sessions at once, two turns each, every turn's prompt a shared system prefix, the session's
/// history and a new message: each answer equals the same prompt run alone through one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_multi_turn_sessions_through_three_processes_equal_one_at_a_time() {
    let single_port = free_port();
    let _single = lockstep(&["--port", &single_port.to_string()]);
    let d = deploy().await;
    let router = d.router.1;
    let mut sessions = Vec::new();
    for session in 0..64u32 {
        sessions.push(tokio::spawn(async move {
            let mut history: Vec<u32> = (1..=12).collect();
            let mut asked = Vec::new();
            for turn in 0..2u32 {
                history.extend((0..3).map(|p| 1 + (session * 17 + turn * 5 + p) % 900));
                let (status, body) =
                    post(router, "/v1/completions", &completion(&history, 4)).await.unwrap();
                assert_eq!(status, 200, "{body}");
                let answer = text(&body);
                asked.push((history.clone(), answer.clone()));
                history.extend(answer.split_whitespace().map(|t| t[1..].parse::<u32>().unwrap()));
            }
            asked
        }));
    }
    assert!(
        within(Duration::from_secs(20), || async { get(single_port, "/health").await.is_some() })
            .await
    );
    for session in sessions {
        for (prompt, answer) in session.await.unwrap() {
            let (_, alone) =
                post(single_port, "/v1/completions", &completion(&prompt, 4)).await.unwrap();
            assert_eq!(answer, text(&alone));
        }
    }
}

/// Clients that go away at every moment of a request (before its transfer, during it, while it
/// decodes) leave no page, pin, slot or transfer held on either worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_leave_mid_transfer_leave_nothing_held_on_either_worker_process() {
    let d = deploy().await;
    let router = d.router.1;
    for i in 0..40u32 {
        let body = completion(&prompt(i, 120), 100).to_string();
        let io = tokio::net::TcpStream::connect(("127.0.0.1", router)).await.unwrap();
        let mut c = Connection::new(io).await.unwrap();
        let request = c.post("/v1/completions", &body);
        let _ = tokio::time::timeout(Duration::from_micros(300 * u64::from(i % 9)), request).await;
    }
    for http in [d.prefill.1, d.decode.1] {
        let idle = within(Duration::from_secs(10), || async {
            let page = get(http, "/metrics").await.map(|(_, p)| p).unwrap_or_default();
            metric(&page, "vllm:kv_cache_usage_perc") == Some(0.0)
                && metric(&page, "vllm:num_requests_running") == Some(0.0)
                && metric(&page, "vllm:num_requests_waiting") == Some(0.0)
        })
        .await;
        assert!(idle, "a worker still holds pages or requests");
    }
    let (status, body) = post(router, "/v1/completions", &completion(&[5, 6, 7], 3)).await.unwrap();
    assert_eq!(status, 200, "{body}");
}
