//! A run as a Chrome trace (JSON; opens in ui.perfetto.dev): a track per request with its phases,
//! a track per host with the steps its device ran (requests, prompt tokens and decode rows in
//! each), and the faults and restarts as instant events.
//!
//! A request's phases come from what the run logged. Through a router: `queue` from `routed` to
//! the first prefill step holding its transfer, `prefill` to the last such step's end, `transfer`
//! from there to its decoding (the first decode step holding it, or the router's `decoding` if
//! that came first), `decode` to the client's end. Beside them, on a track of process
//! `kv writes`, the span of its transfer's writes on the decode worker: from the first arriving
//! to the last landing. A decode span that begins before that span ends is a request decoding
//! from pages its transfer had not finished writing (the incident this project exists for):
//! `decode_before_writes_landed` lists them. On a single server: `queue` from sending to its first step, `prefill` to its first token,
//! `decode` to its end. (On a worker a request's id is its transfer's id; on a single server,
//! the engine's id, which the client reads from `cmpl-<id>`.)

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};

use crate::events::Event;
use crate::run::RunOutcome;
use crate::trace::SimTrace;

const REQUESTS_PID: u64 = 1;
const FAULTS_PID: u64 = 2;
const KV_WRITES_PID: u64 = 3;
const FIRST_HOST_PID: u64 = 10;

/// Steps of one host that held a request: first start, last end.
type StepSpan = (Duration, Duration);

/// A transfer's writes on its decode worker: the first arrival, the last landing (if any).
type WriteSpan = (Duration, Option<Duration>);

/// The requests (by index in the trace) whose decode began before their transfer's last KV
/// write landed: when it began, and when that write landed.
pub fn decode_before_writes_landed(outcome: &RunOutcome) -> Vec<(usize, Duration, Duration)> {
    let (held, router, writes) = collect(outcome);
    let mut found = Vec::new();
    for (index, observed) in outcome.observed.iter().enumerate() {
        let Some(said) = observed.server_id.and_then(|id| router.get(&id)) else { continue };
        let Some((transfer, decode_at)) = decode_start(said, &held) else { continue };
        if let Some(&(_, Some(landed))) = writes.get(&transfer)
            && decode_at < landed
        {
            found.push((index, decode_at, landed));
        }
    }
    found
}

/// Router request id -> what it said, when, and of which transfer.
type RouterSaid = BTreeMap<u64, Vec<(String, Duration, Option<u64>)>>;

/// What the timeline reads from a run's log: see `collect`.
type Collected = (BTreeMap<(String, u64), StepSpan>, RouterSaid, BTreeMap<u64, WriteSpan>);

/// The step spans per (host, request there), the router's events per request, and each
/// transfer's write span.
fn collect(outcome: &RunOutcome) -> Collected {
    let mut held: BTreeMap<(String, u64), StepSpan> = BTreeMap::new();
    let mut router: RouterSaid = BTreeMap::new();
    let mut writes: BTreeMap<u64, WriteSpan> = BTreeMap::new();
    for logged in &outcome.log {
        match &logged.event {
            Event::Step { host, started, requests, .. } => {
                for &r in requests {
                    let entry = held.entry((host.clone(), r)).or_insert((*started, logged.at));
                    entry.1 = logged.at;
                }
            }
            Event::Router { what, request, transfer, .. } => {
                router.entry(*request).or_default().push((what.clone(), logged.at, *transfer));
            }
            Event::KvWrite { transfer, landed } => {
                let entry = writes.entry(*transfer).or_insert((logged.at, None));
                if *landed {
                    entry.1 = Some(logged.at);
                }
            }
            _ => {}
        }
    }
    (held, router, writes)
}

