//! The page pool: O(1) allocate and free, reference counts, generations, the prefix cache with
//! LRU eviction of unreferenced cached pages, and leased pins. See the module docs for the states.

use std::collections::VecDeque;
use std::fmt;

use self::incremental::Checked;
use super::PageRef;
use super::lru::LruList;
use super::pins::{Pin, PinId, PinTable};
use super::prefix_hash::block_hash;
use super::prefix_index::{PrefixIndex, fingerprint as prefix_fingerprint};
use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Pages in the pool, fixed for its life.
    pub pages_total: u32,
    /// Tokens whose KV one page holds.
    pub page_tokens: u32,
    /// Live pins at once; a pin beyond it is refused.
    pub pins_max: u32,
}

impl PoolConfig {
    /// The largest pool: page numbers must fit in a `u32` with one value left for "none".
    pub const PAGES_MAX: u32 = u32::MAX / 2;
    pub const PAGE_TOKENS_MAX: u32 = 1 << 16;

    pub fn validate(&self) -> Result<(), PoolConfigError> {
        if self.pages_total == 0 || self.pages_total > Self::PAGES_MAX {
            return Err(PoolConfigError(format!(
                "pages_total {} is not in 1..={}",
                self.pages_total,
                Self::PAGES_MAX
            )));
        }
        if self.page_tokens == 0 || self.page_tokens > Self::PAGE_TOKENS_MAX {
            return Err(PoolConfigError(format!(
                "page_tokens {} is not in 1..={}",
                self.page_tokens,
                Self::PAGE_TOKENS_MAX
            )));
        }
        if self.pins_max > Self::PAGES_MAX {
            return Err(PoolConfigError(format!(
                "pins_max {} is over {}",
                self.pins_max,
                Self::PAGES_MAX
            )));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfigError(String);

impl fmt::Display for PoolConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid page pool config: {}", self.0)
    }
}

impl std::error::Error for PoolConfigError {}

/// What a caller did wrong, or ran out of. Never a panic: the caller handles each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvError {
    /// Not enough free or evictable pages; nothing was allocated.
    OutOfPages { needed: u32, available: u32 },
    /// The handle's page was freed or evicted since the handle was made.
    StaleHandle(PageRef),
    /// The page number is not in the pool.
    NoSuchPage(PageRef),
    /// Released or pinned a page nobody holds (an evictable page is cached, not held).
    NotHeld(PageRef),
    /// The pin was already released or expired.
    UnknownPin(PinId),
    /// `pins_max` pins are live.
    TooManyPins,
    /// A cache insert gave a token count other than `page_tokens`.
    WrongTokenCount { expected: u32, got: usize },
    /// The page is already in the prefix cache.
    AlreadyCached(PageRef),
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::OutOfPages { needed, available } => {
                write!(f, "out of KV pages: need {needed}, {available} available")
            }
            KvError::StaleHandle(r) => {
                write!(f, "stale page handle {r:?}: the page was freed or evicted since")
            }
            KvError::NoSuchPage(r) => write!(f, "page {} is not in the pool", r.index()),
            KvError::NotHeld(r) => write!(f, "page {r:?} is not held by anyone"),
            KvError::UnknownPin(p) => write!(f, "pin {p:?} was already released or expired"),
            KvError::TooManyPins => write!(f, "too many live pins"),
            KvError::WrongTokenCount { expected, got } => {
                write!(f, "a cached page holds {expected} tokens, got {got}")
            }
            KvError::AlreadyCached(r) => write!(f, "page {r:?} is already in the prefix cache"),
        }
    }
}

impl std::error::Error for KvError {}

/// A cached page's identity: its chained hash and the hash of the page before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CacheKey {
    pub hash: u64,
    pub parent: u64,
}

/// What `cache_insert` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheInsert {
    Inserted,
    /// Another page already holds this key; the given page stays uncached and is freed when
    /// released. The existing page is named so the caller may share it instead.
    KeyTaken(PageRef),
}

