//! The grammar compiler over a real byte-level vocabulary (the tiny models' tokenizer), driven
//! through outputs drawn under its own masks, with rollbacks as a preemption or a discarded
//! overlap sample makes them. What must hold at every step:
//! - the mask depends on the output alone: a matcher that has been everywhere answers what a
//!   fresh one told the output at once answers;
//! - it is never empty, and a stop token is in it exactly where the text so far is a whole value
//!   of the grammar (checked by parsing it as JSON, and against the schema by hand).

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod tiny;

use std::sync::OnceLock;

use lockstep_core::model::{CompileCounts, Grammar, GrammarCompiler as _, TokenMask};
use lockstep_gpu::grammar::GrammarCompiler;
use lockstep_gpu::tokenizer::Tokenizer;
use proptest::prelude::*;
use serde_json::{Value, json};

const VOCAB: u32 = 260;

fn tokenizer() -> Tokenizer {
    let config = json!({"eos_token": "<|im_end|>", "add_bos_token": false});
    Tokenizer::from_hf(tiny::tokenizer_json().to_string().as_bytes(), Some(&config)).unwrap()
}

/// The tokenizer and its compiler, built once: the compiler's token trie and lexer slices take
/// most of a case's time otherwise.
fn compiler() -> &'static (Tokenizer, GrammarCompiler) {
    static BUILT: OnceLock<(Tokenizer, GrammarCompiler)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let tokenizer = tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, &[tiny::IM_END]).unwrap();
        (tokenizer, compiler)
    })
}

fn schema() -> Grammar {
    Grammar::JsonSchema(
        json!({
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["he", "t"]}},
            "required": ["ok", "tag"],
            "additionalProperties": false,
        })
        .to_string(),
    )
}

fn allowed(mask: &TokenMask) -> Vec<u32> {
    (0..VOCAB).filter(|&t| mask.allows(t)).collect()
}

/// Whether `text` is a whole value of `grammar`.
fn complete(grammar: &Grammar, text: &str) -> bool {
    let Ok(value) = serde_json::from_str::<Value>(text) else { return false };
    match grammar {
        Grammar::JsonObject => value.is_object(),
        _ => {
            value.as_object().is_some_and(|o| o.len() == 2)
                && value["ok"].is_boolean()
                && ["he", "t"].contains(&value["tag"].as_str().unwrap_or(""))
        }
    }
}

/// One walk: each step either draws the `pick`-th allowed token or, when `back` is above zero,
/// forgets that many tokens of the output.
fn walk(grammar: &Grammar, steps: &[(u16, u8)]) -> Result<(), TestCaseError> {
    let (tokenizer, compiler) = compiler();
    let mut matcher = compiler.compile(grammar).unwrap();
    let mut output: Vec<u32> = Vec::new();
    for (step, &(pick, back)) in steps.iter().enumerate() {
        let mask = matcher.allowed(&output);
        // Every other step a grammar compiled anew, not the kept one.
        let fresh = match step % 2 {
            0 => compiler.compile(grammar),
            _ => compiler.compile_uncached(grammar),
        };
        let fresh = fresh.unwrap().allowed(&output);
        prop_assert_eq!(allowed(&mask), allowed(&fresh), "after {:?}", output);
        let tokens = allowed(&mask);
        prop_assert!(!tokens.is_empty(), "an empty mask after {:?}", output);
        let text = tokenizer.decode(&output, false).unwrap();
        let ends = mask.allows(tiny::IM_END);
        // A gap of blanks at the end is a whole value too: the grammar may end there.
        prop_assert_eq!(ends, complete(grammar, &text), "{:?}", text);
        if back > 0 {
            output.truncate(output.len().saturating_sub(usize::from(back % 8)));
            continue;
        }
        let token = tokens[usize::from(pick) % tokens.len()];
        if token == tiny::IM_END {
            break;
        }
        prop_assert!(token != tiny::IM_START, "a special token inside JSON");
        output.push(token);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn a_json_object_grammar_answers_from_the_output_alone(
        steps in prop::collection::vec((any::<u16>(), prop_oneof![6 => Just(0u8), 1 => 1u8..8]), 1..80)
    ) {
        walk(&Grammar::JsonObject, &steps)?;
    }

    #[test]
    fn a_schema_grammar_answers_from_the_output_alone(
        steps in prop::collection::vec((any::<u16>(), prop_oneof![6 => Just(0u8), 1 => 1u8..8]), 1..80)
    ) {
        walk(&schema(), &steps)?;
    }
}

#[test]
fn what_the_compiler_refuses_is_an_error_not_a_panic() {
    let (_, compiler) = compiler();
    for bad in ["not json", "{\"type\": \"sometimes\"}", "[1, 2]", "{\"$ref\": \"#/nowhere\"}"] {
        let grammar = Grammar::JsonSchema(bad.into());
        assert!(compiler.compile(&grammar).is_err(), "{bad} compiled");
    }
    assert!(compiler.compile(&Grammar::Lark("start: (".into())).is_err());
    let lark = Grammar::Lark("start: \"he\" \"t\"".into());
    let mut matcher = compiler.compile(&lark).unwrap();
    assert_eq!(allowed(&matcher.allowed(&[])), [b'h' as u32, 256], "h alone, or the token he");
    assert_eq!(allowed(&matcher.allowed(&[256, b't' as u32])), [tiny::IM_END]);
}

#[test]
fn a_grammar_compiled_again_is_the_kept_one_before_any_output() {
    let tokenizer = tokenizer();
    let compiler = GrammarCompiler::new(&tokenizer, &[tiny::IM_END]).unwrap();
    let grammar = schema();
    let value = tokenizer.encode(r#"{"ok": true, "tag": "t"}"#).unwrap();
    // The first matcher walks to the end of a whole value; what is kept must not walk with it.
    let mut first = compiler.compile(&grammar).unwrap();
    for n in 0..value.len() {
        assert!(first.allowed(&value[..n]).allows(value[n]), "token {n} refused");
    }
    assert_eq!(allowed(&first.allowed(&value)), [tiny::IM_END]);
    let mut kept = compiler.compile(&grammar).unwrap();
    let mut fresh = compiler.compile_uncached(&grammar).unwrap();
    assert_eq!(compiler.compile_counts(), Some(CompileCounts { hits: 1, misses: 1 }));
    for n in 0..=value.len() {
        let (a, b) = (kept.allowed(&value[..n]), fresh.allowed(&value[..n]));
        assert_eq!(allowed(&a), allowed(&b), "after {n} tokens");
    }
    // A refused grammar is kept too, with its error.
    let bad = Grammar::JsonSchema("{\"type\": \"sometimes\"}".into());
    let refused = compiler.compile(&bad).err();
    assert!(refused.is_some());
    assert_eq!(compiler.compile(&bad).err(), refused);
    assert_eq!(compiler.compile_counts(), Some(CompileCounts { hits: 2, misses: 2 }));
}