pub fn timeline(trace: &SimTrace, outcome: &RunOutcome) -> String {
    let mut events: Vec<Value> = vec![
        name_process(REQUESTS_PID, "requests"),
        name_process(FAULTS_PID, "faults"),
        name_process(KV_WRITES_PID, "kv writes"),
    ];
    let mut host_pids: BTreeMap<String, u64> = BTreeMap::new();
    // (host, request id there) -> the span of the steps that held it; router request id ->
    // (what, when, transfer); transfer -> its writes' span.
    let (held, router, writes) = collect(outcome);
    for logged in &outcome.log {
        match &logged.event {
            Event::Step { host, step, started, requests, prompt_tokens, decode_rows } => {
                let next = FIRST_HOST_PID + host_pids.len() as u64;
                let pid = *host_pids.entry(host.clone()).or_insert(next);
                events.push(span(
                    pid,
                    1,
                    "step",
                    *started,
                    logged.at,
                    json!({
                        "step": step, "requests": requests, "prompt_tokens": prompt_tokens,
                        "decode_rows": decode_rows,
                    }),
                ));
            }
            Event::Fault(what) => events.push(instant(FAULTS_PID, 1, what, logged.at, "p")),
            Event::Started { host } => {
                let next = FIRST_HOST_PID + host_pids.len() as u64;
                let pid = *host_pids.entry(host.clone()).or_insert(next);
                events.push(instant(pid, 1, "started", logged.at, "p"));
            }
            _ => {}
        }
    }
    for (host, pid) in &host_pids {
        events.push(name_process(*pid, host));
        events.push(json!({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name",
            "args": {"name": "device steps"}}));
    }
    for (index, observed) in outcome.observed.iter().enumerate() {
        let tid = index as u64 + 1;
        let session =
            trace.requests[index].session.map_or(String::new(), |s| format!(" session {s}"));
        events.push(json!({"ph": "M", "pid": REQUESTS_PID, "tid": tid, "name": "thread_name",
            "args": {"name": format!("request {index}{session}")}}));
        let Some(sent) = observed.sent_at else { continue };
        let end = observed.ended_at.unwrap_or(outcome.virtual_time);
        let how = observed.ending.as_ref().map_or("unfinished", |e| e.label());
        let args = json!({"server_id": observed.server_id, "tokens": observed.tokens.len(), "ending": how});
        let said = observed.server_id.and_then(|id| router.get(&id));
        let phases = match said {
            Some(said) => routed_phases(said, &held, end),
            None => single_phases(observed.server_id, &held, sent, observed.first_token_at, end),
        };
        let transfer = said.and_then(|said| decode_start(said, &held)).map(|(t, _)| t);
        if let Some((transfer, &(first, landed))) =
            transfer.and_then(|t| writes.get(&t).map(|span| (t, span)))
        {
            events.push(json!({"ph": "M", "pid": KV_WRITES_PID, "tid": tid,
                "name": "thread_name", "args": {"name": format!("request {index}{session}")}}));
            let last = landed.unwrap_or(first);
            events.push(span(
                KV_WRITES_PID,
                tid,
                "kv writes",
                first,
                last,
                json!({"transfer": transfer, "last_landed": landed.map(micros)}),
            ));
        }
        let mut last = sent;
        for (name, from, to) in phases {
            if to > from {
                events.push(span(REQUESTS_PID, tid, name, from, to, args.clone()));
            }
            last = last.max(to);
        }
        if last == sent {
            events.push(span(REQUESTS_PID, tid, "request", sent, end, args.clone()));
        }
        events.push(instant(REQUESTS_PID, tid, how, end, "t"));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}

/// Phases of a request the router handled.
fn routed_phases(
    said: &[(String, Duration, Option<u64>)],
    held: &BTreeMap<(String, u64), StepSpan>,
    end: Duration,
) -> Vec<(&'static str, Duration, Duration)> {
    let at = |what: &str| said.iter().find(|(w, _, _)| w == what).map(|&(_, t, _)| t);
    let (Some(routed), decoding) = (at("routed"), said.iter().find(|(w, _, _)| w == "decoding"))
    else {
        return Vec::new();
    };
    let Some(&(_, decoding_at, transfer)) = decoding else {
        return vec![("routed, never decoding", routed, end)];
    };
    let decoding_at = decode_start(said, held).map_or(decoding_at, |(_, at)| at);
    let prefill = transfer.and_then(|t| {
        held.iter()
            .find(|((host, r), _)| *r == t && host.starts_with("prefill"))
            .map(|(_, span)| *span)
    });
    match prefill {
        Some((first, last)) => vec![
            ("queue", routed, first),
            ("prefill", first, last),
            ("transfer", last, decoding_at),
            ("decode", decoding_at, end),
        ],
        None => {
            vec![("queue, prefill and transfer", routed, decoding_at), ("decode", decoding_at, end)]
        }
    }
}

/// The transfer a routed request was decoded from, and when its decode began: its first step on
/// a decode worker, or the router's `decoding` if that came first.
fn decode_start(
    said: &[(String, Duration, Option<u64>)],
    held: &BTreeMap<(String, u64), StepSpan>,
) -> Option<(u64, Duration)> {
    let &(_, decoding_at, transfer) = said.iter().find(|(w, _, _)| w == "decoding")?;
    let transfer = transfer?;
    let first_step = held
        .iter()
        .filter(|((host, r), _)| *r == transfer && host.starts_with("decode"))
        .map(|(_, span)| span.0)
        .min();
    Some((transfer, first_step.map_or(decoding_at, |s| s.min(decoding_at))))
}

/// Phases of a request a single server handled.
fn single_phases(
    id: Option<u64>,
    held: &BTreeMap<(String, u64), StepSpan>,
    sent: Duration,
    first_token: Option<Duration>,
    end: Duration,
) -> Vec<(&'static str, Duration, Duration)> {
    let steps = id.and_then(|id| held.get(&("server".to_owned(), id)));
    let first_step = steps.map_or(sent, |s| s.0);
    let first_token = first_token.unwrap_or(end);
    vec![
        ("queue", sent, first_step),
        ("prefill", first_step, first_token),
        ("decode", first_token, end),
    ]
}

fn name_process(pid: u64, name: &str) -> Value {
    json!({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
}

fn span(pid: u64, tid: u64, name: &str, from: Duration, to: Duration, args: Value) -> Value {
    json!({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": micros(from),
        "dur": micros(to.saturating_sub(from)), "args": args})
}

fn instant(pid: u64, tid: u64, name: &str, at: Duration, scope: &str) -> Value {
    json!({"ph": "i", "pid": pid, "tid": tid, "s": scope, "name": name, "ts": micros(at)})
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
