//! The router's engine: one task owning the transfer protocol's router (`core::pd::Router`) and
//! its end of the peer transport, behind the same `EngineHandle` a single process serves HTTP
//! through. A submitted request goes to a prefill and a decode worker; the decode worker's token
//! stream comes back as the request's events; a client that goes away cancels it wherever it is.
//! Workers join when their links come up and leave when they go down.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::model::SamplingSpec;
use lockstep_core::pd::{Router, RouterConfig, RouterError, RouterOutput};
use lockstep_core::sched::{FinishReason, NewRequest, RequestId};
use lockstep_core::wire::{AbortReason, Envelope, Epoch, RequestSpec, Role, WorkerId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::engine::{
    Command, EngineHandle, EngineStats, InvariantCadence, RequestEvent, SubmitError,
};
use crate::metrics::{Metrics, observe};
use crate::peer::{PeerEvent, Transport};

#[derive(Clone, Debug)]
pub struct RouterEngineConfig {
    pub router: RouterConfig,
    /// The role of every worker the router may hear from, by id (from the command line).
    pub workers: BTreeMap<WorkerId, Role>,
    pub inbox_max: usize,
    pub submit_wait_max: Duration,
    pub check_invariants: bool,
    /// The id of the first request submitted (`engine::first_request_id`).
    pub first_request_id: u64,
}

/// A request the router holds: where its events go, and its clocks.
struct Live {
    events: mpsc::Sender<RequestEvent>,
    arrived: Instant,
    output_tokens: u32,
    /// The attempt of its last transfer; `None` until the first left the router's queue.
    attempt: Option<Epoch>,
    /// When the last output token went to the client; `None` until the first.
    last_token_at: Option<Instant>,
}

struct RouterEngine {
    config: RouterEngineConfig,
    router: Router,
    transport: Transport,
    peer_events: mpsc::Receiver<PeerEvent>,
    commands: mpsc::Receiver<Command>,
    aborts: mpsc::Receiver<RequestId>,
    live: BTreeMap<RequestId, Live>,
    stats: Arc<EngineStats>,
    metrics: Arc<Metrics>,
    cadence: InvariantCadence,
}

/// Starts the router's engine task; its handle serves the HTTP app as a single engine's does.
pub fn spawn(
    config: RouterEngineConfig,
    transport: Transport,
    peer_events: mpsc::Receiver<PeerEvent>,
    metrics: Arc<Metrics>,
) -> (EngineHandle, JoinHandle<()>) {
    let (commands, inbox) = mpsc::channel(config.inbox_max.max(1));
    let aborts_max = config.inbox_max + config.router.requests_max as usize;
    let (aborts, abort_inbox) = mpsc::channel(aborts_max);
    let stats = Arc::new(EngineStats::new(Instant::now()));
    let handle = EngineHandle {
        commands,
        aborts,
        next_id: Arc::new(AtomicU64::new(config.first_request_id)),
        stats: stats.clone(),
        submit_wait_max: config.submit_wait_max,
    };
    // Workers that are up already; later ones arrive as `Up` events.
    let router = Router::new(transport.me(), config.router.clone(), Vec::new(), Vec::new());
    let engine = RouterEngine {
        config,
        router,
        transport,
        peer_events,
        commands: inbox,
        aborts: abort_inbox,
        live: BTreeMap::new(),
        stats,
        metrics,
        cadence: InvariantCadence::default(),
    };
    (handle, tokio::spawn(engine.run()))
}

impl RouterEngine {
    async fn run(mut self) {
        loop {
            let timer = self.router.next_timeout().and_then(|t| self.instant_of(t));
            tokio::select! {
                biased;
                Some(id) = self.aborts.recv() => {
                    if self.router.abort(id, self.now()).is_ok() {
                        self.metrics.client_aborts.increment(1);
                    }
                }
                event = self.peer_events.recv() => match event {
                    Some(event) => self.on_peer_event(event),
                    None => return,
                },
                command = self.commands.recv() => match command {
                    Some(Command::Submit { request, spec, events, reply }) => {
                        self.submit(request, spec, events, reply);
                    }
                    None => return,
                },
                () = sleep_until_or_never(timer) => {
                    let now = self.now();
                    self.router.handle_timeout(now);
                }
            }
            self.after_input();
        }
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.stats.now_ns())
    }

    fn instant_of(&self, t: Time) -> Option<Instant> {
        self.stats.epoch().checked_add(Duration::from_nanos(t.as_nanos()))
    }

    fn on_peer_event(&mut self, event: PeerEvent) {
        let now = self.now();
        match event {
            PeerEvent::Received(envelope) => self.router.handle_envelope(envelope, now),
            PeerEvent::Up { peer, places } => match self.config.workers.get(&peer.worker) {
                Some(&role) => {
                    tracing::info!(?peer, ?role, "worker up");
                    self.router.handle_worker_up(peer, role, places, now);
                }
                None => tracing::warn!(?peer, "a worker the router was not told about"),
            },
            PeerEvent::Down { peer, reason } => {
                tracing::warn!(?peer, %reason, "worker down");
                self.router.handle_worker_down(peer.worker, now);
            }
            // The router moves no KV: no KV lane opens to it (`wire::check_lane`).
            PeerEvent::KvLaneDown { .. } => {}
        }
    }

    fn submit(
        &mut self,
        request: NewRequest,
        spec: SamplingSpec,
        events: mpsc::Sender<RequestEvent>,
        reply: oneshot::Sender<Result<(), SubmitError>>,
    ) {
        let id = request.id;
        let prompt_tokens = request.prompt.len() as u64;
        let spec = RequestSpec {
            id,
            prompt: request.prompt,
            max_tokens: request.max_tokens,
            stop_token_ids: request.stop_token_ids,
            ignore_eos: request.ignore_eos,
            priority: request.priority,
            cache_salt: request.cache_salt,
            sampling: spec.sampling,
            logit_bias: spec.logit_bias,
            grammar: spec.grammar.map(Box::new),
            logprobs: spec.logprobs,
            prompt_logprobs: spec.prompt_logprobs,
        };
        let answer = match self.router.submit(spec, self.now()) {
            Ok(()) => {
                let live = Live {
                    events,
                    arrived: Instant::now(),
                    output_tokens: 0,
                    attempt: None,
                    last_token_at: None,
                };
                self.live.insert(id, live);
                self.metrics.prompt_tokens.increment(prompt_tokens);
                tracing::debug!(request = id.0, "routed");
                Ok(())
            }
            Err(RouterError::Busy) => Err(SubmitError::Busy),
            Err(RouterError::NoWorkers) => Err(SubmitError::NoWorkers),
            Err(e) => Err(SubmitError::Unavailable(e.to_string())),
        };
        let _ = reply.send(answer);
    }

    fn after_input(&mut self) {
        loop {
            let mut gone = Vec::new();
            while let Some(output) = self.router.poll_output() {
                self.dispatch(output, &mut gone);
            }
            if gone.is_empty() {
                break;
            }
            // Clients that went away: cancelled wherever they are; their ends go out above.
            for request in gone {
                let _ = self.router.abort(request, self.now());
            }
        }
        if self.config.check_invariants {
            let checked = if self.cadence.full_check_now(self.live.is_empty()) {
                self.router.check_invariants()
            } else {
                self.router.check_invariants_incremental()
            };
            if let Err(e) = checked {
                panic!("router: {e}");
            }
        }
        self.stats.set_requests_held(self.live.len());
        self.stats.record_progress(self.live.len());
    }

    fn dispatch(&mut self, output: RouterOutput, gone: &mut Vec<RequestId>) {
        match output {
            RouterOutput::Send(envelope) => self.send(envelope),
            RouterOutput::Decoding { request, key, decode } => {
                tracing::debug!(
                    request = request.0,
                    transfer = key.transfer.0,
                    decode = decode.worker.0,
                    "decoding"
                );
                self.metrics.transfers_completed.increment(1);
                if let Some(live) = self.live.get(&request) {
                    observe(&self.metrics.transfer_seconds, live.arrived.elapsed());
                }
            }
            RouterOutput::Tokens { request, tokens, logprobs, prompt_logprobs } => {
                let Some(live) = self.live.get_mut(&request) else { return };
                // The prompt's scores, with the first tokens, go out ahead of them.
                if !prompt_logprobs.is_empty() {
                    let event = RequestEvent::PromptLogprobs { logprobs: prompt_logprobs };
                    if live.events.try_send(event).is_err() {
                        gone.push(request);
                        return;
                    }
                }
                // As the client sees them: tokens that arrive together are zero apart.
                let now = Instant::now();
                // One each when the request asked for them (`pd::Router` passes them on so).
                let mut logprobs = logprobs.into_iter();
                for token in tokens {
                    match live.last_token_at.replace(now) {
                        None => observe(&self.metrics.time_to_first_token, now - live.arrived),
                        Some(last) => observe(&self.metrics.inter_token_latency, now - last),
                    }
                    live.output_tokens += 1;
                    self.metrics.generation_tokens.increment(1);
                    let event = RequestEvent::Token { token, logprobs: logprobs.next() };
                    if live.events.try_send(event).is_err() {
                        gone.push(request);
                        break;
                    }
                }
            }
            RouterOutput::Finished { request, reason } => {
                tracing::debug!(request = request.0, ?reason, "finished");
                self.finish(request, reason);
            }
            RouterOutput::Failed { request, reason } => {
                let decoding = self.live.get(&request).is_some_and(|l| l.last_token_at.is_some());
                // A request that timed out in the router's queue never had a transfer.
                let transferred = reason != AbortReason::QueueTimeout;
                if !decoding && transferred && reason != AbortReason::Client {
                    self.metrics.transfers_failed.increment(1);
                    if reason == AbortReason::Timeout {
                        self.metrics.transfers_timed_out.increment(1);
                    }
                }
                tracing::debug!(request = request.0, ?reason, "failed");
                let finish = match reason {
                    AbortReason::Client => FinishReason::Aborted,
                    // An overload: the client is told so (503, retry), as a single process does.
                    AbortReason::QueueTimeout => FinishReason::QueueTimeout,
                    _ => FinishReason::StepFailed,
                };
                self.finish(request, finish);
            }
        }
    }

    fn finish(&mut self, request: RequestId, reason: FinishReason) {
        self.metrics.finished(reason);
        let Some(live) = self.live.remove(&request) else { return };
        observe(&self.metrics.e2e_latency, live.arrived.elapsed());
        let output_tokens = live.output_tokens;
        let _ = live.events.try_send(RequestEvent::Finished { reason, output_tokens });
    }

    fn send(&mut self, envelope: Envelope) {
        if let lockstep_core::wire::Message::Reserve { key, request, .. } = &envelope.body {
            self.metrics.transfers_started.increment(1);
            if let Some(live) = self.live.get_mut(&request.id) {
                // The first transfer ends the wait in the router's queue. The router sends a
                // request again under the same attempt only after a worker refused it as busy,
                // and under the next after a failure.
                match live.attempt.replace(key.epoch) {
                    None => observe(&self.metrics.queue_time, live.arrived.elapsed()),
                    Some(last) if last == key.epoch => self.metrics.transfers_busy.increment(1),
                    Some(_) => {
                        self.metrics.transfers_retried.increment(1);
                        self.stats.record_transfer_retry();
                    }
                }
            }
        }
        if let Err(e) = self.transport.try_send(&envelope) {
            self.metrics.peer_send_failures.increment(1);
            tracing::debug!(to = ?envelope.to, error = %e, "a peer message was not sent");
        }
    }
}

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
