//! Frames: `[length: u32 LE][version: u8][kind: u8][from][to][body]`, where the length counts
//! every byte after itself. A reader of a byte stream asks `frame_len` whether a whole frame has
//! arrived, then `decode_frame` on exactly that frame.
//!
//! Our own format rather than postcard or bincode: core/ takes std and serde only (DESIGN.md
//! section 2), the format is small enough to read in one sitting, every length is bounded before
//! it is allocated, and the version byte lets a mixed-version deployment refuse cleanly.

use super::codec::{Reader, WireError, Writer};
use super::messages::*;
use crate::model::{Grammar, SamplingSpec, TokenLogprobs};
use crate::sched::{FinishReason, RequestId};

/// The version this build writes and reads.
pub const WIRE_VERSION: u8 = 8;
/// Largest frame, header included: a KV write of a large page with room to spare.
pub const FRAME_BYTES_MAX: usize = 64 << 20;
pub const PROMPT_TOKENS_MAX: usize = 1 << 24;
pub const STOP_TOKENS_MAX: usize = 64;
/// Tokens a request's `logit_bias` may name (OpenAI documents 300).
pub const LOGIT_BIAS_MAX: usize = 300;
/// Bytes of a request's grammar text (a JSON Schema or a Lark grammar).
pub const GRAMMAR_BYTES_MAX: usize = 256 << 10;
pub const PAGES_MAX: usize = 1 << 22;
/// Output tokens in one `Tokens` message: a step's worth, with room to spare.
pub const TOKENS_PER_MESSAGE_MAX: usize = 1 << 16;
const HEADER_BYTES: usize = 4;

/// Encodes an envelope as one frame, appended to `out`. Refuses what every peer's decoder would
/// refuse, so that a bound broken here is a clear error at the sender, not a dropped link at the
/// receiver.
pub fn encode_frame(envelope: &Envelope, out: Vec<u8>) -> Result<Vec<u8>, WireError> {
    check_bounds(&envelope.body)?;
    let mut w = Writer::with_buffer(out);
    let start = w.len();
    w.u32_fixed(0);
    w.u8(WIRE_VERSION);
    w.u8(kind(&envelope.body));
    endpoint(&mut w, envelope.from);
    endpoint(&mut w, envelope.to);
    body(&mut w, &envelope.body);
    let len = w.len() - start - HEADER_BYTES;
    if len > FRAME_BYTES_MAX {
        return Err(WireError::TooLong {
            what: "frame",
            len: len as u64,
            max: FRAME_BYTES_MAX as u64,
        });
    }
    w.patch_u32_fixed(start, len as u32);
    Ok(w.into_bytes())
}

