//! How the rest of the process talks to an engine: bounded channels only.
//!
//! A submission carries its own event channel, sized for every event the request can produce
//! (one per output token and one terminal), so the engine never waits on a slow client and never
//! drops an event. Dropping the `RequestStream` aborts the request: a client that disconnects
//! frees its pages.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockstep_core::model::{SamplingSpec, TokenLogprobs};
use lockstep_core::sched::{AdmissionError, FinishReason, NewRequest, RequestId};
use tokio::sync::{mpsc, oneshot};

use super::stats::EngineStats;

/// What the engine tells one request, in order: its prompt's log-probabilities if it asked
/// (`SamplingSpec::prompt_logprobs`: those of positions 1, 2, … in order, in as many events as
/// the prompt took steps), tokens, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    PromptLogprobs { logprobs: Vec<TokenLogprobs> },
    Token { token: u32, logprobs: Option<TokenLogprobs> },
    Finished { reason: FinishReason, output_tokens: u32 },
}

pub(crate) enum Command {
    Submit {
        request: NewRequest,
        spec: SamplingSpec,
        events: mpsc::Sender<RequestEvent>,
        reply: oneshot::Sender<Result<(), SubmitError>>,
    },
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The scheduler refused it (queue full, prompt too long, …).
    Refused(AdmissionError),
    /// The engine's inbox is full: try again shortly.
    Busy,
    /// The engine is draining for shutdown, or has stopped.
    ShuttingDown,
    /// The engine did not answer within the bound.
    Timeout,
    /// A router with no prefill or no decode worker up.
    NoWorkers,
    /// The router could not take it for another reason.
    Unavailable(String),
    /// This engine cannot serve what the request asks for (`param`): a 400, not a retry.
    Unsupported { param: &'static str, why: &'static str },
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Refused(e) => write!(f, "{e}"),
            SubmitError::Busy => write!(f, "the engine's inbox is full"),
            SubmitError::ShuttingDown => write!(f, "the server is shutting down"),
            SubmitError::Timeout => write!(f, "the engine did not answer in time"),
            SubmitError::NoWorkers => write!(f, "no prefill or no decode worker is up"),
            SubmitError::Unavailable(why) => write!(f, "{why}"),
            SubmitError::Unsupported { why, .. } => write!(f, "{why}"),
        }
    }
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) aborts: mpsc::Sender<RequestId>,
    pub(crate) next_id: Arc<AtomicU64>,
    pub(crate) stats: Arc<EngineStats>,
    pub(crate) submit_wait_max: Duration,
}

impl EngineHandle {
    /// Queues a request; `request.id` is replaced with a fresh one. The returned stream yields
    /// its events; dropping it aborts the request.
    pub async fn submit(
        &self,
        mut request: NewRequest,
        spec: SamplingSpec,
    ) -> Result<RequestStream, SubmitError> {
        if self.stats.draining() {
            return Err(SubmitError::ShuttingDown);
        }
        request.id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let id = request.id;
        // Every token and the terminal event fit, and a prompt's scores in as many events as it
        // has positions: the engine's sends never fail for space.
        let scores = if spec.prompt_logprobs.is_some() { request.prompt.len() } else { 0 };
        let capacity = request.max_tokens as usize + 2 + scores;
        let (events, receiver) = mpsc::channel(capacity);
        let (reply, answer) = oneshot::channel();
        let command = Command::Submit { request, spec, events, reply };
        match self.commands.try_send(command) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Err(SubmitError::Busy),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(SubmitError::ShuttingDown),
        }
        // From here the engine may hold the request: the guard aborts it if we give up.
        let mut stream = RequestStream { id, events: receiver, aborts: Some(self.aborts.clone()) };
        let refused = match tokio::time::timeout(self.submit_wait_max, answer).await {
            Ok(Ok(Ok(()))) => return Ok(stream),
            // Timed out: the engine may yet accept it, so the guard stays armed and aborts it.
            Err(_) => return Err(SubmitError::Timeout),
            Ok(Ok(Err(e))) => e,
            Ok(Err(_)) => SubmitError::ShuttingDown,
        };
        // Refused, or the engine is gone: it holds nothing to abort, and under overload the
        // abort channel must stay free for requests that do hold pages.
        stream.aborts = None;
        Err(refused)
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The statistics, shared: for an observer that outlives this handle (the simulator's leak
    /// check reads a host's after its requests are done).
    pub fn shared_stats(&self) -> Arc<EngineStats> {
        self.stats.clone()
    }
}

/// One request's events. Dropping it before `Finished` aborts the request.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    events: mpsc::Receiver<RequestEvent>,
    aborts: Option<mpsc::Sender<RequestId>>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` only if the engine stopped without finishing the request.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        let event = self.events.recv().await;
        if matches!(event, Some(RequestEvent::Finished { .. }) | None) {
            self.aborts = None; // Ended: nothing to abort.
        }
        event
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if let Some(aborts) = self.aborts.take() {
            // The abort channel holds one slot per live request, so this fits; if it ever did
            // not, the engine still notices the closed event channel at the next token.
            let _ = aborts.try_send(self.id);
        }
    }
}
