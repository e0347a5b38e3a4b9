//! Every check of `LruList::walk`, which `PagePool::check_invariants` runs on its eviction list,
//! fires on a list broken by hand (`kv/pool/invariant_tests.rs` shows its errors reach the pool's
//! check).
//!
//! | check | message | test |
//! |---|---|---|
//! | bounded walk | "lru list longer than its length {len} (a cycle?)" | `the_list_is_longer_than_its_length` |
//! | links in range | "lru link to page {page}, beyond the list's {n} pages" | `a_link_leaves_the_list` |
//! | back links | "lru page {page}: back link {b} but came from {prev}" | `a_back_link_is_wrong` |
//! | tail | "lru tail is {tail} but the walk ended at {prev}" | `the_tail_is_wrong` |
//! | length | "lru holds {n} pages but says {len}" | `the_length_is_wrong` |

use super::*;

/// Pages 2, 0, 3 in that order, out of 4.
fn legit() -> LruList {
    let mut list = LruList::new(4);
    for page in [2, 0, 3] {
        list.push_back(page);
    }
    list
}

fn fires(break_it: impl FnOnce(&mut LruList), expected: &str) {
    let mut list = legit();
    assert_eq!(list.walk(), Ok(vec![2, 0, 3]));
    break_it(&mut list);
    match list.walk() {
        Ok(order) => panic!("the check {expected:?} missed a broken list: {order:?}"),
        Err(e) => assert!(e.contains(expected), "expected {expected:?}, got {e:?}"),
    }
}

#[test]
fn the_list_is_longer_than_its_length() {
    // Understated by two or more: the walk stops before it could loop forever.
    fires(|l| l.len = 1, "lru list longer than its length 1");
}

#[test]
fn a_link_leaves_the_list() {
    fires(|l| l.next[0] = 9, "lru link to page 9, beyond the list's 4 pages");
}

#[test]
fn a_back_link_is_wrong() {
    fires(|l| l.prev[0] = 3, "lru page 0: back link 3 but came from 2");
}

#[test]
fn the_tail_is_wrong() {
    fires(|l| l.tail = 0, "lru tail is 0 but the walk ended at 3");
}

#[test]
fn the_length_is_wrong() {
    fires(|l| l.len = 4, "lru holds 3 pages but says 4");
}
