//! Choosing a request's next token from logits, and the log-probabilities a client may ask for.
//!
//! Every executor samples through this one definition, so a request's parameters and seed mean
//! the same thing on the CPU backend, a GPU backend and the provenance model. A draw depends only
//! on (the request's seed, the position the token takes in its sequence, the logits): never on
//! how many draws came before. A request preempted and recomputed, or one whose sample an
//! overlap step discarded, therefore draws exactly what it would have drawn running alone, and the
//! same seed and prompt give the same completion whatever request id or batch they land in.
//!
//! Penalties (`Sampling::has_penalties`) also read the request's output before the position,
//! which each executor learns from the plans' inputs (`OutputTokens`), so they too depend only
//! on the request's own sequence.

use std::collections::BTreeMap;
use std::ops::Range;

use super::grammar::{Constraint, Grammar, GrammarCompiler};
use super::output_tokens::{OutputTokens, counts};
use crate::sched::{PromptLogprobs, RecentSamples, RequestId, StepPlan};
use crate::wire::Sampling;

/// How one request samples, as its executor is told before any plan names it.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingSpec {
    pub sampling: Sampling,
    /// Log-probabilities to report per sampled token: `None` for none, `Some(n)` for the chosen
    /// token's and the `n` most likely alternatives' (at most `TOP_LOGPROBS_MAX`).
    pub logprobs: Option<u8>,
    /// The prompt's length: the output, which penalties count, starts at this position.
    pub prompt_tokens: u32,
    /// The prompt's distinct tokens, by token, when the request has a repetition penalty (which
    /// counts them; empty otherwise): a decode worker's executor never sees the prompt's tokens
    /// as inputs, nor does one whose prefix cache held them.
    pub prompt_vocabulary: Vec<u32>,
    /// OpenAI's `logit_bias`: (token, bias) added to the token's logit before anything else,
    /// by token (`RequestSpec::logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow, if any (`RequestSpec::grammar`).
    pub grammar: Option<Grammar>,
    /// Log-probabilities of the prompt's own tokens (vLLM's `prompt_logprobs`; what OpenAI's
    /// `echo` with `logprobs` shows): `Some(n)` for each prompt token's after the first, under
    /// the logits of the position before it, with the `n` most likely alternatives there. The
    /// request's scheduler then computes every prompt position (`Scheduler::submit_scoring`).
    pub prompt_logprobs: Option<u8>,
    /// The prompt, when `prompt_logprobs` asks for its tokens' log-probabilities (else empty):
    /// the logits of position `p` score token `p + 1`.
    pub scored_prompt: Vec<u32>,
}

impl SamplingSpec {
    pub const GREEDY: SamplingSpec = SamplingSpec {
        sampling: Sampling::GREEDY,
        logprobs: None,
        prompt_tokens: 0,
        prompt_vocabulary: Vec::new(),
        logit_bias: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        scored_prompt: Vec::new(),
    };
    /// OpenAI's limit on `top_logprobs`.
    pub const TOP_LOGPROBS_MAX: u8 = 20;

    /// A request's spec: its sampling, no log-probabilities or bias, and what its prompt tells
    /// the penalties (`with_prompt`).
    pub fn for_prompt(sampling: Sampling, prompt: &[u32]) -> SamplingSpec {
        SamplingSpec { sampling, ..SamplingSpec::GREEDY }.with_prompt(prompt)
    }

    /// This spec for a request of `prompt`: its length, and its distinct tokens if the
    /// repetition penalty reads them.
    pub fn with_prompt(self, prompt: &[u32]) -> SamplingSpec {
        let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let mut prompt_vocabulary = Vec::new();
        if self.sampling.repetition_penalty != 1.0 {
            prompt_vocabulary = prompt.to_vec();
            prompt_vocabulary.sort_unstable();
            prompt_vocabulary.dedup();
        }
        SamplingSpec { prompt_tokens, prompt_vocabulary, ..self }
    }

    /// This spec scoring `prompt`'s tokens with `top` alternatives each (`prompt_logprobs`).
    pub fn scoring(self, prompt: &[u32], top: u8) -> SamplingSpec {
        SamplingSpec { prompt_logprobs: Some(top), scored_prompt: prompt.to_vec(), ..self }
    }

    /// The record of the output that penalties and a grammar read, if the request has either.
    pub fn output_tokens(&self) -> Option<OutputTokens> {
        let reads_output = self.sampling.has_penalties() || self.grammar.is_some();
        reads_output.then(|| OutputTokens::new(self.prompt_tokens))
    }
}

