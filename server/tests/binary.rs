//! The `lockstep` binary itself: `lockstep serve` answers on its port, and SIGTERM lets an open
//! stream finish, refuses new work, and exits cleanly within the drain bound.

#[path = "common/process.rs"]
mod process;

use std::process::{Command, Stdio};
use std::time::Duration;

use lockstep_server::client::{Connection, sse_data};
use process::{Process as Server, free_port};
use serde_json::json;

async fn connect(port: u16) -> Option<Connection> {
    let io = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    Connection::new(io).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_open_stream_then_exits() {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["serve", "--executor", "provenance", "--port", &port.to_string()])
        .args(["--drain-timeout", "10", "--log-format", "json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let mut ready = false;
    for _ in 0..200 {
        if let Some(mut c) = connect(port).await
            && let Ok(r) = c.get("/health").await
            && r.status.as_u16() == 200
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the server never answered /health");

    let mut c = connect(port).await.unwrap();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut response = c.post("/v1/completions", &body.to_string()).await.unwrap();
    assert_eq!(response.status.as_u16(), 200);
    let mut text = String::from_utf8(response.frame().await.unwrap().unwrap().to_vec()).unwrap();

    let pid = server.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(mut late) = connect(port).await
        && let Ok(r) = late.post("/v1/completions", &json!({"prompt": [1]}).to_string()).await
    {
        assert_eq!(r.status.as_u16(), 503, "new work is refused while draining");
    }
    while let Some(frame) = response.frame().await.unwrap() {
        text.push_str(std::str::from_utf8(&frame).unwrap());
    }
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "the open stream finished");
    let usage: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"][0]["finish_reason"], "length");

    let mut exited = None;
    for _ in 0..200 {
        if let Some(status) = server.0.try_wait().unwrap() {
            exited = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = exited.expect("the server exits after draining");
    assert!(status.success(), "{status}");
    let mut logs = String::new();
    std::io::Read::read_to_string(server.0.stderr.as_mut().unwrap(), &mut logs).unwrap();
    let first: serde_json::Value = serde_json::from_str(logs.lines().next().unwrap()).unwrap();
    assert_eq!(
        first["fields"]["message"], "serving",
        "--log-format json writes JSON lines: {logs}"
    );
}
