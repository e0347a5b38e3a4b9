//! The CPU executor of scheduler plans: every token of a step goes through the model together,
//! layer by layer, with its KV read and written through its request's page table. Rows never mix:
//! each token's arithmetic is the same, in the same order, as the single-sequence reference, so a
//! request's output is bit-identical alone or in any batch (batch invariance by construction).
//!
//! A step runs on a `team`: each member takes a fixed share of every product's rows, owns the KV
//! of a fixed set of KV heads (head `h` lives in shard `h % members`), which it rotates and
//! writes, and computes the attention of a fixed share of the query heads, reading whichever
//! shards hold their KV heads. (Attention by KV head put two of SmolLM2's three KV heads on one
//! of two members: at a 2,000-token context that member's attention was the step.) Who computes
//! a value never changes the value.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use lockstep_core::kv::{PageRef, PoolConfig};
use lockstep_core::model::{
    ExecError, Executor, GrammarCompiler, RequestSampler, SamplingSpec, TokenLogprobs,
    record_outputs,
};
use lockstep_core::sched::{PageTables, RecentSamples, RequestId, StepOutputs, StepPlan};

use super::forward::{attend_head_paged, rope, swiglu};
use super::numerics::rms_norm;
use super::team::{self, Shared};
use super::{LlamaConfig, LlamaWeights, kernels};
use crate::gguf::f32_to_f16;

mod page_store;

/// The KV of some KV heads for every page of the pool, per layer: `pages * page_tokens`
/// positions of `heads.len() * head_dim` keys, and as many values, held at half precision as
/// their f16 bits (the bytes a page transfer carries; half the memory and half the bytes
/// attention reads of the f32 they round to).
#[derive(Clone, Debug)]
struct KvShard {
    /// The model's KV heads this shard holds, ascending.
    heads: Vec<usize>,
    width: usize,
    keys: Vec<Vec<u16>>,
    values: Vec<Vec<u16>>,
}

impl KvShard {
    fn new(c: &LlamaConfig, pool: PoolConfig, heads: Vec<usize>) -> KvShard {
        let width = heads.len() * c.head_dim;
        let len = pool.pages_total as usize * pool.page_tokens as usize * width;
        // Written, not just allocated zeroed (which the OS maps lazily): the pool's memory is
        // taken when the executor starts, so a machine short of it fails at start, not in the
        // middle of serving (llama.cpp clears its KV buffer at start too). Steps were no faster
        // for it, side by side: first touches were 2% of a benchmark run, spread thin.
        #[allow(
            clippy::slow_vector_initialization,
            reason = "the writes are the point: `vec![0; len]` is a lazily mapped calloc"
        )]
        let touched = || {
            let mut v = Vec::with_capacity(len);
            v.resize(len, 0u16);
            v
        };
        KvShard {
            heads,
            width,
            keys: (0..c.layers).map(|_| touched()).collect(),
            values: (0..c.layers).map(|_| touched()).collect(),
        }
    }
}

/// Where position `position` of a request with page table `table` sits in the cache, counted
/// in positions.
fn cache_index(table: &[PageRef], page_tokens: usize, position: usize) -> Result<usize, String> {
    let page = table
        .get(position / page_tokens)
        .ok_or_else(|| format!("position {position} has no page (table of {})", table.len()))?;
    Ok(page.index() as usize * page_tokens + position % page_tokens)
}

/// One token of a step: its row, position and input.
struct Slot {
    row: usize,
    position: usize,
    token: u32,
}

/// Executes plans on the CPU over paged KV. Each request's tokens are chosen by the sampler it
/// was started with (`Executor::start_request`); a request never started cannot be sampled. The
/// executor shares its weights, so it can live as long as the engine that owns it.
#[derive(Debug)]
pub struct CpuExecutor {
    weights: Arc<LlamaWeights>,
    page_tokens: usize,
    /// Pages in the pool, each with KV in every shard.
    pages: usize,
    /// One per team member: written by its member alone (each layer's new keys and values),
    /// then read by every member after a barrier (attention).
    kv: Vec<RwLock<KvShard>>,
    /// How long the team's members spin at barriers, learned across steps.
    patience: team::Patience,
    tables: PageTables,
    /// What recent steps sampled, to resolve overlap-mode placeholders.
    recent: RecentSamples,
    samplers: BTreeMap<RequestId, RequestSampler>,
    /// What compiles the grammars of constrained requests (`with_grammars`); without it a
    /// request with a grammar fails at its first draw.
    grammars: Option<Arc<dyn GrammarCompiler>>,
}

impl CpuExecutor {
    /// An executor on as many threads as the machine offers.
    pub fn new(weights: Arc<LlamaWeights>, pool: PoolConfig, slots: u32) -> CpuExecutor {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(weights, pool, slots, threads)
    }

