//! Every check of `PinTable::check`, which `PagePool::check_invariants` runs on its pins, fires on
//! a table broken by hand. (The table's own methods keep it consistent, so the pool's tests
//! cannot break it; its errors reach the pool's check unchanged, through `?`.)
//!
//! | check | message | test |
//! |---|---|---|
//! | free list names free slots once | "pin slot {slot} on the free list is live, missing or listed twice" | `the_free_list_names_a_live_missing_or_repeated_slot` (all three ways) |
//! | free slots listed | "free pin slot {slot} is not on the free list" | `a_free_slot_is_not_on_the_free_list` |
//! | live pins ordered by expiry | "pin slot {slot} is missing from the expiry order" | `a_live_pin_is_missing_from_the_expiry_order` |
//! | expiry order size | "expiry order holds {n} entries for {m} live pins" | `the_expiry_order_holds_an_extra_entry` |
//! | pinned pages counted | "pin table counts {n} pinned pages, its live pins name {m}" | `the_pinned_pages_are_miscounted` |

use super::*;

/// Three slots: pins in slots 0 and 1 (expiring at 10 and 20 ms), slot 2 free.
fn legit() -> PinTable {
    let mut table = PinTable::new(3);
    for (page, ms) in [(0, 10), (1, 20)] {
        let pages = vec![PageRef::from_parts(page, 0)];
        table.insert(Pin { pages, expires_at: Time::from_millis(ms) }).unwrap();
    }
    assert_eq!(table.live_count(), 2);
    table
}

fn fires(break_it: impl FnOnce(&mut PinTable), expected: &str) {
    let mut table = legit();
    assert_eq!(table.check(), Ok(()));
    break_it(&mut table);
    match table.check() {
        Ok(()) => panic!("the check {expected:?} missed a broken pin table"),
        Err(e) => assert!(e.contains(expected), "expected {expected:?}, got {e:?}"),
    }
}

#[test]
fn the_free_list_names_a_live_missing_or_repeated_slot() {
    for slot in [0, 7, 2] {
        fires(
            |t| t.free.push(slot),
            &format!("pin slot {slot} on the free list is live, missing or listed twice"),
        );
    }
}

#[test]
fn a_free_slot_is_not_on_the_free_list() {
    fires(|t| t.free.clear(), "free pin slot 2 is not on the free list");
}

#[test]
fn a_live_pin_is_missing_from_the_expiry_order() {
    fires(
        |t| {
            t.by_expiry.pop_first();
        },
        "pin slot 0 is missing from the expiry order",
    );
}

#[test]
fn the_expiry_order_holds_an_extra_entry() {
    fires(
        |t| {
            t.by_expiry.insert((Time::from_millis(30), 99, 2));
        },
        "expiry order holds 3 entries for 2 live pins",
    );
}

#[test]
fn the_pinned_pages_are_miscounted() {
    fires(|t| t.pages_pinned += 1, "pin table counts 3 pinned pages, its live pins name 2");
}
