//! The decode side against a scripted router and prefill side, one test per protocol bug class
//! of shared/bugs.md that this side guards, each with the invariant check shown to fire.

use super::*;
use crate::kv::PoolConfig;
use crate::sched::RequestId;
use crate::wire::{Epoch, Incarnation, TransferId, WorkerId};

const D: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const R: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };
const P: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const LEASE_MS: u64 = 100;
const FLIGHT_MS: u64 = 20;
/// The decode side reports a transfer still at work to the router at most this often.
const LIVE_REPORT_MS: u64 = 250;

struct Rig {
    side: DecodeSide,
    pool: PagePool,
    now: Time,
}

/// `Done` of a transfer with its first token and no log-probabilities.
fn done(key: TransferKey, first_token: u32, pages_written: u32) -> Message {
    Message::Done { key, first_token, pages_written, first_logprobs: None, prompt_logprobs: vec![] }
}

fn key(id: u64) -> TransferKey {
    TransferKey { transfer: TransferId(id), epoch: Epoch(0) }
}

fn spec(id: u64, prompt_len: u32) -> RequestSpec {
    RequestSpec::new(RequestId(id), (0..prompt_len).map(|t| t + 1).collect(), 8)
}

impl Rig {
    fn new() -> Rig {
        let config = DecodeConfig {
            lease: Duration::from_millis(LEASE_MS),
            write_flight_max: Duration::from_millis(FLIGHT_MS),
            transfers_max: 4,
            prefix_cache: true,
            live_report_interval: Duration::from_millis(LIVE_REPORT_MS),
        };
        let pool =
            PagePool::new(PoolConfig { pages_total: 8, page_tokens: 4, pins_max: 16 }).unwrap();
        Rig { side: DecodeSide::new(D, config), pool, now: Time::ZERO }
    }

    fn deliver(&mut self, from: Endpoint, body: Message) -> Vec<DecodeOutput> {
        self.side.handle_envelope(Envelope { from, to: D, body }, &mut self.pool, self.now);
        self.drain()
    }

    fn advance(&mut self, ms: u64) -> Vec<DecodeOutput> {
        self.now = self.now.saturating_add(Duration::from_millis(ms));
        self.side.handle_timeout(&mut self.pool, self.now);
        self.pool.handle_timeout(self.now);
        self.drain()
    }

    fn drain(&mut self) -> Vec<DecodeOutput> {
        self.side.check_invariants(&self.pool).unwrap_or_else(|e| panic!("{e}"));
        self.pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        std::iter::from_fn(|| self.side.poll_output()).collect()
    }

    /// Reserves a transfer and returns the pages the prefill side is told to write.
    fn reserve(&mut self, id: u64, prompt_len: u32) -> Vec<PageSlot> {
        let out = self.deliver(
            R,
            Message::Reserve { key: key(id), request: spec(id, prompt_len), prefill: P },
        );
        match out.as_slice() {
            [DecodeOutput::Send(Envelope { to, body: Message::Prepare { pages, .. }, .. })]
                if *to == P =>
            {
                pages.clone()
            }
            other => panic!("expected one Prepare, got {other:?}"),
        }
    }
}

fn sent(out: &[DecodeOutput]) -> Vec<(Endpoint, Message)> {
    out.iter()
        .filter_map(|o| match o {
            DecodeOutput::Send(e) => Some((e.to, e.body.clone())),
            _ => None,
        })
        .collect()
}

fn terminals(out: &[DecodeOutput]) -> usize {
    out.iter().filter(|o| !matches!(o, DecodeOutput::Send(_))).count()
}

#[test]
fn happy_path_hands_whole_kv_to_the_scheduler() {
    let mut rig = Rig::new();
    let pages = rig.reserve(1, 10);
    assert_eq!(pages.len(), 3);
    let out = rig.deliver(P, Message::Heartbeat { key: key(1), seq: 0, progress: 0 });
    assert_eq!(
        sent(&out),
        vec![(P, Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS as u32 })]
    );
    let out = rig.deliver(P, done(key(1), 42, 3));
    let ready = out.iter().find_map(|o| match o {
        DecodeOutput::Ready { pages, first_token, computed_tokens, .. } => {
            Some((pages.clone(), *first_token, *computed_tokens))
        }
        _ => None,
    });
    let (ready_pages, first_token, computed) = ready.expect("Ready");
    assert_eq!((first_token, computed), (42, 10));
    assert_eq!(
        ready_pages.iter().map(|p| p.index()).collect::<Vec<_>>(),
        pages.iter().map(|p| p.index).collect::<Vec<_>>()
    );
    assert!(sent(&out).contains(&(P, Message::DoneAck { key: key(1) })));
    // Success is the driver's to report, once its scheduler accepted the request.
    assert!(!sent(&out).iter().any(|(_, m)| matches!(m, Message::Outcome { .. })));
    assert_eq!(rig.pool.pins_live_count(), 0, "no write can land after Done: pins go");
    assert_eq!(rig.pool.held_count(), 3, "the references moved to the scheduler");
}

