//! Matrix-vector products the way llama.cpp computes them, so the two agree closely: weights of
//! the 32-element block types stay quantized, the activation is quantized to 8 bits per block
//! (`Q8_0`, or `Q8_1` with its block sum for `Q4_1`), and each block's product is an integer sum
//! scaled once (`ggml_vec_dot_q4_1_q8_1` and kin), into eight fused lane accumulators of four
//! consecutive products each, as the AVX2 kernels keep them. Other types are dequantized at load
//! and multiplied in f32. Every row's reduction runs in one fixed order, whatever else is computed.

use super::numerics::hsum8;
use crate::gguf::{TensorType, dequantize, f16_to_f32, round_to_f16};

/// A weight matrix: `rows` rows of `cols`, `y[r] = sum_c w[r][c] * x[c]`.
#[derive(Clone, Debug)]
pub enum Weight {
    Dense {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
    /// Rows of `Q4_0`, `Q4_1` or `Q8_0` blocks, as stored in the file.
    Quantized {
        kind: TensorType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    },
}

impl Weight {
    /// Keeps `bytes` quantized when its type has an 8-bit activation path, else dequantizes.
    pub fn new(kind: TensorType, rows: usize, cols: usize, bytes: &[u8]) -> Weight {
        match kind {
            TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => {
                Weight::Quantized { kind, rows, cols, data: bytes.to_vec() }
            }
            _ => {
                let mut data = vec![0f32; rows * cols];
                dequantize(kind, bytes, &mut data);
                Weight::Dense { rows, cols, data }
            }
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Weight::Dense { rows, .. } | Weight::Quantized { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::Dense { cols, .. } | Weight::Quantized { cols, .. } => *cols,
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row(&self, r: usize) -> Vec<f32> {
        match self {
            Weight::Dense { cols, data, .. } => data[r * cols..(r + 1) * cols].to_vec(),
            Weight::Quantized { kind, cols, data, .. } => {
                let row_bytes = data.len() / self.rows();
                let mut out = vec![0f32; *cols];
                dequantize(*kind, &data[r * row_bytes..(r + 1) * row_bytes], &mut out);
                out
            }
        }
    }

    /// `self` applied to each of `xs`: the batched product. Threads split the weight's rows; each
    /// output element is the same dot product, in the same order, as `matvec` computes, so a row
    /// of the batch comes out bit-identical whatever else is in it.
    pub fn matmul(&self, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let rows = self.rows();
        let acts: Vec<Activation<'_>> = xs.iter().map(|x| self.activation(x)).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows.max(1));
        let per_thread = rows.div_ceil(threads);
        let mut columns: Vec<Vec<f32>> = Vec::with_capacity(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let acts = &acts;
                    scope.spawn(move || {
                        let range = t * per_thread..((t + 1) * per_thread).min(rows);
                        let mut out = Vec::with_capacity(range.len() * acts.len());
                        for r in range {
                            for act in acts {
                                out.push(self.row_dot(r, act));
                            }
                        }
                        out
                    })
                })
                .collect();
            for handle in handles {
                columns.push(handle.join().expect("a matmul thread panicked"));
            }
        });
        let mut out = vec![vec![0f32; rows]; xs.len()];
        let mut r = 0;
        for chunk in columns {
            for (i, value) in chunk.into_iter().enumerate() {
                out[i % xs.len()][r + i / xs.len()] = value;
            }
            r += per_thread;
        }
        out
    }

    fn activation<'a>(&self, x: &'a [f32]) -> Activation<'a> {
        match self {
            Weight::Dense { .. } => Activation::Dense(x),
            Weight::Quantized { .. } => Activation::Q8(Q8::quantize(x)),
        }
    }

    fn row_dot(&self, r: usize, act: &Activation<'_>) -> f32 {
        match (self, act) {
            (Weight::Dense { cols, data, .. }, Activation::Dense(x)) => {
                dot(&data[r * cols..(r + 1) * cols], x)
            }
            (Weight::Quantized { kind, rows, data, .. }, Activation::Q8(act)) => {
                let row_bytes = data.len() / rows;
                let row = &data[r * row_bytes..(r + 1) * row_bytes];
                match kind {
                    TensorType::Q4_1 => dot_q4_1(row, act),
                    TensorType::Q4_0 => dot_q4_0(row, act),
                    TensorType::Q8_0 => dot_q8_0(row, act),
                    other => unreachable!("{other:?} is kept dense"),
                }
            }
            _ => unreachable!("an activation prepared for another weight"),
        }
    }

    pub fn matvec(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols());
        let act = self.activation(x);
        (0..self.rows()).map(|r| self.row_dot(r, &act)).collect()
    }
}

