//! A grammar a request's output is held to (`response_format`, or a `tool_choice` of
//! `"required"` or a named function), and what the client is told when the model's compiler
//! refuses it.
//!
//! The HTTP edge compiles it once, on the path the request takes: as sent, or, on a server that
//! reads reasoning, moved after the thinking (`chat::reasoning`; the grammar as sent is compiled
//! then only when the moved one fails, to name the client's own schema in the 400). So a grammar
//! the server cannot use is the client's 400, not a failed step, and the executor's compile is
//! a clone of the compiler's kept one (`lockstep_gpu::grammar`).

use lockstep_core::model::Grammar;

use super::AppState;
use super::error::ApiError;

#[derive(Clone, Debug)]
pub(super) struct HeldGrammar {
    pub(super) grammar: Grammar,
    /// The request's field that asked for it.
    pub(super) param: &'static str,
    /// What a compile error is about: "the schema", "\"get_weather\"'s parameters".
    what: String,
}

impl HeldGrammar {
    pub(super) fn new(grammar: Grammar, param: &'static str, what: String) -> HeldGrammar {
        HeldGrammar { grammar, param, what }
    }

    /// A 400 about the field that asked for this grammar.
    pub(super) fn invalid(&self, why: String) -> ApiError {
        ApiError::invalid_param(self.param, why)
    }

    /// Compiles `self.grammar` as it is: a 400 naming what it was made from if refused, or
    /// saying why the server has no compiler.
    pub(super) fn check(&self, state: &AppState) -> Result<(), ApiError> {
        let compiler = state.codec.grammars().map_err(|e| self.invalid(e))?;
        compiler.compile(&self.grammar).map_err(|e| self.invalid(format!("{}: {e}", self.what)))?;
        Ok(())
    }
}
