//! A Llama-family model's weights, from a GGUF file or a Hugging Face safetensors directory.
//! GGUF's block types stay quantized (multiplied as llama.cpp does, see `blocks` and `kquants`);
//! the others are widened to f32 at load. Every tensor's shape is checked against the config,
//! and an error names the file and the tensor.

use std::fmt;
use std::path::Path;

use super::LlamaConfig;
use super::matmul::Weight;
use crate::gguf::{Gguf, TensorType, dequantize};

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub q: Weight,
    pub k: Weight,
    pub v: Weight,
    /// Added to the Q, K and V projections (Qwen2); `None` elsewhere.
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    pub o: Weight,
    pub ffn_norm: Vec<f32>,
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

#[derive(Clone, Debug)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    pub embed: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output projection; the embedding when tied (SmolLM2).
    pub output: Option<Weight>,
}

/// Why a model did not load: which file, and which tensor or key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    pub file: String,
    pub what: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.file, self.what)
    }
}

impl std::error::Error for LoadError {}

impl LoadError {
    pub fn new(file: &Path, what: impl Into<String>) -> LoadError {
        LoadError { file: file.display().to_string(), what: what.into() }
    }
}

/// Where tensors come from: by name, checked against the shape the config implies.
pub(crate) trait TensorSource {
    fn contains(&self, name: &str) -> bool;
    /// `name` as `rows` rows of `cols`.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight, LoadError>;
    /// `name` as a vector of `len`, in f32.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError>;
}

/// How a file format names the tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TensorNames {
    Gguf,
    HuggingFace,
}

/// Each role of a layer's tensors, as GGUF and Hugging Face name it within the layer.
const LAYER_TENSORS: [(&str, &str, &str); 12] = [
    ("attn_norm", "attn_norm.weight", "input_layernorm.weight"),
    ("q", "attn_q.weight", "self_attn.q_proj.weight"),
    ("k", "attn_k.weight", "self_attn.k_proj.weight"),
    ("v", "attn_v.weight", "self_attn.v_proj.weight"),
    ("q_bias", "attn_q.bias", "self_attn.q_proj.bias"),
    ("k_bias", "attn_k.bias", "self_attn.k_proj.bias"),
    ("v_bias", "attn_v.bias", "self_attn.v_proj.bias"),
    ("o", "attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm", "ffn_norm.weight", "post_attention_layernorm.weight"),
    ("gate", "ffn_gate.weight", "mlp.gate_proj.weight"),
    ("up", "ffn_up.weight", "mlp.up_proj.weight"),
    ("down", "ffn_down.weight", "mlp.down_proj.weight"),
];

impl TensorNames {
    fn pick(self, gguf: &'static str, hf: &'static str) -> &'static str {
        match self {
            TensorNames::Gguf => gguf,
            TensorNames::HuggingFace => hf,
        }
    }

    fn embed(self) -> &'static str {
        self.pick("token_embd.weight", "model.embed_tokens.weight")
    }

    fn output_norm(self) -> &'static str {
        self.pick("output_norm.weight", "model.norm.weight")
    }

    fn output(self) -> &'static str {
        self.pick("output.weight", "lm_head.weight")
    }

    /// Layer `i`'s tensor of `role` (a first column of `LAYER_TENSORS`).
    fn layer(self, i: usize, role: &str) -> String {
        let (_, gguf, hf) =
            LAYER_TENSORS.iter().find(|(r, _, _)| *r == role).expect("a role from LAYER_TENSORS");
        match self {
            TensorNames::Gguf => format!("blk.{i}.{gguf}"),
            TensorNames::HuggingFace => format!("model.layers.{i}.{hf}"),
        }
    }
}

impl Layer {
    /// The Q, K and V projections of the normed inputs `h`, biases added.
    pub fn qkv(&self, h: &[Vec<f32>]) -> [Vec<Vec<f32>>; 3] {
        let mut out = [self.q.matmul(h), self.k.matmul(h), self.v.matmul(h)];
        if let Some(biases) = &self.qkv_bias {
            for (rows, bias) in out.iter_mut().zip(biases) {
                for row in rows {
                    row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
                }
            }
        }
        out
    }
}

