//! The pool's incremental check: the invariants of the pages that changed since the last check,
//! and the counts, in O(pages changed) where the full check costs O(pages + cached tokens).
//!
//! The pool logs every page whose state it changes (`Checked::touch`, once per page until the
//! next incremental check) and keeps, per page, a summary of what the last incremental check saw,
//! with totals over those summaries. The incremental check brings the logged pages' summaries up
//! to date, moving the totals with them, then checks each logged page against the eviction list
//! and the prefix index, and the totals against the free list's, the eviction list's, the index's
//! and the pin table's counts. So a page counted in the wrong state, a list that lost or gained
//! an entry, or a reference or pin counted twice shows up at the next incremental check; which
//! page the free list lost, or which page a stray index entry names, only the full check says.
//!
//! The full check (`PagePool::check_invariants`) also checks the log: every page not logged looks
//! as it did at the last incremental check (a change the log missed would hide from the
//! incremental check), and the totals are the sums of the summaries.

use super::{PagePool, PageState, block_hash};
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;

const KV: &str = "kv";

/// What the incremental check saw of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    state: SeenState,
    cached: bool,
    refs: u32,
    pins: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SeenState {
    Free,
    Held,
    Evictable,
}

impl Seen {
    const FREE: Seen = Seen { state: SeenState::Free, cached: false, refs: 0, pins: 0 };

    fn of(state: PageState) -> Seen {
        match state {
            PageState::Free => Seen::FREE,
            PageState::Held { refs, pins, cache } => {
                Seen { state: SeenState::Held, cached: cache.is_some(), refs, pins }
            }
            PageState::Evictable { .. } => {
                Seen { state: SeenState::Evictable, cached: true, refs: 0, pins: 0 }
            }
        }
    }
}

/// Sums over the pages' summaries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Totals {
    free: u64,
    evictable: u64,
    cached: u64,
    refs: u64,
    pins: u64,
}

impl Totals {
    fn add(&mut self, seen: Seen) {
        self.free += u64::from(seen.state == SeenState::Free);
        self.evictable += u64::from(seen.state == SeenState::Evictable);
        self.cached += u64::from(seen.cached);
        self.refs += u64::from(seen.refs);
        self.pins += u64::from(seen.pins);
    }

    fn remove(&mut self, seen: Seen) {
        self.free -= u64::from(seen.state == SeenState::Free);
        self.evictable -= u64::from(seen.state == SeenState::Evictable);
        self.cached -= u64::from(seen.cached);
        self.refs -= u64::from(seen.refs);
        self.pins -= u64::from(seen.pins);
    }
}

/// The log of changed pages and what the incremental check last saw. Bounded by the pool: a page
/// is logged once however often it changes, so a pool never checked holds a full log, no more.
#[derive(Clone, Debug)]
pub(super) struct Checked {
    /// Pages changed since the last incremental check, each once, in the order first changed.
    touched: Vec<u32>,
    /// Per page: whether it is in `touched`.
    marked: Vec<bool>,
    seen: Vec<Seen>,
    totals: Totals,
}

impl Checked {
    /// Every page free, as a new pool's are.
    pub(super) fn new(pages_total: usize) -> Checked {
        Checked {
            touched: Vec::new(),
            marked: vec![false; pages_total],
            seen: vec![Seen::FREE; pages_total],
            totals: Totals { free: pages_total as u64, ..Totals::default() },
        }
    }

    /// Logs a page whose state the pool changed. O(1).
    pub(super) fn touch(&mut self, index: u32) {
        let marked = &mut self.marked[index as usize];
        if !*marked {
            *marked = true;
            self.touched.push(index);
        }
    }
}

impl PagePool {
    /// The cheap check, for after every input; `check_invariants` is the full one.
    ///
    /// Checks each page changed since the last incremental check: a held page has a reference or
    /// a pin and is off the eviction list, an evictable one is on it (links checked both ways), a
    /// free one is off it, a cached one is indexed under its key, and one newly cached holds
    /// tokens that hash to its key. Then the counts: free pages against the free list, evictable
    /// pages against the eviction list, cached pages against the index, pins counted on pages
    /// against the pages live pins name. O(pages changed since the last incremental check), with
    /// O(`page_tokens`) more per page newly cached; O(1) when nothing changed.
    ///
    /// Takes `&mut self` to consume the log of changed pages. It does not replace the full check,
    /// which must still run at quiescence and every so many inputs: what it does not see (a free
    /// page missing from the free list while another is on it twice, a stray index entry, a pin
    /// naming a stale page) only the full check finds.
    pub fn check_invariants_incremental(&mut self) -> Result<(), InvariantViolation> {
        // Summaries first, for every logged page, so the totals are whole before any check can
        // return early and a failed check leaves the summaries in step with the pages.
        let touched = std::mem::take(&mut self.checked.touched);
        let mut entered_cache = Vec::new();
        for &index in &touched {
            let checked = &mut self.checked;
            checked.marked[index as usize] = false;
            let now = Seen::of(self.pages[index as usize].state);
            let then = std::mem::replace(&mut checked.seen[index as usize], now);
            checked.totals.remove(then);
            checked.totals.add(now);
            if now.cached && !then.cached {
                entered_cache.push(index);
            }
        }
        let result =
            self.check_touched(&touched, &entered_cache).and_then(|()| self.check_totals());
        // The log's buffer goes back (checking changed nothing), so checking after every input
        // does not allocate.
        let mut touched = touched;
        touched.clear();
        self.checked.touched = touched;
        result
    }

