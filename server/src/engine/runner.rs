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

use lockstep_core::model::{ExecError, Executor, PageStore, SamplingSpec};
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
    /// Pages freed since the last call (`Scheduler::take_freed_pages`), for the executor to
    /// poison (`Executor::release_pages`), in order with the launches, reads and writes around
    /// it. The default drops them, which is right only for a runner whose executor ignores
    /// releases: a runner that wraps another must forward them, or the provenance model under it
    /// cannot see a missing write hide behind stale KV.
    fn release_pages(&mut self, pages: Vec<u32>) {
        let _ = pages;
    }
}

/// A page read for the transfer data plane: its tag, and its bytes.
pub type PageRead = (u64, Result<Vec<u8>, ExecError>);

/// What `PageRunner::step_or_read` found done.
#[derive(Debug)]
pub enum StepOrRead {
    Step(StepResult),
    Read(PageRead),
}

/// A runner whose executor's KV pages the transfer data plane reads (prefill side) and writes
/// (decode side), in order with the steps: a read issued after a step was launched sees its
/// writes, and a write issued before a step is launched is seen by it.
pub trait PageRunner: StepRunner {
    /// Bytes of one page.
    fn page_bytes(&self) -> usize;
    /// Queues a read of `page`; the bytes come back from `page_read`, tagged, in issue order.
    fn read_page(&mut self, tag: u64, page: u32);
    /// The oldest step launched or the oldest read issued, whichever is done first (one future,
    /// so a loop can wait for both on one runner). Cancel-safe like `completed`.
    fn step_or_read(&mut self) -> Pin<Box<dyn Future<Output = StepOrRead> + Send + '_>>;
    /// Queues a write of `page`, seen by every step launched after it. `data` must be
    /// `page_bytes()` long (checked here, so a wrong write is refused before it is acknowledged).
    fn write_page(&mut self, page: u32, data: Vec<u8>) -> Result<(), ExecError>;
}

fn check_page_length(data: &[u8], page_bytes: usize) -> Result<(), ExecError> {
    if data.len() == page_bytes {
        Ok(())
    } else {
        Err(ExecError(format!("a page write of {} bytes, a page is {page_bytes}", data.len())))
    }
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
    reads: VecDeque<PageRead>,
}

impl<E: Executor + Send + 'static> InlineRunner<E> {
    pub fn new(executor: E, cost: StepCost) -> InlineRunner<E> {
        InlineRunner { executor, cost, done: VecDeque::new(), reads: VecDeque::new() }
    }
}

/// Steps are computed at launch, so a read or write now is in order with them already.
impl<E: Executor + PageStore + Send + 'static> PageRunner for InlineRunner<E> {
    fn page_bytes(&self) -> usize {
        self.executor.page_bytes()
    }

    fn read_page(&mut self, tag: u64, page: u32) {
        let mut bytes = Vec::with_capacity(self.executor.page_bytes());
        let result = self.executor.read_page(page, &mut bytes).map(|()| bytes);
        self.reads.push_back((tag, result));
    }

    fn step_or_read(&mut self) -> Pin<Box<dyn Future<Output = StepOrRead> + Send + '_>> {
        Box::pin(async move {
            // Reads are done at issue: nothing to wait for.
            match self.reads.pop_front() {
                Some(read) => StepOrRead::Read(read),
                None => StepOrRead::Step(self.completed().await),
            }
        })
    }

    fn write_page(&mut self, page: u32, data: Vec<u8>) -> Result<(), ExecError> {
        check_page_length(&data, self.executor.page_bytes())?;
        self.executor.write_page(page, &data)
    }
}

impl<E: Executor + Send + 'static> StepRunner for InlineRunner<E> {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.executor.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.executor.end_request(request);
    }

    /// At once, like a write: the steps launched before it have already run.
    fn release_pages(&mut self, pages: Vec<u32>) {
        self.executor.release_pages(&pages);
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
    ReadPage(u64, u32),
    WritePage(u32, Vec<u8>),
}

/// A job and the pages released before it was issued, released (poisoned) just before it runs.
type Queued = (Vec<u32>, Job);

