//! The scheduler's invariants, checked after every input by tests, proptest, fuzz and the
//! simulator. O(requests + pages).

use super::request::Phase;
use super::scheduler::Scheduler;
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
                    ensure_invariant!(
                        SCHED,
                        r.in_flight_steps > 0,
                        "{id} drains with no step in flight"
                    );
                }
            }
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
            ensure_invariant!(
                SCHED,
                r.draft_row.is_none(),
                "{id} has a draft row outside planning"
            );
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
        let mut steps = vec![0u32; self.entries.len()];
        let mut tokens = vec![0u32; self.entries.len()];
        let mut samples = vec![0u32; self.entries.len()];
        for step in &self.in_flight {
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
            for row in &step.rows {
                let r = self.entries.get(row.entry as usize).and_then(Option::as_ref);
                ensure_invariant!(
                    SCHED,
                    r.is_some_and(|r| r.id == row.request),
                    "step {:?} names {}, which is gone: its pages may be reused",
                    step.step,
                    row.request
                );
                let e = row.entry as usize;
                steps[e] += 1;
                tokens[e] += row.end - row.start;
                samples[e] += u32::from(row.sample);
            }
        }
        for (e, r) in self.entries.iter().enumerate() {
            let Some(r) = r else { continue };
            ensure_invariant!(
                SCHED,
                r.in_flight_steps == steps[e],
                "{} counts {} steps in flight, {} name it",
                r.id,
                r.in_flight_steps,
                steps[e]
            );
            ensure_invariant!(
                SCHED,
                r.in_flight_tokens == tokens[e],
                "{} counts {} positions in flight, steps hold {}",
                r.id,
                r.in_flight_tokens,
                tokens[e]
            );
            ensure_invariant!(
                SCHED,
                r.in_flight_samples == samples[e],
                "{} counts {} samples in flight, steps hold {}",
                r.id,
                r.in_flight_samples,
                samples[e]
            );
            ensure_invariant!(
                SCHED,
                r.in_flight_samples == 0 || r.last_sample.is_some(),
                "{} has samples in flight but no source for its next input",
                r.id
            );
        }
        Ok(())
    }
}