/// The log-probabilities of one sampled token under the model's distribution (the raw logits,
/// before temperature, top-k or top-p, as vLLM reports them by default).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first, ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// One request's sampler. Stateless between draws (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    params: Sampling,
}

impl Sampler {
    pub fn new(params: Sampling) -> Sampler {
        Sampler { params }
    }

    pub fn params(&self) -> Sampling {
        self.params
    }

    /// Whether a draw is the largest logit's token. NaN and negative temperatures are refused at
    /// the edge; anything not above zero here is greedy, and so is a top-k of one.
    pub fn is_greedy(&self) -> bool {
        let p = self.params;
        p.temperature.is_nan() || p.temperature <= 0.0 || p.top_k == 1
    }

    /// Whether `penalize` changes logits: then an executor samples from logits on the host,
    /// never by an argmax on the device.
    pub fn has_penalties(&self) -> bool {
        self.params.has_penalties()
    }

    /// The penalties on `logits` (index = token id), given the request's output so far and its
    /// prompt's distinct tokens (`SamplingSpec::prompt_vocabulary`): every token of either
    /// `penalized`. Tokens past the end of `logits` are skipped.
    pub fn penalize(&self, logits: &mut [f32], output: &[u32], prompt_vocabulary: &[u32]) {
        if !self.has_penalties() {
            return;
        }
        let counts = counts(output);
        let mut tokens: Vec<u32> = counts
            .iter()
            .map(|&(token, _)| token)
            .chain(prompt_vocabulary.iter().copied())
            .collect();
        tokens.sort_unstable();
        tokens.dedup();
        for token in tokens {
            if let Some(logit) = logits.get_mut(token as usize) {
                let (count, in_prompt) = occurrences(&counts, prompt_vocabulary, token);
                *logit = self.penalized(*logit, count, in_prompt);
            }
        }
    }

    /// A logit whose token occurs `count` times in the output and, if `in_prompt`, in the
    /// prompt, penalized in vLLM's order: the repetition penalty (if it occurs in either:
    /// divided if positive, multiplied if not), then OpenAI's `frequency_penalty * count` and
    /// `presence_penalty` (if it occurs in the output).
    pub fn penalized(&self, logit: f32, count: u32, in_prompt: bool) -> f32 {
        let p = self.params;
        let mut logit = logit;
        if count > 0 || in_prompt {
            let r = p.repetition_penalty;
            logit = if logit > 0.0 { logit / r } else { logit * r };
        }
        if count > 0 {
            logit = (logit - p.frequency_penalty * count as f32) - p.presence_penalty;
        }
        logit
    }

    /// The token at sequence position `position`, drawn from `logits` (index = token id).
    pub fn sample(&self, logits: &[f32], position: u32) -> u32 {
        assert!(!logits.is_empty(), "sampling from no logits");
        let p = self.params;
        if self.is_greedy() {
            return argmax(logits);
        }
        // Candidates in order of decreasing logit, ties by lower id: no hidden tie-breaks.
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k as usize);
        }
        let max = logits[order[0] as usize];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| f64::from((logits[i as usize] - max) / p.temperature).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.min_p > 0.0 {
            // Decreasing: the candidates above the cut are a prefix. The first always stays.
            let floor = f64::from(p.min_p) * probs[0];
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            order.truncate(keep);
            probs.truncate(keep);
            // Top-p's mass is of what is left, as when min-p sets the rest to -inf first (vLLM).
            let kept: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= kept);
        }
        if p.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = probs.iter().position(|&q| {
                mass += q;
                mass >= f64::from(p.top_p)
            });
            let keep = keep.map_or(probs.len(), |i| i + 1);
            order.truncate(keep);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut draw = uniform(p.seed, position) * total;
        for (&id, &q) in order.iter().zip(&probs) {
            if draw < q {
                return id;
            }
            draw -= q;
        }
        *order.last().expect("at least one candidate")
    }
}

/// What an executor keeps for a request it has started: its sampler, the log-probabilities it
/// asked for, its grammar compiled, and, with penalties or a grammar, its output so far. Every
/// executor samples through this, so a penalty or a grammar means the same on each.
#[derive(Clone, Debug)]
pub struct RequestSampler {
    sampler: Sampler,
    /// Top log-probabilities to report (`SamplingSpec::logprobs`).
    top: Option<u8>,
    output: Option<OutputTokens>,
    /// `SamplingSpec::prompt_vocabulary`.
    prompt_vocabulary: Vec<u32>,
    /// By token.
    logit_bias: Vec<(u32, f32)>,
    constraint: Option<Constraint>,
    /// Top alternatives of each prompt token's log-probabilities, when the request asked for
    /// them (`SamplingSpec::prompt_logprobs`), and the prompt they score.
    prompt_top: Option<u8>,
    scored_prompt: Vec<u32>,
}