impl LlamaWeights {
    pub fn load_gguf(path: &Path) -> Result<LlamaWeights, LoadError> {
        let file = std::fs::read(path).map_err(|e| LoadError::new(path, e.to_string()))?;
        let gguf = Gguf::parse(&file).map_err(|e| LoadError::new(path, e.to_string()))?;
        Self::from_gguf(&gguf, &file).map_err(|what| LoadError::new(path, what))
    }

    pub fn from_gguf(gguf: &Gguf, file: &[u8]) -> Result<LlamaWeights, String> {
        let mut config = LlamaConfig::from_gguf(gguf)?;
        let source = GgufTensors { gguf, file };
        if source.contains("rope_freqs.weight") {
            let factors = source.vector("rope_freqs.weight", config.head_dim / 2);
            config.rope_freq_factors = Some(factors.map_err(|e| e.what)?);
        }
        Self::from_source(config, &source, TensorNames::Gguf).map_err(|e| e.what)
    }

    /// Every tensor the config calls for, from `source` under `names`.
    pub(crate) fn from_source(
        config: LlamaConfig,
        source: &dyn TensorSource,
        names: TensorNames,
    ) -> Result<LlamaWeights, LoadError> {
        let c = &config;
        let (q_width, kv_width) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let n = |role: &str| names.layer(i, role);
            let qkv_bias = if c.qkv_bias {
                Some([
                    source.vector(&n("q_bias"), q_width)?,
                    source.vector(&n("k_bias"), kv_width)?,
                    source.vector(&n("v_bias"), kv_width)?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: source.vector(&n("attn_norm"), c.hidden)?,
                q: source.matrix(&n("q"), q_width, c.hidden)?,
                k: source.matrix(&n("k"), kv_width, c.hidden)?,
                v: source.matrix(&n("v"), kv_width, c.hidden)?,
                qkv_bias,
                o: source.matrix(&n("o"), c.hidden, q_width)?,
                ffn_norm: source.vector(&n("ffn_norm"), c.hidden)?,
                gate: source.matrix(&n("gate"), c.ffn, c.hidden)?,
                up: source.matrix(&n("up"), c.ffn, c.hidden)?,
                down: source.matrix(&n("down"), c.hidden, c.ffn)?,
            });
        }
        let output = match source.contains(names.output()) {
            true => Some(source.matrix(names.output(), c.vocab_size, c.hidden)?),
            false => None,
        };
        Ok(LlamaWeights {
            embed: source.matrix(names.embed(), c.vocab_size, c.hidden)?,
            output_norm: source.vector(names.output_norm(), c.hidden)?,
            output,
            layers,
            config,
        })
    }

    pub fn output(&self) -> &Weight {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}

/// Tensors of a parsed GGUF file (errors carry no file name: `load_gguf` adds it).
struct GgufTensors<'a> {
    gguf: &'a Gguf,
    file: &'a [u8],
}

impl GgufTensors<'_> {
    fn info(&self, name: &str, dims: &[u64]) -> Result<&crate::gguf::TensorInfo, LoadError> {
        let err = |what: String| LoadError { file: String::new(), what };
        let info =
            self.gguf.tensor(name).ok_or_else(|| err(format!("tensor {name:?} is missing")))?;
        if info.dims != dims {
            return Err(err(format!(
                "tensor {name:?} has shape {:?}, the config says {dims:?}",
                info.dims
            )));
        }
        Ok(info)
    }
}

impl TensorSource for GgufTensors<'_> {
    fn contains(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }

    /// ggml lists dimensions innermost first: `[cols, rows]`.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight, LoadError> {
        let info = self.info(name, &[cols as u64, rows as u64])?;
        Ok(Weight::new(info.kind, rows, cols, self.gguf.tensor_data(self.file, info)))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let info = self.info(name, &[len as u64])?;
        let mut data = vec![0f32; len];
        dequantize(info.kind, self.gguf.tensor_data(self.file, info), &mut data);
        Ok(data)
    }
}

/// Bytes of `kind` holding `len` f32 values, for formats that store plain floats.
pub(crate) fn widen(kind: TensorType, bytes: &[u8], len: usize) -> Vec<f32> {
    let mut data = vec![0f32; len];
    dequantize(kind, bytes, &mut data);
    data
}
