//! Round trips of every message, and bad bytes of every kind refused without a panic.

use proptest::prelude::*;

use super::*;
use crate::model::{Grammar, SamplingSpec, TokenLogprobs};
use crate::sched::{FinishReason, RequestId};

fn endpoint() -> impl Strategy<Value = Endpoint> {
    (any::<u32>(), any::<u64>())
        .prop_map(|(w, i)| Endpoint { worker: WorkerId(w), incarnation: Incarnation(i) })
}

fn key() -> impl Strategy<Value = TransferKey> {
    (any::<u64>(), any::<u32>())
        .prop_map(|(t, e)| TransferKey { transfer: TransferId(t), epoch: Epoch(e) })
}

fn page() -> impl Strategy<Value = PageSlot> {
    (any::<u32>(), any::<u32>()).prop_map(|(index, generation)| PageSlot { index, generation })
}

fn reason() -> impl Strategy<Value = AbortReason> {
    prop_oneof![
        Just(AbortReason::Client),
        Just(AbortReason::Router),
        Just(AbortReason::PrefillFailed),
        Just(AbortReason::DecodeFailed),
        Just(AbortReason::Timeout),
        Just(AbortReason::PeerRestarted),
        Just(AbortReason::DecodeBusy),
        Just(AbortReason::QueueTimeout),
        Just(AbortReason::PrefillBusy),
    ]
}

fn spec() -> impl Strategy<Value = RequestSpec> {
    (
        any::<u64>(),
        prop::collection::vec(any::<u32>(), 0..40),
        any::<u32>(),
        prop::collection::vec(any::<u32>(), 0..STOP_TOKENS_MAX),
        any::<bool>(),
        any::<i32>(),
        any::<u64>(),
        (
            -1e6f32..1e6,
            0f32..1.0,
            any::<u32>(),
            any::<u64>(),
            -2f32..2.0,
            -1e30f32..1e30,
            0f32..1.0,
        ),
        prop::collection::vec((any::<u32>(), -100f32..100.0), 0..8),
        (
            grammar(),
            prop::option::of(0..=SamplingSpec::TOP_LOGPROBS_MAX),
            prop::option::of(0..=SamplingSpec::TOP_LOGPROBS_MAX),
        ),
    )
        .prop_map(
            |(
                id,
                prompt,
                max_tokens,
                stop_token_ids,
                ignore_eos,
                priority,
                cache_salt,
                (t, p, k, s, presence, frequency, min_p),
                logit_bias,
                (grammar, logprobs, prompt_logprobs),
            )| RequestSpec {
                id: RequestId(id),
                prompt,
                max_tokens,
                stop_token_ids,
                ignore_eos,
                priority,
                cache_salt,
                sampling: Sampling {
                    temperature: t,
                    top_p: p,
                    top_k: k,
                    seed: s,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    min_p,
                    repetition_penalty: 1.25,
                },
                logit_bias,
                grammar,
                logprobs,
                prompt_logprobs,
            },
        )
}

/// A prompt's scores: each of its own token.
fn prompt_scores() -> impl Strategy<Value = Vec<TokenLogprobs>> {
    prop::collection::vec(any::<u32>(), 0..12)
        .prop_flat_map(|tokens| tokens.into_iter().map(logprobs_of).collect::<Vec<_>>())
}

/// Log-probabilities of `token`: any value but NaN, minus infinity included.
fn logprobs_of(token: u32) -> impl Strategy<Value = TokenLogprobs> {
    let logprob = prop_oneof![9 => -1e4f32..=0.0, 1 => Just(f32::NEG_INFINITY)];
    let top_len = 0..=usize::from(SamplingSpec::TOP_LOGPROBS_MAX);
    (logprob.clone(), prop::collection::vec((any::<u32>(), logprob), top_len))
        .prop_map(move |(logprob, top)| TokenLogprobs { token, logprob, top })
}