impl RequestSampler {
    /// A sampler for `spec`; its grammar, if it has one, compiled by `grammars` (without one,
    /// or if the grammar fails there, sampling the request is an error).
    pub fn new(spec: SamplingSpec, grammars: Option<&dyn GrammarCompiler>) -> RequestSampler {
        let output = spec.output_tokens();
        let mut logit_bias = spec.logit_bias;
        logit_bias.sort_by_key(|&(token, _)| token);
        RequestSampler {
            sampler: Sampler::new(spec.sampling),
            top: spec.logprobs,
            output,
            prompt_vocabulary: spec.prompt_vocabulary,
            logit_bias,
            constraint: spec.grammar.map(|grammar| Constraint::compile(&grammar, grammars)),
            prompt_top: spec.prompt_logprobs,
            scored_prompt: spec.scored_prompt,
        }
    }

    /// The positions of `positions` whose logits score a prompt token (the one after each), if
    /// the request asked for its prompt's log-probabilities: none past the prompt's second to
    /// last, whose logits give the first output token.
    pub fn scored_positions(&self, positions: Range<u32>) -> Range<u32> {
        let scored = match self.prompt_top {
            Some(_) => {
                u32::try_from(self.scored_prompt.len()).unwrap_or(u32::MAX).saturating_sub(1)
            }
            None => 0,
        };
        positions.start..positions.end.min(scored).max(positions.start)
    }

    /// The prompt token that position `position`'s logits score, and the top alternatives to
    /// report with it; `None` unless `scored_positions` lists the position.
    pub fn scored_token(&self, position: u32) -> Option<(u32, u8)> {
        let top = self.prompt_top?;
        let token = *self.scored_prompt.get(position as usize + 1)?;
        Some((token, top))
    }

    /// The log-probabilities of the prompt token after `position` under `logits` (index = token
    /// id): the raw logits, as sampled tokens' are reported.
    pub fn prompt_logprobs(&self, logits: &[f32], position: u32) -> Result<TokenLogprobs, String> {
        let (token, top) = self
            .scored_token(position)
            .ok_or_else(|| format!("position {position} scores no prompt token"))?;
        if token as usize >= logits.len() {
            return Err(format!("prompt token {token} is outside {} logits", logits.len()));
        }
        Ok(logprobs(logits, token, top))
    }

