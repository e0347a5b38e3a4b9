//! A single-sequence forward pass with a contiguous KV cache: the plain reference the batched
//! forward over paged KV will be held to. It follows llama.cpp's arithmetic where that is cheap
//! to do (8-bit activations into quantized weights, a half-precision KV cache, rotary angles by
//! repeated multiplication, norms summed in f64), so that the two agree closely. Every reduction
//! runs in a fixed order over one row, so a row's result never depends on anything computed
//! alongside it.

use super::matmul::dot;
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
        let c = &weights.config;
        let position = self.len;
        let mut x = weights.embed.row(token as usize);
        let mut h = vec![0f32; c.hidden];
        for (l, layer) in weights.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            let mut q = layer.q.matvec(&h);
            let mut k = layer.k.matvec(&h);
            let v = layer.v.matvec(&h);
            rope(&mut q, c, position);
            rope(&mut k, c, position);
            // The cache holds half precision, as llama.cpp's does by default.
            self.keys[l].extend(k.iter().map(|&v| round_to_f16(v)));
            self.values[l].extend(v.iter().map(|&v| round_to_f16(v)));
            let kv_width = c.kv_heads * c.head_dim;
            let (keys, values) = (&self.keys[l], &self.values[l]);
            let attended = attention(c, &q, position + 1, |p| {
                (&keys[p * kv_width..][..kv_width], &values[p * kv_width..][..kv_width])
            });
            add(&mut x, &layer.o.matvec(&attended));
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            let gate = layer.gate.matvec(&h);
            let up = layer.up.matvec(&h);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
            add(&mut x, &layer.down.matvec(&act));
        }
        self.len += 1;
        rms_norm(&x.clone(), &weights.output_norm, c.rms_eps, &mut x);
        weights.output().matvec(&x)
    }
}

pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean_square = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

pub(crate) fn rope(v: &mut [f32], c: &LlamaConfig, position: usize) {
    let d = c.head_dim;
    let theta_scale = c.rope_base.powf(-2.0 / d as f32);
    for head in v.chunks_exact_mut(d) {
        // The angle of pair i is position * theta_scale^i, by repeated multiplication.
        let mut theta = position as f32;
        for i in 0..d / 2 {
            let (sin, cos) = theta.sin_cos();
            theta *= theta_scale;
            let (a, b) = match c.rope_style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + d / 2),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }
}

/// Attention of one token's query over `positions` cached positions, whose key and value rows
/// (`kv_heads * head_dim` each) `rows(p)` gives.
pub(crate) fn attention<'a>(
    c: &LlamaConfig,
    q: &[f32],
    positions: usize,
    rows: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) -> Vec<f32> {
    let d = c.head_dim;
    let group = c.heads / c.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; c.heads * d];
    let mut scores = vec![0f32; positions];
    for h in 0..c.heads {
        let kv_head = h / group;
        // Against a half-precision cache, the query is rounded to half precision too.
        let q: Vec<f32> = q[h * d..(h + 1) * d].iter().map(|&v| round_to_f16(v)).collect();
        for (p, score) in scores.iter_mut().enumerate() {
            *score = dot(&q, &rows(p).0[kv_head * d..][..d]) * scale;
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f64;
        for s in &mut scores {
            *s = (*s - max).exp();
            total += f64::from(*s);
        }
        let total = total as f32;
        let out = &mut out[h * d..(h + 1) * d];
        for (p, &s) in scores.iter().enumerate() {
            let w = round_to_f16(s / total);
            for (o, &v) in out.iter_mut().zip(&rows(p).1[kv_head * d..][..d]) {
                *o += w * v;
            }
        }
    }
    out
}

pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
