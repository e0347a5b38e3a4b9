//! Weights of the 256-element K-quant types (`Q4_K`, `Q5_K`, `Q6_K`: most GGUF files in the
//! wild) kept in their blocks, and their products with 8-bit activations the way llama.cpp's x86
//! CPU backend computes them, so that a K-quant model's logits are llama.cpp's to the bit:
//!
//! - The activation is quantized per 256 values to `Q8_K` (`quantize_row_q8_K_ref`): an f32 scale,
//!   256 signed bytes and their sums (ggml keeps each 16's; the K types use them in pairs).
//! - A block's integer products are exact, so only the floating-point steps must follow
//!   llama.cpp, and they differ by path. `Q5_K` and `Q6_K` (`ggml_vec_dot_q5_K_q8_K`,
//!   `ggml_vec_dot_q6_K_q8_K`) and a `Q4_K` matrix whose row count is not a multiple of 8
//!   (`ggml_vec_dot_q4_K_q8_K`) sum each block into eight integer lanes (element `e` in lane
//!   `(e % 32) / 4`), scale them into eight fused lane accumulators and reduce them with `hsum8`;
//!   `Q4_K` adds its minimums' share in four lanes, `Q5_K` in one chain of integer sums. Every
//!   other `Q4_K` matrix llama.cpp repacks eight rows together (`block_q4_Kx8`) and multiplies
//!   with `ggml_gemv_q4_K_8x8_q8_K`: one fused accumulator a row for the scaled sums and one for
//!   the minimums, subtracted at the end.
//!
//! The quants are kept as the file has them and each block's scales as the products read them
//! (4.75, 5.75 and 6.75 bits a weight; the file's 4.5, 5.5 and 6.56), unpacked one block at a
//! time in the product, which serves every input of a batch before the next block.

use super::kernels;
use super::numerics::hsum8;
use crate::gguf::{TensorType, dequantize, f16_to_f32, f32_to_f16, scale_min_k4};

/// Elements a K-quant block holds.
const QK: usize = 256;

/// Rows of `Q4_K` or `Q6_K` blocks: each block's quants as ggml lays them out, and its scales
/// read once at load (`Header`), so a product does not unpack 6-bit scales and convert half
/// precision in every block of every row it reads.
#[derive(Clone, Debug)]
pub struct KBlockRows {
    kind: TensorType,
    rows: usize,
    cols: usize,
    /// Per block: `Q4_K`'s 128 bytes of nibbles, or `Q6_K`'s 128 bytes of low nibbles and 64 of
    /// high bit pairs.
    quants: Vec<u8>,
    heads: Vec<Header>,
}

/// A block's scales as the products read them: 24 bytes (`Q4_K`'s file header is 16, `Q6_K`'s
/// 18).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Header {
    /// `Q4_K`: the 6-bit scale of each 32 elements, then the 6-bit minimum of each. `Q6_K`: the
    /// signed scale of each 16.
    pub scales: [i8; 16],
    /// The block's scale (and `Q4_K`'s scale of minimums), widened from half precision.
    pub d: f32,
    pub dmin: f32,
}

impl KBlockRows {
    /// Whether `kind` is a K-quant type kept in its blocks.
    pub fn holds(kind: TensorType) -> bool {
        matches!(kind, TensorType::Q4K | TensorType::Q5K | TensorType::Q6K)
    }

