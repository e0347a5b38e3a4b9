//! Weights of the 32-element block types (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`) kept quantized,
//! and their products with 8-bit activations the way llama.cpp computes them: the activation is
//! quantized per block (`Q8_0`, or `Q8_1` with its block sum for `Q4_1` and `Q5_1`), each block's
//! product is an integer sum in eight lanes of four consecutive products, scaled once into eight
//! fused lane accumulators, and the lanes are reduced with `hsum8` (`ggml_vec_dot_q4_1_q8_1` and
//! kin). Except for a `Q4_0` matrix whose row count is a multiple of 8, which llama.cpp's x86 build
//! repacks eight rows together (`block_q4_0x8`) and multiplies with `gemv_q4_b32_8x8_q8_0_lut_avx`:
//! each block's products summed in integers, then one fused chain a row (`repacked_dots`).
//!
//! At load the half-precision block scales are widened to f32 (exactly) and stored apart from
//! the quants, so that a product reads each row as two plain arrays; the 5-bit types' values are
//! unpacked to a byte each (less 16 for `Q5_0`), so they multiply as `Q8_0`'s do.

use super::kernels;
use super::numerics::hsum8;
use crate::gguf::{TensorType, dequantize, f16_to_f32, f32_to_f16, five_bit_values, round_to_f16};

/// Rows of quantized blocks.
#[derive(Clone, Debug)]
pub struct BlockRows {
    kind: TensorType,
    rows: usize,
    cols: usize,
    /// Per block, `rows * cols / 32` of them.
    scales: Vec<f32>,
    /// Per block for `Q4_1` and `Q5_1`; empty otherwise.
    mins: Vec<f32>,
    /// Per block, 16 bytes of nibbles (`Q4_0`, `Q4_1`), or 32 bytes: signed (`Q8_0`, and
    /// `Q5_0`'s values less 16) or not (`Q5_1`'s values).
    quants: Vec<u8>,
}

impl BlockRows {
    /// Whether `kind` is kept quantized.
    pub fn holds(kind: TensorType) -> bool {
        matches!(
            kind,
            TensorType::Q4_0
                | TensorType::Q4_1
                | TensorType::Q5_0
                | TensorType::Q5_1
                | TensorType::Q8_0
        )
    }

