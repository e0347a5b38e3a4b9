//! Each check of `Digests::check` fires on a cache broken by hand (the promise that the cache
//! equals recomputing is shown in `provenance_tests.rs`).

use super::*;
use crate::sched::{Bucket, RequestId, RowPlan, StepId, StepPlan};

/// Slot 0's table cut at `from`, then `pages` appended.
fn table_update(from: u32, pages: &[u32]) -> StepPlan {
    StepPlan {
        step: StepId(0),
        rows: vec![RowPlan {
            request: RequestId(1),
            slot: 0,
            positions: 0..0,
            inputs: 0..0,
            page_table_from: from,
            page_updates: 0..pages.len() as u32,
            sample: false,
        }],
        input_tokens: Vec::new(),
        page_updates: pages.iter().map(|&p| PageRef::from_parts(p, 0)).collect(),
        bucket: Bucket::Eager,
    }
}

struct Legit {
    digests: Digests,
    tables: PageTables,
    kv: Vec<u64>,
}

/// Four pages of two values, two slots; slot 0's table is pages 2, 0, 1, all three folded.
fn legit() -> Legit {
    let mut digests = Digests::new(4, 2, 2);
    let mut tables = PageTables::new(2);
    tables.apply(&table_update(0, &[2, 0, 1])).unwrap();
    let kv: Vec<u64> = (1..=8).collect();
    digests.digest(0, tables.table(0), 6, &kv);
    digests.check(&tables, &kv).unwrap();
    Legit { digests, tables, kv }
}

fn fires(break_it: impl FnOnce(&mut Legit), expected: &str) {
    let mut l = legit();
    break_it(&mut l);
    match l.digests.check(&l.tables, &l.kv) {
        Ok(()) => panic!("the check {expected:?} missed a broken cache"),
        Err(e) => assert!(e.contains(expected), "expected {expected:?}, got {e}"),
    }
}

#[test]
fn a_value_changed_behind_the_caches_back() {
    fires(|l| l.kv[4] = 99, "page 2's cached terms are not its values'");
}

#[test]
fn a_fold_loses_a_sum() {
    fires(|l| _ = l.digests.folds[0].sums.pop(), "slot 0's fold has vectors of different lengths");
}

#[test]
fn a_table_cut_the_fold_missed() {
    fires(
        |l| l.tables.apply(&table_update(1, &[])).unwrap(),
        "slot 0's fold covers 3 pages of a table of 1",
    );
}

#[test]
fn a_fold_names_a_page_its_table_does_not() {
    fires(|l| l.digests.folds[0].pages[1] = 3, "slot 0's fold has page 3 at 1, its table 0");
}

#[test]
fn a_sum_is_wrong() {
    fires(|l| l.digests.folds[0].sums[1] ^= 1, "slot 0's sum at 1 is not its pages' values'");
}

#[test]
fn a_folding_is_off_its_pages_watch_list() {
    fires(|l| l.digests.pages[0].watches.clear(), "slot 0's folding at 1 is not watched by page 0");
}

/// `slots` slots whose tables are page 0 of two values, each folded once.
fn sharing_page_0(slots: u32) -> (Digests, PageTables, Vec<u64>) {
    let mut digests = Digests::new(1, 2, slots);
    let mut tables = PageTables::new(slots);
    let kv = vec![1, 2];
    for slot in 0..slots {
        let mut plan = table_update(0, &[0]);
        plan.rows[0].slot = slot;
        tables.apply(&plan).unwrap();
        digests.digest(slot, tables.table(slot), 2, &kv);
    }
    (digests, tables, kv)
}

/// Slot 0's fold cut and made again `times` times, as a cached system prompt's page is by
/// request after request in one slot; the cache checked after.
fn refold_slot_0(digests: &mut Digests, tables: &PageTables, kv: &[u64], times: u32) {
    for _ in 0..times {
        digests.table_cut(0, 0);
        digests.digest(0, tables.table(0), 2, kv);
    }
    digests.check(tables, kv).unwrap();
}

/// Dead entries do not pile up, and a list that compaction keeps mostly empty does not grow: a
/// page folded a thousand times by one slot while another's folding of it stays live keeps room
/// for 4 entries (the least a `Vec` of them allocates).
#[test]
fn a_page_folded_anew_again_and_again_keeps_a_short_watch_list() {
    let (mut digests, tables, kv) = sharing_page_0(2);
    refold_slot_0(&mut digests, &tables, &kv, 1000);
    let watches = &digests.pages[0].watches;
    assert_eq!(watches.capacity(), 4, "{} entries", watches.len());
}

/// A list mostly live grows instead of being compacted again after a few entries: with 60 live
/// entries, a thousand foldings cost compaction under three visits each (each compaction of a
/// full list of capacity C leaves at least C/2 free, so two each amortized), and at least one for
/// each entry it dropped.
#[test]
fn compaction_visits_a_few_entries_per_folding() {
    let (mut digests, tables, kv) = sharing_page_0(60);
    let before = digests.watch_visits;
    refold_slot_0(&mut digests, &tables, &kv, 1000);
    let visits = digests.watch_visits - before;
    let dropped = 60 + 1000 - digests.pages[0].watches.len() as u64;
    assert!(
        (dropped..3000).contains(&visits),
        "compaction visited {visits} entries for 1000 foldings, dropping {dropped}"
    );
}

/// Every bit of a value and of its position changes its term: a digest blind to some bits (an
/// `|` for an `^` in `term` ignores each bit the other side has set) would take stale KV that
/// differs from the right value only there for the right value.
#[test]
fn every_bit_of_a_value_and_of_its_position_changes_its_term() {
    for (value, position) in [(0, 0), (u64::MAX, 7), (0x1234_5678_9abc_def1, 1 << 40)] {
        let t = term(value, position);
        for bit in 0..64 {
            assert_ne!(term(value ^ 1 << bit, position), t, "value bit {bit}");
            assert_ne!(term(value, position ^ 1 << bit), t, "position bit {bit}");
        }
    }
}

/// And every bit of the sum and of the length changes a digest's finish.
#[test]
fn every_bit_of_a_sum_and_of_a_length_changes_the_finish() {
    for (sum, len) in [(0, 0), (u64::MAX, 7), (0x1234_5678_9abc_def1, 1 << 20)] {
        let f = finish(sum, len);
        for bit in 0..64 {
            assert_ne!(finish(sum ^ 1 << bit, len), f, "sum bit {bit}");
        }
        for bit in 0..32 {
            assert_ne!(finish(sum, len ^ 1 << bit), f, "length bit {bit}");
        }
    }
}

/// `mix` is SplitMix64's finalizer, a bijection (so distinct KV values stay distinct): its first
/// two outputs from seed 0, as published with the generator, pin it.
#[test]
fn mix_is_splitmix64s_finalizer() {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    assert_eq!(mix(GAMMA), 0xe220_a839_7b1d_cdaf);
    assert_eq!(mix(GAMMA.wrapping_mul(2)), 0x6e78_9e6a_a1b9_65f4);
}
