//! `cargo bench -p lockstep-core --bench invariants`: what checking costs (issue 10). The full
//! `check_invariants` of the page pool and the scheduler at 1,024, 16,384 and 65,536 pages with a
//! realistic occupancy, against the incremental check after one decode step; the transfer
//! protocol's timers and the router's choice of worker with 1,000 live transfers; the full and
//! incremental checks of the protocol sides there. BENCHMARKS.md records the numbers.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use lockstep_core::Time;
use lockstep_core::kv::{PagePool, PageRef, PoolConfig};
use lockstep_core::pd::{
    DecodeConfig, DecodeSide, PrefillConfig, PrefillSide, Router, RouterConfig, Sampled,
};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode, StepOutputs};
use lockstep_core::wire::{
    Endpoint, Envelope, Epoch, Incarnation, Message, PageSlot, RequestSpec, TransferId,
    TransferKey, WorkerId,
};

const PAGE_TOKENS: u32 = 16;
/// Pages a running request holds after its prompt (512 tokens); finished requests leave 20 pages
/// each in the prefix cache (320 tokens).
const PROMPT_PAGES: u32 = 32;
const CACHED_PAGES: u32 = 20;

/// A scheduler over `pages` pages, a page per 16 tokens, as a server sees it after a while: a
/// request per 64 pages decodes with a 512-token prompt (half the pool held), as many finished
/// earlier and left their 320-token prompts in the prefix cache (three tenths of it evictable),
/// the rest free. All running requests share their first 128 tokens (a system prompt).
fn busy_scheduler(pages: u32) -> Scheduler {
    let requests = pages / 64;
    let config = SchedConfig {
        pool: PoolConfig { pages_total: pages, page_tokens: PAGE_TOKENS, pins_max: 64 },
        mode: StepMode::Sync,
        waiting_max: requests,
        running_max: requests,
        step_tokens_max: 8_192,
        prefill_chunk_tokens_max: 8_192,
        scored_tokens_max: 8_192,
        request_tokens_max: 1 << 20,
        capture_sizes: vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    };
    let mut sched = Scheduler::new(config).unwrap();
    let earlier = (0..requests).map(|i| {
        let prompt = (0..CACHED_PAGES * PAGE_TOKENS).map(|t| 1_000_000 + i * 7_919 + t).collect();
        new_request(u64::from(i), prompt, 1)
    });
    run_to_the_end(&mut sched, earlier.collect());
    let running: Vec<_> = (0..requests)
        .map(|i| {
            let prompt = (0..PROMPT_PAGES * PAGE_TOKENS)
                .map(|t| if t < 128 { t } else { 2_000_000 + i * 7_919 + t })
                .collect();
            new_request(u64::from(requests + i), prompt, 4_096)
        })
        .collect();
    for req in running {
        sched.submit(req, Time::ZERO).unwrap();
    }
    while sched.running_count() < requests as usize || sched.waiting_count() > 0 {
        step(&mut sched);
    }
    // A few decode steps, so the prompts' last pages are written to.
    for _ in 0..4 {
        step(&mut sched);
    }
    // What the setup changed is not what one input changes.
    sched.check_invariants_incremental().unwrap();
    sched
}

fn new_request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt,
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: true,
        priority: 0,
        cache_salt: 0,
    }
}

fn run_to_the_end(sched: &mut Scheduler, requests: Vec<NewRequest>) {
    for req in requests {
        sched.submit(req, Time::ZERO).unwrap();
    }
    while sched.requests_held() > 0 {
        step(sched);
    }
}

/// Plans a step, applies its outputs and drains the events: two inputs of the engine loop's.
fn step(sched: &mut Scheduler) {
    let plan = sched.plan_step(Time::ZERO).unwrap();
    let sampled = vec![1; plan.sampling_rows()];
    sched.apply_outputs(&StepOutputs::tokens(plan.step, sampled), Time::ZERO).unwrap();
    while sched.poll_event().is_some() {}
}

