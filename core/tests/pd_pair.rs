//! The deterministic pair driver (after quinn-proto's `Pair`): the router, a prefill side and a
//! decode side in memory with a virtual clock, a network proptest reorders, drops and
//! duplicates, and a data plane whose one-sided writes land whenever proptest says within the
//! write flight bound, whatever the receiver's state. Workers restart, clients abort.
//!
//! Checked after every action: both sides' and both pools' invariants; every page the decode side
//! hands to its scheduler holds exactly the KV its transfer wrote, and still does when the
//! scheduler lets go of it (a late write of another transfer would change it); one terminal output
//! per transfer per side and one end per request at the router. Then the faults stop, and every
//! transfer must end within the bound, and every page come back.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::kv::{PagePool, PageRef, PoolConfig};
use lockstep_core::pd::{
    DecodeConfig, DecodeOutput, DecodeSide, PrefillConfig, PrefillOutput, PrefillSide, Router,
    RouterConfig, RouterOutput, Sampled,
};
use lockstep_core::sched::RequestId;
use lockstep_core::wire::{
    Endpoint, Envelope, Epoch, Incarnation, Message, PageSlot, RequestSpec, TransferId,
    TransferKey, WorkerId,
};
use proptest::prelude::*;

const PAGE_TOKENS: u32 = 4;
const LEASE_MS: u64 = 40;
const FLIGHT_MS: u64 = 10;
const DEADLINE_MS: u64 = 400;

#[derive(Clone, Debug)]
enum Action {
    NewRequest {
        prompt_len: u8,
    },
    Deliver(u8),
    Drop(u8),
    Duplicate(u8),
    Land(u8),
    FailWrite(u8),
    Compute(u8),
    ComputeFail(u8),
    /// The prefill worker computed a step of its prompts: its computing transfers live on.
    ComputeProgress,
    Abort(u8),
    ReleaseReady(u8),
    Advance(u8),
    RestartPrefill,
    RestartDecode,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => (1..20u8).prop_map(|prompt_len| Action::NewRequest { prompt_len }),
        10 => any::<u8>().prop_map(Action::Deliver),
        1 => any::<u8>().prop_map(Action::Drop),
        1 => any::<u8>().prop_map(Action::Duplicate),
        5 => any::<u8>().prop_map(Action::Land),
        1 => any::<u8>().prop_map(Action::FailWrite),
        3 => any::<u8>().prop_map(Action::Compute),
        1 => any::<u8>().prop_map(Action::ComputeFail),
        2 => Just(Action::ComputeProgress),
        1 => any::<u8>().prop_map(Action::Abort),
        2 => any::<u8>().prop_map(Action::ReleaseReady),
        3 => (1..30u8).prop_map(Action::Advance),
        1 => Just(Action::RestartPrefill),
        1 => Just(Action::RestartDecode),
    ]
}

/// What a decode page holds: which transfer's write of which ordinal landed there last.
type Tag = (TransferId, u32);

/// A request the decode scheduler holds: its pages, each with the tag it must keep (none for
/// pages that came from the prefix cache), and the decode incarnation that took it.
struct Held {
    key: TransferKey,
    pages: Vec<(PageRef, Option<Tag>)>,
    at: Endpoint,
}

struct Write {
    key: TransferKey,
    from: Endpoint,
    to: Endpoint,
    ordinal: u32,
    page: PageSlot,
    land_by: Time,
}

struct Pair {
    now: Time,
    router_at: Endpoint,
    router: Router,
    router_ends: BTreeMap<RequestId, u32>,
    router_decoding: std::collections::BTreeSet<RequestId>,
    prefill_at: Endpoint,
    decode_at: Endpoint,
    prefill: PrefillSide,
    decode: DecodeSide,
    prefill_pool: PagePool,
    decode_pool: PagePool,
    decode_memory: BTreeMap<u32, Tag>,
    network: VecDeque<Envelope>,
    writes: VecDeque<Write>,
    computations: VecDeque<(Endpoint, TransferKey, RequestSpec)>,
    /// The pages each transfer was told to write, from its `Prepare`.
    prepared: BTreeMap<TransferId, Vec<PageSlot>>,
    /// Requests the decode scheduler holds: their pages and the tags those must keep.
    ready: Vec<Held>,
    decode_terminals: BTreeMap<TransferKey, u32>,
    prefill_terminals: BTreeMap<(Incarnation, TransferKey), u32>,
    next_transfer: u64,
}

