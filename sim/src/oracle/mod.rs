//! The oracles (DESIGN.md section 6), each its own checker: what a run must show whatever the
//! faults. A violation names its oracle and request and says what differed.

pub mod determinism;
pub mod equal_alone;
pub mod fail_closed;
pub mod invariants;
pub mod leaks;
pub mod liveness;

use std::fmt;

use crate::reference::Reference;
use crate::run::RunOutcome;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Oracle {
    /// 4: every state machine's invariants after every input, on every host.
    Invariants,
    /// 1: every completed request equals its output alone.
    EqualAlone,
    /// 5: nothing a client got was built on partial or foreign KV.
    FailClosed,
    /// 3: nothing held at quiescence.
    Leaks,
    /// 2: every request ends within the bound once faults heal.
    Liveness,
    /// 6: the same seed gives the same run.
    Determinism,
}

impl Oracle {
    pub fn name(self) -> &'static str {
        match self {
            Oracle::Invariants => "invariants",
            Oracle::EqualAlone => "equal-alone",
            Oracle::FailClosed => "fail-closed",
            Oracle::Leaks => "leaks",
            Oracle::Liveness => "liveness",
            Oracle::Determinism => "determinism",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub oracle: Oracle,
    pub request: Option<usize>,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.request {
            Some(r) => write!(f, "[{}] request {r}: {}", self.oracle.name(), self.detail),
            None => write!(f, "[{}] {}", self.oracle.name(), self.detail),
        }
    }
}

/// Every oracle but determinism (which needs two runs), most telling first: a broken invariant
/// explains the rest.
pub fn check(reference: &Reference, outcome: &RunOutcome) -> Vec<Violation> {
    let mut violations = invariants::check(outcome);
    violations.extend(equal_alone::check(reference, outcome));
    violations.extend(fail_closed::check(reference, outcome));
    if outcome.panics.is_empty() {
        // After a stopped engine, leaks and stalls are its symptoms, not findings.
        violations.extend(leaks::check(outcome));
        violations.extend(liveness::check(outcome));
    }
    violations
}

/// The first index where two token lists differ (the shorter one's length if one is a prefix).
pub fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()))
}
