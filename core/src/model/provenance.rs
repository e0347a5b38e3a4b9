//! A deterministic model whose outputs prove where its KV came from.
//!
//! The KV it writes for a token is a hash of (the token, its position, the KV of the previous
//! position); the token it samples is a hash of every KV value it reads through the row's page
//! table. A request's outputs therefore depend on its own tokens alone, whatever pages, slots or
//! batch-mates it had, unless a page it reads holds another request's KV, stale KV, or KV that
//! was never written: then they change. Running a request alone and in a crowd and comparing is
//! the whole correctness check.
//!
//! Two things keep that check honest and cheap:
//! - Freed pages are poisoned (`Executor::release_pages`). Pages are reused last freed first, so
//!   a request that skips a write into a page another request with the same prefix just freed
//!   could read exactly the KV it should have written, and nothing would show. Poison is unlike
//!   any written value and unlike `UNWRITTEN`, and no two poisonings are alike, so such a read
//!   changes the output in the crowd (poison) while the same request alone reads `UNWRITTEN`.
//! - The digest that sampling hashes is kept up to date per page and per slot (`digest.rs`), so
//!   a sampled token costs O(new tokens), not a pass over the whole context. It depends on the
//!   values and their positions only, never on the page size or the chunking.

use std::collections::BTreeMap;
use std::fmt;

use super::digest::{Digests, mix};
use super::{
    ExecError, Executor, PageStore, RequestSampler, SamplingSpec, SyntheticGrammars, TokenLogprobs,
    record_outputs,
};
use crate::invariant::InvariantViolation;
use crate::kv::PoolConfig;
use crate::sched::{
    PageTables, PromptLogprobs, RecentSamples, RequestId, RowPlan, StepOutputs, StepPlan,
};

/// Marks a KV slot that no step has written since the model started.
const UNWRITTEN: u64 = 0;

/// The low two bits of every poison value (see `poison`): a written value has its low bit set
/// (`kv_value`) and `UNWRITTEN` is zero, so poison never equals either.
const POISON_TAG: u64 = 0b10;

/// Tokens the model gives a logit per sampled position; every other token has none (minus
/// infinity). Enough for temperature, top-k and top-p to choose among, few enough to be cheap.
const CANDIDATES: u32 = 8;

#[derive(Clone)]
pub struct ProvenanceModel {
    page_tokens: u32,
    vocab_size: u32,
    kv: Vec<u64>,
    tables: PageTables,
    /// What sampling hashes, kept up to date as pages change and tables are cut.
    digests: Digests,
    /// Values poisoned since the start: numbers each poison value, so no two are alike.
    poisoned: u64,
    /// What recent steps sampled, to resolve the placeholders of overlap-mode plans.
    recent: RecentSamples,
    /// How each started request samples.
    samplers: BTreeMap<RequestId, RequestSampler>,
    /// A synthetic vocabulary's grammars: a mask that follows the output.
    grammars: SyntheticGrammars,
}

impl fmt::Debug for ProvenanceModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProvenanceModel")
            .field("page_tokens", &self.page_tokens)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl ProvenanceModel {
    pub fn new(pool: PoolConfig, slots: u32, vocab_size: u32) -> ProvenanceModel {
        ProvenanceModel {
            page_tokens: pool.page_tokens,
            vocab_size: vocab_size.max(1),
            kv: vec![UNWRITTEN; pool.pages_total as usize * pool.page_tokens as usize],
            tables: PageTables::new(slots),
            digests: Digests::new(pool.pages_total, pool.page_tokens, slots),
            poisoned: 0,
            recent: RecentSamples::default(),
            samplers: BTreeMap::new(),
            grammars: SyntheticGrammars { vocab_size: vocab_size.max(1) },
        }
    }

    /// Checks that the digests it keeps say what recomputing them from the KV would (see
    /// `digest.rs`). O(store + tables): tests call it, the engine does not.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.digests.check(&self.tables, &self.kv).map_err(|e| InvariantViolation::new("model", e))
    }

    /// Hash steps sampling took since the start (one per KV value read, one per page folded
    /// into a slot's sum): its work, for tests and benchmarks that count it rather than time it.
    /// Per decode token it does not grow with the context.
    pub fn hash_steps(&self) -> u64 {
        self.digests.hash_steps()
    }
}

