//! The decode side of the transfer protocol: reserves pages for the prefill side to write,
//! grants write leases, and hands the pages to the scheduler only once `Done` says every write
//! has landed. See the module docs of `pd` for the lease argument.
//!
//! Per transfer: `AwaitingPrefill → (Ready | Ended)`, or `AwaitingPrefill → Draining → gone` when
//! it ends while writes may still land. Exactly one terminal output (`Ready` or `Ended`) per
//! transfer.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::Sampled;
use super::peers::{Heard, Peers};
use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::kv::prefix_hash::{block_hashes, root_hash};
use crate::kv::{PagePool, PageRef, PinId};
use crate::model::TokenLogprobs;
use crate::wire::{
    AbortReason, Endpoint, Envelope, Message, PageSlot, RequestSpec, TransferId, TransferKey,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeConfig {
    /// How long one lease grant lets the prefill side write (`L`).
    pub lease: Duration,
    /// How long a write issued may take to land or fail (`W`): the data plane's timeout.
    pub write_flight_max: Duration,
    /// Live transfers at most; a `Reserve` beyond it is refused.
    pub transfers_max: u32,
    /// Whether reserved prompts reuse the decode side's prefix cache.
    pub prefix_cache: bool,
    /// How often, at most, a transfer whose prefill side's heartbeats report progress tells the
    /// router so (`Message::TransferLive`): well under the router's outcome timeout, which counts
    /// from the last report, and long enough that a transfer of a short prompt sends none.
    pub live_report_interval: Duration,
}

/// What the decode side asks its driver to do. Drained with `poll_output` after every input.
#[derive(Clone, Debug, PartialEq)]
pub enum DecodeOutput {
    Send(Envelope),
    /// The KV arrived whole: the scheduler takes the request with these page references (they
    /// move; the transfer holds none any more), of which the first `cached_pages` came from this
    /// side's prefix cache, and `computed_tokens` positions already computed. The driver then
    /// tells `router` the outcome (`Message::Outcome`): success only once the scheduler accepted
    /// the request, so the router never counts on a request nobody decodes.
    Ready {
        key: TransferKey,
        router: Endpoint,
        request: RequestSpec,
        pages: Vec<PageRef>,
        cached_pages: u32,
        computed_tokens: u32,
        first_token: u32,
        /// The first token's log-probabilities, as the prefill side sent them (if asked for).
        first_logprobs: Option<TokenLogprobs>,
        /// The prompt's tokens' log-probabilities, as the prefill side sent them (if asked for).
        prompt_logprobs: Vec<TokenLogprobs>,
    },
    /// The transfer ended without KV.
    Ended {
        key: TransferKey,
        reason: AbortReason,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Pages reserved and pinned; waiting for `Done`.
    AwaitingPrefill,
    /// Ended (its terminal output is out) while writes may still land: the pages stay until the
    /// prefill side reports it drained, or the lease runs out.
    Draining,
}

#[derive(Clone, Debug)]
struct Transfer {
    key: TransferKey,
    router: Endpoint,
    prefill: Endpoint,
    request: RequestSpec,
    /// Pages found in the prefix cache: read, never written, by this request.
    cached: Vec<PageRef>,
    /// Pages the prefill side writes, in position order, all pinned by `pin` under the lease.
    reserved: Vec<PageRef>,
    pin: PinId,
    lease_until: Time,
    /// The router hears `TransferLive` at the first heartbeat from then on that reports more
    /// progress than `reported_progress`, the last it heard of.
    next_live_report: Time,
    reported_progress: u32,
    phase: Phase,
}

#[derive(Clone, Debug)]
pub struct DecodeSide {
    me: Endpoint,
    config: DecodeConfig,
    transfers: BTreeMap<TransferId, Transfer>,
    leases: BTreeSet<(Time, TransferId)>,
    /// Transfers that ended, oldest first, and whether they completed: the answer to a late
    /// duplicate `Done`. Bounded by `transfers_max`.
    ended: VecDeque<(TransferKey, bool)>,
    /// The newest incarnation seen of each peer.
    peers: Peers,
    /// The highest transfer id reserved by each router incarnation. Routers allocate ids in
    /// increasing order, so a `Reserve` at or below it is a late duplicate of a transfer that may
    /// have ended and been forgotten: taking it would reserve pages nobody will ever write.
    reserved_up_to: BTreeMap<Endpoint, TransferId>,
    outputs: VecDeque<DecodeOutput>,
    /// Transfers changed since the last incremental check; only live ones.
    changed: BTreeSet<TransferId>,
    /// Page references the transfers hold (`page_refs`), counted as they come and go.
    page_refs_held: u64,
    /// Planted bugs' own memory (feature `planted-bugs` only; see `crate::planted`).
    #[cfg(feature = "planted-bugs")]
    planted: PlantedMemory,
}

/// What the planted bugs of this side remember; nothing of it exists in production builds.
#[cfg(feature = "planted-bugs")]
#[derive(Clone, Debug, Default)]
struct PlantedMemory {
    /// SlotReuse: a metadata slot per transfer (the lowest free at its `Reserve`, as engines
    /// allocate them), remembered after it is freed; and each taken slot's holder.
    slot_of: BTreeMap<TransferId, u32>,
    slot_holder: BTreeMap<u32, TransferId>,
    /// FreeWhileWriteLands: pages freed at an abort whose transfer may still write them.
    unrevoked: BTreeSet<(TransferKey, u32)>,
}

impl DecodeSide {
    pub fn new(me: Endpoint, config: DecodeConfig) -> DecodeSide {
        DecodeSide {
            me,
            ended: VecDeque::with_capacity(config.transfers_max as usize),
            config,
            transfers: BTreeMap::new(),
            leases: BTreeSet::new(),
            peers: Peers::default(),
            reserved_up_to: BTreeMap::new(),
            outputs: VecDeque::new(),
            changed: BTreeSet::new(),
            page_refs_held: 0,
            #[cfg(feature = "planted-bugs")]
            planted: PlantedMemory::default(),
        }
    }

    pub fn transfers_live(&self) -> usize {
        self.transfers.len()
    }

    pub fn poll_output(&mut self) -> Option<DecodeOutput> {
        self.outputs.pop_front()
    }

    /// The earliest lease end, if any: when to call `handle_timeout`.
    pub fn next_timeout(&self) -> Option<Time> {
        self.leases.first().map(|(t, _)| *t)
    }

    /// Handles one envelope from the network. Envelopes for another incarnation of this worker,
    /// from an older incarnation of a peer, or about another epoch are dropped.
    pub fn handle_envelope(&mut self, envelope: Envelope, pool: &mut PagePool, now: Time) {
        self.handle(envelope, pool, now, true);
    }

    /// As `handle_envelope`, for a `Reserve` the driver's scheduler refused (no batch slot): it is
    /// answered with a failed `Outcome`, and counted as seen so that a late duplicate is dropped.
    pub fn refuse_reserve(&mut self, envelope: Envelope, pool: &mut PagePool, now: Time) {
        self.handle(envelope, pool, now, false);
    }

    /// Whether a transfer with this id is live (reserved, or draining).
    pub fn holds(&self, transfer: TransferId) -> bool {
        self.transfers.contains_key(&transfer)
    }

    /// Whether a one-sided write of `key` into `page` may land now: the page is still reserved by
    /// that transfer. Checked by the data plane before a write lands, as RDMA checks a memory
    /// key: once the transfer let go of its pages (they may be reused), a late write is dropped.
    pub fn write_allowed(&self, key: TransferKey, page: PageSlot) -> bool {
        #[cfg(feature = "planted-bugs")]
        if (crate::planted!(FreeWhileWriteLands)
            || crate::planted!(PrematureRelease)
            || crate::planted!(LeaseShorterThanWrite))
            && self.planted.unrevoked.contains(&(key, page.index))
        {
            // sgl#32564, sgl#35049: the freed page is still a valid target (the whole pool is
            // registered with the NIC); the write lands in whoever holds the page now.
            return true;
        }
        self.transfers.get(&key.transfer).is_some_and(|t| {
            t.key == key
                && t.reserved
                    .iter()
                    .any(|p| p.index() == page.index && p.generation() == page.generation)
        })
    }

    /// Every page reference the transfers hold, once per reference: what the scheduler's page
    /// accounting counts besides its own.
    pub fn page_refs(&self) -> impl Iterator<Item = PageRef> + '_ {
        self.transfers.values().flat_map(|t| t.cached.iter().chain(&t.reserved).copied())
    }

    /// How many `page_refs` there are, in O(1): what the scheduler's incremental check counts
    /// besides its own references.
    pub fn page_refs_count(&self) -> u64 {
        self.page_refs_held
    }

    /// Pins the transfers hold in the pool: one each.
    pub fn pins_held(&self) -> usize {
        self.transfers.len()
    }

    fn handle(&mut self, envelope: Envelope, pool: &mut PagePool, now: Time, admit: bool) {
        if envelope.to != self.me || !self.note_peer(envelope.from, pool, now) {
            return;
        }
        let from = envelope.from;
        let Some(key) = envelope.body.key() else { return };
        let Some(transfer) = self.transfers.get(&key.transfer) else {
            self.handle_unknown(from, envelope.body, pool, now, admit);
            return;
        };
        let expected = match envelope.body {
            Message::Abort { .. } if from == transfer.router => transfer.router,
            _ => transfer.prefill,
        };
        if transfer.key != key || from != expected {
            return;
        }
        match envelope.body {
            Message::Heartbeat { seq, progress, .. } => self.on_heartbeat(key, seq, progress, now),
            Message::Done {
                first_token, pages_written, first_logprobs, prompt_logprobs, ..
            } => {
                let sampled = Sampled { first_token, first_logprobs, prompt_logprobs };
                self.on_done(key, sampled, pages_written, pool)
            }
            Message::Abort { reason, .. } if from == transfer.router => {
                self.on_router_abort(key, reason, pool)
            }
            Message::Abort { reason, .. } => self.on_prefill_abort(key, reason, pool),
            Message::AbortAck { .. } if transfer.phase == Phase::Draining => {
                self.release(key.transfer, pool)
            }
            _ => {}
        }
    }

    /// Ends transfers whose lease ran out: no write can land in their pages any more.
    pub fn handle_timeout(&mut self, pool: &mut PagePool, now: Time) {
        while let Some(&(until, id)) = self.leases.first() {
            if until > now {
                break;
            }
            let transfer = &self.transfers[&id];
            let (key, phase) = (transfer.key, transfer.phase);
            if phase == Phase::AwaitingPrefill && self.fail_open(key, pool) {
                continue;
            }
            if phase == Phase::AwaitingPrefill {
                self.send_to_prefill(key, Message::Abort { key, reason: AbortReason::Timeout });
                self.end(key, AbortReason::Timeout);
            }
            self.release(id, pool);
        }
    }

    /// A transfer the decode side does not hold: a new `Reserve`, or a late message for one that
    /// ended. A heartbeat is never granted here: the answer is always `Abort`.
    fn handle_unknown(
        &mut self,
        from: Endpoint,
        body: Message,
        pool: &mut PagePool,
        now: Time,
        admit: bool,
    ) {
        let Some(key) = body.key() else { return };
        let completed =
            self.ended.iter().find(|(k, _)| k.transfer == key.transfer).map(|(_, done)| *done);
        match body {
            Message::Reserve { request, prefill, .. } => {
                if self.reserved_up_to.get(&from).is_some_and(|&up_to| key.transfer <= up_to) {
                    return;
                }
                self.reserved_up_to.insert(from, key.transfer);
                if admit {
                    self.on_reserve(from, key, request, prefill, pool, now);
                } else {
                    let failure = Some(AbortReason::DecodeBusy);
                    self.send(from, Message::Outcome { key, failure });
                }
            }
            Message::Done { .. } if completed == Some(true) => {
                self.send(from, Message::DoneAck { key })
            }
            #[cfg(feature = "planted-bugs")]
            Message::Done { first_token, first_logprobs, prompt_logprobs, .. }
                if crate::planted!(SlotReuse) && self.slot_occupant(key, from).is_some() =>
            {
                // sgl#17259, sgl#22716, sgl#27374: the late Done is matched by its metadata slot,
                // not by transfer and epoch: the slot's new occupant takes it.
                let occupant = self.slot_occupant(key, from).expect("matched above");
                let pages = self.transfers[&occupant.transfer].reserved.len() as u32;
                let sampled = Sampled { first_token, first_logprobs, prompt_logprobs };
                self.on_done(occupant, sampled, pages, pool);
            }
            Message::Heartbeat { .. } | Message::Done { .. } => {
                self.send(from, Message::Abort { key, reason: AbortReason::DecodeFailed });
            }
            Message::Abort { .. } => self.send(from, Message::AbortAck { key }),
            _ => {}
        }
    }

    fn on_reserve(
        &mut self,
        router: Endpoint,
        key: TransferKey,
        request: RequestSpec,
        prefill: Endpoint,
        pool: &mut PagePool,
        now: Time,
    ) {
        if request.prompt.is_empty() {
            self.send(router, Message::Outcome { key, failure: Some(AbortReason::DecodeFailed) });
            return;
        }
        if self.transfers.len() >= self.config.transfers_max as usize {
            self.send(router, Message::Outcome { key, failure: Some(AbortReason::DecodeBusy) });
            return;
        }
        let page_tokens = pool.page_tokens() as usize;
        let mut cached = Vec::new();
        if self.config.prefix_cache {
            // The page holding the last prompt token is always written: the prefill side
            // computes it to sample the first token, and it must not land in a shared page.
            let shareable = (request.prompt.len() - 1) / page_tokens * page_tokens;
            let keys = block_hashes(request.cache_salt, &request.prompt[..shareable], page_tokens);
            pool.match_prefix(root_hash(request.cache_salt), &keys, &request.prompt, &mut cached);
        }
        let needed = request.prompt.len().div_ceil(page_tokens) - cached.len();
        debug_assert!(
            needed >= 1,
            "the last prompt page is never shared, so a hand-off is never empty"
        );
        let lease_until = if crate::planted!(LeakWhenPeerSilent) {
            // vllm#46283: no timeout on the reservation: decode waits for prefill forever.
            Time::MAX
        } else {
            now.saturating_add(self.lease_span())
        };
        let mut reserved = Vec::with_capacity(needed);
        // The lease is tracked here alone: the pin never expires on the pool's clock, so the
        // order in which a driver fires the two machines' timers cannot free a page under a
        // write, nor leave this side holding a pin the pool already dropped.
        let pin = match pool.allocate_many(needed as u32, &mut reserved) {
            Ok(()) => pool.pin_many(&reserved, Time::MAX).ok(),
            Err(_) => None,
        };
        let Some(pin) = pin else {
            for page in cached.into_iter().chain(reserved) {
                pool.release(page).expect("a page taken a moment ago is held");
            }
            self.send(router, Message::Outcome { key, failure: Some(AbortReason::DecodeBusy) });
            return;
        };
        let prepare = Message::Prepare {
            key,
            request: request.clone(),
            cached_tokens: (cached.len() * page_tokens) as u32,
            page_tokens: page_tokens as u32,
            pages: reserved
                .iter()
                .map(|p| PageSlot { index: p.index(), generation: p.generation() })
                .collect(),
            lease_ms: u32::try_from(self.config.lease.as_millis()).unwrap_or(u32::MAX),
        };
        self.send(prefill, prepare);
        self.leases.insert((lease_until, key.transfer));
        self.page_refs_held += (cached.len() + reserved.len()) as u64;
        self.changed.insert(key.transfer);
        self.transfers.insert(
            key.transfer,
            Transfer {
                key,
                router,
                prefill,
                request,
                cached,
                reserved,
                pin,
                lease_until,
                next_live_report: now.saturating_add(self.config.live_report_interval),
                reported_progress: 0,
                phase: Phase::AwaitingPrefill,
            },
        );
        #[cfg(feature = "planted-bugs")]
        if crate::planted!(SlotReuse) {
            self.take_slot(key.transfer);
        }
    }

    fn on_heartbeat(&mut self, key: TransferKey, seq: u32, progress: u32, now: Time) {
        let span = self.lease_span();
        let transfer = self.transfers.get_mut(&key.transfer).expect("checked by the caller");
        if transfer.phase == Phase::Draining {
            // Ended: never a new lease. Say so again, in case the first Abort was lost.
            let prefill = transfer.prefill;
            self.send(prefill, Message::Abort { key, reason: AbortReason::DecodeFailed });
            return;
        }
        let until = now.saturating_add(span);
        // HeartbeatNotExtendingLease (a missing class): the grant goes out, the lease stays.
        if until > transfer.lease_until && !crate::planted!(HeartbeatNotExtendingLease) {
            self.leases.remove(&(transfer.lease_until, key.transfer));
            self.leases.insert((until, key.transfer));
            transfer.lease_until = until;
            self.changed.insert(key.transfer);
        }
        // The prefill side got further since the last report: the router's outcome timeout
        // starts again. Heartbeats alone do not: a sender stuck in its handshake heartbeats too.
        let live = transfer.next_live_report <= now && progress > transfer.reported_progress;
        if live {
            transfer.next_live_report = now.saturating_add(self.config.live_report_interval);
            transfer.reported_progress = progress;
        }
        let (prefill, router, lease_ms) = (
            transfer.prefill,
            transfer.router,
            u32::try_from(self.config.lease.as_millis()).unwrap_or(u32::MAX),
        );
        self.send(prefill, Message::LeaseGrant { key, seq, lease_ms });
        if live {
            self.send(router, Message::TransferLive { key });
        }
    }

    fn on_done(
        &mut self,
        key: TransferKey,
        sampled: Sampled,
        pages_written: u32,
        pool: &mut PagePool,
    ) {
        let transfer = &self.transfers[&key.transfer];
        let prefill = transfer.prefill;
        if transfer.phase == Phase::Draining {
            // It finished before our Abort reached it; every write has completed.
            self.release(key.transfer, pool);
            #[cfg(feature = "planted-bugs")]
            if crate::planted!(SlotReuse)
                && let Some(occupant) = self.slot_occupant(key, prefill)
            {
                // sgl#17259, sgl#22716, sgl#27374: the Done of the aborted transfer is read from
                // its metadata slot, freed at the abort and reused: the new occupant takes it.
                let pages = self.transfers[&occupant.transfer].reserved.len() as u32;
                self.on_done(occupant, sampled, pages, pool);
            }
            return;
        }
        if pages_written as usize != transfer.reserved.len() {
            // Fail closed: KV that did not arrive whole is never decoded from.
            self.send(prefill, Message::Abort { key, reason: AbortReason::PrefillFailed });
            self.end(key, AbortReason::PrefillFailed);
            self.release(key.transfer, pool);
            return;
        }
        let mut transfer = self.transfers.remove(&key.transfer).expect("looked up above");
        self.leases.remove(&(transfer.lease_until, key.transfer));
        self.forgotten(key.transfer, &transfer);
        // Writes are over: the pages are ordinary request pages from here on.
        pool.unpin(transfer.pin).expect("a transfer's pin is released by the transfer alone");
        let page_tokens = pool.page_tokens();
        let computed_tokens = transfer.request.prompt.len() as u32;
        debug_assert!(transfer.cached.len() as u32 * page_tokens <= computed_tokens);
        let cached_pages = transfer.cached.len() as u32;
        let mut pages = transfer.cached;
        pages.append(&mut transfer.reserved);
        self.send(prefill, Message::DoneAck { key });
        self.remember(key, true);
        self.outputs.push_back(DecodeOutput::Ready {
            key,
            router: transfer.router,
            request: transfer.request,
            pages,
            cached_pages,
            computed_tokens,
            first_token: sampled.first_token,
            first_logprobs: sampled.first_logprobs,
            prompt_logprobs: sampled.prompt_logprobs,
        });
    }

    #[cfg_attr(not(feature = "planted-bugs"), allow(unused_variables))]
    fn on_router_abort(&mut self, key: TransferKey, reason: AbortReason, pool: &mut PagePool) {
        let transfer = self.transfers.get_mut(&key.transfer).expect("checked by the caller");
        if transfer.phase == Phase::Draining {
            return;
        }
        let prefill = transfer.prefill;
        self.send(prefill, Message::Abort { key, reason });
        self.end(key, reason);
        #[cfg(feature = "planted-bugs")]
        if crate::planted!(FreeWhileWriteLands) {
            // sgl#32564, sgl#35049: the abort frees the pages at once, writes still in flight.
            let pages = self.transfers[&key.transfer].reserved.iter().map(|p| (key, p.index()));
            self.planted.unrevoked.extend(pages);
            self.release(key.transfer, pool);
        }
    }

    fn on_prefill_abort(&mut self, key: TransferKey, reason: AbortReason, pool: &mut PagePool) {
        // The prefill side aborts only once its writes have drained.
        let transfer = &self.transfers[&key.transfer];
        let (prefill, phase) = (transfer.prefill, transfer.phase);
        if phase == Phase::AwaitingPrefill && self.fail_open(key, pool) {
            return;
        }
        if phase == Phase::AwaitingPrefill {
            self.end(key, reason);
        }
        self.send(prefill, Message::AbortAck { key });
        self.release(key.transfer, pool);
    }

    /// Records a newer incarnation of a peer; returns false for an envelope from an older one.
    /// A prefill worker that restarted gives up its transfers, which keep their pages until their
    /// lease ends: its writes may still be in flight.
    fn note_peer(&mut self, from: Endpoint, pool: &mut PagePool, _now: Time) -> bool {
        match self.peers.hear(from) {
            Heard::Stale => false,
            Heard::Known => true,
            Heard::Newer => {
                let gone: Vec<TransferKey> = self
                    .transfers
                    .values()
                    .filter(|t| {
                        t.prefill.worker == from.worker
                            && t.prefill.incarnation < from.incarnation
                            && t.phase == Phase::AwaitingPrefill
                    })
                    .map(|t| t.key)
                    .collect();
                for key in gone {
                    if !self.fail_open(key, pool) {
                        self.end(key, AbortReason::PeerRestarted);
                    }
                }
                true
            }
        }
    }

    /// The link to a prefill worker broke: its transfers end now and keep their pages until their
    /// lease runs out (a write sent before the break may still be landing).
    pub fn handle_peer_down(&mut self, worker: crate::wire::WorkerId) {
        let gone: Vec<TransferKey> = self
            .transfers
            .values()
            .filter(|t| t.prefill.worker == worker && t.phase == Phase::AwaitingPrefill)
            .map(|t| t.key)
            .collect();
        for key in gone {
            self.send_to_prefill(key, Message::Abort { key, reason: AbortReason::PeerRestarted });
            self.end(key, AbortReason::PeerRestarted);
        }
    }

    /// The terminal transition without KV: reported once, now; the pages stay until drained.
    fn end(&mut self, key: TransferKey, reason: AbortReason) {
        let transfer = self.transfers.get_mut(&key.transfer).expect("ending a live transfer");
        assert_eq!(transfer.phase, Phase::AwaitingPrefill, "transfer {key:?} ended twice");
        transfer.phase = Phase::Draining;
        self.changed.insert(key.transfer);
        let router = transfer.router;
        #[cfg(feature = "planted-bugs")]
        self.free_slot(key.transfer);
        self.send(router, Message::Outcome { key, failure: Some(reason) });
        self.remember(key, false);
        self.outputs.push_back(DecodeOutput::Ended { key, reason });
    }

    /// Lets go of a transfer's pages and forgets it. Only once no write can land.
    fn release(&mut self, id: TransferId, pool: &mut PagePool) {
        let transfer = self.transfers.remove(&id).expect("releasing a live transfer");
        #[cfg(feature = "planted-bugs")]
        if crate::planted!(PrematureRelease) || crate::planted!(LeaseShorterThanWrite) {
            // Both bugs lived where the whole pool is registered with the NIC (no per-transfer
            // fence): a write still in flight after the release lands in the page's next owner.
            let pages = transfer.reserved.iter().map(|p| (transfer.key, p.index()));
            self.planted.unrevoked.extend(pages);
        }
        debug_assert_eq!(transfer.phase, Phase::Draining, "released before its terminal output");
        self.leases.remove(&(transfer.lease_until, id));
        self.forgotten(id, &transfer);
        pool.unpin(transfer.pin).expect("a transfer's pin is released by the transfer alone");
        for page in transfer.cached.into_iter().chain(transfer.reserved) {
            pool.release(page).expect("a transfer's page reference is live");
        }
    }

    /// How long a reservation or a grant holds the pages: the lease the prefill side is told,
    /// plus the longest a write it issued inside that lease can take to land, so that the pages
    /// outlive every write.
    fn lease_span(&self) -> Duration {
        if crate::planted!(LeaseShorterThanWrite) {
            // A missing class: the lease alone, so a write issued at its end lands after it.
            return self.config.lease;
        }
        self.config.lease + self.config.write_flight_max
    }

    /// Bookkeeping of a transfer just removed: its references leave the count, and there is
    /// nothing left of it to check.
    fn forgotten(&mut self, id: TransferId, transfer: &Transfer) {
        #[cfg(feature = "planted-bugs")]
        self.free_slot(id);
        self.page_refs_held -= (transfer.cached.len() + transfer.reserved.len()) as u64;
        self.changed.remove(&id);
    }

    /// Planted FailOpen (sgl#30233, vllm#52234): a transfer whose prefill failed, restarted or
    /// went silent is taken as done: decode generates from its pages as they are, after the
    /// unwritten first-token slot (0), and answers 200. Always false without the plant.
    fn fail_open(&mut self, key: TransferKey, pool: &mut PagePool) -> bool {
        if !crate::planted!(FailOpen) {
            return false;
        }
        let pages = self.transfers[&key.transfer].reserved.len() as u32;
        self.on_done(key, Sampled::token(0), pages, pool);
        true
    }

    /// SlotReuse: the live transfer from `from` now holding the metadata slot an ended one had.
    #[cfg(feature = "planted-bugs")]
    fn slot_occupant(&self, ended: TransferKey, from: Endpoint) -> Option<TransferKey> {
        let slot = self.planted.slot_of.get(&ended.transfer)?;
        let holder = self.transfers.get(self.planted.slot_holder.get(slot)?)?;
        (holder.key != ended && holder.prefill == from && holder.phase == Phase::AwaitingPrefill)
            .then_some(holder.key)
    }

    /// SlotReuse: a transfer takes the lowest free metadata slot.
    #[cfg(feature = "planted-bugs")]
    fn take_slot(&mut self, id: TransferId) {
        let slot = (0..).find(|s| !self.planted.slot_holder.contains_key(s)).expect("a free slot");
        self.planted.slot_holder.insert(slot, id);
        if self.planted.slot_of.len() >= 4 * self.config.transfers_max as usize {
            self.planted.slot_of.pop_first();
        }
        self.planted.slot_of.insert(id, slot);
    }

    /// SlotReuse: the slot is freed when the transfer ends (the bug: before any late message of
    /// it can no longer arrive).
    #[cfg(feature = "planted-bugs")]
    fn free_slot(&mut self, id: TransferId) {
        if let Some(slot) = self.planted.slot_of.get(&id)
            && self.planted.slot_holder.get(slot) == Some(&id)
        {
            self.planted.slot_holder.remove(slot);
        }
    }

    fn remember(&mut self, key: TransferKey, completed: bool) {
        if self.ended.len() >= self.config.transfers_max as usize {
            self.ended.pop_front();
        }
        self.ended.push_back((key, completed));
    }

    fn send_to_prefill(&mut self, key: TransferKey, body: Message) {
        let prefill = self.transfers[&key.transfer].prefill;
        self.send(prefill, body);
    }

    fn send(&mut self, to: Endpoint, body: Message) {
        self.outputs.push_back(DecodeOutput::Send(Envelope { from: self.me, to, body }));
    }

    /// Every reserved page belongs to exactly one live transfer, is live in the pool, referenced
    /// and pinned at least until the lease ends; the lease index matches the transfers; bounds
    /// hold; the counts kept for the incremental check are right.
    pub fn check_invariants(&self, pool: &PagePool) -> Result<(), InvariantViolation> {
        self.check_counts()?;
        let mut owner: BTreeMap<u32, TransferId> = BTreeMap::new();
        for (&id, t) in &self.transfers {
            self.check_transfer(id, t, pool)?;
            for &page in &t.reserved {
                if let Some(other) = owner.insert(page.index(), id) {
                    return Err(InvariantViolation::new(
                        PD,
                        format!("page {} reserved by {other:?} and {id:?}", page.index()),
                    ));
                }
            }
        }
        ensure_invariant!(
            PD,
            self.ended.len() <= self.config.transfers_max as usize,
            "ended memory over its bound"
        );
        // After the checks of each transfer, so that a state broken by hand is reported by the
        // check about it rather than as a count off.
        let refs: u64 =
            self.transfers.values().map(|t| (t.cached.len() + t.reserved.len()) as u64).sum();
        ensure_invariant!(
            PD,
            refs == self.page_refs_held,
            "{} page references counted, the transfers hold {refs}",
            self.page_refs_held
        );
        if let Some(id) = self.changed.iter().find(|id| !self.transfers.contains_key(id)) {
            return Err(InvariantViolation::new(
                PD,
                format!("transfer {id:?} is noted as changed but is not live"),
            ));
        }
        Ok(())
    }

    /// The cheap check, for after every input; `check_invariants` is the full one.
    ///
    /// Checks every transfer an input changed since the last incremental check as the full
    /// check does (filed under its id and its lease, pages reserved, live, referenced and pinned
    /// in `pool`), then the counts: transfers within the bound, one lease per transfer, the
    /// earliest lease a live transfer's, the memory of ended transfers within its bound.
    /// O(pages of the transfers changed + log transfers), where the full check is O(pages of all
    /// transfers). Takes `&mut self` to consume the set of changed transfers. That no page is
    /// reserved by two transfers, and that the count of references (`page_refs_count`) is right,
    /// only the full check sees: run it at quiescence and every so many inputs.
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
                self.check_transfer(id, t, pool)?;
            }
        }
        self.check_counts()?;
        if let Some(&(until, id)) = self.leases.first() {
            let lease = self.transfers.get(&id).map(|t| t.lease_until);
            ensure_invariant!(
                PD,
                lease == Some(until),
                "the earliest lease ({until:?}, {id:?}) names a transfer leased until {lease:?}"
            );
        }
        ensure_invariant!(
            PD,
            self.ended.len() <= self.config.transfers_max as usize,
            "ended memory over its bound"
        );
        Ok(())
    }

    fn check_counts(&self) -> Result<(), InvariantViolation> {
        ensure_invariant!(
            PD,
            self.transfers.len() <= self.config.transfers_max as usize,
            "{} transfers over the bound",
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.leases.len() == self.transfers.len(),
            "{} leases for {} transfers",
            self.leases.len(),
            self.transfers.len()
        );
        Ok(())
    }

    /// One transfer's own invariants: see `check_invariants`.
    fn check_transfer(
        &self,
        id: TransferId,
        t: &Transfer,
        pool: &PagePool,
    ) -> Result<(), InvariantViolation> {
        ensure_invariant!(PD, t.key.transfer == id, "transfer {id:?} filed under another id");
        ensure_invariant!(
            PD,
            self.leases.contains(&(t.lease_until, id)),
            "transfer {id:?} missing from the lease index"
        );
        ensure_invariant!(
            PD,
            !t.reserved.is_empty(),
            "transfer {id:?} reserved no page: an empty hand-off"
        );
        for &page in t.reserved.iter().chain(&t.cached) {
            ensure_invariant!(
                PD,
                pool.is_live(page),
                "transfer {id:?} holds page {page:?}, which was freed or reused"
            );
            ensure_invariant!(
                PD,
                pool.refs(page).unwrap_or(0) >= 1,
                "transfer {id:?} holds page {page:?} without a reference"
            );
        }
        for &page in &t.reserved {
            ensure_invariant!(
                PD,
                pool.pin_count(page).unwrap_or(0) >= 1,
                "reserved page {page:?} of {id:?} is not pinned while a write may land"
            );
        }
        Ok(())
    }
}

const PD: &str = "pd-decode";

#[cfg(test)]
#[path = "decode_invariant_tests.rs"]
mod invariant_tests;
#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