    /// `bytes` must be `rows * cols / 256` blocks of `kind`, which the loader checked.
    pub fn from_ggml(kind: TensorType, rows: usize, cols: usize, bytes: &[u8]) -> KBlockRows {
        assert!(Self::holds(kind), "{kind:?} is not a K-quant type");
        assert_eq!(cols % QK, 0, "{kind:?} rows are whole blocks");
        let block_bytes = kind.block_bytes() as usize;
        assert_eq!(bytes.len(), rows * cols / QK * block_bytes);
        let blocks = bytes.len() / block_bytes;
        let mut out = KBlockRows {
            kind,
            rows,
            cols,
            quants: Vec::with_capacity(blocks * quant_bytes(kind)),
            heads: Vec::with_capacity(blocks),
        };
        for block in bytes.chunks_exact(block_bytes) {
            let half = |at: usize| f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]));
            let mut head = Header::default();
            match kind {
                TensorType::Q4K | TensorType::Q5K => {
                    (head.d, head.dmin) = (half(0), half(2));
                    for j in 0..8 {
                        let (sc, m) = scale_min_k4(j, &block[4..16]);
                        (head.scales[j], head.scales[8 + j]) = (sc as i8, m as i8);
                    }
                    out.quants.extend_from_slice(&block[16..]);
                }
                _ => {
                    head.d = half(208);
                    for (s, &b) in head.scales.iter_mut().zip(&block[192..208]) {
                        *s = b as i8;
                    }
                    out.quants.extend_from_slice(&block[0..192]);
                }
            }
            out.heads.push(head);
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

    /// Row `r`'s block headers and quants.
    #[inline(always)]
    fn row_parts(&self, r: usize) -> (&[Header], &[u8]) {
        let per_row = self.cols / QK;
        let q = quant_bytes(self.kind);
        (
            &self.heads[r * per_row..(r + 1) * per_row],
            &self.quants[r * per_row * q..(r + 1) * per_row * q],
        )
    }

    /// Row `r` as f32 (an embedding lookup): its blocks rebuilt in ggml's layout (the scales
    /// came from half precision and 6-bit fields, so they go back exactly) and dequantized as
    /// the file's.
    pub fn row(&self, r: usize) -> Vec<f32> {
        let (heads, quants) = self.row_parts(r);
        let mut bytes = Vec::with_capacity(heads.len() * self.kind.block_bytes() as usize);
        for (head, q) in heads.iter().zip(quants.chunks_exact(quant_bytes(self.kind))) {
            match self.kind {
                TensorType::Q4K | TensorType::Q5K => {
                    bytes.extend_from_slice(&f32_to_f16(head.d).to_le_bytes());
                    bytes.extend_from_slice(&f32_to_f16(head.dmin).to_le_bytes());
                    let (sc, m) = head.scales.split_at(8);
                    for j in 0..4 {
                        bytes.push(sc[j] as u8 | ((sc[j + 4] as u8) >> 4) << 6);
                    }
                    for j in 0..4 {
                        bytes.push(m[j] as u8 | ((m[j + 4] as u8) >> 4) << 6);
                    }
                    for j in 0..4 {
                        bytes.push((sc[j + 4] as u8 & 0x0f) | (m[j + 4] as u8 & 0x0f) << 4);
                    }
                    bytes.extend_from_slice(q);
                }
                _ => {
                    bytes.extend_from_slice(q);
                    bytes.extend(head.scales.map(|s| s as u8));
                    bytes.extend_from_slice(&f32_to_f16(head.d).to_le_bytes());
                }
            }
        }
        let mut out = vec![0f32; self.cols];
        dequantize(self.kind, &bytes, &mut out);
        out
    }

    /// Block `b` of the matrix (row after row) as `dequantize` computes its elements, for a
    /// device that dequantizes in its kernels: element `e` is `scales[e / 32] * q[e] -
    /// mins[e / 32]` for `Q4_K` and `scales[e / 16] * q[e]` for `Q6_K`, each operation rounded
    /// on its own, the scales and minimums being the dequantizer's f32 products (`d * sc`,
    /// `dmin * m`).
    pub fn group_values(&self, b: usize) -> GroupValues {
        let per_block = quant_bytes(self.kind);
        let (head, quants) = (&self.heads[b], &self.quants[b * per_block..(b + 1) * per_block]);
        let mut out =
            GroupValues { scales: [0.0; 16], mins: [0.0; 8], q: unpack(self.kind, quants) };
        match self.kind {
            TensorType::Q4K | TensorType::Q5K => {
                for j in 0..8 {
                    out.scales[j] = head.d * f32::from(head.scales[j] as u8);
                    out.mins[j] = head.dmin * f32::from(head.scales[8 + j] as u8);
                }
            }
            _ => {
                for (scale, &sc) in out.scales.iter_mut().zip(&head.scales) {
                    *scale = head.d * f32::from(sc);
                }
            }
        }
        out
    }

    /// Row `r` times each of `acts`: one pass over the row's blocks for all of them.
    #[inline(always)]
    pub fn dots<const N: usize>(&self, r: usize, acts: [&Q8K; N]) -> [f32; N] {
        let mut sums = [Sum::default(); N];
        let repacked = self.repacked();
        let (heads, quants) = self.row_parts(r);
        #[cfg(target_arch = "x86_64")]
        if repacked && kernels::has_avx2_fma() {
            let acts = acts.map(|act| (act.d.as_slice(), act.q.as_slice(), act.sums32.as_slice()));
            #[allow(
                unsafe_code,
                reason = "a function compiled for CPU features detected at run time"
            )]
            // SAFETY: the CPU has AVX2 and FMA, all that the kernel is compiled for.
            let totals = unsafe { kernels::avx2::q4k_repacked(heads, quants, acts) };
            return totals.map(|(row, min)| row - min);
        }
        #[cfg(target_arch = "x86_64")]
        if kernels::has_avx2_fma() {
            let acts = acts.map(|act| (act.d.as_slice(), act.q.as_slice(), act.sums32.as_slice()));
            #[allow(
                unsafe_code,
                reason = "functions compiled for CPU features detected at run time"
            )]
            // SAFETY: the CPU has AVX2 and FMA, all that the kernels are compiled for.
            let partial = unsafe {
                match self.kind {
                    TensorType::Q4K => kernels::avx2::kquant_lanes::<4, N>(heads, quants, acts),
                    TensorType::Q5K => kernels::avx2::kquant_lanes::<5, N>(heads, quants, acts),
                    _ => kernels::avx2::kquant_lanes::<6, N>(heads, quants, acts),
                }
            };
            for (sum, (lanes, mins, min)) in sums.iter_mut().zip(partial) {
                (sum.lanes, sum.mins, sum.min) = (lanes, mins, min);
            }
            return self.reduce(&sums, repacked);
        }
        for (b, (head, block)) in
            heads.iter().zip(quants.chunks_exact(quant_bytes(self.kind))).enumerate()
        {
            let q8: [&[i8]; N] = std::array::from_fn(|n| &acts[n].q[b * QK..(b + 1) * QK]);
            if repacked {
                let sums32: [&[i16]; N] =
                    std::array::from_fn(|n| &acts[n].sums32[b * 8..(b + 1) * 8]);
                let totals = q4k_totals(block, head, q8, sums32);
                for ((sum, act), &(scaled, minimum)) in sums.iter_mut().zip(&acts).zip(&totals) {
                    // `_mm256_mul_ps(col_scale, row_scale)`, then one fused step each.
                    sum.row = (scaled as f32).mul_add(head.d * act.d[b], sum.row);
                    sum.min = (minimum as f32).mul_add(head.dmin * act.d[b], sum.min);
                }
                continue;
            }
            let lanes = block_lanes(self.kind, block, head, q8);
            for ((sum, act), lanes) in sums.iter_mut().zip(&acts).zip(&lanes) {
                let yd = act.d[b];
                let d = yd * head.d;
                for (acc, &lane) in sum.lanes.iter_mut().zip(lanes) {
                    *acc = d.mul_add(lane as f32, *acc);
                }
                let dmin = -yd * head.dmin;
                let sums32 = &act.sums32[b * 8..(b + 1) * 8];
                match self.kind {
                    TensorType::Q4K => {
                        for (acc, &m) in sum.mins.iter_mut().zip(&head.min_products(sums32)) {
                            *acc = dmin.mul_add(m as f32, *acc);
                        }
                    }
                    // `summs += dmin * hsum`: the minimums' products added in integers first.
                    TensorType::Q5K => {
                        let minimum: i32 = head.min_products(sums32).iter().sum();
                        sum.min = dmin.mul_add(minimum as f32, sum.min);
                    }
                    _ => {}
                }
            }
        }
        self.reduce(&sums, repacked)
    }

    /// Each input's running sums to its product, as llama.cpp's paths end.
    #[inline(always)]
    fn reduce<const N: usize>(&self, sums: &[Sum; N], repacked: bool) -> [f32; N] {
        std::array::from_fn(|n| {
            let sum = &sums[n];
            match (self.kind, repacked) {
                (TensorType::Q4K, true) => sum.row - sum.min,
                // `hsum_float_8`, plus the minimums' lanes as `_mm_movehl_ps` and
                // `_mm_movehdup_ps` pair them.
                (TensorType::Q4K, false) => {
                    let m = &sum.mins;
                    hsum8(&sum.lanes) + ((m[0] + m[2]) + (m[1] + m[3]))
                }
                (TensorType::Q5K, _) => hsum8(&sum.lanes) + sum.min,
                _ => hsum8(&sum.lanes),
            }
        })
    }

    /// Row `r` times `act`.
    #[inline(always)]
    pub fn dot(&self, r: usize, act: &Q8K) -> f32 {
        self.dots(r, [act])[0]
    }

    /// Whether llama.cpp multiplies this matrix repacked, eight rows together (the module's
    /// docs).
    pub fn repacked(&self) -> bool {
        self.kind == TensorType::Q4K && self.rows.is_multiple_of(8)
    }
}

