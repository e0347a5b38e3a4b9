//! Unit tests of the pool, including one per invariant check on a hand-broken state: a check that
//! cannot fire is no check.

use super::*;
use crate::kv::prefix_hash::{block_hash, root_hash};

fn pool(pages_total: u32, page_tokens: u32) -> PagePool {
    PagePool::new(PoolConfig { pages_total, page_tokens, pins_max: pages_total }).unwrap()
}

fn ok(pool: &PagePool) {
    if let Err(e) = pool.check_invariants() {
        panic!("{e}");
    }
}

fn cache(pool: &mut PagePool, page: PageRef, parent: u64, tokens: &[u32]) -> CacheKey {
    let key = CacheKey { hash: block_hash(parent, tokens), parent };
    assert_eq!(pool.cache_insert(page, key, tokens), Ok(CacheInsert::Inserted));
    key
}

#[test]
fn config_is_validated() {
    assert!(PagePool::new(PoolConfig { pages_total: 0, page_tokens: 16, pins_max: 0 }).is_err());
    assert!(PagePool::new(PoolConfig { pages_total: 4, page_tokens: 0, pins_max: 0 }).is_err());
    assert!(
        PagePool::new(PoolConfig { pages_total: u32::MAX, page_tokens: 16, pins_max: 0 }).is_err()
    );
}

/// Each bound is inclusive, and the error names the field and its range: these come from an
/// operator's flags. (`validate` alone: a pool of `PAGES_MAX` pages would not fit in memory.)
#[test]
fn config_bounds_are_inclusive_and_errors_name_the_field() {
    let max = PoolConfig::PAGES_MAX;
    let config =
        |pages_total, page_tokens, pins_max| PoolConfig { pages_total, page_tokens, pins_max };
    assert_eq!(config(max, PoolConfig::PAGE_TOKENS_MAX, max).validate(), Ok(()));
    let refused = |c: PoolConfig| c.validate().expect_err("out of bounds").to_string();
    assert_eq!(
        refused(config(max + 1, 16, 0)),
        format!("invalid page pool config: pages_total {} is not in 1..={max}", max + 1)
    );
    let too_large = PoolConfig::PAGE_TOKENS_MAX + 1;
    assert!(refused(config(4, too_large, 0)).contains(&format!("page_tokens {too_large} is not")));
    assert!(refused(config(4, 16, max + 1)).contains(&format!("pins_max {} is over", max + 1)));
}

