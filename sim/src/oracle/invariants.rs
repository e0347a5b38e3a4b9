//! Oracle 4: every state machine's invariants after every input, on every host. Each engine runs
//! with `--check-invariants`, which stops it with a panic naming the broken invariant; any panic
//! in any host is a finding (bad input must never panic either), and so is a host's software
//! failing.

use super::{Oracle, Violation};
use crate::run::RunOutcome;

pub fn check(outcome: &RunOutcome) -> Vec<Violation> {
    let mut found: Vec<Violation> = outcome
        .panics
        .iter()
        .map(|p| Violation {
            oracle: Oracle::Invariants,
            request: None,
            detail: format!("panic: {p}"),
        })
        .collect();
    if let Some(e) = &outcome.sim_error {
        found.push(Violation {
            oracle: Oracle::Invariants,
            request: None,
            detail: format!("a host's software failed: {e}"),
        });
    }
    found
}
