//! Turning stored tensor rows into f32, for every type in `TensorType`. The formulas are ggml's
//! (`ggml-quants.c`, `dequantize_row_*`), written out block by block; the tests hold them to the
//! `gguf` Python package's numpy implementation on random blocks and on the default model.

use super::TensorType;

/// Dequantizes `bytes`, a whole number of blocks of `kind`, into `out`, which must hold exactly
/// the elements those blocks encode. Panics otherwise: the loader checked the sizes, so a
/// mismatch here is a bug.
pub fn dequantize(kind: TensorType, bytes: &[u8], out: &mut [f32]) {
    let block_bytes = kind.block_bytes() as usize;
    let block_elements = kind.block_elements() as usize;
    assert_eq!(
        bytes.len() % block_bytes,
        0,
        "{kind:?}: {} bytes are not whole blocks",
        bytes.len()
    );
    assert_eq!(
        bytes.len() / block_bytes * block_elements,
        out.len(),
        "{kind:?}: output of the wrong length"
    );
    for (block, y) in bytes.chunks_exact(block_bytes).zip(out.chunks_exact_mut(block_elements)) {
        match kind {
            TensorType::F32 => y[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
            TensorType::F16 => y[0] = f16_to_f32(u16::from_le_bytes([block[0], block[1]])),
            TensorType::BF16 => y[0] = bf16_to_f32(u16::from_le_bytes([block[0], block[1]])),
            TensorType::Q4_0 => q4_0(block, y),
            TensorType::Q4_1 => q4_1(block, y),
            TensorType::Q5_0 => q5_0(block, y),
            TensorType::Q5_1 => q5_1(block, y),
            TensorType::Q8_0 => q8_0(block, y),
            TensorType::Q4K => q4_k(block, y),
            TensorType::Q5K => q5_k(block, y),
            TensorType::Q6K => q6_k(block, y),
        }
    }
}

fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

fn q4_0(block: &[u8], y: &mut [f32]) {
    let d = half(block, 0);
    let qs = &block[2..18];
    for j in 0..16 {
        y[j] = (i32::from(qs[j] & 0x0f) - 8) as f32 * d;
        y[j + 16] = (i32::from(qs[j] >> 4) - 8) as f32 * d;
    }
}

fn q4_1(block: &[u8], y: &mut [f32]) {
    let (d, m) = (half(block, 0), half(block, 2));
    let qs = &block[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0x0f) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

/// A `Q5_0` or `Q5_1` block's 32 integer values, 0 to 31: element `j`'s low four bits are
/// `q4_0`'s nibble, its fifth bit is bit `j` of the 32-bit word `qh` (`dequantize_row_q5_0`'s
/// `xh_0` and `xh_1`).
pub(crate) fn five_bit_values(kind: TensorType, block: &[u8]) -> [i32; 32] {
    let at = if kind == TensorType::Q5_0 { 2 } else { 4 };
    let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    let qs = &block[at + 4..at + 20];
    std::array::from_fn(|j| {
        let nibble = if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
        i32::from(nibble) | (((qh >> j) & 1) << 4) as i32
    })
}

fn q5_0(block: &[u8], y: &mut [f32]) {
    let d = half(block, 0);
    for (y, q) in y.iter_mut().zip(five_bit_values(TensorType::Q5_0, block)) {
        *y = (q - 16) as f32 * d;
    }
}

fn q5_1(block: &[u8], y: &mut [f32]) {
    let (d, m) = (half(block, 0), half(block, 2));
    for (y, q) in y.iter_mut().zip(five_bit_values(TensorType::Q5_1, block)) {
        *y = q as f32 * d + m;
    }
}

fn q8_0(block: &[u8], y: &mut [f32]) {
    let d = half(block, 0);
    for (y, &q) in y.iter_mut().zip(&block[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K block (`get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn q4_k(block: &[u8], y: &mut [f32]) {
    scaled_with_mins(block, None, &block[16..144], y);
}

fn q5_k(block: &[u8], y: &mut [f32]) {
    scaled_with_mins(block, Some(&block[16..48]), &block[48..176], y);
}

/// `Q4_K` and `Q5_K`: per 32 elements `d * sc * q - dmin * m`, the 6-bit `sc` and `m` packed in
/// bytes 4 to 16; `q` a nibble of `qs` (element `64c + l` low in byte `32c + l`, `64c + 32 + l`
/// high) and, for `Q5_K`, a fifth bit from `qh[l]`: bit `2c` for the low nibble, `2c + 1` for
/// the high.
fn scaled_with_mins(block: &[u8], qh: Option<&[u8]>, qs: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(block, 0), half(block, 2));
    let scales = &block[4..16];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        for l in 0..32 {
            let fifth = |bit: usize| qh.map_or(0, |qh| 16 * ((qh[l] >> bit) & 1));
            y[l] = d1 * f32::from((q[l] & 0x0f) + fifth(2 * chunk)) - min1;
            y[l + 32] = d2 * f32::from((q[l] >> 4) + fifth(2 * chunk + 1)) - min2;
        }
    }
}

fn q6_k(block: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&block[0..128], &block[128..192], &block[192..208]);
    let d = half(block, 208);
    for n in 0..2 {
        let (ql, qh, sc, y) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..], &mut y[128 * n..]);
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let scale = |i: usize| d * f32::from(sc[is + i] as i8);
            y[l] = scale(0) * q1 as f32;
            y[l + 32] = scale(2) * q2 as f32;
            y[l + 64] = scale(4) * q3 as f32;
            y[l + 96] = scale(6) * q4 as f32;
        }
    }
}

/// IEEE half precision to single, exactly (subnormals, infinities and NaN included).
///
/// Without branches (the three cases are computed and one selected), so that a loop widening
/// halves vectorizes: the portable attention reads every cached value through it (on a CPU
/// without F16C, an ARM laptop's).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    let half = u32::from(bits);
    // Exponent and mantissa moved to their places in an f32; the exponent still biased by 15.
    let shifted = (half & 0x7fff) << 13;
    let exponent = shifted & 0x0f80_0000;
    // A normal half: rebias the exponent to 127.
    let normal = shifted + ((127 - 15) << 23);
    // Infinity and NaN: exponent all ones, the mantissa (NaN's payload) kept.
    let special = shifted + ((255 - 31) << 23);
    // Zero and subnormal, `m * 2^-24`: `2^-14 * (1 + m / 1024) - 2^-14`, exact in f32.
    let subnormal = (f32::from_bits(shifted + (113 << 23)) - f32::from_bits(113 << 23)).to_bits();
    // Selected by masks, not branches, so the compiler keeps it straight-line.
    let is_special = 0u32.wrapping_sub(u32::from(exponent == 0x0f80_0000));
    let is_subnormal = 0u32.wrapping_sub(u32::from(exponent == 0));
    let is_normal = !(is_special | is_subnormal);
    let magnitude = (special & is_special) | (subnormal & is_subnormal) | (normal & is_normal);
    f32::from_bits((half & 0x8000) << 16 | magnitude)
}

/// bfloat16 is the top half of an f32.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Single precision to IEEE half, rounding to nearest even, as ggml's `GGML_FP32_TO_FP16` does
/// (overflow to infinity, underflow through subnormals to zero, NaN kept).
pub fn f32_to_f16(value: f32) -> u16 {
    let bits = value.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exponent = ((bits >> 23) & 0xff) as i32;
    let mantissa = bits & 0x7f_ffff;
    if exponent == 0xff {
        return sign | 0x7c00 | if mantissa != 0 { 0x200 } else { 0 };
    }
    let unbiased = exponent - 127 + 15;
    if unbiased >= 0x1f {
        return sign | 0x7c00;
    }
    if unbiased <= 0 {
        if unbiased < -10 {
            return sign;
        }
        // Subnormal half: shift the full significand, rounding to nearest even.
        let significand = mantissa | 0x80_0000;
        let shift = (14 - unbiased) as u32;
        let half = significand >> shift;
        let rest = significand & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        let round_up = rest > halfway || (rest == halfway && half & 1 == 1);
        return sign | (half + u32::from(round_up)) as u16;
    }
    let half = ((unbiased as u32) << 10) | (mantissa >> 13);
    let rest = mantissa & 0x1fff;
    let round_up = rest > 0x1000 || (rest == 0x1000 && half & 1 == 1);
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    sign | (half + u32::from(round_up)) as u16
}

/// `value` rounded to the nearest half-precision value: `f16_to_f32(f32_to_f16(value))`.
#[inline]
pub fn round_to_f16(value: f32) -> f32 {
    // A value whose nearest half is a normal one (2^-14 up to below 65520, where ties go to
    // infinity) keeps its 10 high mantissa bits, rounded to nearest even in place: a carry out
    // of the mantissa bumps the exponent, as it should. This is most calls (activation scales,
    // queries, softmax weights); the rest take the conversions.
    let bits = value.to_bits();
    if (0x3880_0000..0x477f_f000).contains(&(bits & 0x7fff_ffff)) {
        let rounded = bits + 0x0fff + ((bits >> 13) & 1);
        return f32::from_bits(rounded & !0x1fff);
    }
    f16_to_f32(f32_to_f16(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every half widens to its value: `(1024 + m) * 2^(e - 25)` for a normal one, `m * 2^-24`
    /// for a subnormal, computed as arithmetic (exact in f32), and the payload kept for NaN.
    #[test]
    fn every_half_widens_to_its_value() {
        for bits in 0..=u16::MAX {
            let (exponent, mantissa) = (i32::from((bits >> 10) & 0x1f), bits & 0x3ff);
            let magnitude = match exponent {
                0 => f32::from(mantissa) * f32::powi(2.0, -24),
                0x1f if mantissa == 0 => f32::INFINITY,
                0x1f => f32::from_bits(0x7f80_0000 | u32::from(mantissa) << 13),
                e => f32::from(1024 + mantissa) * f32::powi(2.0, e - 25),
            };
            let expected = if bits >> 15 == 1 { -magnitude } else { magnitude };
            assert_eq!(f16_to_f32(bits).to_bits(), expected.to_bits(), "{bits:#06x}");
        }
    }

    /// The in-place rounding is the two conversions, at and around its range's edges and over
    /// every 251st f32 (all exponents, mixed low bits, both signs).
    #[test]
    fn rounding_to_half_is_the_two_conversions() {
        let edges =
            [0x3880_0000u32, 0x387f_ffff, 0x387f_f000, 0x477f_f000, 0x477f_efff, 0x477f_e000];
        let near = edges.iter().flat_map(|&e| (e - 2..=e + 2).flat_map(|b| [b, b | 1 << 31]));
        for bits in (0..=u32::MAX).step_by(251).chain(near) {
            let x = f32::from_bits(bits);
            let expected = f16_to_f32(f32_to_f16(x));
            let got = round_to_f16(x);
            assert!(
                got.to_bits() == expected.to_bits() || (got.is_nan() && expected.is_nan()),
                "{bits:#010x}: {got} against {expected}"
            );
        }
    }
}
