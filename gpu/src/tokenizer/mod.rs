//! Text to token ids and back, for models whose GGUF metadata carries a GPT-2-style byte-level
//! BPE vocabulary (`tokenizer.ggml.model = "gpt2"`): Llama 3, SmolLM2, Qwen2.
//!
//! The vocabulary, merges and special tokens come from the GGUF file; the pre-tokenizer follows
//! `tokenizer.ggml.pre`, as llama.cpp does. The Hugging Face `tokenizers` crate does the work: we
//! describe the tokenizer to it in its own JSON format, the stable way to build one.

use serde_json::{Value, json};
use tokenizers::Tokenizer as HfTokenizer;

use crate::gguf::{Gguf, MetadataValue};

/// ggml's token type for control tokens (`<|im_start|>` and the like).
const TOKEN_TYPE_CONTROL: u64 = 3;

#[derive(Debug)]
pub struct Tokenizer {
    inner: HfTokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
}

impl Tokenizer {
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, String> {
        match gguf.get_str("tokenizer.ggml.model") {
            Some("gpt2") => {}
            other => return Err(format!("tokenizer model {other:?} is not supported (gpt2 is)")),
        }
        let strings = |key: &str| -> Result<Vec<&str>, String> {
            let values = gguf
                .get(key)
                .and_then(MetadataValue::as_array)
                .ok_or_else(|| format!("missing {key}"))?;
            values
                .iter()
                .map(|v| v.as_str().ok_or_else(|| format!("{key} holds a non-string")))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = gguf
            .get("tokenizer.ggml.token_type")
            .and_then(MetadataValue::as_array)
            .map(|v| v.iter().map(|t| t.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let description = describe(&tokens, &merges, &types, pre)?;
        let inner = HfTokenizer::from_bytes(description.to_string().as_bytes())
            .map_err(|e| format!("building the tokenizer: {e}"))?;
        let id = |key: &str| gguf.get_u64(key).map(|v| v as u32);
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: matches!(
                gguf.get("tokenizer.ggml.add_bos_token"),
                Some(MetadataValue::Bool(true))
            ),
        })
    }

    /// From a Hugging Face `tokenizer.json`, with the special tokens `tokenizer_config.json`
    /// names (`bos_token`, `eos_token`, `add_bos_token`) when there is one. Where the config
    /// does not say whether to add BOS, the tokenizer's own post-processor decides, as
    /// transformers would (Llama 3 adds `<|begin_of_text|>` that way).
    pub fn from_hf(json: &[u8], config: Option<&Value>) -> Result<Tokenizer, String> {
        let inner = HfTokenizer::from_bytes(json).map_err(|e| format!("tokenizer.json: {e}"))?;
        let special = |key: &str| -> Option<u32> {
            let value = config?.get(key)?;
            let text = value.as_str().or_else(|| value.get("content")?.as_str())?;
            inner.token_to_id(text)
        };
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let add_bos = match config.and_then(|c| c.get("add_bos_token")).and_then(Value::as_bool) {
            Some(add) => add,
            None => {
                let with = inner.encode("a", true).map_err(|e| format!("tokenizer.json: {e}"))?;
                bos.is_some() && with.get_ids().first().copied() == bos
            }
        };
        Ok(Tokenizer { inner, bos, eos, add_bos })
    }

    /// The text of token `id` (`<|im_end|>`), for chat templates that name special tokens.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are recognized,
    /// as llama.cpp does when asked to parse specials.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let plain = self.encode_plain(text)?;
        let mut ids = Vec::with_capacity(plain.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(&plain);
        Ok(ids)
    }

    /// As `encode`, without the BOS the tokenizer adds (vLLM's `add_special_tokens: false`).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        let encoding = self.inner.encode(text, false).map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are kept when `keep_special`.
    pub fn decode(&self, ids: &[u32], keep_special: bool) -> Result<String, String> {
        self.inner.decode(ids, !keep_special).map_err(|e| e.to_string())
    }

    /// The tokenizer in Hugging Face's `tokenizer.json` format (what llguidance reads each
    /// token's bytes from).
    pub fn to_json(&self) -> Result<Value, String> {
        let text =
            self.inner.to_string(false).map_err(|e| format!("the tokenizer as JSON: {e}"))?;
        serde_json::from_str(&text).map_err(|e| format!("the tokenizer as JSON: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// The tokenizer in the Hugging Face JSON format.
fn describe(tokens: &[&str], merges: &[&str], types: &[u64], pre: &str) -> Result<Value, String> {
    let vocab: serde_json::Map<String, Value> =
        tokens.iter().enumerate().map(|(i, t)| ((*t).to_owned(), json!(i))).collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types.get(*i) == Some(&TOKEN_TYPE_CONTROL))
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        // GPT-2's split; SmolLM2 splits digits one by one first (llama.cpp's "smollm").
        "default" | "gpt2" => byte_level.clone(),
        "smollm" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        other => return Err(format!("pre-tokenizer {other:?} is not supported yet")),
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        }
    }))
}
