//! The paged KV page pool and its prefix cache (DESIGN.md section 3, "kv").
//!
//! A fixed number of pages of `page_tokens` tokens each, all allocated at construction. Each page
//! is in exactly one state:
//!
//! ```text
//!            allocate                      release (last ref, no pin)
//!   Free ──────────────────▶ Held ───────────────────────────────────▶ Free      (not cached)
//!    ▲                     refs+pins≥1  ─────────────────────────────▶ Evictable (cached)
//!    │                        ▲                                            │
//!    │                        └──────────── retain (prefix-cache hit) ─────┘
//!    └──────────── evicted by allocate when no page is free (LRU first) ◀──┘
//! ```
//!
//! Invariants (`PagePool::check_invariants`): free + held + evictable = total; the free list holds
//! exactly the free pages and the LRU list exactly the evictable ones; a held page has at least one
//! reference or pin; every live pin is counted on its page and no pinned page is free or evictable;
//! the prefix index maps each cached page's key to that page and nothing else, and each cached
//! page's stored tokens hash to its key. Every handle carries its page's generation, which changes
//! whenever the page's contents stop being what the handle referred to (freed or evicted), so a
//! stale handle is refused, never served.

mod lru;
mod pins;
mod pool;
pub mod prefix_hash;
mod prefix_index;

pub use pins::PinId;
pub use pool::{CacheInsert, CacheKey, KvError, PagePool, PinExpired, PoolConfig, PoolConfigError};

/// A handle to one page: its number and the generation it had when the handle was made.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PageRef {
    index: u32,
    generation: u32,
}

impl PageRef {
    /// A handle from its parts, as a page named on the wire arrives. The pool checks it like any
    /// other handle: a stale one is refused.
    pub fn from_parts(index: u32, generation: u32) -> PageRef {
        PageRef { index, generation }
    }

    /// The page's number, from 0 to `pages_total - 1`: where its KV lives in the device buffer.
    pub fn index(self) -> u32 {
        self.index
    }

    pub fn generation(self) -> u32 {
        self.generation
    }
}
