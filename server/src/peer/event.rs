//! What the transport tells its owner, in one bounded channel.

use lockstep_core::wire::{Endpoint, Envelope};

use super::error::LinkError;

/// Events leave in the order the link table changed: a link's `Up` comes before anything it
/// received, and its `Down` after; when a newer link takes a worker's place, the old one's `Down`
/// comes before the new one's `Up`, and nothing the old one receives after that is delivered. A KV
/// lane has no `Up`, and what it delivers is not ordered with the control link's deliveries.
#[derive(Clone, Debug, PartialEq)]
pub enum PeerEvent {
    /// A link opened. A worker that restarted shows up with a higher incarnation: whatever the
    /// owner held for its earlier life is gone. `places`: what its `Hello` said it takes at once
    /// (`Message::Hello`).
    Up { peer: Endpoint, places: u32 },
    /// The link to `peer` ended. The dialing side redials with backoff.
    Down { peer: Endpoint, reason: LinkError },
    /// The KV lane to `peer` ended (`wire::Lane`; no `Up` is reported for one): every write sent
    /// on it and not acknowledged yet never will be, so the sender fails them now rather than at
    /// its transfer's deadline. The dialing side redials with backoff.
    KvLaneDown { peer: Endpoint, reason: LinkError },
    /// An envelope of the protocol (`Message::key()` is `Some`) from the live incarnation of a
    /// peer, addressed to this worker's incarnation.
    Received(Envelope),
}
