//! The prefix cache's index: page key (a 64-bit chained hash) to page number.
//!
//! An open-addressed table sized once at start to at least twice the pool, so it never grows,
//! never allocates after construction, and stays at most half full. Linear probing with
//! backward-shift deletion keeps lookups short without tombstones. Nothing ever iterates it to
//! make a decision; iteration exists only for `check_invariants`.

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    keys: Vec<u64>,
    pages: Vec<u32>,
    mask: usize,
    len: usize,
}

impl PrefixIndex {
    /// A table able to hold `entries_max` keys at a load of at most one half.
    pub(crate) fn with_capacity(entries_max: usize) -> PrefixIndex {
        let slots = (entries_max.max(1) * 2).next_power_of_two();
        PrefixIndex { keys: vec![0; slots], pages: vec![EMPTY; slots], mask: slots - 1, len: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn get(&self, key: u64) -> Option<u32> {
        let mut slot = self.home(key);
        loop {
            let page = self.pages[slot];
            if page == EMPTY {
                return None;
            }
            if self.keys[slot] == key {
                return Some(page);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Inserts `key -> page`. Returns the page already there, and changes nothing, if the key is
    /// taken.
    pub(crate) fn insert(&mut self, key: u64, page: u32) -> Result<(), u32> {
        assert_ne!(page, EMPTY, "page number {EMPTY} is reserved");
        assert!(
            self.len < self.keys.len() / 2,
            "prefix index sized for fewer entries than the pool has pages"
        );
        let mut slot = self.home(key);
        loop {
            let existing = self.pages[slot];
            if existing == EMPTY {
                self.keys[slot] = key;
                self.pages[slot] = page;
                self.len += 1;
                return Ok(());
            }
            if self.keys[slot] == key {
                return Err(existing);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Removes `key`, returning its page.
    pub(crate) fn remove(&mut self, key: u64) -> Option<u32> {
        let mut slot = self.home(key);
        loop {
            let page = self.pages[slot];
            if page == EMPTY {
                return None;
            }
            if self.keys[slot] == key {
                self.pages[slot] = EMPTY;
                self.len -= 1;
                self.close_gap(slot);
                return Some(page);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Every `(key, page)`, in table order. For invariant checks only.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.keys.iter().zip(&self.pages).filter(|(_, p)| **p != EMPTY).map(|(k, p)| (*k, *p))
    }

    fn home(&self, key: u64) -> usize {
        // Keys are already well-mixed hashes; the high bits pick the slot.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & self.mask
    }

    /// Backward-shift deletion: pull later entries of the probe run into the hole, so that every
    /// entry stays reachable from its home slot without tombstones.
    fn close_gap(&mut self, mut hole: usize) {
        let mut slot = (hole + 1) & self.mask;
        while self.pages[slot] != EMPTY {
            let home = self.home(self.keys[slot]);
            // The entry may move to `hole` only if `hole` lies on its probe path home..=slot.
            let distance_to_slot = slot.wrapping_sub(home) & self.mask;
            let distance_to_hole = hole.wrapping_sub(home) & self.mask;
            if distance_to_hole < distance_to_slot {
                self.keys[hole] = self.keys[slot];
                self.pages[hole] = self.pages[slot];
                self.pages[slot] = EMPTY;
                hole = slot;
            }
            slot = (slot + 1) & self.mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn behaves_like_a_map_under_churn() {
        let mut index = PrefixIndex::with_capacity(64);
        let mut model = BTreeMap::new();
        // Keys that collide on purpose: many share their home slot.
        let mut state = 1u64;
        for step in 0..20_000u32 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (state >> 58) << 40 | (state >> 61);
            if model.len() < 64 && state & 1 == 0 {
                let expected = model.get(&key).copied();
                match index.insert(key, step) {
                    Ok(()) => {
                        assert_eq!(expected, None);
                        model.insert(key, step);
                    }
                    Err(page) => assert_eq!(Some(page), expected),
                }
            } else {
                assert_eq!(index.remove(key), model.remove(&key));
            }
            assert_eq!(index.len(), model.len());
            for (k, v) in &model {
                assert_eq!(index.get(*k), Some(*v), "key {k:#x} lost at step {step}");
            }
        }
    }
}
