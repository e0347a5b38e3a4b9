//! The scheduler's invariants, checked after every input by tests, proptest, fuzz and the
//! simulator. The full check is O(requests + pages); the incremental one, for after every input
//! at any size, O(running requests + rows in flight + pages changed), and the full one runs at
//! quiescence and every so many inputs.

use super::request::{Phase, Request};
use super::scheduler::{InFlightRow, InFlightStep, Scheduler};
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;

const SCHED: &str = "sched";

impl Scheduler {
    /// Checks the pool's invariants, then: every page reference is owned by exactly one page-table
    /// entry of a held request; each phase holds what it must and nothing else (a waiting request
    /// holds no page and no slot, every slot has one holder); the waiting and running orders hold
    /// exactly the waiting and running requests, sorted and within bounds; positions and samples
    /// in flight agree with the steps in flight, which are within the mode's bound; and a
    /// request's counters stay within its tokens, its page table and its limits.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.check_invariants_sharing_pool(&[])
    }

    /// `check_invariants` where others hold references in this scheduler's pool too (a
    /// transfer's reserved pages on the decode side): `others` lists each once per reference.
    pub fn check_invariants_sharing_pool(
        &self,
        others: &[crate::kv::PageRef],
    ) -> Result<(), InvariantViolation> {
        self.pool.check_invariants()?;
        self.check_bounds()?;
        self.check_requests()?;
        self.check_page_references(others)?;
        self.check_in_flight()
    }

    fn check_bounds(&self) -> Result<(), InvariantViolation> {
        let c = &self.config;
        // `slots_held()` is `running_max` less the free slots: it cannot exceed `running_max`,
        // and would overflow if more slots were free than there are.
        ensure_invariant!(
            SCHED,
            self.free_slots.len() <= c.running_max as usize,
            "{} slots on the free list, over running_max {}",
            self.free_slots.len(),
            c.running_max
        );
        ensure_invariant!(
            SCHED,
            self.running.len() <= self.slots_held(),
            "{} running but {} slots held",
            self.running.len(),
            self.slots_held()
        );
        ensure_invariant!(
            SCHED,
            self.in_flight.len() <= c.mode.steps_in_flight_max(),
            "{} steps in flight in {:?} mode",
            self.in_flight.len(),
            c.mode
        );
        ensure_invariant!(
            SCHED,
            self.running.windows(2).all(|w| w[0] < w[1]),
            "running order is not sorted"
        );
        ensure_invariant!(
            SCHED,
            self.by_id.len() + self.free_entries.len() == self.entries.len(),
            "{} requests + {} free entries != {}",
            self.by_id.len(),
            self.free_entries.len(),
            self.entries.len()
        );
        ensure_invariant!(
            SCHED,
            self.kept.len() <= self.entries.len()
                && self.kept.keys().all(|id| !self.by_id.contains_key(id)),
            "{} kept page sets, or one of a request still held",
            self.kept.len()
        );
        ensure_invariant!(
            SCHED,
            self.waiting.len() == self.waiting_deadlines.len(),
            "{} waiting, {} queue deadlines",
            self.waiting.len(),
            self.waiting_deadlines.len()
        );
        Ok(())
    }

    fn check_requests(&self) -> Result<(), InvariantViolation> {
        let page_tokens = self.pool.page_tokens();
        let mut slot_holder = vec![None; self.config.running_max as usize];
        for &slot in &self.free_slots {
            ensure_invariant!(
                SCHED,
                (slot as usize) < slot_holder.len(),
                "free slot {slot} out of range"
            );
            ensure_invariant!(
                SCHED,
                slot_holder[slot as usize].is_none(),
                "slot {slot} is free twice"
            );
            slot_holder[slot as usize] = Some(u64::MAX);
        }
        for (&id, &entry) in &self.by_id {
            let Some(r) = self.entries.get(entry as usize).and_then(Option::as_ref) else {
                return Err(InvariantViolation::new(
                    SCHED,
                    format!("{id} maps to empty entry {entry}"),
                ));
            };
            ensure_invariant!(SCHED, r.id == id, "{id} maps to entry {entry} holding {}", r.id);
            let in_waiting = self.waiting.contains(&(r.order, entry));
            let in_running = self.running.binary_search(&(r.order, entry)).is_ok();
            check_phase(r, in_waiting, in_running)?;
            if let Some(slot) = r.slot() {
                let holder = slot_holder.get_mut(slot as usize);
                ensure_invariant!(
                    SCHED,
                    matches!(holder, Some(None)),
                    "{id}'s slot {slot} is out of range, free, or held twice"
                );
                if let Some(h) = holder {
                    *h = Some(id.0);
                }
            }
            self.check_counters(r, page_tokens)?;
        }
        ensure_invariant!(
            SCHED,
            slot_holder.iter().all(Option::is_some),
            "a slot is neither free nor held"
        );
        for &(order, entry) in self.waiting.iter().chain(&self.running) {
            let r = self.entries.get(entry as usize).and_then(Option::as_ref);
            ensure_invariant!(
                SCHED,
                r.is_some_and(|r| r.order == order),
                "an order names entry {entry}, which holds another request or none"
            );
        }
        Ok(())
    }

    /// A request's counters against its tokens, its page table and its limits.
    fn check_counters(&self, r: &Request, page_tokens: u32) -> Result<(), InvariantViolation> {
        let id = r.id;
        let planned = r.planned_end();
        ensure_invariant!(
            SCHED,
            r.computed as usize <= r.tokens.len(),
            "{id} computed {} of {} tokens",
            r.computed,
            r.tokens.len()
        );
        ensure_invariant!(
            SCHED,
            r.computed <= r.computed_high && r.computed_high as usize <= r.tokens.len(),
            "{id} computed {}, at most {} ever, of {} tokens",
            r.computed,
            r.computed_high,
            r.tokens.len()
        );
        ensure_invariant!(
            SCHED,
            planned <= r.len_with_in_flight(),
            "{id} plans KV for {planned} positions of {}",
            r.len_with_in_flight()
        );
        let pages_min = planned.div_ceil(page_tokens) as usize;
        ensure_invariant!(
            SCHED,
            r.pages.len() >= pages_min,
            "{id} has {} pages for {planned} planned positions",
            r.pages.len()
        );
        ensure_invariant!(
            SCHED,
            r.pages_sent as usize <= r.pages.len(),
            "{id} sent {} of {} pages",
            r.pages_sent,
            r.pages.len()
        );
        ensure_invariant!(
            SCHED,
            r.pages_cached as usize * page_tokens as usize <= r.computed as usize,
            "{id} cached {} pages of {} computed tokens",
            r.pages_cached,
            r.computed
        );
        ensure_invariant!(
            SCHED,
            r.output_len() <= r.max_tokens,
            "{id} produced {} tokens over max {}",
            r.output_len(),
            r.max_tokens
        );
        ensure_invariant!(
            SCHED,
            r.tokens.len() as u32 <= self.config.request_tokens_max,
            "{id} is longer than the context"
        );
        ensure_invariant!(SCHED, r.draft_row.is_none(), "{id} has a draft row outside planning");
        Ok(())
    }

    /// Each page reference in the pool belongs to one page-table entry of a held request: a page
    /// freed while a request still lists it, or listed by a request that dropped its reference, is
    /// caught here.
    fn check_page_references(
        &self,
        others: &[crate::kv::PageRef],
    ) -> Result<(), InvariantViolation> {
        let mut refs = vec![0u32; self.pool.pages_total() as usize];
        let mut listed = Vec::new();
        let held = self.entries.iter().flatten().map(|r| (r.id, &r.pages));
        let kept = self.kept.iter().map(|(&id, pages)| (id, pages));
        for (id, pages) in held.chain(kept) {
            for &page in pages {
                ensure_invariant!(
                    SCHED,
                    self.pool.is_live(page),
                    "{id} lists page {page:?}, which was freed or evicted"
                );
                refs[page.index() as usize] += 1;
                listed.push(page);
            }
        }
        for &page in others {
            ensure_invariant!(
                SCHED,
                self.pool.is_live(page),
                "a transfer holds page {page:?}, which was freed or evicted"
            );
            refs[page.index() as usize] += 1;
            listed.push(page);
        }
        let mut total = 0u64;
        for page in listed {
            let counted = refs[page.index() as usize];
            let held = self.pool.refs(page).unwrap_or(0);
            ensure_invariant!(
                SCHED,
                held == counted,
                "page {page:?} has {held} references but {counted} page-table and transfer entries"
            );
        }
        for &count in &refs {
            total += u64::from(count);
        }
        let pool_total = self.pool.refs_total();
        ensure_invariant!(
            SCHED,
            pool_total == total,
            "the pool counts {pool_total} page references, page tables and transfers hold {total}"
        );
        Ok(())
    }

    fn check_in_flight(&self) -> Result<(), InvariantViolation> {
        let mut counted = vec![InFlight::default(); self.entries.len()];
        for step in &self.in_flight {
            self.check_step(step)?;
            for row in &step.rows {
                counted[row.entry as usize].add(row);
            }
        }
        for (e, r) in self.entries.iter().enumerate() {
            let Some(r) = r else { continue };
            check_in_flight_counts(r, counted[e])?;
        }
        Ok(())
    }

    /// A step in flight was planned, counts its sampling rows, and names live requests only.
    fn check_step(&self, step: &InFlightStep) -> Result<(), InvariantViolation> {
        ensure_invariant!(
            SCHED,
            step.step < self.next_step,
            "step {:?} in flight was never planned",
            step.step
        );
        ensure_invariant!(
            SCHED,
            step.sampling_rows == step.rows.iter().filter(|r| r.sample).count(),
            "step {:?} miscounts its sampling rows",
            step.step
        );
        let (mut tokens, mut scored) = (0u64, 0u64);
        for row in &step.rows {
            let r = self.entries.get(row.entry as usize).and_then(Option::as_ref);
            let Some(r) = r.filter(|r| r.id == row.request) else {
                let what = format!(
                    "step {:?} names {}, which is gone: its pages may be reused",
                    step.step, row.request
                );
                return Err(InvariantViolation::new(SCHED, what));
            };
            tokens += u64::from(row.end - row.start);
            scored += u64::from(r.scored_in(row.start, row.end));
        }
        // The step's bounds: what the executor computes, and the logits it keeps to score.
        ensure_invariant!(
            SCHED,
            tokens <= u64::from(self.config.step_tokens_max),
            "step {:?} computes {tokens} tokens, over step_tokens_max {}",
            step.step,
            self.config.step_tokens_max
        );
        ensure_invariant!(
            SCHED,
            scored <= u64::from(self.config.scored_tokens_max),
            "step {:?} scores {scored} prompt positions, over scored_tokens_max {}",
            step.step,
            self.config.scored_tokens_max
        );
        Ok(())
    }
}

