//! The messages of the prefill-to-decode transfer protocol and of the router (DESIGN.md
//! section 3, "pd"), as plain data. `frame.rs` turns them into bytes and back.

use crate::model::{Grammar, TokenLogprobs};
use crate::sched::{FinishReason, RequestId};

/// A worker (router, prefill or decode) in a deployment.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct WorkerId(pub u32);

/// Which life of a worker: changes on every restart, so peers can tell the old one's messages
/// (and drop its state) from the new one's.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Incarnation(pub u64);

/// One life of one worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Endpoint {
    pub worker: WorkerId,
    pub incarnation: Incarnation,
}

/// Names a transfer. Allocated by the router, never reused while a late message could arrive.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TransferId(pub u64);

/// Which attempt at a transfer: a retried transfer gets a higher epoch, and messages of a lower
/// one are dropped.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Epoch(pub u32);

/// What every protocol message is about.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TransferKey {
    pub transfer: TransferId,
    pub epoch: Epoch,
}

/// A decode-side page named on the wire: number and generation, so a write aimed at a page that
/// has since been reused is recognizable.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PageSlot {
    pub index: u32,
    pub generation: u32,
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    pub seed: u64,
    /// OpenAI's penalties on the output so far: a token's logit less `frequency_penalty` times
    /// its count in the output, then less `presence_penalty` if it is there at all
    /// (`model::Sampler::penalize`). Zero: none.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's: a candidate less likely than `min_p` times the most likely one is cut (after the
    /// temperature and top-k, before top-p). 0: no cut.
    pub min_p: f32,
    /// vLLM's (and Hugging Face's): a token of the prompt or the output so far has its logit
    /// divided by this if positive, multiplied if not, before the other penalties. 1: none.
    pub repetition_penalty: f32,
}

impl Sampling {
    /// The most likely token every time.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };

    /// Whether the output so far changes the logits (a penalty that is not its no-op).
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// A request as it travels between workers.
#[derive(Clone, PartialEq, Debug)]
pub struct RequestSpec {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub priority: i32,
    pub cache_salt: u64,
    pub sampling: Sampling,
    /// OpenAI's `logit_bias`: added to each named token's logit before sampling; by token, at
    /// most `LOGIT_BIAS_MAX`, each finite.
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow (OpenAI's `response_format`), its text at most
    /// `GRAMMAR_BYTES_MAX` bytes. Boxed: most requests have none, and every message that
    /// carries a spec would otherwise grow by it.
    pub grammar: Option<Box<Grammar>>,
    /// Log-probabilities to report per output token: `None` for none, `Some(n)` for the chosen
    /// token's and the `n` most likely (`SamplingSpec::logprobs`, at most `TOP_LOGPROBS_MAX`).
    /// The prefill worker reports the first output token's in `Done`, the decode worker the
    /// rest's in `Tokens`.
    pub logprobs: Option<u8>,
    /// Log-probabilities of the prompt's tokens (`SamplingSpec::prompt_logprobs`): the prefill
    /// worker scores them and sends them with `Done`, the decode worker on to the router ahead of
    /// the first token.
    pub prompt_logprobs: Option<u8>,
}

impl RequestSpec {
    /// A request with what a client gets when it asks for nothing else: greedy sampling, no stop
    /// tokens beyond the model's, default priority, the shared cache namespace.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> RequestSpec {
        RequestSpec {
            id,
            prompt,
            max_tokens,
            stop_token_ids: vec![],
            ignore_eos: false,
            priority: 0,
            cache_salt: 0,
            sampling: Sampling::GREEDY,
            logit_bias: Vec::new(),
            grammar: None,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AbortReason {
    /// The client went away or cancelled.
    Client,
    /// The router gave up on the transfer (its own timeout, a peer declared dead).
    Router,
    /// The prefill side could not compute or write the KV.
    PrefillFailed,
    /// The decode side could not take the request (no pages, queue full).
    DecodeFailed,
    /// A lease or a wait ran out.
    Timeout,
    /// The peer came back as a new incarnation: whatever the old one held is gone.
    PeerRestarted,
    /// The decode worker had no batch slot, page or transfer place free: try again later.
    DecodeBusy,
    /// The prefill worker had no transfer place free (its transfers outlive the router's count
    /// of them: until the decode side acknowledges `Done`, or an aborted one's writes drain):
    /// try again later.
    PrefillBusy,
    /// The request waited at the router longer than its `queue_wait_max` for workers with room:
    /// no worker ever took it (an overload, not a failure of the engine).
    QueueTimeout,
}

/// What a worker does in a deployment.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Role {
    Router,
    Prefill,
    Decode,
}

/// How a worker lays out a page of KV in memory. Two workers exchange KV only if theirs are
/// equal: a page written in one layout and read in another is garbage that decodes without error.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct KvLayout {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for f16/bf16, 4 for f32).
    pub element_bytes: u32,
}

/// What a worker tells a peer when a link opens, so that a mismatch refuses the link instead of
/// copying KV the receiver reads wrongly.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LinkIdentity {
    pub role: Role,
    pub page_tokens: u32,
    pub kv_layout: KvLayout,
    /// A fingerprint of the model's weights and tokenizer: the same prompt must mean the same KV.
    pub model: u64,
}

/// Which of a pair of workers' two connections a link is. KV writes and their acknowledgements
/// travel on a lane of their own, as RDMA writes travel beside a TCP control channel in
/// Mooncake or NIXL: a protocol message never waits behind megabytes of KV, and nothing orders
/// a transfer's writes with its protocol messages (an `Abort` may arrive before a write issued
/// earlier). Only a prefill and a decode worker open the KV lane.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Lane {
    Control,
    Kv,
}

