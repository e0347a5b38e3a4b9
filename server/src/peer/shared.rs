//! The state a transport's tasks share: the link table, the counters, and the owner's event
//! channel, with the one lock that orders events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use lockstep_core::wire::{Endpoint, Envelope, Lane, WorkerId};
use tokio::sync::{Notify, RwLock, mpsc, oneshot};
use tokio::time::timeout;

use super::config::PeerConfig;
use super::error::{LinkError, SendError};
use super::event::PeerEvent;
use super::outbound::{self, OutboundQueue};
use super::stats::PeerStats;
use super::table::{LinkId, LinkTable, LiveLink, Verdict};

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: PeerConfig,
    pub(crate) stats: PeerStats,
    /// Never held across an await: sends look their link up here without waiting.
    table: Mutex<LinkTable>,
    /// Orders events as the table changes: opening and closing links take it for writing,
    /// deliveries for reading. So a superseded link's last envelopes never follow its `Down`,
    /// and the new link's `Up` never precedes the old one's `Down`. Each holder waits at most
    /// `event_wait_max` for the owner's channel.
    order: RwLock<()>,
    events: mpsc::Sender<PeerEvent>,
    /// Woken whenever a link leaves the table, for dialers waiting for theirs to end.
    link_closed: Notify,
    next_link_id: AtomicU64,
}

/// A link the table took, for its task to run.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) id: LinkId,
    /// Whom the link is to: the peer its handshake named.
    pub(crate) peer: Endpoint,
    pub(crate) lane: Lane,
    pub(crate) queue: OutboundQueue,
    /// Resolves when the link leaves the table: someone else closed it.
    pub(crate) removed: oneshot::Receiver<()>,
}

impl Shared {
    pub(crate) fn new(config: PeerConfig, events: mpsc::Sender<PeerEvent>) -> Shared {
        Shared {
            table: Mutex::new(LinkTable::new(config.peers_max)),
            config,
            stats: PeerStats::default(),
            order: RwLock::new(()),
            events,
            link_closed: Notify::new(),
            next_link_id: AtomicU64::new(1),
        }
    }

    /// Every change to the table is a single insert or remove, so a panic elsewhere while it
    /// was held cannot have left it half-changed: a poisoned lock is still a good table.
    pub(crate) fn table(&self) -> MutexGuard<'_, LinkTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the table would open a link to `peer` on `lane` dialed by `dialer` now.
    pub(crate) fn admits(
        &self,
        peer: Endpoint,
        lane: Lane,
        dialer: WorkerId,
    ) -> Result<(), LinkError> {
        match self.table().verdict(peer, lane, dialer) {
            Verdict::Refuse(error) => Err(error),
            Verdict::Open | Verdict::Supersede => Ok(()),
        }
    }

    /// Puts a link that finished its handshake in the table, closing those it supersedes, and
    /// reports them. A control link is reported `Up` (with the `places` its peer's `Hello` said)
    /// and `Down`: it is the peer as the protocol sees it. A KV lane is reported only when it
    /// ends (`KvLaneDown`), for the writes on it.
    pub(crate) async fn open(
        &self,
        peer: Endpoint,
        lane: Lane,
        dialer: WorkerId,
        places: u32,
    ) -> Result<Opened, LinkError> {
        let _order = self.order.write().await;
        let peer = if lockstep_core::planted!(OldIncarnationStateKept) {
            // vLLM's NIXL connector hands back the remote agent it already registered for an
            // engine id ("TODO re-evaluate refreshing for scaling/recovery"): a peer's record is
            // keyed by who it is, not by which life answered. Here the link to a restarted
            // worker opens under the incarnation first heard: the owner sees no restart, keeps
            // addressing the dead life and holding its transfers, and the new process drops
            // all of it as misaddressed, as `deliver` drops what the new process sends.
            let heard = self.table().incarnation_heard(peer.worker);
            Endpoint { worker: peer.worker, incarnation: heard.unwrap_or(peer.incarnation) }
        } else {
            peer
        };
        let (sender, queue) =
            outbound::channel(self.config.send_queue_max, self.config.send_bytes_max);
        let (closer, removed) = oneshot::channel();
        let id = LinkId(self.next_link_id.fetch_add(1, Ordering::Relaxed));
        let link = LiveLink { id, peer, lane, dialer, sender, _closer: closer };
        let superseded = self.table().open(link)?;
        for old in superseded {
            PeerStats::bump(&self.stats.links_superseded);
            let (old_peer, old_lane) = (old.peer, old.lane);
            drop(old);
            tracing::info!(
                worker = peer.worker.0,
                old = old_peer.incarnation.0,
                lane = ?old_lane,
                "peer link superseded"
            );
            self.emit(down(old_peer, old_lane, LinkError::Superseded { by: peer })).await;
        }
        PeerStats::bump(&self.stats.links_opened);
        tracing::info!(
            worker = peer.worker.0,
            incarnation = peer.incarnation.0,
            ?lane,
            "peer link up"
        );
        if lane == Lane::Control {
            self.emit(PeerEvent::Up { peer, places }).await;
        }
        Ok(Opened { id, peer, lane, queue, removed })
    }

