//! The freed list (`PagePool::take_freed`): what it lists, and that each of its checks fires on a
//! list broken by hand.

use super::*;
use crate::kv::prefix_hash::root_hash;

fn pool(pages_total: u32) -> PagePool {
    PagePool::new(PoolConfig { pages_total, page_tokens: 2, pins_max: 4 }).unwrap()
}

fn taken(pool: &mut PagePool) -> Vec<u32> {
    let mut out = Vec::new();
    pool.take_freed(&mut out);
    out
}

/// Caches `page` under the first key of a chain holding `tokens`.
fn cache(pool: &mut PagePool, page: PageRef, tokens: &[u32]) {
    let root = root_hash(0);
    let key = CacheKey { hash: block_hash(root, tokens), parent: root };
    assert_eq!(pool.cache_insert(page, key, tokens), Ok(CacheInsert::Inserted));
}

#[test]
fn freed_pages_are_listed_once_until_taken() {
    let mut pool = pool(4);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    assert_eq!(taken(&mut pool), Vec::<u32>::new(), "allocating frees nothing");
    pool.release(b).unwrap();
    pool.release(a).unwrap();
    // Freed again after being handed out again: still listed once.
    let a2 = pool.allocate().unwrap();
    assert_eq!(a2.index(), a.index());
    pool.release(a2).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.freed_untaken_count(), 2);
    assert_eq!(taken(&mut pool), vec![b.index(), a.index()]);
    assert_eq!(pool.freed_untaken_count(), 0);
    assert_eq!(taken(&mut pool), Vec::<u32>::new(), "taking empties the list");
    pool.check_invariants().unwrap();
}

#[test]
fn a_cached_page_is_listed_when_evicted_not_when_it_becomes_evictable() {
    let mut pool = pool(1);
    let a = pool.allocate().unwrap();
    cache(&mut pool, a, &[1, 2]);
    pool.release(a).unwrap();
    assert_eq!(taken(&mut pool), Vec::<u32>::new(), "an evictable page keeps its KV");
    // No free page: the allocation evicts the cached one and hands it out at once.
    let b = pool.allocate().unwrap();
    assert_eq!(b.index(), a.index());
    assert_eq!(taken(&mut pool), vec![a.index()], "evicted, so its KV is gone");
    pool.check_invariants().unwrap();
}

#[test]
fn a_pinned_page_is_listed_only_when_its_pin_goes() {
    let mut pool = pool(2);
    let a = pool.allocate().unwrap();
    let pin = pool.pin(a, Time::MAX).unwrap();
    pool.release(a).unwrap();
    assert_eq!(taken(&mut pool), Vec::<u32>::new(), "a pinned page is held");
    pool.unpin(pin).unwrap();
    assert_eq!(taken(&mut pool), vec![a.index()]);
}

/// A pool with pages 1 and 0 freed and not taken, checked clean.
fn legit() -> PagePool {
    let mut pool = pool(4);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    pool.release(b).unwrap();
    pool.release(a).unwrap();
    pool.check_invariants().unwrap();
    pool
}

fn fires(break_it: impl FnOnce(&mut FreedPages), expected: &str) {
    let mut pool = legit();
    break_it(&mut pool.freed);
    match pool.check_invariants() {
        Ok(()) => panic!("the check {expected:?} missed a broken freed list"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn the_freed_list_names_a_page_outside_the_pool() {
    fires(|f| f.list.push(9), "freed list names page 9, which is not in the pool");
}

#[test]
fn a_page_is_on_the_freed_list_twice() {
    fires(|f| f.list.push(1), "page 1 is on the freed list twice");
}

#[test]
fn a_listed_page_is_not_marked() {
    fires(|f| f.listed[0] = false, "freed page 0 is listed but not marked");
}

#[test]
fn a_marked_page_is_not_listed() {
    fires(|f| f.listed[3] = true, "3 pages marked freed, 2 listed");
}