impl Executor for ProvenanceModel {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.samplers.insert(request, RequestSampler::new(spec, Some(&self.grammars)));
    }

    fn end_request(&mut self, request: RequestId) {
        self.samplers.remove(&request);
    }

    /// Writes the KV of every planned position, then samples each sampling row.
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        self.check_pages(plan)?;
        self.tables.apply(plan).map_err(ExecError)?;
        for row in &plan.rows {
            // Two rows of one slot (a broken plan) cut at the lower of their cuts, which is what
            // is left of the table as it was.
            self.digests.table_cut(row.slot, row.page_table_from);
        }
        record_outputs(&mut self.samplers, plan, &self.recent).map_err(ExecError)?;
        let mut by_row = Vec::with_capacity(plan.rows.len());
        let mut sampled = Vec::new();
        let mut row_logprobs = Vec::new();
        let mut prompt_logprobs = Vec::new();
        for row in &plan.rows {
            if row.positions.is_empty() {
                // A real model gets logits only by computing a position; neither may this one.
                return Err(ExecError(format!(
                    "{}: a row with no position to compute",
                    row.request
                )));
            }
            for (position, input) in row.positions.clone().zip(plan.row_inputs(row)) {
                let token = self.recent.resolve(*input).map_err(ExecError)?;
                let previous = match position {
                    0 => 0x5eed,
                    p => self.read(row.slot, p - 1)?,
                };
                let (page, slot) = self.kv_index(row.slot, position)?;
                self.kv[slot] = kv_value(token, position, previous);
                self.digests.page_changed(page);
            }
            if let Some(scored) = self.score_prompt(row)? {
                prompt_logprobs.push(scored);
            }
            if row.sample {
                // Out of the map while `sample` (which takes `self`) reads it.
                let mut sampler = self.samplers.remove(&row.request).ok_or_else(|| {
                    ExecError(format!("{}: a sampling row of a request never started", row.request))
                })?;
                let drawn = self.sample(row.slot, row.positions.end, &mut sampler);
                self.samplers.insert(row.request, sampler);
                let (token, lp) = drawn?;
                sampled.push(token);
                row_logprobs.push(lp);
                by_row.push(Some(token));
            } else {
                by_row.push(None);
            }
        }
        self.recent.record(plan.step, by_row);
        if row_logprobs.iter().all(Option::is_none) {
            row_logprobs.clear();
        }
        Ok(StepOutputs { step: plan.step, sampled, logprobs: row_logprobs, prompt_logprobs })
    }

    /// Overwrites each page with poison. A page outside the store is no page of this model and
    /// is skipped: a plan naming it is refused anyway.
    fn release_pages(&mut self, pages: &[u32]) {
        for &page in pages {
            let Ok(values) = self.page_values(page) else { continue };
            for value in &mut self.kv[values] {
                *value = poison(self.poisoned);
                self.poisoned += 1;
            }
            self.digests.page_changed(page);
        }
    }
}

/// A page is its positions' KV values, each 8 bytes little-endian: what a transfer moves.
impl PageStore for ProvenanceModel {
    fn page_bytes(&self) -> usize {
        self.page_tokens as usize * 8
    }

    fn read_page(&self, page: u32, out: &mut Vec<u8>) -> Result<(), ExecError> {
        let values = self.page_values(page)?;
        out.extend(self.kv[values].iter().flat_map(|v| v.to_le_bytes()));
        Ok(())
    }

    fn write_page(&mut self, page: u32, data: &[u8]) -> Result<(), ExecError> {
        if data.len() != self.page_bytes() {
            return Err(ExecError(format!(
                "page {page}: {} bytes written, a page is {}",
                data.len(),
                self.page_bytes()
            )));
        }
        let values = self.page_values(page)?;
        for (value, bytes) in self.kv[values].iter_mut().zip(data.chunks_exact(8)) {
            *value = u64::from_le_bytes(bytes.try_into().expect("chunks of 8"));
        }
        self.digests.page_changed(page);
        Ok(())
    }
}

impl ProvenanceModel {
    /// Refuses a plan naming a page the store does not have, before anything changes: every
    /// page a table holds is then a page of the store.
    fn check_pages(&self, plan: &StepPlan) -> Result<(), ExecError> {
        let pages_total = self.kv.len() / self.page_tokens as usize;
        match plan.page_updates.iter().find(|p| p.index() as usize >= pages_total) {
            Some(page) => Err(ExecError(format!("page {} is outside the store", page.index()))),
            None => Ok(()),
        }
    }

    fn page_values(&self, page: u32) -> Result<std::ops::Range<usize>, ExecError> {
        let start = page as usize * self.page_tokens as usize;
        let end = start + self.page_tokens as usize;
        if end > self.kv.len() {
            return Err(ExecError(format!("page {page} is outside the store")));
        }
        Ok(start..end)
    }

    /// The token sampled after `len` positions, with its log-probabilities if asked for. The
    /// logits come from a digest of every KV value read through the page table: `CANDIDATES`
    /// consecutive token ids from a point the digest picks, each with a logit the digest draws.
    fn sample(
        &mut self,
        slot: u32,
        len: u32,
        sampler: &mut RequestSampler,
    ) -> Result<(u32, Option<TokenLogprobs>), ExecError> {
        let (digest, logits) = self.candidate_logits(slot, len)?;
        let base = (digest % u64::from(self.vocab_size)) as u32;
        let token_of = |i: u32| (base + i) % self.vocab_size;
        let (chosen, lp) = sampler.sample_candidates(&logits, len, token_of).map_err(ExecError)?;
        let lp = lp.map(|l| TokenLogprobs {
            token: token_of(chosen),
            logprob: l.logprob,
            top: l.top.into_iter().map(|(i, p)| (token_of(i), p)).collect(),
        });
        Ok((token_of(chosen), lp))
    }

