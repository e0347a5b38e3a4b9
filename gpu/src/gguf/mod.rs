//! GGUF v3 files (llama.cpp's model format): header, metadata, tensor infos and the aligned data
//! section. Parsing checks every count, length, offset and size against the file before it is
//! trusted, so a truncated or hostile file gives an error naming what was wrong, never a panic or
//! an allocation the file could not back.
//!
//! Layout: `"GGUF"`, version `u32` (3), tensor count `u64`, metadata count `u64`, the metadata
//! key-value pairs, the tensor infos (name, dims, type, offset), padding to the alignment
//! (`general.alignment`, default 32), then the tensor data, each tensor at its offset from there.
//! All little-endian.

mod dequant;
mod parse;
mod types;
mod write;

pub use dequant::{bf16_to_f32, dequantize, f16_to_f32, f32_to_f16, round_to_f16};
pub(crate) use dequant::{five_bit_values, scale_min_k4};
pub use parse::{Gguf, GgufError, MetadataValue, TensorInfo};
pub use types::TensorType;
pub use write::GgufWriter;

#[cfg(test)]
mod tests;