    /// From ggml's block layout. `bytes` must be `rows * cols / 32` blocks of `kind`, which the
    /// loader checked.
    pub fn from_ggml(kind: TensorType, rows: usize, cols: usize, bytes: &[u8]) -> BlockRows {
        let blocks = rows * cols / 32;
        let mut out = BlockRows {
            kind,
            rows,
            cols,
            scales: Vec::with_capacity(blocks),
            mins: Vec::new(),
            quants: Vec::with_capacity(blocks * quant_bytes(kind)),
        };
        for block in bytes.chunks_exact(kind.block_bytes() as usize) {
            out.scales.push(half(block, 0));
            if has_mins(kind) {
                out.mins.push(half(block, 2));
            }
            match kind {
                TensorType::Q5_0 | TensorType::Q5_1 => {
                    // `Q5_0`'s values are centred on 16: less 16, they are signed bytes.
                    let offset = if kind == TensorType::Q5_0 { 16 } else { 0 };
                    let values = five_bit_values(kind, block);
                    out.quants.extend(values.map(|v| (v - offset) as i8 as u8));
                }
                _ => out.quants.extend_from_slice(&block[block.len() - quant_bytes(kind)..]),
            }
        }
        out
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn kind(&self) -> TensorType {
        self.kind
    }

    /// Every block, row after row: its scale and (`Q4_1`, `Q5_1`; else empty) minimum, the
    /// file's half precision values widened to f32 (so they narrow back exactly), and its quants
    /// (16 bytes of nibbles in ggml's order, element `j` low and `j + 16` high in byte `j`; or 32
    /// bytes, a value each: signed for `Q8_0` and `Q5_0` (less 16), unsigned for `Q5_1`).
    pub fn blocks(&self) -> (&[f32], &[f32], &[u8]) {
        (&self.scales, &self.mins, &self.quants)
    }

    /// Row `r` as f32 (an embedding lookup): the blocks rebuilt in ggml's layout (the scales
    /// came from half precision, so they narrow back exactly) and dequantized as the file's; the
    /// 5-bit types' values computed as their dequantizer computes them.
    pub fn row(&self, r: usize) -> Vec<f32> {
        let per_row = self.cols / 32;
        if matches!(self.kind, TensorType::Q5_0 | TensorType::Q5_1) {
            let blocks = r * per_row..(r + 1) * per_row;
            let quants = &self.quants[blocks.start * 32..blocks.end * 32];
            return quants
                .chunks_exact(32)
                .zip(blocks)
                .flat_map(|(q, b)| {
                    q.iter().map(move |&q| match self.kind {
                        TensorType::Q5_0 => f32::from(q as i8) * self.scales[b],
                        _ => f32::from(q) * self.scales[b] + self.mins[b],
                    })
                })
                .collect();
        }
        let quant_bytes = quant_bytes(self.kind);
        let mut bytes = Vec::with_capacity(per_row * self.kind.block_bytes() as usize);
        for b in r * per_row..(r + 1) * per_row {
            bytes.extend_from_slice(&f32_to_f16(self.scales[b]).to_le_bytes());
            if self.kind == TensorType::Q4_1 {
                bytes.extend_from_slice(&f32_to_f16(self.mins[b]).to_le_bytes());
            }
            bytes.extend_from_slice(&self.quants[b * quant_bytes..(b + 1) * quant_bytes]);
        }
        let mut out = vec![0f32; self.cols];
        dequantize(self.kind, &bytes, &mut out);
        out
    }

    /// Row `r` times the activation `act`.
    #[inline(always)]
    pub fn dot(&self, r: usize, act: &Q8) -> f32 {
        if self.repacked() {
            let (scales, _, quants) = self.row_parts(r);
            return repacked_dots(scales, quants, [act])[0];
        }
        let (scales, mins, quants) = self.row_parts(r);
        let (lanes, summs) = match self.kind {
            TensorType::Q8_0 | TensorType::Q5_0 => (q8_lanes(scales, quants, act), 0.0),
            TensorType::Q5_1 => (q8_lanes(scales, quants, act), min_sums(mins, act)),
            kind => q4_lanes(scales, mins, quants, act, kind == TensorType::Q4_0),
        };
        self.finish(&lanes, summs)
    }

    /// Row `r` times four activations: `dot` four times over, faster (the row is unpacked once).
    #[inline(always)]
    pub fn dot4(&self, r: usize, acts: [&Q8; 4]) -> [f32; 4] {
        if self.repacked() {
            let (scales, _, quants) = self.row_parts(r);
            return repacked_dots(scales, quants, acts);
        }
        #[cfg(target_arch = "x86_64")]
        if kernels::has_avx2_fma() {
            let (scales, mins, quants) = self.row_parts(r);
            let mut out = [0f32; 4];
            #[allow(
                unsafe_code,
                reason = "functions compiled for CPU features detected at run time"
            )]
            // SAFETY: the CPU has AVX2 and FMA, all that these are compiled for.
            match self.kind {
                TensorType::Q8_0 | TensorType::Q5_0 | TensorType::Q5_1 => {
                    let inputs = acts.map(|a| (a.d.as_slice(), a.q.as_slice()));
                    let lanes = unsafe { kernels::avx2::q8_lanes(scales, quants, inputs) };
                    for ((o, lanes), act) in out.iter_mut().zip(&lanes).zip(acts) {
                        *o = self.finish(lanes, min_sums(mins, act));
                    }
                }
                kind => {
                    let inputs = acts.map(|a| (a.d.as_slice(), a.s.as_slice(), a.q.as_slice()));
                    let centered = kind == TensorType::Q4_0;
                    let results =
                        unsafe { kernels::avx2::q4_lanes4(scales, mins, quants, inputs, centered) };
                    for (o, (lanes, summs)) in out.iter_mut().zip(&results) {
                        *o = self.finish(lanes, *summs);
                    }
                }
            }
            return out;
        }
        acts.map(|act| self.dot(r, act))
    }

    /// Rows `r0..r0 + 8` times `act`: `dot` of each, the same bits; for a repacked matrix with
    /// AVX2, the eight rows' chains side by side in one vector, as llama.cpp's gemv keeps them.
    #[inline(always)]
    pub fn dot8(&self, r0: usize, act: &Q8) -> [f32; 8] {
        #[cfg(target_arch = "x86_64")]
        if self.repacked() && kernels::has_avx2_fma() {
            let per_row = self.cols / 32;
            let blocks = r0 * per_row..(r0 + 8) * per_row;
            let quants = &self.quants[blocks.start * 16..blocks.end * 16];
            #[allow(
                unsafe_code,
                reason = "a function compiled for CPU features detected at run time"
            )]
            // SAFETY: the CPU has AVX2 and FMA, all that `q4_0_repacked8` is compiled for.
            return unsafe {
                kernels::avx2::q4_0_repacked8(&self.scales[blocks], quants, &act.d, &act.q)
            };
        }
        std::array::from_fn(|j| self.dot(r0 + j, act))
    }

    /// Whether llama.cpp multiplies this matrix repacked, eight rows together (the module's
    /// docs): then `dot8` takes eight rows a pass as it does.
    #[inline(always)]
    pub fn repacked(&self) -> bool {
        self.kind == TensorType::Q4_0 && self.rows.is_multiple_of(8)
    }

    /// Row `r`'s block scales, minimums (empty unless `Q4_1` or `Q5_1`) and quants.
    #[inline(always)]
    fn row_parts(&self, r: usize) -> (&[f32], &[f32], &[u8]) {
        let per_row = self.cols / 32;
        let blocks = r * per_row..(r + 1) * per_row;
        let quant_bytes = quant_bytes(self.kind);
        let quants = &self.quants[blocks.start * quant_bytes..blocks.end * quant_bytes];
        let mins = if self.mins.is_empty() { &[][..] } else { &self.mins[blocks.clone()] };
        (&self.scales[blocks], mins, quants)
    }

    /// The lanes reduced, plus for `Q4_1` and `Q5_1` the minimums' share (`summs`).
    #[inline(always)]
    fn finish(&self, lanes: &[f32; 8], summs: f32) -> f32 {
        if has_mins(self.kind) { hsum8(lanes) + summs } else { hsum8(lanes) }
    }
}

