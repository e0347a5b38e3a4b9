//! `cargo bench -p lockstep-core --bench protocol`: the wire codec's messages encoded and decoded
//! per second, and the transfer protocol's cost per transfer end to end (both sides, every
//! message through the codec) with 10,000 transfers in flight. Target (issue 3): under 2 µs per
//! transfer, excluding the KV bytes.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lockstep_core::Time;
use lockstep_core::kv::{PagePool, PageRef, PoolConfig};
use lockstep_core::pd::{
    DecodeConfig, DecodeOutput, DecodeSide, PrefillConfig, PrefillOutput, PrefillSide, Sampled,
};
use lockstep_core::sched::RequestId;
use lockstep_core::wire::{
    Endpoint, Envelope, Epoch, Incarnation, Message, RequestSpec, Sampling, TransferId,
    TransferKey, WorkerId, decode_frame, encode_frame,
};

const TRANSFERS: u32 = 10_000;
const PROMPT_TOKENS: u32 = 64;
const PAGE_TOKENS: u32 = 16;

const ROUTER: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };
const PREFILL: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const DECODE: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };

fn spec(id: u64) -> RequestSpec {
    RequestSpec {
        id: RequestId(id),
        prompt: (0..PROMPT_TOKENS).map(|t| (id as u32).wrapping_mul(31) ^ t).collect(),
        max_tokens: 128,
        stop_token_ids: vec![2],
        ignore_eos: false,
        priority: 0,
        cache_salt: 0,
        sampling: Sampling {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            seed: id,
            ..Sampling::GREEDY
        },
        logit_bias: vec![(7, -100.0)],
        grammar: None,
        logprobs: None,
        prompt_logprobs: None,
    }
}

fn key(id: u64) -> TransferKey {
    TransferKey { transfer: TransferId(id), epoch: Epoch(0) }
}

fn codec(c: &mut Criterion) {
    let messages = [
        (
            "heartbeat",
            Envelope {
                from: PREFILL,
                to: DECODE,
                body: Message::Heartbeat { key: key(7), seq: 3, progress: 0 },
            },
        ),
        (
            "reserve_64_tokens",
            Envelope {
                from: ROUTER,
                to: DECODE,
                body: Message::Reserve { key: key(7), request: spec(7), prefill: PREFILL },
            },
        ),
    ];
    let mut group = c.benchmark_group("wire");
    group.throughput(Throughput::Elements(1));
    for (name, envelope) in messages {
        let mut buf = Vec::with_capacity(1024);
        group.bench_function(format!("encode_{name}"), |b| {
            b.iter(|| {
                buf.clear();
                buf = encode_frame(black_box(&envelope), std::mem::take(&mut buf)).unwrap();
            })
        });
        let frame = encode_frame(&envelope, Vec::new()).unwrap();
        group.bench_function(format!("decode_{name}"), |b| {
            b.iter(|| black_box(decode_frame(black_box(&frame)).unwrap()))
        });
    }
    group.finish();
}

/// Carries an envelope through the codec, as a peer link would.
fn wire(envelope: &Envelope, buf: &mut Vec<u8>) -> Envelope {
    buf.clear();
    *buf =
        encode_frame(envelope, std::mem::take(buf)).expect("benchmark messages are within bounds");
    decode_frame(buf).unwrap()
}

