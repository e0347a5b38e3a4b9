//! The live links to each peer worker, one per lane, and the newest incarnation heard from each:
//! which link a send takes, and whether a newly opened link replaces, joins or loses to what is
//! there.

use std::collections::BTreeMap;

use lockstep_core::wire::{Endpoint, Incarnation, Lane, WorkerId};
use tokio::sync::oneshot;

use super::error::LinkError;
use super::outbound::LinkSender;

/// Names one link for the life of the transport (a worker's links come and go).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinkId(pub(crate) u64);

/// A link in the table. Removing it from the table closes it: its task waits on `_closer`.
#[derive(Debug)]
pub(crate) struct LiveLink {
    pub(crate) id: LinkId,
    pub(crate) peer: Endpoint,
    pub(crate) lane: Lane,
    /// Which end dialed: breaks the tie between two links to one incarnation.
    pub(crate) dialer: WorkerId,
    pub(crate) sender: LinkSender,
    pub(crate) _closer: oneshot::Sender<()>,
}

/// What to do with a link that just finished its handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// No link to that worker: open it.
    Open,
    /// Open it in place of the live one, which closes.
    Supersede,
    Refuse(LinkError),
}

/// The rule, from what the table holds for the worker (the newest incarnation heard, and the live
/// link's peer and dialer on the same lane):
/// - an older incarnation than the newest heard is refused: that life is over;
/// - a newer incarnation than the live link's supersedes it;
/// - for the same incarnation, a link dialed by the same end supersedes the old one (that end
///   redialed, so it saw the old link die; this end has not yet), and between links dialed from
///   both ends, both ends keep the one dialed by the lower worker id, so they agree.
pub(crate) fn verdict(
    newest: Option<Incarnation>,
    live: Option<(Endpoint, WorkerId)>,
    peer: Endpoint,
    dialer: WorkerId,
) -> Verdict {
    if let Some(newest) = newest
        && peer.incarnation < newest
    {
        let newest = Endpoint { worker: peer.worker, incarnation: newest };
        return Verdict::Refuse(LinkError::Stale { newest });
    }
    let Some((live_peer, live_dialer)) = live else {
        return Verdict::Open;
    };
    if peer.incarnation > live_peer.incarnation || dialer == live_dialer || dialer < live_dialer {
        Verdict::Supersede
    } else {
        Verdict::Refuse(LinkError::Duplicate)
    }
}

#[derive(Debug)]
pub(crate) struct LinkTable {
    live: BTreeMap<(WorkerId, Lane), LiveLink>,
    newest: BTreeMap<WorkerId, Incarnation>,
    peers_max: usize,
}

impl LinkTable {
    pub(crate) fn new(peers_max: usize) -> LinkTable {
        LinkTable { live: BTreeMap::new(), newest: BTreeMap::new(), peers_max }
    }

    /// The verdict on a link to `peer` on `lane` dialed by `dialer`, before it is opened.
    pub(crate) fn verdict(&self, peer: Endpoint, lane: Lane, dialer: WorkerId) -> Verdict {
        let known = self.newest.get(&peer.worker).copied();
        if known.is_none() && self.newest.len() >= self.peers_max {
            return Verdict::Refuse(LinkError::TooManyPeers);
        }
        let live = self.live.get(&(peer.worker, lane)).map(|link| (link.peer, link.dialer));
        verdict(known, live, peer, dialer)
    }

    /// Opens `link` if the verdict allows. The links it replaced, to report down: the one on its
    /// lane, and the other lane's if that one is to an older incarnation (that life is over).
    pub(crate) fn open(&mut self, link: LiveLink) -> Result<Vec<LiveLink>, LinkError> {
        if let Verdict::Refuse(error) = self.verdict(link.peer, link.lane, link.dialer) {
            return Err(error);
        }
        let peer = link.peer;
        self.newest.insert(peer.worker, peer.incarnation);
        let mut superseded: Vec<LiveLink> =
            self.live.insert((peer.worker, link.lane), link).into_iter().collect();
        for lane in [Lane::Control, Lane::Kv] {
            let key = (peer.worker, lane);
            if self.live.get(&key).is_some_and(|l| l.peer.incarnation < peer.incarnation) {
                superseded.extend(self.live.remove(&key));
            }
        }
        Ok(superseded)
    }

    /// Removes the link `id` to `worker` on `lane` if it is still the live one.
    pub(crate) fn close(&mut self, worker: WorkerId, lane: Lane, id: LinkId) -> Option<LiveLink> {
        match self.live.get(&(worker, lane)) {
            Some(link) if link.id == id => self.live.remove(&(worker, lane)),
            _ => None,
        }
    }

    /// The newest incarnation of `worker` a link opened to.
    pub(crate) fn incarnation_heard(&self, worker: WorkerId) -> Option<Incarnation> {
        self.newest.get(&worker).copied()
    }

    pub(crate) fn is_live(&self, worker: WorkerId, lane: Lane, id: LinkId) -> bool {
        self.live.get(&(worker, lane)).is_some_and(|link| link.id == id)
    }

