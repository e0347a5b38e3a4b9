//! A Llama-family model's shape, from GGUF metadata.

use crate::gguf::Gguf;

/// How rotary embeddings pair up a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)`: what GGUF's llama weights expect (the converter permutes Q
    /// and K so that this equals Hugging Face's rotate-half on the original weights).
    Interleaved,
    /// Halves `(i, i + d/2)`: Hugging Face's `rotate_half`, for safetensors weights.
    Halves,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads the `llama.*` keys. Errors name the missing or bad key.
    pub fn from_gguf(gguf: &Gguf) -> Result<LlamaConfig, String> {
        let arch = gguf.get_str("general.architecture").ok_or("no general.architecture")?;
        if arch != "llama" {
            return Err(format!("architecture {arch:?} is not llama"));
        }
        let int = |key: &str| {
            gguf.get_u64(key)
                .map(|v| v as usize)
                .ok_or_else(|| format!("missing or non-integer {key}"))
        };
        let hidden = int("llama.embedding_length")?;
        let heads = int("llama.attention.head_count")?;
        let kv_heads = gguf.get_u64("llama.attention.head_count_kv").map_or(heads, |v| v as usize);
        if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
            return Err(format!(
                "{hidden} hidden with {heads} heads and {kv_heads} KV heads do not divide"
            ));
        }
        let vocab_size = match gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => tokens.len(),
            None => int("llama.vocab_size")?,
        };
        Ok(LlamaConfig {
            vocab_size,
            hidden,
            layers: int("llama.block_count")?,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            ffn: int("llama.feed_forward_length")?,
            rms_eps: gguf.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_base: gguf.get_f32("llama.rope.freq_base").unwrap_or(10_000.0),
            rope_style: RopeStyle::Interleaved,
            context_length: int("llama.context_length")?,
        })
    }
}
