//! The executor contract, sampling, and the model that executes scheduler plans without weights.
//!
//! `ProvenanceModel` is the simulator's oracle of record (DESIGN.md section 5): any KV read that
//! does not belong to the request, or was not completely written, changes its output.

mod digest;
mod executor;
mod grammar;
mod output_tokens;
mod page_store;
mod provenance;
mod sampling;
mod synthetic_grammar;

pub use executor::{ExecError, Executor};
pub use grammar::{CompileCounts, Grammar, GrammarCompiler, TokenMask, TokenMatcher};
pub use output_tokens::{OutputTokens, counts};
pub use page_store::PageStore;
pub use provenance::ProvenanceModel;
pub use sampling::{
    RequestSampler, Sampler, SamplingSpec, TokenLogprobs, argmax, logprobs, record_outputs,
};
pub use synthetic_grammar::{SyntheticGrammars, SyntheticMatcher};
