//! The prefill side against a scripted decode side and write transport, one test per protocol
//! bug class of shared/bugs.md that this side guards, each with the invariant check shown to fire.

use super::*;
use crate::kv::PoolConfig;
use crate::sched::RequestId;
use crate::wire::{Epoch, Incarnation, WorkerId};

const P: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const D: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const LEASE_MS: u32 = 100;
const FLIGHT_MS: u64 = 20;

struct Rig {
    side: PrefillSide,
    pool: PagePool,
    now: Time,
    sources: Vec<PageRef>,
}

/// `Done` of a transfer with its first token and no log-probabilities.
fn done(key: TransferKey, first_token: u32, pages_written: u32) -> Message {
    Message::Done { key, first_token, pages_written, first_logprobs: None, prompt_logprobs: vec![] }
}

fn key(id: u64) -> TransferKey {
    TransferKey { transfer: TransferId(id), epoch: Epoch(0) }
}

fn prepare(id: u64, prompt_len: u32, cached_tokens: u32) -> Message {
    let pages = (prompt_len.div_ceil(4) - cached_tokens / 4) as usize;
    Message::Prepare {
        key: key(id),
        request: RequestSpec::new(RequestId(id), (0..prompt_len).collect(), 4),
        cached_tokens,
        page_tokens: 4,
        pages: (0..pages as u32).map(|i| PageSlot { index: 10 + i, generation: 0 }).collect(),
        lease_ms: LEASE_MS,
    }
}

impl Rig {
    fn new() -> Rig {
        let config = PrefillConfig {
            heartbeat_interval: Duration::from_millis(30),
            write_flight_max: Duration::from_millis(FLIGHT_MS),
            transfer_deadline: Duration::from_millis(1_000),
            done_retransmit: Duration::from_millis(50),
            transfers_max: 4,
        };
        let mut pool =
            PagePool::new(PoolConfig { pages_total: 8, page_tokens: 4, pins_max: 16 }).unwrap();
        let sources = (0..3).map(|_| pool.allocate().unwrap()).collect();
        Rig { side: PrefillSide::new(P, config), pool, now: Time::ZERO, sources }
    }

    fn deliver(&mut self, body: Message) -> Vec<PrefillOutput> {
        self.side.handle_envelope(Envelope { from: D, to: P, body }, &mut self.pool, self.now);
        self.drain()
    }

    fn computed(&mut self, id: u64) -> Vec<PrefillOutput> {
        let sources = self.sources.clone();
        self.side.handle_computed(key(id), Sampled::token(9), &sources, &mut self.pool, self.now);
        self.drain()
    }

    fn completion(&mut self, id: u64, ordinal: u32, landed: bool) -> Vec<PrefillOutput> {
        self.side.handle_write_completion(key(id), ordinal, landed, &mut self.pool, self.now);
        self.drain()
    }

    /// Transfer `id` of a 10-token prompt computed and granted a lease: its three writes are
    /// out.
    fn writing(&mut self, id: u64) {
        self.deliver(prepare(id, 10, 0));
        self.computed(id);
        self.deliver(Message::LeaseGrant { key: key(id), seq: 0, lease_ms: LEASE_MS });
    }

    /// As `writing`, and its three writes landed: its `Done` is out.
    fn written(&mut self, id: u64) {
        self.writing(id);
        for ordinal in 0..3 {
            self.completion(id, ordinal, true);
        }
    }

    fn advance(&mut self, ms: u64) -> Vec<PrefillOutput> {
        self.now = self.now.saturating_add(Duration::from_millis(ms));
        self.side.handle_timeout(&mut self.pool, self.now);
        self.drain()
    }

    fn drain(&mut self) -> Vec<PrefillOutput> {
        self.side.check_invariants(&self.pool).unwrap_or_else(|e| panic!("{e}"));
        self.pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        std::iter::from_fn(|| self.side.poll_output()).collect()
    }
}

fn sent(out: &[PrefillOutput]) -> Vec<Message> {
    out.iter()
        .filter_map(|o| match o {
            PrefillOutput::Send(e) => Some(e.body.clone()),
            _ => None,
        })
        .collect()
}

fn writes(out: &[PrefillOutput]) -> Vec<u32> {
    out.iter()
        .filter_map(|o| match o {
            PrefillOutput::Write { ordinal, .. } => Some(*ordinal),
            _ => None,
        })
        .collect()
}