fn decode_config() -> DecodeConfig {
    DecodeConfig {
        lease: Duration::from_millis(LEASE_MS),
        write_flight_max: Duration::from_millis(FLIGHT_MS),
        transfers_max: 4,
        prefix_cache: true,
        live_report_interval: Duration::from_millis(DEADLINE_MS / 2),
    }
}

fn prefill_config() -> PrefillConfig {
    PrefillConfig {
        heartbeat_interval: Duration::from_millis(LEASE_MS / 4),
        write_flight_max: Duration::from_millis(FLIGHT_MS),
        transfer_deadline: Duration::from_millis(DEADLINE_MS),
        done_retransmit: Duration::from_millis(20),
        transfers_max: 4,
    }
}

fn pool(pages_total: u32) -> PagePool {
    PagePool::new(PoolConfig { pages_total, page_tokens: PAGE_TOKENS, pins_max: 64 }).unwrap()
}

fn pick<T>(items: &VecDeque<T>, i: u8) -> Option<usize> {
    (!items.is_empty()).then(|| usize::from(i) % items.len())
}

impl Pair {
    fn new() -> Pair {
        let prefill_at = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
        let decode_at = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
        Pair {
            now: Time::ZERO,
            router_at: Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) },
            router: Router::new(
                Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) },
                RouterConfig {
                    outcome_timeout: Duration::from_millis(DEADLINE_MS + LEASE_MS + 4 * FLIGHT_MS),
                    requests_max: 8,
                    retries_max: 1,
                    // This pair has no decode scheduler: nothing streams tokens.
                    decode_idle_timeout: Duration::from_secs(3600),
                    decode_slots: 8,
                    prefill_slots: 8,
                    queue_wait_max: Duration::from_millis(DEADLINE_MS * 4),
                    busy_backoff: Duration::from_millis(5),
                },
                vec![prefill_at],
                vec![decode_at],
            ),
            router_ends: BTreeMap::new(),
            router_decoding: std::collections::BTreeSet::new(),
            prefill_at,
            decode_at,
            prefill: PrefillSide::new(prefill_at, prefill_config()),
            decode: DecodeSide::new(decode_at, decode_config()),
            prefill_pool: pool(64),
            decode_pool: pool(12),
            decode_memory: BTreeMap::new(),
            network: VecDeque::new(),
            writes: VecDeque::new(),
            computations: VecDeque::new(),
            prepared: BTreeMap::new(),
            ready: Vec::new(),
            decode_terminals: BTreeMap::new(),
            prefill_terminals: BTreeMap::new(),
            next_transfer: 1,
        }
    }

    fn act(&mut self, action: Action) {
        match action {
            Action::NewRequest { prompt_len } => {
                // Prompts share prefixes, so the decode side's cache is exercised.
                let prompt = (0..u32::from(prompt_len)).map(|t| t % 7).collect();
                let request = RequestSpec::new(RequestId(self.next_transfer), prompt, 4);
                self.next_transfer += 1;
                let _ = self.router.submit(request, self.now);
                self.collect();
            }
            Action::Deliver(i) => {
                if let Some(i) = pick(&self.network, i) {
                    let envelope = self.network.remove(i).unwrap();
                    self.deliver(envelope);
                }
            }
            Action::Drop(i) => {
                if let Some(i) = pick(&self.network, i) {
                    self.network.remove(i);
                }
            }
            Action::Duplicate(i) => {
                if let Some(i) = pick(&self.network, i) {
                    let copy = self.network[i].clone();
                    self.network.push_back(copy);
                }
            }
            Action::Land(i) => {
                if let Some(i) = pick(&self.writes, i) {
                    self.finish_write(i, true);
                }
            }
            Action::FailWrite(i) => {
                if let Some(i) = pick(&self.writes, i) {
                    self.finish_write(i, false);
                }
            }
            Action::Compute(i) => {
                if let Some(i) = pick(&self.computations, i) {
                    self.compute(i, true);
                }
            }
            Action::ComputeFail(i) => {
                if let Some(i) = pick(&self.computations, i) {
                    self.compute(i, false);
                }
            }
            Action::ComputeProgress => self.prefill.handle_compute_progress(self.now),
            Action::Abort(i) => {
                let request = RequestId(u64::from(i) % self.next_transfer.max(1));
                let _ = self.router.abort(request, self.now);
                self.collect();
            }
            Action::ReleaseReady(i) => {
                if !self.ready.is_empty() {
                    let i = usize::from(i) % self.ready.len();
                    self.release_ready(i);
                }
            }
            Action::Advance(ms) => self.advance(Duration::from_millis(u64::from(ms))),
            Action::RestartPrefill => {
                // Its posted writes stay in flight and may still land: that is the point.
                self.prefill_at.incarnation.0 += 1;
                self.prefill = PrefillSide::new(self.prefill_at, prefill_config());
                self.prefill_pool = pool(64);
                self.computations.clear();
                self.router.handle_worker_restart(self.prefill_at, self.now);
                self.collect();
            }
            Action::RestartDecode => {
                self.decode_at.incarnation.0 += 1;
                self.decode = DecodeSide::new(self.decode_at, decode_config());
                self.decode_pool = pool(12);
                self.decode_memory.clear();
                self.ready.clear();
                self.prepared.clear();
                self.router.handle_worker_restart(self.decode_at, self.now);
                self.collect();
            }
        }
        self.check();
    }

    fn deliver(&mut self, envelope: Envelope) {
        if envelope.to.worker == self.decode_at.worker {
            self.decode.handle_envelope(envelope, &mut self.decode_pool, self.now);
        } else if envelope.to.worker == self.prefill_at.worker {
            self.prefill.handle_envelope(envelope, &mut self.prefill_pool, self.now);
        } else if envelope.to.worker == self.router_at.worker {
            self.router.handle_envelope(envelope, self.now);
        }
        self.collect();
    }

    /// A write lands (or fails) now. One addressed to an earlier life of the decode worker fails:
    /// its memory registration is gone (as an RDMA remote key is).
    fn finish_write(&mut self, i: usize, landed: bool) {
        let write = self.writes.remove(i).unwrap();
        let landed = landed && write.to == self.decode_at;
        if landed {
            // The page must still be the one the transfer reserved: freed or reused means the
            // write lands in free memory or in another request's KV.
            let page = PageRef::from_parts(write.page.index, write.page.generation);
            assert!(
                self.decode_pool.is_live(page),
                "{:?}: a write landed in page {page:?} after it was freed or reused",
                write.key
            );
            self.decode_memory.insert(write.page.index, (write.key.transfer, write.ordinal));
        }
        if write.from == self.prefill_at {
            self.prefill.handle_write_completion(
                write.key,
                write.ordinal,
                landed,
                &mut self.prefill_pool,
                self.now,
            );
            self.collect();
        }
    }

    fn compute(&mut self, i: usize, ok: bool) {
        let (at, key, request) = self.computations.remove(i).unwrap();
        if at != self.prefill_at {
            return;
        }
        if !ok {
            self.prefill.handle_compute_failed(key, &mut self.prefill_pool, self.now);
            self.collect();
            return;
        }
        let pages = request.prompt.len().div_ceil(PAGE_TOKENS as usize) as u32;
        let mut sources = Vec::new();
        self.prefill_pool.allocate_many(pages, &mut sources).unwrap();
        self.prefill.handle_computed(
            key,
            Sampled::token(42),
            &sources,
            &mut self.prefill_pool,
            self.now,
        );
        // The prefill scheduler finishes the request at once: only the transfer's pins hold them.
        for page in sources {
            self.prefill_pool.release(page).unwrap();
        }
        self.collect();
    }

    fn advance(&mut self, by: Duration) {
        let target = self.now.saturating_add(by);
        // Writes cannot outlive their flight: each lands by its deadline.
        loop {
            let due = self
                .writes
                .iter()
                .enumerate()
                .filter(|(_, w)| w.land_by <= target)
                .min_by_key(|(_, w)| w.land_by)
                .map(|(i, w)| (i, w.land_by));
            let Some((i, at)) = due else { break };
            self.now = self.now.max(at);
            self.timeouts();
            if i < self.writes.len() && self.writes[i].land_by == at {
                self.finish_write(i, true);
            }
        }
        self.now = target;
        self.timeouts();
    }

    fn timeouts(&mut self) {
        self.router.handle_timeout(self.now);
        self.decode.handle_timeout(&mut self.decode_pool, self.now);
        self.decode_pool.handle_timeout(self.now);
        self.prefill.handle_timeout(&mut self.prefill_pool, self.now);
        self.prefill_pool.handle_timeout(self.now);
        while self.decode_pool.poll_expired().is_some() {}
        while self.prefill_pool.poll_expired().is_some() {}
        self.collect();
    }

    fn release_ready(&mut self, i: usize) {
        let Held { key, pages, at } = self.ready.remove(i);
        if at != self.decode_at {
            return;
        }
        for (page, tag) in pages {
            if let Some(tag) = tag {
                assert_eq!(
                    self.decode_memory.get(&page.index()),
                    Some(&tag),
                    "{key:?}: page {page:?} was overwritten while the scheduler held it"
                );
            }
            self.decode_pool.release(page).unwrap();
        }
    }

    fn collect(&mut self) {
        while let Some(output) = self.router.poll_output() {
            match output {
                RouterOutput::Send(envelope) => self.network.push_back(envelope),
                RouterOutput::Decoding { request, .. } => {
                    *self.router_ends.entry(request).or_default() += 1;
                    self.router_decoding.insert(request);
                }
                // A decoding request's end (a client abort) ends the decoding, not the transfer.
                RouterOutput::Failed { request, .. } if self.router_decoding.remove(&request) => {}
                RouterOutput::Failed { request, .. } => {
                    *self.router_ends.entry(request).or_default() += 1;
                }
                RouterOutput::Tokens { request, .. } | RouterOutput::Finished { request, .. } => {
                    panic!("{request}: tokens in a pair with no decode scheduler")
                }
            }
        }
        while let Some(output) = self.decode.poll_output() {
            self.on_decode_output(output);
        }
        while let Some(output) = self.prefill.poll_output() {
            match output {
                PrefillOutput::Send(envelope) => self.network.push_back(envelope),
                PrefillOutput::Compute { key, request } => {
                    self.computations.push_back((self.prefill_at, key, request))
                }
                PrefillOutput::Cancel { key } => self.computations.retain(|(_, k, _)| *k != key),
                PrefillOutput::Write { key, to, ordinal, page, .. } => {
                    self.writes.push_back(Write {
                        key,
                        from: self.prefill_at,
                        to,
                        ordinal,
                        page,
                        land_by: self.now.saturating_add(Duration::from_millis(FLIGHT_MS)),
                    })
                }
                PrefillOutput::Ended { key, .. } => {
                    *self
                        .prefill_terminals
                        .entry((self.prefill_at.incarnation, key))
                        .or_default() += 1
                }
            }
        }
    }

    /// Takes one decode-side output: messages go on the network, and a hand-over to the
    /// scheduler is checked page by page against what its transfer wrote.
    fn on_decode_output(&mut self, output: DecodeOutput) {
        match output {
            DecodeOutput::Send(envelope) => {
                if let Message::Prepare { key, pages, .. } = &envelope.body {
                    self.prepared.insert(key.transfer, pages.clone());
                }
                self.network.push_back(envelope);
            }
            DecodeOutput::Ready { key, router, pages, .. } => {
                *self.decode_terminals.entry(key).or_default() += 1;
                // This driver's scheduler always accepts: success goes to the router now.
                self.network.push_back(Envelope {
                    from: self.decode_at,
                    to: router,
                    body: Message::Outcome { key, failure: None },
                });
                // Fail closed: every page the transfer was told to write holds its write.
                let written = &self.prepared[&key.transfer];
                let cached = pages.len() - written.len();
                for (ordinal, slot) in written.iter().enumerate() {
                    let landed = self.decode_memory.get(&slot.index);
                    assert_eq!(
                        landed,
                        Some(&(key.transfer, ordinal as u32)),
                        "{key:?}: decoding from page {} that holds {landed:?}",
                        slot.index
                    );
                }
                let tags = pages
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (*p, (i >= cached).then(|| (key.transfer, (i - cached) as u32))))
                    .collect();
                self.ready.push(Held { key, pages: tags, at: self.decode_at });
            }
            DecodeOutput::Ended { key, .. } => *self.decode_terminals.entry(key).or_default() += 1,
        }
    }

    fn check(&mut self) {
        // The incremental checks first: they must pass wherever the full ones do.
        let incremental = |r: Result<(), lockstep_core::InvariantViolation>| {
            r.unwrap_or_else(|e| panic!("incremental check: {e}"))
        };
        incremental(self.router.check_invariants_incremental());
        incremental(self.decode.check_invariants_incremental(&self.decode_pool));
        incremental(self.prefill.check_invariants_incremental(&self.prefill_pool));
        incremental(self.decode_pool.check_invariants_incremental());
        incremental(self.prefill_pool.check_invariants_incremental());
        self.router.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        for (request, count) in &self.router_ends {
            assert_eq!(*count, 1, "router: {request} ended {count} times");
        }
        self.decode.check_invariants(&self.decode_pool).unwrap_or_else(|e| panic!("{e}"));
        self.prefill.check_invariants(&self.prefill_pool).unwrap_or_else(|e| panic!("{e}"));
        self.decode_pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        self.prefill_pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        for (key, count) in &self.decode_terminals {
            assert_eq!(*count, 1, "decode side: {key:?} ended {count} times");
        }
        for (key, count) in &self.prefill_terminals {
            assert_eq!(*count, 1, "prefill side: {key:?} ended {count} times");
        }
    }

    /// No more faults: everything is delivered, every write lands, every computation finishes.
    /// Within the bound every transfer ends on both sides and every page comes back.
    fn heal(&mut self) {
        let bound = self
            .now
            .saturating_add(Duration::from_millis(DEADLINE_MS + LEASE_MS + 4 * FLIGHT_MS + 100));
        while self.now <= bound {
            while let Some(envelope) = self.network.pop_front() {
                self.deliver(envelope);
            }
            while !self.writes.is_empty() {
                self.finish_write(0, true);
            }
            while !self.computations.is_empty() {
                self.compute(0, true);
            }
            self.check();
            if self.decode.transfers_live() == 0
                && self.prefill.transfers_live() == 0
                && self.network.is_empty()
                && self.writes.is_empty()
            {
                break;
            }
            self.advance(Duration::from_millis(5));
        }
        assert_eq!(
            (self.decode.transfers_live(), self.prefill.transfers_live()),
            (0, 0),
            "transfers still live once healed"
        );
        while !self.ready.is_empty() {
            self.release_ready(0);
        }
        self.check();
        assert_eq!(self.decode_pool.held_count(), 0, "decode pages leaked");
        assert_eq!(self.prefill_pool.held_count(), 0, "prefill pages leaked");
        assert_eq!(
            (self.decode_pool.pins_live_count(), self.prefill_pool.pins_live_count()),
            (0, 0),
            "pins leaked"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { max_shrink_iters: 4096, ..ProptestConfig::default() })]
    #[test]
    fn transfers_survive_reordering_loss_duplication_restarts_and_aborts(actions in prop::collection::vec(action(), 1..300)) {
        let mut pair = Pair::new();
        for action in actions {
            pair.act(action);
        }
        pair.heal();
    }
}