/// The bounds `decode_frame` holds a message's sequences to.
fn check_bounds(message: &Message) -> Result<(), WireError> {
    let bound = |what: &'static str, len: usize, max: usize| {
        if len > max {
            Err(WireError::TooLong { what, len: len as u64, max: max as u64 })
        } else {
            Ok(())
        }
    };
    let spec = |request: &RequestSpec| {
        bound("prompt", request.prompt.len(), PROMPT_TOKENS_MAX)?;
        bound("stop tokens", request.stop_token_ids.len(), STOP_TOKENS_MAX)?;
        let sampling = &request.sampling;
        finite_penalty("presence penalty", sampling.presence_penalty)?;
        finite_penalty("frequency penalty", sampling.frequency_penalty)?;
        finite_penalty("repetition penalty", sampling.repetition_penalty)?;
        bound("logit bias", request.logit_bias.len(), LOGIT_BIAS_MAX)?;
        for &(_, bias) in &request.logit_bias {
            finite_penalty("logit bias", bias)?;
        }
        let grammar = request.grammar.as_ref().map_or(0, |g| g.text().len());
        bound("grammar", grammar, GRAMMAR_BYTES_MAX)?;
        let top = request.logprobs.max(request.prompt_logprobs).map_or(0, usize::from);
        bound("top logprobs", top, TOP_LOGPROBS_MAX)
    };
    let prompt_scores = |scores: &[TokenLogprobs]| {
        bound("prompt logprobs", scores.len(), PROMPT_TOKENS_MAX)?;
        scores.iter().try_for_each(|l| check_logprobs(l.token, l))
    };
    match message {
        Message::Reserve { request, .. } => spec(request),
        Message::Prepare { request, pages, .. } => {
            spec(request)?;
            bound("pages", pages.len(), PAGES_MAX)
        }
        Message::KvWrite { data, .. } => bound("kv data", data.len(), FRAME_BYTES_MAX),
        Message::Tokens { tokens, logprobs, prompt_logprobs, index, .. } => {
            bound("tokens", tokens.len(), TOKENS_PER_MESSAGE_MAX)?;
            if *index != 0 && !prompt_logprobs.is_empty() {
                let value = u64::from(*index);
                return Err(WireError::Invalid { what: "prompt logprobs past index 0", value });
            }
            prompt_scores(prompt_logprobs)?;
            if !logprobs.is_empty() && logprobs.len() != tokens.len() {
                let value = logprobs.len() as u64;
                return Err(WireError::Invalid { what: "logprobs beside the tokens", value });
            }
            tokens.iter().zip(logprobs).try_for_each(|(&token, l)| check_logprobs(token, l))
        }
        Message::Done { first_token, first_logprobs, prompt_logprobs, .. } => {
            prompt_scores(prompt_logprobs)?;
            first_logprobs.as_ref().map_or(Ok(()), |l| check_logprobs(*first_token, l))
        }
        _ => Ok(()),
    }
}

/// A token's log-probabilities travel without their token (the message names it once), so they
/// must be of that token; and their values are what a log-softmax gives, never NaN.
fn check_logprobs(token: u32, logprobs: &TokenLogprobs) -> Result<(), WireError> {
    if logprobs.token != token {
        let value = u64::from(logprobs.token);
        return Err(WireError::Invalid { what: "logprobs of another token", value });
    }
    if logprobs.top.len() > TOP_LOGPROBS_MAX {
        let (len, max) = (logprobs.top.len() as u64, TOP_LOGPROBS_MAX as u64);
        return Err(WireError::TooLong { what: "top logprobs", len, max });
    }
    std::iter::once(logprobs.logprob)
        .chain(logprobs.top.iter().map(|&(_, l)| l))
        .try_for_each(|l| not_nan("logprob", l).map(|_| ()))
}

/// How many bytes the frame at the start of `buf` takes, once its length prefix has arrived;
/// `Ok(None)` while it has not. A length over `FRAME_BYTES_MAX` is an error: the stream is
/// garbage or hostile and should be closed.
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, WireError> {
    let Some(prefix) = buf.first_chunk::<HEADER_BYTES>() else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(*prefix) as usize;
    if len > FRAME_BYTES_MAX {
        return Err(WireError::TooLong {
            what: "frame",
            len: len as u64,
            max: FRAME_BYTES_MAX as u64,
        });
    }
    Ok(Some(HEADER_BYTES + len))
}

/// Decodes exactly one frame (as delimited by `frame_len`).
pub fn decode_frame(frame: &[u8]) -> Result<Envelope, WireError> {
    let mut r = Reader::new(frame);
    let len = r.u32_fixed("frame length")? as usize;
    if len != r.remaining() {
        return Err(WireError::Invalid { what: "frame length", value: len as u64 });
    }
    let version = r.u8("version")?;
    if version != WIRE_VERSION {
        return Err(WireError::UnsupportedVersion { got: version, supported: WIRE_VERSION });
    }
    let kind = r.u8("kind")?;
    let from = read_endpoint(&mut r)?;
    let to = read_endpoint(&mut r)?;
    let body = read_body(&mut r, kind)?;
    r.finish()?;
    Ok(Envelope { from, to, body })
}

