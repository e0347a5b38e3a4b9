//! The router's side of the transfer protocol: pairs a prefill and a decode worker for each
//! request, allocates transfer ids that are never reused, retries a failed transfer as a new one,
//! and ends every request exactly once: decoding, or failed with a reason.
//!
//! Per request: `Reserving → (Decoding | Failed)`, with retries as fresh transfers in between;
//! then `Decoding → (Finished | Failed)`: the decode worker streams the request's tokens
//! (`Message::Tokens`, numbered), and the router passes them on in order, cancels the decoding
//! when the client goes away, and fails the request when the stream breaks (a gap, silence past
//! `decode_idle_timeout`, the worker lost or restarted). Tokens of any transfer of the request
//! other than the one it follows are answered with `Cancel`: a request whose success message was
//! lost and that was retried elsewhere is never decoded twice for the client.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::model::TokenLogprobs;
use crate::sched::{FinishReason, RequestId};
use crate::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Message, RequestSpec, TransferId, TransferKey, WorkerId,
};

use self::index::{Index, Times};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterConfig {
    /// How long a transfer may go without an `Outcome` or a `TransferLive` before the router
    /// gives up on it. Longer than the prefill side's deadline plus the decode side's interval
    /// between reports, so the router does not give up on a transfer the workers are still
    /// finishing.
    pub outcome_timeout: Duration,
    /// Requests in transfer at once; a submit beyond it is refused.
    pub requests_max: u32,
    /// Fresh transfers tried after the first fails.
    pub retries_max: u32,
    /// How long a decoding request may go without a `Tokens` message before the router gives up
    /// on it. Longer than any stall a healthy decode worker has (a long queue, preemption).
    pub decode_idle_timeout: Duration,
    /// Requests each decode worker takes at once (its batch slots): beyond it, requests wait at
    /// the router rather than be refused by the worker.
    pub decode_slots: u32,
    /// Transfers each prefill worker computes at once. A prefill worker shares its steps among
    /// the prompts it holds, so more at once only makes each take longer: requests beyond it wait
    /// here, where their deadline is `queue_wait_max`, not in a transfer's.
    pub prefill_slots: u32,
    /// How long a request may wait at the router for workers with room.
    pub queue_wait_max: Duration,
    /// How long a request refused by a busy worker waits before it is sent again.
    pub busy_backoff: Duration,
}

/// What the router asks its driver to do. Drained with `poll_output` after every input.
/// What a `Tokens` message brings, as `on_tokens` takes it.
struct Stream {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    prompt_logprobs: Vec<TokenLogprobs>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RouterOutput {
    Send(Envelope),
    /// The request's KV is on `decode`, which now generates its tokens.
    Decoding {
        request: RequestId,
        key: TransferKey,
        decode: Endpoint,
    },
    /// The next output tokens of a decoding request, in order, each once, with their
    /// log-probabilities when the request asked for them (else empty; else one per token).
    Tokens {
        request: RequestId,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        /// With a request's first tokens, if it asked: its prompt's tokens' log-probabilities
        /// from the second on, which go out ahead of the tokens. Else empty.
        prompt_logprobs: Vec<TokenLogprobs>,
    },
    /// The decoding request ended; nothing about it follows.
    Finished {
        request: RequestId,
        reason: FinishReason,
    },
    /// The request could not be handed to a decode worker, or its decoding broke off (after
    /// `Decoding` and perhaps some `Tokens`). Nothing about it follows.
    Failed {
        request: RequestId,
        reason: AbortReason,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterError {
    /// `requests_max` requests are in transfer or decoding: try later (HTTP 429/503).
    Busy,
    /// A request with this id is in transfer or decoding.
    DuplicateRequest(RequestId),
    /// No prefill or no decode worker is configured.
    NoWorkers,
    /// No such request: never submitted, or already ended.
    UnknownRequest(RequestId),
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouterError::Busy => write!(f, "too many requests in transfer"),
            RouterError::DuplicateRequest(id) => write!(f, "request {id} is already in transfer"),
            RouterError::NoWorkers => write!(f, "no prefill or decode worker"),
            RouterError::UnknownRequest(id) => write!(f, "request {id} is not in flight"),
        }
    }
}

impl std::error::Error for RouterError {}

#[derive(Clone, Debug)]
struct Transfer {
    key: TransferKey,
    request: RequestSpec,
    prefill: Endpoint,
    decode: Endpoint,
    deadline: Time,
    attempt: u32,
    /// Its queue deadline, kept for a busy refusal: that sends it back to the queue without
    /// using an attempt, so only this deadline bounds how often it may be refused.
    queue_deadline: Time,
}

/// A request waiting at the router for a decode worker with room.
#[derive(Clone, Debug)]
struct Queued {
    request: RequestSpec,
    attempt: u32,
    /// Not sent before then (a busy worker's back-off).
    not_before: Time,
    /// Fails if still waiting then.
    deadline: Time,
}

/// A request whose KV is on a decode worker, which streams its tokens.
#[derive(Clone, Debug)]
struct Decoding {
    key: TransferKey,
    decode: Endpoint,
    /// Index of the next output token expected.
    next_index: u32,
    /// When the stream counts as broken unless a `Tokens` message comes first.
    idle_deadline: Time,
}

#[derive(Clone, Debug)]
pub struct Router {
    me: Endpoint,
    config: RouterConfig,
    prefills: Vec<Endpoint>,
    decodes: Vec<Endpoint>,
    /// Requests each worker that came up said it takes at once (`Hello`'s `places`): the router
    /// sends it no more than that or the config's slots for its role, whichever is fewer.
    /// Workers given to `new` take the config's.
    places: BTreeMap<WorkerId, u32>,
    next_transfer: u64,
    transfers: BTreeMap<TransferId, Transfer>,
    by_request: BTreeMap<RequestId, TransferId>,
    deadlines: BTreeSet<(Time, TransferId)>,
    decoding: BTreeMap<RequestId, Decoding>,
    idle_deadlines: BTreeSet<(Time, RequestId)>,
    /// In arrival order; bounded with the rest by `requests_max`.
    queue: VecDeque<Queued>,
    outputs: VecDeque<RouterOutput>,
    /// Indexes kept in step with the above (`router/index.rs`), so that choosing a worker and
    /// finding the next timer cost O(workers + log requests), not a scan of every request.
    index: Index,
}

impl Router {
    /// Transfer ids of one router incarnation start at `first_id`: its incarnation's low 24 bits
    /// above 40 bits of count, so a restarted router (a higher incarnation) starts above its
    /// predecessors, until the 24 bits wrap (with millisecond incarnations, every 4.6 hours; a
    /// reused id is then refused by a worker that still holds it, and retried as another).
    const ID_BITS: u32 = 40;

