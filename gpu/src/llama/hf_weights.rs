//! Weights from a Hugging Face model directory: `model.safetensors`, or the shards that
//! `model.safetensors.index.json` maps tensor names to. Tensors of F32, F16 and BF16 are widened
//! to f32. Q and K are stored as transformers uses them (rotate-half RoPE), so no permutation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::matmul::Weight;
use super::weights::{LoadError, TensorNames, TensorSource, widen};
use super::{LlamaConfig, LlamaWeights};
use crate::gguf::TensorType;

/// Loads `dir/config.json` and the weights beside it.
pub fn load_hf_dir(dir: &Path) -> Result<LlamaWeights, LoadError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| LoadError::new(&config_path, e.to_string()))?;
    let config =
        LlamaConfig::from_hf_json(&text).map_err(|what| LoadError::new(&config_path, what))?;
    let shards = shard_files(dir)?;
    let mut bytes = Vec::with_capacity(shards.len());
    for path in &shards {
        bytes.push(std::fs::read(path).map_err(|e| LoadError::new(path, e.to_string()))?);
    }
    let mut parsed = Vec::with_capacity(shards.len());
    for (path, data) in shards.iter().zip(&bytes) {
        let tensors = SafeTensors::deserialize(data)
            .map_err(|e| LoadError::new(path, format!("not a safetensors file: {e}")))?;
        parsed.push(tensors);
    }
    let mut by_name = BTreeMap::new();
    for (shard, tensors) in parsed.iter().enumerate() {
        for name in tensors.names() {
            by_name.insert(name.to_owned(), shard);
        }
    }
    let source = Shards { paths: &shards, tensors: &parsed, by_name };
    LlamaWeights::from_source(config, &source, TensorNames::HuggingFace)
}

/// `model.safetensors`, or every shard the index names (each once, in name order).
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).map_err(|e| {
        LoadError::new(dir, format!("neither model.safetensors nor a readable index: {e}"))
    })?;
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let index: Index =
        serde_json::from_str(&text).map_err(|e| LoadError::new(&index_path, e.to_string()))?;
    let mut files: Vec<&String> = index.weight_map.values().collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|file| {
            // A shard is a file beside the index, never a path elsewhere.
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(LoadError::new(
                    &index_path,
                    format!("shard {file:?} is not a plain file name"),
                ));
            }
            Ok(dir.join(file))
        })
        .collect()
}

struct Shards<'a> {
    paths: &'a [PathBuf],
    tensors: &'a [SafeTensors<'a>],
    by_name: BTreeMap<String, usize>,
}

impl Shards<'_> {
    /// The tensor's element type and bytes, checked to have `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<(TensorType, &[u8]), LoadError> {
        let shard = *self.by_name.get(name).ok_or_else(|| {
            let file = self.paths.first().map_or(Path::new("."), |p| p.as_path());
            LoadError::new(file, format!("tensor {name:?} is missing"))
        })?;
        let path = &self.paths[shard];
        let view = self.tensors[shard]
            .tensor(name)
            .map_err(|e| LoadError::new(path, format!("tensor {name:?}: {e}")))?;
        if view.shape() != shape {
            return Err(LoadError::new(
                path,
                format!("tensor {name:?} has shape {:?}, the config says {shape:?}", view.shape()),
            ));
        }
        let kind = match view.dtype() {
            Dtype::F32 => TensorType::F32,
            Dtype::F16 => TensorType::F16,
            Dtype::BF16 => TensorType::BF16,
            other => {
                return Err(LoadError::new(
                    path,
                    format!("tensor {name:?} is {other:?}; F32, F16 and BF16 are supported"),
                ));
            }
        };
        Ok((kind, view.data()))
    }
}

impl TensorSource for Shards<'_> {
    fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Weight, LoadError> {
        let (kind, bytes) = self.get(name, &[rows, cols])?;
        Ok(Weight::new(kind, rows, cols, bytes))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let (kind, bytes) = self.get(name, &[len])?;
        Ok(widen(kind, bytes, len))
    }
}
