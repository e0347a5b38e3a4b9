//! The provenance model's digest of what a slot's page table holds, kept up to date so that a
//! sampled token costs O(new tokens) instead of a pass over the whole context.
//!
//! The digest of the first `len` positions of a slot is a sum (wrapping) of one term per
//! position, each a strong mix of the value there bound to its position, finished with the
//! length. It depends on every value read through the table and on where it was read, so the
//! model's promise stands (a page of another request, stale or unwritten KV changes the token),
//! and on nothing else: not on how positions are grouped into pages, since the page size is a
//! knob of the engine and a request must sample the same tokens under any. A sum rather than a
//! chain because a sum splits: a page's terms are added once and reused; a chain of the values
//! in order would have to be walked from the start. (A sum, not an xor: equal terms would cancel
//! in an xor.)
//!
//! - Each page's terms are cached, for the table index they were computed at, until a value of
//!   the page changes (a step writes it, a transfer lands it, a release poisons it).
//! - Each slot keeps its sum over a prefix of its table's full pages (its fold): the page folded
//!   at each table index and the sum after it. Sampling extends the fold to the pages that became
//!   full since, adds the partial page's terms (fewer than a page), and is done.
//! - A fold is cut back when what it covered changes: the slot's table is cut below its length (a
//!   new request in the slot, a recompute), or a page it covers changes. The second needs to know,
//!   from a page, which folds cover it: each page has a watch list of (slot, table index, stamp)
//!   entries, one per folding. Entries are not removed when a fold is cut (that would cost a
//!   search per page); one is live only while its slot's fold still holds the same stamp at that
//!   index, and stamps are never reused, so a dead entry can never cut a fold by mistake. A change
//!   cuts each live entry's fold to its index and empties the list; a list full of dead entries is
//!   compacted when it would grow (see `watch`).
//!
//! Cost per sampled row: O(tokens written) for the changes, O(page_tokens) for the partial page,
//! O(page_tokens) for each page folded (each page once per fold, so amortized O(1) per token) and
//! amortized O(1) watch bookkeeping. After a cut, refolding the pages a prefix-cache hit brings in
//! costs O(1) per page whose terms are cached.

use crate::kv::PageRef;
use crate::sched::PageTables;

/// Binds a term to its position.
const POSITION_SALT: u64 = 0x243f_6a88_85a3_08d3;
/// Binds a digest to its length.
const LENGTH_SALT: u64 = 0x0123_4567_89ab_cdef;

/// One slot's sum over a prefix of its table's full pages; the three vectors have equal length.
#[derive(Clone, Debug, Default)]
struct Fold {
    /// The page folded at each table index.
    pages: Vec<u32>,
    /// The sum of the terms of the pages up to and including each index.
    sums: Vec<u64>,
    /// Names each folding in its page's watch list.
    stamps: Vec<u64>,
}

impl Fold {
    fn cut(&mut self, len: usize) {
        self.pages.truncate(len);
        self.sums.truncate(len);
        self.stamps.truncate(len);
    }
}

/// A page was folded into `slot`'s sum at table index `index` under `stamp`.
#[derive(Clone, Copy, Debug)]
struct Watch {
    slot: u32,
    index: u32,
    stamp: u64,
}

/// What is known of one page.
#[derive(Clone, Debug, Default)]
struct Page {
    /// The sum of its values' terms at table index `at`, meaningful while `valid`.
    terms: u64,
    at: u32,
    valid: bool,
    /// The foldings that covered it, live or dead (see the module docs).
    watches: Vec<Watch>,
}

#[derive(Clone, Debug)]
pub(super) struct Digests {
    page_tokens: usize,
    pages: Vec<Page>,
    folds: Vec<Fold>,
    next_stamp: u64,
    /// Terms computed since the start, one per KV value read, plus one per page folded into a
    /// sum: the work sampling did. A test counts it to show that the cost of a token does not
    /// grow with the context.
    hash_steps: u64,
    /// Watch entries compaction has looked at: a test counts it to show that compaction costs
    /// O(1) per entry added.
    watch_visits: u64,
}

