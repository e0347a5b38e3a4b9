//! Choosing the next token from logits. The definition lives in `lockstep_core::model` so that
//! every executor, the provenance model included, samples the same way; this module re-exports it
//! for the model code's callers.

pub use lockstep_core::model::{
    RequestSampler, Sampler, SamplingSpec, TokenLogprobs, argmax, logprobs,
};
pub use lockstep_core::wire::Sampling;
