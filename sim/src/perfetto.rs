//! A run as a Chrome trace (JSON; opens in Perfetto, ui.perfetto.dev): a track per request with
//! its spans (waiting to be sent, queued until its first token, decoding until its end), and the
//! faults as instant events on a track of their own.

use serde_json::{Value, json};

use crate::events::Event;
use crate::run::RunOutcome;
use crate::trace::SimTrace;

const CLIENTS_PID: u64 = 1;
const FAULTS_PID: u64 = 2;

pub fn timeline(trace: &SimTrace, outcome: &RunOutcome) -> String {
    let mut events: Vec<Value> = vec![
        json!({"ph": "M", "pid": CLIENTS_PID, "name": "process_name", "args": {"name": "requests"}}),
        json!({"ph": "M", "pid": FAULTS_PID, "name": "process_name", "args": {"name": "faults"}}),
    ];
    for (index, observed) in outcome.observed.iter().enumerate() {
        let tid = index as u64 + 1;
        let session =
            trace.requests[index].session.map_or(String::new(), |s| format!(" session {s}"));
        events.push(json!({"ph": "M", "pid": CLIENTS_PID, "tid": tid, "name": "thread_name",
            "args": {"name": format!("request {index}{session}")}}));
        let Some(sent) = observed.sent_at else { continue };
        let end = observed.ended_at.unwrap_or(outcome.virtual_time);
        let first = observed.first_token_at.unwrap_or(end);
        let how = observed.ending.as_ref().map_or("unfinished", |e| e.label());
        events.push(span(CLIENTS_PID, tid, "queued and prefill", sent, first, json!({})));
        if first < end {
            events.push(span(
                CLIENTS_PID,
                tid,
                "decode",
                first,
                end,
                json!({"tokens": observed.tokens.len()}),
            ));
        }
        events.push(json!({"ph": "i", "pid": CLIENTS_PID, "tid": tid, "s": "t", "name": how,
            "ts": micros(end)}));
    }
    for logged in &outcome.log {
        if let Event::Fault(what) = &logged.event {
            events.push(json!({"ph": "i", "pid": FAULTS_PID, "tid": 1, "s": "p", "name": what,
                "ts": micros(logged.at)}));
        }
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}

fn span(
    pid: u64,
    tid: u64,
    name: &str,
    from: std::time::Duration,
    to: std::time::Duration,
    args: Value,
) -> Value {
    json!({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": micros(from),
        "dur": micros(to.saturating_sub(from)), "args": args})
}

fn micros(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