/// What a request's phase requires of it: which order it is in, what it may hold.
fn check_phase(r: &Request, in_waiting: bool, in_running: bool) -> Result<(), InvariantViolation> {
    let id = r.id;
    match r.phase {
        Phase::Waiting => {
            ensure_invariant!(
                SCHED,
                in_waiting && !in_running,
                "{id} is waiting but not (only) in the waiting order"
            );
            ensure_invariant!(
                SCHED,
                r.pages.is_empty() && r.computed == 0,
                "{id} waits holding {} pages, {} computed",
                r.pages.len(),
                r.computed
            );
            ensure_invariant!(
                SCHED,
                r.in_flight_steps == 0,
                "{id} waits with {} steps in flight",
                r.in_flight_steps
            );
        }
        Phase::Running { .. } => ensure_invariant!(
            SCHED,
            in_running && !in_waiting,
            "{id} is running but not (only) in the running order"
        ),
        Phase::Reserved { .. } => {
            ensure_invariant!(
                SCHED,
                !in_running && !in_waiting,
                "{id} is reserved but ordered: it would be scheduled before its KV came"
            );
            ensure_invariant!(
                SCHED,
                r.pages.is_empty() && r.computed == 0 && r.in_flight_steps == 0,
                "{id} is reserved holding {} pages, {} computed, {} steps in flight",
                r.pages.len(),
                r.computed,
                r.in_flight_steps
            );
        }
        Phase::Draining { .. } => {
            ensure_invariant!(
                SCHED,
                !in_running && !in_waiting,
                "{id} is draining but still ordered"
            );
            ensure_invariant!(SCHED, r.in_flight_steps > 0, "{id} drains with no step in flight");
        }
    }
    Ok(())
}

