//! The elementwise and reduction arithmetic of one token's forward pass, defined to the bit.
//!
//! Each function fixes its order of operations and where it fuses a multiply and an add, so that
//! a result never depends on the machine, the compiler's vectorization, or what else is in the
//! batch. The orders are those of llama.cpp's x86 CPU backend built for AVX2 and FMA (the build
//! our goldens come from): eight-lane fused accumulators, reduced pairwise in a fixed pattern, and
//! the exponential ggml uses in softmax and SiLU. With them our logits equal llama.cpp's to the
//! last bit on a one-token prompt, and stay within rounding of them on longer ones.
//!
//! `f32::mul_add` is one correctly rounded fused multiply-add on every target (a libm call where
//! the CPU has no FMA instruction), so these definitions are exact everywhere; `kernels` compiles
//! them with FMA enabled where the CPU has it, for speed only.

/// `x[i] * x[i]` in single precision, summed in double, as ggml's `rms_norm` does; then
/// `out = x * scale * weight` with the scale rounded to single.
#[inline(always)]
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// Eight lanes summed as x86's `hsum_float_8` does: the halves, then lanes 0+2 and 1+3, then the
/// last two.
#[inline(always)]
pub fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// A value of a half-precision KV cache: its f16 bits (the paged cache), or the f32 it equals
/// exactly (the reference's contiguous cache). Either reads as the same f32.
pub trait HalfValue: Copy {
    fn to_f32(self) -> f32;
}

impl HalfValue for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl HalfValue for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::gguf::f16_to_f32(self)
    }
}

/// A dot product of half-precision values (`a`, either form of `HalfValue`) the way ggml's
/// `vec_dot_f16` runs on AVX2: 32 elements a step into four accumulators of eight lanes (element
/// `i` feeds accumulator `(i % 32) / 8`, lane `i % 8`), each a chain of fused multiply-adds; the
/// accumulators are added 0+2, 1+3, then together; the eight lanes are reduced 0+4, 1+5, 2+6,
/// 3+7, then in pairs. A final partial step counts as padded with zeros, which is what
/// llama.cpp's padded KV length amounts to (a zero weight times a zero value adds nothing,
/// exactly).
#[inline(always)]
pub fn dot_f16<A: HalfValue>(a: &[A], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let (a_steps, a_rest) = a.as_chunks::<32>();
    let (b_steps, b_rest) = b.as_chunks::<32>();
    for (x, y) in a_steps.iter().zip(b_steps) {
        for j in 0..4 {
            for l in 0..8 {
                acc[j][l] = x[8 * j + l].to_f32().mul_add(y[8 * j + l], acc[j][l]);
            }
        }
    }
    for (i, (x, y)) in a_rest.iter().zip(b_rest).enumerate() {
        acc[i / 8][i % 8] = x.to_f32().mul_add(*y, acc[i / 8][i % 8]);
    }
    reduce_lanes(&acc)
}

/// The reduction of `dot_f16`'s four accumulators of eight lanes (lane `8 * j + l` is
/// `acc[j][l]`).
#[inline(always)]
pub fn reduce_lanes(acc: &[[f32; 8]; 4]) -> f32 {
    let mut a = [0f32; 8];
    for l in 0..8 {
        a[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

/// `exp(x)` as ggml computes it eight lanes at a time (ggml's `ggml_v_expf`, adapted from Arm's
/// optimized-routines): round `x / ln 2` to an integer `n` with the 1.5 * 2^23 trick, reduce,
/// evaluate a degree-5 polynomial, and scale by `2^n` through the exponent bits, with separate
/// handling where `|n| > 126`. At most 1.5 ulp from the true value, and deterministic.
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    // b = x - n ln 2, with ln 2 in two parts so that n ln 2 is exact enough.
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = C4.mul_add(b, C3).mul_add(u, C2.mul_add(b, C1)).mul_add(u, C0 * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    // 2^n overflows the exponent field: scale in two steps, or saturate past |n| > 192.
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    if n.abs() > 192.0 {
        return s1 * s1;
    }
    let s2 = f32::from_bits(e.wrapping_sub(g));
    s2.mul_add(j, s2) * s1
}

use expf_constants::*;

/// `expf`'s constants as bit patterns, so that they are the same floats as ggml's hexadecimal
/// ones (also the AVX2 `expf8`'s).
pub(crate) mod expf_constants {
    pub const SHIFT: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23
    pub const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
    pub const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
    pub const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
    pub const C0: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1
    pub const C1: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
    pub const C2: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
    pub const C3: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
    pub const C4: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
}

/// SiLU of the gate times the up projection, `g / (1 + exp(-g)) * u`, as ggml's `swiglu`:
/// ggml's exponential on groups of eight, the C library's on a remainder.
#[inline(always)]
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let vectorized = gate.len() - gate.len() % 8;
    for (i, ((o, &g), &u)) in out.iter_mut().zip(gate).zip(up).enumerate() {
        let e = if i < vectorized { expf(0.0 - g) } else { (-g).exp() };
        *o = (g / (1.0 + e)) * u;
    }
}

/// Softmax of `scores` in place, as ggml's `soft_max`: exponentials of `score - max` by eight
/// (summed per group of eight with `hsum8`, the group sums added in double), then scaled by the
/// reciprocal of the total rounded to single. A last partial group counts as padded with masked
/// (zero) entries, as llama.cpp's KV length is.
#[inline(always)]
pub fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0f64;
    for group in scores.chunks_mut(8) {
        total += f64::from(exp_group(group, max));
    }
    let inverse = (1.0 / total) as f32;
    for s in scores {
        *s *= inverse;
    }
}

/// One group of up to eight softmax scores: each becomes `expf(score - max)`, and their sum is
/// returned as `hsum8` adds eight lanes (a short group padded with zeros).
#[inline(always)]
pub(crate) fn exp_group(group: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; 8];
    for (lane, s) in lanes.iter_mut().zip(group.iter_mut()) {
        *s = expf(*s - max);
        *lane = *s;
    }
    hsum8(&lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn expf_is_within_two_ulps_of_the_c_library_where_it_is_finite() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(ulps(expf(x), x.exp()));
            x += 0.013;
        }
        assert!(worst <= 2, "expf off by {worst} ulps");
    }

    #[test]
    fn expf_saturates_like_ggml_outside_the_exponent_range() {
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
        // Between 126 and 192 binades the result is scaled in two steps, still close.
        assert!(ulps(expf(-95.0), (-95.0f32).exp()) <= 2);
    }

    #[test]
    fn softmax_sums_to_one_and_treats_a_partial_group_as_padded() {
        let mut scores = [0.5, -1.0, 2.0, 0.0, 3.0, 1.0, -2.0, 0.25, 1.5, 0.75];
        softmax(&mut scores);
        let total: f32 = scores.iter().sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(scores[4] > scores[2] && scores[2] > scores[8]);
    }

    #[test]
    fn lane_dot_products_reduce_in_the_documented_order() {
        // 2^24 + 1 rounds back to 2^24: the 1 survives only if lanes 0 and 4 cancel first, as
        // the documented order has it. A sequential sum gives 0.
        let big = 16_777_216f32;
        let mut a = [0f32; 40];
        (a[0], a[1], a[4]) = (big, 1.0, -big);
        assert_eq!(dot_f16(&a, &[1.0; 40]), 1.0);
        assert_eq!(a.iter().fold(0f32, |s, &v| s + v), 0.0);
        assert_eq!(hsum8(&[big, 1.0, 0.0, 0.0, -big, 0.0, 0.0, 0.0]), 1.0);
    }
}