/// `step` with the incremental check after each of its two inputs, as the engine runs it.
fn step_checked(sched: &mut Scheduler) {
    let plan = sched.plan_step(Time::ZERO).unwrap();
    sched.check_invariants_incremental().unwrap();
    let sampled = vec![1; plan.sampling_rows()];
    sched.apply_outputs(&StepOutputs::tokens(plan.step, sampled), Time::ZERO).unwrap();
    while sched.poll_event().is_some() {}
    sched.check_invariants_incremental().unwrap();
}

/// Runs `one` on a copy of `base`, timing it alone; a fresh copy every 64 steps (outside the
/// timed part) so the pool never runs dry.
fn steps(base: &Scheduler, iters: u64, one: fn(&mut Scheduler)) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let mut sched = base.clone();
        // The first steps of a copy grow its vectors (a clone keeps no spare capacity).
        for _ in 0..4 {
            one(&mut sched);
        }
        let n = left.min(64);
        let start = Instant::now();
        for _ in 0..n {
            one(black_box(&mut sched));
        }
        total += start.elapsed();
        left -= n;
    }
    total
}

fn checks(c: &mut Criterion) {
    let mut group = c.benchmark_group("check");
    group.sample_size(20);
    for pages in [1_024, 16_384, 65_536] {
        let sched = busy_scheduler(pages);
        let pool = sched.pool();
        eprintln!(
            "{pages} pages: {} running, {} held, {} evictable, {} free, {} cached",
            sched.running_count(),
            pool.held_count(),
            pool.evictable_count(),
            pool.free_count(),
            pool.cached_count()
        );
        group.bench_function(format!("pool_full/{pages}"), |b| {
            b.iter(|| black_box(sched.pool().check_invariants()).unwrap())
        });
        group.bench_function(format!("sched_full/{pages}"), |b| {
            b.iter(|| black_box(sched.check_invariants()).unwrap())
        });
        // What one decode step changes, checked incrementally.
        let mut stepped = sched.clone();
        step(&mut stepped);
        // A copy of the pool carries its log of the pages the step changed.
        let stepped_pool = stepped.pool().clone();
        group.bench_function(format!("pool_incremental_after_a_step/{pages}"), |b| {
            b.iter_batched_ref(
                || stepped_pool.clone(),
                |pool| pool.check_invariants_incremental().unwrap(),
                BatchSize::LargeInput,
            )
        });
        group.bench_function(format!("sched_incremental_after_a_step/{pages}"), |b| {
            b.iter_batched_ref(
                || stepped.clone(),
                |s| s.check_invariants_incremental().unwrap(),
                BatchSize::LargeInput,
            )
        });
        // What checking after every input adds to the engine's step.
        group.bench_function(format!("decode_step/{pages}"), |b| {
            b.iter_custom(|iters| steps(&sched, iters, step))
        });
        group.bench_function(format!("decode_step_checked_incrementally/{pages}"), |b| {
            b.iter_custom(|iters| steps(&sched, iters, step_checked))
        });
    }
    group.finish();
}

const TRANSFERS: u32 = 1_000;
const WORKERS: u32 = 8;
const TRANSFER_PAGES: u32 = 4;

fn endpoint(worker: u32) -> Endpoint {
    Endpoint { worker: WorkerId(worker), incarnation: Incarnation(1) }
}

const PREFILL: u32 = 1;
const DECODE: u32 = 2;

fn spec(id: u64) -> RequestSpec {
    let prompt = (0..TRANSFER_PAGES * PAGE_TOKENS).map(|t| (id as u32).wrapping_mul(31) ^ t);
    RequestSpec::new(RequestId(id), prompt.collect(), 64)
}

fn key(id: u64) -> TransferKey {
    TransferKey { transfer: TransferId(id), epoch: Epoch(0) }
}

fn envelope(from: u32, to: u32, body: Message) -> Envelope {
    Envelope { from: endpoint(from), to: endpoint(to), body }
}

