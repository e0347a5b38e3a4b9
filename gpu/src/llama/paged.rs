//! The CPU executor of scheduler plans: every token of a step goes through the model together,
//! layer by layer, with its KV read and written through its request's page table. Rows never mix:
//! each token's arithmetic is the same, in the same order, as the single-sequence reference, so a
//! request's output is bit-identical alone or in any batch (batch invariance by construction).

use std::collections::BTreeMap;

use lockstep_core::kv::{PageRef, PoolConfig};
use lockstep_core::sched::{PageTables, RecentSamples, RequestId, StepOutputs, StepPlan};

use super::LlamaWeights;
use super::forward::{add, attention, rope, swiglu};
use super::kernels;
use super::numerics::rms_norm;
use crate::gguf::round_to_f16;
use crate::sampling::{Sampler, argmax};

/// KV of every page of the pool, per layer: `pages * page_tokens` positions of
/// `kv_heads * head_dim` keys, and as many values, held at half precision (as f32 values).
#[derive(Clone, Debug)]
pub struct PagedKv {
    page_tokens: usize,
    width: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl PagedKv {
    pub fn new(weights: &LlamaWeights, pool: PoolConfig) -> PagedKv {
        let c = &weights.config;
        let width = c.kv_heads * c.head_dim;
        let len = pool.pages_total as usize * pool.page_tokens as usize * width;
        PagedKv {
            page_tokens: pool.page_tokens as usize,
            width,
            keys: vec![vec![0.0; len]; c.layers],
            values: vec![vec![0.0; len]; c.layers],
        }
    }

    fn offset(&self, table: &[PageRef], position: usize) -> Result<usize, String> {
        let page = table
            .get(position / self.page_tokens)
            .ok_or_else(|| format!("position {position} has no page (table of {})", table.len()))?;
        Ok((page.index() as usize * self.page_tokens + position % self.page_tokens) * self.width)
    }
}

/// One token of a step: its row, position and input.
struct Slot {
    row: usize,
    position: usize,
    token: u32,
}

/// Executes plans on the CPU over paged KV. Each request's tokens are chosen by its own sampler
/// (`set_sampler`), greedily where it has none.
#[derive(Debug)]
pub struct CpuExecutor<'w> {
    weights: &'w LlamaWeights,
    kv: PagedKv,
    tables: PageTables,
    /// What recent steps sampled, to resolve overlap-mode placeholders.
    recent: RecentSamples,
    samplers: BTreeMap<RequestId, Sampler>,
}

impl<'w> CpuExecutor<'w> {
    pub fn new(weights: &'w LlamaWeights, pool: PoolConfig, slots: u32) -> CpuExecutor<'w> {
        CpuExecutor {
            weights,
            kv: PagedKv::new(weights, pool),
            tables: PageTables::new(slots),
            recent: RecentSamples::default(),
            samplers: BTreeMap::new(),
        }
    }

    /// Samples `request`'s tokens with `sampler` (a generator of its own: see `Sampler::new`).
    pub fn set_sampler(&mut self, request: RequestId, sampler: Sampler) {
        self.samplers.insert(request, sampler);
    }

    /// Drops what is kept for `request`; call when it finishes.
    pub fn forget(&mut self, request: RequestId) {
        self.samplers.remove(&request);
    }

    /// Runs a step; returns the outputs and, per sampling row, the logits sampled from.
    pub fn execute(&mut self, plan: &StepPlan) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        kernels::in_pool(|| self.execute_in_pool(plan))
    }

