//! Oracle 3: at quiescence (every client done, every fault healed, the hosts given time to let go)
//! no host holds a request, page, transfer or pin.

use super::{Oracle, Violation};
use crate::run::RunOutcome;

pub fn check(outcome: &RunOutcome) -> Vec<Violation> {
    outcome
        .held_at_end
        .iter()
        .map(|h| Violation {
            oracle: Oracle::Leaks,
            request: None,
            detail: format!("held at quiescence: {h}"),
        })
        .collect()
}
