//! Continuous batching (DESIGN.md section 3, "sched").
//!
//! The driver's loop, in order:
//!
//! 1. `submit` and `abort` as requests come and go; `handle_timeout(now)` when `next_timeout`
//!    is due.
//! 2. `plan_step(now)`: the next batch, or `None` if nothing can run or too many steps are in
//!    flight. In overlap mode a second step may be planned before the first is applied.
//! 3. `apply_outputs(outputs, now)` for the oldest step in flight, once the executor is done.
//! 4. `poll_event` until it returns `None`: tokens, finishes, preemptions.
//!
//! A request moves `Waiting → Running → (Draining →) gone`, or back to `Waiting` when preempted.
//! `Draining` is how "free before the last reader" (vllm#45357, sglang#18803) is made impossible:
//! a request that ends or is preempted while a step in flight still reads or writes its pages
//! keeps them, and its batch slot, until that step's outputs are applied.
//!
//! Ordering is total and explicit: priority, then arrival time, then id. Decode rows come before
//! prefill chunks; prefill chunks of running requests before admissions; preemption takes the
//! last request in that order (the newest of the lowest priority).

mod apply;
mod config;
mod hand_over;
mod invariants;
mod plan;
mod planner;
mod request;
mod scheduler;

pub use config::{SchedConfig, SchedConfigError, StepMode};
pub use hand_over::HandOverError;
pub use plan::{
    Bucket, InputToken, PageTables, PromptLogprobs, RecentSamples, RowPlan, StepId, StepOutputs,
    StepPlan,
};
pub use request::{AdmissionError, FinishReason, NewRequest, RequestId};
pub use scheduler::{AbortError, ApplyError, SchedEvent, Scheduler};

#[cfg(test)]
mod bug_classes;
#[cfg(test)]
mod hand_over_tests;
#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod tests;