/// Tokens with none, or with one each.
fn tokens_and_logprobs() -> impl Strategy<Value = (Vec<u32>, Vec<TokenLogprobs>)> {
    (prop::collection::vec(any::<u32>(), 0..40), any::<bool>()).prop_flat_map(|(tokens, asked)| {
        let logprobs: Vec<_> = tokens.iter().map(|&t| logprobs_of(t)).collect();
        let count = if asked { tokens.len() } else { 0 };
        (Just(tokens), logprobs).prop_map(move |(tokens, mut logprobs)| {
            logprobs.truncate(count);
            (tokens, logprobs)
        })
    })
}

fn grammar() -> impl Strategy<Value = Option<Box<Grammar>>> {
    prop_oneof![
        Just(None),
        Just(Some(Box::new(Grammar::JsonObject))),
        ".{0,40}".prop_map(|schema| Some(Box::new(Grammar::JsonSchema(schema)))),
        ".{0,40}".prop_map(|lark| Some(Box::new(Grammar::Lark(lark)))),
    ]
}

fn identity() -> impl Strategy<Value = LinkIdentity> {
    (
        prop_oneof![Just(Role::Router), Just(Role::Prefill), Just(Role::Decode)],
        any::<u32>(),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()),
        any::<u64>(),
    )
        .prop_map(|(role, page_tokens, (layers, kv_heads, head_dim, element_bytes), model)| {
            LinkIdentity {
                role,
                page_tokens,
                kv_layout: KvLayout { layers, kv_heads, head_dim, element_bytes },
                model,
            }
        })
}

fn finish() -> impl Strategy<Value = Option<FinishReason>> {
    prop::option::of(prop_oneof![
        Just(FinishReason::Length),
        Just(FinishReason::ContextLength),
        any::<u32>().prop_map(FinishReason::EndOfSequence),
        any::<u32>().prop_map(FinishReason::StopToken),
        Just(FinishReason::Aborted),
        Just(FinishReason::QueueTimeout),
        Just(FinishReason::StepFailed),
    ])
}

/// The link's own messages and those about a request after its transfer.
fn link_or_request_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (identity(), prop_oneof![Just(Lane::Control), Just(Lane::Kv)], any::<u32>())
            .prop_map(|(identity, lane, places)| Message::Hello { identity, lane, places }),
        prop_oneof![
            Just(LinkMismatch::Roles),
            Just(LinkMismatch::PageTokens),
            Just(LinkMismatch::KvLayout),
            Just(LinkMismatch::Model),
        ]
        .prop_map(|mismatch| Message::LinkRefused { mismatch }),
        any::<u64>().prop_map(|nonce| Message::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Message::Pong { nonce }),
        (key(), any::<u64>(), any::<u32>(), tokens_and_logprobs(), prompt_scores(), finish())
            .prop_map(|(key, request, index, (tokens, logprobs), prompt_logprobs, finish)| {
                // Scores of the prompt come with the first tokens only.
                let index = if prompt_logprobs.is_empty() { index } else { 0 };
                Message::Tokens {
                    key,
                    request: RequestId(request),
                    index,
                    tokens,
                    logprobs,
                    prompt_logprobs,
                    finish,
                }
            }),
        (key(), any::<u64>())
            .prop_map(|(key, request)| Message::Cancel { key, request: RequestId(request) }),
        (key(), page(), any::<bool>()).prop_map(|(key, page, landed)| Message::KvWriteAck {
            key,
            page,
            landed
        }),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        link_or_request_message(),
        (key(), spec(), endpoint()).prop_map(|(key, request, prefill)| Message::Reserve {
            key,
            request,
            prefill
        }),
        (
            key(),
            spec(),
            any::<u32>(),
            1..u32::MAX,
            prop::collection::vec(page(), 0..20),
            any::<u32>()
        )
            .prop_map(|(key, request, cached_tokens, page_tokens, pages, lease_ms)| {
                Message::Prepare { key, request, cached_tokens, page_tokens, pages, lease_ms }
            }),
        (key(), any::<u32>(), any::<u32>()).prop_map(|(key, seq, progress)| Message::Heartbeat {
            key,
            seq,
            progress
        }),
        (key(), any::<u32>(), any::<u32>()).prop_map(|(key, seq, lease_ms)| Message::LeaseGrant {
            key,
            seq,
            lease_ms
        }),
        (key(), any::<u32>(), any::<u32>()).prop_flat_map(|(key, first_token, pages_written)| {
            let logprobs = prop::option::of(logprobs_of(first_token));
            (logprobs, prompt_scores()).prop_map(move |(first_logprobs, prompt_logprobs)| {
                Message::Done { key, first_token, pages_written, first_logprobs, prompt_logprobs }
            })
        }),
        key().prop_map(|key| Message::DoneAck { key }),
        (key(), reason()).prop_map(|(key, reason)| Message::Abort { key, reason }),
        key().prop_map(|key| Message::AbortAck { key }),
        key().prop_map(|key| Message::TransferLive { key }),
        (key(), prop::option::of(reason()))
            .prop_map(|(key, failure)| Message::Outcome { key, failure }),
        (key(), page(), any::<u32>(), prop::collection::vec(any::<u8>(), 0..200)).prop_map(
            |(key, page, first_token, data)| Message::KvWrite { key, page, first_token, data }
        ),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (endpoint(), endpoint(), message()).prop_map(|(from, to, body)| Envelope { from, to, body })
}

