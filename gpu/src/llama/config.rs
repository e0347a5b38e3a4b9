//! A Llama-family model's shape: from GGUF metadata or a Hugging Face `config.json`.
//!
//! The family differs in few places, each a field here rather than a branch on a model name:
//! Qwen2 adds biases to the Q, K and V projections, Llama 3.1 rescales RoPE frequencies, Mistral
//! (v0.1) attends over a sliding window, SmolLM2 ties the output projection to the embedding.

use serde::Deserialize;

use crate::gguf::Gguf;

/// How rotary embeddings pair up a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)`: what GGUF's llama weights expect (the converter permutes Q
    /// and K so that this equals Hugging Face's rotate-half on the original weights).
    Interleaved,
    /// Halves `(i, i + d/2)`: Hugging Face's `rotate_half`, for safetensors weights (and for
    /// GGUF's qwen2, which is stored unpermuted; llama.cpp's "NEOX" style).
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
    /// Per rotary pair, the divisor of its angle (Llama 3.1's frequency rescaling); `None` is 1.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// A token attends only to the last this many positions, itself included (Mistral v0.1).
    pub sliding_window: Option<usize>,
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads the `{arch}.*` keys of a `llama` or `qwen2` GGUF (Mistral's GGUFs say `llama`).
    /// Errors name the missing or bad key.
    pub fn from_gguf(gguf: &Gguf) -> Result<LlamaConfig, String> {
        let arch = gguf.get_str("general.architecture").ok_or("no general.architecture")?;
        let (rope_style, qkv_bias) = match arch {
            "llama" => (RopeStyle::Interleaved, false),
            "qwen2" => (RopeStyle::Halves, true),
            other => return Err(format!("architecture {other:?} is not llama or qwen2")),
        };
        let key = |name: &str| format!("{arch}.{name}");
        let int = |name: &str| {
            gguf.get_u64(&key(name))
                .map(|v| v as usize)
                .ok_or_else(|| format!("missing or non-integer {}", key(name)))
        };
        let hidden = int("embedding_length")?;
        let heads = int("attention.head_count")?;
        let kv_heads = gguf.get_u64(&key("attention.head_count_kv")).map_or(heads, |v| v as usize);
        let vocab_size = match gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(tokens) => tokens.len(),
            None => int("vocab_size")?,
        };
        let config = LlamaConfig {
            vocab_size,
            hidden,
            layers: int("block_count")?,
            heads,
            kv_heads,
            head_dim: gguf
                .get_u64(&key("attention.key_length"))
                .map_or(hidden / heads.max(1), |v| v as usize),
            ffn: int("feed_forward_length")?,
            rms_eps: gguf.get_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope_base: gguf.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_style,
            // GGUF stores Llama 3.1's factors as the tensor `rope_freqs.weight`; the weights
            // loader reads it.
            rope_freq_factors: None,
            qkv_bias,
            sliding_window: None,
            context_length: int("context_length")?,
        };
        config.check()?;
        Ok(config)
    }

    /// From a Hugging Face `config.json` (`model_type` llama, mistral or qwen2).
    pub fn from_hf_json(text: &str) -> Result<LlamaConfig, String> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| format!("config.json: {e}"))?;
        let qkv_bias = match hf.model_type.as_str() {
            "llama" | "mistral" => hf.attention_bias.unwrap_or(false),
            "qwen2" => true,
            other => {
                return Err(format!(
                    "config.json: model_type {other:?} is not llama, mistral or qwen2"
                ));
            }
        };
        let heads = hf.num_attention_heads;
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads.max(1));
        let rope_base = hf.rope_theta.unwrap_or(10_000.0);
        let rope_freq_factors = match &hf.rope_scaling {
            None => None,
            Some(scaling) => scaling.freq_factors(rope_base, head_dim)?,
        };
        // Qwen2 configs carry a window they do not use unless `use_sliding_window` is set.
        let sliding_window = match hf.model_type.as_str() {
            "qwen2" if hf.use_sliding_window != Some(true) => None,
            _ => hf.sliding_window,
        };
        let config = LlamaConfig {
            vocab_size: hf.vocab_size,
            hidden: hf.hidden_size,
            layers: hf.num_hidden_layers,
            heads,
            kv_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim,
            ffn: hf.intermediate_size,
            rms_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_base,
            rope_style: RopeStyle::Halves,
            rope_freq_factors,
            qkv_bias,
            sliding_window,
            context_length: hf.max_position_embeddings.unwrap_or(4096),
        };
        config.check()?;
        Ok(config)
    }

    /// Shapes that the forward pass needs to hold together.
    fn check(&self) -> Result<(), String> {
        let (h, kv) = (self.heads, self.kv_heads);
        if h == 0 || kv == 0 || h % kv != 0 {
            return Err(format!("{h} attention heads are not a multiple of {kv} KV heads"));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(format!("head size {} is not a positive even number", self.head_dim));
        }
        if [self.hidden, self.layers, self.ffn, self.vocab_size].contains(&0) {
            return Err(
                "hidden size, layers, feed-forward size and vocabulary must be nonzero".into()
            );
        }
        if self.sliding_window == Some(0) {
            return Err("a sliding window of 0 positions".into());
        }
        if let Some(factors) = &self.rope_freq_factors
            && factors.len() != self.head_dim / 2
        {
            return Err(format!(
                "{} RoPE frequency factors for {} rotary pairs",
                factors.len(),
                self.head_dim / 2
            ));
        }
        Ok(())
    }

    /// The first position a token at `position` attends to.
    pub fn window_start(&self, position: usize) -> usize {
        self.sliding_window.map_or(0, |w| (position + 1).saturating_sub(w))
    }
}

