//! Grammars compiled over a model's vocabulary: core's `GrammarCompiler`, by llguidance.
//!
//! llguidance reads each token's bytes from the tokenizer's `tokenizer.json` form and builds a
//! trie of them once per model (`GrammarCompiler::new`, tens of milliseconds for a 50k
//! vocabulary); a grammar then compiles in about a millisecond and answers each step's mask by
//! walking the trie under its Earley parser.
//!
//! Compiled grammars are kept (`compiled_grammars`): the HTTP edge's compile of a request's
//! grammar makes the executor's a clone, and a grammar sent again is not compiled again.
//!
//! A matcher answers from the output it is given, not from what it was told before (core's
//! contract): it keeps the output it has consumed, rolls back to the common prefix when a new
//! output departs from it (a preempted request recomputed, an overlap sample discarded), and
//! replays from the start when rollback fails.

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, token_bytes_from_tokenizer_json};
use lockstep_core::model::{self, CompileCounts, Grammar, TokenMask, TokenMatcher};
use serde_json::{Value, json};

use crate::compiled_grammars::{
    COMPILED_GRAMMAR_BYTES_MAX, COMPILED_GRAMMARS_MAX, CompiledGrammars,
};
use crate::tokenizer::Tokenizer;

/// Whitespace between two tokens of JSON, at most 20 characters (llguidance's default has no
/// bound): a model that loops on newlines, as small ones do, cannot spend its `max_tokens` on
/// blanks, and pretty-printed JSON nested nine deep still fits. A schema's own `x-guidance`
/// options replace it.
pub const JSON_BLANKS: &str = r"[\x20\x0A\x0D\x09]{1,20}";

/// A model's grammar compiler: its vocabulary as a token trie, and the tokens that end an
/// output (what a finished grammar allows).
pub struct GrammarCompiler {
    factory: ParserFactory,
    stop_tokens: Vec<u32>,
    /// Each grammar compiled lately, as its matcher before any output (or the compile's error).
    compiled: Mutex<CompiledGrammars<Result<Matcher, String>>>,
}

impl fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarCompiler").field("stop_tokens", &self.stop_tokens).finish()
    }
}

impl GrammarCompiler {
    /// A compiler over `tokenizer`'s vocabulary; `stop_tokens` (the model's, at least one) are
    /// what a finished grammar allows.
    pub fn new(tokenizer: &Tokenizer, stop_tokens: &[u32]) -> Result<GrammarCompiler, String> {
        let &eos =
            stop_tokens.first().ok_or("the grammar compiler: the model has no stop token")?;
        let eos = tokenizer.eos.filter(|t| stop_tokens.contains(t)).unwrap_or(eos);
        let bytes =
            token_bytes_from_tokenizer_json(&tokenizer.to_json()?).map_err(compiler_error)?;
        let vocab = u32::try_from(bytes.len()).map_err(|_| "the grammar compiler: vocabulary")?;
        if stop_tokens.iter().any(|&t| t >= vocab) {
            return Err(format!("the grammar compiler: a stop token is past the {vocab} tokens"));
        }
        let trie = TokTrie::from(&TokRxInfo::new(vocab, eos), &bytes);
        let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(compiler_error)?;
        // Nothing on stderr: a grammar's problems come back as errors.
        factory.quiet();
        let compiled = CompiledGrammars::new(COMPILED_GRAMMARS_MAX, COMPILED_GRAMMAR_BYTES_MAX);
        Ok(GrammarCompiler {
            factory,
            stop_tokens: stop_tokens.to_vec(),
            compiled: Mutex::new(compiled),
        })
    }

    /// `grammar` compiled now, whatever is kept: what a kept one must equal (tests, benchmarks).
    pub fn compile_uncached(&self, grammar: &Grammar) -> Result<Box<dyn TokenMatcher>, String> {
        Ok(self.matcher(self.start(grammar)?))
    }

