//! Planning a step: which requests run, which positions each computes, which pages hold them.
//!
//! Three passes in a fixed order: decode rows of running requests, prefill chunks of running
//! requests, then admissions from the waiting queue, each pass in request order. Rows are drafted
//! first (pages allocated, preemptions made) and only then written into the plan, so a request
//! preempted after its row was drafted simply loses the row.

use super::plan::{Bucket, InputToken, RowPlan, StepPlan};
use super::request::{Phase, Request};
use super::scheduler::{InFlightRow, InFlightStep, Scheduler};
use crate::Time;
use crate::kv::prefix_hash::{block_hash, root_hash};

#[derive(Clone, Copy, Debug)]
pub(crate) struct DraftRow {
    entry: u32,
    start: u32,
    end: u32,
    sample: bool,
    cancelled: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Decode,
    Prefill,
}

/// What is left of a step being planned: tokens, and of them prompt positions whose logits
/// score a prompt token (`SchedConfig::scored_tokens_max`).
#[derive(Clone, Copy, Debug)]
struct Budget {
    tokens: u32,
    scored: u32,
}

impl Budget {
    /// How many of `want` positions from `start` request `r` may compute: as many as there are
    /// tokens left and, of its scored positions (a prefix of them), as many as may be scored.
    fn chunk(&self, r: &Request, start: u32, want: u32) -> u32 {
        let tokens = want.min(self.tokens);
        match r.scored_in(start, start + tokens) > self.scored {
            // Its first positions from `start` are all scored: that many of them.
            true => self.scored,
            false => tokens,
        }
    }

    fn take(&mut self, r: &Request, start: u32, end: u32) {
        self.tokens -= end - start;
        self.scored -= r.scored_in(start, end);
    }

    /// A drafted row given back (its request preempted by a later one's need for pages).
    fn give_back(&mut self, r: &Request, start: u32, end: u32) {
        self.tokens += end - start;
        self.scored += r.scored_in(start, end);
    }
}

/// What `ensure_pages` could do for a request.
enum Pages {
    Ready,
    /// Not now: pages are coming back once steps in flight are applied.
    Wait,
    /// Nothing of lower order was left to preempt, so the request preempted itself.
    SelfPreempted,
}

impl Scheduler {
    /// Plans the next step, or returns `None` when nothing can run or `mode` allows no more steps
    /// in flight. The plan's rows must be executed and their outputs applied in step order.
    pub fn plan_step(&mut self, now: Time) -> Option<super::StepPlan> {
        if self.in_flight.len() >= self.config.mode.steps_in_flight_max() {
            return None;
        }
        let mut draft = std::mem::take(&mut self.draft);
        draft.clear();
        let mut budget =
            Budget { tokens: self.config.step_tokens_max, scored: self.config.scored_tokens_max };
        let prefilling = self.draft_running(Pass::Decode, &mut draft, &mut budget, now);
        if prefilling > 0 {
            self.draft_running(Pass::Prefill, &mut draft, &mut budget, now);
        }
        self.draft_admissions(&mut draft, &mut budget);
        let plan = draft.iter().any(|row| !row.cancelled).then(|| self.materialize(&draft));
        self.draft = draft;
        plan
    }

    /// Drafts the pass's rows; returns how many running requests it saw with more than one
    /// position to compute, so that the prefill pass is skipped when there are none.
    fn draft_running(
        &mut self,
        pass: Pass,
        draft: &mut Vec<DraftRow>,
        budget: &mut Budget,
        now: Time,
    ) -> usize {
        let chunk_max = self.config.prefill_chunk_tokens_max;
        let mut prefilling = 0;
        let mut i = 0;
        let page_tokens = self.pool.page_tokens();
        let context_max = self.config.request_tokens_max;
        while i < self.running.len() && budget.tokens > 0 {
            let (_, entry) = self.running[i];
            let r = self.entry(entry);
            let (start, len_with_in_flight) = if crate::planted!(ScheduledTwiceInOverlap) {
                // Planted (missing class): the next step is planned from the applied positions,
                // so a request the step in flight has is scheduled again for the same ones.
                (r.computed, r.len_with_in_flight())
            } else {
                (r.planned_end(), r.len_with_in_flight())
            };
            let remaining = len_with_in_flight - start;
            prefilling += usize::from(remaining > 1);
            // Samples in flight that will end the request: it gets no further row.
            let will_finish = r.output_len() + r.in_flight_samples >= r.max_tokens
                || len_with_in_flight >= context_max;
            let tokens = match pass {
                _ if r.draft_row.is_some() || will_finish => 0,
                Pass::Decode if remaining == 1 => 1,
                Pass::Prefill if remaining > 1 => budget.chunk(r, start, remaining.min(chunk_max)),
                _ => 0,
            };
            if tokens == 0 {
                i += 1;
                continue;
            }
            let end = start + tokens;
            // Most rows need no new page; a multiply tells so without a division.
            let has_pages = end <= r.pages.len() as u32 * page_tokens;
            let pages = if has_pages {
                Pages::Ready
            } else {
                self.ensure_pages(entry, end, draft, budget, now)
            };
            match pages {
                Pages::Ready => {
                    self.entry_mut(entry).draft_row = Some(draft.len() as u32);
                    draft.push(DraftRow {
                        entry,
                        start,
                        end,
                        sample: end == len_with_in_flight,
                        cancelled: false,
                    });
                    budget.take(self.entry(entry), start, end);
                    i += 1;
                }
                Pages::Wait => i += 1,
                // It left the running order: the next request now stands at `i`.
                Pages::SelfPreempted => {}
            }
        }
        // Stopped early for want of budget: the prefill pass cannot run either.
        prefilling
    }

