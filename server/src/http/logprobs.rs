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
        let alternatives: Map<String, Value> =
            l.top.iter().map(|&(id, lp)| (codec.token_text(id), Value::from(lp))).collect();
        top.push(alternatives);
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}