fn kind(message: &Message) -> u8 {
    match message {
        Message::Reserve { .. } => 1,
        Message::Prepare { .. } => 2,
        Message::Heartbeat { .. } => 3,
        Message::LeaseGrant { .. } => 4,
        Message::Done { .. } => 5,
        Message::DoneAck { .. } => 6,
        Message::Abort { .. } => 7,
        Message::AbortAck { .. } => 8,
        Message::Outcome { .. } => 9,
        Message::KvWrite { .. } => 10,
        Message::Hello { .. } => 11,
        Message::LinkRefused { .. } => 12,
        Message::Ping { .. } => 13,
        Message::Pong { .. } => 14,
        Message::Tokens { .. } => 15,
        Message::Cancel { .. } => 16,
        Message::KvWriteAck { .. } => 17,
        Message::TransferLive { .. } => 18,
    }
}

fn body(w: &mut Writer, message: &Message) {
    if let Some(key) = message.key() {
        transfer_key(w, key);
    }
    match message {
        Message::Hello { identity, lane, places } => {
            link_identity(w, identity);
            w.u8(match lane {
                Lane::Control => 1,
                Lane::Kv => 2,
            });
            w.u32(*places);
        }
        Message::LinkRefused { mismatch } => w.u8(link_mismatch(*mismatch)),
        Message::Ping { nonce } | Message::Pong { nonce } => w.u64(*nonce),
        Message::Tokens { request, index, tokens, logprobs, prompt_logprobs, finish, .. } => {
            w.u64(request.0);
            w.u32(*index);
            w.u32s(tokens);
            w.bool(!logprobs.is_empty());
            for l in logprobs {
                token_logprobs(w, l);
            }
            prompt_scores(w, prompt_logprobs);
            finish_reason(w, *finish);
        }
        Message::Cancel { request, .. } => w.u64(request.0),
        Message::KvWriteAck { page, landed, .. } => {
            page_slot(w, *page);
            w.bool(*landed);
        }
        Message::Reserve { request, prefill, .. } => {
            request_spec(w, request);
            endpoint(w, *prefill);
        }
        Message::Prepare { request, cached_tokens, page_tokens, pages, lease_ms, .. } => {
            request_spec(w, request);
            w.u32(*cached_tokens);
            w.u32(*page_tokens);
            w.u64(pages.len() as u64);
            for page in pages {
                page_slot(w, *page);
            }
            w.u32(*lease_ms);
        }
        Message::DoneAck { .. } | Message::AbortAck { .. } | Message::TransferLive { .. } => {}
        Message::Heartbeat { seq, progress, .. } => {
            w.u32(*seq);
            w.u32(*progress);
        }
        Message::LeaseGrant { seq, lease_ms, .. } => {
            w.u32(*seq);
            w.u32(*lease_ms);
        }
        Message::Done { first_token, pages_written, first_logprobs, prompt_logprobs, .. } => {
            w.u32(*first_token);
            w.u32(*pages_written);
            w.bool(first_logprobs.is_some());
            if let Some(l) = first_logprobs {
                token_logprobs(w, l);
            }
            prompt_scores(w, prompt_logprobs);
        }
        Message::Abort { reason, .. } => w.u8(abort_reason(*reason)),
        Message::Outcome { failure, .. } => match failure {
            None => w.u8(0),
            Some(reason) => w.u8(abort_reason(*reason)),
        },
        Message::KvWrite { page, first_token, data, .. } => {
            page_slot(w, *page);
            w.u32(*first_token);
            w.bytes(data);
        }
    }
}

