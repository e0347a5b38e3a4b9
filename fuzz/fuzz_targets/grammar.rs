//! Grammars from outside (a client's JSON Schema, a Lark grammar, the grammar of calls to a
//! client's tools in each markup dialect) through llguidance's compiler and our matcher over a
//! byte-level vocabulary (`lockstep_gpu::grammar`). No panic compiling anything. A grammar that
//! compiles answers a mask at every step of a walk drawn under it, with rollbacks as a recompute
//! makes them: never empty, and at the end the mask a fresh matcher told the whole output at
//! once gives, whether compiled anew or taken from the compiler's kept grammars (as a refusal is).
//! Input: byte 0 % 4 picks JSON Schema (0), Lark (1), or tools (2: one call, 3: parallel calls;
//! the text a JSON object of tool names to parameter schemas, the dialect byte 0 / 4 among
//! `ToolFormat::ALL`); the grammar's text runs to the first 0xFF; each byte after it picks an
//! allowed token (0xF0 and up: forget that many tokens, less 0xEF).

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lockstep_core::model::{Grammar, GrammarCompiler as _, TokenMask};
use lockstep_gpu::grammar::GrammarCompiler;
use lockstep_gpu::tokenizer::Tokenizer;
use lockstep_server::tool_calls::{ToolFormat, ToolSpec, required_calls};
use serde_json::{Map, Value, json};

/// The 256 bytes, merges "t r", "u e", "tr ue", "{ \"", and `<|end|>` (the stop token).
const VOCAB: u32 = 261;
const END: u32 = 260;

fn compiler() -> &'static GrammarCompiler {
    static COMPILER: OnceLock<GrammarCompiler> = OnceLock::new();
    COMPILER.get_or_init(|| {
        let chars = byte_chars();
        let mut vocab = Map::new();
        for (id, ch) in chars.iter().enumerate() {
            vocab.insert(ch.to_string(), json!(id));
        }
        for (id, token) in [(256, "tr"), (257, "ue"), (258, "true"), (259, "{\"")] {
            vocab.insert(token.into(), json!(id));
        }
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": END, "content": "<|end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": ["t r", "u e", "tr ue", "{ \""]},
        });
        let config = json!({"eos_token": "<|end|>", "add_bos_token": false});
        let tokenizer = Tokenizer::from_hf(tokenizer.to_string().as_bytes(), Some(&config))
            .expect("the fuzz vocabulary");
        GrammarCompiler::new(&tokenizer, &[END]).expect("the fuzz grammar compiler")
    })
}

/// GPT-2's `bytes_to_unicode`, in byte order.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256;
    (0..256u32)
        .map(|b| match printable(b) {
            true => char::from_u32(b).expect("Latin-1"),
            false => {
                next += 1;
                char::from_u32(next - 1).expect("above 255")
            }
        })
        .collect()
}

fn allowed(mask: &TokenMask) -> Vec<u32> {
    (0..VOCAB).filter(|&t| mask.allows(t)).collect()
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&kind, rest)) = bytes.split_first() else { return };
    let end = rest.iter().position(|&b| b == 0xFF).unwrap_or(rest.len());
    let text = String::from_utf8_lossy(&rest[..end]).into_owned();
    let picks = rest.get(end + 1..).unwrap_or(&[]);
    let grammar = match kind % 4 {
        0 => Grammar::JsonSchema(text),
        1 => Grammar::Lark(text),
        parallel => {
            let Ok(Value::Object(tools)) = serde_json::from_str(&text) else { return };
            let specs: Vec<ToolSpec> = tools
                .into_iter()
                .map(|(name, parameters)| ToolSpec { name, description: None, parameters })
                .collect();
            let format = ToolFormat::ALL[usize::from(kind / 4) % ToolFormat::ALL.len()];
            required_calls(format, &specs, parallel == 3)
        }
    };
    let compiler = compiler();
    let mut matcher = match compiler.compile(&grammar) {
        Ok(matcher) => matcher,
        Err(e) => {
            // Refused again from the kept grammars, as a compile anew refuses it.
            assert_eq!(compiler.compile(&grammar).err().as_ref(), Some(&e));
            assert_eq!(compiler.compile_uncached(&grammar).err(), Some(e));
            return;
        }
    };
    let mut output: Vec<u32> = Vec::new();
    for &pick in picks.iter().take(64) {
        let tokens = allowed(&matcher.allowed(&output));
        assert!(!tokens.is_empty(), "an empty mask after {output:?}");
        if pick >= 0xF0 {
            output.truncate(output.len().saturating_sub(usize::from(pick - 0xEF)));
            continue;
        }
        let token = tokens[usize::from(pick) % tokens.len()];
        if token == END {
            break;
        }
        output.push(token);
    }
    let walked = allowed(&matcher.allowed(&output));
    let kept = compiler.compile(&grammar).expect("it compiled once").allowed(&output);
    let fresh = compiler.compile_uncached(&grammar).expect("it compiled once").allowed(&output);
    assert_eq!(walked, allowed(&fresh), "after {output:?}");
    assert_eq!(allowed(&kept), allowed(&fresh), "the kept grammar, after {output:?}");
});