/// What the incremental check gathers of an entry before it checks the request there.
#[derive(Clone, Copy, Debug, Default)]
struct Active {
    running: bool,
    in_flight: InFlight,
}

/// What the steps in flight hold for one request.
#[derive(Clone, Copy, Debug, Default)]
struct InFlight {
    steps: u32,
    tokens: u32,
    samples: u32,
}

impl InFlight {
    fn add(&mut self, row: &InFlightRow) {
        self.steps += 1;
        self.tokens += row.end - row.start;
        self.samples += u32::from(row.sample);
    }
}

/// A request's counts of what is in flight for it against what the steps hold.
fn check_in_flight_counts(r: &Request, counted: InFlight) -> Result<(), InvariantViolation> {
    ensure_invariant!(
        SCHED,
        r.in_flight_steps == counted.steps,
        "{} counts {} steps in flight, {} name it",
        r.id,
        r.in_flight_steps,
        counted.steps
    );
    ensure_invariant!(
        SCHED,
        r.in_flight_tokens == counted.tokens,
        "{} counts {} positions in flight, steps hold {}",
        r.id,
        r.in_flight_tokens,
        counted.tokens
    );
    ensure_invariant!(
        SCHED,
        r.in_flight_samples == counted.samples,
        "{} counts {} samples in flight, steps hold {}",
        r.id,
        r.in_flight_samples,
        counted.samples
    );
    ensure_invariant!(
        SCHED,
        r.in_flight_samples == 0 || r.last_sample.is_some(),
        "{} has samples in flight but no source for its next input",
        r.id
    );
    Ok(())
}