fn read_body(r: &mut Reader<'_>, kind: u8) -> Result<Message, WireError> {
    match kind {
        11 => {
            let identity = read_link_identity(r)?;
            let lane = match r.u8("lane")? {
                1 => Lane::Control,
                2 => Lane::Kv,
                value => return Err(WireError::Invalid { what: "lane", value: u64::from(value) }),
            };
            let places = r.u32("places")?;
            return Ok(Message::Hello { identity, lane, places });
        }
        12 => return Ok(Message::LinkRefused { mismatch: read_link_mismatch(r.u8("mismatch")?)? }),
        13 => return Ok(Message::Ping { nonce: r.u64("nonce")? }),
        14 => return Ok(Message::Pong { nonce: r.u64("nonce")? }),
        _ => {}
    }
    let key = read_transfer_key(r)?;
    Ok(match kind {
        1 => Message::Reserve { key, request: read_request_spec(r)?, prefill: read_endpoint(r)? },
        2 => {
            let request = read_request_spec(r)?;
            let cached_tokens = r.u32("cached tokens")?;
            let page_tokens = r.u32("page tokens")?;
            if page_tokens == 0 {
                return Err(WireError::Invalid { what: "page tokens", value: 0 });
            }
            let count = r.len("pages", PAGES_MAX, 2)?;
            let mut pages = Vec::with_capacity(count);
            for _ in 0..count {
                pages.push(read_page_slot(r)?);
            }
            let lease_ms = r.u32("lease")?;
            Message::Prepare { key, request, cached_tokens, page_tokens, pages, lease_ms }
        }
        3 => Message::Heartbeat {
            key,
            seq: r.u32("heartbeat seq")?,
            progress: r.u32("heartbeat progress")?,
        },
        4 => Message::LeaseGrant { key, seq: r.u32("heartbeat seq")?, lease_ms: r.u32("lease")? },
        5 => {
            let first_token = r.u32("first token")?;
            let pages_written = r.u32("pages written")?;
            let first_logprobs = match r.bool("first logprobs")? {
                true => Some(read_token_logprobs(r, first_token)?),
                false => None,
            };
            let prompt_logprobs = read_prompt_scores(r)?;
            Message::Done { key, first_token, pages_written, first_logprobs, prompt_logprobs }
        }
        6 => Message::DoneAck { key },
        7 => Message::Abort { key, reason: read_abort_reason(r.u8("abort reason")?)? },
        8 => Message::AbortAck { key },
        18 => Message::TransferLive { key },
        9 => {
            let failure = match r.u8("outcome")? {
                0 => None,
                code => Some(read_abort_reason(code)?),
            };
            Message::Outcome { key, failure }
        }
        10 => {
            let page = read_page_slot(r)?;
            let first_token = r.u32("first token")?;
            let data = r.bytes("kv data", FRAME_BYTES_MAX)?.to_vec();
            Message::KvWrite { key, page, first_token, data }
        }
        15 => {
            let request = RequestId(r.u64("request id")?);
            let index = r.u32("token index")?;
            let tokens = r.u32s("tokens", TOKENS_PER_MESSAGE_MAX)?;
            let logprobs = match r.bool("logprobs")? {
                // One encoding per message: no tokens carry no log-probabilities, so the flag that
                // says they do is refused rather than read as an empty list.
                true if tokens.is_empty() => {
                    return Err(WireError::Invalid { what: "logprobs of no tokens", value: 0 });
                }
                true => {
                    tokens.iter().map(|&t| read_token_logprobs(r, t)).collect::<Result<_, _>>()?
                }
                false => Vec::new(),
            };
            let prompt_logprobs = read_prompt_scores(r)?;
            if index != 0 && !prompt_logprobs.is_empty() {
                let value = u64::from(index);
                return Err(WireError::Invalid { what: "prompt logprobs past index 0", value });
            }
            let finish = read_finish_reason(r)?;
            Message::Tokens { key, request, index, tokens, logprobs, prompt_logprobs, finish }
        }
        16 => Message::Cancel { key, request: RequestId(r.u64("request id")?) },
        17 => Message::KvWriteAck { key, page: read_page_slot(r)?, landed: r.bool("landed")? },
        other => return Err(WireError::UnknownKind(other)),
    })
}

fn endpoint(w: &mut Writer, e: Endpoint) {
    w.u32(e.worker.0);
    w.u64(e.incarnation.0);
}

fn read_endpoint(r: &mut Reader<'_>) -> Result<Endpoint, WireError> {
    Ok(Endpoint {
        worker: WorkerId(r.u32("worker")?),
        incarnation: Incarnation(r.u64("incarnation")?),
    })
}

fn transfer_key(w: &mut Writer, key: TransferKey) {
    w.u64(key.transfer.0);
    w.u32(key.epoch.0);
}

