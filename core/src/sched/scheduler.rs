//! The scheduler's state, its inputs other than planning and applying, and its outputs.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use super::config::{SchedConfig, SchedConfigError};
use super::plan::StepId;
use super::request::{
    AdmissionError, AfterDrain, FinishReason, NewRequest, OrderKey, Phase, Request, RequestId,
};
use crate::Time;
use crate::kv::{PagePool, PageRef};

/// What the scheduler tells its driver. Drained with `poll_event` after every input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedEvent {
    /// The request's next output token, in order.
    Token { request: RequestId, token: u32 },
    /// The request ended. Exactly one per request; nothing about it follows.
    Finished { request: RequestId, reason: FinishReason, output_tokens: u32 },
    /// The request lost its pages to a higher-order one and will recompute; its tokens so far
    /// stand.
    Preempted { request: RequestId },
    /// A request submitted with `submit_keeping_pages` ended and no step touches its pages any
    /// more: take them with `take_kept_pages`. After its `Finished`.
    PagesKept { request: RequestId },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortError {
    /// No such request: never submitted, or already ended and reported.
    Unknown(RequestId),
}

impl fmt::Display for AbortError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortError::Unknown(id) => write!(f, "no live request {id}"),
        }
    }
}

impl std::error::Error for AbortError {}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApplyError {
    /// Outputs must come for the oldest step in flight, once.
    UnexpectedStep { got: StepId, expected: Option<StepId> },
    /// One sampled token per sampling row.
    WrongTokenCount { step: StepId, expected: usize, got: usize },
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApplyError::UnexpectedStep { got, expected } => {
                write!(f, "outputs for {got:?}, expected {expected:?}")
            }
            ApplyError::WrongTokenCount { step, expected, got } => {
                write!(f, "outputs for {step:?} carry {got} tokens for {expected} sampling rows")
            }
        }
    }
}

impl std::error::Error for ApplyError {}

/// A row of a step in flight, as the scheduler remembers it until the step is applied.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InFlightRow {
    pub(crate) entry: u32,
    pub(crate) request: RequestId,
    pub(crate) start: u32,
    pub(crate) end: u32,
    pub(crate) sample: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct InFlightStep {
    pub(crate) step: StepId,
    pub(crate) rows: Vec<InFlightRow>,
    pub(crate) sampling_rows: usize,
}

/// Continuous-batching scheduler over a page pool. See the module docs for the driver's loop.
#[derive(Clone)]
pub struct Scheduler {
    pub(crate) config: SchedConfig,
    pub(crate) pool: PagePool,
    /// Requests by entry number; an entry is reused only after its request is gone.
    pub(crate) entries: Vec<Option<Request>>,
    pub(crate) free_entries: Vec<u32>,
    pub(crate) by_id: BTreeMap<RequestId, u32>,
    /// Waiting requests in admission order.
    pub(crate) waiting: BTreeSet<(OrderKey, u32)>,
    /// When each waiting request gives up.
    pub(crate) waiting_deadlines: BTreeSet<(Time, RequestId)>,
    /// Running requests in admission order (not the draining ones).
    pub(crate) running: Vec<(OrderKey, u32)>,
    /// Free batch slots, used as a stack.
    pub(crate) free_slots: Vec<u32>,
    pub(crate) in_flight: VecDeque<InFlightStep>,
    pub(crate) next_step: StepId,
    pub(crate) events: VecDeque<SchedEvent>,
    /// Reused between steps so planning does not allocate its scratch space.
    pub(crate) draft: Vec<super::planner::DraftRow>,
    /// Tokens of admitted requests looked up in the prefix cache, and found there (vLLM's
    /// prefix-cache queries and hits), since the start.
    pub(crate) prefix_tokens_queried: u64,
    pub(crate) prefix_tokens_hit: u64,
    /// Preemptions since the start, for the metrics of every role (a worker sees no events).
    preemptions: u64,
    /// Pages of ended requests that keep them, until the caller takes them: still references
    /// this scheduler holds.
    pub(crate) kept: BTreeMap<RequestId, Vec<PageRef>>,
}

