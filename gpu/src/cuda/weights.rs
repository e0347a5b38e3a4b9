//! The model's tensors in device memory, uploaded once.
//!
//! Each matrix is stored in the narrowest of f16, bf16 and f32 that holds every one of its
//! values exactly, as the CPU backend holds them: an f16 or bf16 checkpoint stays 2 bytes a
//! weight (the bandwidth the decode roofline assumes), and anything else (f32 tensors, and the
//! quantized GGUF types, dequantized by the CPU backend's own `dequantize` at load) goes up as
//! f32. So the device multiplies exactly the weights the CPU multiplies; only the order and the
//! activations' precision differ (the CPU's quantized path also rounds activations to 8 bits,
//! which this backend does not: its logits differ from the CPU's within rounding, see
//! `tests/cuda_device.rs`). Norm weights and biases are f32.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError};

use crate::gguf::{f16_to_f32, f32_to_f16};
use crate::llama::{LlamaWeights, Weight};

/// How a matrix is stored on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    F16,
    Bf16,
}

/// A weight matrix on the device, `rows` rows of `cols`, row-major.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

/// A matrix's elements in their storage type: f32 values, or the 16-bit patterns of f16 or
/// bf16 ones.
#[derive(Debug)]
pub enum MatrixData {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    Bf16(CudaSlice<u16>),
}

#[derive(Debug)]
pub struct DeviceLayer {
    pub attn_norm: CudaSlice<f32>,
    /// The Q, K and V matrices stacked, in that order: one product computes all three.
    pub qkv: DeviceMatrix,
    /// The Q, K and V biases (Qwen2), one vector in the same order.
    pub qkv_bias: Option<CudaSlice<f32>>,
    pub o: DeviceMatrix,
    pub ffn_norm: CudaSlice<f32>,
    /// The gate matrix's rows, then the up matrix's: one product with SwiGLU at its end.
    pub gate_up: DeviceMatrix,
    pub down: DeviceMatrix,
}

#[derive(Debug)]
pub struct DeviceWeights {
    pub embed: DeviceMatrix,
    pub layers: Vec<DeviceLayer>,
    pub output_norm: CudaSlice<f32>,
    /// `None` when tied to the embedding.
    pub output: Option<DeviceMatrix>,
    /// Llama 3 RoPE frequency factors, one per rotary pair.
    pub rope_freq_factors: Option<CudaSlice<f32>>,
    /// Device memory the weights take.
    pub bytes: usize,
}

impl DeviceWeights {
    pub fn output(&self) -> &DeviceMatrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }
}

/// The narrowest storage that holds every value exactly.
pub fn storage_for(values: &[f32]) -> Storage {
    if values.iter().all(|&v| f16_to_f32(f32_to_f16(v)).to_bits() == v.to_bits() || v.is_nan()) {
        Storage::F16
    } else if values.iter().all(|&v| v.to_bits() & 0xffff == 0) {
        Storage::Bf16
    } else {
        Storage::F32
    }
}

/// `values` as the 16-bit patterns of `storage` (F16 or Bf16), exact by `storage_for`.
pub fn narrow(values: &[f32], storage: Storage) -> Vec<u16> {
    match storage {
        Storage::F16 => values.iter().map(|&v| f32_to_f16(v)).collect(),
        _ => values.iter().map(|&v| (v.to_bits() >> 16) as u16).collect(),
    }
}

/// The matrix's values in f32, row-major: the dense data as it is, quantized rows through the
/// CPU backend's dequantizer.
fn dense_values(weight: &Weight) -> std::borrow::Cow<'_, [f32]> {
    match weight {
        Weight::Dense { data, .. } => std::borrow::Cow::Borrowed(data),
        Weight::Quantized(_) => {
            let mut data = Vec::with_capacity(weight.rows() * weight.cols());
            for r in 0..weight.rows() {
                data.extend(weight.row(r));
            }
            std::borrow::Cow::Owned(data)
        }
    }
}

struct Uploader<'a> {
    stream: &'a Arc<CudaStream>,
    bytes: usize,
}

