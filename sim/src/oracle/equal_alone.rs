//! Oracle 1: every request that completed equals its output when run alone, token for token,
//! and (when it asked for them) log-probability for log-probability, bit for bit. A page read
//! that held another request's KV, stale KV or KV a transfer had not finished writing changes
//! the provenance model's output from there on; log-probabilities lost or mismatched on their
//! way from a worker change what the client saw.

use super::{Oracle, Violation, first_difference};
use crate::client::Ending;
use crate::reference::Reference;
use crate::run::RunOutcome;

pub fn check(reference: &Reference, outcome: &RunOutcome) -> Vec<Violation> {
    let mut found = Vec::new();
    for (index, observed) in outcome.observed.iter().enumerate() {
        if !matches!(observed.ending, Some(Ending::Completed { .. })) {
            continue;
        }
        let alone = &reference.outputs[index];
        if observed.tokens != *alone {
            let at = first_difference(&observed.tokens, alone);
            found.push(Violation {
                oracle: Oracle::EqualAlone,
                request: Some(index),
                detail: format!(
                    "completed with {} tokens, alone it gives {}; first difference at token {at}: \
                     {:?} here, {:?} alone",
                    observed.tokens.len(),
                    alone.len(),
                    observed.tokens.get(at),
                    alone.get(at)
                ),
            });
            continue;
        }
        let alone = &reference.logprobs[index];
        if observed.logprobs != *alone {
            let at = first_difference(&observed.logprobs, alone);
            found.push(Violation {
                oracle: Oracle::EqualAlone,
                request: Some(index),
                detail: format!(
                    "completed with its output alone but other log-probabilities ({} of them here, {} \
                     alone); first difference at token {at}: {:?} here, {:?} alone",
                    observed.logprobs.len(),
                    alone.len(),
                    observed.logprobs.get(at),
                    alone.get(at)
                ),
            });
        }
    }
    found
}