impl fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("slots_held", &self.slots_held())
            .field("in_flight", &self.in_flight.len())
            .field("pool", &self.pool)
            .finish()
    }
}

impl Scheduler {
    pub fn new(config: SchedConfig) -> Result<Scheduler, SchedConfigError> {
        config.validate()?;
        let pool = PagePool::new(config.pool).map_err(|e| SchedConfigError::from_pool(&e))?;
        let requests_max = (config.waiting_max + config.running_max) as usize;
        Ok(Scheduler {
            pool,
            entries: vec![None; requests_max],
            free_entries: (0..requests_max as u32).rev().collect(),
            by_id: BTreeMap::new(),
            waiting: BTreeSet::new(),
            waiting_deadlines: BTreeSet::new(),
            running: Vec::with_capacity(config.running_max as usize),
            free_slots: (0..config.running_max).rev().collect(),
            in_flight: VecDeque::with_capacity(2),
            next_step: StepId(0),
            events: VecDeque::new(),
            draft: Vec::with_capacity(config.step_tokens_max as usize),
            prefix_tokens_queried: 0,
            prefix_tokens_hit: 0,
            preemptions: 0,
            kept: BTreeMap::new(),
            config,
        })
    }

    pub fn config(&self) -> &SchedConfig {
        &self.config
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Pages whose contents ended since the last call (`PagePool::take_freed`): the driver hands
    /// them to its executor before its next step launch or page read or write.
    pub fn take_freed_pages(&mut self, out: &mut Vec<u32>) {
        self.pool.take_freed(out);
    }

    /// The pool, for a transfer sharing it on the same worker (`core::node`): what the transfer
    /// takes it holds, and the node's check counts it (`check_invariants_sharing_pool`).
    pub(crate) fn pool_mut(&mut self) -> &mut PagePool {
        &mut self.pool
    }

    pub fn waiting_count(&self) -> usize {
        self.waiting.len()
    }

    pub fn running_count(&self) -> usize {
        self.running.len()
    }

    /// Requests holding a batch slot: running and draining.
    pub fn slots_held(&self) -> usize {
        self.config.running_max as usize - self.free_slots.len()
    }

    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The requests of `step`'s sampling rows, in row order: whose each of its
    /// `StepOutputs::sampled` (and `logprobs`) is. `None` unless `step` is the oldest in flight,
    /// the one `apply_outputs` takes next.
    pub fn step_sampling(&self, step: StepId) -> Option<impl Iterator<Item = RequestId> + '_> {
        let oldest = self.in_flight.front().filter(|s| s.step == step)?;
        Some(oldest.rows.iter().filter(|row| row.sample).map(|row| row.request))
    }

    /// Requests the scheduler holds in any phase.
    pub fn requests_held(&self) -> usize {
        self.by_id.len()
    }

    /// Tokens looked up in the prefix cache at admission and tokens found, since the start.
    pub fn prefix_cache_tokens(&self) -> (u64, u64) {
        (self.prefix_tokens_queried, self.prefix_tokens_hit)
    }

    /// Requests preempted by recompute since the start (a request preempted twice counts twice).
    pub fn preemptions_total(&self) -> u64 {
        self.preemptions
    }

