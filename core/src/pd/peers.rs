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

#[cfg(test)]
mod tests {
    use super::*;

    fn life(worker: u32, incarnation: u64) -> Endpoint {
        Endpoint { worker: WorkerId(worker), incarnation: Incarnation(incarnation) }
    }

    /// A late envelope from an earlier life is stale, and leaves the newest as it was: taken for
    /// a newer life, it would make the protocol sides give up what the current life holds.
    #[test]
    fn lives_are_heard_in_order_and_an_earlier_one_is_stale() {
        let mut peers = Peers::default();
        assert_eq!(peers.hear(life(1, 5)), Heard::Newer, "first contact");
        assert_eq!(peers.hear(life(1, 5)), Heard::Known);
        assert_eq!(peers.hear(life(2, 1)), Heard::Newer, "another worker is its own");
        assert_eq!(peers.hear(life(1, 4)), Heard::Stale);
        assert_eq!(peers.hear(life(1, 5)), Heard::Known, "the stale one changed nothing");
        assert_eq!(peers.hear(life(1, 6)), Heard::Newer, "a restart");
        assert_eq!(peers.hear(life(1, 5)), Heard::Stale);
        assert_eq!(peers.hear(life(1, 6)), Heard::Known);
    }
}