    /// Gives a running request pages for positions up to `end`, preempting requests of lower
    /// order (last first) while that helps. A victim with steps in flight gives its pages back
    /// only once they are applied, so preemption stops as soon as what is coming back suffices.
    fn ensure_pages(
        &mut self,
        entry: u32,
        end: u32,
        draft: &mut [DraftRow],
        budget: &mut Budget,
        now: Time,
    ) -> Pages {
        let need = self.pages_needed(entry, end);
        let mut coming_back = 0;
        loop {
            if self.pool.available_count() >= need {
                let Scheduler { pool, entries, .. } = self;
                let r =
                    entries[entry as usize].as_mut().expect("a live entry number names a request");
                pool.allocate_many(need, &mut r.pages).expect("available pages were counted");
                return Pages::Ready;
            }
            if self.pool.available_count() + coming_back >= need {
                return Pages::Wait;
            }
            let &(_, victim) = self.running.last().expect("the requester is running");
            if victim == entry {
                self.preempt(entry, now);
                return Pages::SelfPreempted;
            }
            if let Some(row) = self.entry_mut(victim).draft_row.take() {
                let row = &mut draft[row as usize];
                row.cancelled = true;
                budget.give_back(self.entry(victim), row.start, row.end);
            }
            if self.entry(victim).in_flight_steps > 0 {
                coming_back += self.exclusive_pages(victim);
            }
            self.preempt(victim, now);
        }
    }

    fn pages_needed(&self, entry: u32, end: u32) -> u32 {
        let held = self.entry(entry).pages.len() as u32;
        end.div_ceil(self.pool.page_tokens()).saturating_sub(held)
    }

    /// Pages that become available when this request lets go of them.
    fn exclusive_pages(&self, entry: u32) -> u32 {
        let r = self.entry(entry);
        let alone = |p| self.pool.refs(p) == Ok(1) && self.pool.pin_count(p) == Ok(0);
        r.pages.iter().filter(|&&p| alone(p)).count() as u32
    }

    /// Admits waiting requests in order while a slot, budget and pages allow; the first that does
    /// not fit stops admission, so a large request is not overtaken forever by small ones.
    fn draft_admissions(&mut self, draft: &mut Vec<DraftRow>, budget: &mut Budget) {
        while budget.tokens > 0 && !self.free_slots.is_empty() {
            let Some(&(_, entry)) = self.waiting.first() else {
                break;
            };
            let computed = self.match_cached_prefix(entry);
            let len = self.entry(entry).tokens.len() as u32;
            let want = (len - computed).min(self.config.prefill_chunk_tokens_max);
            let tokens = budget.chunk(self.entry(entry), computed, want);
            let end = computed + tokens;
            let need = self.pages_needed(entry, end);
            // No scored position left for a request that scores its prompt: it waits for the
            // next step, at the head of the queue.
            if tokens == 0 || self.pool.available_count() < need {
                self.release_matched_prefix(entry);
                break;
            }
            let Scheduler { pool, entries, .. } = self;
            let r = entries[entry as usize].as_mut().expect("a live entry number names a request");
            pool.allocate_many(need, &mut r.pages).expect("available pages were counted");
            r.draft_row = Some(draft.len() as u32);
            self.start_running(entry);
            self.prefix_tokens_queried += u64::from(len);
            self.prefix_tokens_hit += u64::from(computed);
            draft.push(DraftRow {
                entry,
                start: computed,
                end,
                sample: end == len,
                cancelled: false,
            });
            budget.take(self.entry(entry), computed, end);
        }
    }

    /// Takes the longest cached prefix of a waiting request's tokens and returns how many tokens
    /// it covers. The last token is always left to compute: its logits give the first output
    /// token, and writing its KV into a shared page would corrupt that page for everyone.
    fn match_cached_prefix(&mut self, entry: u32) -> u32 {
        if !self.config.prefix_cache {
            return 0;
        }
        let page_tokens = self.pool.page_tokens() as usize;
        let Scheduler { pool, entries, .. } = self;
        let r = entries[entry as usize].as_mut().expect("a live entry number names a request");
        debug_assert!(r.pages.is_empty() && r.computed == 0);
        let mut limit = (r.tokens.len() - 1) / page_tokens;
        if !r.reads_prefix_cache {
            // Only what it computed itself before: every position of a scored prompt has its
            // logits computed once, and a preempted one resumes where it was (without that, two
            // such requests can preempt each other forever, neither keeping any progress).
            limit = limit.min(r.computed_high as usize / page_tokens);
        }
        extend_page_keys(&mut r.page_keys, r.cache_salt, &r.tokens, page_tokens, limit);
        let root = root_hash(r.cache_salt);
        let matched = pool.match_prefix(root, &r.page_keys[..limit], &r.tokens, &mut r.pages);
        r.pages_cached = matched as u32;
        r.computed = (matched * page_tokens) as u32;
        r.computed_high = r.computed_high.max(r.computed);
        r.computed
    }