fn read_transfer_key(r: &mut Reader<'_>) -> Result<TransferKey, WireError> {
    Ok(TransferKey { transfer: TransferId(r.u64("transfer")?), epoch: Epoch(r.u32("epoch")?) })
}

fn page_slot(w: &mut Writer, page: PageSlot) {
    w.u32(page.index);
    w.u32(page.generation);
}

fn read_page_slot(r: &mut Reader<'_>) -> Result<PageSlot, WireError> {
    Ok(PageSlot { index: r.u32("page index")?, generation: r.u32("page generation")? })
}

fn request_spec(w: &mut Writer, spec: &RequestSpec) {
    w.u64(spec.id.0);
    w.u32s(&spec.prompt);
    w.u32(spec.max_tokens);
    w.u32s(&spec.stop_token_ids);
    w.bool(spec.ignore_eos);
    w.i32(spec.priority);
    w.u64(spec.cache_salt);
    w.f32(spec.sampling.temperature);
    w.f32(spec.sampling.top_p);
    w.u32(spec.sampling.top_k);
    w.u64(spec.sampling.seed);
    w.f32(spec.sampling.presence_penalty);
    w.f32(spec.sampling.frequency_penalty);
    w.f32(spec.sampling.min_p);
    w.f32(spec.sampling.repetition_penalty);
    w.u64(spec.logit_bias.len() as u64);
    for &(token, bias) in &spec.logit_bias {
        w.u32(token);
        w.f32(bias);
    }
    let (kind, text) = match spec.grammar.as_deref() {
        None => (0, ""),
        Some(Grammar::JsonObject) => (1, ""),
        Some(Grammar::JsonSchema(schema)) => (2, schema.as_str()),
        Some(Grammar::Lark(lark)) => (3, lark.as_str()),
    };
    w.u8(kind);
    w.bytes(text.as_bytes());
    // 0 for none, else one more than the number of top alternatives.
    w.u8(spec.logprobs.map_or(0, |top| top + 1));
    w.u8(spec.prompt_logprobs.map_or(0, |top| top + 1));
}

fn read_request_spec(r: &mut Reader<'_>) -> Result<RequestSpec, WireError> {
    Ok(RequestSpec {
        id: RequestId(r.u64("request id")?),
        prompt: r.u32s("prompt", PROMPT_TOKENS_MAX)?,
        max_tokens: r.u32("max tokens")?,
        stop_token_ids: r.u32s("stop tokens", STOP_TOKENS_MAX)?,
        ignore_eos: r.bool("ignore eos")?,
        priority: r.i32("priority")?,
        cache_salt: r.u64("cache salt")?,
        sampling: Sampling {
            temperature: r.f32("temperature")?,
            top_p: r.f32("top p")?,
            top_k: r.u32("top k")?,
            seed: r.u64("seed")?,
            presence_penalty: read_penalty(r, "presence penalty")?,
            frequency_penalty: read_penalty(r, "frequency penalty")?,
            min_p: r.f32("min p")?,
            repetition_penalty: read_penalty(r, "repetition penalty")?,
        },
        logit_bias: read_logit_bias(r)?,
        grammar: read_grammar(r)?,
        logprobs: read_top(r, "logprobs")?,
        prompt_logprobs: read_top(r, "prompt logprobs")?,
    })
}

/// 0 for none, else one more than a number of top alternatives.
fn read_top(r: &mut Reader<'_>, what: &'static str) -> Result<Option<u8>, WireError> {
    match r.u8(what)? {
        0 => Ok(None),
        n if usize::from(n - 1) <= TOP_LOGPROBS_MAX => Ok(Some(n - 1)),
        n => Err(WireError::Invalid { what: "top logprobs", value: u64::from(n - 1) }),
    }
}

/// A prompt's scores: each with its token (the message names no prompt token).
fn prompt_scores(w: &mut Writer, scores: &[TokenLogprobs]) {
    w.u64(scores.len() as u64);
    for l in scores {
        w.u32(l.token);
        token_logprobs(w, l);
    }
}

