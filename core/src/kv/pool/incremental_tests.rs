//! Every check of `PagePool::check_invariants_incremental` fires on a state broken by hand, and so
//! does every check the full check makes of the incremental one's log (`check_change_log`). Each
//! test builds a legitimate pool through its API, runs the check to empty the log, breaks one thing
//! through the private fields (logging the page, as a mutator would, where the check is about
//! logged pages) and sees that very check report it, matched by its message.
//!
//! | check | message | test |
//! |---|---|---|
//! | incremental: logged page's links (`LruList::linked`) | "lru page {index}: its links …" | `a_logged_pages_links_are_broken` (the ways: `kv/lru/invariant_tests.rs`) |
//! | incremental: logged free page off the eviction list | "free page {index} is on the eviction list" | `a_logged_free_page_is_on_the_eviction_list` |
//! | incremental: logged held page has a holder | "held page {index} has no reference and no pin" | `a_logged_held_page_has_no_holder` |
//! | incremental: logged held page off the eviction list | "held page {index} is on the eviction list" | `a_logged_held_page_is_on_the_eviction_list` |
//! | incremental: logged evictable page listed | "evictable page {index} is not on the eviction list" | `a_logged_evictable_page_is_off_the_eviction_list` |
//! | incremental: logged cached page indexed | "cached page {index} is not indexed under its key {hash}" | `a_logged_cached_page_is_not_indexed` |
//! | incremental: newly cached tokens match the key | "cached page {index}'s tokens hash to {h}, not its key {hash}" | `a_newly_cached_pages_tokens_do_not_match_its_key` |
//! | incremental: free count | "{n} free pages but {m} on the free list" | `the_free_list_lost_a_page` |
//! | incremental: evictable count | "{n} evictable pages but {m} on the eviction list" | `an_unlogged_free_page_is_on_the_eviction_list` |
//! | incremental: cached count | "{n} cached pages but {m} index entries" | `a_stray_index_entry_is_counted` |
//! | incremental: pin count | "pages count {n} pins, live pins name {m} pages" | `a_page_counts_a_pin_nobody_holds` |
//! | full: log in range | "change log names page {index}, which is not in the pool" | `the_change_log_names_a_page_beyond_the_pool` |
//! | full: log once each | "page {index} is on the change log twice" | `a_page_is_on_the_change_log_twice` |
//! | full: logged pages marked | "page {index} is on the change log but not marked" | `a_logged_page_is_not_marked` |
//! | full: log sized to the pool | "the change log marks {n} and summarizes {m} pages of {total}" | `the_change_log_is_sized_for_another_pool` |
//! | full: marked pages logged | "page {index} is marked changed but not on the change log" | `a_marked_page_is_not_on_the_change_log` |
//! | full: no change unlogged | "page {index} changed without being logged: …" | `a_page_changed_without_being_logged` |
//! | full: totals are sums | "the incremental check's totals {t} are not the sums of its summaries {s}" | `the_totals_drift_from_the_summaries` |

use super::super::*;
use crate::kv::prefix_hash::root_hash;

/// As `invariant_tests.rs`'s: four pages of two tokens: page 0 cached and evictable, page 1 held
/// (one reference) and pinned, pages 2 and 3 free. Both checks passed, the log empty.
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
    pool.check_invariants_incremental().unwrap_or_else(|e| panic!("legit pool refused: {e}"));
    pool.check_invariants().unwrap_or_else(|e| panic!("legit pool refused: {e}"));
    (pool, key)
}