    /// The prompt and output tokens applied so far of a held request.
    pub fn request_tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.by_id.get(&id).map(|&e| self.entry(e).tokens.as_slice())
    }

    /// Positions of a held request whose KV applied steps wrote; back to what the prefix cache
    /// holds after a preemption.
    pub fn computed_tokens(&self, id: RequestId) -> Option<u32> {
        self.by_id.get(&id).map(|&e| self.entry(e).computed)
    }

    /// Accepts a request into the waiting queue, or refuses it with the reason. A refused request
    /// leaves no trace.
    pub fn submit(&mut self, req: NewRequest, now: Time) -> Result<(), AdmissionError> {
        self.check_admissible(&req)?;
        let entry = self
            .free_entries
            .pop()
            .expect("entries are sized for every request the queue bounds admit");
        let id = req.id;
        self.entries[entry as usize] = Some(Request::new(req, now));
        self.by_id.insert(id, entry);
        self.enqueue(entry, now);
        Ok(())
    }

    /// As `submit`, for a request whose prompt's tokens are scored (`SamplingSpec::
    /// prompt_logprobs`): it computes every prompt position, reading from the prefix cache only
    /// the pages of positions it computed itself before a preemption (vLLM skips the cache
    /// altogether: `skip_reading_prefix_cache`), and offers its pages to the cache as any
    /// request does.
    pub fn submit_scoring(&mut self, req: NewRequest, now: Time) -> Result<(), AdmissionError> {
        let id = req.id;
        self.submit(req, now)?;
        self.skip_prefix_cache_reads(id);
        Ok(())
    }

    /// A request just submitted computes every prompt position (`submit_scoring`), for the
    /// prefill node's requests, which it submits keeping their pages.
    pub(crate) fn skip_prefix_cache_reads(&mut self, id: RequestId) {
        if let Some(&entry) = self.by_id.get(&id) {
            self.entry_mut(entry).reads_prefix_cache = false;
        }
    }

    fn check_admissible(&self, req: &NewRequest) -> Result<(), AdmissionError> {
        if self.waiting.len() >= self.config.waiting_max as usize {
            return Err(AdmissionError::QueueFull { waiting_max: self.config.waiting_max });
        }
        self.check_request(req)
    }

    /// What makes a request acceptable whatever queue it goes to.
    pub(crate) fn check_request(&self, req: &NewRequest) -> Result<(), AdmissionError> {
        if self.by_id.contains_key(&req.id) || self.kept.contains_key(&req.id) {
            return Err(AdmissionError::DuplicateId(req.id));
        }
        if req.prompt.is_empty() {
            return Err(AdmissionError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(AdmissionError::ZeroMaxTokens);
        }
        let max = crate::wire::STOP_TOKENS_MAX;
        if req.stop_token_ids.len() > max {
            return Err(AdmissionError::TooManyStopTokens { count: req.stop_token_ids.len(), max });
        }
        let prompt_tokens = u32::try_from(req.prompt.len()).unwrap_or(u32::MAX);
        if prompt_tokens >= self.config.request_tokens_max {
            return Err(AdmissionError::PromptTooLong {
                prompt_tokens,
                request_tokens_max: self.config.request_tokens_max,
            });
        }
        // The KV of the last output token is never computed: it is sampled and returned.
        let tokens_max = (u64::from(prompt_tokens) + u64::from(req.max_tokens) - 1)
            .min(u64::from(self.config.request_tokens_max));
        let pages_needed = tokens_max.div_ceil(u64::from(self.pool.page_tokens()));
        if pages_needed > u64::from(self.pool.pages_total()) {
            return Err(AdmissionError::NeverFits {
                pages_needed,
                pages_total: self.pool.pages_total(),
            });
        }
        Ok(())
    }

    /// Ends a request in any phase. Its terminal event goes out now; its pages and slot are
    /// released now, or once the last step in flight that touches them is applied.
    pub fn abort(&mut self, id: RequestId, _now: Time) -> Result<(), AbortError> {
        let entry = *self.by_id.get(&id).ok_or(AbortError::Unknown(id))?;
        match self.entry(entry).phase {
            Phase::Draining { then: AfterDrain::Remove, .. } => Err(AbortError::Unknown(id)),
            _ => {
                if crate::planted!(AbortInMultiTurnSession) {
                    // Planted (sglang#36552): the aborted turn's KV is saved for the session's
                    // next turn, and nobody ever takes it back.
                    self.entry_mut(entry).keeps_pages = true;
                }
                if crate::planted!(CancelNearSharedPrefix) {
                    // Planted (sglang#23392, sglang#24193): a cancel lets go of the shared
                    // prefix it matched now, and its release lets go of it once more.
                    self.release_shared_prefix_early(entry);
                }
                self.finish(entry, FinishReason::Aborted);
                Ok(())
            }
        }
    }

    /// Planted `CancelNearSharedPrefix` only: drops one reference to each cached prefix page
    /// another request also holds, leaving the page listed (its release comes again later).
    fn release_shared_prefix_early(&mut self, entry: u32) {
        let Scheduler { pool, entries, .. } = self;
        let r = entries[entry as usize].as_ref().expect("a live entry number names a request");
        for &page in &r.pages[..r.pages_cached as usize] {
            if pool.refs(page).is_ok_and(|refs| refs > 1) {
                let _ = pool.release(page);
            }
        }
    }

    /// The next event, if any. Drain after every input.
    pub fn poll_event(&mut self) -> Option<SchedEvent> {
        self.events.pop_front()
    }

    /// When to call `handle_timeout`: the earliest queue deadline or pin lease.
    pub fn next_timeout(&self) -> Option<Time> {
        let queue = self.waiting_deadlines.first().map(|(t, _)| *t);
        Time::earliest(queue, self.pool.next_timeout())
    }

    /// Refuses waiting requests past their queue deadline, and expires pin leases.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&(deadline, id)) = self.waiting_deadlines.first() {
            if deadline > now {
                break;
            }
            let entry = self.by_id[&id];
            self.finish(entry, FinishReason::QueueTimeout);
        }
        self.pool.handle_timeout(now);
    }

    pub(crate) fn entry(&self, entry: u32) -> &Request {
        self.entries[entry as usize].as_ref().expect("a live entry number names a request")
    }

    pub(crate) fn entry_mut(&mut self, entry: u32) -> &mut Request {
        self.entries[entry as usize].as_mut().expect("a live entry number names a request")
    }

    pub(crate) fn enqueue(&mut self, entry: u32, now: Time) {
        let deadline = now.saturating_add(self.config.queue_wait_max);
        let r = self.entry_mut(entry);
        r.phase = Phase::Waiting;
        r.queued_at = now;
        let (order, id) = (r.order, r.id);
        self.waiting.insert((order, entry));
        self.waiting_deadlines.insert((deadline, id));
    }

    fn dequeue(&mut self, entry: u32) {
        let r = self.entry(entry);
        let deadline = r.queued_at.saturating_add(self.config.queue_wait_max);
        let (order, id) = (r.order, r.id);
        let was_waiting = self.waiting.remove(&(order, entry));
        let had_deadline = self.waiting_deadlines.remove(&(deadline, id));
        assert!(was_waiting && had_deadline, "{id} left a waiting queue it was not in");
    }

    /// Moves a request into the running order with a fresh slot.
    pub(crate) fn start_running(&mut self, entry: u32) {
        self.dequeue(entry);
        let slot = self.free_slots.pop().expect("admission checked a slot is free");
        let r = self.entry_mut(entry);
        r.phase = Phase::Running { slot };
        let key = (r.order, entry);
        let at =
            self.running.binary_search(&key).expect_err("a request is in the running order once");
        self.running.insert(at, key);
    }

    fn stop_running(&mut self, entry: u32) {
        let key = (self.entry(entry).order, entry);
        let at =
            self.running.binary_search(&key).expect("a running request is in the running order");
        self.running.remove(at);
    }

    /// The terminal transition: reports `reason` once and lets go of the request, now or when its
    /// steps in flight are applied.
    pub(crate) fn finish(&mut self, entry: u32, reason: FinishReason) {
        let r = self.entry(entry);
        let (id, output_tokens, phase) = (r.id, r.output_len(), r.phase);
        // First, so that a `PagesKept` the release below reports comes after it.
        self.events.push_back(SchedEvent::Finished { request: id, reason, output_tokens });
        match phase {
            Phase::Waiting => {
                self.dequeue(entry);
                if self.entry(entry).keeps_pages {
                    // Nothing to keep, but the caller waits for this event all the same.
                    self.kept.insert(id, Vec::new());
                    self.events.push_back(SchedEvent::PagesKept { request: id });
                }
                self.remove(entry);
            }
            Phase::Running { slot } => {
                self.stop_running(entry);
                self.drain_or(entry, slot, AfterDrain::Remove);
            }
            Phase::Draining { slot, then: AfterDrain::Requeue } => {
                self.entry_mut(entry).phase = Phase::Draining { slot, then: AfterDrain::Remove };
            }
            Phase::Draining { then: AfterDrain::Remove, .. } => unreachable!("{id} finished twice"),
            Phase::Reserved { slot } => {
                self.free_slots.push(slot);
                self.remove(entry);
            }
        }
    }

    /// Preempts a running request by recompute: its pages go (now or after its steps in flight),
    /// its tokens stay, and it waits again in its original order.
    pub(crate) fn preempt(&mut self, entry: u32, now: Time) {
        let Phase::Running { slot } = self.entry(entry).phase else {
            unreachable!("only running requests are preempted");
        };
        self.stop_running(entry);
        let r = self.entry_mut(entry);
        r.preemptions += 1;
        let id = r.id;
        self.preemptions += 1;
        self.events.push_back(SchedEvent::Preempted { request: id });
        if self.drain_or(entry, slot, AfterDrain::Requeue) {
            self.enqueue(entry, now);
        }
    }

    /// Releases the request's pages and slot now if no step in flight touches them, and returns
    /// true; else marks it draining, to finish with `then` when the last such step is applied.
    fn drain_or(&mut self, entry: u32, slot: u32, then: AfterDrain) -> bool {
        // Planted (vllm#45357, vllm#47728, sglang#18803): overlap scheduling freed the pages at
        // once, while the step in flight still read and wrote them.
        if self.entry(entry).in_flight_steps > 0 && !crate::planted!(FreeBeforeLastReader) {
            self.entry_mut(entry).phase = Phase::Draining { slot, then };
            return false;
        }
        self.release_resources(entry, slot, then);
        if then == AfterDrain::Remove {
            self.remove(entry);
        }
        true
    }

    /// Ends a drain once the request's last step in flight is applied.
    pub(crate) fn complete_drain(&mut self, entry: u32, now: Time) {
        let Phase::Draining { slot, then } = self.entry(entry).phase else {
            return;
        };
        self.release_resources(entry, slot, then);
        match then {
            AfterDrain::Requeue => self.enqueue(entry, now),
            AfterDrain::Remove => self.remove(entry),
        }
    }

    fn release_resources(&mut self, entry: u32, slot: u32, then: AfterDrain) {
        let r = self.entries[entry as usize].as_mut().expect("a live entry number names a request");
        debug_assert_eq!(
            r.in_flight_steps, 0,
            "{} released while a step in flight touches it",
            r.id
        );
        if then == AfterDrain::Remove && r.keeps_pages {
            // Its prompt's KV is what a transfer sends: the references stay ours until the
            // caller takes them, so the pages are never freed before the transfer pins them.
            self.kept.insert(r.id, std::mem::take(&mut r.pages));
            self.events.push_back(SchedEvent::PagesKept { request: r.id });
        }
        for page in r.pages.drain(..) {
            if let Err(e) = self.pool.release(page) {
                panic!("{} held page {page:?} it could not release: {e}", r.id);
            }
        }
        r.pages_sent = 0;
        r.pages_cached = 0;
        r.computed = 0;
        r.phase = Phase::Waiting;
        self.free_slots.push(slot);
    }

    fn remove(&mut self, entry: u32) {
        let r = self.entries[entry as usize].take().expect("a live entry number names a request");
        assert!(r.pages.is_empty(), "{} removed while holding pages", r.id);
        self.by_id.remove(&r.id);
        self.free_entries.push(entry);
    }
}

impl SchedConfigError {
    fn from_pool(e: &crate::kv::PoolConfigError) -> SchedConfigError {
        SchedConfigError::new(e.to_string())
    }
}