    /// The kept grammars. A panic elsewhere while they were locked left them whole (each change
    /// to them is one call that does not panic), so a poisoned lock is taken as it is.
    fn compiled(&self) -> MutexGuard<'_, CompiledGrammars<Result<Matcher, String>>> {
        self.compiled.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `grammar`'s matcher before any output.
    fn start(&self, grammar: &Grammar) -> Result<Matcher, String> {
        let parser = self.factory.create_parser(Self::top_level(grammar)?);
        let matcher = Matcher::new(parser);
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(matcher),
        }
    }

    fn matcher(&self, start: Matcher) -> Box<dyn TokenMatcher> {
        Box::new(GrammarMatcher {
            matcher: start.clone(),
            start,
            consumed: Vec::new(),
            stop_tokens: self.stop_tokens.clone(),
        })
    }

    fn top_level(grammar: &Grammar) -> Result<TopLevelGrammar, String> {
        let json = |mut schema: Value| {
            if let Some(fields) = schema.as_object_mut() {
                fields
                    .entry("x-guidance")
                    .or_insert_with(|| json!({"whitespace_pattern": JSON_BLANKS}));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match grammar {
            Grammar::JsonObject => json(json!({"type": "object"})),
            Grammar::JsonSchema(text) => {
                json(serde_json::from_str(text).map_err(|e| format!("the JSON schema: {e}"))?)
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        })
    }
}

impl model::GrammarCompiler for GrammarCompiler {
    fn compile(&self, grammar: &Grammar) -> Result<Box<dyn TokenMatcher>, String> {
        let kept = self.compiled().get(grammar);
        let start = match kept {
            Some(start) => start,
            // Compiled outside the lock: one long compile holds up no other.
            None => {
                let start = self.start(grammar);
                self.compiled().insert(grammar.clone(), start.clone());
                start
            }
        };
        Ok(self.matcher(start?))
    }

    fn compile_counts(&self) -> Option<CompileCounts> {
        Some(self.compiled().counts())
    }
}

/// One request's grammar state.
#[derive(Clone)]
struct GrammarMatcher {
    /// The matcher before any output: what a failed rollback replays from.
    start: Matcher,
    matcher: Matcher,
    /// The output `matcher` has consumed.
    consumed: Vec<u32>,
    stop_tokens: Vec<u32>,
}

impl GrammarMatcher {
    /// `matcher` having consumed exactly `output`.
    fn follow(&mut self, output: &[u32]) -> Result<(), String> {
        let common = self.consumed.iter().zip(output).take_while(|(a, b)| a == b).count();
        if common < self.consumed.len() {
            let back = self.consumed.len() - common;
            if self.matcher.rollback(back).is_err() || self.matcher.is_error() {
                self.matcher = self.start.clone();
                self.consumed.clear();
                return self.follow(output);
            }
            self.consumed.truncate(common);
        }
        for &token in &output[common..] {
            self.matcher.consume_token(token).map_err(|e| e.to_string())?;
            self.consumed.push(token);
        }
        Ok(())
    }
}

impl TokenMatcher for GrammarMatcher {
    fn allowed(&mut self, output: &[u32]) -> TokenMask {
        let mask = self.follow(output).and_then(|()| {
            let mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
            Ok(mask.as_slice().to_vec())
        });
        // A grammar that cannot go on (an output it refuses, a parser past its limits) ends the
        // output rather than letting it run unconstrained: only the stop tokens.
        // Where the grammar may end, any of the model's stop tokens may end it (llguidance
        // knows one).
        let mut words = mask.unwrap_or_default();
        let bit = |t: u32| (t as usize / 32, 1u32 << (t % 32));
        let ends = self.stop_tokens.iter().any(|&t| {
            let (at, b) = bit(t);
            words.get(at).is_some_and(|w| w & b != 0)
        });
        if ends || words.iter().all(|&w| w == 0) {
            for &t in &self.stop_tokens {
                let (at, b) = bit(t);
                if words.len() <= at {
                    words.resize(at + 1, 0);
                }
                words[at] |= b;
            }
        }
        TokenMask::from_words(words)
    }

    fn boxed_clone(&self) -> Box<dyn TokenMatcher> {
        Box::new(self.clone())
    }
}

/// llguidance's errors are `anyhow`'s, which this crate does not name.
fn compiler_error(e: impl fmt::Display) -> String {
    format!("the grammar compiler: {e}")
}
