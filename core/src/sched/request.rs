//! A request as the scheduler sees it: what the caller submits, why it ended, and its state.

use std::fmt;

use crate::Time;
use crate::kv::PageRef;

/// Names a request. Chosen by the caller, unique among the requests a scheduler holds.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// What a caller submits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    /// Output tokens at most, the end-of-sequence or stop token included.
    pub max_tokens: u32,
    /// Tokens that end this request, besides the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence ids.
    pub ignore_eos: bool,
    /// Lower runs first; then earlier arrival; then lower id. There is no other tie-break.
    pub priority: i32,
    /// Namespace of the prefix cache: requests share cached pages only under the same salt
    /// (model, adapter, tenant).
    pub cache_salt: u64,
}

/// Why a request ended. Exactly one per request, reported once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Produced `max_tokens` tokens.
    Length,
    /// Reached the model's context length (`request_tokens_max`).
    ContextLength,
    /// Produced one of the model's end-of-sequence tokens.
    EndOfSequence(u32),
    /// Produced one of the request's stop tokens.
    StopToken(u32),
    /// Aborted by the caller.
    Aborted,
    /// Waited longer than `queue_wait_max` for admission.
    QueueTimeout,
    /// A step computing it failed (`Scheduler::fail_step`): its output so far stands, no more
    /// comes.
    StepFailed,
}

/// Why `submit` refused a request. Nothing about the refused request is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmissionError {
    /// `waiting_max` requests are already waiting: try again later (HTTP 429/503).
    QueueFull {
        waiting_max: u32,
    },
    /// A request with this id is still held.
    DuplicateId(RequestId),
    EmptyPrompt,
    ZeroMaxTokens,
    /// The prompt alone reaches the context length.
    PromptTooLong {
        prompt_tokens: u32,
        request_tokens_max: u32,
    },
    /// Prompt plus `max_tokens` needs more pages than the whole pool has: it could never run.
    NeverFits {
        pages_needed: u64,
        pages_total: u32,
    },
    /// More stop tokens than a request may carry between workers (`wire::STOP_TOKENS_MAX`):
    /// refused here, as every peer would refuse it, rather than accepted and lost in transfer.
    TooManyStopTokens {
        count: usize,
        max: usize,
    },
    /// Every batch slot is held: a hand-over could not be reserved one (`Scheduler::reserve`).
    NoSlot {
        running_max: u32,
    },
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmissionError::QueueFull { waiting_max } => {
                write!(f, "queue full ({waiting_max} requests waiting)")
            }
            AdmissionError::DuplicateId(id) => write!(f, "request id {id} is already in use"),
            AdmissionError::EmptyPrompt => write!(f, "the prompt is empty"),
            AdmissionError::ZeroMaxTokens => write!(f, "max_tokens is zero"),
            AdmissionError::PromptTooLong { prompt_tokens, request_tokens_max } => {
                write!(
                    f,
                    "prompt of {prompt_tokens} tokens reaches the context length {request_tokens_max}"
                )
            }
            AdmissionError::NeverFits { pages_needed, pages_total } => {
                write!(f, "request needs {pages_needed} KV pages, the pool has {pages_total}")
            }
            AdmissionError::TooManyStopTokens { count, max } => {
                write!(f, "{count} stop tokens, at most {max}")
            }
            AdmissionError::NoSlot { running_max } => {
                write!(f, "all {running_max} batch slots are held")
            }
        }
    }
}

