//! Weight matrices and their batched products. Weights of the 32-element block types and of the
//! K-quant types stay quantized and multiply as llama.cpp's do (`blocks`, `kquants`); other types
//! are dequantized at load and multiplied in f32. Every row's reduction runs in one fixed order,
//! whatever else is computed.

use rayon::prelude::*;

use super::blocks::{BlockRows, Q8};
use super::kernels;
use super::kquants::{KBlockRows, Q8K};
use crate::gguf::{TensorType, dequantize};

/// A weight matrix: `rows` rows of `cols`, `y[r] = sum_c w[r][c] * x[c]`.
#[derive(Clone, Debug)]
pub enum Weight {
    Dense {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
    /// Rows of `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1` or `Q8_0` blocks.
    Quantized(BlockRows),
    /// Rows of `Q4_K`, `Q5_K` or `Q6_K` blocks.
    KQuantized(KBlockRows),
}

impl Weight {
    /// Keeps `bytes` quantized when its type has an 8-bit activation path, else dequantizes.
    pub fn new(kind: TensorType, rows: usize, cols: usize, bytes: &[u8]) -> Weight {
        if BlockRows::holds(kind) {
            return Weight::Quantized(BlockRows::from_ggml(kind, rows, cols, bytes));
        }
        if KBlockRows::holds(kind) {
            return Weight::KQuantized(KBlockRows::from_ggml(kind, rows, cols, bytes));
        }
        let mut data = vec![0f32; rows * cols];
        dequantize(kind, bytes, &mut data);
        Weight::Dense { rows, cols, data }
    }

    pub fn rows(&self) -> usize {
        match self {
            Weight::Dense { rows, .. } => *rows,
            Weight::Quantized(blocks) => blocks.rows(),
            Weight::KQuantized(blocks) => blocks.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::Dense { cols, .. } => *cols,
            Weight::Quantized(blocks) => blocks.cols(),
            Weight::KQuantized(blocks) => blocks.cols(),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row(&self, r: usize) -> Vec<f32> {
        match self {
            Weight::Dense { cols, data, .. } => data[r * cols..(r + 1) * cols].to_vec(),
            Weight::Quantized(blocks) => blocks.row(r),
            Weight::KQuantized(blocks) => blocks.row(r),
        }
    }

    /// `self` applied to each of `xs`: the batched product. The pool's threads take fixed ranges
    /// of the weight's rows; each output element is the same dot product, in the same order,
    /// whichever thread computes it and whatever else is in the batch, so a row of the batch
    /// comes out bit-identical alone or among others.
    pub fn matmul(&self, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let rows = self.rows();
        let n = xs.len();
        if n == 0 {
            return Vec::new();
        }
        let acts: Vec<Activation<'_>> = xs.iter().map(|x| self.activation(x)).collect();
        // Row-major results, `n` a weight row: threads write disjoint chunks.
        let mut flat = vec![0f32; rows * n];
        flat.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(task, out)| {
            let first = task * ROWS_PER_TASK;
            kernels::run(
                #[inline(always)]
                || self.rows_into(first, &acts, out),
            );
        });
        let mut out = vec![vec![0f32; rows]; n];
        for (r, products) in flat.chunks_exact(n).enumerate() {
            for (o, &p) in out.iter_mut().zip(products) {
                o[r] = p;
            }
        }
        out
    }

    /// Rows `first..` of the product with every activation, into `out` (row-major).
    #[inline(always)]
    fn rows_into(&self, first: usize, acts: &[Activation<'_>], out: &mut [f32]) {
        for (i, products) in out.chunks_exact_mut(acts.len()).enumerate() {
            for (p, act) in products.iter_mut().zip(acts) {
                *p = self.row_dot(first + i, act);
            }
        }
    }

    /// The inputs `xs` as this weight's products take them (quantized, for block weights).
    pub(crate) fn activations<'a>(&self, xs: &'a [Vec<f32>]) -> Vec<Activation<'a>> {
        xs.iter().map(|x| self.activation(x)).collect()
    }

