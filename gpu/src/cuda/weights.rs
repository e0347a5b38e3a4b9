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
//!
//! With `LaunchOptions::block_weights`, a matrix of GGUF's block types (`Q4_0` to `Q8_0`, `Q4_K`
//! to `Q6_K`; a stack of them if all have one type) goes up in its blocks instead
//! (`DeviceBlocks`: prelude.cu's layout), and the kernels dequantize each value as the CPU's
//! dequantizer does: the same f32 values, read at 5 to 10 bits a weight.

use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaSlice, CudaStream, DriverError};

use crate::gguf::{TensorType, f16_to_f32, f32_to_f16};
use crate::llama::{KBlockRows, LlamaWeights, Weight};

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

/// A matrix's elements in their storage type: f32 values, the 16-bit patterns of f16 or bf16
/// ones, or GGUF blocks (`DeviceBlocks`'s arrays).
#[derive(Debug)]
pub enum MatrixData {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    Bf16(CudaSlice<u16>),
    Blocks { kind: BlockKind, quants: CudaSlice<u32>, scales: CudaSlice<u16> },
}

/// GGUF's block types the kernels read in their blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
    Q5_1,
    Q5K,
}

impl BlockKind {
    fn of(kind: TensorType) -> Option<BlockKind> {
        match kind {
            TensorType::Q4_0 => Some(BlockKind::Q4_0),
            TensorType::Q4_1 => Some(BlockKind::Q4_1),
            // `Q5_0`'s values less 16 are signed bytes under a half-precision scale: `Q8_0`'s
            // layout and formula (`BlockRows` keeps them so).
            TensorType::Q8_0 | TensorType::Q5_0 => Some(BlockKind::Q8_0),
            TensorType::Q4K => Some(BlockKind::Q4K),
            TensorType::Q6K => Some(BlockKind::Q6K),
            TensorType::Q5_1 => Some(BlockKind::Q5_1),
            TensorType::Q5K => Some(BlockKind::Q5K),
            _ => None,
        }
    }
}

/// Block-typed rows in the layout prelude.cu's `q4_0_blocks` and kin read: per chunk of 8
/// elements the quants, one 32-bit word of 4-bit ones (element `8c + i`'s nibble at bits `4i`:
/// `Q4_0`, `Q4_1`, `Q4_K`) or two of bytes (its 8 bytes in order: `Q8_0` and `Q5_0`'s less 16,
/// `Q6_K`'s less 32 as signed bytes, `Q5_1`'s and `Q5_K`'s unsigned); then the scales as 16-bit
/// words: per block of 32 one scale's half-precision bits (`Q4_1`, `Q5_1`: the scale and then the
/// minimum); for the K-quants the dequantizer's f32 products, which half precision does not
/// hold: `Q4_K`'s and `Q5_K`'s scale and minimum of each 32, `Q6_K`'s scale of each 16, each f32
/// as two words, low first. The scales are padded to
/// a multiple of 16 bytes, so that a kernel may round a row's span of them out to 16 bytes (an
/// L2 prefetch) and stay inside the allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBlocks {
    pub kind: BlockKind,
    pub quants: Vec<u32>,
    pub scales: Vec<u16>,
}

