//! The live link to each peer worker, and the newest incarnation heard from each: which link a
//! send takes, and whether a newly opened link replaces, joins or loses to what is there.

use std::collections::BTreeMap;

use lockstep_core::wire::{Endpoint, Incarnation, WorkerId};
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
/// link's peer and dialer):
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
    live: BTreeMap<WorkerId, LiveLink>,
    newest: BTreeMap<WorkerId, Incarnation>,
    peers_max: usize,
}

impl LinkTable {
    pub(crate) fn new(peers_max: usize) -> LinkTable {
        LinkTable { live: BTreeMap::new(), newest: BTreeMap::new(), peers_max }
    }

    /// The verdict on a link to `peer` dialed by `dialer`, before it is opened.
    pub(crate) fn verdict(&self, peer: Endpoint, dialer: WorkerId) -> Verdict {
        let known = self.newest.get(&peer.worker).copied();
        if known.is_none() && self.newest.len() >= self.peers_max {
            return Verdict::Refuse(LinkError::TooManyPeers);
        }
        let live = self.live.get(&peer.worker).map(|link| (link.peer, link.dialer));
        verdict(known, live, peer, dialer)
    }

    /// Opens `link` if the verdict allows; the link it replaced, if any, to report down.
    pub(crate) fn open(&mut self, link: LiveLink) -> Result<Option<LiveLink>, LinkError> {
        if let Verdict::Refuse(error) = self.verdict(link.peer, link.dialer) {
            return Err(error);
        }
        self.newest.insert(link.peer.worker, link.peer.incarnation);
        Ok(self.live.insert(link.peer.worker, link))
    }

    /// Removes the link `id` to `worker` if it is still the live one.
    pub(crate) fn close(&mut self, worker: WorkerId, id: LinkId) -> Option<LiveLink> {
        match self.live.get(&worker) {
            Some(link) if link.id == id => self.live.remove(&worker),
            _ => None,
        }
    }

    /// The newest incarnation of `worker` a link opened to.
    pub(crate) fn incarnation_heard(&self, worker: WorkerId) -> Option<Incarnation> {
        self.newest.get(&worker).copied()
    }

    pub(crate) fn is_live(&self, worker: WorkerId, id: LinkId) -> bool {
        self.live.get(&worker).is_some_and(|link| link.id == id)
    }

    pub(crate) fn has_link(&self, worker: WorkerId) -> bool {
        self.live.contains_key(&worker)
    }

    /// The live link's peer and its sender, for a send to `worker`.
    pub(crate) fn route(&self, worker: WorkerId) -> Option<(Endpoint, LinkSender)> {
        self.live.get(&worker).map(|link| (link.peer, link.sender.clone()))
    }

    /// The peers with a live link, by worker id.
    pub(crate) fn live_peers(&self) -> Vec<Endpoint> {
        self.live.values().map(|link| link.peer).collect()
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
            dialer: WorkerId(1),
            sender,
            _closer: closer,
        };
        assert!(table.open(link).expect("room for one").is_none());
        assert_eq!(table.verdict(at(3, 1), WorkerId(1)), Verdict::Refuse(LinkError::TooManyPeers));
        assert!(table.close(WorkerId(2), LinkId(7)).is_none(), "another link's close is ignored");
        assert!(table.close(WorkerId(2), LinkId(1)).is_some());
        assert!(!table.has_link(WorkerId(2)));
    }
}