proptest! {
    #[test]
    fn every_message_round_trips(envelope in envelope()) {
        let frame = encode_frame(&envelope, Vec::new()).unwrap();
        prop_assert_eq!(frame_len(&frame), Ok(Some(frame.len())));
        prop_assert_eq!(decode_frame(&frame), Ok(envelope));
    }

    #[test]
    fn every_truncation_is_an_error(envelope in envelope()) {
        let frame = encode_frame(&envelope, Vec::new()).unwrap();
        for cut in 0..frame.len() {
            prop_assert!(decode_frame(&frame[..cut]).is_err(), "a frame cut at {} decoded", cut);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = frame_len(&bytes);
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn frames_split_a_stream(envelopes in prop::collection::vec(envelope(), 1..5)) {
        let mut stream = Vec::new();
        for e in &envelopes {
            stream = encode_frame(e, stream).unwrap();
        }
        let mut decoded = Vec::new();
        let mut rest = stream.as_slice();
        while let Some(len) = frame_len(rest).unwrap() {
            decoded.push(decode_frame(&rest[..len]).unwrap());
            rest = &rest[len..];
        }
        prop_assert!(rest.is_empty());
        prop_assert_eq!(decoded, envelopes);
    }
}

fn sample() -> Envelope {
    let end = Endpoint { worker: WorkerId(1), incarnation: Incarnation(2) };
    Envelope {
        from: end,
        to: end,
        body: Message::Heartbeat {
            key: TransferKey { transfer: TransferId(3), epoch: Epoch(4) },
            seq: 5,
            progress: 6,
        },
    }
}

#[test]
fn bytes_are_pinned() {
    // A change here is a wire-format change: bump WIRE_VERSION.
    assert_eq!(
        encode_frame(&sample(), Vec::new()).unwrap(),
        vec![10, 0, 0, 0, 8, 3, 1, 2, 1, 2, 3, 4, 5, 6]
    );
}

#[test]
fn other_versions_and_kinds_are_refused() {
    let mut frame = encode_frame(&sample(), Vec::new()).unwrap();
    frame[4] = 3;
    assert_eq!(decode_frame(&frame), Err(WireError::UnsupportedVersion { got: 3, supported: 8 }));
    frame[4] = 8;
    frame[5] = 99;
    assert_eq!(decode_frame(&frame), Err(WireError::UnknownKind(99)));
}

/// The largest frame, `FRAME_BYTES_MAX` bytes after its length prefix, goes out and comes back;
/// one byte more is the sender's clear error, not a link its receiver drops.
#[test]
fn a_frame_of_exactly_the_largest_length_passes_and_one_byte_more_is_refused() {
    let end = Endpoint { worker: WorkerId(1), incarnation: Incarnation(2) };
    let write = |bytes: usize| Envelope {
        from: end,
        to: end,
        body: Message::KvWrite {
            key: TransferKey { transfer: TransferId(3), epoch: Epoch(4) },
            page: PageSlot { index: 5, generation: 6 },
            first_token: 7,
            data: vec![9; bytes],
        },
    };
    // What the frame holds besides its data, with a data length of as many varint bytes.
    let probe = 1 << 22;
    let overhead = encode_frame(&write(probe), Vec::new()).unwrap().len() - 4 - probe;
    let largest = encode_frame(&write(FRAME_BYTES_MAX - overhead), Vec::new()).unwrap();
    assert_eq!(frame_len(&largest), Ok(Some(4 + FRAME_BYTES_MAX)));
    assert_eq!(decode_frame(&largest), Ok(write(FRAME_BYTES_MAX - overhead)));
    let over = encode_frame(&write(FRAME_BYTES_MAX - overhead + 1), Vec::new());
    let max = FRAME_BYTES_MAX as u64;
    assert_eq!(over, Err(WireError::TooLong { what: "frame", len: max + 1, max }));
    // Data alone over the bound is named as such, before the frame is built.
    let data = encode_frame(&write(FRAME_BYTES_MAX + 1), Vec::new());
    assert_eq!(data, Err(WireError::TooLong { what: "kv data", len: max + 1, max }));
}

#[test]
fn huge_lengths_are_refused_before_allocating() {
    assert!(matches!(frame_len(&[0xff, 0xff, 0xff, 0xff]), Err(WireError::TooLong { .. })));
    assert_eq!(frame_len(&[1, 0]), Ok(None));
    // A Reserve whose prompt claims a billion tokens, in a frame of a few bytes: refused by the
    // length check, not by running out of memory.
    let mut w = Writer::new();
    w.u32_fixed(0);
    w.u8(WIRE_VERSION);
    w.u8(1);
    for _ in 0..2 {
        w.u32(1);
        w.u64(2);
    }
    w.u64(3); // transfer
    w.u32(4); // epoch
    w.u64(5); // request id
    w.u64(1 << 30); // prompt length
    let mut frame = w.into_bytes();
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    assert!(matches!(decode_frame(&frame), Err(WireError::TooLong { what: "prompt", .. })));
}

#[test]
fn a_length_that_disagrees_with_the_frame_is_refused() {
    let mut frame = encode_frame(&sample(), Vec::new()).unwrap();
    frame.push(0);
    assert!(matches!(decode_frame(&frame), Err(WireError::Invalid { what: "frame length", .. })));
}

#[test]
fn encode_refuses_what_every_decoder_refuses() {
    let key = TransferKey { transfer: TransferId(1), epoch: Epoch(0) };
    let mut request = RequestSpec::new(RequestId(1), vec![1, 2], 4);
    request.stop_token_ids = vec![7; STOP_TOKENS_MAX + 1];
    let prefill = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
    let envelope = |request: RequestSpec| Envelope {
        from: prefill,
        to: prefill,
        body: Message::Reserve { key, request, prefill },
    };
    let err = encode_frame(&envelope(request.clone()), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::TooLong { what: "stop tokens", .. }), "{err}");
    request.stop_token_ids.truncate(STOP_TOKENS_MAX);
    let frame = encode_frame(&envelope(request.clone()), Vec::new()).unwrap();
    assert_eq!(decode_frame(&frame).unwrap(), envelope(request.clone()));
    // A grammar's text at its bound travels; a byte more is refused.
    let mut constrained = request.clone();
    constrained.grammar = Some(Box::new(Grammar::Lark("x".repeat(GRAMMAR_BYTES_MAX + 1))));
    let err = encode_frame(&envelope(constrained.clone()), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::TooLong { what: "grammar", .. }), "{err}");
    constrained.grammar = Some(Box::new(Grammar::JsonSchema("x".repeat(GRAMMAR_BYTES_MAX))));
    let frame = encode_frame(&envelope(constrained.clone()), Vec::new()).unwrap();
    assert_eq!(decode_frame(&frame).unwrap(), envelope(constrained));
    // A bias list over its bound, or a bias or penalty that is not finite: refused by the
    // encoder, and by a decoder that gets one.
    let mut biased = request.clone();
    biased.logit_bias = vec![(1, 0.5); LOGIT_BIAS_MAX + 1];
    let err = encode_frame(&envelope(biased.clone()), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::TooLong { what: "logit bias", .. }), "{err}");
    biased.logit_bias = vec![(1, f32::NAN)];
    let err = encode_frame(&envelope(biased), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::Invalid { what: "logit bias", .. }), "{err}");
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut penalized = request.clone();
        penalized.sampling.frequency_penalty = bad;
        let err = encode_frame(&envelope(penalized), Vec::new()).unwrap_err();
        assert!(matches!(err, WireError::Invalid { what: "frequency penalty", .. }), "{err}");
    }
    request.sampling.presence_penalty = 1.25;
    let mut frame = encode_frame(&envelope(request), Vec::new()).unwrap();
    let bits = 1.25f32.to_le_bytes();
    let at = frame.windows(4).position(|w| w == bits).unwrap();
    frame[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let err = decode_frame(&frame).unwrap_err();
    assert!(matches!(err, WireError::Invalid { what: "presence penalty", .. }), "{err}");
}

