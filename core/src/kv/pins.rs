//! Leased pins: how a transfer holds its pages while a one-sided write into them, or a read out of
//! them, may still be in flight. A pin covers a set of pages under one lease (a transfer's pages
//! share it) and keeps them from being freed, evicted or handed out until it is released or its
//! lease runs out. Leases are extended by heartbeats; the earliest expiry is the pool's next
//! timeout.

use std::collections::BTreeSet;

use super::PageRef;
use crate::Time;

/// Names one pin. Carries a generation, so a pin released and its slot reused is not mistaken for
/// the old one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PinId {
    slot: u32,
    generation: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pin {
    pub(crate) pages: Vec<PageRef>,
    pub(crate) expires_at: Time,
}

#[derive(Debug, Clone)]
enum PinSlot {
    Free { generation: u32 },
    Live { generation: u32, pin: Pin, serial: u64 },
}

#[derive(Debug, Clone)]
pub(crate) struct PinTable {
    slots: Vec<PinSlot>,
    free: Vec<u32>,
    /// Live pins by expiry, then by the order they were made: pins expiring together are
    /// released first-made first, whatever slots they sit in.
    by_expiry: BTreeSet<(Time, u64, u32)>,
    serial_next: u64,
    /// Pages named by live pins, a page once per pin: kept as pins come and go so that the pool's
    /// incremental check compares it with its pages' pin counts in O(1).
    pages_pinned: u64,
}

impl PinTable {
    pub(crate) fn new(pins_max: u32) -> PinTable {
        PinTable {
            slots: vec![PinSlot::Free { generation: 0 }; pins_max as usize],
            // Reversed so that slot 0 is used first: easier to read in traces.
            free: (0..pins_max).rev().collect(),
            by_expiry: BTreeSet::new(),
            serial_next: 0,
            pages_pinned: 0,
        }
    }

    pub(crate) fn live_count(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Pages named by live pins, a page once per pin that names it.
    pub(crate) fn pages_pinned(&self) -> u64 {
        self.pages_pinned
    }

    pub(crate) fn insert(&mut self, pin: Pin) -> Option<PinId> {
        let slot = self.free.pop()?;
        let generation = match self.slots[slot as usize] {
            PinSlot::Free { generation } => generation,
            PinSlot::Live { .. } => unreachable!("pin slot {slot} on the free list is live"),
        };
        let serial = self.serial_next;
        self.serial_next += 1;
        let expires_at = pin.expires_at;
        self.pages_pinned += pin.pages.len() as u64;
        self.slots[slot as usize] = PinSlot::Live { generation, pin, serial };
        self.by_expiry.insert((expires_at, serial, slot));
        Some(PinId { slot, generation })
    }

    /// The pin's expiry and serial, if it is live.
    fn expiry_of(&self, id: PinId) -> Option<(Time, u64)> {
        match self.slots.get(id.slot as usize)? {
            PinSlot::Live { generation, pin, serial } if *generation == id.generation => {
                Some((pin.expires_at, *serial))
            }
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, id: PinId) -> Option<Pin> {
        let (expires_at, serial) = self.expiry_of(id)?;
        self.by_expiry.remove(&(expires_at, serial, id.slot));
        let freed = PinSlot::Free { generation: id.generation.wrapping_add(1) };
        let PinSlot::Live { pin, .. } = std::mem::replace(&mut self.slots[id.slot as usize], freed)
        else {
            unreachable!("pin {id:?} was found live");
        };
        self.free.push(id.slot);
        self.pages_pinned -= pin.pages.len() as u64;
        Some(pin)
    }

    pub(crate) fn set_expiry(&mut self, id: PinId, expires_at: Time) -> Option<()> {
        let (old, serial) = self.expiry_of(id)?;
        self.by_expiry.remove(&(old, serial, id.slot));
        self.by_expiry.insert((expires_at, serial, id.slot));
        if let PinSlot::Live { pin, .. } = &mut self.slots[id.slot as usize] {
            pin.expires_at = expires_at;
        }
        Some(())
    }

    /// The earliest expiry; pins that never expire (`Time::MAX`) are never due.
    pub(crate) fn next_expiry(&self) -> Option<Time> {
        self.by_expiry.first().map(|(t, _, _)| *t).filter(|&t| t != Time::MAX)
    }

    /// The live pin that expires first, if it has expired by `now`.
    pub(crate) fn first_expired(&self, now: Time) -> Option<PinId> {
        let &(expires_at, _, slot) = self.by_expiry.first()?;
        if expires_at > now || expires_at == Time::MAX {
            return None;
        }
        match self.slots[slot as usize] {
            PinSlot::Live { generation, .. } => Some(PinId { slot, generation }),
            PinSlot::Free { .. } => None,
        }
    }

    /// Every live pin. For invariant checks only.
    pub(crate) fn live(&self) -> impl Iterator<Item = (PinId, &Pin)> + '_ {
        self.slots.iter().enumerate().filter_map(|(slot, s)| match s {
            PinSlot::Live { generation, pin, .. } => {
                Some((PinId { slot: slot as u32, generation: *generation }, pin))
            }
            PinSlot::Free { .. } => None,
        })
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.slots.len()];
        for &slot in &self.free {
            match self.slots.get(slot as usize) {
                Some(PinSlot::Free { .. }) if !on_free_list[slot as usize] => {
                    on_free_list[slot as usize] = true
                }
                _ => {
                    return Err(format!(
                        "pin slot {slot} on the free list is live, missing or listed twice"
                    ));
                }
            }
        }
        let mut expiries = 0;
        let mut pages_pinned = 0u64;
        for (slot, s) in self.slots.iter().enumerate() {
            match s {
                PinSlot::Free { .. } if !on_free_list[slot] => {
                    return Err(format!("free pin slot {slot} is not on the free list"));
                }
                PinSlot::Live { pin, serial, .. } => {
                    if !self.by_expiry.contains(&(pin.expires_at, *serial, slot as u32)) {
                        return Err(format!("pin slot {slot} is missing from the expiry order"));
                    }
                    expiries += 1;
                    pages_pinned += pin.pages.len() as u64;
                }
                PinSlot::Free { .. } => {}
            }
        }
        if expiries != self.by_expiry.len() {
            return Err(format!(
                "expiry order holds {} entries for {expiries} live pins",
                self.by_expiry.len()
            ));
        }
        if pages_pinned != self.pages_pinned {
            return Err(format!(
                "pin table counts {} pinned pages, its live pins name {pages_pinned}",
                self.pages_pinned
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod invariant_tests;