/// sglang#32564, sglang#35049, nixl#2067: an abort freed pages while a one-sided write was in
/// flight; the write landed in the next request's pages.
#[test]
fn free_while_a_write_lands() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    rig.deliver(P, Message::Heartbeat { key: key(1), seq: 0, progress: 0 });
    let out = rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    assert_eq!(terminals(&out), 1);
    assert!(sent(&out).contains(&(P, Message::Abort { key: key(1), reason: AbortReason::Client })));
    // The prefill side has not said it drained: the pages stay reserved and pinned.
    assert_eq!(rig.pool.held_count(), 3);
    let mut more = Vec::new();
    assert!(
        rig.pool.allocate_many(6, &mut more).is_err(),
        "reserved pages were handed out while writes may land"
    );
    rig.deliver(P, Message::AbortAck { key: key(1) });
    assert_eq!(rig.pool.held_count(), 0, "drained: now they go");
    // And without the drain acknowledgment, the lease bounds the wait.
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    rig.advance(LEASE_MS + FLIGHT_MS - 1);
    assert_eq!(rig.pool.held_count(), 3, "released before the lease provably outlived every write");
    rig.advance(1);
    assert_eq!(rig.pool.held_count(), 0);
    // By hand: free a draining transfer's pages in the pool, as the bug did.
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    let t = rig.side.transfers.values().next().unwrap().clone();
    rig.pool.unpin(t.pin).unwrap();
    for page in &t.reserved {
        rig.pool.release(*page).unwrap();
    }
    let what = rig.side.check_invariants(&rig.pool).unwrap_err();
    assert!(what.what().contains("freed or reused"), "{what}");
}

/// The data plane's check before a write lands, as RDMA checks a memory key: only the
/// transfer's own key, and only into a page it reserved, of the generation it reserved.
#[test]
fn a_write_lands_only_in_a_page_its_transfer_reserved() {
    let mut rig = Rig::new();
    let pages = rig.reserve(1, 10);
    let [first, ..] = pages[..] else { panic!("no pages") };
    assert!(pages.iter().all(|&p| rig.side.write_allowed(key(1), p)));
    let stale = TransferKey { transfer: TransferId(1), epoch: Epoch(7) };
    assert!(!rig.side.write_allowed(stale, first), "another epoch's key");
    assert!(!rig.side.write_allowed(key(2), first), "another transfer's key");
    let reused = PageSlot { generation: first.generation + 1, ..first };
    assert!(!rig.side.write_allowed(key(1), reused), "the page in a later use");
    let unreserved = (0..8)
        .map(|index| PageSlot { index, ..first })
        .find(|slot| pages.iter().all(|p| p.index != slot.index))
        .unwrap();
    assert!(!rig.side.write_allowed(key(1), unreserved), "a page it never reserved");
    rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    assert!(rig.side.write_allowed(key(1), first), "draining: the writes in flight still land");
    rig.deliver(P, Message::AbortAck { key: key(1) });
    assert!(!rig.side.write_allowed(key(1), first), "released: a late write is dropped");
}

/// vllm#46283, sglang#34692: the peer never answered; pages were never reclaimed.
#[test]
fn leak_when_the_peer_is_silent() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    assert_eq!(rig.side.next_timeout(), Some(Time::from_millis(LEASE_MS + FLIGHT_MS)));
    let out = rig.advance(LEASE_MS + FLIGHT_MS);
    assert_eq!(terminals(&out), 1);
    assert!(out.contains(&DecodeOutput::Ended { key: key(1), reason: AbortReason::Timeout }));
    assert!(
        sent(&out)
            .contains(&(R, Message::Outcome { key: key(1), failure: Some(AbortReason::Timeout) }))
    );
    // And the prefill side, should it be alive after all, is told to stop writing.
    let abort = Message::Abort { key: key(1), reason: AbortReason::Timeout };
    assert!(sent(&out).contains(&(P, abort)), "{out:?}");
    assert_eq!(rig.pool.held_count(), 0);
    assert_eq!(rig.side.transfers_live(), 0);
    // Heartbeats keep it alive; silence after them still ends it one lease later.
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    for _ in 0..10 {
        rig.advance(LEASE_MS / 2);
        rig.deliver(P, Message::Heartbeat { key: key(1), seq: 1, progress: 0 });
    }
    assert_eq!(rig.side.transfers_live(), 1);
    rig.advance(LEASE_MS + FLIGHT_MS);
    assert_eq!(rig.side.transfers_live(), 0);
}

