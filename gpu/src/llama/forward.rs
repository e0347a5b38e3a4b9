//! A single-sequence forward pass with a contiguous KV cache: the plain reference the batched
//! forward over paged KV is held to. It computes in llama.cpp's order of operations (8-bit
//! activations into quantized weights, a half-precision KV cache, rotary angles by repeated
//! multiplication and fused rotations, `numerics` for the rest), so that the two agree to the
//! bit. Every reduction runs in a fixed order over one row, so a row's result never depends on
//! anything computed alongside it.

use super::kernels;
use super::numerics::{self, HalfValue, rms_norm};
use super::{LlamaConfig, LlamaWeights, RopeStyle};
use crate::gguf::round_to_f16;

/// One sequence's KV cache and position.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// Per layer: `positions * kv_heads * head_dim` keys, then the same of values.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl Sequence {
    pub fn new(config: &LlamaConfig) -> Sequence {
        Sequence {
            keys: vec![Vec::new(); config.layers],
            values: vec![Vec::new(); config.layers],
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Runs `token` at the next position and returns the logits over the vocabulary.
    pub fn forward(&mut self, weights: &LlamaWeights, token: u32) -> Vec<f32> {
        kernels::in_pool(|| self.forward_in_pool(weights, token))
    }

    fn forward_in_pool(&mut self, weights: &LlamaWeights, token: u32) -> Vec<f32> {
        let c = &weights.config;
        let position = self.len;
        let mut x = weights.embed.row(token as usize);
        let mut h = vec![0f32; c.hidden];
        for (l, layer) in weights.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            let [mut q, mut k, v] = layer.qkv(std::slice::from_ref(&h)).map(|mut m| m.remove(0));
            rope(&mut q, c, position);
            rope(&mut k, c, position);
            // The cache holds half precision, as llama.cpp's does by default.
            self.keys[l].extend(k.iter().map(|&v| round_to_f16(v)));
            self.values[l].extend(v.iter().map(|&v| round_to_f16(v)));
            let kv_width = c.kv_heads * c.head_dim;
            let (keys, values) = (&self.keys[l], &self.values[l]);
            let attended = attention(c, &q, position, |p| {
                (&keys[p * kv_width..][..kv_width], &values[p * kv_width..][..kv_width])
            });
            add(&mut x, &layer.o.matvec(&attended));
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            let gate = layer.gate.matvec(&h);
            let up = layer.up.matvec(&h);
            let act = swiglu(&gate, &up);
            add(&mut x, &layer.down.matvec(&act));
        }
        self.len += 1;
        rms_norm(&x.clone(), &weights.output_norm, c.rms_eps, &mut x);
        weights.output().matvec(&x)
    }
}

pub(crate) fn rope(v: &mut [f32], c: &LlamaConfig, position: usize) {
    let d = c.head_dim;
    let theta_scale = c.rope_base.powf(-2.0 / d as f32);
    let factors = c.rope_freq_factors.as_deref();
    for head in v.chunks_exact_mut(d) {
        // The angle of pair i is position * theta_scale^i, by repeated multiplication.
        let mut theta = position as f32;
        for i in 0..d / 2 {
            let angle = factors.map_or(theta, |f| theta / f[i]);
            let (sin, cos) = angle.sin_cos();
            theta *= theta_scale;
            let (a, b) = match c.rope_style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + d / 2),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
    }
}

/// Attention of the query of the token at `position` over the cached positions it sees (all
/// before it, or the config's sliding window), whose key and value rows (`kv_heads * head_dim`
/// each) `rows(p)` gives. The query is rounded to half precision to meet
/// the half-precision cache, and so are the softmax weights before they weigh the values, as in
/// llama.cpp; every product runs in `numerics`' fixed lane order.
pub(crate) fn attention<'a>(
    c: &LlamaConfig,
    q: &[f32],
    position: usize,
    rows: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) -> Vec<f32> {
    kernels::run(
        #[inline(always)]
        || attention_body(c, q, position, rows),
    )
}

