//! The executor contract (DESIGN.md section 5): what runs a scheduler's step plan.
//!
//! An executor computes every planned position of a step in one batched pass, reading and writing
//! KV through the plan's page-table updates, and samples one token per sampling row. Its KV store
//! is its own: the CPU backend shards it across threads, the provenance model keeps hashes, a
//! GPU backend keeps it in device memory.

use std::fmt;

use crate::sched::{StepOutputs, StepPlan};

pub trait Executor {
    /// Computes `plan`; `StepOutputs::sampled` has one token per sampling row, in row order.
    /// A plan the executor cannot compute (a position without a page, an unknown placeholder) is
    /// an error, never a guess.
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError>;
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