/// Breaks the legitimate pool and asserts the incremental check reports `expected`.
fn incremental_fires(break_it: impl FnOnce(&mut PagePool, CacheKey), expected: &str) {
    let (mut pool, key) = legit();
    break_it(&mut pool, key);
    match pool.check_invariants_incremental() {
        Ok(()) => panic!("the incremental check {expected:?} missed a broken pool"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

/// Breaks the legitimate pool and asserts the full check reports `expected`.
fn full_fires(break_it: impl FnOnce(&mut PagePool, CacheKey), expected: &str) {
    let (mut pool, key) = legit();
    break_it(&mut pool, key);
    match pool.check_invariants() {
        Ok(()) => panic!("the full check {expected:?} missed a broken pool"),
        Err(e) => assert!(e.what().contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn both_checks_pass_through_a_pools_life_and_agree_on_the_references() {
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 8, page_tokens: 2, pins_max: 4 }).unwrap();
    let root = root_hash(0);
    let mut held = Vec::new();
    let mut parent = root;
    for step in 0..200u32 {
        match step % 7 {
            0..=2 => {
                if let Ok(page) = pool.allocate() {
                    held.push(page);
                }
            }
            3 => {
                if let Some(&page) = held.last() {
                    let tokens = [step, step + 1];
                    let key = CacheKey { hash: block_hash(parent, &tokens), parent };
                    if pool.cache_insert(page, key, &tokens) == Ok(CacheInsert::Inserted) {
                        parent = key.hash;
                    }
                }
            }
            4 => {
                if let Some(&page) = held.first() {
                    pool.retain(page).unwrap();
                    held.push(page);
                }
            }
            5 => {
                if let Some(&page) = held.first() {
                    let pin = pool.pin(page, Time::MAX).unwrap();
                    pool.release(held.remove(0)).unwrap();
                    if step % 2 == 0 {
                        pool.unpin(pin).unwrap();
                    } else {
                        pool.extend_pin(pin, Time::from_millis(u64::from(step))).unwrap();
                        pool.handle_timeout(Time::from_millis(u64::from(step)));
                    }
                }
            }
            _ => {
                for page in held.drain(..held.len() / 2) {
                    pool.release(page).unwrap();
                }
            }
        }
        if step % 3 != 0 {
            // Not after every change: the log covers several at once.
            pool.check_invariants_incremental().unwrap_or_else(|e| panic!("step {step}: {e}"));
            assert_eq!(pool.refs_total_checked(), pool.refs_total(), "step {step}");
        }
        pool.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
}

#[test]
fn nothing_changed_nothing_checked() {
    let (mut pool, _) = legit();
    // Broken where only the full check looks, and not logged: the incremental check has
    // nothing to look at. This is the price of its cost, and why the full one must still run.
    pool.free.swap(0, 1);
    pool.pages[2].generation += 1;
    assert_eq!(pool.check_invariants_incremental(), Ok(()));
}

#[test]
fn a_logged_pages_links_are_broken() {
    incremental_fires(
        |p, _| {
            // Pushed twice, page 2 becomes its own neighbour, and page 0's successor no longer
            // points back at it.
            p.lru.push_back(2);
            p.lru.push_back(2);
            p.checked.touch(0);
        },
        "lru page 0: its links",
    );
}

#[test]
fn a_logged_free_page_is_on_the_eviction_list() {
    incremental_fires(
        |p, _| {
            p.lru.push_back(3);
            p.checked.touch(3);
        },
        "free page 3 is on the eviction list",
    );
}

#[test]
fn a_logged_held_page_has_no_holder() {
    incremental_fires(
        |p, _| {
            p.pages[1].state = PageState::Held { refs: 0, pins: 0, cache: None };
            p.checked.touch(1);
        },
        "held page 1 has no reference and no pin",
    );
}

#[test]
fn a_logged_held_page_is_on_the_eviction_list() {
    incremental_fires(
        |p, _| {
            p.lru.push_back(1);
            p.checked.touch(1);
        },
        "held page 1 is on the eviction list",
    );
}

#[test]
fn a_logged_evictable_page_is_off_the_eviction_list() {
    incremental_fires(
        |p, _| {
            p.lru.remove(0);
            p.checked.touch(0);
        },
        "evictable page 0 is not on the eviction list",
    );
}

#[test]
fn a_logged_cached_page_is_not_indexed() {
    incremental_fires(
        |p, key| {
            let pages = p.pages.clone();
            p.index.remove(key.hash, |i| cache_hash(&pages, i) == Some(key.hash)).unwrap();
            p.checked.touch(0);
        },
        "cached page 0 is not indexed under its key",
    );
}

#[test]
fn a_newly_cached_pages_tokens_do_not_match_its_key() {
    incremental_fires(
        |p, _| {
            let page = PageRef { index: 1, generation: p.pages[1].generation };
            let root = root_hash(0);
            let key = CacheKey { hash: block_hash(root, &[5, 6]), parent: root };
            assert_eq!(p.cache_insert(page, key, &[5, 6]), Ok(CacheInsert::Inserted));
            p.page_tokens_mut(1)[0] = 7;
        },
        "cached page 1's tokens hash to",
    );
}

#[test]
fn the_free_list_lost_a_page() {
    incremental_fires(
        |p, _| {
            p.free.pop();
        },
        "2 free pages but 1 on the free list",
    );
}

#[test]
fn an_unlogged_free_page_is_on_the_eviction_list() {
    incremental_fires(|p, _| p.lru.push_back(2), "1 evictable pages but 2 on the eviction list");
}

#[test]
fn a_stray_index_entry_is_counted() {
    incremental_fires(
        |p, key| p.index.insert(key.hash ^ 1, 3, |_| false).unwrap(),
        "1 cached pages but 2 index entries",
    );
}

#[test]
fn a_page_counts_a_pin_nobody_holds() {
    incremental_fires(
        |p, _| {
            p.pages[1].state = PageState::Held { refs: 1, pins: 2, cache: None };
            p.checked.touch(1);
        },
        "pages count 2 pins, live pins name 1 pages",
    );
}

#[test]
fn the_change_log_names_a_page_beyond_the_pool() {
    full_fires(
        |p, _| p.checked.touched.push(9),
        "change log names page 9, which is not in the pool",
    );
}

#[test]
fn a_page_is_on_the_change_log_twice() {
    full_fires(
        |p, _| {
            p.checked.touch(2);
            p.checked.touched.push(2);
        },
        "page 2 is on the change log twice",
    );
}

#[test]
fn a_logged_page_is_not_marked() {
    full_fires(|p, _| p.checked.touched.push(2), "page 2 is on the change log but not marked");
}

#[test]
fn the_change_log_is_sized_for_another_pool() {
    full_fires(
        |p, _| p.checked.marked.push(false),
        "the change log marks 5 and summarizes 4 pages of 4",
    );
}

#[test]
fn a_marked_page_is_not_on_the_change_log() {
    full_fires(
        |p, _| p.checked.marked[3] = true,
        "page 3 is marked changed but not on the change log",
    );
}

#[test]
fn a_page_changed_without_being_logged() {
    // A mutator that forgot to log: one more reference on page 1, which every other check allows.
    full_fires(
        |p, _| p.pages[1].state = PageState::Held { refs: 2, pins: 1, cache: None },
        "page 1 changed without being logged",
    );
}

#[test]
fn the_totals_drift_from_the_summaries() {
    full_fires(|p, _| p.checked.totals.refs += 1, "the incremental check's totals");
}