    /// An executor whose steps run on `threads` threads (at least one).
    pub fn with_threads(
        weights: Arc<LlamaWeights>,
        pool: PoolConfig,
        slots: u32,
        threads: usize,
    ) -> CpuExecutor {
        let c = &weights.config;
        let threads = threads.max(1);
        let kv = (0..threads)
            .map(|m| {
                let heads = (0..c.kv_heads).filter(|h| h % threads == m).collect();
                RwLock::new(KvShard::new(c, pool, heads))
            })
            .collect();
        CpuExecutor {
            weights,
            page_tokens: pool.page_tokens as usize,
            pages: pool.pages_total as usize,
            kv,
            patience: team::Patience::new(),
            tables: PageTables::new(slots),
            recent: RecentSamples::default(),
            samplers: BTreeMap::new(),
            grammars: None,
        }
    }

    /// This executor, compiling requests' grammars with `grammars` (the model's).
    pub fn with_grammars(self, grammars: Arc<dyn GrammarCompiler>) -> CpuExecutor {
        CpuExecutor { grammars: Some(grammars), ..self }
    }

    /// Runs a step; returns the outputs and, per sampling row, the logits sampled from.
    pub fn execute_with_logits(
        &mut self,
        plan: &StepPlan,
    ) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        // Every sampling row's request was started: checked before any work.
        for row in plan.rows.iter().filter(|r| r.sample) {
            if !self.samplers.contains_key(&row.request) {
                return Err(format!("{}: a sampling row of a request never started", row.request));
            }
        }
        self.tables.apply(plan)?;
        record_outputs(&mut self.samplers, plan, &self.recent)?;
        let c = &self.weights.config;
        let mut slots = Vec::with_capacity(plan.input_tokens.len());
        // Per row, the cache index of every position its tokens write or read, checked before the
        // team starts so that members cannot fail halfway. One table serves all of a row's
        // tokens; positions before the first token's window stay unused at 0.
        let mut cache = Vec::with_capacity(plan.rows.len());
        let mut sampling = Vec::new();
        // The slots whose logits score a prompt token (`RequestSampler::scored_positions`), by
        // row: (row, its first scored position, the slots).
        let mut scoring: Vec<(usize, u32, Vec<usize>)> = Vec::new();
        for (r, row) in plan.rows.iter().enumerate() {
            if row.positions.is_empty() {
                return Err(format!("{}: a row with no position to compute", row.request));
            }
            let table = self.tables.table(row.slot);
            let mut indices = vec![0; row.positions.end as usize];
            let first = c.window_start(row.positions.start as usize);
            for (p, at) in indices.iter_mut().enumerate().skip(first) {
                *at = cache_index(table, self.page_tokens, p)?;
            }
            cache.push(indices);
            let first_slot = slots.len();
            for (position, input) in row.positions.clone().zip(plan.row_inputs(row)) {
                let position = position as usize;
                let token = self.recent.resolve(*input)?;
                if token as usize >= c.vocab_size {
                    return Err(format!(
                        "{}: token {token} is outside the vocabulary",
                        row.request
                    ));
                }
                slots.push(Slot { row: r, position, token });
            }
            if row.sample {
                // The row's last token, just pushed, is the one whose logits are sampled.
                sampling.push(slots.len() - 1);
            }
            if let Some(sampler) = self.samplers.get(&row.request) {
                let scored = sampler.scored_positions(row.positions.clone());
                if !scored.is_empty() {
                    let at = |p: u32| first_slot + (p - row.positions.start) as usize;
                    scoring.push((r, scored.start, scored.map(at).collect()));
                }
            }
        }
        let mut logit_slots = sampling.clone();
        logit_slots.extend(scoring.iter().flat_map(|(_, _, s)| s.iter().copied()));
        let mut logits = self.forward(&slots, &cache, &logit_slots);
        let scored_logits = logits.split_off(sampling.len());
        let mut prompt_logprobs = Vec::with_capacity(scoring.len());
        let mut scored_logits = scored_logits.iter();
        for (r, first, scored) in &scoring {
            let request = plan.rows[*r].request;
            let logits = scored_logits.by_ref().take(scored.len()).map(Vec::as_slice);
            prompt_logprobs.push(self.samplers[&request].score_positions(request, *first, logits)?);
        }
        let mut sampled = Vec::with_capacity(sampling.len());
        let mut row_logprobs: Vec<Option<TokenLogprobs>> = Vec::with_capacity(sampling.len());
        for (&t, l) in sampling.iter().zip(&logits) {
            let row = &plan.rows[slots[t].row];
            // The sampled token takes the position after the row's last.
            let sampler = self.samplers.get_mut(&row.request).ok_or("a request never started")?;
            let (token, lp) = sampler
                .sample(l, row.positions.end)
                .map_err(|e| format!("{}: {e}", row.request))?;
            sampled.push(token);
            row_logprobs.push(lp);
        }
        let mut by_row = vec![None; plan.rows.len()];
        for (&t, &token) in sampling.iter().zip(&sampled) {
            by_row[slots[t].row] = Some(token);
        }
        self.recent.record(plan.step, by_row);
        if row_logprobs.iter().all(Option::is_none) {
            row_logprobs.clear();
        }
        let outputs =
            StepOutputs { step: plan.step, sampled, logprobs: row_logprobs, prompt_logprobs };
        Ok((outputs, logits))
    }

    /// Every token of the step through every layer, on the team; returns the logits of the
    /// tokens `sampling` lists (those sampled, and those scoring a prompt token).
    fn forward(&self, slots: &[Slot], cache: &[Vec<usize>], sampling: &[usize]) -> Vec<Vec<f32>> {
        let w = &*self.weights;
        let c = &w.config;
        let n = slots.len();
        let (q_width, kv_width) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let q = Shared::new(n, q_width);
        let k = Shared::new(n, kv_width);
        let v = Shared::new(n, kv_width);
        let attended = Shared::new(n, q_width);
        let o = Shared::new(n, c.hidden);
        let act = Shared::new(n, c.ffn);
        let down = Shared::new(n, c.hidden);
        let logits = Shared::new(sampling.len(), c.vocab_size);
        team::run(self.kv.len(), &self.patience, |me| {
            // Every member keeps the residual stream of every token: it is small, and computing
            // the norms twice costs less than another barrier.
            let mut x: Vec<Vec<f32>> =
                slots.iter().map(|s| w.embed.row(s.token as usize)).collect();
            let mut h = vec![vec![0f32; c.hidden]; n];
            let mut row = vec![0f32; c.ffn.max(q_width).max(c.hidden)];
            // Each layer's attention and SwiGLU outputs of every token, and this member's gate
            // and up rows: allocated once a step, not once a layer.
            let mut all_attended = vec![vec![0f32; q_width]; n];
            let mut all_act = vec![vec![0f32; c.ffn]; n];
            let share = me.share(c.ffn);
            let (mut gate, mut up) =
                (vec![vec![0f32; share.len()]; n], vec![vec![0f32; share.len()]; n]);
            for (l, layer) in w.layers.iter().enumerate() {
                for (xi, hi) in x.iter().zip(&mut h) {
                    rms_norm(xi, &layer.attn_norm, c.rms_eps, hi);
                }
                let h_acts = layer.q.activations(&h);
                for (weight, out) in [(&layer.q, &q), (&layer.k, &k), (&layer.v, &v)] {
                    let own;
                    let acts = if weight.accepts(&h_acts) {
                        &h_acts
                    } else {
                        own = weight.activations(&h);
                        &own
                    };
                    weight.rows_with(me.share(weight.rows()), acts, |i, r, y| out.set(i, r, y));
                }
                me.sync();
                {
                    let mut shard =
                        self.kv[me.index].write().expect("a KV shard is never poisoned");
                    self.write_kv(l, slots, cache, [&k, &v], &mut shard);
                }
                // Every shard holds this layer's keys and values before anyone reads them.
                me.sync();
                {
                    let shards: Vec<RwLockReadGuard<'_, KvShard>> = self
                        .kv
                        .iter()
                        .map(|s| s.read().expect("a KV shard is never poisoned"))
                        .collect();
                    self.attend(l, slots, cache, &q, &attended, &shards, me.share(c.heads));
                }
                me.sync();
                attended.read_all(&mut all_attended);
                let acts = layer.o.activations(&all_attended);
                layer.o.rows_with(me.share(c.hidden), &acts, |i, r, y| o.set(i, r, y));
                me.sync();
                for (i, (xi, hi)) in x.iter_mut().zip(&mut h).enumerate() {
                    o.read(i, &mut row[..c.hidden]);
                    xi.iter_mut().zip(&row).for_each(|(a, b)| *a += b);
                    rms_norm(xi, &layer.ffn_norm, c.rms_eps, hi);
                }
                // Gate and up rows of the same share, then SiLU over that share at once.
                let rows = share.clone();
                let gate_acts = layer.gate.activations(&h);
                let own;
                let up_acts = if layer.up.accepts(&gate_acts) {
                    &gate_acts
                } else {
                    own = layer.up.activations(&h);
                    &own
                };
                let first = rows.start;
                layer.gate.rows_with(rows.clone(), &gate_acts, |i, r, y| gate[i][r - first] = y);
                layer.up.rows_with(rows.clone(), up_acts, |i, r, y| up[i][r - first] = y);
                for (i, (g, u)) in gate.iter().zip(&up).enumerate() {
                    for (j, y) in swiglu(g, u).into_iter().enumerate() {
                        act.set(i, first + j, y);
                    }
                }
                me.sync();
                act.read_all(&mut all_act);
                let acts = layer.down.activations(&all_act);
                layer.down.rows_with(me.share(c.hidden), &acts, |i, r, y| down.set(i, r, y));
                me.sync();
                for (i, xi) in x.iter_mut().enumerate() {
                    down.read(i, &mut row[..c.hidden]);
                    xi.iter_mut().zip(&row).for_each(|(a, b)| *a += b);
                }
            }
            let normed: Vec<Vec<f32>> = sampling
                .iter()
                .map(|&t| {
                    let mut out = vec![0f32; c.hidden];
                    rms_norm(&x[t], &w.output_norm, c.rms_eps, &mut out);
                    out
                })
                .collect();
            let output = w.output();
            let acts = output.activations(&normed);
            output.rows_with(me.share(c.vocab_size), &acts, |i, r, y| logits.set(i, r, y));
            me.sync();
        });
        logits.rows()
    }

    /// This member's keys and values of the step's tokens into its shard: its KV heads
    /// rotated (keys) and rounded to half precision. A token of a prefill chunk attends to the
    /// ones before it, so all are written before any attention.
    fn write_kv(
        &self,
        layer: usize,
        slots: &[Slot],
        cache: &[Vec<usize>],
        [k, v]: [&Shared; 2],
        shard: &mut KvShard,
    ) {
        let c = &self.weights.config;
        let d = c.head_dim;
        let bias = self.weights.layers[layer].qkv_bias.as_ref();
        let (mut k_row, mut v_row) = (vec![0f32; c.kv_heads * d], vec![0f32; c.kv_heads * d]);
        for (i, s) in slots.iter().enumerate() {
            k.read(i, &mut k_row);
            v.read(i, &mut v_row);
            if let Some([_, kb, vb]) = bias {
                k_row.iter_mut().zip(kb).for_each(|(x, b)| *x += b);
                v_row.iter_mut().zip(vb).for_each(|(x, b)| *x += b);
            }
            let at = cache[s.row][s.position] * shard.width;
            for (j, &head) in shard.heads.iter().enumerate() {
                let (src, dst) = (head * d..(head + 1) * d, at + j * d..at + (j + 1) * d);
                // Heads rotate independently: only this member's are worth rotating.
                rope(&mut k_row[src.clone()], c, s.position);
                for (o, &x) in shard.keys[layer][dst.clone()].iter_mut().zip(&k_row[src.clone()]) {
                    *o = f32_to_f16(x);
                }
                for (o, &x) in shard.values[layer][dst].iter_mut().zip(&v_row[src]) {
                    *o = f32_to_f16(x);
                }
            }
        }
    }

    /// This member's attention: query heads `heads` of every token, each over the keys and
    /// values of its KV head in whichever shard holds it.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        layer: usize,
        slots: &[Slot],
        cache: &[Vec<usize>],
        q: &Shared,
        attended: &Shared,
        shards: &[RwLockReadGuard<'_, KvShard>],
        heads: std::ops::Range<usize>,
    ) {
        let c = &self.weights.config;
        let d = c.head_dim;
        let group = c.heads / c.kv_heads;
        let bias = self.weights.layers[layer].qkv_bias.as_ref();
        let mut q_row = vec![0f32; c.heads * d];
        let mut out = vec![0f32; d];
        for (i, s) in slots.iter().enumerate() {
            q.read(i, &mut q_row);
            if let Some([qb, _, _]) = bias {
                q_row.iter_mut().zip(qb).for_each(|(x, b)| *x += b);
            }
            for h in heads.clone() {
                let kv_head = h / group;
                // Head `kv_head` lives in shard `kv_head % members`, at its place there.
                let shard = &shards[kv_head % shards.len()];
                let j = kv_head / shards.len();
                debug_assert_eq!(shard.heads[j], kv_head);
                let (keys, values) = (&shard.keys[layer], &shard.values[layer]);
                rope(&mut q_row[h * d..(h + 1) * d], c, s.position);
                let index = (&cache[s.row][..], shard.width, j * d);
                kernels::run(
                    #[inline(always)]
                    || {
                        attend_head_paged(
                            c,
                            &q_row[h * d..(h + 1) * d],
                            s.position,
                            keys,
                            values,
                            index,
                            &mut out,
                        )
                    },
                );
                for (col, &y) in out.iter().enumerate() {
                    attended.set(i, h * d + col, y);
                }
            }
        }
    }
}

impl Executor for CpuExecutor {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        let sampler = RequestSampler::new(spec, self.grammars.as_deref());
        self.samplers.insert(request, sampler);
    }

    fn end_request(&mut self, request: RequestId) {
        self.samplers.remove(&request);
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        self.execute_with_logits(plan).map(|(outputs, _)| outputs).map_err(ExecError)
    }
}