    /// Whether `acts`, prepared for another weight, are what this weight's products take: the
    /// same activations serve Q, K and V (and gate and up) when their types agree.
    pub(crate) fn accepts(&self, acts: &[Activation<'_>]) -> bool {
        acts.iter().all(|act| {
            matches!(
                (self, act),
                (Weight::Dense { .. }, Activation::Dense(_))
                    | (Weight::Quantized(_), Activation::Q8(_))
                    | (Weight::KQuantized(_), Activation::Q8K(_))
            )
        })
    }

    /// Rows `rows` of the product with each of `acts`, each handed to `store(input, row, value)`:
    /// a team member's share of a product. The same dot products as `matmul`'s.
    pub(crate) fn rows_with(
        &self,
        rows: std::ops::Range<usize>,
        acts: &[Activation<'_>],
        mut store: impl FnMut(usize, usize, f32),
    ) {
        kernels::run(
            #[inline(always)]
            || {
                // Eight rows a pass over each input where llama.cpp repacks a Q4_0 matrix. (A
                // repacked Q4_K matrix so took twice as long at batch 1: BENCHMARKS.md.)
                let mut rows = rows;
                if let Weight::Quantized(blocks) = self
                    && blocks.repacked()
                {
                    while rows.len() >= 8 {
                        for (i, act) in acts.iter().enumerate() {
                            let Activation::Q8(act) = act else {
                                unreachable!("an activation prepared for another weight")
                            };
                            for (j, y) in blocks.dot8(rows.start, act).into_iter().enumerate() {
                                store(i, rows.start + j, y);
                            }
                        }
                        rows.start += 8;
                    }
                }
                // A tile of rows against every input, four inputs a pass over each row: the
                // tile's weights stay in the L1 cache while the inputs stream past them once a
                // tile instead of once a row (at a 2,048-token prefill the down product's
                // inputs are 3 MB).
                let mut tile = rows.start;
                while tile < rows.end {
                    let tile_rows = tile..(tile + ROWS_PER_TILE).min(rows.end);
                    tile = tile_rows.end;
                    let mut i = 0;
                    while i + 4 <= acts.len() && !matches!(self, Weight::Dense { .. }) {
                        for r in tile_rows.clone() {
                            let products = match self {
                                Weight::Dense { .. } => unreachable!("checked above"),
                                Weight::Quantized(blocks) => blocks.dot4(
                                    r,
                                    [0, 1, 2, 3].map(|j| match &acts[i + j] {
                                        Activation::Q8(act) => act,
                                        _ => unreachable!(
                                            "an activation prepared for another weight"
                                        ),
                                    }),
                                ),
                                Weight::KQuantized(blocks) => blocks.dots(
                                    r,
                                    [0, 1, 2, 3].map(|j| match &acts[i + j] {
                                        Activation::Q8K(act) => act,
                                        _ => unreachable!(
                                            "an activation prepared for another weight"
                                        ),
                                    }),
                                ),
                            };
                            for (j, y) in products.into_iter().enumerate() {
                                store(i + j, r, y);
                            }
                        }
                        i += 4;
                    }
                    for r in tile_rows {
                        for (i, act) in acts.iter().enumerate().skip(i) {
                            store(i, r, self.row_dot(r, act));
                        }
                    }
                }
            },
        );
    }

    fn activation<'a>(&self, x: &'a [f32]) -> Activation<'a> {
        match self {
            Weight::Dense { .. } => Activation::Dense(x),
            Weight::Quantized(_) => Activation::Q8(Q8::quantize(x)),
            Weight::KQuantized(_) => Activation::Q8K(Q8K::quantize(x)),
        }
    }

    #[inline(always)]
    fn row_dot(&self, r: usize, act: &Activation<'_>) -> f32 {
        match (self, act) {
            (Weight::Dense { cols, data, .. }, Activation::Dense(x)) => {
                dot(&data[r * cols..(r + 1) * cols], x)
            }
            (Weight::Quantized(blocks), Activation::Q8(act)) => blocks.dot(r, act),
            (Weight::KQuantized(blocks), Activation::Q8K(act)) => blocks.dot(r, act),
            _ => unreachable!("an activation prepared for another weight"),
        }
    }

    pub fn matvec(&self, x: &[f32]) -> Vec<f32> {
        debug_assert_eq!(x.len(), self.cols());
        self.matmul(std::slice::from_ref(&x.to_vec())).pop().expect("one product for one input")
    }
}

/// Weight rows `rows_with` multiplies by every input before moving on: 16 of a small model's
/// widest rows (1,536 columns: 18 kB of Q4_1, 26 kB of Q8_0) fit the L1 cache beside four
/// inputs.
const ROWS_PER_TILE: usize = 16;

/// Weight rows a pool task takes: enough to outweigh handing out the task, few enough that the
/// smallest products (192 rows) still spread over the threads.
const ROWS_PER_TASK: usize = 16;

/// An activation as a weight's product needs it.
pub(crate) enum Activation<'a> {
    Dense(&'a [f32]),
    Q8(Q8),
    Q8K(Q8K),
}

/// A dot product in a fixed order: eight partial sums, then combined the same way every time.
#[inline(always)]
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
