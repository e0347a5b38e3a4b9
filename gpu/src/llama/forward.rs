//! A single-sequence forward pass with a contiguous KV cache: the plain reference the batched
//! forward over paged KV is held to. It computes in llama.cpp's order of operations (8-bit
//! activations into quantized weights, a half-precision KV cache, rotary angles by repeated
//! multiplication and fused rotations, `numerics` for the rest), so that the two agree to the
//! bit. Every reduction runs in a fixed order over one row, so a row's result never depends on
//! anything computed alongside it.

use super::kernels;
use super::numerics::{self, rms_norm};
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
pub(crate) fn attend_head<'a>(
    c: &LlamaConfig,
    q: &[f32],
    position: usize,
    key: impl Fn(usize) -> &'a [f32],
    value: impl Fn(usize) -> &'a [f32],
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
    // Value dimension `i` is a dot product over positions (as `numerics::dot_f16`): position p
    // feeds lane p % 32. Lanes are laid out lane-major, so one position updates `d` contiguous
    // accumulators.
    let mut lanes = vec![0f32; 32 * d];
    for (p, &s) in scores.iter().enumerate().skip(first) {
        let w = round_to_f16(s);
        let lane = &mut lanes[(p % 32) * d..][..d];
        for (acc, &v) in lane.iter_mut().zip(value(p)) {
            *acc = v.mul_add(w, *acc);
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

/// SiLU of `gate` times `up` (`numerics::swiglu`), with the CPU's fused multiply-add.
pub(crate) fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    kernels::run(
        #[inline(always)]
        || numerics::swiglu(gate, up, &mut out),
    );
    out
}
