//! One worker's state machines together (DESIGN.md sections 3 and 4): the scheduler, its page
//! pool and the worker's side of the transfer protocol, composed so that a driver (the server's
//! engine task, the simulator) has one sans-IO machine per role to feed.
//!
//! Ownership in the shared pool: requests hold page references, transfers hold pins (and, on the
//! decode side, the references of the pages they reserved until the hand-over moves them to a
//! request). Each node's `check_invariants` runs every part's checks and then the accounting
//! across them: every reference in the pool is one a request or a transfer lists, every pin one a
//! transfer holds.
//!
//! Timers fire in one fixed order, the protocol side first and then the scheduler: a lease that
//! ends releases its pages before the scheduler plans with the pool again. The pool's own pin
//! expiry never ends a transfer's pin (the transfer tracks its lease alone), so no order of the
//! two can free a page under a write.
//!
//! A request's id in the node's scheduler is its transfer's id: a request retried as a new
//! transfer may meet an earlier attempt of itself still ending on the same worker, and the two
//! must not collide. Messages to the router name the router's id.

mod decode;
mod prefill;

pub use decode::{DecodeNode, DecodeNodeOutput};
pub use prefill::{PrefillNode, PrefillNodeOutput};

use std::collections::BTreeMap;

use crate::model::{SamplingSpec, TokenLogprobs};
use crate::sched::{NewRequest, RequestId, Scheduler, StepOutputs};
use crate::wire::{RequestSpec, TransferKey};

/// The scheduler's id of a transfer's request on a worker.
pub fn local_id(key: TransferKey) -> RequestId {
    RequestId(key.transfer.0)
}

fn sampling_spec(request: &RequestSpec) -> SamplingSpec {
    let spec = SamplingSpec::for_prompt(request.sampling, &request.prompt);
    SamplingSpec {
        logit_bias: request.logit_bias.clone(),
        grammar: request.grammar.as_deref().cloned(),
        logprobs: request.logprobs,
        ..spec
    }
}

/// The log-probabilities a step's outputs carry, by request: taken before the scheduler applies
/// the outputs (which retires the step), and handed to each request's `Token` event after.
fn logprobs_by_request(
    sched: &Scheduler,
    outputs: &StepOutputs,
    into: &mut BTreeMap<RequestId, TokenLogprobs>,
) {
    let Some(requests) = sched.step_sampling(outputs.step) else { return };
    for (request, logprobs) in requests.zip(&outputs.logprobs) {
        if let Some(logprobs) = logprobs {
            into.insert(request, logprobs.clone());
        }
    }
}

fn new_request(key: TransferKey, request: &RequestSpec) -> NewRequest {
    NewRequest {
        id: local_id(key),
        prompt: request.prompt.clone(),
        max_tokens: request.max_tokens,
        stop_token_ids: request.stop_token_ids.clone(),
        ignore_eos: request.ignore_eos,
        priority: request.priority,
        cache_salt: request.cache_salt,
    }
}

#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod several_workers_tests;
#[cfg(test)]
mod tests;
