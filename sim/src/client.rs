//! The simulated clients: one turmoil host whose tasks replay the trace through the server's HTTP
//! API, as an OpenAI client would (a streamed completion with token-id prompts, a new connection
//! per request). Open-loop requests go out at their times; a session's next turn goes out after
//! the previous answer plus its think time. A client may go away mid-request (the cancellation
//! fault), gives up when the server says nothing for its read timeout (a crashed server sends no
//! FIN; a live one sends keep-alives), and gives up after a bound. What each client saw is kept
//! for the oracles. A board tells the run loop when the next client will send and how many
//! requests are out, so that it can fast-forward through idle time (`run`).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_server::client::Connection;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::timeout;

use crate::events::{Event, EventLog};
use crate::topology::HTTP_PORT;
use crate::trace::{SimRequest, Start};

/// How a request ended, as its client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// A whole answer: the stream ended with a finish reason and `[DONE]`.
    Completed { finish_reason: String },
    /// Refused with an HTTP status before any token.
    Refused { status: u16, message: String },
    /// Failed after the stream began (an error event, or the stream cut short), or the
    /// connection failed.
    Failed { why: String },
    /// The client went away (the cancellation fault).
    Cancelled,
    /// Nothing came, not even a keep-alive, for the client's read timeout: the server it talks
    /// to went away without closing the connection (a crash).
    Silent,
    /// No end within the client's bound.
    TimedOut,
}

impl Ending {
    pub fn label(&self) -> &'static str {
        match self {
            Ending::Completed { .. } => "completed",
            Ending::Refused { .. } => "refused",
            Ending::Failed { .. } => "failed",
            Ending::Cancelled => "cancelled",
            Ending::Silent => "silent",
            Ending::TimedOut => "timed-out",
        }
    }
}

/// What one client saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// The server's id for it (`cmpl-<id>`): the router's request id in its events.
    pub server_id: Option<u64>,
    pub sent_at: Option<Duration>,
    pub first_token_at: Option<Duration>,
    pub ended_at: Option<Duration>,
    pub tokens: Vec<u32>,
    /// Each token's log-probabilities as the stream gave them (one JSON object a token: its
    /// text, logprob, top alternatives and text offset), when the request asked for them.
    pub logprobs: Vec<String>,
    pub ending: Option<Ending>,
}

pub type Observations = Arc<Mutex<Vec<Observed>>>;

/// What the clients tell the run loop, for the idle fast-forward: when each client waiting to send
/// will send, and how many requests are out (sent and not yet ended). An open-loop request is on it
/// from the start; a session's next turn from the previous turn's end (in the same tick: a host's
/// time does not move on while it has a task ready to run).
#[derive(Debug, Default)]
pub struct Board {
    /// (send time, request) of each client sleeping until its send.
    next_sends: BTreeSet<(Duration, usize)>,
    outstanding: usize,
}

impl Board {
    /// The earliest time a client will send, if any is waiting to.
    pub fn next_send(&self) -> Option<Duration> {
        self.next_sends.first().map(|&(at, _)| at)
    }

    /// Requests sent and not yet ended.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }
}

pub type ClientBoard = Arc<Mutex<Board>>;

/// The clients' part of a run.
#[derive(Clone, Debug)]
pub struct ClientPlan {
    pub requests: Vec<SimRequest>,
    /// When each request's client goes away after sending, if it does.
    pub cancel_after: Vec<Option<Duration>>,
    /// The host serving the HTTP API.
    pub entry: String,
    /// The longest a client waits for its answer.
    pub timeout: Duration,
    /// The longest a client waits for the server's next bytes.
    pub read_timeout: Duration,
    /// Open-loop times count from here.
    pub start_offset: Duration,
}

