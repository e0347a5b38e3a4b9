//! The engine task: one loop that owns the scheduler and the step runner.
//!
//! Each turn: plan and launch every step the mode allows, publish gauges, then wait for the first
//! of (the oldest step done, an abort, a submission, the scheduler's next timeout), handle it, and
//! hand the scheduler's events to their requests. `select!` is `biased`, so the order in which
//! simultaneous inputs are taken is fixed: a seed replays to the same run under turmoil.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::model::{SamplingSpec, TokenLogprobs};
use lockstep_core::sched::{
    FinishReason, NewRequest, PromptLogprobs, RequestId, SchedEvent, Scheduler, StepId,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::EngineConfig;
use super::handle::{Command, RequestEvent, SubmitError};
use super::invariant_cadence::InvariantCadence;
use super::runner::{StepResult, StepRunner};
use super::stats::EngineStats;
use crate::metrics::{Metrics, observe};

/// A request the engine holds, and the times its latencies are measured from.
struct Live {
    events: mpsc::Sender<RequestEvent>,
    /// Its span: every log line about it, from queue through prefill and decode, is inside.
    span: tracing::Span,
    arrived: Instant,
    scheduled: bool,
    last_token_at: Option<Instant>,
    /// The next prompt position whose token's log-probabilities go out, when the request asked
    /// for them (from 1: the first token has none): a recomputed position's come again, and
    /// only the first go.
    next_scored: u32,
}

/// A launched step: when, and which requests its sampling rows sample for, in row order.
struct Launched {
    step: StepId,
    at: Instant,
    sampling: Vec<RequestId>,
}

pub(super) struct Engine<R> {
    config: EngineConfig,
    sched: Scheduler,
    runner: R,
    live: BTreeMap<RequestId, Live>,
    launched: VecDeque<Launched>,
    /// Log-probabilities of the step being applied, by request, taken as its tokens go out.
    step_logprobs: BTreeMap<RequestId, TokenLogprobs>,
    commands: mpsc::Receiver<Command>,
    aborts: mpsc::Receiver<RequestId>,
    stats: Arc<EngineStats>,
    metrics: Arc<Metrics>,
    cadence: InvariantCadence,
}

/// Marks the engine stopped however its task ends, a panic included, so `/health` fails.
struct StoppedOnDrop(Arc<EngineStats>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        self.0.set_stopped();
    }
}

impl<R: StepRunner> Engine<R> {
    pub(super) fn new(
        config: EngineConfig,
        sched: Scheduler,
        runner: R,
        commands: mpsc::Receiver<Command>,
        aborts: mpsc::Receiver<RequestId>,
        stats: Arc<EngineStats>,
        metrics: Arc<Metrics>,
    ) -> Engine<R> {
        Engine {
            config,
            sched,
            runner,
            live: BTreeMap::new(),
            launched: VecDeque::new(),
            step_logprobs: BTreeMap::new(),
            commands,
            aborts,
            stats,
            metrics,
            cadence: InvariantCadence::default(),
        }
    }

    pub(super) async fn run(mut self) {
        let _stopped = StoppedOnDrop(self.stats.clone());
        loop {
            // Whatever already waits goes in first, so that steps completing back to back
            // (the `biased` select below prefers them) never starve submissions and aborts.
            if self.take_waiting_inputs() {
                return self.shut_down().await;
            }
            self.launch_ready();
            self.publish();
            let timer = self.sched.next_timeout().and_then(|t| self.instant_of(t));
            tokio::select! {
                biased;
                result = self.runner.completed(), if !self.launched.is_empty() => {
                    self.on_step_done(result);
                }
                Some(id) = self.aborts.recv() => self.abort(id),
                command = self.commands.recv() => match command {
                    Some(Command::Submit { request, spec, events, reply }) => {
                        self.submit(request, spec, events, reply);
                    }
                    None => return self.shut_down().await,
                },
                () = sleep_until_or_never(timer) => {
                    let now = self.now();
                    self.sched.handle_timeout(now);
                }
            }
            self.after_input();
        }
    }