/// Runs the executor on a thread of its own (the CPU executor then fans each step out to its
/// team). The engine's tokio tasks never block on a step.
#[derive(Debug)]
pub struct ThreadRunner {
    jobs: std::sync::mpsc::SyncSender<Queued>,
    /// Pages released since the last job was sent. They ride with the next job, of whatever
    /// kind, instead of taking a place in the bounded queue of their own: nothing can observe a
    /// release before the next job runs, and every job runs after the releases issued before it.
    released: Vec<u32>,
    /// When `released` next gets sorted and deduplicated: it may name a page again (freed, handed
    /// out and freed again with no job between), and this keeps it within twice the pool.
    released_dedup_at: usize,
    results: mpsc::Receiver<StepResult>,
    launched: usize,
    reads: mpsc::Receiver<PageRead>,
    reads_issued: usize,
    /// `None` when the executor keeps no pages for the data plane.
    page_bytes: Option<usize>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Start(id, _) => write!(f, "Start({id})"),
            Job::End(id) => write!(f, "End({id})"),
            Job::Step(plan) => write!(f, "Step({:?})", plan.step),
            Job::ReadPage(tag, page) => write!(f, "ReadPage({tag}, {page})"),
            Job::WritePage(page, _) => write!(f, "WritePage({page})"),
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
        Self::spawn_inner(NoPages(executor), jobs_max, None)
    }

    /// As `spawn`, for an executor whose pages the transfer data plane reads and writes
    /// (`PageRunner`). `jobs_max` must also hold the page reads and writes in flight.
    pub fn spawn_with_pages<E: Executor + PageStore + Send + 'static>(
        executor: E,
        jobs_max: usize,
    ) -> std::io::Result<ThreadRunner> {
        let page_bytes = executor.page_bytes();
        Self::spawn_inner(executor, jobs_max, Some(page_bytes))
    }

    fn spawn_inner<E: Executor + PageStore + Send + 'static>(
        executor: E,
        jobs_max: usize,
        page_bytes: Option<usize>,
    ) -> std::io::Result<ThreadRunner> {
        let (jobs, inbox) = std::sync::mpsc::sync_channel::<Queued>(jobs_max);
        let (outbox, results) = mpsc::channel(4);
        let (read_outbox, reads) = mpsc::channel(jobs_max.max(1));
        std::thread::Builder::new().name("lockstep-executor".into()).spawn(move || {
            let mut executor = executor;
            while let Ok((released, job)) = inbox.recv() {
                if !released.is_empty() {
                    executor.release_pages(&released);
                }
                match job {
                    Job::Start(id, spec) => executor.start_request(id, spec),
                    Job::End(id) => executor.end_request(id),
                    Job::ReadPage(tag, page) => {
                        let mut bytes = Vec::new();
                        let result = executor.read_page(page, &mut bytes).map(|()| bytes);
                        if read_outbox.blocking_send((tag, result)).is_err() {
                            return;
                        }
                    }
                    Job::WritePage(page, data) => {
                        if let Err(e) = executor.write_page(page, &data) {
                            // Refused lengths never get here; a page out of range would be a
                            // data-plane bug, and the page's request then decodes wrong KV.
                            tracing::error!(page, error = %e, "a page write failed");
                        }
                    }
                    Job::Step(plan) => {
                        let result = execute_catching(&mut executor, &plan);
                        if outbox.blocking_send((plan.step, result)).is_err() {
                            return; // The engine is gone.
                        }
                    }
                }
            }
        })?;
        Ok(ThreadRunner {
            jobs,
            released: Vec::new(),
            released_dedup_at: RELEASED_DEDUP_MIN,
            results,
            launched: 0,
            reads,
            reads_issued: 0,
            page_bytes,
        })
    }

    fn send(&mut self, job: Job) {
        let released = std::mem::take(&mut self.released);
        self.released_dedup_at = RELEASED_DEDUP_MIN;
        // Full would mean the engine broke its own bound; gone means the thread died, which
        // `completed` reports as a failed step.
        if let Err(std::sync::mpsc::TrySendError::Full((_, job))) =
            self.jobs.try_send((released, job))
        {
            panic!("the executor's job queue is full: {job:?}");
        }
    }
}

/// Pages `ThreadRunner::released` holds before it is first deduplicated.
const RELEASED_DEDUP_MIN: usize = 1024;

impl StepRunner for ThreadRunner {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.send(Job::Start(request, spec));
    }

    fn end_request(&mut self, request: RequestId) {
        self.send(Job::End(request));
    }

    fn release_pages(&mut self, pages: Vec<u32>) {
        self.released.extend(pages);
        if self.released.len() >= self.released_dedup_at {
            // Releasing a page twice before a job runs is releasing it once.
            self.released.sort_unstable();
            self.released.dedup();
            self.released_dedup_at = 2 * self.released.len().max(RELEASED_DEDUP_MIN);
        }
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

impl PageRunner for ThreadRunner {
    fn page_bytes(&self) -> usize {
        self.page_bytes.unwrap_or(0)
    }

    fn read_page(&mut self, tag: u64, page: u32) {
        self.reads_issued += 1;
        self.send(Job::ReadPage(tag, page));
    }

    fn step_or_read(&mut self) -> Pin<Box<dyn Future<Output = StepOrRead> + Send + '_>> {
        Box::pin(async move {
            if self.reads_issued == 0 {
                return StepOrRead::Step(self.completed().await);
            }
            // Both channels are cancel-safe: whichever loses the race keeps its message.
            let ThreadRunner { reads, reads_issued, launched, results, .. } = self;
            tokio::select! {
                biased;
                step = results.recv(), if *launched > 0 => {
                    *launched -= 1;
                    StepOrRead::Step(step.unwrap_or((
                        StepId(u64::MAX),
                        Err(ExecError("the executor thread is gone".into())),
                    )))
                }
                read = reads.recv() => {
                    *reads_issued -= 1;
                    StepOrRead::Read(read.unwrap_or((
                        u64::MAX,
                        Err(ExecError("the executor thread is gone".into())),
                    )))
                }
            }
        })
    }

    fn write_page(&mut self, page: u32, data: Vec<u8>) -> Result<(), ExecError> {
        let Some(page_bytes) = self.page_bytes else {
            return Err(ExecError("this executor keeps no pages for transfers".into()));
        };
        check_page_length(&data, page_bytes)?;
        self.send(Job::WritePage(page, data));
        Ok(())
    }
}

/// An executor without a page store, run by a `ThreadRunner` that never reads or writes pages.
struct NoPages<E>(E);

impl<E: Executor> Executor for NoPages<E> {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.0.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.0.end_request(request);
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        self.0.execute(plan)
    }

    fn release_pages(&mut self, pages: &[u32]) {
        self.0.release_pages(pages);
    }
}

impl<E> PageStore for NoPages<E> {
    fn page_bytes(&self) -> usize {
        0
    }

    fn read_page(&self, page: u32, _out: &mut Vec<u8>) -> Result<(), ExecError> {
        Err(ExecError(format!("page {page}: this executor keeps no pages for transfers")))
    }

    fn write_page(&mut self, page: u32, _data: &[u8]) -> Result<(), ExecError> {
        Err(ExecError(format!("page {page}: this executor keeps no pages for transfers")))
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

#[cfg(test)]
#[path = "runner_tests.rs"]
mod tests;