impl Uploader<'_> {
    fn vector(&mut self, values: &[f32]) -> Result<CudaSlice<f32>, DriverError> {
        self.bytes += values.len() * 4;
        self.stream.clone_htod(values)
    }

    fn matrix(&mut self, weight: &Weight) -> Result<DeviceMatrix, DriverError> {
        self.stacked(&[weight])
    }

    /// `weights`' rows one after another as one matrix (they have the same columns), stored in
    /// the narrowest type that holds all of them exactly.
    fn stacked(&mut self, weights: &[&Weight]) -> Result<DeviceMatrix, DriverError> {
        let values: std::borrow::Cow<'_, [f32]> = match weights {
            [one] => dense_values(one),
            _ => weights.iter().flat_map(|w| dense_values(w).into_owned()).collect(),
        };
        let storage = storage_for(&values);
        let (rows, cols) = (weights.iter().map(|w| w.rows()).sum(), weights[0].cols());
        let data = match storage {
            Storage::F32 => MatrixData::F32(self.vector(&values)?),
            Storage::F16 | Storage::Bf16 => {
                self.bytes += values.len() * 2;
                let bits = self.stream.clone_htod(&narrow(&values, storage))?;
                match storage {
                    Storage::F16 => MatrixData::F16(bits),
                    _ => MatrixData::Bf16(bits),
                }
            }
        };
        Ok(DeviceMatrix { rows, cols, data })
    }
}

/// Uploads every tensor of `weights` on `stream`.
pub fn upload(weights: &LlamaWeights, stream: &Arc<CudaStream>) -> Result<DeviceWeights, String> {
    fn err(what: &str) -> impl Fn(DriverError) -> String + '_ {
        move |e| format!("CUDA: uploading {what}: {e}")
    }
    let mut up = Uploader { stream, bytes: 0 };
    let mut layers = Vec::with_capacity(weights.layers.len());
    for (i, l) in weights.layers.iter().enumerate() {
        let what = format!("layer {i}");
        let e = err(&what);
        let qkv_bias = match &l.qkv_bias {
            None => None,
            Some([q, k, v]) => Some(up.vector(&[&q[..], k, v].concat()).map_err(&e)?),
        };
        layers.push(DeviceLayer {
            attn_norm: up.vector(&l.attn_norm).map_err(&e)?,
            qkv: up.stacked(&[&l.q, &l.k, &l.v]).map_err(&e)?,
            qkv_bias,
            o: up.matrix(&l.o).map_err(&e)?,
            ffn_norm: up.vector(&l.ffn_norm).map_err(&e)?,
            gate_up: up.stacked(&[&l.gate, &l.up]).map_err(&e)?,
            down: up.matrix(&l.down).map_err(&e)?,
        });
    }
    let embed = up.matrix(&weights.embed).map_err(err("the embedding"))?;
    let output = match &weights.output {
        Some(w) => Some(up.matrix(w).map_err(err("the output projection"))?),
        None => None,
    };
    let output_norm = up.vector(&weights.output_norm).map_err(err("the output norm"))?;
    let rope_freq_factors = match &weights.config.rope_freq_factors {
        Some(f) => Some(up.vector(f).map_err(err("the RoPE factors"))?),
        None => None,
    };
    Ok(DeviceWeights { embed, layers, output_norm, output, rope_freq_factors, bytes: up.bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_the_narrowest_that_holds_every_value_exactly() {
        assert_eq!(storage_for(&[0.5, -2.0, 65504.0, 1.0 / 1024.0]), Storage::F16);
        // 1e-8 is below f16's range but a bf16 pattern if its low bits are zero.
        let tiny = f32::from_bits(1e-8f32.to_bits() & 0xffff_0000);
        assert_eq!(storage_for(&[0.5, tiny]), Storage::Bf16);
        assert_eq!(storage_for(&[0.5, 0.1]), Storage::F32, "0.1 is neither");
        let huge = f32::from_bits(1e30f32.to_bits() & 0xffff_0000);
        assert_eq!(storage_for(&[huge]), Storage::Bf16, "past f16's range");
        let back: Vec<f32> =
            narrow(&[0.5, -3.25], Storage::F16).into_iter().map(f16_to_f32).collect();
        assert_eq!(back, [0.5, -3.25]);
        let bf = narrow(&[tiny], Storage::Bf16);
        assert_eq!(f32::from_bits(u32::from(bf[0]) << 16), tiny);
    }
}