#[test]
fn allocate_until_empty_then_refuse() {
    let mut pool = pool(3, 4);
    let pages: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    assert_eq!(pages.iter().map(|p| p.index()).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(pool.allocate(), Err(KvError::OutOfPages { needed: 1, available: 0 }));
    let mut out = Vec::new();
    assert_eq!(
        pool.allocate_many(1, &mut out),
        Err(KvError::OutOfPages { needed: 1, available: 0 })
    );
    assert!(out.is_empty());
    ok(&pool);
    pool.release(pages[1]).unwrap();
    assert_eq!(pool.free_count(), 1);
    ok(&pool);
}

#[test]
fn allocate_many_is_all_or_nothing() {
    let mut pool = pool(4, 4);
    let mut out = Vec::new();
    pool.allocate_many(3, &mut out).unwrap();
    assert_eq!(
        pool.allocate_many(2, &mut out),
        Err(KvError::OutOfPages { needed: 2, available: 1 })
    );
    assert_eq!(out.len(), 3);
    assert_eq!(pool.free_count(), 1);
    ok(&pool);
}

#[test]
fn stale_handles_are_refused_never_served() {
    let mut pool = pool(1, 4);
    let old = pool.allocate().unwrap();
    pool.release(old).unwrap();
    let new = pool.allocate().unwrap();
    assert_eq!(old.index(), new.index());
    assert_ne!(old, new, "a reused page must carry a new generation");
    assert_eq!(pool.release(old), Err(KvError::StaleHandle(old)));
    assert_eq!(pool.retain(old), Err(KvError::StaleHandle(old)));
    assert_eq!(pool.pin(old, Time::MAX), Err(KvError::StaleHandle(old)));
    assert_eq!(pool.refs(new), Ok(1), "the stale release must not touch the new owner's page");
    ok(&pool);
}

#[test]
fn refcounts_free_on_last_release_only() {
    let mut pool = pool(2, 4);
    let page = pool.allocate().unwrap();
    pool.retain(page).unwrap();
    pool.release(page).unwrap();
    assert_eq!(pool.refs(page), Ok(1));
    pool.release(page).unwrap();
    assert_eq!(pool.free_count(), 2);
    assert_eq!(pool.release(page), Err(KvError::StaleHandle(page)), "double free is refused");
    ok(&pool);
}

#[test]
fn cached_pages_survive_release_and_are_hit_later() {
    let mut pool = pool(4, 4);
    let root = root_hash(0);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    let ka = cache(&mut pool, a, root, &tokens[..4]);
    let kb = cache(&mut pool, b, ka.hash, &tokens[4..]);
    pool.release(a).unwrap();
    pool.release(b).unwrap();
    assert_eq!((pool.evictable_count(), pool.free_count()), (2, 2));
    ok(&pool);

    let mut hit = Vec::new();
    assert_eq!(pool.match_prefix(root, &[ka.hash, kb.hash], &tokens, &mut hit), 2);
    assert_eq!(hit, vec![a, b], "a hit returns the same pages with the same generations");
    assert_eq!(pool.evictable_count(), 0);
    ok(&pool);
}

#[test]
fn a_hit_checks_tokens_and_parent_not_just_the_hash() {
    let mut pool = pool(2, 2);
    let root = root_hash(0);
    let page = pool.allocate().unwrap();
    let key = cache(&mut pool, page, root, &[5, 6]);
    assert!(pool.cache_lookup(key, &[5, 6]).is_some());
    // Same hash, other tokens: what a hash collision looks like. A miss, never the page.
    assert!(pool.cache_lookup(key, &[5, 7]).is_none());
    assert!(pool.cache_lookup(CacheKey { hash: key.hash, parent: root ^ 1 }, &[5, 6]).is_none());
}

#[test]
fn eviction_takes_least_recently_used_and_only_unreferenced() {
    let mut pool = pool(3, 1);
    let root = root_hash(0);
    let pages: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    let keys: Vec<_> =
        pages.iter().zip(10u32..).map(|(p, t)| cache(&mut pool, *p, root, &[t])).collect();
    // Release in the order 2, 0; page 1 stays referenced.
    pool.release(pages[2]).unwrap();
    pool.release(pages[0]).unwrap();
    let first = pool.allocate().unwrap();
    assert_eq!(first.index(), 2, "least recently released goes first");
    assert!(pool.cache_lookup(keys[2], &[12]).is_none(), "an evicted page leaves the cache");
    assert_eq!(pool.release(pages[2]), Err(KvError::StaleHandle(pages[2])));
    let second = pool.allocate().unwrap();
    assert_eq!(second.index(), 0);
    assert_eq!(
        pool.allocate(),
        Err(KvError::OutOfPages { needed: 1, available: 0 }),
        "a referenced cached page is never evicted"
    );
    assert!(pool.cache_lookup(keys[1], &[11]).is_some());
    ok(&pool);
}

#[test]
fn key_taken_leaves_the_second_page_uncached() {
    let mut pool = pool(2, 2);
    let root = root_hash(0);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    let key = cache(&mut pool, a, root, &[1, 2]);
    assert_eq!(pool.cache_insert(b, key, &[1, 2]), Ok(CacheInsert::KeyTaken(a)));
    assert_eq!(pool.cache_insert(a, key, &[1, 2]), Err(KvError::AlreadyCached(a)));
    assert_eq!(
        pool.cache_insert(b, key, &[1]),
        Err(KvError::WrongTokenCount { expected: 2, got: 1 })
    );
    pool.release(b).unwrap();
    assert_eq!(pool.free_count(), 1);
    ok(&pool);
}

#[test]
fn pinned_pages_are_never_freed_or_evicted() {
    let mut pool = pool(1, 1);
    let page = pool.allocate().unwrap();
    cache(&mut pool, page, root_hash(0), &[3]);
    let pin = pool.pin(page, Time::from_millis(10)).unwrap();
    pool.release(page).unwrap();
    assert_eq!(pool.refs(page), Ok(0));
    assert_eq!(
        pool.allocate(),
        Err(KvError::OutOfPages { needed: 1, available: 0 }),
        "pinned, so not evictable"
    );
    ok(&pool);
    assert_eq!(pool.unpin(pin), Ok(vec![page]));
    assert_eq!(pool.unpin(pin), Err(KvError::UnknownPin(pin)));
    assert_eq!(pool.evictable_count(), 1);
    ok(&pool);
}

/// Pins expiring together are released first-made first, whatever slots they sit in: here the
/// later pin reuses slot 0, which the first pin let go of, and still comes out after the pin in
/// slot 1. (Release order is what the owners hear, `PinExpired` by `PinExpired`: it must depend
/// on the history of pins, not on where a slot happened to be free.)
#[test]
fn pins_expiring_together_are_released_in_the_order_they_were_made() {
    let mut pool = pool(3, 2);
    let pages: Vec<PageRef> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    let at = Time::from_millis(10);
    let first = pool.pin(pages[0], at).unwrap();
    let second = pool.pin(pages[1], at).unwrap();
    pool.unpin(first).unwrap();
    let third = pool.pin(pages[2], at).unwrap();
    assert!(third < second, "the third pin reuses the first's slot 0");
    for page in pages {
        pool.release(page).unwrap();
    }
    pool.handle_timeout(at);
    let expired: Vec<PinId> = std::iter::from_fn(|| pool.poll_expired()).map(|e| e.pin).collect();
    assert_eq!(expired, [second, third]);
    ok(&pool);
}

#[test]
fn pin_leases_expire_and_heartbeats_extend_them() {
    let mut pool = pool(2, 1);
    let page = pool.allocate().unwrap();
    let pin = pool.pin(page, Time::from_millis(10)).unwrap();
    pool.release(page).unwrap();
    assert_eq!(pool.next_timeout(), Some(Time::from_millis(10)));
    pool.extend_pin(pin, Time::from_millis(20)).unwrap();
    pool.handle_timeout(Time::from_millis(15));
    assert_eq!(pool.poll_expired(), None);
    assert_eq!(pool.free_count(), 1);
    pool.handle_timeout(Time::from_millis(20));
    assert_eq!(pool.poll_expired(), Some(PinExpired { pin, pages: vec![page] }));
    assert_eq!(pool.free_count(), 2, "the expired lease released the page");
    assert_eq!(pool.next_timeout(), None);
    assert_eq!(pool.extend_pin(pin, Time::MAX), Err(KvError::UnknownPin(pin)));
    ok(&pool);
}

#[test]
fn pins_are_bounded() {
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 2, page_tokens: 1, pins_max: 1 }).unwrap();
    let page = pool.allocate().unwrap();
    pool.pin(page, Time::MAX).unwrap();
    assert_eq!(pool.pin(page, Time::MAX), Err(KvError::TooManyPins));
    assert_eq!(pool.pin_count(page), Ok(1));
    ok(&pool);
}