    fn first_id(incarnation: crate::wire::Incarnation) -> u64 {
        if crate::planted!(RouterIdsReusedAfterRestart) {
            return 0;
        }
        (incarnation.0 & ((1 << (64 - Self::ID_BITS)) - 1)) << Self::ID_BITS
    }

    pub fn new(
        me: Endpoint,
        config: RouterConfig,
        prefills: Vec<Endpoint>,
        decodes: Vec<Endpoint>,
    ) -> Router {
        let index = Index::new(config.requests_max as usize);
        Router {
            next_transfer: Self::first_id(me.incarnation),
            me,
            config,
            prefills,
            decodes,
            places: BTreeMap::new(),
            transfers: BTreeMap::new(),
            by_request: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            decoding: BTreeMap::new(),
            idle_deadlines: BTreeSet::new(),
            queue: VecDeque::new(),
            outputs: VecDeque::new(),
            index,
        }
    }

    pub fn requests_in_transfer(&self) -> usize {
        self.by_request.len()
    }

    pub fn requests_decoding(&self) -> usize {
        self.decoding.len()
    }

    /// Requests waiting at the router for a decode worker with room.
    pub fn requests_queued(&self) -> usize {
        self.queue.len()
    }

    /// The transfer a request in transfer is in now.
    pub fn transfer_of(&self, request: RequestId) -> Option<TransferKey> {
        self.by_request.get(&request).map(|id| self.transfers[id].key)
    }

    pub fn poll_output(&mut self) -> Option<RouterOutput> {
        self.outputs.pop_front()
    }

    pub fn next_timeout(&self) -> Option<Time> {
        let transfer = self.deadlines.first().map(|(t, _)| *t);
        let idle = self.idle_deadlines.first().map(|(t, _)| *t);
        // A queued request is due at its deadline, or when its back-off ends if a worker has
        // room then (else it waits for an end, which is an input, not a timer).
        let deadline = self.index.queue_deadlines.first();
        let queued = if self.has_room() {
            Time::earliest(self.index.queue_not_before.first(), deadline)
        } else {
            deadline
        };
        [transfer, idle, queued].into_iter().flatten().min()
    }

