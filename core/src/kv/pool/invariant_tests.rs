//! Every check of `PagePool::check_invariants` fires on a state broken by hand: each test builds a
//! legitimate pool through its API, sees the check pass, breaks one thing through the private
//! fields and sees that very check report it (matched by its message). A check that cannot fire
//! is no check.
//!
//! | check | message | test |
//! |---|---|---|
//! | free list in range | "free list names page {index}, which is not in the pool" | `free_list_names_a_page_outside_the_pool` |
//! | free list once each | "page {index} is on the free list twice" | `a_page_is_on_the_free_list_twice` |
//! | lru walk (`LruList::walk`, 5 checks) | "lru ..." | `kv/lru/invariant_tests.rs`; reaching this check: `an_lru_error_is_reported_by_the_pool` |
//! | lru in range | "lru names page {index}, which is not in the pool" | `the_lru_names_a_page_outside_the_pool` |
//! | pins hold live pages | "pin {id:?} holds stale page {page:?}" | `a_pin_holds_a_stale_page` |
//! | pin table (`PinTable::check`, 4 checks) | "pin slot ..." / "expiry order ..." | `kv/pins/invariant_tests.rs` |
//! | free page listed | "free page {index} is not on the free list" | `a_free_page_is_not_on_the_free_list` |
//! | free page unpinned | "free page {index} has {n} live pins" | `a_free_page_has_live_pins` |
//! | held page has a holder | "held page {index} has no reference and no pin" | `a_held_page_has_no_reference_and_no_pin` |
//! | pin count | "page {index} counts {pins} pins, {n} are live" | `a_page_miscounts_its_pins` |
//! | held not free | "held page {index} is on the free list" | `a_held_page_is_on_the_free_list` |
//! | held not evictable | "held page {index} is on the eviction list" | `a_held_page_is_on_the_eviction_list` |
//! | evictable listed | "evictable page {index} is not on the eviction list" | `an_evictable_page_is_off_the_eviction_list` |
//! | evictable not free | "evictable page {index} is on the free list" | `an_evictable_page_is_on_the_free_list` |
//! | evictable unpinned | "evictable page {index} has live pins" | `an_evictable_page_has_live_pins` |
//! | cached page indexed | "cached page {index} is not indexed under its key {hash}" | `a_cached_page_is_not_indexed` |
//! | cached tokens match key | "cached page {index}'s tokens hash to {h}, not its key {hash}" | `a_cached_pages_tokens_do_not_match_its_key` |
//! | pages = configured total | "the pool has {} pages (...), configured {}" | `the_pool_has_more_pages_than_configured` |
//! | evictable count | "{n} evictable pages but {m} on the eviction list" | `a_free_page_is_on_the_eviction_list` |
//! | cached count | "{cached} cached pages but {n} index entries" | `a_cached_page_is_indexed_twice` |
//! | index entries name cached pages | "index entry {fp} points at page {index}, which is {state}" | `an_index_entry_names_a_freed_page`, `an_index_entry_names_a_page_beyond_the_pool` |

use super::*;
use crate::kv::prefix_hash::root_hash;

/// Four pages of two tokens: page 0 cached and evictable, page 1 held (one reference) and pinned,
/// pages 2 and 3 free.
fn legit() -> (PagePool, CacheKey) {
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 4, page_tokens: 2, pins_max: 4 }).unwrap();
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    let root = root_hash(0);
    let key = CacheKey { hash: block_hash(root, &[1, 2]), parent: root };
    assert_eq!(pool.cache_insert(a, key, &[1, 2]), Ok(CacheInsert::Inserted));
    pool.release(a).unwrap();
    pool.pin(b, Time::MAX).unwrap();
    assert_eq!((a.index(), b.index()), (0, 1));
    assert_eq!((pool.evictable_count(), pool.held_count(), pool.free_count()), (1, 1, 2));
    (pool, key)
}

