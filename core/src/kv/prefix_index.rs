//! The prefix cache's index: page key (a 64-bit chained hash) to page number.
//!
//! An open-addressed table sized once at start to at least twice the pool, so it never grows,
//! never allocates after construction, and stays at most half full. A slot holds the key's upper
//! 32 bits and the page number, 8 bytes, so a 65,536-page pool's index fits in 1 MiB of cache;
//! the owner confirms a candidate against the page's full key. Linear probing with backward-shift
//! deletion keeps lookups short without tombstones. Nothing ever iterates it to make a decision;
//! iteration exists only for `check_invariants`.

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    fingerprint: u32,
    page: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    slots: Vec<Slot>,
    mask: usize,
    len: usize,
}

impl PrefixIndex {
    /// A table able to hold `entries_max` keys at a load of at most one half.
    pub(crate) fn with_capacity(entries_max: usize) -> PrefixIndex {
        let slots = (entries_max.max(1) * 2).next_power_of_two();
        PrefixIndex {
            slots: vec![Slot { fingerprint: 0, page: EMPTY }; slots],
            mask: slots - 1,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The page indexed under `key`; `has_key(page)` confirms a candidate's full key.
    pub(crate) fn get(&self, key: u64, has_key: impl Fn(u32) -> bool) -> Option<u32> {
        self.find(key, has_key).map(|(_, page)| page)
    }

    /// The slot and page indexed under `key`.
    fn find(&self, key: u64, has_key: impl Fn(u32) -> bool) -> Option<(usize, u32)> {
        let fingerprint = fingerprint(key);
        let mut slot = self.home(fingerprint);
        loop {
            let Slot { fingerprint: found, page } = self.slots[slot];
            if page == EMPTY {
                return None;
            }
            if found == fingerprint && has_key(page) {
                return Some((slot, page));
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// The page in each key's home slot when the fingerprint there matches, else `u32::MAX`.
    ///
    /// A tight loop of independent loads: the processor keeps dozens in flight, where lookups one
    /// by one, each followed by its checks, keep a few. A long prompt's keys land all over the
    /// index, so this is what makes matching it fast; `get` then finds the slots in cache.
    pub(crate) fn home_candidates(&self, keys: &[u64], out: &mut [u32]) {
        for (key, out) in keys.iter().zip(out) {
            let fingerprint = fingerprint(*key);
            let slot = self.slots[self.home(fingerprint)];
            *out = if slot.fingerprint == fingerprint { slot.page } else { EMPTY };
        }
    }

    /// Indexes `page` under `key`. Returns the page already there, and changes nothing, if the key
    /// is taken.
    pub(crate) fn insert(
        &mut self,
        key: u64,
        page: u32,
        has_key: impl Fn(u32) -> bool,
    ) -> Result<(), u32> {
        assert_ne!(page, EMPTY, "page number {EMPTY} is reserved");
        assert!(
            self.len < self.slots.len() / 2,
            "prefix index sized for fewer entries than the pool has pages"
        );
        let fingerprint = fingerprint(key);
        let mut slot = self.home(fingerprint);
        loop {
            let Slot { fingerprint: found, page: existing } = self.slots[slot];
            if existing == EMPTY {
                self.slots[slot] = Slot { fingerprint, page };
                self.len += 1;
                return Ok(());
            }
            if found == fingerprint && has_key(existing) {
                return Err(existing);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Removes `key`, returning its page.
    pub(crate) fn remove(&mut self, key: u64, has_key: impl Fn(u32) -> bool) -> Option<u32> {
        let (slot, page) = self.find(key, has_key)?;
        self.slots[slot].page = EMPTY;
        self.len -= 1;
        self.close_gap(slot);
        Some(page)
    }

    /// Every `(fingerprint, page)`, in table order. For invariant checks only.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.slots.iter().filter(|s| s.page != EMPTY).map(|s| (s.fingerprint, s.page))
    }

    fn home(&self, fingerprint: u32) -> usize {
        (u64::from(fingerprint).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & self.mask
    }

    /// Backward-shift deletion: pull later entries of the probe run into the hole, so that every
    /// entry stays reachable from its home slot without tombstones.
    fn close_gap(&mut self, mut hole: usize) {
        let mut slot = (hole + 1) & self.mask;
        while self.slots[slot].page != EMPTY {
            let home = self.home(self.slots[slot].fingerprint);
            // The entry may move to `hole` only if `hole` lies on its probe path home..=slot.
            let distance_to_slot = slot.wrapping_sub(home) & self.mask;
            let distance_to_hole = hole.wrapping_sub(home) & self.mask;
            if distance_to_hole < distance_to_slot {
                self.slots[hole] = self.slots[slot];
                self.slots[slot].page = EMPTY;
                hole = slot;
            }
            slot = (slot + 1) & self.mask;
        }
    }
}

/// The upper half of a key: what a slot keeps of it.
pub(crate) fn fingerprint(key: u64) -> u32 {
    (key >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The fast path of a long prompt's lookup: a key in its home slot gives its page, any other
    /// key gives `EMPTY`. (The pool confirms every candidate and falls back to `get`, so a wrong
    /// answer here costs speed, never correctness: only this test sees it.)
    #[test]
    fn home_candidates_name_the_page_in_each_keys_home_slot() {
        let mut index = PrefixIndex::with_capacity(16);
        let (present, absent) = (7u64 << 32 | 1, 9u64 << 32 | 1);
        index.insert(present, 3, |_| false).unwrap();
        let mut out = [0; 2];
        index.home_candidates(&[present, absent], &mut out);
        assert_eq!(out, [3, EMPTY]);
    }

    /// Keys spread over the table: their home slots are where lookups start, and keys that all
    /// started in one slot would make every probe run the whole table (still correct, so only
    /// this test sees it). 64 fingerprints in 128 slots take at least 32 homes.
    #[test]
    fn keys_spread_over_their_home_slots() {
        let index = PrefixIndex::with_capacity(64);
        let homes: std::collections::BTreeSet<usize> =
            (0..64u32).map(|f| index.home(f.wrapping_mul(0x2545_f491))).collect();
        assert!(homes.len() >= 32, "64 keys in {} home slots", homes.len());
    }

    #[test]
    fn behaves_like_a_map_under_churn() {
        let mut index = PrefixIndex::with_capacity(64);
        let mut model: BTreeMap<u64, u32> = BTreeMap::new();
        // Keys whose fingerprints collide on purpose: few distinct upper halves, so home slots and
        // fingerprints are shared and only the full-key check tells entries apart.
        let mut state = 1u64;
        for step in 0..20_000u32 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (state >> 61) << 32 | (state >> 58);
            let keys: BTreeMap<u32, u64> = model.iter().map(|(k, p)| (*p, *k)).collect();
            let has_key = |page: u32| keys.get(&page) == Some(&key);
            if model.len() < 64 && state & 1 == 0 {
                let expected = model.get(&key).copied();
                match index.insert(key, step, has_key) {
                    Ok(()) => {
                        assert_eq!(expected, None);
                        model.insert(key, step);
                    }
                    Err(page) => assert_eq!(Some(page), expected),
                }
            } else {
                assert_eq!(index.remove(key, has_key), model.remove(&key));
            }
            assert_eq!(index.len(), model.len());
            let keys: BTreeMap<u32, u64> = model.iter().map(|(k, p)| (*p, *k)).collect();
            for (k, v) in &model {
                assert_eq!(
                    index.get(*k, |page| keys.get(&page) == Some(k)),
                    Some(*v),
                    "key {k:#x} lost at step {step}"
                );
            }
        }
    }
}