    fn execute_in_pool(&mut self, plan: &StepPlan) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        self.tables.apply(plan)?;
        let mut slots = Vec::with_capacity(plan.input_tokens.len());
        for (r, row) in plan.rows.iter().enumerate() {
            if row.positions.is_empty() {
                return Err(format!("{}: a row with no position to compute", row.request));
            }
            for (position, input) in row.positions.clone().zip(plan.row_inputs(row)) {
                slots.push(Slot {
                    row: r,
                    position: position as usize,
                    token: self.recent.resolve(*input)?,
                });
            }
        }
        let last_of_sampling_rows: Vec<usize> = plan
            .rows
            .iter()
            .enumerate()
            .filter(|(_, row)| row.sample)
            .map(|(r, _)| slots.iter().rposition(|s| s.row == r).expect("a row has a token"))
            .collect();
        let hidden = self.forward(plan, &slots)?;
        let c = &self.weights.config;
        let mut logits = Vec::with_capacity(last_of_sampling_rows.len());
        let mut normed = vec![0f32; c.hidden];
        for &t in &last_of_sampling_rows {
            rms_norm(&hidden[t], &self.weights.output_norm, c.rms_eps, &mut normed);
            logits.push(self.weights.output().matvec(&normed));
        }
        let sampled: Vec<u32> = last_of_sampling_rows
            .iter()
            .zip(&logits)
            .map(|(&t, l)| match self.samplers.get_mut(&plan.rows[slots[t].row].request) {
                Some(sampler) => sampler.sample(l),
                None => argmax(l),
            })
            .collect();
        let mut by_row = vec![None; plan.rows.len()];
        for (&t, &token) in last_of_sampling_rows.iter().zip(&sampled) {
            by_row[slots[t].row] = Some(token);
        }
        self.recent.record(plan.step, by_row);
        Ok((StepOutputs { step: plan.step, sampled }, logits))
    }

    /// Every token of the step through every layer; returns the final hidden states.
    fn forward(&mut self, plan: &StepPlan, slots: &[Slot]) -> Result<Vec<Vec<f32>>, String> {
        let w = self.weights;
        let c = &w.config;
        let tables: Vec<&[PageRef]> =
            plan.rows.iter().map(|row| self.tables.table(row.slot)).collect();
        let mut x: Vec<Vec<f32>> = slots.iter().map(|s| w.embed.row(s.token as usize)).collect();
        let mut h = vec![vec![0f32; c.hidden]; slots.len()];
        for (l, layer) in w.layers.iter().enumerate() {
            for (xi, hi) in x.iter().zip(&mut h) {
                rms_norm(xi, &layer.attn_norm, c.rms_eps, hi);
            }
            let [mut q, mut k, v] = layer.qkv(&h);
            for (i, s) in slots.iter().enumerate() {
                rope(&mut q[i], c, s.position);
                rope(&mut k[i], c, s.position);
                let at = self.kv.offset(tables[s.row], s.position)?;
                let width = self.kv.width;
                for (dst, &src) in self.kv.keys[l][at..at + width].iter_mut().zip(&k[i]) {
                    *dst = round_to_f16(src);
                }
                for (dst, &src) in self.kv.values[l][at..at + width].iter_mut().zip(&v[i]) {
                    *dst = round_to_f16(src);
                }
            }
            let mut attended = Vec::with_capacity(slots.len());
            for (i, s) in slots.iter().enumerate() {
                let table = tables[s.row];
                let kv = &self.kv;
                // Masked positions are never read; their offsets stand unused at 0.
                let first = c.window_start(s.position);
                let mut offsets = vec![0; s.position + 1];
                for (p, offset) in offsets.iter_mut().enumerate().skip(first) {
                    *offset = kv.offset(table, p)?;
                }
                let (keys, values) = (&kv.keys[l], &kv.values[l]);
                attended.push(attention(c, &q[i], s.position, |p| {
                    (
                        &keys[offsets[p]..offsets[p] + kv.width],
                        &values[offsets[p]..offsets[p] + kv.width],
                    )
                }));
            }
            let o = layer.o.matmul(&attended);
            for (xi, oi) in x.iter_mut().zip(&o) {
                add(xi, oi);
            }
            for (xi, hi) in x.iter().zip(&mut h) {
                rms_norm(xi, &layer.ffn_norm, c.rms_eps, hi);
            }
            let gate = layer.gate.matmul(&h);
            let up = layer.up.matmul(&h);
            let act: Vec<Vec<f32>> = gate.iter().zip(&up).map(|(g, u)| swiglu(g, u)).collect();
            let down = layer.down.matmul(&act);
            for (xi, di) in x.iter_mut().zip(&down) {
                add(xi, di);
            }
        }
        Ok(x)
    }
}