fn ends(out: &[PrefillOutput]) -> Vec<bool> {
    out.iter()
        .filter_map(|o| match o {
            PrefillOutput::Ended { completed, .. } => Some(*completed),
            _ => None,
        })
        .collect()
}

#[test]
fn happy_path_writes_under_a_lease_then_done() {
    let mut rig = Rig::new();
    let out = rig.deliver(prepare(1, 10, 0));
    assert_eq!(sent(&out), vec![Message::Heartbeat { key: key(1), seq: 0, progress: 0 }]);
    assert!(out.iter().any(|o| matches!(o, PrefillOutput::Compute { .. })));
    let out = rig.computed(1);
    assert!(writes(&out).is_empty(), "no write before a lease is granted");
    let out = rig.deliver(Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS });
    assert_eq!(writes(&out), vec![0, 1, 2]);
    rig.completion(1, 0, true);
    rig.completion(1, 2, true);
    let out = rig.completion(1, 1, true);
    assert_eq!(sent(&out), vec![done(key(1), 9, 3)]);
    let out = rig.deliver(Message::DoneAck { key: key(1) });
    assert_eq!(ends(&out), vec![true]);
    assert_eq!(rig.pool.pins_live_count(), 0, "source pages are let go of at the end");
}

#[test]
fn a_lease_runs_from_when_it_was_asked_for() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0)); // heartbeat 0 sent at t=0
    rig.computed(1);
    rig.advance(90);
    // The grant for heartbeat 0 arrives at t=90: it runs to t=100, not t=190.
    let out = rig.deliver(Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS });
    assert_eq!(writes(&out).len(), 3);
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.computed(1);
    rig.now = Time::from_millis(100);
    let out = rig.deliver(Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS });
    assert!(writes(&out).is_empty(), "a grant that expired on the way allows no write");
}

/// sglang#36707, sglang#38961: the abort acknowledgment went out with writes unresolved.
#[test]
fn premature_release() {
    let mut rig = Rig::new();
    rig.writing(1);
    let out = rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
    assert_eq!(ends(&out), vec![false]);
    assert!(sent(&out).is_empty(), "acknowledged the abort with three writes in flight");
    rig.completion(1, 0, true);
    let out = rig.completion(1, 1, false);
    assert!(sent(&out).is_empty());
    let out = rig.completion(1, 2, true);
    assert_eq!(sent(&out), vec![Message::AbortAck { key: key(1) }]);
    // By hand: a transfer that claims Done with a write outstanding.
    let mut rig = Rig::new();
    rig.writing(1);
    let t = rig.side.transfers.get_mut(&TransferId(1)).unwrap();
    t.phase = Phase::DoneSent { first_token: 9, resend_at: Time::MAX };
    assert!(rig.side.check_invariants(&rig.pool).unwrap_err().what().contains("unresolved"));
}

/// sglang#30352: an abort tripped an assertion in the transfer thread; the transfer never
/// reached a terminal state. Here an abort in every phase ends, within one write flight at most.
#[test]
fn abort_path_wedge() {
    for phase in 0..4 {
        let mut rig = Rig::new();
        rig.deliver(prepare(1, 10, 0));
        if phase >= 1 {
            rig.computed(1);
        }
        if phase >= 2 {
            rig.deliver(Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS });
        }
        if phase >= 3 {
            for ordinal in 0..3 {
                rig.completion(1, ordinal, true);
            }
        }
        let out = rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
        assert_eq!(ends(&out), vec![false], "phase {phase}");
        // Writes whose completion never comes: the flight bound still ends the drain.
        rig.advance(FLIGHT_MS);
        assert_eq!(rig.side.transfers_live(), 0, "phase {phase}: wedged");
    }
}

/// sglang#34692: the sender stayed in its handshake state forever: a leak and a hang.
#[test]
fn stuck_in_handshake() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.computed(1);
    // The decode side never grants a lease: heartbeats repeat, then the deadline ends it.
    let mut heartbeats = 0;
    let mut ended = Vec::new();
    for _ in 0..40 {
        let out = rig.advance(30);
        heartbeats += sent(&out).iter().filter(|m| matches!(m, Message::Heartbeat { .. })).count();
        ended.extend(ends(&out));
    }
    assert!(heartbeats >= 30);
    assert_eq!(ended, vec![false]);
    assert_eq!(rig.side.transfers_live(), 0);
    assert_eq!(rig.pool.pins_live_count(), 0);
}