/// sglang#30233, vllm#52234: decode generated from incomplete KV and answered 200.
#[test]
fn fail_open() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let out = rig.deliver(P, done(key(1), 7, 2));
    assert!(out.contains(&DecodeOutput::Ended { key: key(1), reason: AbortReason::PrefillFailed }));
    assert!(
        !out.iter().any(|o| matches!(o, DecodeOutput::Ready { .. })),
        "partial KV reached the scheduler"
    );
    assert_eq!(rig.pool.held_count(), 0);
}

/// vllm#46240: both completions of an aborted request arrived; an assertion killed the engine.
#[test]
fn double_completion() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let first = rig.deliver(P, done(key(1), 7, 3));
    let second = rig.deliver(P, done(key(1), 7, 3));
    assert_eq!(terminals(&first), 1);
    assert_eq!(terminals(&second), 0, "a duplicate Done must not complete twice");
    assert_eq!(
        sent(&second),
        vec![(P, Message::DoneAck { key: key(1) })],
        "but it is acknowledged again"
    );
}

/// The prefill side aborts only once its writes drained: the pages go at once, acknowledged, and
/// nothing is sent back to abort. An acknowledgment of an abort nobody asked for (the transfer
/// is not draining) ends nothing.
#[test]
fn a_prefill_abort_frees_the_pages_at_once_and_a_stray_ack_ends_nothing() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    assert!(rig.deliver(P, Message::AbortAck { key: key(1) }).is_empty());
    assert_eq!((rig.side.transfers_live(), rig.pool.held_count()), (1, 3));
    let out = rig.deliver(P, Message::Abort { key: key(1), reason: AbortReason::PrefillFailed });
    assert!(out.contains(&DecodeOutput::Ended { key: key(1), reason: AbortReason::PrefillFailed }));
    let sent = sent(&out);
    assert!(sent.contains(&(P, Message::AbortAck { key: key(1) })), "{sent:?}");
    assert!(!sent.iter().any(|(_, m)| matches!(m, Message::Abort { .. })), "{sent:?}");
    assert_eq!((rig.side.transfers_live(), rig.pool.held_count()), (0, 0));
}

/// Late messages for a transfer this side no longer holds are answered, so that the prefill side
/// lets go at once rather than at its deadline: a Done is acknowledged only if the transfer
/// completed (one that ended otherwise is told to abort), a heartbeat is told to abort, and an
/// abort is acknowledged.
#[test]
fn late_messages_for_a_transfer_no_longer_held_are_answered_by_how_it_ended() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    assert_eq!(terminals(&rig.deliver(P, done(key(1), 7, 3))), 1);
    rig.reserve(2, 6);
    rig.deliver(R, Message::Abort { key: key(2), reason: AbortReason::Client });
    rig.deliver(P, Message::AbortAck { key: key(2) });
    assert_eq!(rig.side.transfers_live(), 0);
    let told_to_abort = |k| vec![(P, Message::Abort { key: k, reason: AbortReason::DecodeFailed })];
    assert_eq!(
        sent(&rig.deliver(P, done(key(1), 7, 3))),
        vec![(P, Message::DoneAck { key: key(1) })]
    );
    assert_eq!(sent(&rig.deliver(P, done(key(2), 7, 2))), told_to_abort(key(2)));
    let heartbeat = |k| Message::Heartbeat { key: k, seq: 3, progress: 1 };
    assert_eq!(sent(&rig.deliver(P, heartbeat(key(2)))), told_to_abort(key(2)));
    assert_eq!(sent(&rig.deliver(P, heartbeat(key(9)))), told_to_abort(key(9)));
    let abort = Message::Abort { key: key(2), reason: AbortReason::PrefillFailed };
    assert_eq!(sent(&rig.deliver(P, abort)), vec![(P, Message::AbortAck { key: key(2) })]);
    assert_eq!((rig.side.transfers_live(), rig.pool.held_count()), (0, 3), "request 1's pages");
}

