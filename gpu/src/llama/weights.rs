//! A Llama-family model's weights: 32-element block types stay quantized (multiplied as llama.cpp
//! does, see `matmul`), the others are dequantized to f32 at load.

use std::fmt;
use std::path::Path;

use super::LlamaConfig;
use super::matmul::Weight;
use crate::gguf::{Gguf, dequantize};

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub q: Weight,
    pub k: Weight,
    pub v: Weight,
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

impl LlamaWeights {
    pub fn load_gguf(path: &Path) -> Result<LlamaWeights, LoadError> {
        let err = |what: String| LoadError { file: path.display().to_string(), what };
        let file = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let gguf = Gguf::parse(&file).map_err(|e| err(e.to_string()))?;
        Self::from_gguf(&gguf, &file).map_err(err)
    }

    pub fn from_gguf(gguf: &Gguf, file: &[u8]) -> Result<LlamaWeights, String> {
        let config = LlamaConfig::from_gguf(gguf)?;
        let c = &config;
        let kv = c.kv_heads * c.head_dim;
        let matrix = |name: &str, rows: usize, cols: usize| load(gguf, file, name, rows, cols);
        let vector = |name: &str, len: usize| load_vector(gguf, file, name, len);
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let n = |t: &str| format!("blk.{i}.{t}.weight");
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm"), c.hidden)?,
                q: matrix(&n("attn_q"), c.hidden, c.hidden)?,
                k: matrix(&n("attn_k"), kv, c.hidden)?,
                v: matrix(&n("attn_v"), kv, c.hidden)?,
                o: matrix(&n("attn_output"), c.hidden, c.hidden)?,
                ffn_norm: vector(&n("ffn_norm"), c.hidden)?,
                gate: matrix(&n("ffn_gate"), c.ffn, c.hidden)?,
                up: matrix(&n("ffn_up"), c.ffn, c.hidden)?,
                down: matrix(&n("ffn_down"), c.hidden, c.ffn)?,
            });
        }
        let output = match gguf.tensor("output.weight") {
            Some(_) => Some(matrix("output.weight", c.vocab_size, c.hidden)?),
            None => None,
        };
        Ok(LlamaWeights {
            embed: matrix("token_embd.weight", c.vocab_size, c.hidden)?,
            output_norm: vector("output_norm.weight", c.hidden)?,
            output,
            layers,
            config,
        })
    }

    pub fn output(&self) -> &Weight {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}

/// Tensor `name`, which must have `rows` rows of `cols` (ggml dims `[cols, rows]`).
fn load(gguf: &Gguf, file: &[u8], name: &str, rows: usize, cols: usize) -> Result<Weight, String> {
    let info = gguf.tensor(name).ok_or_else(|| format!("tensor {name:?} is missing"))?;
    let expected = [cols as u64, rows as u64];
    if info.dims != expected {
        return Err(format!(
            "tensor {name:?} has shape {:?}, the config says {expected:?}",
            info.dims
        ));
    }
    Ok(Weight::new(info.kind, rows, cols, gguf.tensor_data(file, info)))
}

/// Tensor `name`, a vector of `len`, as f32.
fn load_vector(gguf: &Gguf, file: &[u8], name: &str, len: usize) -> Result<Vec<f32>, String> {
    let info = gguf.tensor(name).ok_or_else(|| format!("tensor {name:?} is missing"))?;
    if info.dims != [len as u64] {
        return Err(format!("tensor {name:?} has shape {:?}, the config says [{len}]", info.dims));
    }
    let mut data = vec![0f32; len];
    dequantize(info.kind, gguf.tensor_data(file, info), &mut data);
    Ok(data)
}