/// A K-quant block's elements as scale, minimum and integer quant (`KBlockRows::group_values`).
#[derive(Clone, Debug)]
pub struct GroupValues {
    /// `Q4_K`, `Q5_K`: the first 8, one per 32 elements. `Q6_K`: one per 16.
    pub scales: [f32; 16],
    /// `Q4_K`'s and `Q5_K`'s, one per 32 elements (zero for `Q6_K`).
    pub mins: [f32; 8],
    /// 0 to 15 (`Q4_K`), 0 to 31 (`Q5_K`) or -32 to 31 (`Q6_K`).
    pub q: [i8; QK],
}

/// One row's running sums with one input: the lane accumulators (and the minimums': `Q4_K`'s in
/// four lanes, `Q5_K`'s in `min`), or the repacked path's two.
#[derive(Clone, Copy, Default)]
struct Sum {
    lanes: [f32; 8],
    mins: [f32; 4],
    row: f32,
    min: f32,
}

impl Header {
    /// `Q4_K`'s minimums times the activation's sums of each 32, in four lanes as
    /// `_mm_madd_epi16` pairs them: lane `i` holds minimums `2i` and `2i + 1`.
    #[inline(always)]
    fn min_products(&self, sums32: &[i16]) -> [i32; 4] {
        let sum32 = |j: usize| i32::from(sums32[j]);
        let m = |j: usize| i32::from(self.scales[8 + j]);
        let pair = |i: usize| m(2 * i) * sum32(2 * i) + m(2 * i + 1) * sum32(2 * i + 1);
        [pair(0), pair(1), pair(2), pair(3)]
    }
}