/// Whether blocks of `kind` carry a minimum.
fn has_mins(kind: TensorType) -> bool {
    matches!(kind, TensorType::Q4_1 | TensorType::Q5_1)
}

/// Quant bytes a block of `kind` keeps (the 5-bit types unpacked to a byte a value).
fn quant_bytes(kind: TensorType) -> usize {
    match kind {
        TensorType::Q4_0 | TensorType::Q4_1 => 16,
        TensorType::Q5_0 | TensorType::Q5_1 | TensorType::Q8_0 => 32,
        other => unreachable!("{other:?} is not kept in blocks"),
    }
}

/// `Q5_1`'s minimums times the activation's block sums, as `ggml_vec_dot_q5_1_q8_1`'s `summs`
/// (one fused step a block, in block order); zero without minimums.
#[inline(always)]
fn min_sums(mins: &[f32], act: &Q8) -> f32 {
    mins.iter().zip(&act.s).fold(0.0, |summs, (&m, &s)| m.mul_add(s, summs))
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// An activation quantized to 8 bits in blocks of 32: per block the scale `d` (rounded to half
/// precision, as stored), the half-precision `s = d * sum(q)` that `Q4_1`'s minimum needs, and
/// the values.
#[derive(Clone, Debug)]
pub struct Q8 {
    d: Vec<f32>,
    s: Vec<f32>,
    q: Vec<i8>,
}

impl Q8 {
    /// `quantize_row_q8_1`: scale from the block's largest magnitude, values rounded to nearest
    /// (ties to even, as the AVX2 path does). The values are scaled by `127 / amax`, not by
    /// `1 / d`: the two differ in the last bit often enough to flip roundings, which moved our
    /// logits by up to 0.4 from llama.cpp's before this matched.
    pub fn quantize(x: &[f32]) -> Q8 {
        // Compiled with the CPU's extensions where it has them, so rounding is an instruction.
        kernels::run(
            #[inline(always)]
            || Self::quantize_here(x),
        )
    }

    #[inline(always)]
    fn quantize_here(x: &[f32]) -> Q8 {
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

#[inline(always)]
fn q4_lanes(
    scales: &[f32],
    mins: &[f32],
    quants: &[u8],
    act: &Q8,
    centered: bool,
) -> ([f32; 8], f32) {
    #[cfg(target_arch = "x86_64")]
    if kernels::has_avx2_fma() {
        #[allow(
            unsafe_code,
            reason = "a function compiled for CPU features detected at run time"
        )]
        // SAFETY: the CPU has AVX2 and FMA, all that `q4_lanes` is compiled for.
        return unsafe {
            kernels::avx2::q4_lanes(scales, mins, quants, &act.d, &act.s, &act.q, centered)
        };
    }
    let offset = if centered { 8 } else { 0 };
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    let blocks = quants.chunks_exact(16).zip(act.q.chunks_exact(32));
    for (b, ((packed, q), (&d, &ad))) in blocks.zip(scales.iter().zip(&act.d)).enumerate() {
        if !mins.is_empty() {
            summs = mins[b].mul_add(act.s[b], summs);
        }
        let mut lanes = [0i32; 8];
        for j in 0..16 {
            lanes[j / 4] += (i32::from(packed[j] & 0x0f) - offset) * i32::from(q[j]);
            lanes[4 + j / 4] += (i32::from(packed[j] >> 4) - offset) * i32::from(q[j + 16]);
        }
        accumulate(&mut acc, d * ad, &lanes);
    }
    (acc, summs)
}

#[inline(always)]
fn q8_lanes(scales: &[f32], quants: &[u8], act: &Q8) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if kernels::has_avx2_fma() {
        #[allow(
            unsafe_code,
            reason = "a function compiled for CPU features detected at run time"
        )]
        // SAFETY: the CPU has AVX2 and FMA, all that `q8_lanes` is compiled for.
        return unsafe { kernels::avx2::q8_lanes(scales, quants, [(&act.d, &act.q)])[0] };
    }
    let mut acc = [0f32; 8];
    let blocks = quants.chunks_exact(32).zip(act.q.chunks_exact(32));
    for ((w, q), (&d, &ad)) in blocks.zip(scales.iter().zip(&act.d)) {
        let mut lanes = [0i32; 8];
        for j in 0..32 {
            lanes[j / 4] += i32::from(w[j] as i8) * i32::from(q[j]);
        }
        accumulate(&mut acc, d * ad, &lanes);
    }
    acc
}