impl DeviceBlocks {
    /// `matrices`' rows one after another, if all are blocks of one type the kernels read.
    pub fn stack(matrices: &[&Weight]) -> Option<DeviceBlocks> {
        let kind_of = |w: &Weight| match w {
            Weight::Quantized(b) => Some(b.kind()),
            Weight::KQuantized(b) => Some(b.kind()),
            Weight::Dense { .. } => None,
        };
        let first = kind_of(matrices[0])?;
        let kind = BlockKind::of(first)?;
        if matrices.iter().any(|&m| kind_of(m) != Some(first)) {
            return None;
        }
        let mut out = DeviceBlocks { kind, quants: Vec::new(), scales: Vec::new() };
        for m in matrices {
            let m = match m {
                Weight::Quantized(b) => b,
                Weight::KQuantized(b) => {
                    out.push_kquant(b);
                    continue;
                }
                Weight::Dense { .. } => unreachable!("every matrix was found quantized"),
            };
            let (scales, mins, quants) = m.blocks();
            let quant_bytes = quants.len() / scales.len();
            for (b, q) in quants.chunks_exact(quant_bytes).enumerate() {
                // Exact: the scales were widened from these half-precision values.
                out.scales.push(f32_to_f16(scales[b]));
                if !mins.is_empty() {
                    out.scales.push(f32_to_f16(mins[b]));
                }
                match kind {
                    // A byte a value (`Q5_0`'s and `Q5_1`'s as `BlockRows` unpacked them).
                    BlockKind::Q8_0 | BlockKind::Q5_1 => out.quants.extend(
                        q.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
                    ),
                    BlockKind::Q4_0 | BlockKind::Q4_1 => {
                        // ggml's nibbles: element `j < 16` low in byte `j`, `j + 16` high.
                        let nibble =
                            |e: usize| u32::from(if e < 16 { q[e] & 15 } else { q[e - 16] >> 4 });
                        out.quants.extend(
                            (0..4).map(|c| (0..8).fold(0, |w, i| w | nibble(8 * c + i) << (4 * i))),
                        );
                    }
                    BlockKind::Q4K | BlockKind::Q5K | BlockKind::Q6K => {
                        unreachable!("a K-quant in BlockRows")
                    }
                }
            }
        }
        out.scales.resize(out.scales.len().next_multiple_of(8), 0);
        Some(out)
    }