    /// Request `request`'s row's scores: `logits` are those of its scored positions from `first`
    /// on, in order (`scored_positions`), each scoring the prompt token after it.
    pub fn score_positions<'a>(
        &self,
        request: RequestId,
        first: u32,
        logits: impl IntoIterator<Item = &'a [f32]>,
    ) -> Result<PromptLogprobs, String> {
        let logprobs = (first..)
            .zip(logits)
            .map(|(position, l)| self.prompt_logprobs(l, position))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{request}: {e}"))?;
        Ok(PromptLogprobs { request, from: first + 1, logprobs })
    }

    /// The plan's input at `position` is `token` (a no-op without penalties).
    pub fn record(&mut self, position: u32, token: u32) -> Result<(), String> {
        match self.output.as_mut() {
            Some(output) => output.record(position, token),
            None => Ok(()),
        }
    }

    /// Whether sampling needs the logits on the host: not greedy, a bias, penalties or a
    /// grammar, or log-probabilities.
    pub fn needs_logits(&self) -> bool {
        !self.sampler.is_greedy()
            || self.output.is_some()
            || !self.logit_bias.is_empty()
            || self.top.is_some()
    }

    /// Whether the logits are changed before the draw: a bias or penalties.
    fn adjusts(&self) -> bool {
        self.sampler.has_penalties() || !self.logit_bias.is_empty()
    }

    /// The tokens the grammar allows at `position`, if the request has one.
    fn allowed(&mut self, position: u32) -> Result<Option<super::TokenMask>, String> {
        let Some(constraint) = self.constraint.as_mut() else { return Ok(None) };
        let output = self.output.as_ref().ok_or("a grammar without its output record")?;
        constraint.allowed(output.before(position)?).map(Some)
    }

    /// The token for `position` from `logits` (index = token id), biased, then penalized by the
    /// output before it, then drawn among the tokens its grammar allows (as if the others' logits
    /// were -inf), and its log-probabilities under the raw logits if asked for (as vLLM reports
    /// them by default).
    pub fn sample(
        &mut self,
        logits: &[f32],
        position: u32,
    ) -> Result<(u32, Option<TokenLogprobs>), String> {
        let allowed = self.allowed(position)?;
        let token = if self.adjusts() {
            let mut adjusted = logits.to_vec();
            for &(token, bias) in &self.logit_bias {
                if let Some(logit) = adjusted.get_mut(token as usize) {
                    *logit += bias;
                }
            }
            if let Some(output) = &self.output {
                let output = output.before(position)?;
                self.sampler.penalize(&mut adjusted, output, &self.prompt_vocabulary);
            }
            self.draw(&adjusted, position, allowed.as_ref(), |i| i)?
        } else {
            self.draw(logits, position, allowed.as_ref(), |i| i)?
        };
        Ok((token, self.top.map(|top| logprobs(logits, token, top))))
    }

    /// `sample` over candidates: `logits[i]` is token `token_of(i)`'s. Returns the candidate's
    /// index and its log-probabilities over the candidates (indices, not tokens).
    pub fn sample_candidates(
        &mut self,
        logits: &[f32],
        position: u32,
        token_of: impl Fn(u32) -> u32,
    ) -> Result<(u32, Option<TokenLogprobs>), String> {
        let allowed = self.allowed(position)?;
        let chosen = if self.adjusts() {
            let counts = match &self.output {
                Some(output) => counts(output.before(position)?),
                None => Vec::new(),
            };
            let mut adjusted = logits.to_vec();
            for (i, logit) in (0u32..).zip(&mut adjusted) {
                let token = token_of(i);
                if let Ok(at) = self.logit_bias.binary_search_by_key(&token, |&(t, _)| t) {
                    *logit += self.logit_bias[at].1;
                }
                let (count, in_prompt) = occurrences(&counts, &self.prompt_vocabulary, token);
                if self.sampler.has_penalties() {
                    *logit = self.sampler.penalized(*logit, count, in_prompt);
                }
            }
            self.draw(&adjusted, position, allowed.as_ref(), &token_of)?
        } else {
            self.draw(logits, position, allowed.as_ref(), &token_of)?
        };
        Ok((chosen, self.top.map(|top| logprobs(logits, chosen, top))))
    }

    /// The index drawn from `logits` (index `i` is token `token_of(i)`), among the allowed
    /// tokens only when there is a grammar: the draw sees them in index order, as it would see
    /// the whole row with every other logit at -inf, without relying on -inf arithmetic.
    fn draw(
        &self,
        logits: &[f32],
        position: u32,
        allowed: Option<&super::TokenMask>,
        token_of: impl Fn(u32) -> u32,
    ) -> Result<u32, String> {
        let Some(mask) = allowed else { return Ok(self.sampler.sample(logits, position)) };
        let indices: Vec<u32> =
            (0..logits.len() as u32).filter(|&i| mask.allows(token_of(i))).collect();
        if indices.is_empty() {
            return Err(format!("the grammar allows no token of the {} sampled", logits.len()));
        }
        let kept: Vec<f32> = indices.iter().map(|&i| logits[i as usize]).collect();
        Ok(indices[self.sampler.sample(&kept, position) as usize])
    }
}

/// Records each row's inputs into its request's sampler (`RequestSampler::record`), for the
/// requests whose penalties or grammar read their output; the others cost nothing. Every executor calls it
/// once a step, before it samples; `recent` resolves the overlap placeholders.
pub fn record_outputs(
    samplers: &mut BTreeMap<RequestId, RequestSampler>,
    plan: &StepPlan,
    recent: &RecentSamples,
) -> Result<(), String> {
    for row in &plan.rows {
        let Some(sampler) = samplers.get_mut(&row.request).filter(|s| s.output.is_some()) else {
            continue;
        };
        for (position, &input) in row.positions.clone().zip(plan.row_inputs(row)) {
            let token = recent.resolve(input)?;
            sampler.record(position, token).map_err(|e| format!("{}: {e}", row.request))?;
        }
    }
    Ok(())
}

/// How often `token` occurs in the output (`counts`, by token) and whether it is in the prompt
/// (`prompt_vocabulary`, by token).
fn occurrences(counts: &[(u32, u32)], prompt_vocabulary: &[u32], token: u32) -> (u32, bool) {
    let count = counts.binary_search_by_key(&token, |&(t, _)| t).map_or(0, |at| counts[at].1);
    (count, prompt_vocabulary.binary_search(&token).is_ok())
}