    pub(crate) fn has_link(&self, worker: WorkerId, lane: Lane) -> bool {
        self.live.contains_key(&(worker, lane))
    }

    /// The live link's peer and its sender, for a send to `worker` on `lane`.
    pub(crate) fn route(&self, worker: WorkerId, lane: Lane) -> Option<(Endpoint, LinkSender)> {
        self.live.get(&(worker, lane)).map(|link| (link.peer, link.sender.clone()))
    }

    /// The peers with a live control link, by worker id.
    pub(crate) fn live_peers(&self) -> Vec<Endpoint> {
        self.live.values().filter(|link| link.lane == Lane::Control).map(|link| link.peer).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(worker: u32, incarnation: u64) -> Endpoint {
        Endpoint { worker: WorkerId(worker), incarnation: Incarnation(incarnation) }
    }

    #[test]
    fn a_first_link_opens_and_an_older_incarnation_is_refused_even_with_no_link_up() {
        assert_eq!(verdict(None, None, at(2, 1), WorkerId(1)), Verdict::Open);
        assert_eq!(verdict(Some(Incarnation(1)), None, at(2, 1), WorkerId(1)), Verdict::Open);
        assert_eq!(
            verdict(Some(Incarnation(3)), None, at(2, 2), WorkerId(1)),
            Verdict::Refuse(LinkError::Stale { newest: at(2, 3) })
        );
    }

    #[test]
    fn a_newer_incarnation_supersedes_whoever_dialed() {
        let live = Some((at(2, 1), WorkerId(1)));
        assert_eq!(verdict(Some(Incarnation(1)), live, at(2, 2), WorkerId(2)), Verdict::Supersede);
        assert_eq!(verdict(Some(Incarnation(1)), live, at(2, 2), WorkerId(1)), Verdict::Supersede);
    }

    #[test]
    fn for_one_incarnation_a_redial_supersedes_and_the_lower_dialer_wins_a_cross_dial() {
        let newest = Some(Incarnation(1));
        // The same end redialed: it saw the old link die.
        assert_eq!(
            verdict(newest, Some((at(2, 1), WorkerId(2))), at(2, 1), WorkerId(2)),
            Verdict::Supersede
        );
        // Worker 1 and worker 2 dialed each other: both keep worker 1's link.
        assert_eq!(
            verdict(newest, Some((at(2, 1), WorkerId(2))), at(2, 1), WorkerId(1)),
            Verdict::Supersede
        );
        assert_eq!(
            verdict(newest, Some((at(2, 1), WorkerId(1))), at(2, 1), WorkerId(2)),
            Verdict::Refuse(LinkError::Duplicate)
        );
    }

    #[test]
    fn the_table_knows_at_most_peers_max_workers() {
        let (sender, _queue) = super::super::outbound::channel(1, 1);
        let mut table = LinkTable::new(1);
        let (closer, _closed) = oneshot::channel();
        let link = LiveLink {
            id: LinkId(1),
            peer: at(2, 1),
            lane: Lane::Control,
            dialer: WorkerId(1),
            sender,
            _closer: closer,
        };
        assert!(table.open(link).expect("room for one").is_empty());
        assert_eq!(
            table.verdict(at(3, 1), Lane::Control, WorkerId(1)),
            Verdict::Refuse(LinkError::TooManyPeers)
        );
        let control = (WorkerId(2), Lane::Control);
        assert!(table.close(control.0, control.1, LinkId(7)).is_none(), "another link's close");
        assert!(table.close(WorkerId(2), Lane::Kv, LinkId(1)).is_none(), "another lane's close");
        assert!(table.close(control.0, control.1, LinkId(1)).is_some());
        assert!(!table.has_link(control.0, control.1));
    }

    fn link(id: u64, peer: Endpoint, lane: Lane) -> LiveLink {
        let (sender, _queue) = super::super::outbound::channel(1, 1);
        let (closer, _closed) = oneshot::channel();
        LiveLink { id: LinkId(id), peer, lane, dialer: WorkerId(1), sender, _closer: closer }
    }

    #[test]
    fn the_lanes_open_side_by_side_and_a_new_life_ends_both_of_the_old_one() {
        let mut table = LinkTable::new(4);
        assert!(table.open(link(1, at(2, 1), Lane::Control)).expect("opens").is_empty());
        assert!(table.open(link(2, at(2, 1), Lane::Kv)).expect("beside it").is_empty());
        assert_eq!(table.live_peers(), vec![at(2, 1)], "one peer, counted once");
        // The worker restarted: its new control link ends the old life's KV lane too.
        let superseded = table.open(link(3, at(2, 2), Lane::Control)).expect("a newer life");
        let ids: Vec<u64> = superseded.iter().map(|l| l.id.0).collect();
        assert_eq!(ids, vec![1, 2]);
        assert!(!table.has_link(WorkerId(2), Lane::Kv));
        assert_eq!(
            table.verdict(at(2, 1), Lane::Kv, WorkerId(1)),
            Verdict::Refuse(LinkError::Stale { newest: at(2, 2) })
        );
    }
}