/// The fields of a Hugging Face `config.json` a Llama-family model needs.
#[derive(Deserialize)]
struct HfConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    #[serde(alias = "type")]
    rope_type: String,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
}

impl HfRopeScaling {
    /// Per rotary pair, how much its angle is divided by. Llama 3.1 (`rope_type: llama3`) keeps
    /// high frequencies, divides low ones by `factor`, and blends in between (transformers'
    /// `_compute_llama3_parameters`); `linear` divides all by `factor`; `default` none.
    fn freq_factors(&self, base: f32, head_dim: usize) -> Result<Option<Vec<f32>>, String> {
        let need = |v: Option<f64>, name: &str| {
            v.ok_or_else(|| format!("config.json: rope_scaling {} needs {name}", self.rope_type))
        };
        let pairs = head_dim / 2;
        let inv_freq = |i: usize| 1.0 / f64::from(base).powf(2.0 * i as f64 / head_dim as f64);
        match self.rope_type.as_str() {
            "default" => Ok(None),
            "linear" => Ok(Some(vec![need(self.factor, "factor")? as f32; pairs])),
            "llama3" => {
                let factor = need(self.factor, "factor")?;
                let low = need(self.low_freq_factor, "low_freq_factor")?;
                let high = need(self.high_freq_factor, "high_freq_factor")?;
                let context = need(
                    self.original_max_position_embeddings,
                    "original_max_position_embeddings",
                )?;
                if high <= low {
                    return Err(
                        "config.json: rope_scaling high_freq_factor must exceed low_freq_factor"
                            .into(),
                    );
                }
                let (low_wavelen, high_wavelen) = (context / low, context / high);
                let factors = (0..pairs)
                    .map(|i| {
                        let freq = inv_freq(i);
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        let scaled = if wavelen < high_wavelen {
                            freq
                        } else if wavelen > low_wavelen {
                            freq / factor
                        } else {
                            let smooth = (context / wavelen - low) / (high - low);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        };
                        (freq / scaled) as f32
                    })
                    .collect();
                Ok(Some(factors))
            }
            other => Err(format!("config.json: rope_scaling type {other:?} is not supported")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31: &str = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "rope_scaling": {"factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}}"#;

    #[test]
    fn llama31_rope_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let c = LlamaConfig::from_hf_json(LLAMA31).unwrap();
        let f = c.rope_freq_factors.as_ref().unwrap();
        assert_eq!((c.head_dim, c.kv_heads, f.len()), (128, 8, 64));
        // Wavelength 2 pi base^(2i/d) against 8192/4 and 8192/1: short ones kept, long ones / 8.
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "factors grow with wavelength");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0), "a blended band in between");
    }

    #[test]
    fn qwen2_has_biases_and_ignores_an_unused_window() {
        let qwen = r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_sliding_window": false, "tie_word_embeddings": true}"#;
        let c = LlamaConfig::from_hf_json(qwen).unwrap();
        assert!(c.qkv_bias);
        assert_eq!((c.sliding_window, c.head_dim), (None, 64));
        let mistral = qwen.replace("qwen2", "mistral").replace("14", "16");
        let c = LlamaConfig::from_hf_json(&mistral).unwrap();
        assert_eq!((c.qkv_bias, c.sliding_window), (false, Some(32768)));
        assert_eq!((c.window_start(40_000), c.window_start(10)), (40_000 + 1 - 32768, 0));
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let err = |text: &str| LlamaConfig::from_hf_json(text).unwrap_err();
        assert!(err("{").contains("config.json"));
        assert!(err(&LLAMA31.replace("\"llama\"", "\"gpt2\"")).contains("model_type \"gpt2\""));
        assert!(
            err(&LLAMA31.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"))
                .contains("not a multiple")
        );
        assert!(err(&LLAMA31.replace("\"llama3\"", "\"yarn\"")).contains("not supported"));
        assert!(err(&LLAMA31.replace("\"hidden_size\": 4096,", "")).contains("hidden_size"));
    }
}