/// Registers the clients' host on `sim`; the run is over when it returns.
pub fn install(
    sim: &mut turmoil::Sim<'_>,
    plan: ClientPlan,
    seen: Observations,
    log: EventLog,
    board: ClientBoard,
) {
    {
        let mut board = board.lock().expect("before the run");
        for (index, request) in plan.requests.iter().enumerate() {
            if let Start::At(at) = request.start {
                board.next_sends.insert((plan.start_offset + at, index));
            }
        }
    }
    sim.client("clients", async move {
        let plan = Arc::new(plan);
        let (ended, watchers): (Vec<_>, Vec<_>) =
            (0..plan.requests.len()).map(|_| watch::channel(false)).unzip();
        let mut tasks = Vec::with_capacity(plan.requests.len());
        for (index, done) in ended.into_iter().enumerate() {
            let previous = match plan.requests[index].start {
                Start::After { previous, .. } => Some(watchers[previous].clone()),
                Start::At(_) => None,
            };
            let (plan, seen, log, board) = (plan.clone(), seen.clone(), log.clone(), board.clone());
            tasks.push(tokio::spawn(async move {
                one_request(&plan, index, previous, &seen, &log, &board).await;
                // Later turns wait on this; nobody listening is fine.
                let _ = done.send(true);
            }));
        }
        for task in tasks {
            task.await?;
        }
        Ok(())
    });
}

async fn one_request(
    plan: &ClientPlan,
    index: usize,
    previous: Option<watch::Receiver<bool>>,
    seen: &Observations,
    log: &EventLog,
    board: &ClientBoard,
) {
    let request = &plan.requests[index];
    let send_at = match request.start {
        // On the board since `install`.
        Start::At(at) => plan.start_offset + at,
        Start::After { think, .. } => {
            if let Some(mut previous) = previous {
                // The sender is dropped only after sending `true`.
                let _ = previous.wait_for(|ended| *ended).await;
            }
            let send_at = turmoil::sim_elapsed().unwrap_or_default() + think;
            board.lock().expect("one task at a time").next_sends.insert((send_at, index));
            send_at
        }
    };
    let now = turmoil::sim_elapsed().unwrap_or_default();
    tokio::time::sleep(send_at.saturating_sub(now)).await;
    {
        let mut board = board.lock().expect("one task at a time");
        board.next_sends.remove(&(send_at, index));
        board.outstanding += 1;
    }
    let sent_at = turmoil::sim_elapsed().unwrap_or_default();
    seen.lock().expect("one task at a time")[index].sent_at = Some(sent_at);
    log.log(Event::Sent { request: index });
    let cancel = plan.cancel_after[index];
    let ending = tokio::select! {
        ending = exchange(plan, index, seen, log) => ending,
        () = sleep_or_never(cancel) => Ending::Cancelled,
        () = tokio::time::sleep(plan.timeout) => Ending::TimedOut,
    };
    board.lock().expect("one task at a time").outstanding -= 1;
    let mut all = seen.lock().expect("one task at a time");
    let observed = &mut all[index];
    observed.ended_at = turmoil::sim_elapsed();
    log.log(Event::Ended {
        request: index,
        how: format!("{ending:?}"),
        tokens: observed.tokens.len(),
    });
    observed.ending = Some(ending);
}

