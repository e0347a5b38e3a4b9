//! A Llama-family model's weights, dequantized to f32 at load.
//!
//! Dequantizing at load is the simple, exact starting point (135M parameters take 540 MB as
//! f32); the benchmark against llama.cpp decides whether rows stay quantized.

use std::fmt;
use std::path::Path;

use super::LlamaConfig;
use crate::gguf::{Gguf, dequantize};

/// A matrix of `rows` rows of `cols`, row-major: `y[r] = sum_c w[r][c] * x[c]`.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub ffn_norm: Vec<f32>,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

#[derive(Clone, Debug)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    pub embed: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output projection; the embedding when tied (SmolLM2).
    pub output: Option<Matrix>,
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
        let vector = |name: &str, len: usize| load(gguf, file, name, 1, len).map(|m| m.data);
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

    pub fn output(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}

/// Dequantizes tensor `name`, which must have `rows` rows of `cols` (ggml dims `[cols, rows]`).
fn load(gguf: &Gguf, file: &[u8], name: &str, rows: usize, cols: usize) -> Result<Matrix, String> {
    let info = gguf.tensor(name).ok_or_else(|| format!("tensor {name:?} is missing"))?;
    let expected: &[u64] = if rows == 1 { &[cols as u64] } else { &[cols as u64, rows as u64] };
    if info.dims != expected {
        return Err(format!(
            "tensor {name:?} has shape {:?}, the config says {expected:?}",
            info.dims
        ));
    }
    let mut data = vec![0f32; rows * cols];
    dequantize(info.kind, gguf.tensor_data(file, info), &mut data);
    Ok(Matrix { rows, cols, data })
}
