//! The executor contract (DESIGN.md section 5): what runs a scheduler's step plan.
//!
//! An executor computes every planned position of a step in one batched pass, reading and writing
//! KV through the plan's page-table updates, and samples one token per sampling row. Its KV store
//! is its own: the CPU backend shards it across threads, the provenance model keeps hashes, a
//! GPU backend keeps it in device memory.
//!
//! A driver tells the executor how each request samples before the first plan that names it
//! (`start_request`) and when it may forget it (`end_request`, after the last step that names it
//! has executed). A sampling row of a request it was not told about is an error: there is no
//! silent greedy fallback. Calls come in one order (starts, steps, page releases, ends as the
//! driver issued them), so an executor that runs steps elsewhere (a thread, a device stream)
//! takes them through one queue.

use std::fmt;

use super::SamplingSpec;
use crate::sched::{RequestId, StepOutputs, StepPlan};

pub trait Executor {
    /// `request` samples with `spec` from its next sampling row on. Starting a request twice
    /// replaces its spec.
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec);

    /// Forgets `request`. No later plan may name it until it is started again.
    fn end_request(&mut self, request: RequestId);

    /// Computes `plan`; `StepOutputs::sampled` has one token per sampling row, in row order.
    /// A plan the executor cannot compute (a position without a page, an unknown placeholder, a
    /// request never started) is an error, never a guess.
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError>;

    /// Pages (by number) whose contents ended since the last call: freed, or evicted from the
    /// prefix cache (`PagePool::take_freed`). No correct plan reads them again before writing
    /// them. A real executor may ignore this (the default does). The provenance model poisons
    /// them: pages are reused last freed first, so a write that never happened could otherwise
    /// hide behind identical KV the previous owner left. Like every call, it comes in order: after
    /// the steps and writes issued before it, before those issued after.
    fn release_pages(&mut self, pages: &[u32]) {
        let _ = pages;
    }
}

/// A plan an executor could not compute, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecError(pub String);

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ExecError {}
