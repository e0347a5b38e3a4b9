//! The node runtime: one engine task per worker owns its `Scheduler` and, through a
//! `StepRunner`, its executor, and runs the step loop (plan, launch, apply outputs, stream
//! tokens). Everything else talks to it through bounded channels (`EngineHandle`).
//!
//! The same code runs in production and in the simulator: time comes only from tokio's clock
//! (virtual under turmoil), there is no `spawn_blocking`, and the only thing that differs is the
//! `StepRunner` handed in (`ThreadRunner` for the CPU executor, `InlineRunner` for the
//! provenance model and test doubles).
//!
//! Bounds: the inbox (`inbox_max` submissions), the scheduler's queue (`waiting_max`), each
//! request's event channel (its `max_tokens` + 2, so the engine never waits on a client), the
//! submit answer (`submit_wait_max`). A step is never timed out by the engine: its pages cannot
//! be freed while the executor may still write them (the "free while a write lands" class), so
//! a step that never ends shows as a stall on `/health` instead.

mod handle;
mod invariant_cadence;
mod runner;
mod stats;
mod step_loop;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

pub(crate) use handle::Command;
pub use handle::{EngineHandle, RequestEvent, RequestStream, SubmitError};
pub(crate) use invariant_cadence::InvariantCadence;
use lockstep_core::sched::{SchedConfig, SchedConfigError, Scheduler};
pub use runner::{
    InlineRunner, PageRead, PageRunner, StepCost, StepOrRead, StepResult, StepRunner, ThreadRunner,
};
pub use stats::EngineStats;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub sched: SchedConfig,
    /// Submissions queued for the engine task, at most; beyond it a submit is refused (429).
    pub inbox_max: usize,
    /// How long a submitter waits for the engine to accept or refuse.
    pub submit_wait_max: Duration,
    /// Check every state machine's invariants after every input (tests and the simulator; it
    /// costs a pass over the pool).
    pub check_invariants: bool,
    /// The id of the first request submitted; each next one counts up from it
    /// (`first_request_id`).
    pub first_request_id: u64,
}

impl EngineConfig {
    pub fn new(sched: SchedConfig) -> EngineConfig {
        EngineConfig {
            sched,
            inbox_max: 256,
            submit_wait_max: Duration::from_secs(10),
            check_invariants: false,
            first_request_id: 1,
        }
    }

    /// Starts of live requests, their ends and two steps: what the executor's queue must hold.
    pub fn executor_jobs_max(&self) -> usize {
        2 * (self.sched.waiting_max + self.sched.running_max) as usize + 8
    }
}

/// The first request id of a process started `started` after the Unix epoch: its milliseconds
/// above 20 bits of count, so the ids (and the `cmpl-<id>` a client reads) of a restarted process
/// start above every id its predecessors gave, unless one gave over 2^20 a millisecond. Counting
/// from 1 again instead, a restarted server answers with ids it gave before the restart, which
/// recorded traces, logs and clients keyed by id take for the same request.
pub fn first_request_id(started: Duration) -> u64 {
    (started.as_millis() as u64).saturating_mul(1 << 20).max(1)
}

/// Starts an engine task on the current tokio runtime.
pub fn spawn<R: StepRunner>(
    config: EngineConfig,
    runner: R,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, JoinHandle<()>), SchedConfigError> {
    let sched = Scheduler::new(config.sched.clone())?;
    let (commands, inbox) = mpsc::channel(config.inbox_max.max(1));
    // One abort per live request at most, so a dropped stream's abort always fits.
    let aborts_max =
        config.inbox_max + (config.sched.waiting_max + config.sched.running_max) as usize;
    let (aborts, abort_inbox) = mpsc::channel(aborts_max);
    let stats = Arc::new(EngineStats::new(tokio::time::Instant::now()));
    let handle = EngineHandle {
        commands,
        aborts,
        next_id: Arc::new(AtomicU64::new(config.first_request_id)),
        stats: stats.clone(),
        submit_wait_max: config.submit_wait_max,
    };
    let engine = step_loop::Engine::new(config, sched, runner, inbox, abort_inbox, stats, metrics);
    let task = tokio::spawn(engine.run());
    Ok((handle, task))
}