    /// Starts moving a request's KV to a decode worker.
    /// Accepts a request: it goes to a prefill and a decode worker now if a decode worker has
    /// room, else it waits here (`requests_queued`).
    pub fn submit(&mut self, request: RequestSpec, now: Time) -> Result<(), RouterError> {
        if self.by_request.contains_key(&request.id)
            || self.decoding.contains_key(&request.id)
            || self.index.queued.contains(&request.id)
        {
            return Err(RouterError::DuplicateRequest(request.id));
        }
        if self.requests_held() >= self.config.requests_max as usize {
            return Err(RouterError::Busy);
        }
        if self.prefills.is_empty() || self.decodes.is_empty() {
            return Err(RouterError::NoWorkers);
        }
        let deadline = now.saturating_add(self.config.queue_wait_max);
        self.enqueue(Queued { request, attempt: 0, not_before: now, deadline });
        self.pump(now);
        Ok(())
    }

    fn requests_held(&self) -> usize {
        self.by_request.len() + self.decoding.len() + self.queue.len()
    }

    /// Starts queued requests in queue order (lowest priority value first, then oldest) while a
    /// decode worker has room; fails those that
    /// waited too long, and all of them when no prefill or no decode worker is up.
    fn pump(&mut self, now: Time) {
        if self.prefills.is_empty() || self.decodes.is_empty() {
            // Nothing can move them, and `submit` refuses while it is so: what waits fails now
            // rather than at its deadline.
            while !self.queue.is_empty() {
                let q = self.dequeue(0);
                let reason = AbortReason::PeerRestarted;
                self.outputs.push_back(RouterOutput::Failed { request: q.request.id, reason });
            }
        }
        // The index says whether any is due before the queue is scanned for which, in order.
        while self.index.queue_deadlines.first().is_some_and(|t| t <= now) {
            let at = self.queue.iter().position(|q| q.deadline <= now).expect("indexed as due");
            let q = self.dequeue(at);
            let reason = AbortReason::QueueTimeout;
            self.outputs.push_back(RouterOutput::Failed { request: q.request.id, reason });
        }
        while self.index.queue_not_before.first().is_some_and(|t| t <= now) && self.has_room() {
            let at = self.queue.iter().position(|q| q.not_before <= now).expect("indexed as due");
            let q = self.dequeue(at);
            self.start(q, now);
        }
    }

    fn has_room(&self) -> bool {
        self.prefill_with_room(0).is_some() && self.decode_with_room(0).is_some()
    }

    /// Puts a request into the queue after every request of its priority or a lower value, so
    /// the queue runs by priority, then by when each was queued (a retry queues anew), as the
    /// workers' schedulers admit. With every priority 0 that is the end of the queue.
    fn enqueue(&mut self, q: Queued) {
        self.index.enqueued(&q);
        let at = self.queue.partition_point(|o| o.request.priority <= q.request.priority);
        self.queue.insert(at, q);
    }

    /// Takes the request at `at` out of the queue.
    fn dequeue(&mut self, at: usize) -> Queued {
        let q = self.queue.remove(at).expect("dequeuing a queued request");
        self.index.dequeued(&q);
        q
    }

    /// Transfers whose KV this prefill worker computes. O(log workers).
    fn prefill_load(&self, worker: &Endpoint) -> usize {
        self.index.prefill_load(worker.worker)
    }

    /// The least loaded prefill worker below its slots (`prefill_slots`, or its places if fewer);
    /// ties go to the lowest in the list, rotated by the attempt number so that a retry prefers
    /// another worker.
    fn prefill_with_room(&self, attempt: u32) -> Option<Endpoint> {
        let n = self.prefills.len();
        (0..n)
            .map(|i| self.prefills[(i + attempt as usize) % n])
            .filter(|w| self.prefill_load(w) < self.slots(w, self.config.prefill_slots))
            .min_by_key(|w| self.prefill_load(w))
    }

    /// What `worker` takes at once: `configured`, or fewer if it said so.
    fn slots(&self, worker: &Endpoint, configured: u32) -> usize {
        self.places.get(&worker.worker).map_or(configured, |&p| p.min(configured)) as usize
    }

    /// A decode worker's load: what it receives and what it decodes. O(log workers).
    fn decode_load(&self, worker: &Endpoint) -> usize {
        self.index.decode_load(worker.worker)
    }

    /// The least loaded decode worker below its slots (`decode_slots`, or its places if fewer);
    /// ties as `prefill_with_room`'s.
    fn decode_with_room(&self, attempt: u32) -> Option<Endpoint> {
        let n = self.decodes.len();
        (0..n)
            .map(|i| self.decodes[(i + attempt as usize) % n])
            .filter(|w| self.decode_load(w) < self.slots(w, self.config.decode_slots))
            .min_by_key(|w| self.decode_load(w))
    }