/// A pin whose lease ran out: the pool released it. Drained with `poll_expired`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinExpired {
    pub pin: PinId,
    pub pages: Vec<PageRef>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageState {
    Free,
    /// Referenced by requests (`refs`) or pinned by transfers (`pins`); at least one of them.
    Held {
        refs: u32,
        pins: u32,
        cache: Option<CacheKey>,
    },
    /// In the prefix cache, referenced by nobody: reusable on a hit, evictable in LRU order.
    Evictable {
        cache: CacheKey,
    },
}

#[derive(Clone, Copy, Debug)]
struct Page {
    generation: u32,
    state: PageState,
}

/// The page pool. See the module docs for its states and invariants.
#[derive(Clone)]
pub struct PagePool {
    config: PoolConfig,
    pages: Vec<Page>,
    /// Free page numbers, used as a stack: O(1), and deterministic.
    free: Vec<u32>,
    lru: LruList,
    index: PrefixIndex,
    /// `page_tokens` token ids per page, meaningful for cached pages: every hit is checked against
    /// them, so a hash collision is a miss, never another request's KV.
    cached_tokens: Vec<u32>,
    /// Pages changed since the last incremental check, and what it saw (`pool/incremental.rs`).
    checked: Checked,
    pins: PinTable,
    expired: VecDeque<PinExpired>,
    /// Pages that lost their contents since the last `take_freed`, for the executor to poison.
    freed: FreedPages,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("config", &self.config)
            .field("free", &self.free.len())
            .field("evictable", &self.lru.len())
            .field("cached", &self.index.len())
            .field("pins", &self.pins.live_count())
            .finish()
    }
}

impl PagePool {
    pub fn new(config: PoolConfig) -> Result<PagePool, PoolConfigError> {
        config.validate()?;
        let total = config.pages_total as usize;
        Ok(PagePool {
            config,
            pages: vec![Page { generation: 0, state: PageState::Free }; total],
            // Reversed so that page 0 is handed out first.
            free: (0..config.pages_total).rev().collect(),
            lru: LruList::new(total),
            index: PrefixIndex::with_capacity(total),
            cached_tokens: vec![0; total * config.page_tokens as usize],
            checked: Checked::new(total),
            pins: PinTable::new(config.pins_max),
            expired: VecDeque::with_capacity(config.pins_max as usize),
            freed: FreedPages::new(total),
        })
    }

    pub fn config(&self) -> PoolConfig {
        self.config
    }

    pub fn page_tokens(&self) -> u32 {
        self.config.page_tokens
    }

    pub fn pages_total(&self) -> u32 {
        self.config.pages_total
    }

    /// Pages nobody holds and no cache entry names.
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// Cached pages nobody holds: reusable on a hit, or evicted when no page is free.
    pub fn evictable_count(&self) -> u32 {
        self.lru.len() as u32
    }

    /// Pages an allocation can have now: free ones, then evictable ones.
    pub fn available_count(&self) -> u32 {
        self.free_count() + self.evictable_count()
    }

    /// Pages held by a reference or a pin.
    pub fn held_count(&self) -> u32 {
        self.pages_total() - self.available_count()
    }

    /// Pages in the prefix cache, held or not.
    pub fn cached_count(&self) -> u32 {
        self.index.len() as u32
    }

    pub fn pins_live_count(&self) -> u32 {
        self.pins.live_count() as u32
    }

    /// References to all pages together. O(pages): for invariant checks.
    pub fn refs_total(&self) -> u64 {
        self.pages
            .iter()
            .map(|p| match p.state {
                PageState::Held { refs, .. } => u64::from(refs),
                _ => 0,
            })
            .sum()
    }

    /// Whether the handle still names the page it was made for, and the page is held or cached.
    pub fn is_live(&self, page: PageRef) -> bool {
        self.page(page).is_ok()
    }

    /// References to the page (not counting pins).
    pub fn refs(&self, page: PageRef) -> Result<u32, KvError> {
        match self.page(page)?.state {
            PageState::Held { refs, .. } => Ok(refs),
            PageState::Evictable { .. } => Ok(0),
            PageState::Free => Err(KvError::StaleHandle(page)),
        }
    }