/// A block's scaled integer products with each of `acts` in eight lanes: element `e` in lane
/// `(e % 32) / 4`, as `_mm256_madd_epi16` leaves them: the portable form of the AVX2 kernels'
/// integer sums (`kernels::avx2::kquant_lanes`, `q4k_repacked`). Exact, so the two, which sum
/// in other orders, agree.
#[inline(always)]
fn block_lanes<const N: usize>(
    kind: TensorType,
    block: &[u8],
    head: &Header,
    acts: [&[i8]; N],
) -> [[i32; 8]; N] {
    let values = unpack(kind, block);
    acts.map(|act| {
        let mut lanes = [0i32; 8];
        for (sixteen, (q, a)) in values.chunks_exact(16).zip(act.chunks_exact(16)).enumerate() {
            // Elements 16 * sixteen .. + 16: lanes 0-3 or 4-7 of their 32.
            let first = (sixteen % 2) * 4;
            // Q4_K and Q5_K have one scale per 32.
            let scale = match kind {
                TensorType::Q4K | TensorType::Q5K => head.scales[sixteen / 2],
                _ => head.scales[sixteen],
            };
            for (k, (q, a)) in q.chunks_exact(4).zip(a.chunks_exact(4)).enumerate() {
                let sum: i32 = q.iter().zip(a).map(|(&q, &a)| i32::from(q) * i32::from(a)).sum();
                lanes[first + k] += i32::from(scale) * sum;
            }
        }
        lanes
    })
}