impl Digests {
    pub(super) fn new(pages_total: u32, page_tokens: u32, slots: u32) -> Digests {
        Digests {
            page_tokens: page_tokens as usize,
            pages: vec![Page::default(); pages_total as usize],
            folds: vec![Fold::default(); slots as usize],
            next_stamp: 0,
            hash_steps: 0,
            watch_visits: 0,
        }
    }

    pub(super) fn hash_steps(&self) -> u64 {
        self.hash_steps
    }

    /// A value of page `page` changed: its terms and every sum over it are out of date.
    pub(super) fn page_changed(&mut self, page: u32) {
        let page = &mut self.pages[page as usize];
        page.valid = false;
        for w in page.watches.drain(..) {
            let fold = &mut self.folds[w.slot as usize];
            if fold.stamps.get(w.index as usize) == Some(&w.stamp) {
                fold.cut(w.index as usize);
            }
        }
    }

    /// `slot`'s table was cut to `pages` entries: its sum may cover no more of it.
    pub(super) fn table_cut(&mut self, slot: u32, pages: u32) {
        let fold = &mut self.folds[slot as usize];
        if fold.pages.len() > pages as usize {
            fold.cut(pages as usize);
        }
    }

    /// The digest of the first `len` positions of `slot`, whose table is `table`, over the KV
    /// store `kv`. The caller has checked that `table` has a page for every position.
    pub(super) fn digest(&mut self, slot: u32, table: &[PageRef], len: u32, kv: &[u64]) -> u64 {
        let full = len as usize / self.page_tokens;
        let mut sum = self.full_pages(slot, &table[..full], kv);
        let tail = len as usize % self.page_tokens;
        if tail > 0 {
            let start = table[full].index() as usize * self.page_tokens;
            let first = (full * self.page_tokens) as u64;
            sum = sum.wrapping_add(terms(&kv[start..start + tail], first));
            self.hash_steps += tail as u64;
        }
        finish(sum, len)
    }

    /// The sum over `full`, the slot's full pages, extending its fold to cover them.
    fn full_pages(&mut self, slot: u32, full: &[PageRef], kv: &[u64]) -> u64 {
        // A fold longer than `full` (sampling fewer positions than before, with no cut between:
        // only a broken plan does it) already holds the sum at `full`.
        let folded = self.folds[slot as usize].pages.len();
        for (index, page) in full.iter().enumerate().skip(folded) {
            let page = page.index();
            let page_terms = self.page_terms(page, index as u32, kv);
            let fold = &mut self.folds[slot as usize];
            let previous = fold.sums.last().copied().unwrap_or(0);
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            fold.pages.push(page);
            fold.sums.push(previous.wrapping_add(page_terms));
            fold.stamps.push(stamp);
            self.hash_steps += 1;
            self.watch(page, Watch { slot, index: index as u32, stamp });
        }
        match full.len() {
            0 => 0,
            n => self.folds[slot as usize].sums[n - 1],
        }
    }

    /// The sum of page `page`'s terms at table index `at`, from the cache or computed. A page
    /// shared by several tables sits at the same index in each (it holds the same positions of
    /// a shared prefix), so one entry serves them all.
    fn page_terms(&mut self, page: u32, at: u32, kv: &[u64]) -> u64 {
        let pt = self.page_tokens;
        let start = page as usize * pt;
        let known = &mut self.pages[page as usize];
        if !known.valid || known.at != at {
            known.terms = terms(&kv[start..start + pt], u64::from(at) * pt as u64);
            known.at = at;
            known.valid = true;
            self.hash_steps += pt as u64;
        }
        known.terms
    }