/// A `Prepare` carries a request and a page list: the encoder holds both to the decoder's
/// bounds, as it does a `Reserve`'s request.
#[test]
fn encode_refuses_a_prepare_the_decoder_would_refuse() {
    let end = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
    let prepare = |request: RequestSpec, pages: usize| Envelope {
        from: end,
        to: end,
        body: Message::Prepare {
            key: TransferKey { transfer: TransferId(1), epoch: Epoch(0) },
            request,
            cached_tokens: 0,
            page_tokens: 4,
            pages: vec![PageSlot { index: 1, generation: 0 }; pages],
            lease_ms: 40,
        },
    };
    let request = RequestSpec::new(RequestId(1), vec![1, 2], 4);
    let err = encode_frame(&prepare(request.clone(), PAGES_MAX + 1), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::TooLong { what: "pages", .. }), "{err}");
    let mut stops = request.clone();
    stops.stop_token_ids = vec![7; STOP_TOKENS_MAX + 1];
    let err = encode_frame(&prepare(stops, 1), Vec::new()).unwrap_err();
    assert!(matches!(err, WireError::TooLong { what: "stop tokens", .. }), "{err}");
    let frame = encode_frame(&prepare(request.clone(), 1), Vec::new()).unwrap();
    assert_eq!(decode_frame(&frame), Ok(prepare(request, 1)));
}