/// A broken link to a prefill worker ends its transfers at once (the router hears so, and the
/// worker is told in case the link comes back), and only its own: their pages stay until the
/// lease has outlived every write sent before the break.
#[test]
fn a_lost_prefill_link_ends_its_transfers_at_once_and_keeps_their_pages_until_the_lease() {
    let other = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let reserve = Message::Reserve { key: key(2), request: spec(2, 6), prefill: other };
    assert_eq!(sent(&rig.deliver(R, reserve)).len(), 1, "a Prepare to the other worker");
    rig.side.handle_peer_down(P.worker);
    let out = rig.drain();
    assert_eq!(out.iter().filter(|o| matches!(o, DecodeOutput::Ended { .. })).count(), 1);
    assert!(out.contains(&DecodeOutput::Ended { key: key(1), reason: AbortReason::PeerRestarted }));
    let failure = Some(AbortReason::PeerRestarted);
    assert!(sent(&out).contains(&(R, Message::Outcome { key: key(1), failure })));
    assert_eq!(rig.pool.held_count(), 5, "both transfers' pages: writes may still land");
    rig.advance(LEASE_MS / 2);
    let heartbeat = Message::Heartbeat { key: key(2), seq: 0, progress: 0 };
    assert_eq!(sent(&rig.deliver(other, heartbeat)).len(), 1, "a lease for the other worker");
    rig.advance(LEASE_MS / 2 + FLIGHT_MS);
    assert_eq!(rig.side.transfers_live(), 1, "the other worker's transfer is live");
    assert_eq!(rig.pool.held_count(), 2);
}

/// vllm#25067: an abort raced prefill completion.
#[test]
fn abort_races_completion() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let aborted = rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    let done = rig.deliver(P, done(key(1), 7, 3));
    assert_eq!(terminals(&aborted) + terminals(&done), 1, "exactly one terminal");
    assert!(!done.iter().any(|o| matches!(o, DecodeOutput::Ready { .. })));
    assert_eq!(rig.pool.held_count(), 0, "Done means every write completed: the pages can go");
}

/// sglang#17259, sglang#22716: a late message for an earlier use of a slot was taken for the
/// current one. Here: a message of another epoch or for another transfer changes nothing.
#[test]
fn late_messages_of_another_epoch_are_dropped() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let stale = TransferKey { transfer: TransferId(1), epoch: Epoch(7) };
    assert!(rig.deliver(P, done(stale, 1, 3)).is_empty());
    assert_eq!(rig.side.transfers_live(), 1);
    // Traffic meant for an earlier life of this worker is dropped too.
    let old_me = Endpoint { incarnation: Incarnation(0), ..D };
    rig.side.handle_envelope(
        Envelope { from: P, to: old_me, body: done(key(1), 1, 3) },
        &mut rig.pool,
        rig.now,
    );
    assert!(rig.drain().is_empty());
}

#[test]
fn a_restarted_prefill_gives_up_its_transfers_after_their_lease() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let reborn = Endpoint { incarnation: Incarnation(2), ..P };
    let out = rig.deliver(reborn, Message::Heartbeat { key: key(9), seq: 0, progress: 0 });
    assert!(out.contains(&DecodeOutput::Ended { key: key(1), reason: AbortReason::PeerRestarted }));
    assert_eq!(rig.pool.held_count(), 3, "the old incarnation's writes may still be in flight");
    // The old incarnation is not heard any more.
    assert!(rig.deliver(P, done(key(1), 1, 3)).is_empty());
    rig.advance(LEASE_MS + FLIGHT_MS);
    assert_eq!(rig.pool.held_count(), 0);
}

#[test]
fn an_ended_transfer_is_never_granted_a_lease() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    let out = rig.deliver(P, Message::Heartbeat { key: key(1), seq: 3, progress: 0 });
    assert!(sent(&out).iter().all(|(_, m)| !matches!(m, Message::LeaseGrant { .. })));
    assert!(sent(&out).iter().any(|(_, m)| matches!(m, Message::Abort { .. })));
}