/// The incremental check.
impl Scheduler {
    /// The cheap check, for after every input; `check_invariants` is the full one.
    ///
    /// Runs the pool's incremental check (`PagePool::check_invariants_incremental`), the bounds
    /// (as the full check), then what the full check asks of each request, for the requests the
    /// steps work on: those in the running order and those the steps in flight name (running and
    /// draining ones). The running order names live requests; each of them is filed under its id,
    /// is where its phase says, holds a slot in range that is neither free nor another's, keeps
    /// its counters within its tokens, pages and limits, and counts what the steps in flight hold
    /// for it. Then the references: the pool's total against the pages the running and draining
    /// requests and kept page sets list (which the full check shows are all the requests that
    /// hold pages), so a page freed while listed, or referenced by nobody, shows. O(running
    /// requests · log requests + rows in flight + free slots + kept page sets), plus a pass over
    /// a 16-byte record per request entry (`waiting_max + running_max`) and the pool's O(pages
    /// changed); nothing in it grows with the pool.
    ///
    /// Waiting and reserved requests, which no step touches, and which request lists which page,
    /// only the full check sees: run it at quiescence and every so many inputs.
    pub fn check_invariants_incremental(&mut self) -> Result<(), InvariantViolation> {
        self.check_invariants_incremental_sharing_pool(0)
    }