/// A `Q4_K` block's scaled products with each of `acts` summed, and its minimums' products with
/// the activation's sums of each 32 summed: what llama.cpp's repacked path scales. (With AVX2,
/// `kernels::avx2::q4k_repacked` computes these in its own loop over a row.)
#[inline(always)]
fn q4k_totals<const N: usize>(
    block: &[u8],
    head: &Header,
    acts: [&[i8]; N],
    sums32: [&[i16]; N],
) -> [(i32, i32); N] {
    let lanes = block_lanes(TensorType::Q4K, block, head, acts);
    let mut out = [(0, 0); N];
    for ((out, lanes), sums32) in out.iter_mut().zip(&lanes).zip(sums32) {
        *out = (lanes.iter().sum(), head.min_products(sums32).iter().sum());
    }
    out
}

/// Each element's integer quant from a block's quant bytes: 0 to 15 for `Q4_K`, 0 to 31 for
/// `Q5_K`, -32 to 31 for `Q6_K` (`dequantize`'s layouts).
#[inline(always)]
fn unpack(kind: TensorType, block: &[u8]) -> [i8; QK] {
    let mut values = [0i8; QK];
    match kind {
        TensorType::Q4K => {
            for (q, out) in block.chunks_exact(32).zip(values.chunks_exact_mut(64)) {
                let (low, high) = out.split_at_mut(32);
                for ((&byte, low), high) in q.iter().zip(low).zip(high) {
                    (*low, *high) = ((byte & 0x0f) as i8, (byte >> 4) as i8);
                }
            }
        }
        TensorType::Q5K => {
            let (qh, qs) = (&block[0..32], &block[32..160]);
            for (chunk, (q, out)) in
                qs.chunks_exact(32).zip(values.chunks_exact_mut(64)).enumerate()
            {
                for l in 0..32 {
                    let high = |half: usize| ((qh[l] >> (2 * chunk + half)) & 1) << 4;
                    out[l] = ((q[l] & 0x0f) | high(0)) as i8;
                    out[l + 32] = ((q[l] >> 4) | high(1)) as i8;
                }
            }
        }
        _ => {
            let (ql, qh) = (&block[0..128], &block[128..192]);
            for n in 0..2 {
                let (ql, qh, q) = (&ql[64 * n..], &qh[32 * n..], &mut values[128 * n..]);
                for l in 0..32 {
                    q[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                    q[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
    }
    values
}

/// Bytes of quants a block of `kind` keeps.
fn quant_bytes(kind: TensorType) -> usize {
    match kind {
        TensorType::Q4K => 128,
        // The fifth bits (32 bytes), then the nibbles.
        TensorType::Q5K => 160,
        _ => 192,
    }
}

/// An activation quantized to 8 bits in blocks of 256 (`block_q8_K`): per block the f32 scale
/// `d`, the values, and the sum of each 32 values (ggml keeps each 16's, `bsums`, and the K-quant
/// products this module computes add them in pairs before they use them).
#[derive(Clone, Debug)]
pub struct Q8K {
    d: Vec<f32>,
    q: Vec<i8>,
    sums32: Vec<i16>,
}

impl Q8K {
    /// `quantize_row_q8_K_ref`: the scale from the block's value of largest magnitude (the
    /// first, on ties), each value times `-127 / max` rounded to nearest, ties to even.
    pub fn quantize(x: &[f32]) -> Q8K {
        kernels::run(
            #[inline(always)]
            || Self::quantize_here(x),
        )
    }

    #[inline(always)]
    fn quantize_here(x: &[f32]) -> Q8K {
        assert!(x.len().is_multiple_of(QK), "a K-quant product's input is whole blocks");
        let blocks = x.len() / QK;
        let mut act = Q8K {
            d: Vec::with_capacity(blocks),
            q: Vec::with_capacity(x.len()),
            sums32: Vec::with_capacity(blocks * 8),
        };
        for block in x.chunks_exact(QK) {
            let (mut max, mut amax) = (0f32, 0f32);
            for &v in block {
                if v.abs() > amax {
                    (amax, max) = (v.abs(), v);
                }
            }
            if amax == 0.0 {
                // ggml leaves the sums as they were; with a zero scale they multiply to zero.
                act.d.push(0.0);
                act.q.extend([0; QK]);
                act.sums32.extend([0; 8]);
                continue;
            }
            let iscale = -127.0 / max;
            let start = act.q.len();
            act.q.extend(block.iter().map(|&v| nearest_int(iscale * v).min(127) as i8));
            for thirty_two in act.q[start..].chunks_exact(32) {
                act.sums32.push(thirty_two.iter().map(|&q| i16::from(q)).sum());
            }
            act.d.push(1.0 / iscale);
        }
        act
    }
}

/// ggml's `nearest_int`: `value` rounded to nearest, ties to even, by adding `1.5 * 2^23` (so the
/// addition's rounding is the rounding) and reading the low mantissa bits. Exact for
/// `|value| < 2^22`, which a scaled 8-bit quant is.
#[inline(always)]
fn nearest_int(value: f32) -> i32 {
    let shifted = (value + 12_582_912.0).to_bits() as i32;
    (shifted & 0x007f_ffff) - 0x0040_0000
}

/// Random bytes of `n` blocks of K-quant `kind` (for tests), with half-precision scales of sane
/// magnitude (random bits there would be infinities and NaNs).
#[cfg(test)]
pub(crate) fn random_kquant_blocks(kind: TensorType, n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut bytes: Vec<u8> = (0..n * kind.block_bytes() as usize).map(|_| next() as u8).collect();
    let mut scale = || f32_to_f16(((next() % 1000) as f32 + 1.0) / 64_000.0).to_le_bytes();
    for block in bytes.chunks_exact_mut(kind.block_bytes() as usize) {
        match kind {
            TensorType::Q4K | TensorType::Q5K => {
                block[0..2].copy_from_slice(&scale());
                block[2..4].copy_from_slice(&scale());
            }
            _ => block[208..210].copy_from_slice(&scale()),
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_input(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    /// The quantized product approximates the f32 product of the dequantized row: the
    /// unpacking is `dequantize`'s, whatever the lane bookkeeping does.
    #[test]
    fn products_approximate_the_dequantized_product() {
        let cases = [
            (TensorType::Q4K, 8),
            (TensorType::Q4K, 3),
            (TensorType::Q5K, 3),
            (TensorType::Q6K, 3),
        ];
        for (kind, rows) in cases {
            let cols = 512;
            let w =
                KBlockRows::from_ggml(kind, rows, cols, &random_kquant_blocks(kind, rows * 2, 7));
            let x = random_input(cols, 11);
            let act = Q8K::quantize(&x);
            for r in 0..rows {
                let exact: f64 = w.row(r).iter().zip(&x).map(|(&a, &b)| f64::from(a * b)).sum();
                let magnitude: f64 =
                    w.row(r).iter().zip(&x).map(|(&a, &b)| f64::from((a * b).abs())).sum();
                let got = f64::from(w.dot(r, &act));
                assert!(
                    (got - exact).abs() <= 0.02 * magnitude,
                    "{kind:?} row {r}: {got} against {exact} (magnitude {magnitude})"
                );
            }
        }
    }

    /// A row rebuilt from the kept form dequantizes to the file's values bit for bit (the
    /// scales' repacking is exact).
    #[test]
    fn rows_dequantize_as_the_file_does() {
        for kind in [TensorType::Q4K, TensorType::Q5K, TensorType::Q6K] {
            let bytes = random_kquant_blocks(kind, 6, 5);
            let w = KBlockRows::from_ggml(kind, 3, 512, &bytes);
            let mut file = vec![0f32; 3 * 512];
            dequantize(kind, &bytes, &mut file);
            let kept: Vec<f32> = (0..3).flat_map(|r| w.row(r)).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&kept), bits(&file), "{kind:?}");
        }
    }

    /// `group_values` computes the elements `row` gives, bit for bit.
    #[test]
    fn group_values_are_the_dequantizer_s() {
        for kind in [TensorType::Q4K, TensorType::Q5K, TensorType::Q6K] {
            let w = KBlockRows::from_ggml(kind, 2, 512, &random_kquant_blocks(kind, 4, 9));
            for r in 0..2 {
                let row = w.row(r);
                for (i, expected) in row.chunks_exact(QK).enumerate() {
                    let g = w.group_values(2 * r + i);
                    for (e, &v) in expected.iter().enumerate() {
                        let q = f32::from(g.q[e]);
                        let got = match kind {
                            TensorType::Q4K | TensorType::Q5K => {
                                g.scales[e / 32] * q - g.mins[e / 32]
                            }
                            _ => g.scales[e / 16] * q,
                        };
                        assert_eq!(got.to_bits(), v.to_bits(), "{kind:?} row {r} element {e}");
                    }
                }
            }
        }
    }

    /// The Q8_K rounding and sums, on values whose quantization is known.
    #[test]
    fn q8k_matches_ggml_on_known_values() {
        let mut x = vec![0f32; QK];
        x[0] = 0.5;
        x[1] = -1.0; // the largest magnitude: scale -127 / -1 = 127
        x[2] = 0.25;
        x[17] = 2.0 / 127.0 * 0.5 * 3.0; // 3 exactly: 127 * (3 / 127)
        let act = Q8K::quantize(&x);
        assert_eq!(act.d, [1.0 / 127.0]);
        // 63.5 rounds to even, 31.75 to 32.
        assert_eq!(&act.q[..3], &[64, -127, 32]);
        assert_eq!(act.q[17], 3);
        assert_eq!(act.sums32[..2], [64 - 127 + 32 + 3, 0]);
        let zero = Q8K::quantize(&[0f32; QK]);
        assert_eq!((zero.d[0], zero.sums32[0]), (0.0, 0));
    }

    /// The AVX2 build of these loops and the portable one give the same bits.
    #[test]
    fn portable_and_detected_products_agree_to_the_bit() {
        // 16 blocks a row: enough steps of each fused chain that an unfused or reordered step
        // changes some row's last bit (2 blocks a row did not show it).
        for kind in [TensorType::Q4K, TensorType::Q5K, TensorType::Q6K] {
            let w = KBlockRows::from_ggml(kind, 8, 4096, &random_kquant_blocks(kind, 128, 3));
            // Odd seeds: `random_input` makes each odd (`100 + i` gave two pairs of equal
            // inputs, which hid a swap of inputs in the four-input kernels).
            let xs: Vec<Vec<f32>> = (0..4).map(|i| random_input(4096, 101 + 2 * i)).collect();
            let detected: Vec<[f32; 4]> = (0..8)
                .map(|r| {
                    let acts = xs.iter().map(|x| Q8K::quantize(x)).collect::<Vec<_>>();
                    kernels::run(|| w.dots(r, [&acts[0], &acts[1], &acts[2], &acts[3]]))
                })
                .collect();
            let portable: Vec<[f32; 4]> = kernels::force_portable(|| {
                (0..8)
                    .map(|r| {
                        let acts = xs.iter().map(|x| Q8K::quantize(x)).collect::<Vec<_>>();
                        w.dots(r, [&acts[0], &acts[1], &acts[2], &acts[3]])
                    })
                    .collect()
            });
            let bits = |v: &[[f32; 4]]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&detected), bits(&portable), "{kind:?}");
            // Four inputs at once are each input alone.
            let acts = xs.iter().map(|x| Q8K::quantize(x)).collect::<Vec<_>>();
            for (r, row) in detected.iter().enumerate() {
                for (act, product) in acts.iter().zip(row) {
                    assert_eq!(w.dot(r, act).to_bits(), product.to_bits());
                }
            }
        }
    }
}