/// vllm#50297: a prefill preempted in its last step handed over an empty page list.
#[test]
fn the_hand_off_is_never_empty() {
    // Every full page of the 8-token prompt cached already: the last one is reserved anyway,
    // since the prefill side computes its last token and that write must not land in a shared page.
    let mut rig = Rig::new();
    let prompt = spec(1, 8).prompt;
    let keys = block_hashes(0, &prompt, 4);
    let mut parent = root_hash(0);
    for (i, &hash) in keys.iter().enumerate() {
        let page = rig.pool.allocate().unwrap();
        let key = crate::kv::CacheKey { hash, parent };
        rig.pool.cache_insert(page, key, &prompt[i * 4..(i + 1) * 4]).unwrap();
        rig.pool.release(page).unwrap();
        parent = hash;
    }
    let out = rig.deliver(R, Message::Reserve { key: key(1), request: spec(1, 8), prefill: P });
    let Some((cached_tokens, pages)) = sent(&out).into_iter().find_map(|(_, m)| match m {
        Message::Prepare { cached_tokens, pages, .. } => Some((cached_tokens, pages)),
        _ => None,
    }) else {
        panic!("no Prepare in {out:?}");
    };
    assert_eq!((cached_tokens, pages.len()), (4, 1));
    // By hand: a transfer with nothing reserved.
    let t = rig.side.transfers.get_mut(&TransferId(1)).unwrap();
    let (pin, pages) = (t.pin, std::mem::take(&mut t.reserved));
    rig.pool.unpin(pin).unwrap();
    for page in pages {
        rig.pool.release(page).unwrap();
    }
    assert!(rig.side.check_invariants(&rig.pool).unwrap_err().what().contains("empty hand-off"));
}

#[test]
fn refusals_when_full_or_out_of_pages() {
    let mut rig = Rig::new();
    rig.reserve(1, 16);
    rig.reserve(2, 16);
    let out = rig.deliver(R, Message::Reserve { key: key(3), request: spec(3, 4), prefill: P });
    assert_eq!(
        sent(&out),
        vec![(R, Message::Outcome { key: key(3), failure: Some(AbortReason::DecodeBusy) })]
    );
    assert_eq!(rig.pool.held_count(), 8);
}

/// A late duplicate `Reserve` of a transfer that already ended must not reserve pages again:
/// nobody would ever write them, and they would sit out a whole lease.
#[test]
fn a_late_duplicate_reserve_is_ignored() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    rig.deliver(P, done(key(1), 1, 3));
    let held = rig.pool.held_count();
    let out = rig.deliver(R, Message::Reserve { key: key(1), request: spec(1, 10), prefill: P });
    assert!(out.is_empty());
    assert_eq!((rig.side.transfers_live(), rig.pool.held_count()), (0, held));
}

// --- The same classes with their guard removed by hand: the checks notice. ---

/// Advances `ms` and says whether every transfer ended: the liveness check.
fn ends_within(rig: &mut Rig, ms: u64) -> bool {
    rig.advance(ms);
    rig.side.transfers_live() == 0
}

#[test]
fn leak_when_the_peer_is_silent_by_hand() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    assert!(ends_within(&mut Rig::new_with(1, 10), LEASE_MS + FLIGHT_MS));
    // The lease guard removed: a transfer that never expires. The liveness check notices.
    let t = rig.side.transfers.get_mut(&TransferId(1)).unwrap();
    rig.side.leases.remove(&(t.lease_until, TransferId(1)));
    t.lease_until = Time::MAX;
    rig.side.leases.insert((Time::MAX, TransferId(1)));
    assert!(!ends_within(&mut rig, 100 * (LEASE_MS + FLIGHT_MS)), "the wedge went unnoticed");
}

#[test]
fn double_completion_by_hand() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let before = rig.side.transfers[&TransferId(1)].clone();
    rig.deliver(P, done(key(1), 7, 3));
    // The guard removed: the completed transfer still on file, as if Done had not ended it.
    rig.side.leases.insert((before.lease_until, TransferId(1)));
    rig.side.transfers.insert(TransferId(1), before);
    let what = rig.side.check_invariants(&rig.pool).unwrap_err();
    assert!(what.what().contains("not pinned"), "{what}");
}

#[test]
fn abort_races_completion_by_hand() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let aborted = rig.deliver(R, Message::Abort { key: key(1), reason: AbortReason::Client });
    // The guard removed: the abort not recorded, so Done completes the transfer as well.
    rig.side.transfers.get_mut(&TransferId(1)).unwrap().phase = Phase::AwaitingPrefill;
    let done = rig.deliver(P, done(key(1), 7, 3));
    assert_eq!(
        terminals(&aborted) + terminals(&done),
        2,
        "the exactly-once count notices the second end"
    );
}