    /// The client went away: the request fails now, and the decode side is told to let go.
    pub fn abort(&mut self, request: RequestId, now: Time) -> Result<(), RouterError> {
        if self.index.queued.contains(&request) {
            let at = self.queue.iter().position(|q| q.request.id == request).expect("queued");
            self.dequeue(at);
            self.outputs.push_back(RouterOutput::Failed { request, reason: AbortReason::Client });
            return Ok(());
        }
        if let Some(d) = self.forget_decoding(request) {
            self.pump(now);
            self.send(d.decode, Message::Cancel { key: d.key, request });
            self.outputs.push_back(RouterOutput::Failed { request, reason: AbortReason::Client });
            return Ok(());
        }
        let Some(&id) = self.by_request.get(&request) else {
            return Err(RouterError::UnknownRequest(request));
        };
        let t = self.forget(id);
        self.send(t.decode, Message::Abort { key: t.key, reason: AbortReason::Client });
        self.outputs.push_back(RouterOutput::Failed { request, reason: AbortReason::Client });
        self.pump(now);
        Ok(())
    }

    /// A worker came back as a new incarnation: address it so from now on, and retry what its old
    /// life held.
    pub fn handle_worker_restart(&mut self, worker: Endpoint, now: Time) {
        for list in [&mut self.prefills, &mut self.decodes] {
            for known in list
                .iter_mut()
                .filter(|k| k.worker == worker.worker && k.incarnation < worker.incarnation)
            {
                *known = worker;
            }
        }
        let lost: Vec<TransferId> = self
            .transfers
            .values()
            .filter(|t| {
                (t.decode.worker == worker.worker && t.decode.incarnation < worker.incarnation)
                    || (t.prefill.worker == worker.worker
                        && t.prefill.incarnation < worker.incarnation)
            })
            .map(|t| t.key.transfer)
            .collect();
        for id in lost {
            self.fail_or_retry(id, AbortReason::PeerRestarted, now);
        }
        self.fail_decoding_on(
            |d| d.worker == worker.worker && d.incarnation < worker.incarnation,
            AbortReason::PeerRestarted,
        );
        self.pump(now);
    }

    /// A link to a worker opened: it is paired from now on, taking at most `places` requests at
    /// once (its `Hello`'s). A newer incarnation of a known worker is a restart
    /// (`handle_worker_restart`), whose places may differ. Workers are kept in id order, so
    /// pairing does not depend on the order links came up in.
    pub fn handle_worker_up(
        &mut self,
        worker: Endpoint,
        role: crate::wire::Role,
        places: u32,
        now: Time,
    ) {
        let known =
            self.prefills.iter().chain(&self.decodes).find(|w| w.worker == worker.worker).copied();
        match known {
            Some(k) if k.incarnation < worker.incarnation => {
                self.places.insert(worker.worker, places);
                self.handle_worker_restart(worker, now)
            }
            Some(_) => {}
            None => {
                let list = match role {
                    crate::wire::Role::Prefill => &mut self.prefills,
                    crate::wire::Role::Decode => &mut self.decodes,
                    crate::wire::Role::Router => return,
                };
                let at = list.partition_point(|w| w.worker < worker.worker);
                list.insert(at, worker);
                self.places.insert(worker.worker, places);
            }
        }
        self.pump(now);
    }

    /// This router's life: its worker id and incarnation.
    pub fn me(&self) -> Endpoint {
        self.me
    }

    /// The paired workers: prefill, then decode.
    pub fn workers(&self) -> (&[Endpoint], &[Endpoint]) {
        (&self.prefills, &self.decodes)
    }

    /// The link to a worker broke (its transport gave up on it): what was on the way through it
    /// is lost. Transfers that involve it are retried elsewhere or fail; requests decoding there
    /// fail, since their streams have a hole.
    /// The worker is no longer paired until it comes up again (`handle_worker_up`).
    pub fn handle_worker_down(&mut self, worker: crate::wire::WorkerId, now: Time) {
        self.prefills.retain(|w| w.worker != worker);
        self.decodes.retain(|w| w.worker != worker);
        self.places.remove(&worker);
        let lost: Vec<TransferId> = self
            .transfers
            .values()
            .filter(|t| t.decode.worker == worker || t.prefill.worker == worker)
            .map(|t| t.key.transfer)
            .collect();
        for id in lost {
            let (decode, key) = (self.transfers[&id].decode, self.transfers[&id].key);
            if decode.worker != worker {
                self.send(decode, Message::Abort { key, reason: AbortReason::Router });
            }
            self.fail_or_retry(id, AbortReason::PeerRestarted, now);
        }
        self.fail_decoding_on(|d| d.worker == worker, AbortReason::PeerRestarted);
        self.pump(now);
    }

