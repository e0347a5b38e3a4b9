//! A single-sequence forward pass with a contiguous KV cache: the plain, obviously-correct
//! reference. Every reduction runs in a fixed order over one row, so a row's result never depends
//! on anything else computed alongside it.

use super::weights::Matrix;
use super::{LlamaConfig, LlamaWeights, RopeStyle};

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
        let mut x =
            weights.embed.data[token as usize * c.hidden..(token as usize + 1) * c.hidden].to_vec();
        let mut h = vec![0f32; c.hidden];
        for (l, layer) in weights.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            let mut q = matvec(&layer.q, &h);
            let mut k = matvec(&layer.k, &h);
            let v = matvec(&layer.v, &h);
            rope(&mut q, c, position);
            rope(&mut k, c, position);
            self.keys[l].extend_from_slice(&k);
            self.values[l].extend_from_slice(&v);
            let attended = attention(c, &q, &self.keys[l], &self.values[l], position + 1);
            add(&mut x, &matvec(&layer.o, &attended));
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            let gate = matvec(&layer.gate, &h);
            let up = matvec(&layer.up, &h);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
            add(&mut x, &matvec(&layer.down, &act));
        }
        self.len += 1;
        rms_norm(&x.clone(), &weights.output_norm, c.rms_eps, &mut x);
        matvec(weights.output(), &x)
    }
}

fn matvec(m: &Matrix, x: &[f32]) -> Vec<f32> {
    debug_assert_eq!(m.cols, x.len());
    m.data.chunks_exact(m.cols).map(|row| dot(row, x)).collect()
}

/// A dot product in a fixed order: eight partial sums, then combined the same way every time.
fn dot(a: &[f32], b: &[f32]) -> f32 {
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

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_square = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

fn rope(v: &mut [f32], c: &LlamaConfig, position: usize) {
    let d = c.head_dim;
    for head in v.chunks_exact_mut(d) {
        for i in 0..d / 2 {
            let theta = position as f32 * c.rope_base.powf(-2.0 * i as f32 / d as f32);
            let (sin, cos) = theta.sin_cos();
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

fn attention(
    c: &LlamaConfig,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    positions: usize,
) -> Vec<f32> {
    let d = c.head_dim;
    let kv_width = c.kv_heads * d;
    let group = c.heads / c.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; c.heads * d];
    let mut scores = vec![0f32; positions];
    for h in 0..c.heads {
        let kv_head = h / group;
        let q = &q[h * d..(h + 1) * d];
        for (p, score) in scores.iter_mut().enumerate() {
            *score = dot(q, &keys[p * kv_width + kv_head * d..][..d]) * scale;
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for s in &mut scores {
            *s = (*s - max).exp();
            total += *s;
        }
        let out = &mut out[h * d..(h + 1) * d];
        for (p, &s) in scores.iter().enumerate() {
            let w = s / total;
            for (o, &v) in out.iter_mut().zip(&values[p * kv_width + kv_head * d..][..d]) {
                *o += w * v;
            }
        }
    }
    out
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