/// A prefill side holding as many transfers as it may refuses the next as busy, not failed: the
/// router counts a transfer off when its decode side takes over, before this side lets go, so a
/// full table is load, and a failure would use up the request's attempt (found by the cluster
/// proptest without faults). Once one ends, the next is taken.
#[test]
fn a_full_transfer_table_refuses_as_busy() {
    let mut rig = Rig::new();
    for id in 1..=4 {
        rig.deliver(prepare(id, 8, 0));
    }
    assert_eq!(rig.side.transfers_live(), 4);
    let out = rig.deliver(prepare(5, 8, 0));
    assert_eq!(sent(&out), vec![Message::Abort { key: key(5), reason: AbortReason::PrefillBusy }]);
    assert_eq!(rig.side.transfers_live(), 4, "nothing of the refused transfer is kept");
    rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
    assert_eq!(rig.side.transfers_live(), 3);
    let out = rig.deliver(prepare(6, 8, 0));
    assert!(!sent(&out).iter().any(|m| matches!(m, Message::Abort { .. })), "{out:?}");
    assert_eq!(rig.side.transfers_live(), 4);
}

/// vllm#50297: a prefill preempted in its last step handed an empty page list to the transfer.
#[test]
fn empty_hand_off() {
    let mut rig = Rig::new();
    // A Prepare naming no page (everything "cached") is refused, never half-served.
    let mut message = prepare(1, 8, 0);
    if let Message::Prepare { cached_tokens, pages, .. } = &mut message {
        *cached_tokens = 8;
        pages.clear();
    }
    let out = rig.deliver(message);
    assert_eq!(
        sent(&out),
        vec![Message::Abort { key: key(1), reason: AbortReason::PrefillFailed }]
    );
    // KV computed over fewer pages than the transfer needs (preempted in its last step): refused.
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.side.handle_computed(key(1), Sampled::token(9), &rig.sources[..2], &mut rig.pool, rig.now);
    let out = rig.drain();
    assert_eq!(ends(&out), vec![false]);
    assert!(writes(&out).is_empty());
    // By hand: a transfer with nothing to write.
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.side.transfers.get_mut(&TransferId(1)).unwrap().pages.clear();
    assert!(rig.side.check_invariants(&rig.pool).unwrap_err().what().contains("empty hand-off"));
}

/// nixl#2067, nixl#2044: a release returned while remote memory access was still outstanding.
/// Here: the source pages a write reads stay pinned until the write completes, even if the
/// prefill scheduler lets go of the request meanwhile.
#[test]
fn sources_stay_pinned_while_writes_read_them() {
    let mut rig = Rig::new();
    rig.writing(1);
    for page in rig.sources.clone() {
        rig.pool.release(page).unwrap(); // the prefill scheduler finished the request
    }
    assert_eq!(rig.pool.held_count(), 3, "pages under a write were freed");
    for ordinal in 0..3 {
        rig.completion(1, ordinal, true);
    }
    rig.deliver(Message::DoneAck { key: key(1) });
    assert_eq!(rig.pool.held_count(), 0);
    // By hand: unpin a source page while its write is outstanding.
    let mut rig = Rig::new();
    rig.writing(1);
    let pin = rig.side.transfers[&TransferId(1)].source_pin.unwrap();
    rig.pool.unpin(pin).unwrap();
    assert!(rig.side.check_invariants(&rig.pool).unwrap_err().what().contains("unpinned"));
}

#[test]
fn done_is_resent_until_acknowledged_and_a_late_abort_is_answered_at_once() {
    let mut rig = Rig::new();
    rig.written(1);
    let out = rig.advance(50);
    assert_eq!(sent(&out), vec![done(key(1), 9, 3)]);
    // abort races completion (vllm#25067): the abort wins, once, with nothing in flight.
    let out = rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
    assert_eq!(sent(&out), vec![Message::AbortAck { key: key(1) }]);
    assert_eq!(ends(&out), vec![false]);
    assert!(rig.deliver(Message::DoneAck { key: key(1) }).is_empty(), "no second terminal");
}