#[test]
fn evictable_and_free_pages_cannot_be_released_or_pinned() {
    let mut pool = pool(2, 1);
    let page = pool.allocate().unwrap();
    cache(&mut pool, page, root_hash(0), &[1]);
    pool.release(page).unwrap();
    assert_eq!(pool.release(page), Err(KvError::NotHeld(page)));
    assert_eq!(pool.pin(page, Time::MAX), Err(KvError::NotHeld(page)));
    let bogus = PageRef { index: 9, generation: 0 };
    assert_eq!(pool.retain(bogus), Err(KvError::NoSuchPage(bogus)));
}

// --- Each invariant check fires on a state broken by hand. ---

fn broken(f: impl FnOnce(&mut PagePool)) -> String {
    let mut pool = pool(4, 2);
    let a = pool.allocate().unwrap();
    let b = pool.allocate().unwrap();
    let key = cache(&mut pool, a, root_hash(0), &[1, 2]);
    pool.release(a).unwrap();
    pool.pin(b, Time::MAX).unwrap();
    let _ = key;
    ok(&pool);
    f(&mut pool);
    match pool.check_invariants() {
        Ok(()) => panic!("the invariant check missed a broken state"),
        Err(e) => e.what().to_owned(),
    }
}

#[test]
fn check_fires_on_page_missing_from_free_list() {
    assert!(
        broken(|p| {
            p.free.pop();
        })
        .contains("not on the free list")
    );
}