#[test]
fn logprobs_travel_only_in_their_shape() {
    let key = TransferKey { transfer: TransferId(1), epoch: Epoch(0) };
    let end = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
    let envelope = |body| Envelope { from: end, to: end, body };
    let of = |token, logprob| TokenLogprobs { token, logprob, top: vec![(3, -0.5)] };
    let tokens = |tokens: Vec<u32>, logprobs| Message::Tokens {
        key,
        request: RequestId(1),
        index: 0,
        tokens,
        logprobs,
        prompt_logprobs: vec![],
        finish: None,
    };
    let refused = |body, what: &str| {
        let err = encode_frame(&envelope(body), Vec::new()).unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
    };
    // All or none, each of its own token, none NaN, at most the top a request may ask for.
    refused(tokens(vec![4, 5], vec![of(4, -1.0)]), "logprobs beside the tokens");
    refused(tokens(vec![4, 5], vec![of(4, -1.0), of(4, -1.0)]), "logprobs of another token");
    refused(tokens(vec![4], vec![of(4, f32::NAN)]), "logprob");
    let mut long = of(4, -1.0);
    long.top = vec![(1, -1.0); usize::from(SamplingSpec::TOP_LOGPROBS_MAX) + 1];
    refused(tokens(vec![4], vec![long]), "top logprobs");
    let done = |first_logprobs| Message::Done {
        key,
        first_token: 4,
        pages_written: 1,
        first_logprobs,
        prompt_logprobs: vec![],
    };
    refused(done(Some(of(5, -1.0))), "logprobs of another token");
    // A prompt's scores: with the first tokens only, none NaN.
    let mut later = tokens(vec![4], vec![]);
    if let Message::Tokens { index, prompt_logprobs, .. } = &mut later {
        (*index, *prompt_logprobs) = (3, vec![of(9, -1.0)]);
    }
    refused(later, "prompt logprobs past index 0");
    let mut nan = done(None);
    if let Message::Done { prompt_logprobs, .. } = &mut nan {
        *prompt_logprobs = vec![of(9, f32::NAN)];
    }
    refused(nan, "logprob");
    let mut request = RequestSpec::new(RequestId(1), vec![1, 2], 4);
    request.logprobs = Some(SamplingSpec::TOP_LOGPROBS_MAX + 1);
    refused(Message::Reserve { key, request: request.clone(), prefill: end }, "top logprobs");

    // A decoder refuses the same: a NaN where a logprob goes, a top count past the bound.
    let frame = encode_frame(&envelope(done(Some(of(4, -1.25)))), Vec::new()).unwrap();
    let bits = (-1.25f32).to_le_bytes();
    let at = frame.windows(4).position(|w| w == bits).unwrap();
    let mut nan = frame.clone();
    nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let err = decode_frame(&nan).unwrap_err();
    assert!(matches!(err, WireError::Invalid { what: "logprob", .. }), "{err}");
    request.logprobs = Some(SamplingSpec::TOP_LOGPROBS_MAX);
    let mut frame =
        encode_frame(&envelope(Message::Reserve { key, request, prefill: end }), Vec::new())
            .unwrap();
    // The spec's last two bytes before the prefill endpoint (a worker and an incarnation of one
    // byte each) are its top counts plus one: the output's, then the prompt's (none: 0).
    let at = frame.len() - 4;
    assert_eq!(frame[at + 1], 0);
    assert_eq!(frame[at], SamplingSpec::TOP_LOGPROBS_MAX + 1);
    frame[at] += 1;
    let value = u64::from(SamplingSpec::TOP_LOGPROBS_MAX) + 1;
    assert_eq!(decode_frame(&frame), Err(WireError::Invalid { what: "top logprobs", value }));

    // One encoding per message (the fuzz target re-encodes what decodes and compares bytes): no
    // tokens with the flag that says log-probabilities follow is refused, not read as none.
    let mut frame = encode_frame(&envelope(tokens(vec![], vec![])), Vec::new()).unwrap();
    // The message ends with that flag, no prompt scores (a zero count) and no finish (0).
    let at = frame.len() - 3;
    assert_eq!(frame[at..], [0, 0, 0]);
    assert!(decode_frame(&frame).is_ok());
    frame[at] = 1;
    let err = decode_frame(&frame).unwrap_err();
    assert!(matches!(err, WireError::Invalid { what: "logprobs of no tokens", .. }), "{err}");
}

