//! The error a `check_invariants()` returns when a state machine's internal state is broken.
//!
//! A violation is a bug in lockstep, not bad input: tests, proptest, fuzz and the simulator call
//! `check_invariants()` after every step and fail loudly on it. It is a value rather than a panic
//! so that tests can show each check fires on a hand-broken state.

use std::fmt;

#[derive(Clone, PartialEq, Eq)]
pub struct InvariantViolation {
    machine: &'static str,
    what: String,
}

impl InvariantViolation {
    pub fn new(machine: &'static str, what: impl Into<String>) -> InvariantViolation {
        InvariantViolation { machine, what: what.into() }
    }

    /// Which machine's invariant broke ("kv", "sched", ...).
    pub fn machine(&self) -> &'static str {
        self.machine
    }

    /// What broke, in words, naming the page or request.
    pub fn what(&self) -> &str {
        &self.what
    }
}

impl fmt::Debug for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} invariant violated: {}", self.machine, self.what)
    }
}

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for InvariantViolation {}

/// Returns `Err(InvariantViolation)` from the enclosing function unless `cond` holds.
#[macro_export]
macro_rules! ensure_invariant {
    ($machine:expr, $cond:expr, $($what:tt)+) => {
        if !$cond {
            return Err($crate::invariant::InvariantViolation::new($machine, format!($($what)+)));
        }
    };
}