    /// References to all pages together as the last incremental check saw them: O(1), and equal
    /// to `refs_total()` right after `check_invariants_incremental`.
    pub fn refs_total_checked(&self) -> u64 {
        self.checked.totals.refs
    }

    fn check_touched(
        &self,
        touched: &[u32],
        entered_cache: &[u32],
    ) -> Result<(), InvariantViolation> {
        for &index in touched {
            let state = self.pages[index as usize].state;
            let on_lru = self.lru.linked(index).map_err(|e| InvariantViolation::new(KV, e))?;
            let key = match state {
                PageState::Free => {
                    ensure_invariant!(KV, !on_lru, "free page {index} is on the eviction list");
                    None
                }
                PageState::Held { refs, pins, cache } => {
                    ensure_invariant!(
                        KV,
                        refs + pins >= 1,
                        "held page {index} has no reference and no pin"
                    );
                    ensure_invariant!(KV, !on_lru, "held page {index} is on the eviction list");
                    cache
                }
                PageState::Evictable { cache } => {
                    ensure_invariant!(
                        KV,
                        on_lru,
                        "evictable page {index} is not on the eviction list"
                    );
                    Some(cache)
                }
            };
            if let Some(key) = key {
                let pages = &self.pages;
                ensure_invariant!(
                    KV,
                    self.index.get(key.hash, |p| super::cache_hash(pages, p) == Some(key.hash))
                        == Some(index),
                    "cached page {index} is not indexed under its key {:#x}",
                    key.hash
                );
            }
        }
        for &index in entered_cache {
            // Tokens are stored once, when the page enters the cache: hashing them then is enough
            // between full checks.
            let Some(key) = self.cache_key_of(index) else { continue };
            let rehash = block_hash(key.parent, self.page_tokens_of(index));
            ensure_invariant!(
                KV,
                rehash == key.hash,
                "cached page {index}'s tokens hash to {rehash:#x}, not its key {:#x}",
                key.hash
            );
        }
        Ok(())
    }

    fn cache_key_of(&self, index: u32) -> Option<super::CacheKey> {
        match self.pages[index as usize].state {
            PageState::Held { cache, .. } => cache,
            PageState::Evictable { cache } => Some(cache),
            PageState::Free => None,
        }
    }

    fn check_totals(&self) -> Result<(), InvariantViolation> {
        let t = self.checked.totals;
        ensure_invariant!(
            KV,
            t.free == self.free.len() as u64,
            "{} free pages but {} on the free list",
            t.free,
            self.free.len()
        );
        ensure_invariant!(
            KV,
            t.evictable == self.lru.len() as u64,
            "{} evictable pages but {} on the eviction list",
            t.evictable,
            self.lru.len()
        );
        ensure_invariant!(
            KV,
            t.cached == self.index.len() as u64,
            "{} cached pages but {} index entries",
            t.cached,
            self.index.len()
        );
        ensure_invariant!(
            KV,
            t.pins == self.pins.pages_pinned(),
            "pages count {} pins, live pins name {} pages",
            t.pins,
            self.pins.pages_pinned()
        );
        Ok(())
    }

    /// The full check's part for the incremental one: the log names each page at most once, and
    /// every page it does not name looks as the last incremental check saw it; the totals are the
    /// sums of the summaries. O(pages).
    pub(super) fn check_change_log(&self) -> Result<(), InvariantViolation> {
        let c = &self.checked;
        let total = self.pages.len();
        let mut listed = vec![false; total];
        for &index in &c.touched {
            let i = index as usize;
            ensure_invariant!(
                KV,
                i < total,
                "change log names page {index}, which is not in the pool"
            );
            ensure_invariant!(KV, !listed[i], "page {index} is on the change log twice");
            ensure_invariant!(KV, c.marked[i], "page {index} is on the change log but not marked");
            listed[i] = true;
        }
        ensure_invariant!(
            KV,
            c.marked.len() == total && c.seen.len() == total,
            "the change log marks {} and summarizes {} pages of {total}",
            c.marked.len(),
            c.seen.len()
        );
        let mut sums = Totals::default();
        for (index, page) in self.pages.iter().enumerate() {
            ensure_invariant!(
                KV,
                c.marked[index] == listed[index],
                "page {index} is marked changed but not on the change log"
            );
            let now = Seen::of(page.state);
            ensure_invariant!(
                KV,
                listed[index] || c.seen[index] == now,
                "page {index} changed without being logged: {:?} at the last incremental \
                 check, {now:?} now",
                c.seen[index]
            );
            sums.add(c.seen[index]);
        }
        ensure_invariant!(
            KV,
            sums == c.totals,
            "the incremental check's totals {:?} are not the sums of its summaries {sums:?}",
            c.totals
        );
        Ok(())
    }
}

#[cfg(test)]
#[path = "incremental_tests.rs"]
mod tests;