#[test]
fn a_restarted_decode_worker_ends_its_transfers() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    let reborn = Endpoint { incarnation: Incarnation(2), ..D };
    rig.side.handle_envelope(
        Envelope { from: reborn, to: P, body: Message::AbortAck { key: key(5) } },
        &mut rig.pool,
        rig.now,
    );
    let out = rig.drain();
    assert_eq!(ends(&out), vec![false]);
    assert_eq!(rig.side.transfers_live(), 0);
    // Another decode worker's restart ends only its own transfers.
    let prepared = Envelope { from: reborn, to: P, body: prepare(2, 10, 0) };
    rig.side.handle_envelope(prepared, &mut rig.pool, rig.now);
    assert_eq!(rig.side.transfers_live(), 1);
    let other = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };
    // Of a later incarnation than the transfer's decode worker, so that only the worker tells.
    let other_reborn = Endpoint { incarnation: Incarnation(3), ..other };
    for from in [other, other_reborn] {
        let body = Message::AbortAck { key: key(9) };
        rig.side.handle_envelope(Envelope { from, to: P, body }, &mut rig.pool, rig.now);
    }
    assert!(ends(&rig.drain()).is_empty());
    assert_eq!(rig.side.transfers_live(), 1);
}

// --- The same classes with their guard removed by hand: the liveness check notices. ---

fn ends_within(rig: &mut Rig, ms: u64) -> bool {
    for _ in 0..ms / 10 {
        rig.advance(10);
    }
    rig.side.transfers_live() == 0
}

#[test]
fn abort_path_wedge_by_hand() {
    let mut rig = Rig::new();
    rig.writing(1);
    rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
    // The flight bound removed: a drain that waits for completions that never come.
    if let Phase::Draining { drained_by, .. } =
        &mut rig.side.transfers.get_mut(&TransferId(1)).unwrap().phase
    {
        *drained_by = Time::MAX;
    }
    // Refiled as a buggy input would leave it: the timers then agree with the broken state.
    rig.side.touch(TransferId(1));
    assert!(!ends_within(&mut rig, 10 * FLIGHT_MS), "the wedge went unnoticed");
}

#[test]
fn stuck_in_handshake_by_hand() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.computed(1);
    // The deadline removed: no grant ever comes, and nothing ends the transfer.
    rig.side.transfers.get_mut(&TransferId(1)).unwrap().deadline = Time::MAX;
    assert!(!ends_within(&mut rig, 2_000), "the hang went unnoticed");
}

#[test]
fn timers_fire_in_transfer_order_whatever_fell_due_first() {
    // The due index orders transfers by time; what fires at once goes out in id order all the
    // same, as a scan of the transfers would have it.
    let mut rig = Rig::new();
    rig.deliver(prepare(2, 10, 0));
    rig.now = Time::from_millis(10);
    let other = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };
    let envelope = Envelope { from: other, to: P, body: prepare(1, 10, 0) };
    rig.side.handle_envelope(envelope, &mut rig.pool, rig.now);
    rig.drain();
    // Transfer 2's heartbeat is due at 30 ms, transfer 1's at 40 ms.
    assert_eq!(rig.side.next_timeout(), Some(Time::from_millis(30)));
    let out = rig.advance(30);
    let heartbeats: Vec<u64> = sent(&out)
        .iter()
        .map(|m| match m {
            Message::Heartbeat { key, seq: 1, progress: 0 } => key.transfer.0,
            other => panic!("expected a second heartbeat, got {other:?}"),
        })
        .collect();
    assert_eq!(heartbeats, [1, 2]);
    assert_eq!(rig.side.next_timeout(), Some(Time::from_millis(70)));
}

/// A prompt whose computation takes three deadlines, the worker computing steps all along: the
/// transfer lives through it, and then has the whole deadline for its handshake and writes.
#[test]
fn a_long_computation_lives_while_the_worker_makes_progress() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    for _ in 0..300 {
        rig.side.handle_compute_progress(rig.now);
        assert!(ends(&rig.advance(10)).is_empty(), "ended at {:?} while computing", rig.now);
    }
    let computed_at = rig.now;
    assert_eq!(computed_at, Time::from_millis(3_000));
    rig.computed(1);
    // No grant ever comes: the deadline counts from the end of the computation.
    assert!(!ends_within(&mut rig, 990), "ended before its deadline from the computation");
    assert!(ends_within(&mut rig, 10), "outlived its deadline from the computation");
}

