//! The newest incarnation heard from each peer worker: how both sides of the protocol drop an
//! earlier life's messages and notice a restart.

use std::collections::BTreeMap;

use crate::wire::{Endpoint, Incarnation, WorkerId};

/// What an envelope's sender says about its worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Heard {
    /// An older incarnation than one already heard: drop the envelope.
    Stale,
    /// The incarnation already heard.
    Known,
    /// First contact, or a newer incarnation: whatever an older life held is gone.
    Newer,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Peers {
    newest: BTreeMap<WorkerId, Incarnation>,
}

impl Peers {
    pub(crate) fn hear(&mut self, from: Endpoint) -> Heard {
        match self.newest.get(&from.worker) {
            Some(&known) if from.incarnation < known => Heard::Stale,
            Some(&known) if from.incarnation == known => Heard::Known,
            _ => {
                self.newest.insert(from.worker, from.incarnation);
                Heard::Newer
            }
        }
    }
}