    /// Takes the aborts, submissions and due timeouts that are already waiting, a bounded
    /// number of each; true when every handle is gone.
    fn take_waiting_inputs(&mut self) -> bool {
        for _ in 0..self.config.inbox_max {
            match self.aborts.try_recv() {
                Ok(id) => self.abort(id),
                Err(_) => break,
            }
        }
        for _ in 0..self.config.inbox_max {
            match self.commands.try_recv() {
                Ok(Command::Submit { request, spec, events, reply }) => {
                    self.submit(request, spec, events, reply);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return true,
            }
        }
        let now = self.now();
        if self.sched.next_timeout().is_some_and(|t| t <= now) {
            self.sched.handle_timeout(now);
        }
        self.after_input();
        false
    }

    fn now(&self) -> Time {
        Time::from_nanos(self.stats.now_ns())
    }

    fn instant_of(&self, t: Time) -> Option<Instant> {
        self.stats.epoch().checked_add(Duration::from_nanos(t.as_nanos()))
    }

    /// Plans and launches steps while the mode allows: in overlap mode step N+1 is planned and
    /// launched while step N runs.
    fn launch_ready(&mut self) {
        while self.launched.len() < self.config.sched.mode.steps_in_flight_max() {
            let now = self.now();
            let Some(plan) = self.sched.plan_step(now) else { break };
            // Planning may have freed pages (a preemption, an eviction) and handed them to this
            // very plan: their poison goes first.
            self.release_freed();
            let at = Instant::now();
            for row in &plan.rows {
                if let Some(live) = self.live.get_mut(&row.request)
                    && !live.scheduled
                {
                    live.scheduled = true;
                    observe(&self.metrics.queue_time, at.saturating_duration_since(live.arrived));
                    live.span.in_scope(|| tracing::debug!(step = plan.step.0, "prefill starts"));
                }
            }
            let sampling = plan.rows.iter().filter(|r| r.sample).map(|r| r.request).collect();
            self.launched.push_back(Launched { step: plan.step, at, sampling });
            self.runner.launch(plan);
            self.after_input();
        }
    }

    fn on_step_done(&mut self, (step, result): StepResult) {
        let launched = self.launched.pop_front().expect("a step completes only once launched");
        let now = self.now();
        self.metrics.steps.increment(1);
        observe(&self.metrics.step_seconds, launched.at.elapsed());
        let applied = match result {
            Ok(outputs) if step == launched.step => {
                // Before the step's tokens: a request's prompt is scored before its first token.
                for scored in &outputs.prompt_logprobs {
                    self.prompt_scored(scored);
                }
                for (request, lp) in launched.sampling.iter().zip(outputs.logprobs.iter()) {
                    if let Some(lp) = lp {
                        self.step_logprobs.insert(*request, lp.clone());
                    }
                }
                self.sched.apply_outputs(&outputs, now).map_err(|e| e.to_string())
            }
            Ok(_) => Err(format!("the runner reported {step:?} for {:?}", launched.step)),
            Err(e) => Err(e.0),
        };
        if let Err(why) = applied {
            // Its requests end with an error and their pages return; the engine goes on.
            tracing::error!(step = launched.step.0, %why, "step failed");
            self.metrics.step_failures.increment(1);
            self.step_logprobs.clear();
            self.sched.fail_step(launched.step, now).expect("the oldest step in flight fails");
        }
        self.stats.record_progress(self.sched.requests_held());
    }

    /// Passes on the prompt log-probabilities a step scored for a request, those of positions
    /// not passed on yet (a preempted request scores its prompt again as it recomputes it).
    fn prompt_scored(&mut self, scored: &PromptLogprobs) {
        let Some(live) = self.live.get_mut(&scored.request) else { return };
        let Some(fresh) = scored.from_position(live.next_scored) else {
            tracing::error!(request = scored.request.0, "prompt log-probabilities out of order");
            return;
        };
        if fresh.is_empty() {
            return; // Passed on when first computed.
        }
        live.next_scored += fresh.len() as u32;
        let fresh = fresh.to_vec();
        // The event channel has room for one of these a prompt position (`EngineHandle::submit`).
        let _ = live.events.try_send(RequestEvent::PromptLogprobs { logprobs: fresh });
    }

    fn submit(
        &mut self,
        request: NewRequest,
        spec: SamplingSpec,
        events: mpsc::Sender<RequestEvent>,
        reply: oneshot::Sender<Result<(), SubmitError>>,
    ) {
        let (id, prompt_tokens) = (request.id, request.prompt.len() as u64);
        let submitted = match spec.prompt_logprobs {
            Some(_) => self.sched.submit_scoring(request, self.now()),
            None => self.sched.submit(request, self.now()),
        };
        let answer = match submitted {
            Ok(()) => {
                self.runner.start_request(id, spec);
                let span = tracing::info_span!("request", id = id.0);
                span.in_scope(|| tracing::debug!(prompt_tokens, "queued"));
                let live = Live {
                    events,
                    span,
                    arrived: Instant::now(),
                    scheduled: false,
                    last_token_at: None,
                    next_scored: 1,
                };
                self.live.insert(id, live);
                self.metrics.prompt_tokens.increment(prompt_tokens);
                Ok(())
            }
            Err(e) => {
                tracing::debug!(request = id.0, error = %e, "refused");
                Err(SubmitError::Refused(e))
            }
        };
        // A submitter that stopped waiting dropped its stream, whose abort is on its way.
        let _ = reply.send(answer);
    }

    fn abort(&mut self, id: RequestId) {
        if self.sched.abort(id, self.now()).is_ok() {
            if lockstep_core::planted!(CollectiveMismatch)
                && self.launched.back().is_some_and(|step| step.sampling.contains(&id))
            {
                // Planted (sglang#28039): the abort takes its request's newest step off the
                // engine's count while the device still runs it; the two never agree again.
                self.launched.pop_back();
            }
            self.metrics.client_aborts.increment(1);
            tracing::debug!(request = id.0, "aborted by its client");
        }
    }

    /// Hands the scheduler's events to their requests; a request whose client is gone is
    /// aborted, and its own events handed out in turn.
    fn after_input(&mut self) {
        loop {
            let mut gone = Vec::new();
            while let Some(event) = self.sched.poll_event() {
                self.dispatch(event, &mut gone);
            }
            self.step_logprobs.clear();
            if gone.is_empty() {
                break;
            }
            for id in gone {
                self.abort(id);
            }
        }
        self.release_freed();
        if self.config.check_invariants {
            let checked = if self.cadence.full_check_now(self.sched.requests_held() == 0) {
                self.sched.check_invariants()
            } else {
                self.sched.check_invariants_incremental()
            };
            if let Err(e) = checked {
                panic!("engine: {e}");
            }
        }
        self.stats.set_requests_held(self.sched.requests_held());
    }

    /// Hands the pages freed since the last call to the executor, to poison (see
    /// `Executor::release_pages`).
    ///
    /// Called at the end of every input and between planning a step and launching it. A step is
    /// the only way this engine writes KV, so every page freed is released after the steps
    /// launched before the free (which may still write or read it for its old owner: the runner
    /// keeps call order) and before any step launched after it. A page freed and handed out
    /// again at once is therefore poisoned before its new owner's first write, never after it,
    /// which would destroy good KV.
    fn release_freed(&mut self) {
        let mut pages = Vec::new();
        self.sched.take_freed_pages(&mut pages);
        if !pages.is_empty() {
            self.runner.release_pages(pages);
        }
    }

    fn dispatch(&mut self, event: SchedEvent, gone: &mut Vec<RequestId>) {
        match event {
            SchedEvent::Token { request, token } => {
                let logprobs = self.step_logprobs.remove(&request);
                let now = Instant::now();
                let Some(live) = self.live.get_mut(&request) else { return };
                match live.last_token_at {
                    None => {
                        let ttft = now.saturating_duration_since(live.arrived);
                        observe(&self.metrics.time_to_first_token, ttft);
                        live.span.in_scope(|| tracing::debug!(?ttft, "decode starts"));
                    }
                    Some(last) => observe(
                        &self.metrics.inter_token_latency,
                        now.saturating_duration_since(last),
                    ),
                }
                live.last_token_at = Some(now);
                self.metrics.generation_tokens.increment(1);
                if live.events.try_send(RequestEvent::Token { token, logprobs }).is_err() {
                    gone.push(request);
                }
            }
            SchedEvent::Finished { request, reason, output_tokens } => {
                self.finished(request, reason, output_tokens);
            }
            SchedEvent::Preempted { request } => {
                if let Some(live) = self.live.get(&request) {
                    live.span.in_scope(|| tracing::debug!("preempted"));
                }
            }
            // A single process submits no request that keeps its pages.
            SchedEvent::PagesKept { .. } => {}
        }
    }

    fn finished(&mut self, request: RequestId, reason: FinishReason, output_tokens: u32) {
        // Every step that names it is launched, and the runner keeps call order.
        self.runner.end_request(request);
        self.metrics.finished(reason);
        let Some(live) = self.live.remove(&request) else { return };
        observe(&self.metrics.e2e_latency, live.arrived.elapsed());
        live.span.in_scope(|| tracing::debug!(?reason, output_tokens, "finished"));
        let _ = live.events.try_send(RequestEvent::Finished { reason, output_tokens });
    }

    fn publish(&self) {
        let pool = self.sched.pool();
        self.metrics.requests_running.set(self.sched.slots_held() as f64);
        self.metrics.requests_waiting.set(self.sched.waiting_count() as f64);
        self.stats.set_pages_held(pool.held_count());
        let held = f64::from(pool.held_count());
        self.metrics.kv_cache_usage.set(held / f64::from(pool.pages_total()));
        let (queried, hit) = self.sched.prefix_cache_tokens();
        self.metrics.prefix_cache_queries.absolute(queried);
        self.metrics.prefix_cache_hits.absolute(hit);
        self.metrics.preemptions.absolute(self.sched.preemptions_total());
    }

    /// Every handle is gone: end what is held and stop.
    async fn shut_down(mut self) {
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            let _ = self.sched.abort(id, self.now());
        }
        self.after_input();
        // Let steps in flight finish: their pages may be written until then.
        while !self.launched.is_empty() {
            let result = self.runner.completed().await;
            self.on_step_done(result);
            self.after_input();
        }
    }
}

async fn sleep_until_or_never(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[path = "step_loop_tests.rs"]
mod tests;