/// Breaks the legitimate pool with `break_it` and asserts the check whose message contains
/// `expected` is the one that fires.
fn fires(break_it: impl FnOnce(&mut PagePool, CacheKey), expected: &str) {
    let (mut pool, key) = legit();
    if let Err(e) = pool.check_invariants() {
        panic!("the legitimate pool is refused: {e}");
    }
    break_it(&mut pool, key);
    match pool.check_invariants() {
        Ok(()) => panic!("the check {expected:?} missed a broken pool"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn free_list_names_a_page_outside_the_pool() {
    fires(|p, _| p.free.push(9), "free list names page 9, which is not in the pool");
}

#[test]
fn a_page_is_on_the_free_list_twice() {
    fires(|p, _| p.free.push(2), "page 2 is on the free list twice");
}

#[test]
fn an_lru_error_is_reported_by_the_pool() {
    // Page 0 put on the eviction list a second time: its back link now names itself.
    fires(|p, _| p.lru.push_back(0), "lru page 0: back link 0 but came from");
}

#[test]
fn the_lru_names_a_page_outside_the_pool() {
    // Only a list sized for more pages than the pool can name one outside it: within its own
    // size, `LruList::walk` reports an out-of-range link first.
    fires(
        |p, _| {
            p.lru = LruList::new(8);
            p.lru.push_back(0);
            p.lru.push_back(6);
        },
        "lru names page 6, which is not in the pool",
    );
}

#[test]
fn a_pin_holds_a_stale_page() {
    // Page 1 reused (its generation moved on) under the transfer's pin.
    fires(|p, _| p.pages[1].generation += 1, "holds stale page PageRef { index: 1");
}

#[test]
fn a_free_page_is_not_on_the_free_list() {
    fires(|p, _| p.free.retain(|&i| i != 2), "free page 2 is not on the free list");
}

#[test]
fn a_free_page_has_live_pins() {
    // The page a transfer pinned, freed anyway: a one-sided write would land in its next owner.
    fires(
        |p, _| {
            p.pages[1].state = PageState::Free;
            p.free.push(1);
        },
        "free page 1 has 1 live pins",
    );
}

#[test]
fn a_held_page_has_no_reference_and_no_pin() {
    // Free page 2 taken off the free list and marked held by nobody: a leak.
    fires(
        |p, _| {
            p.free.retain(|&i| i != 2);
            p.pages[2].state = PageState::Held { refs: 0, pins: 0, cache: None };
        },
        "held page 2 has no reference and no pin",
    );
}

#[test]
fn a_page_miscounts_its_pins() {
    fires(
        |p, _| p.pages[1].state = PageState::Held { refs: 1, pins: 2, cache: None },
        "page 1 counts 2 pins, 1 are live",
    );
}

#[test]
fn a_held_page_is_on_the_free_list() {
    fires(|p, _| p.free.push(1), "held page 1 is on the free list");
}

#[test]
fn a_held_page_is_on_the_eviction_list() {
    fires(|p, _| p.lru.push_back(1), "held page 1 is on the eviction list");
}

#[test]
fn an_evictable_page_is_off_the_eviction_list() {
    fires(|p, _| p.lru.remove(0), "evictable page 0 is not on the eviction list");
}

#[test]
fn an_evictable_page_is_on_the_free_list() {
    fires(|p, _| p.free.push(0), "evictable page 0 is on the free list");
}

#[test]
fn an_evictable_page_has_live_pins() {
    // A pin on a cached page nobody holds: eviction would hand it out under a pin.
    fires(
        |p, _| {
            let page = p.handle(0);
            p.pins.insert(Pin { pages: vec![page], expires_at: Time::MAX }).unwrap();
        },
        "evictable page 0 has live pins",
    );
}

#[test]
fn a_cached_page_is_not_indexed() {
    fires(
        |p, key| {
            p.index.remove(key.hash, |_| true).unwrap();
        },
        "cached page 0 is not indexed under its key",
    );
}

#[test]
fn a_cached_pages_tokens_do_not_match_its_key() {
    fires(|p, _| p.cached_tokens[0] = 99, "cached page 0's tokens hash to");
}

#[test]
fn a_free_page_is_on_the_eviction_list() {
    // No per-page check sees a free page on the eviction list; the count does.
    fires(|p, _| p.lru.push_back(2), "1 evictable pages but 2 on the eviction list");
}

#[test]
fn a_cached_page_is_indexed_twice() {
    // A second entry for page 0 under its own key, as a double insert would leave.
    fires(
        |p, key| p.index.insert(key.hash, 0, |_| false).unwrap(),
        "1 cached pages but 2 index entries",
    );
}

#[test]
fn the_pool_has_more_pages_than_configured() {
    fires(
        |p, _| {
            p.pages.push(Page {
                generation: 0,
                state: PageState::Held { refs: 1, pins: 0, cache: None },
            })
        },
        "the pool has 5 pages (2 free, 2 held, 1 evictable), configured 4",
    );
}

#[test]
fn an_index_entry_names_a_freed_page() {
    // sglang#38355's shape: the cache index still names a page that was freed.
    fires(
        |p, _| {
            p.lru.remove(0);
            p.pages[0].state = PageState::Free;
            p.free.push(0);
        },
        "points at page 0, which is Some(Free)",
    );
}

#[test]
fn an_index_entry_names_a_page_beyond_the_pool() {
    fires(
        |p, key| p.index.insert(key.hash ^ 1, 9, |_| false).unwrap(),
        "points at page 9, which is None",
    );
}