    /// Adds a folding to `page`'s watch list. A list about to grow its allocation first drops
    /// its dead entries, and grows only if that freed less than half of it. So compaction costs
    /// O(1) per entry added, and a list's allocation stays within a few times the most live
    /// entries it ever had, however often folds over the page are cut and made again (a cached
    /// system prompt's pages are folded anew by every request that hits them).
    fn watch(&mut self, page: u32, watch: Watch) {
        let folds = &self.folds;
        let list = &mut self.pages[page as usize].watches;
        if list.len() == list.capacity() && !list.is_empty() {
            self.watch_visits += list.len() as u64;
            list.retain(|w| folds[w.slot as usize].stamps.get(w.index as usize) == Some(&w.stamp));
            if list.len() > list.capacity() / 2 {
                list.reserve(list.capacity());
            }
        }
        list.push(watch);
    }

    /// Checks that the cache says what recomputing would: every fold follows its slot's table
    /// and sums its pages' current values, every valid page entry is its page's, and every
    /// folding is on its page's watch list (else a change to the page would miss the fold).
    /// O(store + folds + watch lists): for tests.
    pub(super) fn check(&self, tables: &PageTables, kv: &[u64]) -> Result<(), String> {
        let pt = self.page_tokens;
        for (index, page) in self.pages.iter().enumerate() {
            let now = terms(&kv[index * pt..(index + 1) * pt], u64::from(page.at) * pt as u64);
            if page.valid && page.terms != now {
                return Err(format!("page {index}'s cached terms are not its values'"));
            }
        }
        for (slot, fold) in self.folds.iter().enumerate() {
            let table = tables.table(slot as u32);
            let len = fold.pages.len();
            if fold.sums.len() != len || fold.stamps.len() != len {
                return Err(format!("slot {slot}'s fold has vectors of different lengths"));
            }
            if len > table.len() {
                let table_len = table.len();
                return Err(format!(
                    "slot {slot}'s fold covers {len} pages of a table of {table_len}"
                ));
            }
            let mut sum = 0u64;
            for (i, &page) in fold.pages.iter().enumerate() {
                let in_table = table[i].index();
                if in_table != page {
                    return Err(format!(
                        "slot {slot}'s fold has page {page} at {i}, its table {in_table}"
                    ));
                }
                let start = page as usize * pt;
                sum = sum.wrapping_add(terms(&kv[start..start + pt], (i * pt) as u64));
                if fold.sums[i] != sum {
                    return Err(format!("slot {slot}'s sum at {i} is not its pages' values'"));
                }
                let watched = self.pages[page as usize]
                    .watches
                    .iter()
                    .any(|w| (w.slot, w.index, w.stamp) == (slot as u32, i as u32, fold.stamps[i]));
                if !watched {
                    return Err(format!(
                        "slot {slot}'s folding at {i} is not watched by page {page}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// `digest` computed from scratch, position by position, caching nothing: what the cached
    /// one must equal.
    #[cfg(test)]
    pub(super) fn digest_from_scratch(&self, table: &[PageRef], len: u32, kv: &[u64]) -> u64 {
        let pt = self.page_tokens;
        let sum = (0..len as usize).fold(0u64, |sum, position| {
            let value = kv[table[position / pt].index() as usize * pt + position % pt];
            sum.wrapping_add(term(value, position as u64))
        });
        finish(sum, len)
    }
}

/// What the value at `position` adds to a digest.
fn term(value: u64, position: u64) -> u64 {
    mix(value ^ mix(position ^ POSITION_SALT))
}

/// The terms of consecutive values, the first at position `first`.
fn terms(values: &[u64], first: u64) -> u64 {
    values.iter().zip(first..).fold(0, |sum, (&value, p)| sum.wrapping_add(term(value, p)))
}

/// The digest of `len` positions whose terms sum to `sum`.
fn finish(sum: u64, len: u32) -> u64 {
    mix(sum ^ mix(u64::from(len) ^ LENGTH_SALT))
}

pub(super) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
#[path = "digest_tests.rs"]
mod tests;
