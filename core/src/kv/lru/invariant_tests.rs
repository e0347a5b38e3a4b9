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
//!
//! `LruList::linked`, the one-page check of the pool's incremental check:
//!
//! | check | message | test |
//! |---|---|---|
//! | page in range | "lru page {page} is beyond the list's {n} pages" | `linked_is_asked_about_a_page_beyond_the_list` |
//! | links lead back | "lru page {page}: its links {prev} and {next} do not both lead back" | `a_pages_links_do_not_lead_back` (six ways) |

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

#[test]
fn linked_tells_listed_pages_from_others() {
    let list = legit();
    let linked: Vec<_> = (0..4).map(|page| list.linked(page)).collect();
    assert_eq!(linked, [Ok(true), Ok(false), Ok(true), Ok(true)]);
    let mut alone = LruList::new(2);
    alone.push_back(1);
    assert_eq!((alone.linked(0), alone.linked(1)), (Ok(false), Ok(true)));
}

#[test]
fn linked_is_asked_about_a_page_beyond_the_list() {
    assert_eq!(legit().linked(4), Err("lru page 4 is beyond the list's 4 pages".to_string()));
}

#[test]
fn a_pages_links_do_not_lead_back() {
    type Break = fn(&mut LruList);
    let cases: [(Break, u32); 6] = [
        // Page 0's successor does not point back at it.
        (|l| l.prev[3] = 2, 0),
        // The head is page 2, yet page 0 claims no predecessor.
        (|l| l.prev[0] = NIL, 0),
        // An unlisted page that the head names.
        (|l| l.head = 1, 1),
        // The tail's successor link leaves the list's end.
        (|l| l.next[3] = 1, 3),
        // An unlisted page with stale links into the list, one or both: neither leads back,
        // yet it is not the clean unlinked page either.
        (|l| l.next[1] = 3, 1),
        (
            |l| {
                l.prev[1] = 2;
                l.next[1] = 3;
            },
            1,
        ),
    ];
    for (break_it, page) in cases {
        let mut list = legit();
        break_it(&mut list);
        match list.linked(page) {
            Err(e) => assert!(e.contains(&format!("lru page {page}: its links")), "{e}"),
            Ok(linked) => panic!("page {page}'s broken links were taken for linked={linked}"),
        }
    }
}
