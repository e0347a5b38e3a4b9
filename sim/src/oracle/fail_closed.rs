//! Oracle 5: fail closed. A request that did not complete (refused, failed, cancelled, timed out)
//! may have streamed some tokens first, but every one of them must be its output alone so far:
//! nothing a client ever got was built on partial or foreign KV.

use super::{Oracle, Violation, first_difference};
use crate::client::Ending;
use crate::reference::Reference;
use crate::run::RunOutcome;

pub fn check(reference: &Reference, outcome: &RunOutcome) -> Vec<Violation> {
    let mut found = Vec::new();
    for (index, observed) in outcome.observed.iter().enumerate() {
        if matches!(observed.ending, Some(Ending::Completed { .. })) {
            continue; // equal-alone's
        }
        let alone = &reference.outputs[index];
        if !alone.starts_with(&observed.tokens) {
            let at = first_difference(&observed.tokens, alone);
            found.push(Violation {
                oracle: Oracle::FailClosed,
                request: Some(index),
                detail: format!(
                    "{} after {} tokens that are not its output alone: first difference at token \
                     {at}: {:?} here, {:?} alone",
                    observed.ending.as_ref().map_or("unfinished", Ending::label),
                    observed.tokens.len(),
                    observed.tokens.get(at),
                    alone.get(at)
                ),
            });
            continue;
        }
        let alone = &reference.logprobs[index];
        if !alone.starts_with(&observed.logprobs) {
            let at = first_difference(&observed.logprobs, alone);
            found.push(Violation {
                oracle: Oracle::FailClosed,
                request: Some(index),
                detail: format!(
                    "{} after log-probabilities that are not its own alone: first difference at \
                     token {at}: {:?} here, {:?} alone",
                    observed.ending.as_ref().map_or("unfinished", Ending::label),
                    observed.logprobs.get(at),
                    alone.get(at)
                ),
            });
        }
    }
    found
}