    fn fail_decoding_on(&mut self, on: impl Fn(Endpoint) -> bool, reason: AbortReason) {
        let lost: Vec<RequestId> =
            self.decoding.iter().filter(|(_, d)| on(d.decode)).map(|(&r, _)| r).collect();
        for request in lost {
            let d = self.forget_decoding(request).expect("listed above");
            self.send(d.decode, Message::Cancel { key: d.key, request });
            self.outputs.push_back(RouterOutput::Failed { request, reason });
        }
    }

    pub fn handle_envelope(&mut self, envelope: Envelope, now: Time) {
        if envelope.to != self.me {
            return;
        }
        let from = envelope.from;
        match envelope.body {
            Message::Outcome { key, failure } => {
                let Some(t) = self.transfers.get(&key.transfer) else {
                    if crate::planted!(AbortRacesCompletion)
                        && failure.is_none()
                        && !self.decoding.values().any(|d| d.key == key)
                    {
                        // vllm#25067: an abort raced the transfer's completion; the completion
                        // finds its request gone and asserts it is in flight: a crash.
                        panic!("transfer {key:?} completed, but its request is not in flight");
                    }
                    return;
                };
                if t.key != key || t.decode != from {
                    return;
                }
                match failure {
                    None => self.start_decoding(key, now),
                    Some(reason) => self.fail_or_retry(key.transfer, reason, now),
                }
            }
            Message::Tokens { key, request, index, tokens, logprobs, prompt_logprobs, finish } => {
                let stream = Stream { tokens, logprobs, prompt_logprobs };
                self.on_tokens(from, key, request, index, stream, finish, now)
            }
            Message::TransferLive { key } => self.on_transfer_live(from, key, now),
            _ => {}
        }
    }

    /// The transfer's workers are still at it (the prefill side computing or writing): its
    /// outcome timeout counts from now. Never shortened; a stale or foreign report is ignored.
    fn on_transfer_live(&mut self, from: Endpoint, key: TransferKey, now: Time) {
        let Some(t) = self.transfers.get_mut(&key.transfer) else { return };
        let deadline = now.saturating_add(self.config.outcome_timeout);
        if t.key != key || t.decode != from || deadline <= t.deadline {
            return;
        }
        self.deadlines.remove(&(t.deadline, key.transfer));
        self.deadlines.insert((deadline, key.transfer));
        t.deadline = deadline;
        let request = t.request.id;
        self.index.changed(request);
    }

