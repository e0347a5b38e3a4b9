//! Oracle 6: determinism. The same seed gives the same run: the event logs of two runs hash the
//! same, or the first entry where they part is the finding.

use super::{Oracle, Violation};
use crate::run::RunOutcome;

pub fn check(first: &RunOutcome, second: &RunOutcome) -> Vec<Violation> {
    if first.log_hash == second.log_hash {
        return Vec::new();
    }
    let at = first.log.iter().zip(&second.log).position(|(a, b)| a != b);
    let detail = match at {
        Some(i) => format!(
            "seed {} ran twice and parted at event {i}: {} vs {}",
            first.seed, first.log[i], second.log[i]
        ),
        None => format!(
            "seed {} ran twice: {} events vs {}",
            first.seed,
            first.log.len(),
            second.log.len()
        ),
    };
    vec![Violation { oracle: Oracle::Determinism, request: None, detail }]
}