#[test]
fn check_fires_on_page_listed_free_twice() {
    assert!(
        broken(|p| {
            let i = p.free[0];
            p.free.push(i);
        })
        .contains("twice")
    );
}

#[test]
fn check_fires_on_held_page_without_refs_or_pins() {
    assert!(
        broken(|p| p.pages[1].state = PageState::Held { refs: 0, pins: 0, cache: None })
            .contains("no reference and no pin")
    );
}

#[test]
fn check_fires_on_pin_count_mismatch() {
    assert!(
        broken(|p| p.pages[1].state = PageState::Held { refs: 1, pins: 2, cache: None })
            .contains("pins")
    );
}

#[test]
fn check_fires_on_freed_page_that_is_pinned() {
    // The page a transfer pinned, freed anyway: a one-sided write would land in its next owner.
    let what = broken(|p| {
        p.pages[1].state = PageState::Free;
        p.free.push(1);
    });
    assert!(what.contains("live pins") || what.contains("stale"), "{what}");
}

#[test]
fn check_fires_on_evictable_page_off_the_lru() {
    assert!(
        broken(|p| {
            p.lru.remove(0);
        })
        .contains("eviction list")
    );
}

#[test]
fn check_fires_on_cached_page_freed_while_indexed() {
    // sglang#38355's shape: the cache index still names a page that was freed.
    let what = broken(|p| {
        p.lru.remove(0);
        p.pages[0].state = PageState::Free;
        p.free.push(0);
    });
    assert!(what.contains("index entr"), "{what}");
}

#[test]
fn check_fires_on_stored_tokens_that_do_not_match_the_key() {
    assert!(broken(|p| p.cached_tokens[0] = 99).contains("hash to"));
}

#[test]
fn check_fires_on_index_entry_lost() {
    let what = broken(|p| {
        let key = match p.pages[0].state {
            PageState::Evictable { cache } => cache,
            s => panic!("{s:?}"),
        };
        p.index.remove(key.hash, |_| true);
    });
    assert!(what.contains("not indexed"), "{what}");
}

#[test]
fn one_pin_holds_a_transfers_pages_under_one_lease() {
    let mut pool = pool(4, 1);
    let pages: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    let pin = pool.pin_many(&pages, Time::from_millis(10)).unwrap();
    for &page in &pages {
        pool.release(page).unwrap();
        assert_eq!(pool.pin_count(page), Ok(1));
    }
    assert_eq!(pool.free_count(), 1);
    ok(&pool);
    pool.extend_pin(pin, Time::from_millis(20)).unwrap();
    pool.handle_timeout(Time::from_millis(10));
    assert_eq!(pool.free_count(), 1, "extended once, for every page");
    pool.handle_timeout(Time::from_millis(20));
    assert_eq!(pool.poll_expired(), Some(PinExpired { pin, pages: pages.clone() }));
    assert_eq!(pool.free_count(), 4);
    // All or none: a stale page in the set pins nothing.
    let held = pool.allocate().unwrap();
    assert_eq!(pool.pin_many(&[held, pages[0]], Time::MAX), Err(KvError::StaleHandle(pages[0])));
    assert_eq!(pool.pin_count(held), Ok(0));
    ok(&pool);
}