    fn start_decoding(&mut self, key: TransferKey, now: Time) {
        let t = self.forget(key.transfer);
        let request = t.request.id;
        let idle_deadline = now.saturating_add(self.config.decode_idle_timeout);
        self.decoding
            .insert(request, Decoding { key, decode: t.decode, next_index: 0, idle_deadline });
        self.idle_deadlines.insert((idle_deadline, request));
        self.index.decoding_started(request, t.decode.worker);
        self.outputs.push_back(RouterOutput::Decoding { request, key, decode: t.decode });
        // Its prefill worker has room again.
        self.pump(now);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_tokens(
        &mut self,
        from: Endpoint,
        key: TransferKey,
        request: RequestId,
        index: u32,
        Stream { tokens, logprobs, prompt_logprobs }: Stream,
        finish: Option<FinishReason>,
        now: Time,
    ) {
        // Tokens before the transfer's success: its `Outcome` was lost or overtaken. The stream
        // is as good a proof that the decode worker took the request.
        let current = self.by_request.get(&request).map(|id| &self.transfers[id]);
        if current.is_some_and(|t| t.key == key && t.decode == from) {
            self.start_decoding(key, now);
        }
        let Some(d) = self.decoding.get_mut(&request).filter(|d| d.key == key && d.decode == from)
        else {
            // Another attempt of the request, or one that ended here: that worker stops.
            if finish.is_none() {
                self.send(from, Message::Cancel { key, request });
            }
            return;
        };
        let end = index.checked_add(tokens.len() as u32);
        if index > d.next_index || end.is_none() {
            // A hole: a message was lost with a broken link. Never pass on a stream with a gap.
            let d = self.forget_decoding(request).expect("looked up above");
            self.send(d.decode, Message::Cancel { key, request });
            let reason = AbortReason::Router;
            self.outputs.push_back(RouterOutput::Failed { request, reason });
            self.pump(now);
            return;
        }
        // Tokens already passed on (a duplicate) are skipped.
        // (A late copy may be wholly covered by what passed since.)
        let seen = ((d.next_index - index) as usize).min(tokens.len());
        let fresh = tokens[seen..].to_vec();
        // Empty, or one per token (the codec holds every message to that).
        let fresh_logprobs = logprobs.get(seen..).map_or_else(Vec::new, <[_]>::to_vec);
        // The prompt's scores come with index 0 (the codec holds every message to that): a
        // copy of what passed brings them again, and they stay behind.
        let prompt_logprobs = if index == d.next_index { prompt_logprobs } else { Vec::new() };
        d.next_index += fresh.len() as u32;
        self.idle_deadlines.remove(&(d.idle_deadline, request));
        d.idle_deadline = now.saturating_add(self.config.decode_idle_timeout);
        self.idle_deadlines.insert((d.idle_deadline, request));
        self.index.changed(request);
        if !fresh.is_empty() {
            let (tokens, logprobs) = (fresh, fresh_logprobs);
            let output = RouterOutput::Tokens { request, tokens, logprobs, prompt_logprobs };
            self.outputs.push_back(output);
        }
        if let Some(reason) = finish {
            self.forget_decoding(request);
            self.outputs.push_back(RouterOutput::Finished { request, reason });
            self.pump(now);
        }
    }

    fn forget_decoding(&mut self, request: RequestId) -> Option<Decoding> {
        let d = self.decoding.remove(&request)?;
        self.idle_deadlines.remove(&(d.idle_deadline, request));
        self.index.decoding_ended(request, d.decode.worker);
        Some(d)
    }

    /// Gives up on transfers that heard no `Outcome` in time: the decode side is told to let go
    /// (its own lease would end it anyway), and the request is retried or fails.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            let (decode, key) = {
                let t = &self.transfers[&id];
                (t.decode, t.key)
            };
            self.send(decode, Message::Abort { key, reason: AbortReason::Router });
            self.fail_or_retry(id, AbortReason::Timeout, now);
        }
        while let Some(&(deadline, request)) = self.idle_deadlines.first() {
            if deadline > now {
                break;
            }
            let d =
                self.forget_decoding(request).expect("an idle deadline names a decoding request");
            self.send(d.decode, Message::Cancel { key: d.key, request });
            let reason = AbortReason::Timeout;
            self.outputs.push_back(RouterOutput::Failed { request, reason });
        }
        self.pump(now);
    }

    fn start(&mut self, queued: Queued, now: Time) -> TransferKey {
        let Queued { request, attempt, deadline: queue_deadline, .. } = queued;
        let key = TransferKey { transfer: TransferId(self.next_transfer), epoch: Epoch(attempt) };
        self.next_transfer += 1;
        // `pump` starts a request only when both roles have room, whatever the attempt's order.
        let prefill = self.prefill_with_room(attempt).expect("a prefill worker with room");
        let decode = self.decode_with_room(attempt).expect("a decode worker with room");
        let deadline = now.saturating_add(self.config.outcome_timeout);
        self.send(decode, Message::Reserve { key, request: request.clone(), prefill });
        self.by_request.insert(request.id, key.transfer);
        self.deadlines.insert((deadline, key.transfer));
        self.index.transfer_started(request.id, prefill.worker, decode.worker);
        let transfer =
            Transfer { key, request, prefill, decode, deadline, attempt, queue_deadline };
        self.transfers.insert(key.transfer, transfer);
        key
    }

    fn fail_or_retry(&mut self, id: TransferId, reason: AbortReason, now: Time) {
        let t = self.forget(id);
        if matches!(reason, AbortReason::DecodeBusy | AbortReason::PrefillBusy) {
            // Not a failure of the request: it waits (within the deadline it was queued with) and
            // goes again after a back-off, once a worker has room. The attempt is not used up.
            let not_before = now.saturating_add(self.config.busy_backoff).min(t.queue_deadline);
            let (request, attempt, deadline) = (t.request, t.attempt, t.queue_deadline);
            self.enqueue(Queued { request, attempt, not_before, deadline });
        } else if t.attempt < self.config.retries_max && reason != AbortReason::Client {
            // A new attempt, bounded by `retries_max`, waits anew.
            let (request, attempt) = (t.request, t.attempt + 1);
            let deadline = now.saturating_add(self.config.queue_wait_max);
            self.enqueue(Queued { request, attempt, not_before: now, deadline });
        } else {
            self.outputs.push_back(RouterOutput::Failed { request: t.request.id, reason });
        }
        self.pump(now);
    }

    fn forget(&mut self, id: TransferId) -> Transfer {
        let t = self.transfers.remove(&id).expect("forgetting a live transfer");
        self.deadlines.remove(&(t.deadline, id));
        self.by_request.remove(&t.request.id);
        self.index.transfer_ended(t.request.id, t.prefill.worker, t.decode.worker);
        t
    }

    fn send(&mut self, to: Endpoint, body: Message) {
        self.outputs.push_back(RouterOutput::Send(Envelope { from: self.me, to, body }));
    }

    /// Each request in transfer has exactly one live transfer and the reverse; the deadline index
    /// matches; ids are below the next one to allocate and within this incarnation's range;
    /// bounds hold; the indexes of loads and of the queue are what scans find.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.check_counts()?;
        for worker in self.places.keys() {
            ensure_invariant!(
                PD,
                self.prefills.iter().chain(&self.decodes).any(|w| w.worker == *worker),
                "places known for {worker:?}, which is not paired"
            );
        }
        let mut queued = BTreeSet::new();
        for (a, b) in self.queue.iter().zip(self.queue.iter().skip(1)) {
            ensure_invariant!(
                PD,
                a.request.priority <= b.request.priority,
                "{} (priority {}) is queued before {} (priority {})",
                a.request.id,
                a.request.priority,
                b.request.id,
                b.request.priority
            );
        }
        for q in &self.queue {
            let id = q.request.id;
            ensure_invariant!(
                PD,
                !self.by_request.contains_key(&id)
                    && !self.decoding.contains_key(&id)
                    && queued.insert(id),
                "{id} is queued and in flight, or queued twice"
            );
            ensure_invariant!(
                PD,
                q.attempt <= self.config.retries_max,
                "{id} is queued for attempt {} of {}",
                q.attempt,
                self.config.retries_max
            );
        }
        for (request, d) in &self.decoding {
            self.check_decoding(*request, d)?;
        }
        ensure_invariant!(
            PD,
            self.requests_held() <= self.config.requests_max as usize,
            "{} transfers, {} decoding and {} queued over the bound",
            self.transfers.len(),
            self.decoding.len(),
            self.queue.len()
        );
        for (&id, t) in &self.transfers {
            self.check_transfer(id, t)?;
        }
        // Last, so that a state broken by hand is reported by the check about it rather than as
        // an index out of step.
        self.check_index(queued)
    }

    /// The cheap check, for after every input; `check_invariants` is the full one.
    ///
    /// Checks every request changed since the last incremental check as the full check does:
    /// in one place at most (transfer, decoding or queue), its transfer filed both ways, under
    /// its deadline, with an id of this incarnation and an attempt within the bound, or its idle
    /// deadline filed. Then the counts: requests against transfers, deadlines against
    /// transfers, idle deadlines against decoding requests, the bound, the loads against the
    /// transfers and decoding requests, the queue's index against the queue, and the earliest
    /// deadline and idle deadline name live entries. O(requests changed · log requests +
    /// workers), where the full check is O(requests · log requests). Takes `&mut self` to
    /// consume the set of changed requests; if more changed than it holds (`requests_max`), the
    /// full check runs instead. Which worker carries which load, and the queue's entries one by
    /// one, only the full check sees: run it at quiescence and every so many inputs.
    pub fn check_invariants_incremental(&mut self) -> Result<(), InvariantViolation> {
        let Some(changed) = self.index.take_changed() else {
            return self.check_invariants();
        };
        for &request in &changed {
            self.check_request(request)?;
        }
        self.check_counts()?;
        ensure_invariant!(
            PD,
            self.requests_held() <= self.config.requests_max as usize,
            "{} transfers, {} decoding and {} queued over the bound",
            self.transfers.len(),
            self.decoding.len(),
            self.queue.len()
        );
        if let Some(&(at, id)) = self.deadlines.first() {
            let deadline = self.transfers.get(&id).map(|t| t.deadline);
            ensure_invariant!(
                PD,
                deadline == Some(at),
                "the earliest deadline ({at:?}, {id:?}) names a transfer due at {deadline:?}"
            );
        }
        if let Some(&(at, request)) = self.idle_deadlines.first() {
            let idle = self.decoding.get(&request).map(|d| d.idle_deadline);
            ensure_invariant!(
                PD,
                idle == Some(at),
                "the earliest idle deadline ({at:?}, {request}) names a request idle at {idle:?}"
            );
        }
        let prefill: usize = self.index.prefill_loads.values().sum();
        let decode: usize = self.index.decode_loads.values().sum();
        ensure_invariant!(
            PD,
            prefill == self.transfers.len() && decode == self.transfers.len() + self.decoding.len(),
            "loads of {prefill} on prefill and {decode} on decode workers for {} transfers and {} \
             decoding requests",
            self.transfers.len(),
            self.decoding.len()
        );
        let q = &self.index;
        ensure_invariant!(
            PD,
            q.queued.len() == self.queue.len()
                && q.queue_deadlines.len() == self.queue.len()
                && q.queue_not_before.len() == self.queue.len(),
            "the queue index holds {}, {} and {} entries for {} queued requests",
            q.queued.len(),
            q.queue_deadlines.len(),
            q.queue_not_before.len(),
            self.queue.len()
        );
        Ok(())
    }

    fn check_counts(&self) -> Result<(), InvariantViolation> {
        ensure_invariant!(
            PD,
            self.by_request.len() == self.transfers.len(),
            "{} requests for {} transfers",
            self.by_request.len(),
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.deadlines.len() == self.transfers.len(),
            "{} deadlines for {} transfers",
            self.deadlines.len(),
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.idle_deadlines.len() == self.decoding.len(),
            "{} idle deadlines for {} decoding requests",
            self.idle_deadlines.len(),
            self.decoding.len()
        );
        Ok(())
    }

    /// A request, wherever it is: in one place at most, and filed there as the full check asks.
    fn check_request(&self, request: RequestId) -> Result<(), InvariantViolation> {
        let transfer = self.by_request.get(&request).copied();
        let decoding = self.decoding.get(&request);
        let queued = self.index.queued.contains(&request);
        ensure_invariant!(
            PD,
            !queued || (transfer.is_none() && decoding.is_none()),
            "{request} is queued and in flight, or queued twice"
        );
        if let Some(d) = decoding {
            self.check_decoding(request, d)?;
        }
        if let Some(id) = transfer {
            let t = self.transfers.get(&id);
            ensure_invariant!(
                PD,
                t.is_some_and(|t| t.request.id == request),
                "{request} maps to transfer {id:?}, which is not live or not its"
            );
            if let Some(t) = t {
                self.check_transfer(id, t)?;
            }
        }
        Ok(())
    }

    fn check_decoding(&self, request: RequestId, d: &Decoding) -> Result<(), InvariantViolation> {
        ensure_invariant!(
            PD,
            !self.by_request.contains_key(&request),
            "{request} is decoding and in transfer at once"
        );
        ensure_invariant!(
            PD,
            self.idle_deadlines.contains(&(d.idle_deadline, request)),
            "{request} is missing from the idle deadlines"
        );
        Ok(())
    }

    fn check_transfer(&self, id: TransferId, t: &Transfer) -> Result<(), InvariantViolation> {
        let first = Self::first_id(self.me.incarnation);
        ensure_invariant!(PD, t.key.transfer == id, "transfer {id:?} filed under another id");
        ensure_invariant!(
            PD,
            id.0 >= first && id.0 < self.next_transfer,
            "transfer {id:?} outside this incarnation's ids"
        );
        ensure_invariant!(
            PD,
            self.by_request.get(&t.request.id) == Some(&id),
            "{} does not map to its transfer {id:?}",
            t.request.id
        );
        ensure_invariant!(
            PD,
            self.deadlines.contains(&(t.deadline, id)),
            "transfer {id:?} missing from the deadlines"
        );
        ensure_invariant!(
            PD,
            t.attempt <= self.config.retries_max,
            "transfer {id:?} is attempt {} of {}",
            t.attempt,
            self.config.retries_max
        );
        Ok(())
    }

    /// The indexes against scans of what they index. `queued` is the queue's requests.
    fn check_index(&self, queued: BTreeSet<RequestId>) -> Result<(), InvariantViolation> {
        let mut prefill: BTreeMap<WorkerId, usize> = BTreeMap::new();
        let mut decode: BTreeMap<WorkerId, usize> = BTreeMap::new();
        for t in self.transfers.values() {
            *prefill.entry(t.prefill.worker).or_default() += 1;
            *decode.entry(t.decode.worker).or_default() += 1;
        }
        for d in self.decoding.values() {
            *decode.entry(d.decode.worker).or_default() += 1;
        }
        ensure_invariant!(
            PD,
            prefill == self.index.prefill_loads,
            "prefill loads {:?} are not the transfers' {prefill:?}",
            self.index.prefill_loads
        );
        ensure_invariant!(
            PD,
            decode == self.index.decode_loads,
            "decode loads {:?} are not the transfers' and decoding requests' {decode:?}",
            self.index.decode_loads
        );
        let (mut deadlines, mut not_before) = (Times::default(), Times::default());
        for q in &self.queue {
            deadlines.insert(q.deadline);
            not_before.insert(q.not_before);
        }
        ensure_invariant!(
            PD,
            queued == self.index.queued
                && deadlines == self.index.queue_deadlines
                && not_before == self.index.queue_not_before,
            "the queue index is not the queue's: {:?}",
            self.index
        );
        ensure_invariant!(
            PD,
            self.index.changed_within_bound(),
            "{} requests noted as changed, over the bound",
            self.index.changed.len()
        );
        Ok(())
    }
}

const PD: &str = "pd-router";

#[path = "router_index.rs"]
mod index;
#[cfg(test)]
#[path = "router_invariant_tests.rs"]
mod invariant_tests;
#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
