//! The prefill side of the transfer protocol: computes a prompt's KV, writes it into the decode
//! side's reserved pages under a lease, and reports `Done` only once every write has completed.
//!
//! Per transfer: `Computing → Writing → DoneSent → gone`, or `Draining → gone` from any of the
//! first three on an abort, a failed write, a lost lease or a deadline. Exactly one terminal
//! output per transfer. `Draining` ends only when no write of this transfer can land any more:
//! every issued write completed or failed, or one write flight passed since the last was issued.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::peers::{Heard, Peers};
use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::kv::{PagePool, PageRef, PinId};
use crate::model::TokenLogprobs;
use crate::wire::{
    AbortReason, Endpoint, Envelope, Message, PageSlot, RequestSpec, TransferId, TransferKey,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillConfig {
    /// How often to ask for a lease while computing or writing; well under the lease itself.
    pub heartbeat_interval: Duration,
    /// How long a write issued may take to land or fail (`W`); the transport guarantees it.
    pub write_flight_max: Duration,
    /// How long a transfer may wait for a lease, a computation or an answer. Counted from
    /// `Prepare`, and again from the end of its computation: a prompt computed while the worker
    /// makes progress is never cut off for its length, only one stalled this long since the
    /// worker last made progress (`handle_compute_progress`).
    pub transfer_deadline: Duration,
    /// How often `Done` is sent again until acknowledged.
    pub done_retransmit: Duration,
    /// Live transfers at most; a `Prepare` beyond it is refused.
    pub transfers_max: u32,
}

/// What the prefill side asks its driver to do. Drained with `poll_output` after every input.
#[derive(Clone, Debug, PartialEq)]
pub enum PrefillOutput {
    Send(Envelope),
    /// Compute the request's prompt and report with `handle_computed`.
    Compute {
        key: TransferKey,
        request: RequestSpec,
    },
    /// Stop computing the request if it still is; its KV is not needed.
    Cancel {
        key: TransferKey,
    },
    /// Write the KV of positions `first_token..first_token + page_tokens` (from `source`, pinned
    /// here until the write completes) into the decode side's `page`, one-sided. Report the
    /// outcome with `handle_write_completion(key, ordinal, ..)`.
    Write {
        key: TransferKey,
        to: Endpoint,
        ordinal: u32,
        source: PageRef,
        page: PageSlot,
        first_token: u32,
    },
    /// The transfer ended: `true` if the decode side has the whole KV.
    Ended {
        key: TransferKey,
        completed: bool,
    },
}

/// What computing a transfer's prompt gave besides its KV: the first output token, and the
/// log-probabilities the request asked for, of that token and of the prompt's from the second
/// on. They travel to the decode side in `Done`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampled {
    pub first_token: u32,
    pub first_logprobs: Option<TokenLogprobs>,
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

impl Sampled {
    /// The first token alone, for a request that asked for no log-probabilities.
    pub fn token(first_token: u32) -> Sampled {
        Sampled { first_token, ..Sampled::default() }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the computation (and, meanwhile, for a lease).
    Computing,
    /// Issuing writes while the lease allows; `issued` of the pages so far.
    Writing { first_token: u32, issued: u32 },
    /// Every write completed and `Done` sent; waiting for `DoneAck`.
    DoneSent { first_token: u32, resend_at: Time },
    /// Ending: no new write; waiting until none can land. Then `answer` goes to the decode side.
    Draining { answer: Answer, drained_by: Time },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// The decode side aborted: acknowledge once drained.
    AbortAck,
    /// This side gives up: say so once drained.
    Abort(AbortReason),
}

#[derive(Clone, Debug)]
struct Transfer {
    key: TransferKey,
    decode: Endpoint,
    request: RequestSpec,
    cached_tokens: u32,
    page_tokens: u32,
    pages: Vec<PageSlot>,
    /// Source pages of the computed KV (positions from 0), pinned while writes read them.
    sources: Vec<PageRef>,
    source_pin: Option<PinId>,
    /// Writes issued and not yet completed or failed.
    outstanding: BTreeSet<u32>,
    completed_writes: u32,
    last_write_at: Option<Time>,
    /// Writes are allowed until then; `None` before the first grant.
    permission_until: Option<Time>,
    heartbeat_seq: u32,
    /// Send times of recent heartbeats, to anchor each grant to when it was asked for.
    heartbeats_sent: VecDeque<(u32, Time)>,
    next_heartbeat: Time,
    /// Heartbeats that found the worker had computed a step since the one before (`progress`).
    compute_ticks: u32,
    /// The worker's last step those heartbeats have counted.
    compute_progress_counted: Time,
    deadline: Time,
    phase: Phase,
    /// The first output token's log-probabilities and the prompt's, if the request asked:
    /// they go with `Done`.
    first_logprobs: Option<TokenLogprobs>,
    prompt_logprobs: Vec<TokenLogprobs>,
    /// The time this transfer is filed under in `PrefillSide::due`.
    filed_due: Time,
}

impl Transfer {
    /// The message that says every page is written.
    fn done(&self, first_token: u32) -> Message {
        Message::Done {
            key: self.key,
            first_token,
            pages_written: self.pages.len() as u32,
            first_logprobs: self.first_logprobs.clone(),
            prompt_logprobs: self.prompt_logprobs.clone(),
        }
    }

    /// When something is next due for it: a heartbeat, a retransmission, a drain, its deadline.
    fn due(&self) -> Time {
        match self.phase {
            Phase::Computing | Phase::Writing { .. } => self.next_heartbeat.min(self.deadline),
            Phase::DoneSent { resend_at, .. } => resend_at.min(self.deadline),
            Phase::Draining { drained_by, .. } => drained_by,
        }
    }
}

const HEARTBEATS_REMEMBERED: usize = 8;

#[derive(Clone, Debug)]
pub struct PrefillSide {
    me: Endpoint,
    config: PrefillConfig,
    transfers: BTreeMap<TransferId, Transfer>,
    peers: Peers,
    /// The highest transfer id prepared by each decode incarnation. Ids increase, so a `Prepare`
    /// at or below it is a late duplicate of a transfer that may have ended and been forgotten;
    /// taking it would end that transfer a second time.
    prepared_up_to: BTreeMap<Endpoint, TransferId>,
    outputs: VecDeque<PrefillOutput>,
    /// Every live transfer under the time it is next due (`Transfer::due`): the timers, read in
    /// O(log transfers) where a scan would cost O(transfers). Every input that changes a transfer
    /// refiles it (`touch`) before it returns.
    due: BTreeSet<(Time, TransferId)>,
    /// Transfers changed since the last incremental check; only live ones.
    changed: BTreeSet<TransferId>,
    /// Transfers holding a pin on their source pages.
    source_pins: usize,
    /// When this worker last computed a step of the prompts it holds: a computing transfer's
    /// deadline is at least `transfer_deadline` past it.
    compute_progress_at: Time,
}

impl PrefillSide {
    pub fn new(me: Endpoint, config: PrefillConfig) -> PrefillSide {
        PrefillSide {
            me,
            config,
            transfers: BTreeMap::new(),
            peers: Peers::default(),
            prepared_up_to: BTreeMap::new(),
            outputs: VecDeque::new(),
            due: BTreeSet::new(),
            changed: BTreeSet::new(),
            source_pins: 0,
            compute_progress_at: Time::ZERO,
        }
    }

    pub fn transfers_live(&self) -> usize {
        self.transfers.len()
    }

    pub fn config(&self) -> &PrefillConfig {
        &self.config
    }

    /// Pins the transfers hold in the pool: one each once its KV is computed. O(1).
    pub fn pins_held(&self) -> usize {
        self.source_pins
    }

    /// Whether the transfer is live and waiting for its computation.
    pub fn is_computing(&self, key: TransferKey) -> bool {
        self.transfers
            .get(&key.transfer)
            .is_some_and(|t| t.key == key && t.phase == Phase::Computing)
    }

    pub fn poll_output(&mut self) -> Option<PrefillOutput> {
        self.outputs.pop_front()
    }

    /// The earliest time something is due: a heartbeat, a retransmission, a drain, a deadline.
    pub fn next_timeout(&self) -> Option<Time> {
        self.due.first().map(|&(at, _)| at)
    }

    /// Refiles a transfer in the due index after it changed, and notes it changed; nothing if
    /// it is gone (`forget` unfiled it). Every input calls it for each transfer it handled.
    fn touch(&mut self, id: TransferId) {
        let Some(t) = self.transfers.get_mut(&id) else { return };
        let due = t.due();
        if due != t.filed_due {
            self.due.remove(&(t.filed_due, id));
            self.due.insert((due, id));
            t.filed_due = due;
        }
        self.changed.insert(id);
    }

    pub fn handle_envelope(&mut self, envelope: Envelope, pool: &mut PagePool, now: Time) {
        if envelope.to != self.me || !self.note_peer(envelope.from, pool, now) {
            return;
        }
        if let Some(key) = envelope.body.key() {
            self.handle_message(envelope, key, pool, now);
            self.touch(key.transfer);
        }
    }

    fn handle_message(
        &mut self,
        envelope: Envelope,
        key: TransferKey,
        pool: &mut PagePool,
        now: Time,
    ) {
        let from = envelope.from;
        let Some(transfer) = self.transfers.get(&key.transfer) else {
            if let Message::Prepare { request, cached_tokens, page_tokens, pages, .. } =
                envelope.body
            {
                if self.prepared_up_to.get(&from).is_some_and(|&up_to| key.transfer <= up_to) {
                    self.send(from, Message::Abort { key, reason: AbortReason::PrefillFailed });
                    return;
                }
                self.prepared_up_to.insert(from, key.transfer);
                if page_tokens != pool.page_tokens() {
                    // Pages of another size: every write would put KV at the wrong positions.
                    // The link's handshake refuses such a peer; this is the second line.
                    self.send(from, Message::Abort { key, reason: AbortReason::PrefillFailed });
                    return;
                }
                self.on_prepare(from, key, request, cached_tokens, page_tokens, pages, now);
            } else if let Message::Abort { .. } = envelope.body {
                self.send(from, Message::AbortAck { key });
            }
            return;
        };
        if transfer.key != key || transfer.decode != from {
            return;
        }
        match envelope.body {
            Message::LeaseGrant { seq, lease_ms, .. } => {
                self.on_grant(key, seq, lease_ms, pool, now)
            }
            Message::DoneAck { .. } => self.on_done_ack(key, pool),
            // sgl#34692: a sender still in its handshake (no lease granted yet) polls for nothing
            // but the grant: an abort then is never seen.
            Message::Abort { .. }
                if crate::planted!(StuckInBootstrap) && transfer.permission_until.is_none() => {}
            Message::Abort { .. } => self.drain(key, Answer::AbortAck, pool, now),
            _ => {}
        }
    }

    /// The prompt's KV is computed: `sources` hold it from position 0, and `sampled` has the
    /// first output token (with the log-probabilities the request asked for).
    pub fn handle_computed(
        &mut self,
        key: TransferKey,
        sampled: Sampled,
        sources: &[PageRef],
        pool: &mut PagePool,
        now: Time,
    ) {
        let Some(t) = self.transfers.get_mut(&key.transfer) else { return };
        if t.key != key || t.phase != Phase::Computing {
            return;
        }
        let first_token = sampled.first_token;
        t.first_logprobs = sampled.first_logprobs;
        t.prompt_logprobs = sampled.prompt_logprobs;
        let prompt_pages = t.request.prompt.len().div_ceil(t.page_tokens as usize);
        let first_page = (t.cached_tokens / t.page_tokens) as usize;
        if crate::planted!(EmptyHandOff)
            && sources.len() < prompt_pages
            && prompt_pages - first_page == t.pages.len()
        {
            // vllm#50297: the hand-off path does not check the page list; with no source page to
            // write, the transfer counts as written at once and `Done` goes out.
            t.completed_writes = t.pages.len() as u32;
            t.phase = Phase::Writing { first_token, issued: t.pages.len() as u32 };
            self.issue_writes(key, now);
            self.touch(key.transfer);
            return;
        }
        if sources.len() < prompt_pages || prompt_pages - first_page != t.pages.len() {
            self.drain(key, Answer::Abort(AbortReason::PrefillFailed), pool, now);
            self.touch(key.transfer);
            return;
        }
        // Pin what the writes will read, so the prefill scheduler may finish or preempt the
        // request meanwhile without freeing it under a write. Released by this side alone (its
        // deadline and drain bound every transfer), never by the pool's clock: a pin the pool
        // expired while a write still reads the page would let the page be reused under it.
        let Ok(pin) = pool.pin_many(&sources[first_page..prompt_pages], Time::MAX) else {
            self.drain(key, Answer::Abort(AbortReason::PrefillFailed), pool, now);
            self.touch(key.transfer);
            return;
        };
        let t = self.transfers.get_mut(&key.transfer).expect("looked up above");
        if !crate::planted!(StuckInBootstrap) {
            // The computation's time is not the protocol's: the handshake, the writes and the
            // answer get the whole deadline from here.
            t.deadline = now.saturating_add(self.config.transfer_deadline);
        }
        t.sources = sources[first_page..prompt_pages].to_vec();
        t.source_pin = Some(pin);
        self.source_pins += 1;
        t.phase = Phase::Writing { first_token, issued: 0 };
        self.issue_writes(key, now);
        self.touch(key.transfer);
    }

    /// The computation failed or was refused: give up.
    pub fn handle_compute_failed(&mut self, key: TransferKey, pool: &mut PagePool, now: Time) {
        if self.transfers.get(&key.transfer).is_some_and(|t| t.key == key) {
            self.drain(key, Answer::Abort(AbortReason::PrefillFailed), pool, now);
            self.touch(key.transfer);
        }
    }

    /// The worker took one of the prompts it holds further than it had ever been (the caller
    /// decides; recomputing what a preemption lost is not progress). A prompt waits its turn
    /// behind the others (the scheduler's order bounds that wait), so the worker's progress, not
    /// the prompt's own, is what keeps a computing transfer alive: the deadline ends only a
    /// stalled or thrashing computation. Takes effect at each transfer's next timer
    /// (`handle_timeout`).
    pub fn handle_compute_progress(&mut self, now: Time) {
        self.compute_progress_at = self.compute_progress_at.max(now);
    }

    /// A write issued earlier completed (`landed`) or failed.
    pub fn handle_write_completion(
        &mut self,
        key: TransferKey,
        ordinal: u32,
        landed: bool,
        pool: &mut PagePool,
        now: Time,
    ) {
        let Some(t) = self.transfers.get_mut(&key.transfer) else { return };
        if t.key != key || !t.outstanding.remove(&ordinal) {
            return;
        }
        t.completed_writes += u32::from(landed);
        match (&t.phase, landed) {
            (Phase::Writing { .. }, false) => {
                self.drain(key, Answer::Abort(AbortReason::PrefillFailed), pool, now)
            }
            (Phase::Writing { .. }, true) => self.issue_writes(key, now),
            (Phase::Draining { .. }, _) => self.finish_drain_if_done(key, pool, now),
            _ => {}
        }
        self.touch(key.transfer);
    }

    pub fn handle_timeout(&mut self, pool: &mut PagePool, now: Time) {
        // In id order, as a scan of the transfers would find them: the order of the outputs
        // must not depend on when each was due.
        let mut due: Vec<TransferKey> = self
            .due
            .range(..=(now, TransferId(u64::MAX)))
            .map(|(_, id)| self.transfers.get(id).expect("the due index names live transfers").key)
            .collect();
        due.sort_unstable_by_key(|key| key.transfer);
        let stalled_after = self.compute_progress_at.saturating_add(self.config.transfer_deadline);
        for key in due {
            let Some(t) = self.transfers.get_mut(&key.transfer) else { continue };
            if t.phase == Phase::Computing {
                t.deadline = t.deadline.max(stalled_after);
            }
            match t.phase {
                Phase::Draining { .. } => self.finish_drain_if_done(key, pool, now),
                _ if t.deadline <= now => {
                    self.drain(key, Answer::Abort(AbortReason::Timeout), pool, now)
                }
                // Filed under a deadline that the worker's progress has since moved.
                Phase::Computing if t.next_heartbeat > now => {}
                Phase::DoneSent { first_token, .. } => {
                    let (decode, done) = (t.decode, t.done(first_token));
                    self.send(decode, done);
                    let resend_at = now.saturating_add(self.config.done_retransmit);
                    self.transfer_mut(key).phase = Phase::DoneSent { first_token, resend_at };
                }
                Phase::Computing | Phase::Writing { .. } => self.heartbeat(key, now),
            }
            self.touch(key.transfer);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_prepare(
        &mut self,
        decode: Endpoint,
        key: TransferKey,
        request: RequestSpec,
        cached_tokens: u32,
        page_tokens: u32,
        pages: Vec<PageSlot>,
        now: Time,
    ) {
        let prompt_pages = request.prompt.len().div_ceil(page_tokens.max(1) as usize);
        let first_page = (cached_tokens / page_tokens.max(1)) as usize;
        let sane = page_tokens > 0
            && !request.prompt.is_empty()
            && cached_tokens.is_multiple_of(page_tokens)
            && first_page < prompt_pages
            && prompt_pages - first_page == pages.len();
        if !sane {
            // An empty or inconsistent hand-off is refused, never half-served.
            self.send(decode, Message::Abort { key, reason: AbortReason::PrefillFailed });
            return;
        }
        if self.transfers.len() >= self.config.transfers_max as usize {
            // Full, not failed: the router counts a transfer off this worker when its decode
            // side takes over, while this side holds it until `DoneAck` (or an aborted one's
            // writes drain). A refusal that used up an attempt would fail requests for load.
            self.send(decode, Message::Abort { key, reason: AbortReason::PrefillBusy });
            return;
        }
        let deadline = if crate::planted!(StuckInBootstrap) {
            // sgl#34692: no bootstrap timeout: the handshake may wait forever (see `on_grant`).
            Time::MAX
        } else {
            now.saturating_add(self.config.transfer_deadline)
        };
        self.transfers.insert(
            key.transfer,
            Transfer {
                key,
                decode,
                request: request.clone(),
                cached_tokens,
                page_tokens,
                pages,
                sources: Vec::new(),
                source_pin: None,
                outstanding: BTreeSet::new(),
                completed_writes: 0,
                last_write_at: None,
                permission_until: None,
                heartbeat_seq: 0,
                heartbeats_sent: VecDeque::with_capacity(HEARTBEATS_REMEMBERED),
                next_heartbeat: now,
                compute_ticks: 0,
                compute_progress_counted: now,
                deadline,
                phase: Phase::Computing,
                first_logprobs: None,
                prompt_logprobs: Vec::new(),
                filed_due: now,
            },
        );
        self.due.insert((now, key.transfer));
        self.heartbeat(key, now);
        self.outputs.push_back(PrefillOutput::Compute { key, request });
    }

    fn heartbeat(&mut self, key: TransferKey, now: Time) {
        let interval = self.config.heartbeat_interval;
        let compute_progress_at = self.compute_progress_at;
        let t = self.transfer_mut(key);
        if t.phase == Phase::Computing && compute_progress_at > t.compute_progress_counted {
            t.compute_ticks = t.compute_ticks.saturating_add(1);
            t.compute_progress_counted = compute_progress_at;
        }
        let computed = u32::from(t.phase != Phase::Computing);
        let progress = t.compute_ticks.saturating_add(computed).saturating_add(t.completed_writes);
        let seq = t.heartbeat_seq;
        t.heartbeat_seq = seq.wrapping_add(1);
        if t.heartbeats_sent.len() == HEARTBEATS_REMEMBERED {
            t.heartbeats_sent.pop_front();
        }
        t.heartbeats_sent.push_back((seq, now));
        t.next_heartbeat = now.saturating_add(interval);
        let decode = t.decode;
        self.send(decode, Message::Heartbeat { key, seq, progress });
    }

    fn on_grant(
        &mut self,
        key: TransferKey,
        seq: u32,
        lease_ms: u32,
        _pool: &mut PagePool,
        now: Time,
    ) {
        if crate::planted!(StuckInBootstrap) {
            // sgl#34692: the transfer's deadline only starts once the handshake is done.
            let deadline = now.saturating_add(self.config.transfer_deadline);
            let t = self.transfer_mut(key);
            t.deadline = t.deadline.min(deadline);
        }
        let t = self.transfer_mut(key);
        // The lease runs from when its heartbeat was sent, never from when the grant arrived.
        let Some(&(_, sent_at)) = t.heartbeats_sent.iter().find(|(s, _)| *s == seq) else { return };
        let until = sent_at.saturating_add(Duration::from_millis(u64::from(lease_ms)));
        if t.permission_until.is_none_or(|p| until > p) {
            t.permission_until = Some(until);
        }
        if matches!(t.phase, Phase::Writing { .. }) {
            self.issue_writes(key, now);
        }
    }

    /// Issues every write the lease allows now; sends `Done` once all have completed.
    fn issue_writes(&mut self, key: TransferKey, now: Time) {
        let t = self.transfers.get_mut(&key.transfer).expect("writing a live transfer");
        let Phase::Writing { first_token, issued } = t.phase else { return };
        let allowed = t.permission_until.is_some_and(|until| now < until);
        let mut issued_now = issued;
        while allowed && (issued_now as usize) < t.pages.len() {
            let ordinal = issued_now;
            t.outstanding.insert(ordinal);
            t.last_write_at = Some(now);
            let position = t.cached_tokens + ordinal * t.page_tokens;
            self.outputs.push_back(PrefillOutput::Write {
                key,
                to: t.decode,
                ordinal,
                source: t.sources[ordinal as usize],
                page: t.pages[ordinal as usize],
                first_token: position,
            });
            issued_now += 1;
        }
        t.phase = Phase::Writing { first_token, issued: issued_now };
        if issued_now as usize == t.pages.len() && t.outstanding.is_empty() {
            // Every write has completed: only now may `Done` go out.
            assert_eq!(t.completed_writes as usize, t.pages.len(), "Done with writes unresolved");
            let (decode, done) = (t.decode, t.done(first_token));
            t.phase = Phase::DoneSent {
                first_token,
                resend_at: now.saturating_add(self.config.done_retransmit),
            };
            self.send(decode, done);
        }
    }

    fn on_done_ack(&mut self, key: TransferKey, pool: &mut PagePool) {
        if matches!(self.transfer_mut(key).phase, Phase::DoneSent { .. }) {
            self.outputs.push_back(PrefillOutput::Ended { key, completed: true });
            self.forget(key, pool);
        }
    }

    /// Stops issuing writes and waits until none can land, then answers. Reports the end now.
    fn drain(&mut self, key: TransferKey, answer: Answer, pool: &mut PagePool, now: Time) {
        let flight = self.config.write_flight_max;
        let t = self.transfer_mut(key);
        match t.phase {
            Phase::Draining { .. } => return,
            Phase::DoneSent { .. } if answer == Answer::AbortAck => {
                // Every write completed already: acknowledge at once.
                let decode = t.decode;
                self.send(decode, Message::AbortAck { key });
                self.outputs.push_back(PrefillOutput::Ended { key, completed: false });
                self.forget(key, pool);
                if crate::planted!(DoubleCompletion) {
                    // vllm#46240: the send's completion freed the transfer and the abort's is
                    // handled too: its lookup below asserts the transfer is live: the engine dies.
                } else {
                    return;
                }
            }
            Phase::Computing => self.outputs.push_back(PrefillOutput::Cancel { key }),
            _ => {}
        }
        let t = self.transfer_mut(key);
        if crate::planted!(PrematureRelease) {
            // sgl#36707, sgl#38961: a failed or aborted transfer's outstanding writes are erased,
            // so its abort, or the ack of decode's, goes out at once (and decode frees the
            // pages) while they may still land.
            t.outstanding.clear();
        }
        let drained_by = if crate::planted!(AbortPathWedge) && !t.outstanding.is_empty() {
            // sgl#30352: an abort while writes are in flight trips an assertion in the transfer
            // thread, which dies: nothing ends the transfer any more, whatever completes after.
            Time::MAX
        } else {
            t.last_write_at.map_or(now, |at| at.saturating_add(flight))
        };
        t.phase = Phase::Draining { answer, drained_by };
        self.outputs.push_back(PrefillOutput::Ended { key, completed: false });
        self.finish_drain_if_done(key, pool, now);
    }

    /// Ends a drain once no write can land: all completed or failed, or the flight bound passed.
    fn finish_drain_if_done(&mut self, key: TransferKey, pool: &mut PagePool, now: Time) {
        let t = self.transfer_mut(key);
        let Phase::Draining { answer, drained_by } = t.phase else { return };
        if !t.outstanding.is_empty() && now < drained_by {
            return;
        }
        if crate::planted!(AbortPathWedge) && drained_by == Time::MAX {
            // The planted wedge above: the thread that would end the transfer is gone.
            return;
        }
        let decode = t.decode;
        let message = match answer {
            Answer::AbortAck => Message::AbortAck { key },
            Answer::Abort(reason) => Message::Abort { key, reason },
        };
        self.send(decode, message);
        self.forget(key, pool);
    }

    fn forget(&mut self, key: TransferKey, pool: &mut PagePool) {
        let t = self.transfers.remove(&key.transfer).expect("forgetting a live transfer");
        self.due.remove(&(t.filed_due, key.transfer));
        self.changed.remove(&key.transfer);
        if let Some(pin) = t.source_pin {
            pool.unpin(pin).expect("a transfer's pin is released by the transfer alone");
            self.source_pins -= 1;
        }
    }

    /// The link to a decode worker broke: nothing sent to it arrives any more, so its transfers
    /// end (each drains its writes first, as on any abort).
    pub fn handle_peer_down(
        &mut self,
        worker: crate::wire::WorkerId,
        pool: &mut PagePool,
        now: Time,
    ) {
        let gone: Vec<TransferKey> =
            self.transfers.values().filter(|t| t.decode.worker == worker).map(|t| t.key).collect();
        for key in gone {
            self.drain(key, Answer::Abort(AbortReason::PeerRestarted), pool, now);
            self.touch(key.transfer);
        }
    }

    /// Records a newer incarnation of a peer; returns false for an envelope from an older one. A
    /// decode worker that restarted has lost its reservations: its transfers end.
    fn note_peer(&mut self, from: Endpoint, pool: &mut PagePool, now: Time) -> bool {
        match self.peers.hear(from) {
            Heard::Stale => false,
            Heard::Known => true,
            Heard::Newer => {
                let gone: Vec<TransferKey> = self
                    .transfers
                    .values()
                    .filter(|t| {
                        t.decode.worker == from.worker && t.decode.incarnation < from.incarnation
                    })
                    .map(|t| t.key)
                    .collect();
                for key in gone {
                    self.drain(key, Answer::Abort(AbortReason::PeerRestarted), pool, now);
                    self.touch(key.transfer);
                }
                true
            }
        }
    }

    fn transfer_mut(&mut self, key: TransferKey) -> &mut Transfer {
        self.transfers.get_mut(&key.transfer).expect("a live transfer")
    }

    fn send(&mut self, to: Endpoint, body: Message) {
        self.outputs.push_back(PrefillOutput::Send(Envelope { from: self.me, to, body }));
    }

    /// Writes are issued only under a lease and never beyond the pages; `Done` only after every
    /// write completed; a drain answers only once nothing is outstanding or the flight bound
    /// passed; source pages stay pinned while writes may read them; bounds hold; the due index
    /// holds each transfer once, under the time it is due.
    pub fn check_invariants(&self, pool: &PagePool) -> Result<(), InvariantViolation> {
        ensure_invariant!(
            PD,
            self.transfers.len() <= self.config.transfers_max as usize,
            "{} transfers over the bound",
            self.transfers.len()
        );
        for (&id, t) in &self.transfers {
            check_transfer(id, t, pool)?;
        }
        // After the checks of each transfer's own state, so that a state broken by hand is
        // reported by the check about it rather than as a transfer due at another time.
        for (&id, t) in &self.transfers {
            self.check_filed(id, t)?;
        }
        ensure_invariant!(
            PD,
            self.due.len() == self.transfers.len(),
            "{} due times for {} transfers",
            self.due.len(),
            self.transfers.len()
        );
        if let Some(id) = self.changed.iter().find(|id| !self.transfers.contains_key(id)) {
            return Err(InvariantViolation::new(
                PD,
                format!("transfer {id:?} is noted as changed but is not live"),
            ));
        }
        let pinned = self.transfers.values().filter(|t| t.source_pin.is_some()).count();
        ensure_invariant!(
            PD,
            pinned == self.source_pins,
            "{} source pins counted, {pinned} transfers hold one",
            self.source_pins
        );
        Ok(())
    }

    /// The cheap check, for after every input; `check_invariants` is the full one.
    ///
    /// Checks every transfer an input changed since the last incremental check as the full
    /// check does (its state, its source pins in `pool`, its place in the due index), then the
    /// counts: transfers within the bound, one due entry per transfer, and the earliest entry
    /// names a live transfer due then. O(pages of the transfers changed + log transfers), where
    /// the full check is O(pages of all transfers). Takes `&mut self` to consume the set of
    /// changed transfers. A transfer no input touched cannot have changed, unless a bug changed
    /// it behind the inputs' back: the full check, at quiescence and every so many inputs, sees
    /// those too.
    pub fn check_invariants_incremental(
        &mut self,
        pool: &PagePool,
    ) -> Result<(), InvariantViolation> {
        let changed = std::mem::take(&mut self.changed);
        for &id in &changed {
            let t = self.transfers.get(&id);
            ensure_invariant!(
                PD,
                t.is_some(),
                "transfer {id:?} is noted as changed but is not live"
            );
            if let Some(t) = t {
                check_transfer(id, t, pool)?;
                self.check_filed(id, t)?;
            }
        }
        ensure_invariant!(
            PD,
            self.transfers.len() <= self.config.transfers_max as usize,
            "{} transfers over the bound",
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.due.len() == self.transfers.len(),
            "{} due times for {} transfers",
            self.due.len(),
            self.transfers.len()
        );
        if let Some(&(at, id)) = self.due.first() {
            let due = self.transfers.get(&id).map(Transfer::due);
            ensure_invariant!(
                PD,
                due == Some(at),
                "the earliest due entry ({at:?}, {id:?}) names a transfer due at {due:?}"
            );
        }
        Ok(())
    }

    /// The transfer is in the due index under the time it is due.
    fn check_filed(&self, id: TransferId, t: &Transfer) -> Result<(), InvariantViolation> {
        let due = t.due();
        ensure_invariant!(
            PD,
            t.filed_due == due,
            "transfer {id:?} is filed as due at {:?} but is due at {due:?}",
            t.filed_due
        );
        ensure_invariant!(
            PD,
            self.due.contains(&(due, id)),
            "transfer {id:?} is missing from the due index"
        );
        Ok(())
    }
}

const PD: &str = "pd-prefill";

/// One transfer's own invariants: see `PrefillSide::check_invariants`.
fn check_transfer(id: TransferId, t: &Transfer, pool: &PagePool) -> Result<(), InvariantViolation> {
    ensure_invariant!(PD, t.key.transfer == id, "transfer {id:?} filed under another id");
    ensure_invariant!(
        PD,
        !t.pages.is_empty(),
        "transfer {id:?} has nothing to write: an empty hand-off"
    );
    ensure_invariant!(
        PD,
        t.heartbeats_sent.len() <= HEARTBEATS_REMEMBERED,
        "transfer {id:?} remembers too many heartbeats"
    );
    ensure_invariant!(
        PD,
        t.outstanding.is_empty() || t.permission_until.is_some(),
        "transfer {id:?} has writes out without ever holding a lease"
    );
    match t.phase {
        Phase::Computing => ensure_invariant!(
            PD,
            t.outstanding.is_empty() && t.sources.is_empty(),
            "transfer {id:?} writes before its KV exists"
        ),
        Phase::Writing { issued, .. } => {
            ensure_invariant!(
                PD,
                issued as usize <= t.pages.len(),
                "transfer {id:?} issued {issued} writes for {} pages",
                t.pages.len()
            );
            ensure_invariant!(
                PD,
                t.outstanding.iter().all(|&o| o < issued),
                "transfer {id:?} has an outstanding write it never issued"
            );
        }
        Phase::DoneSent { .. } => {
            ensure_invariant!(
                PD,
                t.outstanding.is_empty(),
                "transfer {id:?} sent Done with {} writes unresolved",
                t.outstanding.len()
            );
            ensure_invariant!(
                PD,
                t.completed_writes as usize == t.pages.len(),
                "transfer {id:?} sent Done after {} of {} writes",
                t.completed_writes,
                t.pages.len()
            );
        }
        Phase::Draining { .. } => {}
    }
    if !t.outstanding.is_empty() {
        ensure_invariant!(PD, t.source_pin.is_some(), "transfer {id:?} reads unpinned pages");
        for &source in &t.sources {
            ensure_invariant!(
                PD,
                pool.pin_count(source).unwrap_or(0) >= 1,
                "source page {source:?} of {id:?} unpinned while a write reads it"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "prefill_invariant_tests.rs"]
mod invariant_tests;
#[cfg(test)]
#[path = "prefill_tests.rs"]
mod tests;