    fn release_matched_prefix(&mut self, entry: u32) {
        let Scheduler { pool, entries, .. } = self;
        let r = entries[entry as usize].as_mut().expect("a live entry number names a request");
        for page in r.pages.drain(..) {
            pool.release(page).expect("a page matched a moment ago is held");
        }
        r.pages_cached = 0;
        r.computed = 0;
    }

    /// Writes the drafted rows into a plan and records the step as in flight.
    fn materialize(&mut self, draft: &[DraftRow]) -> StepPlan {
        let step = self.next_step;
        self.next_step.0 += 1;
        let rows_count = draft.iter().filter(|row| !row.cancelled).count();
        let tokens_count = draft
            .iter()
            .filter(|row| !row.cancelled)
            .map(|row| (row.end - row.start) as usize)
            .sum();
        let mut plan = StepPlan {
            step,
            rows: Vec::with_capacity(rows_count),
            input_tokens: Vec::with_capacity(tokens_count),
            page_updates: Vec::new(),
            bucket: Bucket::Eager,
        };
        let mut record =
            InFlightStep { step, rows: Vec::with_capacity(rows_count), sampling_rows: 0 };
        for d in draft.iter().filter(|row| !row.cancelled) {
            let row_index = plan.rows.len() as u32;
            let r = self.entries[d.entry as usize].as_mut().expect("a drafted entry is live");
            r.draft_row = None;
            let Phase::Running { slot } = r.phase else {
                unreachable!("{} drafted but not running", r.id);
            };
            let inputs_start = plan.input_tokens.len() as u32;
            for position in d.start..d.end {
                let token = match r.tokens.get(position as usize) {
                    Some(&token) => InputToken::Known(token),
                    None => {
                        assert_eq!(
                            position as usize,
                            r.tokens.len(),
                            "{}: only the next token can be pending",
                            r.id
                        );
                        let (step, row) = r
                            .last_sample
                            .expect("a pending token comes from a sampling step in flight");
                        InputToken::FromStep { step, row }
                    }
                };
                plan.input_tokens.push(token);
            }
            if crate::planted!(StaleKvAfterResume) && r.preemptions > 0 && r.pages_sent == 0 {
                // Planted (missing class): a resumed request's prefix found in the cache again
                // is taken as still in its slot's page table, which holds what it held before.
                r.pages_sent = r.pages_cached;
            }
            let updates_start = plan.page_updates.len() as u32;
            plan.page_updates.extend_from_slice(&r.pages[r.pages_sent as usize..]);
            let page_table_from = r.pages_sent;
            r.pages_sent = r.pages.len() as u32;
            r.in_flight_tokens += d.end - d.start;
            r.in_flight_steps += 1;
            if d.sample {
                r.in_flight_samples += 1;
                r.last_sample = Some((step, row_index));
                record.sampling_rows += 1;
            }
            plan.rows.push(RowPlan {
                request: r.id,
                slot,
                positions: d.start..d.end,
                inputs: inputs_start..plan.input_tokens.len() as u32,
                page_table_from,
                page_updates: updates_start..plan.page_updates.len() as u32,
                sample: d.sample,
            });
            record.rows.push(InFlightRow {
                entry: d.entry,
                request: r.id,
                start: d.start,
                end: d.end,
                sample: d.sample,
            });
        }
        plan.bucket = self.bucket_for(&plan);
        self.in_flight.push_back(record);
        plan
    }

    fn bucket_for(&self, plan: &StepPlan) -> Bucket {
        let rows = plan.rows.len() as u32;
        let decode_only = plan.tokens_total() == rows;
        match self.config.capture_sizes.iter().find(|&&size| size >= rows) {
            Some(&padded_rows) if decode_only => Bucket::Graph { padded_rows },
            _ => Bucket::Eager,
        }
    }
}

/// Extends `keys` to the chained keys of the first `pages` full pages of `tokens`.
pub(crate) fn extend_page_keys(
    keys: &mut Vec<u64>,
    salt: u64,
    tokens: &[u32],
    page_tokens: usize,
    pages: usize,
) {
    while keys.len() < pages {
        let i = keys.len();
        let parent = keys.last().copied().unwrap_or_else(|| root_hash(salt));
        keys.push(block_hash(parent, &tokens[i * page_tokens..(i + 1) * page_tokens]));
    }
}