/// Why a link was refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LinkMismatch {
    /// The two roles never talk to each other (two routers, two decode workers).
    Roles,
    PageTokens,
    KvLayout,
    Model,
}

#[derive(Clone, PartialEq, Debug)]
pub enum Message {
    /// Either end of a link, first thing: who I am (the envelope names my incarnation) and what
    /// my KV looks like.
    Hello {
        identity: LinkIdentity,
        /// The connection this link is: the dialer names it, the acceptor repeats it.
        lane: Lane,
        /// Requests this end takes at once, which a router sends it no more of: a prefill
        /// worker's transfers, a decode worker's batch slots (a router's is never read). Each
        /// process has its own command line, so only the worker knows what it was given.
        places: u32,
    },
    /// The answer to a `Hello` whose identity does not match: the link closes.
    LinkRefused {
        mismatch: LinkMismatch,
    },
    /// Link liveness: answered by `Pong` with the same nonce. A link that hears nothing for a
    /// bound is dead.
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    /// Router → decode: take this request, whose prefill runs on `prefill`.
    Reserve {
        key: TransferKey,
        request: RequestSpec,
        prefill: Endpoint,
    },
    /// Decode → prefill: compute the request and write the KV of positions from
    /// `cached_tokens` on into these pages (the first `cached_tokens` are cached on the decode
    /// side already). No write is allowed before a `LeaseGrant`; `lease_ms` is how long each
    /// grant lasts.
    Prepare {
        key: TransferKey,
        request: RequestSpec,
        cached_tokens: u32,
        page_tokens: u32,
        pages: Vec<PageSlot>,
        lease_ms: u32,
    },
    /// Prefill → decode: asks for write permission (a lease). The prefill side remembers when it
    /// sent heartbeat `seq`; the grant that answers it runs from that moment, which is no later
    /// than the decode side's own start of the lease.
    Heartbeat {
        key: TransferKey,
        seq: u32,
        /// How far the transfer has come: grows when the prefill worker made progress since the
        /// last heartbeat (took a prompt further than ever: recomputing after a preemption does
        /// not count), when the computation ended, and with each write completed. The decode
        /// side reports a transfer to the router (`TransferLive`) only when it grew: a prefill
        /// side that heartbeats without getting anywhere does not keep the router waiting.
        progress: u32,
    },
    /// Decode → prefill: writes are allowed for `lease_ms` from when heartbeat `seq` was sent.
    LeaseGrant {
        key: TransferKey,
        seq: u32,
        lease_ms: u32,
    },
    /// Prefill → decode: every page is written and every write has completed; here is the first
    /// output token, with its log-probabilities if the request asked for them (of `first_token`:
    /// the codec refuses any other).
    Done {
        key: TransferKey,
        first_token: u32,
        pages_written: u32,
        first_logprobs: Option<TokenLogprobs>,
        /// The prompt's tokens' log-probabilities from the second on, if the request asked
        /// (`RequestSpec::prompt_logprobs`); else empty.
        prompt_logprobs: Vec<TokenLogprobs>,
    },
    /// Decode → prefill: `Done` received; the prefill side may let go.
    DoneAck {
        key: TransferKey,
    },
    /// Any side → its peer: end the transfer.
    Abort {
        key: TransferKey,
        reason: AbortReason,
    },
    /// Reply to `Abort`. From the prefill side it also says "drained": no write of mine to this
    /// transfer will land any more.
    AbortAck {
        key: TransferKey,
    },
    /// Decode → router: the transfer ended; `failure` is `None` when the request now decodes.
    Outcome {
        key: TransferKey,
        failure: Option<AbortReason>,
    },
    /// Decode → router: the transfer is live here, and its prefill side's heartbeats say it got
    /// further (it is computing or writing). The router's outcome timeout counts again from
    /// here, so a long prompt is not given up on while the workers make progress on it. Sent at
    /// most once per `DecodeConfig::live_report_interval` per transfer.
    TransferLive {
        key: TransferKey,
    },
    /// Prefill → decode memory, one-sided: KV bytes for a page, landing whatever the receiver's
    /// state (as an RDMA write does). Never handled by the decode state machine.
    KvWrite {
        key: TransferKey,
        page: PageSlot,
        first_token: u32,
        data: Vec<u8>,
    },
    /// Decode memory → prefill: the `KvWrite` into `page` landed, or was dropped (`landed`
    /// false: the page's transfer let go of it, as a revoked memory key drops an RDMA write).
    KvWriteAck {
        key: TransferKey,
        page: PageSlot,
        landed: bool,
    },
    /// Decode → router: output tokens of a request the transfer handed over, numbered from the
    /// first output token (which the prefill side sampled) so that a gap is seen; `finish` ends
    /// the request. `logprobs` is empty when the request did not ask for them, else one per
    /// token, of that token (the codec refuses any other shape).
    Tokens {
        key: TransferKey,
        request: RequestId,
        index: u32,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        /// With the first tokens of a request that asked (index 0): its prompt's tokens'
        /// log-probabilities from the second on, which go out ahead of the tokens. Else empty.
        prompt_logprobs: Vec<TokenLogprobs>,
        finish: Option<FinishReason>,
    },
    /// Router → decode: stop generating this request (the client went away, or the router
    /// follows another transfer of it). Answered by nothing: tokens that still come get another.
    Cancel {
        key: TransferKey,
        request: RequestId,
    },
}