/// A prefill side with 1,000 live transfers, a quarter in each state: computing; writing with
/// no lease yet; writing with writes out; `Done` sent. Their heartbeats and deadlines spread
/// over a second.
fn busy_prefill() -> (PrefillSide, PagePool, Time) {
    let pages = TRANSFERS * TRANSFER_PAGES;
    let config = PoolConfig { pages_total: pages, page_tokens: PAGE_TOKENS, pins_max: pages };
    let mut pool = PagePool::new(config).unwrap();
    let pd = PrefillConfig {
        heartbeat_interval: Duration::from_secs(2),
        write_flight_max: Duration::from_secs(1),
        transfer_deadline: Duration::from_secs(60),
        done_retransmit: Duration::from_secs(5),
        transfers_max: TRANSFERS,
    };
    let mut side = PrefillSide::new(endpoint(PREFILL), pd);
    let mut now = Time::ZERO;
    for id in 0..u64::from(TRANSFERS) {
        now = now.saturating_add(Duration::from_millis(1));
        let pages = (0..TRANSFER_PAGES)
            .map(|p| PageSlot { index: id as u32 * TRANSFER_PAGES + p, generation: 0 })
            .collect();
        let prepare = Message::Prepare {
            key: key(id),
            request: spec(id),
            cached_tokens: 0,
            page_tokens: PAGE_TOKENS,
            pages,
            lease_ms: 10_000,
        };
        side.handle_envelope(envelope(DECODE, PREFILL, prepare), &mut pool, now);
        if id % 4 == 0 {
            continue;
        }
        let mut sources: Vec<PageRef> = Vec::new();
        pool.allocate_many(TRANSFER_PAGES, &mut sources).unwrap();
        side.handle_computed(key(id), Sampled::token(1), &sources, &mut pool, now);
        for page in sources {
            pool.release(page).unwrap();
        }
        if id % 4 == 1 {
            continue;
        }
        let grant = Message::LeaseGrant { key: key(id), seq: 0, lease_ms: 10_000 };
        side.handle_envelope(envelope(DECODE, PREFILL, grant), &mut pool, now);
        if id % 4 == 3 {
            for ordinal in 0..TRANSFER_PAGES {
                side.handle_write_completion(key(id), ordinal, true, &mut pool, now);
            }
        }
    }
    while side.poll_output().is_some() {}
    assert_eq!(side.transfers_live(), TRANSFERS as usize);
    (side, pool, now)
}

/// A decode side with 1,000 transfers awaiting their prefill, each with 4 reserved pages.
fn busy_decode() -> (DecodeSide, PagePool) {
    let pages = TRANSFERS * TRANSFER_PAGES;
    let config = PoolConfig { pages_total: pages, page_tokens: PAGE_TOKENS, pins_max: pages };
    let mut pool = PagePool::new(config).unwrap();
    let pd = DecodeConfig {
        lease: Duration::from_secs(10),
        write_flight_max: Duration::from_secs(1),
        transfers_max: TRANSFERS,
        prefix_cache: false,
        live_report_interval: Duration::from_secs(30),
    };
    let mut side = DecodeSide::new(endpoint(DECODE), pd);
    for id in 0..u64::from(TRANSFERS) {
        let reserve =
            Message::Reserve { key: key(id), request: spec(id), prefill: endpoint(PREFILL) };
        let now = Time::ZERO.saturating_add(Duration::from_millis(id));
        side.handle_envelope(envelope(0, DECODE, reserve), &mut pool, now);
    }
    while side.poll_output().is_some() {}
    assert_eq!(side.transfers_live(), TRANSFERS as usize);
    (side, pool)
}

/// A router over 8 prefill and 8 decode workers with 1,000 requests in transfer and 1,000
/// decoding, and room for more on every worker.
fn busy_router() -> (Router, Time) {
    let prefills = (0..WORKERS).map(|w| endpoint(100 + w)).collect();
    let decodes = (0..WORKERS).map(|w| endpoint(200 + w)).collect();
    let config = RouterConfig {
        outcome_timeout: Duration::from_secs(30),
        requests_max: 4 * TRANSFERS,
        retries_max: 2,
        decode_idle_timeout: Duration::from_secs(30),
        decode_slots: TRANSFERS,
        prefill_slots: TRANSFERS,
        queue_wait_max: Duration::from_secs(60),
        busy_backoff: Duration::from_millis(100),
    };
    let mut router = Router::new(endpoint(0), config, prefills, decodes);
    let mut now = Time::ZERO;
    for id in 0..u64::from(2 * TRANSFERS) {
        now = now.saturating_add(Duration::from_millis(1));
        router.submit(spec(id), now).unwrap();
    }
    // Half of them reach their decode worker.
    let mut decoding = Vec::new();
    while let Some(output) = router.poll_output() {
        if let lockstep_core::pd::RouterOutput::Send(e) = output
            && let Message::Reserve { key, request, .. } = e.body
            && request.id.0 % 2 == 0
        {
            decoding.push((key, e.to));
        }
    }
    for (key, decode) in decoding {
        let outcome = Message::Outcome { key, failure: None };
        router.handle_envelope(Envelope { from: decode, to: endpoint(0), body: outcome }, now);
    }
    while router.poll_output().is_some() {}
    assert_eq!(router.requests_in_transfer(), TRANSFERS as usize);
    assert_eq!(router.requests_decoding(), TRANSFERS as usize);
    (router, now)
}

