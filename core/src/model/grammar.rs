//! Constrained decoding: a grammar a request's output must follow (OpenAI's `response_format`),
//! and what an executor asks of one.
//!
//! A grammar travels as data (`Grammar`: what the HTTP edge builds and the wire carries).
//! Compiling it needs the model's vocabulary, so an executor is handed a `GrammarCompiler` (the
//! server's is llguidance over the tokenizer's bytes) that turns it into a `TokenMatcher`. A
//! matcher answers from the request's output so far and nothing else, as penalties do: the same
//! output gives the same mask, so a request preempted and recomputed, sampled under overlap
//! scheduling, or handed from a prefill worker to a decode worker is constrained exactly as it
//! is alone.

use std::fmt;

/// What a constrained request's output must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Grammar {
    /// Any JSON object (`{"type": "json_object"}`).
    JsonObject,
    /// JSON that a JSON Schema accepts, the schema as JSON text (`{"type": "json_schema"}`).
    JsonSchema(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl Grammar {
    /// The grammar's text, for bounds and messages (empty for `JsonObject`).
    pub fn text(&self) -> &str {
        match self {
            Grammar::JsonObject => "",
            Grammar::JsonSchema(text) | Grammar::Lark(text) => text,
        }
    }
}

/// A set of token ids, a bit each: token `t` is bit `t % 32` of word `t / 32` (llguidance's
/// layout). Tokens past the last word are outside the set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    pub fn from_words(words: Vec<u32>) -> TokenMask {
        TokenMask { words }
    }

    /// The set of one token.
    pub fn only(token: u32) -> TokenMask {
        let mut words = vec![0; token as usize / 32 + 1];
        words[token as usize / 32] = 1 << (token % 32);
        TokenMask { words }
    }

    pub fn allows(&self, token: u32) -> bool {
        self.words.get(token as usize / 32).is_some_and(|w| w & (1 << (token % 32)) != 0)
    }

    /// Whether any token below `vocab` is in the set.
    pub fn allows_any_below(&self, vocab: u32) -> bool {
        (0..vocab).step_by(32).any(|base| {
            let word = self.words.get(base as usize / 32).copied().unwrap_or(0);
            let width = (vocab - base).min(32);
            let in_range = if width == 32 { u32::MAX } else { (1 << width) - 1 };
            word & in_range != 0
        })
    }
}

/// A compiled grammar's answer to "which tokens may come next".
pub trait TokenMatcher: Send + Sync {
    /// The tokens that may follow `output`, the request's whole output so far. Called with
    /// outputs that grow a token at a time, and, after a preemption or a discarded overlap
    /// sample, with one that shares only a prefix with the last: the answer depends on `output`
    /// alone. Never empty: a matcher that cannot go on allows only the end of sequence.
    fn allowed(&mut self, output: &[u32]) -> TokenMask;

    /// A copy in the same state (executors, the provenance model among them, are `Clone`).
    fn boxed_clone(&self) -> Box<dyn TokenMatcher>;
}

/// Turns a `Grammar` into a matcher over one model's vocabulary.
pub trait GrammarCompiler: Send + Sync + fmt::Debug {
    /// A grammar the compiler refuses (a schema it cannot read, a grammar too large) is a clear
    /// error; the HTTP edge compiles each grammar once to say so to the client.
    fn compile(&self, grammar: &Grammar) -> Result<Box<dyn TokenMatcher>, String>;

    /// How many compiles a compiler that keeps compiled grammars answered from them (the
    /// server's metrics); `None` from one that keeps none.
    fn compile_counts(&self) -> Option<CompileCounts> {
        None
    }
}

/// Compiles answered from the compiled grammars a compiler keeps (`hits`), and the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompileCounts {
    pub hits: u64,
    pub misses: u64,
}

/// A request's compiled grammar, or why it has none (the executor had no compiler, or the
/// grammar failed there): sampling it is then an error, never an unconstrained draw.
pub(super) struct Constraint(Result<Box<dyn TokenMatcher>, String>);

impl Constraint {
    pub(super) fn compile(grammar: &Grammar, compiler: Option<&dyn GrammarCompiler>) -> Constraint {
        Constraint(match compiler {
            Some(compiler) => compiler.compile(grammar),
            None => {
                Err("this executor has no grammar compiler: constrained decoding is off".into())
            }
        })
    }

    pub(super) fn allowed(&mut self, output: &[u32]) -> Result<TokenMask, String> {
        match &mut self.0 {
            Ok(matcher) => Ok(matcher.allowed(output)),
            Err(e) => Err(format!("the request's grammar: {e}")),
        }
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Constraint {
        Constraint(match &self.0 {
            Ok(matcher) => Ok(matcher.boxed_clone()),
            Err(e) => Err(e.clone()),
        })
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Ok(_) => f.write_str("Constraint(compiled)"),
            Err(e) => write!(f, "Constraint(failed: {e})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_holds_its_tokens_and_nothing_past_its_words() {
        let mask = TokenMask::only(37);
        assert!(mask.allows(37));
        assert!(!mask.allows(36) && !mask.allows(38) && !mask.allows(5) && !mask.allows(1 << 20));
        assert!(mask.allows_any_below(38));
        assert!(!mask.allows_any_below(37), "37 is not below 37");
        assert!(!TokenMask::from_words(vec![]).allows_any_below(100));
        let high = TokenMask::from_words(vec![0, 1 << 31]);
        assert!(high.allows(63) && high.allows_any_below(64) && !high.allows_any_below(63));
    }
}