/// An activation as a weight's product needs it.
enum Activation<'a> {
    Dense(&'a [f32]),
    Q8(Q8),
}

/// An activation quantized to 8 bits in blocks of 32: per block the scale `d` (rounded to half
/// precision, as stored), the half-precision `s = d * sum(q)` that `Q4_1`'s minimum needs, and
/// the values.
struct Q8 {
    d: Vec<f32>,
    s: Vec<f32>,
    q: Vec<i8>,
}

impl Q8 {
    /// `quantize_row_q8_1`: scale from the block's largest magnitude, values rounded to nearest
    /// (ties to even, as the AVX2 path does). The values are scaled by `127 / amax`, not by
    /// `1 / d`: the two differ in the last bit often enough to flip roundings, which moved our
    /// logits by up to 0.4 from llama.cpp's before this matched.
    fn quantize(x: &[f32]) -> Q8 {
        let blocks = x.len() / 32;
        let mut act = Q8 {
            d: Vec::with_capacity(blocks),
            s: Vec::with_capacity(blocks),
            q: Vec::with_capacity(x.len()),
        };
        for block in x.chunks_exact(32) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for &v in block {
                let q = (v * id).round_ties_even() as i8;
                sum += i32::from(q);
                act.q.push(q);
            }
            act.d.push(round_to_f16(d));
            act.s.push(round_to_f16(sum as f32 * d));
        }
        act
    }
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

fn dot_q4_1(row: &[u8], act: &Q8) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (b, block) in row.chunks_exact(20).enumerate() {
        let (d, m) = (half(block, 0), half(block, 2));
        summs = m.mul_add(act.s[b], summs);
        let lanes = nibble_lanes(block[4..20].try_into().expect("16 bytes"), act_block(act, b), 0);
        accumulate(&mut acc, d * act.d[b], &lanes);
    }
    hsum8(&acc) + summs
}

fn dot_q4_0(row: &[u8], act: &Q8) -> f32 {
    let mut acc = [0f32; 8];
    for (b, block) in row.chunks_exact(18).enumerate() {
        let d = half(block, 0);
        let lanes = nibble_lanes(block[2..18].try_into().expect("16 bytes"), act_block(act, b), 8);
        accumulate(&mut acc, d * act.d[b], &lanes);
    }
    hsum8(&acc)
}

fn dot_q8_0(row: &[u8], act: &Q8) -> f32 {
    let mut acc = [0f32; 8];
    for (b, block) in row.chunks_exact(34).enumerate() {
        let d = half(block, 0);
        let weights: &[u8; 32] = block[2..34].try_into().expect("32 bytes");
        let q = act_block(act, b);
        let mut lanes = [0i32; 8];
        for j in 0..32 {
            lanes[j / 4] += i32::from(weights[j] as i8) * i32::from(q[j]);
        }
        accumulate(&mut acc, d * act.d[b], &lanes);
    }
    hsum8(&acc)
}

fn act_block(act: &Q8, b: usize) -> &[i8; 32] {
    act.q[32 * b..32 * b + 32].try_into().expect("32 activations a block")
}

/// Lane `j` of eight: `acc[j] += scale * lanes[j]`, fused as one rounding.
fn accumulate(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]) {
    for j in 0..8 {
        acc[j] = scale.mul_add(lanes[j] as f32, acc[j]);
    }
}

/// The integer products of a block of 32 4-bit weights (low nibbles are elements 0 to 15, high
/// nibbles 16 to 31), each less `offset`, with 32 8-bit activations, summed in eight lanes of
/// four consecutive elements. Integer sums are exact, so the result does not depend on how the
/// compiler vectorizes it.
fn nibble_lanes(packed: &[u8; 16], q: &[i8; 32], offset: i32) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for j in 0..16 {
        lanes[j / 4] += (i32::from(packed[j] & 0x0f) - offset) * i32::from(q[j]);
        lanes[4 + j / 4] += (i32::from(packed[j] >> 4) - offset) * i32::from(q[j + 16]);
    }
    lanes
}

/// A dot product in a fixed order: eight partial sums, then combined the same way every time.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a_chunks, a_rest) = a.as_chunks::<8>();
    let (b_chunks, b_rest) = b.as_chunks::<8>();
    for (x, y) in a_chunks.iter().zip(b_chunks) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}