/// A `Q4_0` row (its scales and quants) times each of `acts` as llama.cpp's repacked path
/// computes it: per block the integer sum of `(q - 8) * a`, then `acc = fma(sum, d * act_d,
/// acc)` in block order, one chain a row. Integer sums are exact, so the AVX2 kernel and the
/// loop below agree.
#[inline(always)]
fn repacked_dots<const N: usize>(scales: &[f32], quants: &[u8], acts: [&Q8; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if kernels::has_avx2_fma() {
        #[allow(
            unsafe_code,
            reason = "a function compiled for CPU features detected at run time"
        )]
        // SAFETY: the CPU has AVX2 and FMA, all that `q4_0_repacked` is compiled for.
        return unsafe {
            kernels::avx2::q4_0_repacked(
                scales,
                quants,
                acts.map(|a| (a.d.as_slice(), a.q.as_slice())),
            )
        };
    }
    let mut acc = [0f32; N];
    for (b, packed) in quants.chunks_exact(16).enumerate() {
        for (acc, act) in acc.iter_mut().zip(&acts) {
            let q = &act.q[32 * b..32 * b + 32];
            let mut sum = 0i32;
            for (j, &byte) in packed.iter().enumerate() {
                sum += (i32::from(byte & 0x0f) - 8) * i32::from(q[j]);
                sum += (i32::from(byte >> 4) - 8) * i32::from(q[j + 16]);
            }
            *acc = (sum as f32).mul_add(scales[b] * act.d[b], *acc);
        }
    }
    acc
}