    /// Takes link `id` out of the table and reports it down, unless it already left (a newer
    /// link superseded it and reported that).
    pub(crate) async fn close(&self, peer: Endpoint, lane: Lane, id: LinkId, reason: LinkError) {
        let _order = self.order.write().await;
        let Some(link) = self.table().close(peer.worker, lane, id) else {
            return;
        };
        drop(link);
        PeerStats::bump(&self.stats.links_died);
        tracing::info!(
            worker = peer.worker.0,
            incarnation = peer.incarnation.0,
            ?lane,
            %reason,
            "peer link down"
        );
        self.link_closed.notify_waiters();
        self.emit(down(peer, lane, reason)).await;
    }

    /// Hands a protocol envelope from link `id` to the owner, if it comes from that link's peer,
    /// is addressed to this incarnation, and the link is still the live one on `lane`.
    pub(crate) async fn deliver(&self, id: LinkId, peer: Endpoint, lane: Lane, envelope: Envelope) {
        if envelope.from != peer || envelope.to != self.config.me {
            PeerStats::bump(&self.stats.frames_misaddressed);
            return;
        }
        let _order = self.order.read().await;
        if !self.table().is_live(peer.worker, lane, id) {
            return;
        }
        self.emit(PeerEvent::Received(envelope)).await;
    }

    /// Returns once no link to `worker` on `lane` is in the table. Bounded in effect: a link
    /// stays only while its peer is heard from at least every `dead_after`.
    pub(crate) async fn until_no_link(&self, worker: WorkerId, lane: Lane) {
        loop {
            let closed = self.link_closed.notified();
            tokio::pin!(closed);
            // Registered before the check, so a close between the check and the wait wakes it.
            closed.as_mut().enable();
            if !self.table().has_link(worker, lane) {
                return;
            }
            closed.await;
        }
    }

    /// Counts a link that never opened, by why.
    pub(crate) fn count_refusal(&self, error: &LinkError) {
        let counter = match error {
            LinkError::Refused(_) => &self.stats.links_refused,
            LinkError::Stale { .. } | LinkError::Duplicate | LinkError::TooManyPeers => {
                &self.stats.links_stale
            }
            _ => &self.stats.handshakes_failed,
        };
        PeerStats::bump(counter);
    }

    /// Counts a refused send, by why.
    pub(crate) fn count_send(&self, result: &Result<(), SendError>) {
        let counter = match result {
            Ok(()) => return,
            Err(SendError::NoLink { .. } | SendError::OtherIncarnation { .. }) => {
                &self.stats.sends_no_link
            }
            Err(SendError::LinkClosed) => &self.stats.sends_no_link,
            Err(SendError::Full | SendError::TimedOut) => &self.stats.sends_full,
            Err(
                SendError::NotFromMe { .. }
                | SendError::LinkMessage
                | SendError::Encode(_)
                | SendError::TooLarge { .. },
            ) => &self.stats.sends_invalid,
        };
        PeerStats::bump(counter);
    }

    /// Gives the owner `event`, waiting at most `event_wait_max` for room; else drops and counts
    /// it (an owner that stopped reading has closed the channel, or stalls: either way the
    /// links must not).
    async fn emit(&self, event: PeerEvent) {
        let sent = timeout(self.config.event_wait_max, self.events.send(event)).await;
        if !matches!(sent, Ok(Ok(()))) {
            PeerStats::bump(&self.stats.events_dropped);
        }
    }
}

/// The event of a link on `lane` to `peer` ending.
fn down(peer: Endpoint, lane: Lane, reason: LinkError) -> PeerEvent {
    match lane {
        Lane::Control => PeerEvent::Down { peer, reason },
        Lane::Kv => PeerEvent::KvLaneDown { peer, reason },
    }
}