fn protocol(c: &mut Criterion) {
    let mut group = c.benchmark_group("pd_1000_transfers");
    let (prefill, prefill_pool, now) = busy_prefill();
    group.bench_function("prefill_next_timeout", |b| b.iter(|| black_box(prefill.next_timeout())));
    group.bench_function("prefill_handle_timeout_nothing_due", |b| {
        b.iter_batched_ref(
            || (prefill.clone(), prefill_pool.clone()),
            |(side, pool)| side.handle_timeout(pool, now),
            BatchSize::LargeInput,
        )
    });
    group.bench_function("prefill_check_full", |b| {
        b.iter(|| black_box(prefill.check_invariants(&prefill_pool)).unwrap())
    });
    // After one input: a lease grant to a transfer that is writing.
    let mut granted = prefill.clone();
    let mut granted_pool = prefill_pool.clone();
    granted.check_invariants_incremental(&granted_pool).unwrap();
    let grant = Message::LeaseGrant { key: key(2), seq: 0, lease_ms: 20_000 };
    granted.handle_envelope(envelope(DECODE, PREFILL, grant), &mut granted_pool, now);
    while granted.poll_output().is_some() {}
    group.bench_function("prefill_check_incremental_after_an_input", |b| {
        b.iter_batched_ref(
            || granted.clone(),
            |side| side.check_invariants_incremental(&granted_pool).unwrap(),
            BatchSize::LargeInput,
        )
    });
    let (decode, decode_pool) = busy_decode();
    group.bench_function("decode_check_full", |b| {
        b.iter(|| black_box(decode.check_invariants(&decode_pool)).unwrap())
    });
    // After one input: a heartbeat that extends a lease.
    let mut beaten = decode.clone();
    let mut beaten_pool = decode_pool.clone();
    beaten.check_invariants_incremental(&beaten_pool).unwrap();
    let heartbeat = Message::Heartbeat { key: key(7), seq: 0, progress: 0 };
    let later = Time::ZERO.saturating_add(Duration::from_secs(5));
    beaten.handle_envelope(envelope(PREFILL, DECODE, heartbeat), &mut beaten_pool, later);
    while beaten.poll_output().is_some() {}
    group.bench_function("decode_check_incremental_after_an_input", |b| {
        b.iter_batched_ref(
            || beaten.clone(),
            |side| side.check_invariants_incremental(&beaten_pool).unwrap(),
            BatchSize::LargeInput,
        )
    });
    let (router, now) = busy_router();
    group.bench_function("router_next_timeout", |b| b.iter(|| black_box(router.next_timeout())));
    group.bench_function("router_submit_and_abort", |b| {
        let mut router = router.clone();
        let id = RequestId(u64::MAX);
        b.iter(|| {
            router.submit(spec(id.0), now).unwrap();
            router.abort(id, now).unwrap();
            while router.poll_output().is_some() {}
        })
    });
    group.bench_function("router_check_full", |b| {
        b.iter(|| black_box(router.check_invariants()).unwrap())
    });
    // After one input: a request submitted, which starts a transfer at once.
    let mut submitted = router.clone();
    submitted.check_invariants_incremental().unwrap();
    submitted.submit(spec(u64::MAX), now).unwrap();
    while submitted.poll_output().is_some() {}
    group.bench_function("router_check_incremental_after_an_input", |b| {
        b.iter_batched_ref(
            || submitted.clone(),
            |router| router.check_invariants_incremental().unwrap(),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = checks, protocol
}
criterion_main!(benches);