/// Runs `TRANSFERS` transfers concurrently through both sides, phase by phase (all reserved,
/// then all prepared, ...), so 10,000 are in flight at once. Returns the time taken.
fn run_transfers() -> Duration {
    let decode_config = DecodeConfig {
        lease: Duration::from_secs(10),
        write_flight_max: Duration::from_secs(1),
        transfers_max: TRANSFERS,
        prefix_cache: false,
        live_report_interval: Duration::from_secs(30),
    };
    let prefill_config = PrefillConfig {
        heartbeat_interval: Duration::from_secs(2),
        write_flight_max: Duration::from_secs(1),
        transfer_deadline: Duration::from_secs(60),
        done_retransmit: Duration::from_secs(5),
        transfers_max: TRANSFERS,
    };
    let pages = TRANSFERS * PROMPT_TOKENS / PAGE_TOKENS;
    let mut decode_pool =
        PagePool::new(PoolConfig { pages_total: pages, page_tokens: PAGE_TOKENS, pins_max: pages })
            .unwrap();
    let mut prefill_pool =
        PagePool::new(PoolConfig { pages_total: pages, page_tokens: PAGE_TOKENS, pins_max: pages })
            .unwrap();
    let mut decode = DecodeSide::new(DECODE, decode_config);
    let mut prefill = PrefillSide::new(PREFILL, prefill_config);
    let mut sources: Vec<Vec<PageRef>> = Vec::with_capacity(TRANSFERS as usize);
    for _ in 0..TRANSFERS {
        let mut s = Vec::new();
        prefill_pool.allocate_many(PROMPT_TOKENS / PAGE_TOKENS, &mut s).unwrap();
        sources.push(s);
    }
    let now = Time::ZERO;
    let mut buf = Vec::with_capacity(1024);
    let mut to_prefill = Vec::with_capacity(TRANSFERS as usize * 2);
    let mut to_decode = Vec::with_capacity(TRANSFERS as usize * 2);
    let mut writes = Vec::with_capacity(TRANSFERS as usize * 4);
    let start = Instant::now();
    // As a driver does: outputs are drained after every input.
    let pump = |decode: &mut DecodeSide,
                prefill: &mut PrefillSide,
                to_prefill: &mut Vec<Envelope>,
                to_decode: &mut Vec<Envelope>,
                writes: &mut Vec<(TransferKey, u32)>| {
        while let Some(output) = decode.poll_output() {
            if let DecodeOutput::Send(e) = output
                && e.to == PREFILL
            {
                to_prefill.push(e);
            }
        }
        while let Some(output) = prefill.poll_output() {
            match output {
                PrefillOutput::Send(e) => to_decode.push(e),
                PrefillOutput::Write { key, ordinal, .. } => writes.push((key, ordinal)),
                _ => {}
            }
        }
    };
    for id in 0..u64::from(TRANSFERS) {
        let reserve = Envelope {
            from: ROUTER,
            to: DECODE,
            body: Message::Reserve { key: key(id), request: spec(id), prefill: PREFILL },
        };
        decode.handle_envelope(wire(&reserve, &mut buf), &mut decode_pool, now);
        pump(&mut decode, &mut prefill, &mut to_prefill, &mut to_decode, &mut writes);
    }
    // Phase by phase, so all 10,000 are in flight at once: deliver everything, compute
    // everything, complete every write, until every transfer is done.
    let mut inbox = Vec::with_capacity(TRANSFERS as usize * 2);
    let mut completions = Vec::with_capacity(TRANSFERS as usize * 4);
    for _round in 0..8 {
        inbox.append(&mut to_prefill);
        for e in inbox.drain(..) {
            prefill.handle_envelope(wire(&e, &mut buf), &mut prefill_pool, now);
            if let Message::Prepare { key, .. } = e.body {
                prefill.handle_computed(
                    key,
                    Sampled::token(1),
                    &sources[key.transfer.0 as usize],
                    &mut prefill_pool,
                    now,
                );
            }
            pump(&mut decode, &mut prefill, &mut to_prefill, &mut to_decode, &mut writes);
        }
        completions.append(&mut writes);
        for (key, ordinal) in completions.drain(..) {
            prefill.handle_write_completion(key, ordinal, true, &mut prefill_pool, now);
            pump(&mut decode, &mut prefill, &mut to_prefill, &mut to_decode, &mut writes);
        }
        inbox.append(&mut to_decode);
        for e in inbox.drain(..) {
            decode.handle_envelope(wire(&e, &mut buf), &mut decode_pool, now);
            pump(&mut decode, &mut prefill, &mut to_prefill, &mut to_decode, &mut writes);
        }
        if decode.transfers_live() == 0 && prefill.transfers_live() == 0 {
            break;
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(
        (decode.transfers_live(), prefill.transfers_live()),
        (0, 0),
        "the benchmark's transfers did not all finish"
    );
    elapsed
}

fn transfers(c: &mut Criterion) {
    let mut group = c.benchmark_group("pd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(u64::from(TRANSFERS)));
    group.bench_function("10000_concurrent_transfers_end_to_end", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| run_transfers()).sum())
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = codec, transfers
}
criterion_main!(benches);
