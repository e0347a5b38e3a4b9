//! Log-probabilities in the two shapes OpenAI uses: per token objects with UTF-8 bytes (chat),
//! and parallel lists with text offsets (legacy completions).

use lockstep_core::model::TokenLogprobs;
use serde_json::{Map, Value, json};

use crate::text::TextCodec;

/// Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
pub fn chat(codec: &dyn TextCodec, logprobs: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = codec.token_text(id);
        json!({ "token": token, "logprob": logprob, "bytes": token.as_bytes() })
    };
    let content: Vec<Value> = logprobs
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            let top: Vec<Value> = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e["top_logprobs"] = Value::from(top);
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions with `echo`: the prompt's tokens, then the output's as `completion` gives them
/// (counting from `output_offset`, the echoed text's length). The prompt's first token has no
/// log-probability (null, as OpenAI and vLLM give it); token `i` after it has `scores[i - 1]`'s.
/// Prompt offsets count from 0 by the tokens' texts.
pub fn completion_echoed(
    codec: &dyn TextCodec,
    prompt: &[u32],
    scores: &[TokenLogprobs],
    output: &[TokenLogprobs],
    output_offset: usize,
) -> Value {
    let (mut tokens, mut token_logprobs, mut top, mut text_offset) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut offset = 0;
    for (i, &id) in prompt.iter().enumerate() {
        let text = codec.token_text(id);
        text_offset.push(Value::from(offset));
        offset += text.len();
        tokens.push(Value::from(text));
        match i.checked_sub(1).and_then(|j| scores.get(j)) {
            Some(l) => {
                token_logprobs.push(Value::from(l.logprob));
                top.push(Value::Object(alternatives(codec, l)));
            }
            None => {
                token_logprobs.push(Value::Null);
                top.push(Value::Null);
            }
        }
    }
    let rest = completion(codec, output, output_offset);
    for (name, list) in [
        ("tokens", &mut tokens),
        ("token_logprobs", &mut token_logprobs),
        ("top_logprobs", &mut top),
        ("text_offset", &mut text_offset),
    ] {
        list.extend(rest[name].as_array().into_iter().flatten().cloned());
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// A token's top alternatives: `{text: logprob}`.
fn alternatives(codec: &dyn TextCodec, l: &TokenLogprobs) -> Map<String, Value> {
    l.top.iter().map(|&(id, lp)| (codec.token_text(id), Value::from(lp))).collect()
}

/// Completions: `{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`;
/// offsets count from `offset`, the output's length before these tokens.
pub fn completion(codec: &dyn TextCodec, logprobs: &[TokenLogprobs], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut text_offset = Vec::new();
    for l in logprobs {
        let text = codec.token_text(l.token);
        text_offset.push(offset);
        offset += text.len();
        tokens.push(text);
        token_logprobs.push(l.logprob);
        top.push(alternatives(codec, l));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}