fn read_prompt_scores(r: &mut Reader<'_>) -> Result<Vec<TokenLogprobs>, WireError> {
    // Each is at least a one-byte token, a four-byte logprob and a one-byte count.
    let len = r.len("prompt logprobs", PROMPT_TOKENS_MAX, 6)?;
    (0..len)
        .map(|_| {
            let token = r.u32("scored token")?;
            read_token_logprobs(r, token)
        })
        .collect()
}

const TOP_LOGPROBS_MAX: usize = SamplingSpec::TOP_LOGPROBS_MAX as usize;

/// A token's log-probabilities less the token, which the message names beside them.
fn token_logprobs(w: &mut Writer, logprobs: &TokenLogprobs) {
    w.f32(logprobs.logprob);
    w.u64(logprobs.top.len() as u64);
    for &(token, logprob) in &logprobs.top {
        w.u32(token);
        w.f32(logprob);
    }
}

fn read_token_logprobs(r: &mut Reader<'_>, token: u32) -> Result<TokenLogprobs, WireError> {
    let logprob = not_nan("logprob", r.f32("logprob")?)?;
    // Each alternative is at least a one-byte token and a four-byte logprob.
    let len = r.len("top logprobs", TOP_LOGPROBS_MAX, 5)?;
    let top = (0..len)
        .map(|_| Ok((r.u32("top token")?, not_nan("top logprob", r.f32("top logprob")?)?)))
        .collect::<Result<_, WireError>>()?;
    Ok(TokenLogprobs { token, logprob, top })
}

/// A log-probability may be minus infinity (a token the model rules out) but never NaN.
fn not_nan(what: &'static str, value: f32) -> Result<f32, WireError> {
    match value.is_nan() {
        true => Err(WireError::Invalid { what, value: u64::from(value.to_bits()) }),
        false => Ok(value),
    }
}

fn read_grammar(r: &mut Reader<'_>) -> Result<Option<Box<Grammar>>, WireError> {
    let kind = r.u8("grammar kind")?;
    let text = r.bytes("grammar", GRAMMAR_BYTES_MAX)?;
    let text = std::str::from_utf8(text).map_err(|e| WireError::Invalid {
        what: "grammar text (UTF-8)",
        value: e.valid_up_to() as u64,
    })?;
    let empty = |grammar| match text.is_empty() {
        true => Ok(grammar),
        false => Err(WireError::Invalid { what: "grammar text of a JSON object", value: 0 }),
    };
    match kind {
        0 => empty(None),
        1 => empty(Some(Box::new(Grammar::JsonObject))),
        2 => Ok(Some(Box::new(Grammar::JsonSchema(text.to_owned())))),
        3 => Ok(Some(Box::new(Grammar::Lark(text.to_owned())))),
        other => Err(WireError::Invalid { what: "grammar kind", value: u64::from(other) }),
    }
}

fn read_logit_bias(r: &mut Reader<'_>) -> Result<Vec<(u32, f32)>, WireError> {
    // Each entry is at least a one-byte token and a four-byte bias.
    let len = r.len("logit bias", LOGIT_BIAS_MAX, 5)?;
    (0..len).map(|_| Ok((r.u32("biased token")?, read_penalty(r, "logit bias")?))).collect()
}

/// A penalty or bias is added to logits: NaN or an infinity would make them NaN or infinite, so
/// it is refused on both sides of the wire (the HTTP edge bounds penalties to [-2, 2], biases to
/// [-100, 100]).
fn finite_penalty(what: &'static str, value: f32) -> Result<f32, WireError> {
    match value.is_finite() {
        true => Ok(value),
        false => Err(WireError::Invalid { what, value: u64::from(value.to_bits()) }),
    }
}

fn read_penalty(r: &mut Reader<'_>, what: &'static str) -> Result<f32, WireError> {
    finite_penalty(what, r.f32(what)?)
}

fn abort_reason(reason: AbortReason) -> u8 {
    match reason {
        AbortReason::Client => 1,
        AbortReason::Router => 2,
        AbortReason::PrefillFailed => 3,
        AbortReason::DecodeFailed => 4,
        AbortReason::Timeout => 5,
        AbortReason::PeerRestarted => 6,
        AbortReason::DecodeBusy => 7,
        AbortReason::QueueTimeout => 8,
        AbortReason::PrefillBusy => 9,
    }
}