/// KV writes and their acknowledgements take the KV lane, every other protocol message the
/// control lane, and the link's own messages either: the transport sends each by its lane, so a
/// write on the control lane would queue behind protocol messages, and a `Done` on the KV lane
/// could overtake the writes it reports.
#[test]
fn each_message_takes_its_lane() {
    let key = TransferKey { transfer: TransferId(1), epoch: Epoch(0) };
    let page = PageSlot { index: 2, generation: 0 };
    let kv_layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 1, element_bytes: 8 };
    let identity = LinkIdentity { role: Role::Prefill, page_tokens: 4, kv_layout, model: 9 };
    let lanes = [
        (Message::Hello { identity, lane: Lane::Kv, places: 4 }, None),
        (Message::LinkRefused { mismatch: LinkMismatch::Roles }, None),
        (Message::Ping { nonce: 1 }, None),
        (Message::Pong { nonce: 1 }, None),
        (Message::KvWrite { key, page, first_token: 3, data: vec![0; 8] }, Some(Lane::Kv)),
        (Message::KvWriteAck { key, page, landed: true }, Some(Lane::Kv)),
        (Message::Heartbeat { key, seq: 0, progress: 0 }, Some(Lane::Control)),
        (Message::DoneAck { key }, Some(Lane::Control)),
        (Message::Abort { key, reason: AbortReason::Client }, Some(Lane::Control)),
    ];
    for (message, lane) in lanes {
        assert_eq!(message.lane(), lane, "{message:?}");
    }
}