#[inline(always)]
fn attention_body<'a>(
    c: &LlamaConfig,
    q: &[f32],
    position: usize,
    rows: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) -> Vec<f32> {
    let d = c.head_dim;
    let group = c.heads / c.kv_heads;
    let mut out = vec![0f32; c.heads * d];
    for (h, out) in out.chunks_exact_mut(d).enumerate() {
        let kv = (h / group) * d;
        attend_head(
            c,
            &q[h * d..(h + 1) * d],
            position,
            |p| &rows(p).0[kv..kv + d],
            |p| &rows(p).1[kv..kv + d],
            out,
        );
    }
    out
}

/// One query head of the token at `position` over the keys and values of one KV head.
#[inline(always)]
pub(crate) fn attend_head<'a, H: HalfValue + 'a>(
    c: &LlamaConfig,
    q: &[f32],
    position: usize,
    key: impl Fn(usize) -> &'a [H],
    value: impl Fn(usize) -> &'a [H],
    out: &mut [f32],
) {
    // Positions before `first` are masked: a zero weight, exactly as llama.cpp's -inf mask gives
    // (lanes stay indexed by absolute position, as its padded KV length has them).
    let first = c.window_start(position);
    let d = c.head_dim;
    let scale = 1.0 / (d as f32).sqrt();
    let q: Vec<f32> = q.iter().map(|&v| round_to_f16(v)).collect();
    let mut scores = vec![0f32; position + 1];
    for (p, score) in scores.iter_mut().enumerate() {
        if p < first {
            *score = f32::NEG_INFINITY;
            continue;
        }
        *score = numerics::dot_f16(&key(p)[..d], &q) * scale;
    }
    numerics::softmax(&mut scores);
    weigh_values(&scores, first, d, value, out);
}

/// `attend_head` over a paged cache of f16 bits: position `p`'s key and value are the
/// `head_dim` values at `index[p] * width + offset` of `keys` and `values`. The same bits; with
/// AVX2 and F16C (and a head size of a multiple of 32) the whole head runs in vector registers
/// (`kernels::avx2::f16_scores`, `softmax`, `weigh_values`): at a 2,000-token context it was
/// most of a decode step.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn attend_head_paged(
    c: &LlamaConfig,
    q: &[f32],
    position: usize,
    keys: &[u16],
    values: &[u16],
    (index, width, offset): (&[usize], usize, usize),
    out: &mut [f32],
) {
    let d = c.head_dim;
    let at = |p: usize| index[p] * width + offset;
    #[cfg(target_arch = "x86_64")]
    if kernels::has_avx2_fma_f16c() && d.is_multiple_of(32) {
        let first = c.window_start(position);
        let scale = 1.0 / (d as f32).sqrt();
        let q: Vec<f32> = q.iter().map(|&v| round_to_f16(v)).collect();
        let mut scores = vec![f32::NEG_INFINITY; position + 1];
        let index = (&index[..=position], width, offset);
        #[allow(unsafe_code, reason = "functions compiled for CPU features detected at run time")]
        // SAFETY: the CPU has AVX2, FMA and F16C, all that these are compiled for.
        unsafe {
            kernels::avx2::f16_scores(&q, keys, index, first, scale, &mut scores[first..]);
            kernels::avx2::softmax(&mut scores);
            kernels::avx2::weigh_values(&scores, first, values, index, out);
        }
        return;
    }
    attend_head(c, q, position, |p| &keys[at(p)..at(p) + d], |p| &values[at(p)..at(p) + d], out);
}

/// `out[i]`: the values' dimension `i` weighed by the softmax weights (each rounded to half
/// precision, as llama.cpp's KQV product takes them), a dot product over positions in
/// `numerics::dot_f16`'s lanes: position `p` feeds lane `p % 32`.
#[inline(always)]
fn weigh_values<'a, H: HalfValue + 'a>(
    scores: &[f32],
    first: usize,
    d: usize,
    value: impl Fn(usize) -> &'a [H],
    out: &mut [f32],
) {
    // Lanes are laid out lane-major, so one position updates `d` contiguous accumulators.
    let mut lanes = vec![0f32; 32 * d];
    for (p, &s) in scores.iter().enumerate().skip(first) {
        let w = round_to_f16(s);
        let lane = &mut lanes[(p % 32) * d..][..d];
        for (acc, &v) in lane.iter_mut().zip(value(p)) {
            *acc = v.to_f32().mul_add(w, *acc);
        }
    }
    for (i, o) in out.iter_mut().enumerate() {
        let acc: [[f32; 8]; 4] =
            std::array::from_fn(|j| std::array::from_fn(|l| lanes[(8 * j + l) * d + i]));
        *o = numerics::reduce_lanes(&acc);
    }
}

pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// SiLU of `gate` times `up` (`numerics::swiglu`): with AVX2, eight exponentials a vector
/// (`kernels::avx2::swiglu`, the same bits).
pub(crate) fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    #[cfg(target_arch = "x86_64")]
    if kernels::has_avx2_fma() {
        #[allow(unsafe_code, reason = "a function compiled for CPU features detected at run time")]
        // SAFETY: the CPU has AVX2 and FMA, all that it is compiled for.
        unsafe {
            kernels::avx2::swiglu(gate, up, &mut out)
        };
        return out;
    }
    kernels::run(
        #[inline(always)]
        || numerics::swiglu(gate, up, &mut out),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{f16_to_f32, f32_to_f16};
    use crate::llama::RopeStyle;

    /// Values in [-1, 1) from an xorshift generator seeded with `seed`.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn config(head_dim: usize, sliding_window: Option<usize>) -> LlamaConfig {
        LlamaConfig {
            vocab_size: 8,
            hidden: head_dim,
            layers: 1,
            heads: 1,
            kv_heads: 1,
            head_dim,
            ffn: 8,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_freq_factors: None,
            qkv_bias: false,
            sliding_window,
            context_length: 4096,
        }
    }

    /// The paged attention (vector scores and softmax with AVX2) computes `attend_head`'s bits
    /// over a scattered cache: head sizes of a multiple of 32 and not, a sliding window (masked
    /// scores take the scalar exponential), scores far below the maximum, partial groups.
    #[test]
    fn paged_attention_is_attend_head_to_the_bit() {
        let mut next = uniform(0x9e37_79b9_7f4a_7c15);
        for (head_dim, window, position, spread) in [
            (64, None, 0, 1.0),
            (64, None, 300, 1.0),
            (128, None, 77, 4.0),
            (64, Some(40), 203, 1.0),
            // Scores 100 apart: exponentials past the simple range.
            (64, None, 150, 60.0),
            (80, None, 45, 1.0),
        ] {
            let c = config(head_dim, window);
            let (width, offset) = (3 * head_dim, head_dim);
            // Positions scattered over the cache in reverse, as pages may be.
            let slots = position + 1;
            let index: Vec<usize> = (0..slots).map(|p| slots - 1 - p).collect();
            let cells = slots * width;
            // The paged cache holds f16 bits; `attend_head` reads the f32 they equal.
            let keys: Vec<u16> = (0..cells).map(|_| f32_to_f16(next() * spread)).collect();
            let values: Vec<u16> = (0..cells).map(|_| f32_to_f16(next())).collect();
            let widened = |v: &[u16]| v.iter().map(|&b| f16_to_f32(b)).collect::<Vec<f32>>();
            let (key_values, value_values) = (widened(&keys), widened(&values));
            let q: Vec<f32> = (0..head_dim).map(|_| next() * spread).collect();
            let at = |p: usize| index[p] * width + offset;
            let mut alone = vec![0f32; head_dim];
            attend_head(
                &c,
                &q,
                position,
                |p| &key_values[at(p)..at(p) + head_dim],
                |p| &value_values[at(p)..at(p) + head_dim],
                &mut alone,
            );
            // The detected path (vector with AVX2 and F16C), then the portable loop over the f16
            // bits, as a CPU without AVX2 runs it.
            let paged_with = |portable: bool| {
                let mut out = vec![0f32; head_dim];
                let index = (&index[..], width, offset);
                let run = || attend_head_paged(&c, &q, position, &keys, &values, index, &mut out);
                if portable {
                    kernels::force_portable(run)
                } else {
                    kernels::run(run)
                }
                out
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (paged, portable) = (paged_with(false), paged_with(true));
            let case = format!("head size {head_dim}, window {window:?}, position {position}");
            assert_eq!(bits(&paged), bits(&alone), "{case}");
            assert_eq!(bits(&portable), bits(&alone), "portable, {case}");
            assert!(paged.iter().all(|x| x.is_finite()));
        }
    }

    /// The vector scores and softmax themselves, before the weights' rounding to half precision
    /// (which hides a last-bit difference in most scores): each score is `dot_f16 * scale` and
    /// the softmax `numerics::softmax`, bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_scores_and_softmax_are_the_portable_ones_to_the_bit() {
        if !kernels::has_avx2_fma_f16c() {
            return;
        }
        let mut next = uniform(0x2545_f491_4f6c_dd1d);
        for (d, positions, spread) in [(64, 1000, 1.0), (128, 333, 3.0), (64, 77, 40.0)] {
            let q: Vec<f32> = (0..d).map(|_| round_to_f16(next() * spread)).collect();
            let keys: Vec<u16> = (0..positions * d).map(|_| f32_to_f16(next() * spread)).collect();
            let index: Vec<usize> = (0..positions).collect();
            let scale = 0.125;
            let mut vector = vec![0f32; positions];
            #[allow(unsafe_code, reason = "the CPU was just found to have AVX2, FMA and F16C")]
            // SAFETY: as the allow says.
            unsafe {
                kernels::avx2::f16_scores(&q, &keys, (&index, d, 0), 0, scale, &mut vector)
            };
            let portable: Vec<f32> =
                keys.chunks_exact(d).map(|k| numerics::dot_f16(k, &q) * scale).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vector), bits(&portable), "scores, head size {d}");
            let mut expected = portable.clone();
            numerics::softmax(&mut expected);
            #[allow(unsafe_code, reason = "the CPU was just found to have AVX2, FMA and F16C")]
            // SAFETY: as the allow says.
            unsafe {
                kernels::avx2::softmax(&mut vector)
            };
            assert_eq!(bits(&vector), bits(&expected), "softmax, head size {d}");
        }
        // One group of eight: its sum alone is the total, so the order of its additions shows
        // in the weights (among many groups the total's rounding hides it).
        for trial in 0..200 {
            let mut scores: Vec<f32> = (0..8 + trial % 9).map(|_| next() * 3.0).collect();
            let mut expected = scores.clone();
            numerics::softmax(&mut expected);
            #[allow(unsafe_code, reason = "the CPU was just found to have AVX2, FMA and F16C")]
            // SAFETY: as the allow says.
            unsafe {
                kernels::avx2::softmax(&mut scores)
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&scores), bits(&expected), "softmax of {} scores", scores.len());
        }
    }

    /// F16C's rounding of the softmax weights is `round_to_f16` for every f32 but NaN: ties to
    /// even, the subnormal halves, overflow to infinity, both signs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_rounding_to_half_is_round_to_f16() {
        if !kernels::has_avx2_fma_f16c() {
            return;
        }
        // Every 97th bit pattern hits all exponents with mixed low bits; then the edges.
        let edges = [
            0x3380_0000u32,
            0x3380_0001,
            0x3300_0000,
            0x3300_0001,
            0x387f_e000,
            0x477f_f000,
            0x477f_efff,
            0x477f_f001,
        ];
        for bits in (0..=u32::MAX).step_by(97).chain(edges).chain(edges.map(|b| b | 1 << 31)) {
            let x = f32::from_bits(bits);
            if x.is_nan() {
                continue;
            }
            #[allow(unsafe_code, reason = "the CPU was just found to have AVX2, FMA and F16C")]
            // SAFETY: as the allow says.
            let vector = unsafe { kernels::avx2::round_to_f16(x) };
            assert_eq!(vector.to_bits(), round_to_f16(x).to_bits(), "{bits:#010x}");
        }
    }

    /// The vector SiLU is `numerics::swiglu` to the bit: gates far past the exponential's simple
    /// range (the scalar fallback of a group), zeros of both signs, a remainder past the last
    /// group of eight.
    #[test]
    fn vector_swiglu_is_the_portable_one_to_the_bit() {
        let mut next = uniform(0x5851_f42d_4c95_7f2d);
        for (len, spread) in [(8, 1.0), (4099, 6.0), (1000, 120.0), (13, 30.0)] {
            let mut gate: Vec<f32> = (0..len).map(|_| next() * spread).collect();
            gate[len / 2] = 0.0;
            gate[len / 3] = -0.0;
            let up: Vec<f32> = (0..len).map(|_| next()).collect();
            let vector = swiglu(&gate, &up);
            let mut portable = vec![0f32; len];
            kernels::force_portable(|| numerics::swiglu(&gate, &up, &mut portable));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vector), bits(&portable), "{len} gates of spread {spread}");
        }
    }
}