fn read_abort_reason(code: u8) -> Result<AbortReason, WireError> {
    Ok(match code {
        1 => AbortReason::Client,
        2 => AbortReason::Router,
        3 => AbortReason::PrefillFailed,
        4 => AbortReason::DecodeFailed,
        5 => AbortReason::Timeout,
        6 => AbortReason::PeerRestarted,
        7 => AbortReason::DecodeBusy,
        8 => AbortReason::QueueTimeout,
        9 => AbortReason::PrefillBusy,
        value => return Err(WireError::Invalid { what: "abort reason", value: u64::from(value) }),
    })
}

fn link_identity(w: &mut Writer, identity: &LinkIdentity) {
    w.u8(match identity.role {
        Role::Router => 1,
        Role::Prefill => 2,
        Role::Decode => 3,
    });
    w.u32(identity.page_tokens);
    w.u32(identity.kv_layout.layers);
    w.u32(identity.kv_layout.kv_heads);
    w.u32(identity.kv_layout.head_dim);
    w.u32(identity.kv_layout.element_bytes);
    w.u64(identity.model);
}

fn read_link_identity(r: &mut Reader<'_>) -> Result<LinkIdentity, WireError> {
    let role = match r.u8("role")? {
        1 => Role::Router,
        2 => Role::Prefill,
        3 => Role::Decode,
        value => return Err(WireError::Invalid { what: "role", value: u64::from(value) }),
    };
    Ok(LinkIdentity {
        role,
        page_tokens: r.u32("page tokens")?,
        kv_layout: KvLayout {
            layers: r.u32("layers")?,
            kv_heads: r.u32("kv heads")?,
            head_dim: r.u32("head dim")?,
            element_bytes: r.u32("element bytes")?,
        },
        model: r.u64("model")?,
    })
}

fn link_mismatch(mismatch: LinkMismatch) -> u8 {
    match mismatch {
        LinkMismatch::Roles => 1,
        LinkMismatch::PageTokens => 2,
        LinkMismatch::KvLayout => 3,
        LinkMismatch::Model => 4,
    }
}

fn read_link_mismatch(code: u8) -> Result<LinkMismatch, WireError> {
    Ok(match code {
        1 => LinkMismatch::Roles,
        2 => LinkMismatch::PageTokens,
        3 => LinkMismatch::KvLayout,
        4 => LinkMismatch::Model,
        value => return Err(WireError::Invalid { what: "link mismatch", value: u64::from(value) }),
    })
}

/// `0` for none, else a code and, for the two reasons that name a token, the token.
fn finish_reason(w: &mut Writer, finish: Option<FinishReason>) {
    match finish {
        None => w.u8(0),
        Some(FinishReason::Length) => w.u8(1),
        Some(FinishReason::ContextLength) => w.u8(2),
        Some(FinishReason::EndOfSequence(token)) => {
            w.u8(3);
            w.u32(token);
        }
        Some(FinishReason::StopToken(token)) => {
            w.u8(4);
            w.u32(token);
        }
        Some(FinishReason::Aborted) => w.u8(5),
        Some(FinishReason::QueueTimeout) => w.u8(6),
        Some(FinishReason::StepFailed) => w.u8(7),
    }
}

fn read_finish_reason(r: &mut Reader<'_>) -> Result<Option<FinishReason>, WireError> {
    Ok(Some(match r.u8("finish reason")? {
        0 => return Ok(None),
        1 => FinishReason::Length,
        2 => FinishReason::ContextLength,
        3 => FinishReason::EndOfSequence(r.u32("eos token")?),
        4 => FinishReason::StopToken(r.u32("stop token")?),
        5 => FinishReason::Aborted,
        6 => FinishReason::QueueTimeout,
        7 => FinishReason::StepFailed,
        value => return Err(WireError::Invalid { what: "finish reason", value: u64::from(value) }),
    }))
}