async fn sleep_or_never(after: Option<Duration>) {
    match after {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// Sends the request and reads its stream to the end; tokens land in `seen` as they come, so a
/// cancelled or timed-out request keeps what it got.
async fn exchange(plan: &ClientPlan, index: usize, seen: &Observations, log: &EventLog) -> Ending {
    let request = &plan.requests[index];
    // Every wait on the server is bounded by the read timeout: `Ending::Silent` past it.
    let connect = turmoil::net::TcpStream::connect((plan.entry.as_str(), HTTP_PORT));
    let io = match timeout(plan.read_timeout, connect).await {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => return Ending::Failed { why: format!("connect: {e}") },
        Err(_) => return Ending::Silent,
    };
    let mut connection = match timeout(plan.read_timeout, Connection::new(io)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Ending::Failed { why: e },
        Err(_) => return Ending::Silent,
    };
    // OpenAI's form: token ids as the object's keys.
    let logit_bias: serde_json::Map<String, Value> =
        request.logit_bias.iter().map(|&(token, bias)| (token.to_string(), json!(bias))).collect();
    let mut body = json!({
        "model": "provenance",
        "prompt": request.input,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        // OpenAI's seeds are signed; the server takes the bits as they are.
        "seed": request.seed as i64,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": logit_bias,
        "stream": true,
    });
    if request.constrained {
        body["response_format"] = json!({"type": "json_object"});
    }
    if request.priority != 0 {
        body["priority"] = json!(request.priority);
    }
    if let Some(top) = request.logprobs {
        body["logprobs"] = json!(top);
    }
    if request.echo {
        body["echo"] = json!(true);
    }
    // With `echo` the answer's first tokens are the prompt's: set aside, and checked.
    let mut echoed = Vec::with_capacity(if request.echo { request.input.len() } else { 0 });
    let mut response =
        match timeout(plan.read_timeout, connection.post("/v1/completions", &body.to_string()))
            .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Ending::Failed { why: e },
            Err(_) => return Ending::Silent,
        };
    if response.status.as_u16() != 200 {
        let status = response.status.as_u16();
        let message = match timeout(plan.read_timeout, response.text()).await {
            Ok(text) => text.unwrap_or_default(),
            Err(_) => return Ending::Silent,
        };
        return Ending::Refused { status, message };
    }
    let mut pending = String::new();
    let mut finish_reason = None;
    loop {
        let frame = match timeout(plan.read_timeout, response.frame()).await {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => {
                return Ending::Failed { why: "the stream ended without [DONE]".into() };
            }
            Ok(Err(e)) => return Ending::Failed { why: e },
            Err(_) => return Ending::Silent,
        };
        pending.push_str(&String::from_utf8_lossy(&frame));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if data == "[DONE]" {
                    return match finish_reason {
                        _ if request.echo && echoed != request.input => Ending::Failed {
                            why: format!("echoed {echoed:?} for the prompt {:?}", request.input),
                        },
                        Some(finish_reason) => Ending::Completed { finish_reason },
                        None => Ending::Failed { why: "[DONE] without a finish reason".into() },
                    };
                }
                let value: Value = match serde_json::from_str(data) {
                    Ok(v) => v,
                    Err(e) => {
                        return Ending::Failed { why: format!("an event that is not JSON: {e}") };
                    }
                };
                if let Some(error) = value.get("error") {
                    return Ending::Failed { why: format!("error event: {error}") };
                }
                if let Some(id) = value["id"].as_str().and_then(|i| i.strip_prefix("cmpl-")) {
                    let mut all = seen.lock().expect("one task at a time");
                    all[index].server_id = all[index].server_id.or(id.parse().ok());
                }
                let choice = &value["choices"][0];
                let text = choice["text"].as_str().unwrap_or("");
                let mut tokens = match parse_tokens(text) {
                    Ok(t) => t,
                    Err(e) => return Ending::Failed { why: e },
                };
                if request.echo && echoed.len() < request.input.len() {
                    let take = (request.input.len() - echoed.len()).min(tokens.len());
                    echoed.extend(tokens.drain(..take));
                }
                let logprobs = token_logprobs(&choice["logprobs"]);
                if !tokens.is_empty() || !logprobs.is_empty() {
                    let mut all = seen.lock().expect("one task at a time");
                    if all[index].first_token_at.is_none() {
                        all[index].first_token_at = turmoil::sim_elapsed();
                        log.log(Event::FirstToken { request: index });
                    }
                    all[index].tokens.extend(tokens);
                    all[index].logprobs.extend(logprobs);
                }
                if let Some(reason) = choice["finish_reason"].as_str() {
                    finish_reason = Some(reason.to_owned());
                }
            }
        }
    }
}

/// A completion chunk's log-probabilities (`{"tokens", "token_logprobs", "top_logprobs",
/// "text_offset"}`, one entry each per token), one JSON object a token; none when absent.
fn token_logprobs(logprobs: &Value) -> Vec<String> {
    let Some(values) = logprobs["token_logprobs"].as_array() else { return Vec::new() };
    (0..values.len())
        .map(|i| {
            let field = |name: &str| logprobs[name].get(i).cloned().unwrap_or(Value::Null);
            json!({
                "token": field("tokens"),
                "logprob": field("token_logprobs"),
                "top": field("top_logprobs"),
                "offset": field("text_offset"),
            })
            .to_string()
        })
        .collect()
}

/// The synthetic codec writes token `n` as ` t<n>`.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    text.split_whitespace()
        .map(|w| {
            w.strip_prefix('t')
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("{w:?} is not a synthetic token"))
        })
        .collect()
}
