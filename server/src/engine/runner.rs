//! The one async seam between the engine loop and whatever computes steps.
//!
//! The loop launches a plan and goes on (planning the next one in overlap mode, taking requests,
//! firing timers); it awaits `completed` alongside everything else. Production runs the CPU
//! executor on threads of its own (`ThreadRunner`): the tokio runtime never blocks on a step. The
//! simulator runs `ProvenanceModel` inline and sleeps the modelled duration on tokio's clock
//! (`InlineRunner`), so virtual time passes as a real step would. The loop is the same code.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::time::Duration;

use lockstep_core::model::{ExecError, Executor, SamplingSpec};
use lockstep_core::sched::{RequestId, StepId, StepOutputs, StepPlan};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A finished step: its id and what the executor made of it.
pub type StepResult = (StepId, Result<StepOutputs, ExecError>);

/// Runs steps for one engine. Calls reach the executor in the order made: starts, launches and
/// ends interleave exactly as the loop issued them.
pub trait StepRunner: Send + 'static {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec);
    fn end_request(&mut self, request: RequestId);
    /// Starts computing `plan` and returns at once.
    fn launch(&mut self, plan: StepPlan);
    /// The oldest launched step, once it is done. Cancel-safe: dropped before it resolves, it
    /// loses nothing, and the next call waits for the same step.
    fn completed(&mut self) -> Pin<Box<dyn Future<Output = StepResult> + Send + '_>>;
}

/// How long a step takes in virtual time: a fixed cost per step plus one per token computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    pub per_step: Duration,
    pub per_prefill_token: Duration,
    pub per_decode_token: Duration,
}

impl StepCost {
    pub const ZERO: StepCost = StepCost {
        per_step: Duration::ZERO,
        per_prefill_token: Duration::ZERO,
        per_decode_token: Duration::ZERO,
    };

    pub fn of(&self, plan: &StepPlan) -> Duration {
        let mut cost = self.per_step;
        for row in &plan.rows {
            let tokens = row.positions.len() as u32;
            cost +=
                if tokens == 1 { self.per_decode_token } else { self.per_prefill_token * tokens };
        }
        cost
    }
}

/// Computes each step at launch on the calling task and reports it done after its modelled cost,
/// in launch order. For executors without real work to wait for: the provenance model, test
/// doubles. No thread, no blocking: it runs unchanged inside turmoil.
#[derive(Debug)]
pub struct InlineRunner<E> {
    executor: E,
    cost: StepCost,
    done: VecDeque<(Instant, StepResult)>,
}

impl<E: Executor + Send + 'static> InlineRunner<E> {
    pub fn new(executor: E, cost: StepCost) -> InlineRunner<E> {
        InlineRunner { executor, cost, done: VecDeque::new() }
    }
}

impl<E: Executor + Send + 'static> StepRunner for InlineRunner<E> {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.executor.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.executor.end_request(request);
    }

    fn launch(&mut self, plan: StepPlan) {
        // Steps run one after another: this one starts when the previous one is done.
        let start = self.done.back().map_or_else(Instant::now, |(at, _)| *at).max(Instant::now());
        let result = execute_catching(&mut self.executor, &plan);
        self.done.push_back((start + self.cost.of(&plan), (plan.step, result)));
    }

    fn completed(&mut self) -> Pin<Box<dyn Future<Output = StepResult> + Send + '_>> {
        Box::pin(async move {
            let Some(&(at, _)) = self.done.front() else {
                return std::future::pending().await;
            };
            if at > Instant::now() {
                tokio::time::sleep_until(at).await;
            } else {
                // Already due: a timer would round up to the next millisecond (every zero-cost
                // step would take one); yielding still lets the other tasks run.
                tokio::task::yield_now().await;
            }
            self.done.pop_front().expect("a launched step is still queued").1
        })
    }
}

/// What the executor thread is asked to do, in order.
enum Job {
    Start(RequestId, SamplingSpec),
    End(RequestId),
    Step(StepPlan),
}

/// Runs the executor on a thread of its own (the CPU executor then fans each step out to its
/// team). The engine's tokio tasks never block on a step.
#[derive(Debug)]
pub struct ThreadRunner {
    jobs: std::sync::mpsc::SyncSender<Job>,
    results: mpsc::Receiver<StepResult>,
    launched: usize,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Start(id, _) => write!(f, "Start({id})"),
            Job::End(id) => write!(f, "End({id})"),
            Job::Step(plan) => write!(f, "Step({:?})", plan.step),
        }
    }
}

impl ThreadRunner {
    /// Moves `executor` to a new thread. `jobs_max` bounds the queue to it: the engine never
    /// has more than its live requests' starts and ends and two steps outstanding.
    pub fn spawn<E: Executor + Send + 'static>(
        executor: E,
        jobs_max: usize,
    ) -> std::io::Result<ThreadRunner> {
        let (jobs, inbox) = std::sync::mpsc::sync_channel::<Job>(jobs_max);
        let (outbox, results) = mpsc::channel(4);
        std::thread::Builder::new().name("lockstep-executor".into()).spawn(move || {
            let mut executor = executor;
            while let Ok(job) = inbox.recv() {
                match job {
                    Job::Start(id, spec) => executor.start_request(id, spec),
                    Job::End(id) => executor.end_request(id),
                    Job::Step(plan) => {
                        let result = execute_catching(&mut executor, &plan);
                        if outbox.blocking_send((plan.step, result)).is_err() {
                            return; // The engine is gone.
                        }
                    }
                }
            }
        })?;
        Ok(ThreadRunner { jobs, results, launched: 0 })
    }

    fn send(&self, job: Job) {
        // Full would mean the engine broke its own bound; gone means the thread died, which
        // `completed` reports as a failed step.
        if let Err(std::sync::mpsc::TrySendError::Full(job)) = self.jobs.try_send(job) {
            panic!("the executor's job queue is full: {job:?}");
        }
    }
}

impl StepRunner for ThreadRunner {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.send(Job::Start(request, spec));
    }

    fn end_request(&mut self, request: RequestId) {
        self.send(Job::End(request));
    }

    fn launch(&mut self, plan: StepPlan) {
        self.launched += 1;
        self.send(Job::Step(plan));
    }

    fn completed(&mut self) -> Pin<Box<dyn Future<Output = StepResult> + Send + '_>> {
        Box::pin(async move {
            if self.launched == 0 {
                return std::future::pending().await;
            }
            match self.results.recv().await {
                Some(result) => {
                    self.launched -= 1;
                    result
                }
                None => {
                    // The thread is gone: every step fails from now on, so the engine fails
                    // every request cleanly instead of waiting forever.
                    self.launched -= 1;
                    (StepId(u64::MAX), Err(ExecError("the executor thread is gone".into())))
                }
            }
        })
    }
}

/// Runs one step; a panic inside the executor becomes that step's error.
fn execute_catching<E: Executor>(
    executor: &mut E,
    plan: &StepPlan,
) -> Result<StepOutputs, ExecError> {
    match catch_unwind(AssertUnwindSafe(|| executor.execute(plan))) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(ExecError(format!("the step panicked: {what}")))
        }
    }
}
