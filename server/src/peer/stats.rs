//! The transport's counters: atomics bumped where things happen, read as one snapshot (the
//! engine exports them to Prometheus).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        #[derive(Debug, Default)]
        pub(crate) struct PeerStats {
            $($(#[$doc])* pub(crate) $name: AtomicU64,)*
        }

        /// The counters at one moment (each read on its own; they need not add up exactly
        /// while links are busy).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct PeerStatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl PeerStats {
            pub(crate) fn snapshot(&self) -> PeerStatsSnapshot {
                PeerStatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

counters! {
    /// Frames written whole, the link's own (hello, ping, pong) included.
    frames_sent,
    bytes_sent,
    /// Frames read whole and decoded.
    frames_received,
    bytes_received,
    /// Sends refused because no link to that incarnation was up.
    sends_no_link,
    /// Sends refused because the link's queue or byte budget stayed full.
    sends_full,
    /// Sends refused because the envelope itself was wrong (not from us, a link message, over a
    /// wire bound or the link's byte budget).
    sends_invalid,
    links_opened,
    /// Links refused for an identity mismatch, by either end (`LinkRefused` sent or received).
    links_refused,
    /// Links refused because the table already holds a newer or winning link, or is full.
    links_stale,
    /// Live links that a newer link to the same worker replaced.
    links_superseded,
    /// Live links that ended (silence, close, an error), not counting the superseded.
    links_died,
    /// Handshakes that failed for anything but a mismatch: no hello in time, a wrong first
    /// frame, another worker at the address, a broken stream.
    handshakes_failed,
    /// Dials that failed or timed out.
    dials_failed,
    /// Accepted connections closed at once because `handshakes_max` were in progress.
    accepts_dropped,
    /// Protocol frames dropped because their `from` was not the link's peer or their `to` not us.
    frames_misaddressed,
    /// Events dropped because the owner left no room for `event_wait_max`.
    events_dropped,
}

impl PeerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}