impl std::error::Error for AdmissionError {}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// In the waiting queue. Holds no page and no slot.
    Waiting,
    /// Admitted: holds a slot and pages, and is scheduled each step.
    Running { slot: u32 },
    /// Preempted or ended while steps in flight still read or write its pages: it keeps its slot
    /// and pages, is never scheduled, and leaves this phase when the last such step is applied.
    Draining { slot: u32, then: AfterDrain },
    /// Decode side of a transfer: its prompt's KV is on its way from a prefill worker. Holds a
    /// slot (so the hand-over always finds one) and no page; never scheduled. Leaves for
    /// `Running` on `hand_over`, or is forgotten on `cancel_reservation`.
    Reserved { slot: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterDrain {
    /// Preempted: back to the waiting queue, to recompute.
    Requeue,
    /// Ended (its terminal event is already out): forget it.
    Remove,
}

/// Admission order: priority, then arrival, then id.
pub(crate) type OrderKey = (i32, Time, RequestId);

#[derive(Clone, Debug)]
pub(crate) struct Request {
    pub(crate) id: RequestId,
    pub(crate) order: OrderKey,
    pub(crate) phase: Phase,
    /// Prompt, then every output token applied so far.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: u32,
    pub(crate) max_tokens: u32,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) ignore_eos: bool,
    pub(crate) cache_salt: u64,
    /// When it last entered the waiting queue.
    pub(crate) queued_at: Time,
    /// Page table: page `i` holds the KV of positions `i*page_tokens..(i+1)*page_tokens`.
    pub(crate) pages: Vec<PageRef>,
    /// Leading pages of `pages` the executor already knows about (sent in earlier plans).
    pub(crate) pages_sent: u32,
    /// Leading pages offered to the prefix cache: found there at admission, or inserted once
    /// their KV was complete (an insert whose key another page holds leaves ours uncached).
    pub(crate) pages_cached: u32,
    /// Chained keys of the leading full pages, as far as computed.
    pub(crate) page_keys: Vec<u64>,
    /// Positions whose KV is written by applied steps.
    pub(crate) computed: u32,
    /// Positions whose KV is being written by steps in flight, beyond `computed`.
    pub(crate) in_flight_tokens: u32,
    /// Tokens steps in flight will sample for it.
    pub(crate) in_flight_samples: u32,
    /// Steps in flight with a row for it.
    pub(crate) in_flight_steps: u32,
    /// The most recent step in flight that samples for it, and the row: the source of the
    /// placeholder input of its next row.
    pub(crate) last_sample: Option<(super::StepId, u32)>,
    pub(crate) preemptions: u32,
    /// Its row in the step being planned, while planning.
    pub(crate) draft_row: Option<u32>,
    /// Prefill side of a transfer: when it ends, its pages are kept for the transfer to pin
    /// (`Scheduler::take_kept_pages`) instead of released.
    pub(crate) keeps_pages: bool,
    /// Whether admission takes any cached prefix. A request whose prompt is scored
    /// (`Scheduler::submit_scoring`) needs the logits of every prompt position: it takes only
    /// the cached pages of positions it computed itself before (`computed_high`), whose scores
    /// went out then, so that a preempted one still keeps its progress.
    pub(crate) reads_prefix_cache: bool,
    /// The most positions it ever had computed, by applied steps, a cached prefix or a hand-over
    /// (a preemption does not lower it).
    pub(crate) computed_high: u32,
}

impl Request {
    pub(crate) fn new(req: NewRequest, now: Time) -> Request {
        Request {
            id: req.id,
            order: (req.priority, now, req.id),
            phase: Phase::Waiting,
            prompt_len: req.prompt.len() as u32,
            tokens: req.prompt,
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            cache_salt: req.cache_salt,
            queued_at: now,
            pages: Vec::new(),
            pages_sent: 0,
            pages_cached: 0,
            page_keys: Vec::new(),
            computed: 0,
            in_flight_tokens: 0,
            in_flight_samples: 0,
            in_flight_steps: 0,
            last_sample: None,
            preemptions: 0,
            draft_row: None,
            keeps_pages: false,
            reads_prefix_cache: true,
            computed_high: 0,
        }
    }

    /// Whether its prompt's positions are scored (`Scheduler::submit_scoring`): their chunks
    /// count against `SchedConfig::scored_tokens_max`.
    pub(crate) fn scores_prompt(&self) -> bool {
        !self.reads_prefix_cache
    }

    /// How many of `positions` have their logits kept to score a prompt token: those before the
    /// prompt's last (whose logits give the first output token) of a request that scores.
    pub(crate) fn scored_in(&self, start: u32, end: u32) -> u32 {
        match self.scores_prompt() {
            true => end.min(self.prompt_len.saturating_sub(1)).saturating_sub(start),
            false => 0,
        }
    }

    pub(crate) fn output_len(&self) -> u32 {
        self.tokens.len() as u32 - self.prompt_len
    }

    /// Positions with KV computed or being computed.
    pub(crate) fn planned_end(&self) -> u32 {
        self.computed + self.in_flight_tokens
    }

    /// Length the sequence will have once the samples in flight are applied.
    pub(crate) fn len_with_in_flight(&self) -> u32 {
        self.tokens.len() as u32 + self.in_flight_samples
    }

    pub(crate) fn slot(&self) -> Option<u32> {
        match self.phase {
            Phase::Waiting => None,
            Phase::Running { slot } | Phase::Draining { slot, .. } | Phase::Reserved { slot } => {
                Some(slot)
            }
        }
    }
}