    /// `check_invariants_incremental` where others hold `others_refs` references in this
    /// scheduler's pool too (a decode node's transfers: `DecodeSide::page_refs_count`).
    pub fn check_invariants_incremental_sharing_pool(
        &mut self,
        others_refs: u64,
    ) -> Result<(), InvariantViolation> {
        self.pool.check_invariants_incremental()?;
        self.check_bounds()?;
        let active = self.active_entries()?;
        let pages = self.check_active_requests(&active)?;
        self.check_reference_total(pages, others_refs)
    }

    /// Per entry: whether it is in the running order, and what the steps in flight hold for it;
    /// the running order and the steps in flight checked to name live requests on the way.
    fn active_entries(&self) -> Result<Vec<Active>, InvariantViolation> {
        let mut active = vec![Active::default(); self.entries.len()];
        for &(order, entry) in &self.running {
            let r = self.entries.get(entry as usize).and_then(Option::as_ref);
            ensure_invariant!(
                SCHED,
                r.is_some_and(|r| r.order == order),
                "an order names entry {entry}, which holds another request or none"
            );
            active[entry as usize].running = true;
        }
        for step in &self.in_flight {
            self.check_step(step)?;
            for row in &step.rows {
                active[row.entry as usize].in_flight.add(row);
            }
        }
        Ok(active)
    }

    /// The checks of each request the steps work on, and the sum of the pages they list.
    fn check_active_requests(&self, active: &[Active]) -> Result<u64, InvariantViolation> {
        let page_tokens = self.pool.page_tokens();
        let mut slot_held = vec![false; self.config.running_max as usize];
        for &slot in &self.free_slots {
            ensure_invariant!(
                SCHED,
                (slot as usize) < slot_held.len(),
                "free slot {slot} out of range"
            );
            ensure_invariant!(SCHED, !slot_held[slot as usize], "slot {slot} is free twice");
            slot_held[slot as usize] = true;
        }
        let mut pages = 0u64;
        for (entry, a) in active.iter().enumerate() {
            if !a.running && a.in_flight.steps == 0 {
                continue;
            }
            let entry = entry as u32;
            let r = self.entry(entry);
            let id = r.id;
            let filed = self.by_id.get(&id).copied();
            ensure_invariant!(
                SCHED,
                filed == Some(entry),
                "{id} in entry {entry} is filed under entry {filed:?}"
            );
            // In the running order under its own order key: `active_entries` checked the key.
            check_phase(r, self.waiting.contains(&(r.order, entry)), a.running)?;
            if let Some(slot) = r.slot() {
                let held = slot_held.get_mut(slot as usize);
                ensure_invariant!(
                    SCHED,
                    matches!(held, Some(false)),
                    "{id}'s slot {slot} is out of range, free, or held twice"
                );
                if let Some(h) = held {
                    *h = true;
                }
            }
            self.check_counters(r, page_tokens)?;
            check_in_flight_counts(r, a.in_flight)?;
            // Not which pages it lists, which the step does not read (a cache miss per request,
            // more than the rest of its checks): a page freed while listed shows in the total.
            pages += r.pages.len() as u64;
        }
        Ok(pages)
    }

    /// The pool's references against what running and draining requests (`requests`), kept page
    /// sets and others list. Right after the pool's incremental check, its total is exact.
    fn check_reference_total(
        &self,
        requests: u64,
        others_refs: u64,
    ) -> Result<(), InvariantViolation> {
        let kept: u64 = self.kept.values().map(|pages| pages.len() as u64).sum();
        let listed = requests + kept + others_refs;
        let pool_total = self.pool.refs_total_checked();
        ensure_invariant!(
            SCHED,
            pool_total == listed,
            "the pool counts {pool_total} page references, running and draining requests, kept \
             pages and transfers hold {listed}"
        );
        Ok(())
    }
}