/// The happy path through the whole pair, so the driver itself is shown to move KV end to end.
#[test]
fn a_transfer_completes_end_to_end() {
    let mut pair = Pair::new();
    pair.act(Action::NewRequest { prompt_len: 10 });
    pair.heal();
    assert_eq!(pair.decode_terminals.len(), 1);
    let completed = pair.decode_terminals.keys().next().copied().unwrap();
    assert!(pair.prepared.contains_key(&completed.transfer));
}

// --- The oracle's checks fire on a hand-broken run. ---

fn reserved_pair() -> (Pair, TransferKey) {
    let mut pair = Pair::new();
    pair.act(Action::NewRequest { prompt_len: 10 });
    pair.act(Action::Deliver(0)); // Reserve reaches the decode side; Prepare goes out
    let key = TransferKey { transfer: *pair.prepared.keys().next().unwrap(), epoch: Epoch(0) };
    (pair, key)
}

/// Fail open (sglang#30233): a hand-over before the writes landed is caught page by page.
#[test]
#[should_panic(expected = "decoding from page")]
fn the_oracle_catches_decoding_from_unwritten_pages() {
    let (mut pair, key) = reserved_pair();
    let pages = pair.prepared[&key.transfer]
        .iter()
        .map(|s| PageRef::from_parts(s.index, s.generation))
        .collect();
    pair.on_decode_output(DecodeOutput::Ready {
        key,
        router: pair.router_at,
        request: spec(1, 10),
        pages,
        cached_pages: 0,
        computed_tokens: 10,
        first_token: 1,
        first_logprobs: None,
        prompt_logprobs: vec![],
    });
}

/// Free while a write lands (sglang#32564): a write landing in a page that was reused since it
/// was reserved (its generation moved on) is caught on landing.
#[test]
#[should_panic(expected = "after it was freed or reused")]
fn the_oracle_catches_a_write_landing_in_a_freed_page() {
    let (mut pair, key) = reserved_pair();
    let slot = pair.prepared[&key.transfer][0];
    pair.writes.push_back(Write {
        key,
        from: pair.prefill_at,
        to: pair.decode_at,
        ordinal: 0,
        page: PageSlot { index: slot.index, generation: slot.generation + 1 },
        land_by: Time::MAX,
    });
    pair.finish_write(0, true);
}

fn spec(id: u64, prompt_len: u32) -> RequestSpec {
    RequestSpec::new(RequestId(id), (0..prompt_len).collect(), 4)
}