/// Lane `j` of eight: `acc[j] += scale * lanes[j]`, fused as one rounding.
#[inline(always)]
fn accumulate(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]) {
    for j in 0..8 {
        acc[j] = scale.mul_add(lanes[j] as f32, acc[j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random blocks of every kept type, with extreme values included, through the portable and
    /// the detected path: the same bits, and close to the dequantized product.
    #[test]
    fn portable_and_detected_products_agree_to_the_bit() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let kinds = [
            TensorType::Q4_0,
            TensorType::Q4_1,
            TensorType::Q5_0,
            TensorType::Q5_1,
            TensorType::Q8_0,
        ];
        for kind in kinds {
            // 8 rows: Q4_0 takes llama.cpp's repacked path; 5: the lanes.
            for rows in [5, 8] {
                let cols = 256;
                let mut bytes = Vec::new();
                for _ in 0..rows * cols / 32 {
                    let scale = f32_to_f16((next() % 1000) as f32 / 1e4 + 1e-3).to_le_bytes();
                    bytes.extend_from_slice(&scale);
                    if has_mins(kind) {
                        bytes.extend_from_slice(&f32_to_f16(-0.05).to_le_bytes());
                    }
                    while bytes.len() % kind.block_bytes() as usize != 0 {
                        bytes.push(next() as u8);
                    }
                }
                let weights = BlockRows::from_ggml(kind, rows, cols, &bytes);
                let x: Vec<f32> =
                    (0..cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
                let act = Q8::quantize(&x);
                for r in 0..rows {
                    let (scales, mins, q) = weights.row_parts(r);
                    let both = || match kind {
                        TensorType::Q8_0 | TensorType::Q5_0 | TensorType::Q5_1 => {
                            (q8_lanes(scales, q, &act), min_sums(mins, &act))
                        }
                        _ => q4_lanes(scales, mins, q, &act, kind == TensorType::Q4_0),
                    };
                    let portable = kernels::force_portable(both);
                    let detected = both();
                    assert_eq!(
                        portable.0.map(f32::to_bits),
                        detected.0.map(f32::to_bits),
                        "{kind:?}"
                    );
                    assert_eq!(portable.1.to_bits(), detected.1.to_bits(), "{kind:?}");
                    // Against the f32 product: the activation's rounding moves each element by at
                    // most half a step (amax / 254 of its block) plus the half-precision scale's
                    // relative 2^-11, and that is all the error there may be.
                    let w = weights.row(r);
                    let exact: f32 = w.iter().zip(&x).map(|(w, x)| w * x).sum();
                    let bound: f32 = w
                        .chunks_exact(32)
                        .zip(x.chunks_exact(32))
                        .map(|(w, x)| {
                            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                            w.iter().map(|w| w.abs() * (amax / 254.0 + amax / 2048.0)).sum::<f32>()
                        })
                        .sum();
                    let ours = weights.dot(r, &act);
                    assert!((ours - exact).abs() <= bound * 1.01 + 1e-4, "{kind:?} {ours} {exact}");
                }
                // Four inputs at once give each one's product, bit for bit.
                let acts: Vec<Q8> = (0..4)
                    .map(|k| {
                        Q8::quantize(&x.iter().map(|v| v * (k as f32 - 1.5)).collect::<Vec<_>>())
                    })
                    .collect();
                for r in 0..rows {
                    let four = weights.dot4(r, [&acts[0], &acts[1], &acts[2], &acts[3]]);
                    let one_by_one: Vec<u32> =
                        acts.iter().map(|a| weights.dot(r, a).to_bits()).collect();
                    assert_eq!(four.map(f32::to_bits).to_vec(), one_by_one, "{kind:?} row {r}");
                }
                // The rebuilt row equals the file's dequantization.
                let mut direct = vec![0f32; rows * cols];
                dequantize(kind, &bytes, &mut direct);
                assert_eq!(weights.row(3), direct[3 * cols..4 * cols]);
                // Eight rows at once are each row alone.
                if rows == 8 {
                    let eight = weights.dot8(0, &acts[1]).map(f32::to_bits);
                    let alone: [u32; 8] =
                        std::array::from_fn(|r| weights.dot(r, &acts[1]).to_bits());
                    assert_eq!(eight, alone, "{kind:?}");
                }
                // The repacked path's AVX2 kernel and its loop agree.
                for r in 0..rows {
                    let acts = [&acts[0], &acts[1], &acts[2], &acts[3]];
                    let portable = kernels::force_portable(|| weights.dot4(r, acts));
                    assert_eq!(portable.map(f32::to_bits), weights.dot4(r, acts).map(f32::to_bits));
                }
            }
        }
    }
}