    /// A K-quant matrix's blocks, from the values the CPU's dequantizer computes them from.
    fn push_kquant(&mut self, m: &KBlockRows) {
        let push_f32 = |scales: &mut Vec<u16>, v: f32| {
            let bits = v.to_bits();
            scales.extend([bits as u16, (bits >> 16) as u16]);
        };
        for b in 0..m.rows() * m.cols() / 256 {
            let g = m.group_values(b);
            if matches!(self.kind, BlockKind::Q4K | BlockKind::Q5K) {
                for (&scale, &min) in g.scales[..8].iter().zip(&g.mins) {
                    push_f32(&mut self.scales, scale);
                    push_f32(&mut self.scales, min);
                }
            } else {
                for &scale in &g.scales {
                    push_f32(&mut self.scales, scale);
                }
            }
            match self.kind {
                BlockKind::Q4K => {
                    self.quants.extend(g.q.chunks_exact(8).map(|c| {
                        c.iter().enumerate().fold(0u32, |w, (i, &q)| w | (q as u32 & 15) << (4 * i))
                    }));
                }
                // A byte a value: `Q5_K`'s 0 to 31, `Q6_K`'s -32 to 31.
                _ => {
                    self.quants.extend(
                        g.q.as_chunks::<4>()
                            .0
                            .iter()
                            .map(|w| u32::from_le_bytes(w.map(|q| q as u8))),
                    );
                }
            }
        }
    }
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
    /// Whether block-typed matrices went up in their blocks.
    pub blocks: bool,
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
        Weight::Quantized(_) | Weight::KQuantized(_) => {
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
    /// Block-typed matrices go up in their blocks (`LaunchOptions::block_weights`).
    blocks: bool,
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
    /// their blocks if `blocks` and they are all blocks of one type the kernels read, else in
    /// the narrowest type that holds all of them exactly.
    fn stacked(&mut self, weights: &[&Weight]) -> Result<DeviceMatrix, DriverError> {
        let (rows, cols) = (weights.iter().map(|w| w.rows()).sum(), weights[0].cols());
        if let Some(blocks) = self.blocks.then(|| DeviceBlocks::stack(weights)).flatten() {
            self.bytes += blocks.quants.len() * 4 + blocks.scales.len() * 2;
            let data = MatrixData::Blocks {
                kind: blocks.kind,
                quants: self.stream.clone_htod(&blocks.quants)?,
                scales: self.stream.clone_htod(&blocks.scales)?,
            };
            return Ok(DeviceMatrix { rows, cols, data });
        }
        let values: std::borrow::Cow<'_, [f32]> = match weights {
            [one] => dense_values(one),
            _ => weights.iter().flat_map(|w| dense_values(w).into_owned()).collect(),
        };
        let storage = storage_for(&values);
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

/// What to add to `e` when it says device memory ran out and `weights` has matrices of a type
/// the kernels read in blocks that went up as f32 (not `blocks`): in their blocks they take 3 to
/// 7 times less.
pub fn out_of_memory_hint(weights: &LlamaWeights, blocks: bool, e: &DriverError) -> &'static str {
    let matrices =
        weights.layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
    let mut matrices = matrices.chain([&weights.embed]).chain(&weights.output);
    // Whether any matrix is of a type the kernels read in blocks.
    let in_blocks = |w: &Weight| match w {
        Weight::Quantized(b) => BlockKind::of(b.kind()).is_some(),
        Weight::KQuantized(b) => BlockKind::of(b.kind()).is_some(),
        Weight::Dense { .. } => false,
    };
    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY && !blocks && matrices.any(in_blocks) {
        "; the model's quantized matrices went up as f32, and `--cuda-launch block-weights` \
         keeps them in their blocks, 3 to 7 times smaller"
    } else {
        ""
    }
}

/// Uploads every tensor of `weights` on `stream`; with `blocks`, block-typed matrices in their
/// blocks.
pub fn upload(
    weights: &LlamaWeights,
    stream: &Arc<CudaStream>,
    blocks: bool,
) -> Result<DeviceWeights, String> {
    let err = |what: &str| {
        let what = what.to_owned();
        move |e: DriverError| {
            format!("CUDA: uploading {what}: {e}{}", out_of_memory_hint(weights, blocks, &e))
        }
    };
    let mut up = Uploader { stream, bytes: 0, blocks };
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
    Ok(DeviceWeights {
        embed,
        layers,
        output_norm,
        output,
        rope_freq_factors,
        bytes: up.bytes,
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::BlockRows;

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

    /// Element `i` of `blocks` as prelude.cu's `load1` reads it.
    fn element(blocks: &DeviceBlocks, i: usize) -> f32 {
        let nibble = (blocks.quants[i / 8] >> (4 * (i % 8))) & 15;
        match blocks.kind {
            BlockKind::Q4_0 => (nibble as i32 - 8) as f32 * f16_to_f32(blocks.scales[i / 32]),
            BlockKind::Q4_1 => {
                let (d, m) = (blocks.scales[2 * (i / 32)], blocks.scales[2 * (i / 32) + 1]);
                nibble as f32 * f16_to_f32(d) + f16_to_f32(m)
            }
            BlockKind::Q8_0 => {
                let word = blocks.quants[2 * (i / 8) + (i % 8) / 4];
                f32::from((word >> (8 * (i % 4))) as u8 as i8) * f16_to_f32(blocks.scales[i / 32])
            }
            BlockKind::Q4K => {
                let (d1, m1) =
                    (scale_word(blocks, 2 * (i / 32)), scale_word(blocks, 2 * (i / 32) + 1));
                d1 * nibble as f32 - m1
            }
            BlockKind::Q6K => {
                let word = blocks.quants[2 * (i / 8) + (i % 8) / 4];
                scale_word(blocks, i / 16) * f32::from((word >> (8 * (i % 4))) as u8 as i8)
            }
            BlockKind::Q5_1 => {
                let byte = (blocks.quants[2 * (i / 8) + (i % 8) / 4] >> (8 * (i % 4))) as u8;
                let (d, m) = (blocks.scales[2 * (i / 32)], blocks.scales[2 * (i / 32) + 1]);
                f32::from(byte) * f16_to_f32(d) + f16_to_f32(m)
            }
            BlockKind::Q5K => {
                let byte = (blocks.quants[2 * (i / 8) + (i % 8) / 4] >> (8 * (i % 4))) as u8;
                let (d1, m1) =
                    (scale_word(blocks, 2 * (i / 32)), scale_word(blocks, 2 * (i / 32) + 1));
                d1 * f32::from(byte) - m1
            }
        }
    }

    /// The `n`th f32 of a K-quant stack's scales (two 16-bit words, low first).
    fn scale_word(blocks: &DeviceBlocks, n: usize) -> f32 {
        f32::from_bits(u32::from(blocks.scales[2 * n]) | u32::from(blocks.scales[2 * n + 1]) << 16)
    }

    /// `rows` rows of `cols` random blocks of `kind` in ggml's layout, scales and minimums of
    /// either sign over a few binades.
    fn random_blocks(kind: TensorType, rows: usize, cols: usize, seed: u64) -> BlockRows {
        let mut state = seed;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            let half = |next: &mut dyn FnMut() -> u64| {
                let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                f32_to_f16(v / (1 << (next() % 6)) as f32).to_le_bytes()
            };
            bytes.extend(half(&mut next));
            if kind == TensorType::Q4_1 {
                bytes.extend(half(&mut next));
            }
            while bytes.len() % kind.block_bytes() as usize != 0 {
                bytes.push(next() as u8);
            }
        }
        BlockRows::from_ggml(kind, rows, cols, &bytes)
    }

    #[test]
    fn block_rows_go_up_in_the_layout_the_kernels_read_with_the_cpu_s_values() {
        let kinds = [
            TensorType::Q4_0,
            TensorType::Q4_1,
            TensorType::Q5_0,
            TensorType::Q5_1,
            TensorType::Q8_0,
        ];
        for kind in kinds {
            let (a, b) = (random_blocks(kind, 3, 64, 1), random_blocks(kind, 2, 64, 2));
            let (a, b) = (Weight::Quantized(a), Weight::Quantized(b));
            let stacked = DeviceBlocks::stack(&[&a, &b]).unwrap();
            let quant_words =
                if matches!(kind, TensorType::Q4_0 | TensorType::Q4_1) { 4 } else { 8 };
            assert_eq!(stacked.quants.len(), 5 * 2 * quant_words, "{kind:?}");
            assert_eq!(stacked.scales.len() % 8, 0, "{kind:?}: padded to 16 bytes");
            let rows = (0..3).map(|r| a.row(r)).chain((0..2).map(|r| b.row(r)));
            for (r, row) in rows.enumerate() {
                for (k, &v) in row.iter().enumerate() {
                    let got = element(&stacked, r * 64 + k);
                    assert_eq!(got.to_bits(), v.to_bits(), "{kind:?} row {r} element {k}");
                }
            }
        }
        let mixed = [
            &Weight::Quantized(random_blocks(TensorType::Q4_1, 1, 32, 3)),
            &Weight::Quantized(random_blocks(TensorType::Q8_0, 1, 32, 4)),
        ];
        assert_eq!(DeviceBlocks::stack(&mixed), None, "one type a stack");
    }

    /// The same for the K-quants, whose scales go up as the dequantizer's f32 products.
    #[test]
    fn kquant_rows_go_up_in_the_layout_the_kernels_read_with_the_cpu_s_values() {
        let file = crate::llama::random_kquant_blocks;
        for kind in [TensorType::Q4K, TensorType::Q5K, TensorType::Q6K] {
            let a = Weight::KQuantized(KBlockRows::from_ggml(kind, 3, 512, &file(kind, 6, 1)));
            let b = Weight::KQuantized(KBlockRows::from_ggml(kind, 2, 512, &file(kind, 4, 2)));
            let stacked = DeviceBlocks::stack(&[&a, &b]).unwrap();
            let words_per_block = if kind == TensorType::Q4K { 32 } else { 64 };
            assert_eq!(stacked.quants.len(), 5 * 2 * words_per_block, "{kind:?}");
            assert_eq!(stacked.scales.len() % 8, 0, "{kind:?}: padded to 16 bytes");
            let rows = (0..3).map(|r| a.row(r)).chain((0..2).map(|r| b.row(r)));
            for (r, row) in rows.enumerate() {
                for (k, &v) in row.iter().enumerate() {
                    let got = element(&stacked, r * 512 + k);
                    assert_eq!(got.to_bits(), v.to_bits(), "{kind:?} row {r} element {k}");
                }
            }
        }
        let q4k = Weight::KQuantized(KBlockRows::from_ggml(
            TensorType::Q4K,
            1,
            256,
            &file(TensorType::Q4K, 1, 3),
        ));
        let q6k = Weight::KQuantized(KBlockRows::from_ggml(
            TensorType::Q6K,
            1,
            256,
            &file(TensorType::Q6K, 1, 4),
        ));
        assert_eq!(DeviceBlocks::stack(&[&q4k, &q6k]), None, "one type a stack");
    }
}