/// The worker stops computing (a wedged executor, a pool that no step fits): the transfer ends
/// one deadline after the worker's last step, not before and not never.
#[test]
fn a_stalled_computation_ends_one_deadline_after_the_last_step() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    for _ in 0..150 {
        rig.side.handle_compute_progress(rig.now);
        rig.advance(10);
    }
    // The last step at 1490 ms; nothing since.
    assert!(!ends_within(&mut rig, 980), "ended before one deadline passed since the last step");
    assert_eq!(rig.now, Time::from_millis(2_480));
    assert!(ends_within(&mut rig, 10), "a stalled computation outlived its deadline");
    assert_eq!(rig.pool.pins_live_count(), 0);
}

/// The progress a heartbeat reports grows only when the transfer got further: the worker's progress
/// since the last heartbeat, the computation's end, a write completed. A sender waiting for a
/// lease that never comes reports the same progress however long it heartbeats.
#[test]
fn heartbeats_report_progress_only_when_the_transfer_got_further() {
    let mut rig = Rig::new();
    let progress = |out: &[PrefillOutput]| {
        sent(out).iter().find_map(|m| match m {
            Message::Heartbeat { progress, .. } => Some(*progress),
            _ => None,
        })
    };
    assert_eq!(progress(&rig.deliver(prepare(1, 10, 0))), Some(0));
    assert_eq!(progress(&rig.advance(30)), Some(0), "no step computed");
    rig.side.handle_compute_progress(rig.now);
    assert_eq!(progress(&rig.advance(30)), Some(1));
    assert_eq!(progress(&rig.advance(30)), Some(1), "no step since the last heartbeat");
    rig.computed(1);
    assert_eq!(progress(&rig.advance(30)), Some(2), "the computation ended");
    for _ in 0..5 {
        assert_eq!(progress(&rig.advance(30)), Some(2), "waiting for a lease is no progress");
    }
    let out = rig.deliver(Message::LeaseGrant { key: key(1), seq: 7, lease_ms: LEASE_MS });
    assert_eq!(writes(&out), vec![0, 1, 2]);
    rig.completion(1, 0, true);
    rig.completion(1, 1, true);
    assert_eq!(progress(&rig.advance(30)), Some(4), "two writes completed");
}

/// A computation that failed (a failed step, a prompt the scheduler refused) gives the transfer
/// up at once, not at its deadline: the decode side is told, and the prompt's KV, should it come
/// after all, is not written. Only for the transfer's own key.
#[test]
fn a_failed_computation_gives_its_transfer_up_at_once() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    let stale = TransferKey { transfer: TransferId(1), epoch: Epoch(7) };
    assert!(rig.side.is_computing(key(1)));
    assert!(!rig.side.is_computing(stale));
    rig.side.handle_compute_failed(stale, &mut rig.pool, rig.now);
    assert!(rig.drain().is_empty(), "another epoch's failure");
    rig.side.handle_compute_failed(key(1), &mut rig.pool, rig.now);
    let out = rig.drain();
    assert!(!rig.side.is_computing(key(1)));
    let abort = Message::Abort { key: key(1), reason: AbortReason::PrefillFailed };
    assert!(sent(&out).contains(&abort), "{out:?}");
    assert_eq!(ends(&out), vec![false]);
    let out = rig.computed(1);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(rig.pool.pins_live_count(), 0);
}

/// A lease grant counts only from the transfer's own decode worker and for its epoch; a
/// computation counts once.
#[test]
fn a_grant_from_another_worker_or_epoch_writes_nothing() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    rig.computed(1);
    let stale = TransferKey { transfer: TransferId(1), epoch: Epoch(7) };
    let grant = |key| Message::LeaseGrant { key, seq: 0, lease_ms: LEASE_MS };
    assert!(writes(&rig.deliver(grant(stale))).is_empty(), "another epoch's grant");
    let other = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };
    let envelope = Envelope { from: other, to: P, body: grant(key(1)) };
    rig.side.handle_envelope(envelope, &mut rig.pool, rig.now);
    assert!(writes(&rig.drain()).is_empty(), "another worker's grant");
    assert_eq!(writes(&rig.deliver(grant(key(1)))), vec![0, 1, 2]);
    // The computation reported twice: the second finds the transfer writing, and changes nothing.
    let pins = rig.pool.pins_live_count();
    assert!(rig.computed(1).is_empty());
    assert_eq!(rig.pool.pins_live_count(), pins);
}