    /// The digest of the slot's first `len` positions, and the logits it gives its candidates
    /// (`CANDIDATES` tokens from the digest's, each a hash of the digest).
    fn candidate_logits(&mut self, slot: u32, len: u32) -> Result<(u64, Vec<f32>), ExecError> {
        let digest = self.digest(slot, len)?;
        let count = CANDIDATES.min(self.vocab_size);
        let logits = (0..u64::from(count)).map(|i| logit(digest, i + 1)).collect();
        Ok((digest, logits))
    }

    /// The log-probabilities of the prompt tokens the row's positions score, if its request
    /// asked (`RequestSampler::scored_positions`). A prompt token that is no candidate of the
    /// position before it gets a logit of its own from the same digest, beside the candidates':
    /// a scored token always has a finite log-probability, and it still depends on the request's
    /// own KV alone.
    fn score_prompt(&mut self, row: &RowPlan) -> Result<Option<PromptLogprobs>, ExecError> {
        let Some(sampler) = self.samplers.get(&row.request) else { return Ok(None) };
        let scored = sampler.scored_positions(row.positions.clone());
        if scored.is_empty() {
            return Ok(None);
        }
        let mut logprobs = Vec::with_capacity(scored.len());
        for position in scored.clone() {
            let (token, top) =
                self.samplers[&row.request].scored_token(position).ok_or_else(|| {
                    ExecError(format!("{}: position {position} scores no token", row.request))
                })?;
            let (digest, mut logits) = self.candidate_logits(row.slot, position + 1)?;
            let base = (digest % u64::from(self.vocab_size)) as u32;
            let mut tokens: Vec<u32> =
                (0..logits.len() as u32).map(|i| (base + i) % self.vocab_size).collect();
            if !tokens.contains(&token) {
                tokens.push(token);
                logits.push(logit(digest, u64::from(CANDIDATES) + 1 + u64::from(token)));
            }
            let index = tokens.iter().position(|&t| t == token).expect("pushed above") as u32;
            let l = super::logprobs(&logits, index, top);
            logprobs.push(TokenLogprobs {
                token,
                logprob: l.logprob,
                top: l.top.into_iter().map(|(i, p)| (tokens[i as usize], p)).collect(),
            });
        }
        Ok(Some(PromptLogprobs { request: row.request, from: scored.start + 1, logprobs }))
    }

    /// A hash of every KV value the first `len` positions of the slot's table hold, in order.
    fn digest(&mut self, slot: u32, len: u32) -> Result<u64, ExecError> {
        let table = self.tables.table(slot);
        if (table.len() as u64) * u64::from(self.page_tokens) < u64::from(len) {
            return Err(ExecError(format!(
                "slot {slot} position {} has no page (table of {})",
                table.len() as u64 * u64::from(self.page_tokens),
                table.len()
            )));
        }
        Ok(self.digests.digest(slot, table, len, &self.kv))
    }

    fn read(&self, slot: u32, position: u32) -> Result<u64, ExecError> {
        Ok(self.kv[self.kv_index(slot, position)?.1])
    }

    /// The page holding `position` of the slot, and where its value is in the store.
    fn kv_index(&self, slot: u32, position: u32) -> Result<(u32, usize), ExecError> {
        let table = self.tables.table(slot);
        let page = table.get((position / self.page_tokens) as usize).ok_or_else(|| {
            ExecError(format!(
                "slot {slot} position {position} has no page (table of {})",
                table.len()
            ))
        })?;
        let index = page.index() as usize * self.page_tokens as usize
            + (position % self.page_tokens) as usize;
        Ok((page.index(), index))
    }
}

/// Candidate `i`'s logit at a position of digest `digest`: in [0, 16).
fn logit(digest: u64, i: u64) -> f32 {
    (mix(digest ^ i.wrapping_mul(0x9e37_79b9)) >> 40) as f32 / 1_048_576.0
}

fn kv_value(token: u32, position: u32, previous: u64) -> u64 {
    // Never UNWRITTEN: the low bit is forced on.
    mix(u64::from(token) ^ u64::from(position) << 32 ^ previous.rotate_left(17)) | 1
}

/// The `n`th poison value since the model started: distinct for every `n` below 2^62 (more
/// values than a store could be poisoned with), and never a written value nor `UNWRITTEN`.
fn poison(n: u64) -> u64 {
    (n << 2) | POISON_TAG
}

#[cfg(test)]
#[path = "provenance_tests.rs"]
mod tests;