impl Message {
    /// The lane the message travels on; `None` for the link's own messages, which go on either.
    pub fn lane(&self) -> Option<Lane> {
        match self {
            Message::Hello { .. }
            | Message::LinkRefused { .. }
            | Message::Ping { .. }
            | Message::Pong { .. } => None,
            Message::KvWrite { .. } | Message::KvWriteAck { .. } => Some(Lane::Kv),
            _ => Some(Lane::Control),
        }
    }

    /// The transfer the message is about; `None` for the link's own messages.
    pub fn key(&self) -> Option<TransferKey> {
        Some(match self {
            Message::Hello { .. }
            | Message::LinkRefused { .. }
            | Message::Ping { .. }
            | Message::Pong { .. } => return None,
            Message::Reserve { key, .. }
            | Message::Prepare { key, .. }
            | Message::Heartbeat { key, .. }
            | Message::LeaseGrant { key, .. }
            | Message::Done { key, .. }
            | Message::DoneAck { key }
            | Message::Abort { key, .. }
            | Message::AbortAck { key }
            | Message::Outcome { key, .. }
            | Message::TransferLive { key }
            | Message::KvWrite { key, .. }
            | Message::KvWriteAck { key, .. }
            | Message::Tokens { key, .. }
            | Message::Cancel { key, .. } => *key,
        })
    }
}

/// A message with its sender and addressee. A worker drops an envelope addressed to another
/// incarnation of itself: that is how a restarted worker ignores traffic meant for its past.
#[derive(Clone, PartialEq, Debug)]
pub struct Envelope {
    pub from: Endpoint,
    pub to: Endpoint,
    pub body: Message,
}