/// A computing transfer's timer filed under its deadline, which the worker's progress has moved
/// since: it fires, and sends nothing until the next heartbeat is due.
#[test]
fn a_deadline_moved_by_progress_fires_without_a_heartbeat() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    // Heartbeats every 30 ms; the last before the deadline at 990 ms, the next due at 1020.
    for _ in 0..33 {
        assert_eq!(sent(&rig.advance(30)).len(), 1);
    }
    rig.side.handle_compute_progress(rig.now);
    assert_eq!(rig.side.next_timeout(), Some(Time::from_millis(1_000)), "the deadline");
    assert!(rig.advance(10).is_empty(), "a heartbeat before one was due");
    assert_eq!(rig.side.next_timeout(), Some(Time::from_millis(1_020)));
    assert_eq!(sent(&rig.advance(20)).len(), 1);
}

/// Each write names the first prompt position its page holds, after the pages the decode side
/// had cached.
#[test]
fn each_write_names_the_first_position_of_its_page() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 4));
    rig.computed(1);
    let out = rig.deliver(Message::LeaseGrant { key: key(1), seq: 0, lease_ms: LEASE_MS });
    let positions: Vec<u32> = out
        .iter()
        .filter_map(|o| match o {
            PrefillOutput::Write { first_token, .. } => Some(*first_token),
            _ => None,
        })
        .collect();
    assert_eq!(positions, vec![4, 8]);
}

/// A computation that outlasts the first lease writes under a later one: a grant extends the
/// permission to write, and one that arrives late, for an earlier heartbeat, never shortens it.
#[test]
fn a_later_grant_extends_the_permission_and_an_earlier_one_never_shortens_it() {
    let mut rig = Rig::new();
    rig.deliver(prepare(1, 10, 0));
    let grant = |seq| Message::LeaseGrant { key: key(1), seq, lease_ms: LEASE_MS };
    // The lease of the heartbeat at 0 ms ends at 100 ms.
    rig.deliver(grant(0));
    // Heartbeats at 30, 60, 90, 120, 150 ms (seq 1 to 5).
    for _ in 0..5 {
        rig.advance(30);
    }
    // The lease of the one at 120 ms ends at 220; then the late grant for the one at 30 ms.
    rig.deliver(grant(4));
    rig.deliver(grant(1));
    assert_eq!(rig.now, Time::from_millis(150));
    assert_eq!(writes(&rig.computed(1)), vec![0, 1, 2], "the permission until 220 ms");
}

/// A `Done` never acknowledged until the deadline: the decode side is told to abort (it may
/// never have heard the `Done`), not sent the acknowledgment of an abort it never asked for.
#[test]
fn a_done_unacknowledged_until_the_deadline_ends_in_an_abort() {
    let mut rig = Rig::new();
    rig.written(1);
    let mut out = Vec::new();
    while rig.side.transfers_live() > 0 {
        out.extend(rig.advance(50));
    }
    assert_eq!(rig.now, Time::from_millis(1_000));
    assert_eq!(ends(&out), vec![false]);
    let abort = Message::Abort { key: key(1), reason: AbortReason::Timeout };
    assert_eq!(sent(&out).last(), Some(&abort), "{out:?}");
}

/// A transfer already draining is not drained again: a second abort (from the decode side, or
/// its link breaking) neither ends it twice nor changes the answer it owes.
#[test]
fn a_draining_transfer_ends_once_whatever_ends_it_again() {
    let mut rig = Rig::new();
    rig.writing(1);
    let out = rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client });
    assert_eq!((ends(&out), sent(&out)), (vec![false], vec![]), "writes are in flight");
    assert!(rig.deliver(Message::Abort { key: key(1), reason: AbortReason::Client }).is_empty());
    rig.side.handle_peer_down(D.worker, &mut rig.pool, rig.now);
    assert!(rig.drain().is_empty());
    rig.completion(1, 0, true);
    rig.completion(1, 1, false);
    let out = rig.completion(1, 2, true);
    assert_eq!((ends(&out), sent(&out)), (vec![], vec![Message::AbortAck { key: key(1) }]));
}