    /// Pins on the page.
    pub fn pin_count(&self, page: PageRef) -> Result<u32, KvError> {
        match self.page(page)?.state {
            PageState::Held { pins, .. } => Ok(pins),
            PageState::Evictable { .. } => Ok(0),
            PageState::Free => Err(KvError::StaleHandle(page)),
        }
    }

    /// Takes one page with one reference: a free page if there is one, else the least recently
    /// used evictable page, which leaves the cache.
    pub fn allocate(&mut self) -> Result<PageRef, KvError> {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                let Some(victim) = self.lru.pop_front() else {
                    return Err(KvError::OutOfPages { needed: 1, available: 0 });
                };
                self.evict(victim);
                victim
            }
        };
        let page = &mut self.pages[index as usize];
        debug_assert_eq!(page.state, PageState::Free);
        page.state = PageState::Held { refs: 1, pins: 0, cache: None };
        let generation = page.generation;
        self.checked.touch(index);
        Ok(PageRef { index, generation })
    }

    /// Takes `count` pages, all or none.
    pub fn allocate_many(&mut self, count: u32, out: &mut Vec<PageRef>) -> Result<(), KvError> {
        let available = self.available_count();
        if count > available {
            return Err(KvError::OutOfPages { needed: count, available });
        }
        for _ in 0..count {
            out.push(self.allocate().expect("available pages were counted before allocating"));
        }
        Ok(())
    }

    /// Adds a reference. An evictable page becomes held again (a prefix-cache hit).
    pub fn retain(&mut self, page: PageRef) -> Result<(), KvError> {
        let state = self.page(page)?.state;
        let next = match state {
            PageState::Held { refs, pins, cache } => {
                PageState::Held { refs: refs + 1, pins, cache }
            }
            PageState::Evictable { cache } => {
                self.lru.remove(page.index);
                PageState::Held { refs: 1, pins: 0, cache: Some(cache) }
            }
            PageState::Free => return Err(KvError::StaleHandle(page)),
        };
        self.pages[page.index as usize].state = next;
        self.checked.touch(page.index);
        Ok(())
    }

    /// Drops a reference. The last one, with no pin left, frees the page or, if it is cached,
    /// makes it evictable.
    pub fn release(&mut self, page: PageRef) -> Result<(), KvError> {
        match self.page(page)?.state {
            PageState::Held { refs, pins, cache } if refs > 0 => {
                self.pages[page.index as usize].state =
                    PageState::Held { refs: refs - 1, pins, cache };
                self.settle(page.index);
                self.checked.touch(page.index);
                Ok(())
            }
            PageState::Held { .. } | PageState::Evictable { .. } => Err(KvError::NotHeld(page)),
            PageState::Free => Err(KvError::StaleHandle(page)),
        }
    }

    /// Pins a held page until `expires_at` or `unpin`. While pinned, the page is neither freed,
    /// evicted nor handed out, even if every reference is released.
    pub fn pin(&mut self, page: PageRef, expires_at: Time) -> Result<PinId, KvError> {
        self.pin_many(&[page], expires_at)
    }

    /// Pins held pages together under one lease: a transfer's pages share it, so a heartbeat
    /// extends them all at once. All or none: one page not held pins nothing.
    pub fn pin_many(&mut self, pages: &[PageRef], expires_at: Time) -> Result<PinId, KvError> {
        for &page in pages {
            if !matches!(self.page(page)?.state, PageState::Held { .. }) {
                return Err(KvError::NotHeld(page));
            }
        }
        let id = self
            .pins
            .insert(Pin { pages: pages.to_vec(), expires_at })
            .ok_or(KvError::TooManyPins)?;
        for &page in pages {
            let PageState::Held { refs, pins, cache } = self.pages[page.index as usize].state
            else {
                unreachable!("checked above");
            };
            self.pages[page.index as usize].state = PageState::Held { refs, pins: pins + 1, cache };
            self.checked.touch(page.index);
        }
        Ok(id)
    }

    /// Moves a pin's expiry (a heartbeat extends the lease).
    pub fn extend_pin(&mut self, pin: PinId, expires_at: Time) -> Result<(), KvError> {
        self.pins.set_expiry(pin, expires_at).ok_or(KvError::UnknownPin(pin))
    }

    /// Releases a pin. A page left with no reference or pin is freed or becomes evictable.
    /// Returns the pages it held.
    pub fn unpin(&mut self, pin: PinId) -> Result<Vec<PageRef>, KvError> {
        let Pin { pages, .. } = self.pins.remove(pin).ok_or(KvError::UnknownPin(pin))?;
        for &page in &pages {
            let PageState::Held { refs, pins, cache } = self.pages[page.index as usize].state
            else {
                unreachable!("pinned page {page:?} is not held");
            };
            assert!(pins > 0, "page {page:?} has a live pin but a pin count of zero");
            self.pages[page.index as usize].state = PageState::Held { refs, pins: pins - 1, cache };
            self.settle(page.index);
            self.checked.touch(page.index);
        }
        Ok(pages)
    }

    /// The earliest pin expiry, if any: when to call `handle_timeout`.
    pub fn next_timeout(&self) -> Option<Time> {
        self.pins.next_expiry()
    }

    /// Releases every pin whose lease ended by `now`; each is reported by `poll_expired`.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(id) = self.pins.first_expired(now) {
            let pages = self.unpin(id).expect("an expired pin is live");
            self.expired.push_back(PinExpired { pin: id, pages });
        }
    }

    /// The next pin released by `handle_timeout`.
    pub fn poll_expired(&mut self) -> Option<PinExpired> {
        self.expired.pop_front()
    }

    /// Puts a held page whose KV is complete into the prefix cache under `key`, keeping a copy of
    /// its `tokens` to verify every later hit.
    ///
    /// Call only once every token of the page has been computed and its step's outputs applied:
    /// a page cached earlier could be matched before its KV exists (sglang#38355).
    pub fn cache_insert(
        &mut self,
        page: PageRef,
        key: CacheKey,
        tokens: &[u32],
    ) -> Result<CacheInsert, KvError> {
        let PageState::Held { refs, pins, cache } = self.page(page)?.state else {
            return Err(KvError::NotHeld(page));
        };
        if cache.is_some() {
            return Err(KvError::AlreadyCached(page));
        }
        if tokens.len() != self.config.page_tokens as usize {
            return Err(KvError::WrongTokenCount {
                expected: self.config.page_tokens,
                got: tokens.len(),
            });
        }
        let pages = &self.pages;
        if let Err(existing) =
            self.index.insert(key.hash, page.index, |p| cache_hash(pages, p) == Some(key.hash))
        {
            let generation = self.pages[existing as usize].generation;
            return Ok(CacheInsert::KeyTaken(PageRef { index: existing, generation }));
        }
        self.page_tokens_mut(page.index).copy_from_slice(tokens);
        self.pages[page.index as usize].state = PageState::Held { refs, pins, cache: Some(key) };
        self.checked.touch(page.index);
        Ok(CacheInsert::Inserted)
    }

    /// The cached page holding exactly `tokens` after the page keyed `key.parent`, if any. Takes
    /// no reference: call `retain` to use it.
    pub fn cache_lookup(&self, key: CacheKey, tokens: &[u32]) -> Option<PageRef> {
        let index = self.index.get(key.hash, |p| cache_hash(&self.pages, p) == Some(key.hash))?;
        self.holds(index, key, tokens).then(|| self.handle(index))
    }

    /// Whether page `index` is cached under exactly `key` and holds exactly `tokens`: what makes a
    /// hash collision a miss rather than another request's KV.
    fn holds(&self, index: u32, key: CacheKey, tokens: &[u32]) -> bool {
        let cached = match self.pages[index as usize].state {
            PageState::Held { cache, .. } => cache,
            PageState::Evictable { cache } => Some(cache),
            PageState::Free => None,
        };
        cached == Some(key) && self.page_tokens_of(index) == tokens
    }

    fn handle(&self, index: u32) -> PageRef {
        PageRef { index, generation: self.pages[index as usize].generation }
    }

    /// Retains the longest run of cached pages that holds `tokens` from its start, given the
    /// sequence's page keys (`keys[i]` names tokens of page `i`, chained from `root`). Appends the
    /// pages to `out` and returns how many matched.
    pub fn match_prefix(
        &mut self,
        root: u64,
        keys: &[u64],
        tokens: &[u32],
        out: &mut Vec<PageRef>,
    ) -> usize {
        // Look everything up first, then take references: the lookups are independent reads the
        // processor overlaps, where interleaved writes would serialize them.
        let first = out.len();
        let matched = self.lookup_prefix(root, keys, tokens, out);
        for &page in &out[first..] {
            self.retain(page).expect("a page found in the cache is live");
        }
        matched
    }

    /// The longest run of cached pages holding `tokens` from its start, appended to `out`,
    /// without taking references.
    pub fn lookup_prefix(
        &self,
        root: u64,
        keys: &[u64],
        tokens: &[u32],
        out: &mut Vec<PageRef>,
    ) -> usize {
        const BLOCK: usize = 64;
        let page_tokens = self.config.page_tokens as usize;
        let pages_max = keys.len().min(tokens.len() / page_tokens);
        let mut candidates = [0u32; BLOCK];
        let mut parent = root;
        for block_start in (0..pages_max).step_by(BLOCK) {
            let block = &keys[block_start..pages_max.min(block_start + BLOCK)];
            self.index.home_candidates(block, &mut candidates);
            for (i, (&hash, &candidate)) in block.iter().zip(&candidates).enumerate() {
                let page = block_start + i;
                let key = CacheKey { hash, parent };
                let page_tokens_slice = &tokens[page * page_tokens..(page + 1) * page_tokens];
                let found =
                    if candidate != u32::MAX && self.holds(candidate, key, page_tokens_slice) {
                        Some(self.handle(candidate))
                    } else {
                        self.cache_lookup(key, page_tokens_slice)
                    };
                let Some(found) = found else {
                    return page;
                };
                out.push(found);
                parent = hash;
            }
        }
        pages_max
    }

    /// Moves to `out` every page whose contents ended since the last call: returned to the free
    /// list, or evicted from the prefix cache (a page merely becoming evictable keeps its KV and
    /// is not listed). Each page once, however often it was freed in between, so at most
    /// `pages_total` of them. A page listed may already be held again: it was handed out after it
    /// was freed. The driver passes them to the executor (`Executor::release_pages`) before any
    /// call that may write KV, which is what makes that safe: see the engine loops.
    pub fn take_freed(&mut self, out: &mut Vec<u32>) {
        self.freed.take(out);
    }

    /// Pages freed or evicted and not yet taken (`take_freed`): none once a driver is idle, or a
    /// page lost its contents without its executor hearing of it.
    pub fn freed_untaken_count(&self) -> usize {
        self.freed.list.len()
    }

    /// Checks every invariant in the module docs. O(pages + pins + cached tokens).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        const KV: &str = "kv";
        let total = self.pages.len();
        let mut on_free_list = vec![false; total];
        for &index in &self.free {
            let page = self.pages.get(index as usize);
            ensure_invariant!(
                KV,
                page.is_some(),
                "free list names page {index}, which is not in the pool"
            );
            ensure_invariant!(
                KV,
                !on_free_list[index as usize],
                "page {index} is on the free list twice"
            );
            on_free_list[index as usize] = true;
        }
        let lru_order = self.lru.walk().map_err(|e| InvariantViolation::new(KV, e))?;
        let mut on_lru = vec![false; total];
        for &index in &lru_order {
            ensure_invariant!(
                KV,
                (index as usize) < total,
                "lru names page {index}, which is not in the pool"
            );
            on_lru[index as usize] = true;
        }
        let mut pins_seen = vec![0u32; total];
        for (id, pin) in self.pins.live() {
            for page in &pin.pages {
                let held = self.pages.get(page.index as usize);
                ensure_invariant!(
                    KV,
                    held.is_some_and(|p| p.generation == page.generation),
                    "pin {id:?} holds stale page {page:?}"
                );
                pins_seen[page.index as usize] += 1;
            }
        }
        self.pins.check().map_err(|e| InvariantViolation::new(KV, e))?;

        let (mut free, mut held, mut evictable, mut cached) = (0usize, 0usize, 0usize, 0usize);
        for (index, page) in self.pages.iter().enumerate() {
            let key = match page.state {
                PageState::Free => {
                    free += 1;
                    ensure_invariant!(
                        KV,
                        on_free_list[index],
                        "free page {index} is not on the free list"
                    );
                    ensure_invariant!(
                        KV,
                        pins_seen[index] == 0,
                        "free page {index} has {} live pins",
                        pins_seen[index]
                    );
                    None
                }
                PageState::Held { refs, pins, cache } => {
                    held += 1;
                    ensure_invariant!(
                        KV,
                        refs + pins >= 1,
                        "held page {index} has no reference and no pin"
                    );
                    ensure_invariant!(
                        KV,
                        pins == pins_seen[index],
                        "page {index} counts {pins} pins, {} are live",
                        pins_seen[index]
                    );
                    ensure_invariant!(
                        KV,
                        !on_free_list[index],
                        "held page {index} is on the free list"
                    );
                    ensure_invariant!(
                        KV,
                        !on_lru[index],
                        "held page {index} is on the eviction list"
                    );
                    cache
                }
                PageState::Evictable { cache } => {
                    evictable += 1;
                    ensure_invariant!(
                        KV,
                        on_lru[index],
                        "evictable page {index} is not on the eviction list"
                    );
                    ensure_invariant!(
                        KV,
                        !on_free_list[index],
                        "evictable page {index} is on the free list"
                    );
                    ensure_invariant!(
                        KV,
                        pins_seen[index] == 0,
                        "evictable page {index} has live pins"
                    );
                    Some(cache)
                }
            };
            if let Some(key) = key {
                cached += 1;
                ensure_invariant!(
                    KV,
                    self.index.get(key.hash, |p| cache_hash(&self.pages, p) == Some(key.hash))
                        == Some(index as u32),
                    "cached page {index} is not indexed under its key {:#x}",
                    key.hash
                );
                let rehash = block_hash(key.parent, self.page_tokens_of(index as u32));
                ensure_invariant!(
                    KV,
                    rehash == key.hash,
                    "cached page {index}'s tokens hash to {rehash:#x}, not its key {:#x}",
                    key.hash
                );
            }
        }
        // Each page is counted in exactly one state above, and the free-list checks above already
        // tie the free list to the free pages: what is left to compare is the pool's size.
        ensure_invariant!(
            KV,
            total == self.config.pages_total as usize,
            "the pool has {total} pages ({free} free, {held} held, {evictable} evictable), \
             configured {}",
            self.config.pages_total
        );
        ensure_invariant!(
            KV,
            evictable == lru_order.len(),
            "{evictable} evictable pages but {} on the eviction list",
            lru_order.len()
        );
        // Entries first, so that one naming a freed page is reported as that; the count then
        // catches a page indexed twice.
        for (fingerprint, index) in self.index.entries() {
            let state = self.pages.get(index as usize).map(|p| p.state);
            let names_it = cache_hash(&self.pages, index)
                .is_some_and(|h| prefix_fingerprint(h) == fingerprint);
            ensure_invariant!(
                KV,
                names_it,
                "index entry {fingerprint:#x} points at page {index}, which is {state:?}"
            );
        }
        ensure_invariant!(
            KV,
            cached == self.index.len(),
            "{cached} cached pages but {} index entries",
            self.index.len()
        );
        self.freed.check()?;
        // Last, so that a state broken by hand is reported by the check about it, not as a
        // change the log missed.
        self.check_change_log()?;
        Ok(())
    }

    fn page(&self, page: PageRef) -> Result<&Page, KvError> {
        let found = self.pages.get(page.index as usize).ok_or(KvError::NoSuchPage(page))?;
        if found.generation != page.generation || found.state == PageState::Free {
            return Err(KvError::StaleHandle(page));
        }
        Ok(found)
    }

    /// After a release or unpin: a page with no reference and no pin left leaves `Held`.
    fn settle(&mut self, index: u32) {
        let page = &mut self.pages[index as usize];
        let PageState::Held { refs: 0, pins: 0, cache } = page.state else {
            return;
        };
        match cache {
            Some(cache) => {
                page.state = PageState::Evictable { cache };
                self.lru.push_back(index);
            }
            None => {
                page.state = PageState::Free;
                // Every handle to the old contents is stale from here on.
                page.generation = page.generation.wrapping_add(1);
                self.free.push(index);
                self.freed.push(index);
            }
        }
    }

    /// Takes an evictable page out of the cache; the caller hands it out at once.
    fn evict(&mut self, index: u32) {
        let PageState::Evictable { cache } = self.pages[index as usize].state else {
            unreachable!(
                "page {index} on the eviction list is {:?}",
                self.pages[index as usize].state
            );
        };
        let pages = &self.pages;
        let removed = self.index.remove(cache.hash, |p| cache_hash(pages, p) == Some(cache.hash));
        assert_eq!(removed, Some(index), "evicted page {index} was not indexed under its key");
        let page = &mut self.pages[index as usize];
        page.state = PageState::Free;
        page.generation = page.generation.wrapping_add(1);
        self.freed.push(index);
    }

    fn page_tokens_of(&self, index: u32) -> &[u32] {
        let n = self.config.page_tokens as usize;
        &self.cached_tokens[index as usize * n..(index as usize + 1) * n]
    }

    fn page_tokens_mut(&mut self, index: u32) -> &mut [u32] {
        let n = self.config.page_tokens as usize;
        &mut self.cached_tokens[index as usize * n..(index as usize + 1) * n]
    }
}

