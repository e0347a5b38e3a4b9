//! Applying a step's outputs: tokens appended, stop conditions checked, finished pages offered
//! to the prefix cache, drains completed.

use super::plan::StepOutputs;
use super::planner::extend_page_keys;
use super::request::{AfterDrain, FinishReason, Phase};
use super::scheduler::{ApplyError, InFlightRow, SchedEvent, Scheduler};
use crate::Time;
use crate::kv::CacheKey;
use crate::kv::prefix_hash::root_hash;

impl Scheduler {
    /// Applies the outputs of the oldest step in flight. Outputs for any other step, or with the
    /// wrong number of tokens, are refused and change nothing.
    pub fn apply_outputs(&mut self, outputs: &StepOutputs, now: Time) -> Result<(), ApplyError> {
        let Some(oldest) = self.in_flight.front() else {
            return Err(ApplyError::UnexpectedStep { got: outputs.step, expected: None });
        };
        if oldest.step != outputs.step {
            return Err(ApplyError::UnexpectedStep {
                got: outputs.step,
                expected: Some(oldest.step),
            });
        }
        if oldest.sampling_rows != outputs.sampled.len() {
            return Err(ApplyError::WrongTokenCount {
                step: outputs.step,
                expected: oldest.sampling_rows,
                got: outputs.sampled.len(),
            });
        }
        let record = self.in_flight.pop_front().expect("checked above");
        let mut sampled = outputs.sampled.iter().copied();
        for (row_index, row) in record.rows.iter().enumerate() {
            let token = if row.sample { sampled.next() } else { None };
            let from = (record.step, row_index as u32);
            self.apply_row(row, token, from, now);
        }
        Ok(())
    }

    /// Gives up on the oldest step in flight (the executor failed or panicked on it): every
    /// request with a row in it ends with `FinishReason::StepFailed`, and the step is retired as
    /// if applied, with nothing it computed kept (no token, no page offered to the cache). Their
    /// pages return once no other step in flight touches them. Every other request goes on.
    pub fn fail_step(&mut self, step: super::StepId, now: Time) -> Result<(), ApplyError> {
        let expected = self.in_flight.front().map(|s| s.step);
        if expected != Some(step) {
            return Err(ApplyError::UnexpectedStep { got: step, expected });
        }
        let record = self.in_flight.pop_front().expect("checked above");
        for row in &record.rows {
            let ending = matches!(
                self.entry(row.entry).phase,
                Phase::Draining { then: AfterDrain::Remove, .. }
            );
            if !ending {
                self.finish(row.entry, FinishReason::StepFailed);
            }
        }
        for (row_index, row) in record.rows.iter().enumerate() {
            // Every request of the step is ending now, so the row's token (any value) is
            // discarded; it stands in only so the in-flight counts come out right.
            let token = row.sample.then_some(0);
            self.apply_row(row, token, (record.step, row_index as u32), now);
        }
        Ok(())
    }

    fn apply_row(
        &mut self,
        row: &InFlightRow,
        token: Option<u32>,
        from: (super::StepId, u32),
        now: Time,
    ) {
        let page_tokens = self.pool.page_tokens();
        let r = self.entry_mut(row.entry);
        assert_eq!(
            r.id, row.request,
            "entry {} was reused while a step in flight named it",
            row.entry
        );
        assert_eq!(r.computed, row.start, "{}: rows applied out of order", r.id);
        r.computed = row.end;
        r.computed_high = r.computed_high.max(row.end);
        r.in_flight_tokens -= row.end - row.start;
        r.in_flight_steps -= 1;
        if token.is_some() {
            r.in_flight_samples -= 1;
            if r.last_sample == Some(from) {
                r.last_sample = None;
            }
        }
        let drained = r.in_flight_steps == 0;
        let discard = matches!(r.phase, Phase::Draining { then: AfterDrain::Remove, .. });
        // Most rows complete no page; a multiply tells so without a division.
        let page_completed = if crate::planted!(PoisonedCachedPrefix) {
            // Planted (sglang#38355): pages cached mid chunked prefill, before their KV is whole.
            (r.pages_cached as usize) < planted_cacheable_pages(r, page_tokens as usize)
        } else {
            (r.pages_cached + 1) * page_tokens <= r.computed
        };
        if !discard {
            if page_completed {
                self.offer_full_pages_to_cache(row.entry);
            }
            if let Some(token) = token {
                let request = self.push_token(row.entry, token);
                self.events.push_back(SchedEvent::Token { request, token });
                if let Some(reason) = self.stop_reason(row.entry, token) {
                    // A running request is let go of here if no step in flight touches it; a
                    // draining one is below.
                    self.finish(row.entry, reason);
                }
            }
        }
        if drained && self.entries[row.entry as usize].is_some() {
            self.complete_drain(row.entry, now);
        }
    }

    fn push_token(&mut self, entry: u32, token: u32) -> super::RequestId {
        let r = self.entry_mut(entry);
        r.tokens.push(token);
        r.id
    }

    pub(crate) fn stop_reason(&self, entry: u32, token: u32) -> Option<FinishReason> {
        let r = self.entry(entry);
        if !r.ignore_eos && self.config.eos_token_ids.contains(&token) {
            Some(FinishReason::EndOfSequence(token))
        } else if r.stop_token_ids.contains(&token) {
            Some(FinishReason::StopToken(token))
        } else if r.output_len() >= r.max_tokens {
            Some(FinishReason::Length)
        } else if r.tokens.len() as u32 >= self.config.request_tokens_max {
            Some(FinishReason::ContextLength)
        } else {
            None
        }
    }

    /// Offers every page whose KV is now complete, written by applied steps only, to the prefix
    /// cache. A page is never offered earlier: a page cached mid-prefill could be matched before
    /// its KV exists, and one cached and then freed poisons the cache (sglang#38355).
    fn offer_full_pages_to_cache(&mut self, entry: u32) {
        if !self.config.prefix_cache {
            return;
        }
        let page_tokens = self.pool.page_tokens() as usize;
        let Scheduler { pool, entries, .. } = self;
        let r = entries[entry as usize].as_mut().expect("a live entry number names a request");
        let full = if crate::planted!(PoisonedCachedPrefix) {
            planted_cacheable_pages(r, page_tokens)
        } else {
            r.computed as usize / page_tokens
        };
        extend_page_keys(&mut r.page_keys, r.cache_salt, &r.tokens, page_tokens, full);
        for i in r.pages_cached as usize..full {
            let parent = if i == 0 { root_hash(r.cache_salt) } else { r.page_keys[i - 1] };
            let key = CacheKey { hash: r.page_keys[i], parent };
            let tokens = &r.tokens[i * page_tokens..(i + 1) * page_tokens];
            if let Err(e) = pool.cache_insert(r.pages[i], key, tokens) {
                panic!("{}: page {i} could not be offered to the cache: {e}", r.id);
            }
        }
        r.pages_cached = full as u32;
    }
}

/// Planted `PoisonedCachedPrefix` only (sglang#38355): the prompt pages a chunked prefill holds
/// count as cacheable as soon as its chunk is planned, before their KV is all written.
fn planted_cacheable_pages(r: &super::request::Request, page_tokens: usize) -> usize {
    let held_prompt_pages = r.pages.len().min(r.prompt_len as usize / page_tokens);
    (r.computed as usize / page_tokens).max(held_prompt_pages)
}