/// The index of the largest logit; ties go to the lowest index.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `token`'s log-probability under `logits`, and the `top` most likely tokens'. Sums in f64 so
/// that a 150k-entry vocabulary loses nothing to rounding.
pub fn logprobs(logits: &[f32], token: u32, top: u8) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_total = f64::from(max) + sum.ln();
    let of = |id: u32| (f64::from(logits[id as usize]) - log_total) as f32;
    let mut best: Vec<u32> = Vec::with_capacity(usize::from(top) + 1);
    if top > 0 {
        // A bounded selection, not a sort of the whole vocabulary. Ids come in ascending order
        // and only a strictly greater logit goes ahead: a tie stays behind the lower id.
        for id in 0..logits.len() as u32 {
            let better =
                |other: &u32| logits[id as usize].total_cmp(&logits[*other as usize]).is_gt();
            let at = best.iter().position(better).unwrap_or(best.len());
            if at < usize::from(top) {
                best.insert(at, id);
                best.truncate(usize::from(top));
            }
        }
    }
    TokenLogprobs {
        token,
        logprob: of(token),
        top: best.into_iter().map(|id| (id, of(id))).collect(),
    }
}

/// Uniform in [0, 1) with 53 bits, from (seed, position) alone.
fn uniform(seed: u64, position: u32) -> f64 {
    let mut z =
        seed ^ u64::from(position).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{TokenMask, TokenMatcher};

    fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> Sampling {
        Sampling { temperature, top_k, top_p, seed, ..Sampling::GREEDY }
    }

    /// Every executor's draws for a seed (the CPU's, CUDA's, the simulator's reference) come from
    /// `uniform`: a change to it changes every sampled output of every seed, which a user who
    /// pinned one sees. Pinned from an independent transcription (Python, 64-bit masks).
    #[test]
    fn the_uniform_draws_of_a_seed_and_position_are_pinned() {
        let pinned: [(u64, u32, u64); 4] = [
            (0, 0, 5_248_942_316_788_664),
            (7, 40, 6_124_246_089_969_453),
            (u64::MAX, 4_000_000_000, 7_916_379_300_303_072),
            (1_000_003, 1, 7_596_905_783_066_459),
        ];
        for (seed, position, bits) in pinned {
            let expected = bits as f64 / (1u64 << 53) as f64;
            assert_eq!(uniform(seed, position), expected, "seed {seed}, position {position}");
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let s = Sampler::new(Sampling::GREEDY);
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], 0), 1);
        let nan = Sampler::new(params(f32::NAN, 0, 1.0, 1));
        assert_eq!(nan.sample(&[0.1, 3.0, 3.0, -1.0], 0), 1, "a NaN temperature is greedy");
    }

    #[test]
    fn top_k_one_is_greedy_and_draws_depend_on_seed_and_position_only() {
        let logits = [0.5, 2.0, 1.9, -3.0, 1.0];
        let s = Sampler::new(params(1.0, 1, 1.0, 7));
        assert!((0..50).all(|p| s.sample(&logits, p) == 1));
        let draw = |seed| {
            let s = Sampler::new(params(0.8, 0, 0.95, seed));
            (0..64).map(|p| s.sample(&logits, p)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7), "same seed, same tokens");
        assert_ne!(draw(7), draw(8), "another seed draws otherwise");
        // Draws are independent of order: position 40 alone draws what it drew in sequence.
        let s = Sampler::new(params(0.8, 0, 0.95, 7));
        assert_eq!(s.sample(&logits, 40), draw(7)[40]);
    }

    #[test]
    fn min_p_cuts_below_its_share_of_the_most_likely_and_top_p_reads_what_is_left() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03 at temperature 1.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let drawn = |min_p: f32, top_p: f32| {
            let s = Sampler::new(Sampling { min_p, ..params(1.0, 0, top_p, 3) });
            let mut counts = [0u32; 4];
            for position in 0..20_000 {
                counts[s.sample(&logits, position) as usize] += 1;
            }
            counts
        };
        // 0.2 * 0.64 = 0.128: tokens 2 and 3 are cut.
        let counts = drawn(0.2, 1.0);
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        let share = f64::from(counts[0]) / 20_000.0;
        assert!((share - 0.64 / 0.88).abs() < 0.02, "top token drawn {share}");
        // What is left is about 0.73 and 0.27: a top-p of 0.7 keeps the first alone (it would
        // keep two of the uncut four, whose first has 0.64).
        assert_eq!(drawn(0.2, 0.7), [20_000, 0, 0, 0]);
        assert!(drawn(0.0, 0.7)[1] > 0);
        // A min-p of 1 keeps the most likely only; ties of it stay.
        assert_eq!(drawn(1.0, 1.0), [20_000, 0, 0, 0]);
    }

    #[test]
    fn top_p_cuts_the_tail_and_frequencies_follow_probabilities() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03 at temperature 1.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let s = Sampler::new(params(1.0, 0, 0.85, 1));
        let mut counts = [0u32; 4];
        for position in 0..20_000 {
            counts[s.sample(&logits, position) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "beyond top-p: never drawn");
        let share = f64::from(counts[0]) / 20_000.0;
        assert!((share - 0.64 / 0.88).abs() < 0.02, "top token drawn {share}");
    }

    /// Every candidate's share of the draws is its softmax probability at the temperature, and
    /// logits far from zero draw as their differences do (the largest is subtracted before
    /// `exp`, which would overflow otherwise).
    #[test]
    fn draws_follow_the_softmax_at_the_temperature_over_every_candidate() {
        let logits = [1002.0, 1001.0, 1000.5, 1000.0];
        let s = Sampler::new(params(0.5, 0, 1.0, 11));
        let draws = 40_000;
        let mut counts = [0u32; 4];
        for position in 0..draws {
            counts[s.sample(&logits, position) as usize] += 1;
        }
        // exp((logit - max) / 0.5): e^0, e^-2, e^-3, e^-4.
        let weights = [0.0f64, -2.0, -3.0, -4.0].map(f64::exp);
        let total: f64 = weights.iter().sum();
        for (token, (&count, weight)) in counts.iter().zip(weights).enumerate() {
            let expected = weight / total;
            let share = f64::from(count) / f64::from(draws);
            let sd = (expected * (1.0 - expected) / f64::from(draws)).sqrt();
            assert!(
                (share - expected).abs() < 5.0 * sd,
                "token {token} drawn {share:.4}, its probability {expected:.4}: {counts:?}"
            );
        }
    }

    #[test]
    fn penalties_take_frequency_times_count_then_presence_off_the_output_s_tokens() {
        let penalized = |presence, frequency, output: &[u32]| {
            let p = Sampling {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..params(0.0, 0, 1.0, 0)
            };
            let mut logits = [1.0f32, 2.0, 3.0, 4.0];
            Sampler::new(p).penalize(&mut logits, output, &[]);
            logits
        };
        assert_eq!(penalized(0.0, 0.0, &[3, 3]), [1.0, 2.0, 3.0, 4.0], "no penalty, no change");
        assert_eq!(penalized(0.5, 0.0, &[3, 3, 1]), [1.0, 1.5, 3.0, 3.5]);
        assert_eq!(penalized(0.0, 0.75, &[3, 3, 1]), [1.0, 1.25, 3.0, 2.5]);
        // vLLM's order: frequency first, then presence; negative values reward.
        assert_eq!(penalized(-1.0, 0.5, &[0, 0, 0]), [(1.0 - 1.5) + 1.0, 2.0, 3.0, 4.0]);
        // A token past the logits (another vocabulary's) is skipped, not a panic.
        assert_eq!(penalized(1.0, 1.0, &[9]), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(counts(&[5, 1, 5, 5, 0]), vec![(0, 1), (1, 1), (5, 3)]);
    }

    #[test]
    fn the_repetition_penalty_divides_or_multiplies_prompt_and_output_tokens_first() {
        let p =
            Sampling { repetition_penalty: 2.0, frequency_penalty: 0.5, ..params(0.0, 0, 1.0, 0) };
        let mut logits = [1.0f32, -2.0, 3.0, 4.0, 6.0];
        // Token 0 in the prompt and the output twice, 1 in the prompt, 3 in the output, 4 in
        // neither; the vocabulary's last token is not penalized by an out-of-range id.
        Sampler::new(p).penalize(&mut logits, &[0, 3, 0, 7], &[0, 1, 9]);
        assert_eq!(logits, [1.0 / 2.0 - 1.0, -2.0 * 2.0, 3.0, 4.0 / 2.0 - 0.5, 6.0]);
        // Over candidates the same: token 9 is candidate 0 (in the prompt), token 3 candidate 1.
        let spec = SamplingSpec::for_prompt(p, &[9, 1, 1]);
        assert_eq!(spec.prompt_vocabulary, [1, 9]);
        let mut sampler = RequestSampler::new(spec, None);
        for (position, token) in [(0, 9), (1, 1), (2, 1), (3, 3)] {
            sampler.record(position, token).unwrap();
        }
        // 5.0 / 2 = 2.5 against (4.0 / 2) - 0.5 = 1.5 and an untouched 2.4.
        let (chosen, _) =
            sampler.sample_candidates(&[5.0, 4.0, 2.4], 4, |i| [9, 3, 8][i as usize]).unwrap();
        assert_eq!(chosen, 0);
        let (chosen, _) =
            sampler.sample_candidates(&[4.0, 4.0, 2.4], 4, |i| [9, 3, 8][i as usize]).unwrap();
        assert_eq!(chosen, 2, "2.0 and 1.5 against 2.4");
        assert!(SamplingSpec::for_prompt(Sampling::GREEDY, &[1, 2]).prompt_vocabulary.is_empty());
    }

    #[test]
    fn a_request_sampler_penalizes_only_with_penalties_and_reports_raw_logprobs() {
        let logits = [1.0f32, 3.0, 2.9, 0.0];
        let spec = |presence| SamplingSpec {
            sampling: Sampling { presence_penalty: presence, ..Sampling::GREEDY },
            logprobs: Some(1),
            ..SamplingSpec::for_prompt(Sampling::GREEDY, &[1, 1])
        };
        let mut plain = RequestSampler::new(spec(0.0), None);
        let mut penalized = RequestSampler::new(spec(0.5), None);
        for sampler in [&mut plain, &mut penalized] {
            for (position, token) in [(0, 1), (1, 1), (2, 1)] {
                sampler.record(position, token).unwrap();
            }
        }
        assert!(!RequestSampler::new(SamplingSpec::GREEDY, None).needs_logits());
        assert!(penalized.needs_logits() && plain.needs_logits(), "logprobs need them too");
        let (token, lp) = plain.sample(&logits, 3).unwrap();
        assert_eq!(token, 1);
        let (token, penalized_lp) = penalized.sample(&logits, 3).unwrap();
        assert_eq!(token, 2, "token 1 is in the output: 3.0 - 0.5 < 2.9");
        assert_eq!(
            penalized_lp.unwrap().top,
            lp.unwrap().top,
            "log-probabilities of the raw logits"
        );
        // Candidates named by token: candidate 0 is token 1, candidate 1 is token 2.
        let (chosen, _) = penalized.sample_candidates(&[3.0, 2.9], 3, |i| i + 1).unwrap();
        assert_eq!(chosen, 1);
        assert!(penalized.sample(&logits, 9).is_err(), "an output position never recorded");
    }

    /// A grammar over tokens below 64: after an output of even length only even tokens, after
    /// one of odd length only odd ones.
    #[derive(Clone)]
    struct Alternating;

    impl TokenMatcher for Alternating {
        fn allowed(&mut self, output: &[u32]) -> TokenMask {
            let parity = output.len() % 2;
            let word = if parity == 0 { 0x5555_5555 } else { 0xaaaa_aaaa };
            TokenMask::from_words(vec![word, word])
        }

        fn boxed_clone(&self) -> Box<dyn TokenMatcher> {
            Box::new(self.clone())
        }
    }

    #[derive(Debug)]
    struct JsonIsAlternating;

    impl GrammarCompiler for JsonIsAlternating {
        fn compile(&self, grammar: &Grammar) -> Result<Box<dyn TokenMatcher>, String> {
            match grammar {
                Grammar::JsonObject => Ok(Box::new(Alternating)),
                _ => Err("only json_object".into()),
            }
        }
    }

    #[test]
    fn a_grammar_draws_among_its_tokens_by_the_output_before_the_position() {
        let spec = |temperature| SamplingSpec {
            grammar: Some(Grammar::JsonObject),
            ..SamplingSpec::for_prompt(params(temperature, 0, 1.0, 5), &[40, 41])
        };
        let mut greedy = RequestSampler::new(spec(0.0), Some(&JsonIsAlternating));
        assert!(greedy.needs_logits(), "a grammar samples on the host even when greedy");
        let logits: Vec<f32> =
            (0..70).map(|t| if t == 9 { 5.0 } else { t as f32 / 100.0 }).collect();
        for (position, token) in [(0, 40), (1, 41)] {
            greedy.record(position, token).unwrap();
        }
        // No output yet: even tokens only; 9 is the largest logit but odd, 68 is the largest
        // even one, and 64 to 69 are past the grammar's mask.
        assert_eq!(greedy.sample(&logits, 2).unwrap().0, 62);
        greedy.record(2, 62).unwrap();
        assert_eq!(greedy.sample(&logits, 3).unwrap().0, 9, "one output token: odd ones");
        // After a recompute that took another path the mask follows the new output.
        greedy.record(2, 8).unwrap();
        greedy.record(3, 7).unwrap();
        assert_eq!(greedy.sample(&logits, 4).unwrap().0, 62);
        assert!(greedy.sample(&logits, 6).is_err(), "an output position never recorded");
        // Drawn: never a token outside the mask, whatever the seed's draw.
        let mut drawn = RequestSampler::new(spec(2.0), Some(&JsonIsAlternating));
        drawn.record(0, 40).unwrap();
        drawn.record(1, 41).unwrap();
        let flat = vec![0.0f32; 64];
        let tokens: Vec<u32> = (0..200).map(|_| drawn.sample(&flat, 2).unwrap().0).collect();
        assert!(tokens.iter().all(|t| t % 2 == 0), "{tokens:?}");
        let other: Vec<u32> =
            (2..200).map(|p| drawn.clone().sample(&flat, p).map_or(1, |s| s.0)).collect();
        assert!(other.iter().skip(1).all(|&t| t == 1), "positions past the output are errors");
        // Over candidates: candidate i is token 10 + i; only the even ones may be drawn.
        let (chosen, _) = greedy.sample_candidates(&[1.0, 3.0, 2.0, 4.0], 4, |i| 10 + i).unwrap();
        assert_eq!(chosen, 2, "token 12, the largest even candidate");
        // Without a compiler, or a grammar the compiler refuses: sampling is an error.
        let mut without = RequestSampler::new(spec(0.0), None);
        without.record(0, 40).unwrap();
        without.record(1, 41).unwrap();
        assert!(without.sample(&logits, 2).unwrap_err().contains("no grammar compiler"));
        let refused = SamplingSpec { grammar: Some(Grammar::Lark("x".into())), ..spec(0.0) };
        let mut refused = RequestSampler::new(refused, Some(&JsonIsAlternating));
        refused.record(0, 40).unwrap();
        refused.record(1, 41).unwrap();
        assert!(refused.sample(&logits, 2).unwrap_err().contains("only json_object"));
    }

    #[test]
    fn a_logit_bias_is_added_before_the_penalties_and_the_draw() {
        let logits = [1.0f32, 3.0, 2.9, 0.0];
        let spec = |bias: Vec<(u32, f32)>, presence| SamplingSpec {
            sampling: Sampling { presence_penalty: presence, ..Sampling::GREEDY },
            logit_bias: bias,
            ..SamplingSpec::for_prompt(Sampling::GREEDY, &[])
        };
        let mut biased = RequestSampler::new(spec(vec![(3, 3.5), (9, 100.0)], 0.0), None);
        assert!(biased.needs_logits(), "a bias needs the logits even when greedy");
        assert_eq!(biased.sample(&logits, 0).unwrap().0, 3, "0.0 + 3.5 beats 3.0");
        // Biased up to 3.6, then penalized by 1.0 for being in the output: 2.9 wins.
        let mut both = RequestSampler::new(spec(vec![(1, 0.6)], 1.0), None);
        both.record(0, 1).unwrap();
        assert_eq!(both.sample(&logits, 1).unwrap().0, 2);
        // The same over candidates: token 3 is candidate 0 (added: 0.5 times 3.5 would lose).
        let (chosen, _) = biased.sample_candidates(&[0.5, 3.0], 0, |i| 3 - 2 * i).unwrap();
        assert_eq!(chosen, 0, "0.5 + 3.5 beats 3.0");
    }

    #[test]
    fn a_scored_prompt_scores_each_token_after_the_first_with_the_logits_before_it() {
        let prompt = [4, 7, 1, 9];
        let spec = SamplingSpec::for_prompt(Sampling::GREEDY, &prompt);
        let sampler = RequestSampler::new(spec.clone().scoring(&prompt, 2), None);
        // Position 3's logits give the first output token, not a prompt token's score.
        assert_eq!(sampler.scored_positions(0..4), 0..3);
        assert_eq!(sampler.scored_positions(2..6), 2..3);
        assert!(sampler.scored_positions(3..5).is_empty());
        assert_eq!(sampler.scored_token(1), Some((1, 2)));
        assert_eq!(sampler.scored_token(3), None);
        let logits = [0.0, 1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0];
        assert_eq!(sampler.prompt_logprobs(&logits, 1).unwrap(), logprobs(&logits, 1, 2));
        assert_eq!(sampler.prompt_logprobs(&logits, 2).unwrap(), logprobs(&logits, 9, 2));
        assert!(sampler.prompt_logprobs(&logits, 3).is_err());
        assert!(sampler.prompt_logprobs(&logits[..5], 2).is_err(), "token 9 of 5 logits");
        let plain = RequestSampler::new(spec, None);
        assert!(plain.scored_positions(0..4).is_empty());
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_in_order() {
        let logits = [1.0, 3.0, 3.0, 0.0];
        let l = logprobs(&logits, 0, 3);
        let total: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((f64::from(l.logprob) - (1.0 - total.ln())).abs() < 1e-6);
        let ids: Vec<u32> = l.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 2, 0], "most likely first, ties by lower id");
        assert!(logprobs(&logits, 3, 0).top.is_empty());
        let sum: f64 = (0..4).map(|t| f64::from(logprobs(&logits, t, 0).logprob).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