#[test]
fn late_messages_of_another_epoch_by_hand() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    // The guard removed: the transfer takes messages of epoch 7 as its own.
    let stale = TransferKey { transfer: TransferId(1), epoch: Epoch(7) };
    rig.side.transfers.get_mut(&TransferId(1)).unwrap().key = stale;
    let out = rig.deliver(P, done(stale, 1, 3));
    let handed_over = out.iter().find_map(|o| match o {
        DecodeOutput::Ready { key, .. } => Some(*key),
        _ => None,
    });
    assert_ne!(
        handed_over,
        Some(key(1)),
        "the key check notices KV handed over under another epoch"
    );
    assert_eq!(handed_over, Some(stale));
}

impl Rig {
    fn new_with(id: u64, prompt_len: u32) -> Rig {
        let mut rig = Rig::new();
        rig.reserve(id, prompt_len);
        rig
    }
}

/// The lease is tracked once, by this side: however late the driver runs the pool's timers, and
/// before or after this side's, the reserved pages stay pinned until the lease ends here, and
/// the heartbeat, `Done` and the release that follow find the pin where they left it.
#[test]
fn the_pools_timers_never_end_a_lease_whatever_the_order() {
    for pool_first in [true, false] {
        let mut rig = Rig::new();
        rig.reserve(1, 10);
        rig.reserve(2, 10);
        let late = rig.now.saturating_add(Duration::from_millis(1000 * (LEASE_MS + FLIGHT_MS)));
        rig.pool.handle_timeout(late);
        assert_eq!(rig.pool.poll_expired(), None, "the pool expired a transfer's pin");
        assert_eq!(rig.pool.next_timeout(), None, "a transfer's pin set a pool timer");
        rig.drain();
        rig.deliver(P, Message::Heartbeat { key: key(1), seq: 0, progress: 0 });
        let out = rig.deliver(P, done(key(1), 7, 3));
        assert!(out.iter().any(|o| matches!(o, DecodeOutput::Ready { .. })));
        // Transfer 2 ends on its lease, the pool's timers run before or after this side's.
        rig.now = late;
        if pool_first {
            rig.pool.handle_timeout(rig.now);
        }
        rig.side.handle_timeout(&mut rig.pool, rig.now);
        rig.pool.handle_timeout(rig.now);
        let out = rig.drain();
        assert_eq!(terminals(&out), 1);
        assert_eq!(rig.side.transfers_live(), 0);
    }
}

/// A long prompt: its prefill side asks for leases for longer than the router's outcome timeout
/// would wait from `Reserve`. A heartbeat at least `live_report_interval` after the last report
/// that says the transfer got further tells the router it is still at work; the others do not:
/// heartbeats that report no progress (a sender stuck in its handshake) tell it nothing, nor do
/// those of a transfer that ended.
#[test]
fn a_transfer_that_gets_further_tells_the_router_at_most_once_per_interval() {
    let mut rig = Rig::new();
    rig.reserve(1, 10);
    let live = |out: &[DecodeOutput]| {
        sent(out).iter().filter(|m| *m == &(R, Message::TransferLive { key: key(1) })).count()
    };
    let mut reports = Vec::new();
    // Progress grows with every heartbeat to 1000 ms, then stands still to 2000 ms.
    for seq in 0..40 {
        rig.now = rig.now.saturating_add(Duration::from_millis(LEASE_MS / 2));
        let progress = seq.min(19);
        let out = rig.deliver(P, Message::Heartbeat { key: key(1), seq, progress });
        assert!(sent(&out).contains(&(P, Message::LeaseGrant { key: key(1), seq, lease_ms: 100 })));
        if live(&out) == 1 {
            reports.push(rig.now.as_nanos() / 1_000_000);
        }
    }
    // Heartbeats every 50 ms: reports at the first one at or past each interval, while progress
    // grows; the last growth (at 1000 ms) was reported at 1000 ms, and nothing after.
    assert_eq!(reports, vec![250, 500, 750, 1000]);
    rig.deliver(P, Message::Abort { key: key(1), reason: AbortReason::Timeout });
    rig.now = rig.now.saturating_add(Duration::from_millis(LIVE_REPORT_MS));
    let out = rig.deliver(P, Message::Heartbeat { key: key(1), seq: 40, progress: 100 });
    assert_eq!(live(&out), 0, "an ended transfer is not at work");
}