/// Pages freed since the driver last took them: a list in freeing order and a mark per page, so a
/// page freed twice is listed once and the list never outgrows the pool.
#[derive(Clone, Debug)]
struct FreedPages {
    list: Vec<u32>,
    listed: Vec<bool>,
}

impl FreedPages {
    fn new(pages_total: usize) -> FreedPages {
        FreedPages { list: Vec::new(), listed: vec![false; pages_total] }
    }

    fn push(&mut self, index: u32) {
        let listed = &mut self.listed[index as usize];
        if !*listed {
            *listed = true;
            self.list.push(index);
        }
    }

    fn take(&mut self, out: &mut Vec<u32>) {
        for &index in &self.list {
            self.listed[index as usize] = false;
        }
        out.append(&mut self.list);
    }

    /// The list and the marks name the same pages, each once.
    fn check(&self) -> Result<(), InvariantViolation> {
        const KV: &str = "kv";
        let mut seen = vec![false; self.listed.len()];
        for &index in &self.list {
            let i = index as usize;
            ensure_invariant!(
                KV,
                i < self.listed.len(),
                "freed list names page {index}, which is not in the pool"
            );
            ensure_invariant!(KV, !seen[i], "page {index} is on the freed list twice");
            ensure_invariant!(KV, self.listed[i], "freed page {index} is listed but not marked");
            seen[i] = true;
        }
        let marked = self.listed.iter().filter(|&&m| m).count();
        ensure_invariant!(
            KV,
            marked == self.list.len(),
            "{marked} pages marked freed, {} listed",
            self.list.len()
        );
        Ok(())
    }
}

/// The cache key hash of page `index`, if it is cached.
/// The key hash of a cached page; `None` for a free page or an index beyond the pool (which a
/// broken index could name: the check must report it, not panic on it).
fn cache_hash(pages: &[Page], index: u32) -> Option<u64> {
    match pages.get(index as usize)?.state {
        PageState::Held { cache, .. } => cache.map(|k| k.hash),
        PageState::Evictable { cache } => Some(cache.hash),
        PageState::Free => None,
    }
}

mod incremental;

#[cfg(test)]
mod freed_tests;
#[cfg(test)]
mod invariant_tests;
#[cfg(test)]
mod tests;
