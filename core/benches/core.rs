//! `cargo bench -p lockstep-core`: one scheduler step at 1,024 running decode requests over
//! 65,536 pages, allocate plus free of one page, and prefix match of a 128k-token prompt against
//! a warm cache. Targets (issue 2): 20 µs, 50 ns, 100 µs. BENCHMARKS.md records the numbers.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use lockstep_core::Time;
use lockstep_core::kv::prefix_hash::{block_hashes, root_hash};
use lockstep_core::kv::{CacheKey, PagePool, PoolConfig};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode, StepOutputs};

const PAGES: u32 = 65_536;
const PAGE_TOKENS: u32 = 16;
const RUNNING: u32 = 1_024;
const PROMPT_TOKENS: u32 = 512;

fn pool_config() -> PoolConfig {
    PoolConfig { pages_total: PAGES, page_tokens: PAGE_TOKENS, pins_max: PAGES }
}

/// A scheduler with 1,024 requests past their prefill, each holding 32 pages: half the pool.
fn decoding_scheduler(mode: StepMode) -> Scheduler {
    let config = SchedConfig {
        pool: pool_config(),
        mode,
        waiting_max: RUNNING,
        running_max: RUNNING,
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
    for id in 0..RUNNING {
        let prompt = (0..PROMPT_TOKENS).map(|t| id * 7_919 + t).collect();
        let req = NewRequest {
            id: RequestId(u64::from(id)),
            prompt,
            max_tokens: 1 << 19,
            stop_token_ids: vec![],
            ignore_eos: true,
            priority: 0,
            cache_salt: 0,
        };
        sched.submit(req, Time::ZERO).unwrap();
    }
    while sched.running_count() < RUNNING as usize
        || sched.pool().held_count() < RUNNING * PROMPT_TOKENS / PAGE_TOKENS
    {
        let plan = sched.plan_step(Time::ZERO).unwrap();
        let sampled = vec![1; plan.sampling_rows()];
        sched.apply_outputs(&StepOutputs::tokens(plan.step, sampled), Time::ZERO).unwrap();
        while sched.poll_event().is_some() {}
    }
    sched
}

/// Plans a step, applies its outputs, drains the events: what the engine loop does per step.
fn one_step(sched: &mut Scheduler, sampled: &mut StepOutputs) -> usize {
    let plan = sched.plan_step(Time::ZERO).unwrap();
    sampled.step = plan.step;
    sampled.sampled.clear();
    sampled.sampled.resize(plan.sampling_rows(), 1);
    sched.apply_outputs(sampled, Time::ZERO).unwrap();
    let mut events = 0;
    while sched.poll_event().is_some() {
        events += 1;
    }
    assert_eq!(plan.rows.len(), RUNNING as usize, "every request decodes each step");
    events
}

fn scheduler_step(c: &mut Criterion) {
    let base = decoding_scheduler(StepMode::Sync);
    c.bench_function("sched_step_1024_decode_rows", |b| {
        b.iter_custom(|iters| {
            // Each step grows every request by a token; start again from the same state every
            // 256 steps, outside the timed part, so the pool never runs dry.
            let mut total = Duration::ZERO;
            let mut left = iters;
            let mut outputs = StepOutputs {
                step: lockstep_core::sched::StepId(0),
                sampled: Vec::with_capacity(RUNNING as usize),
                logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            };
            while left > 0 {
                let mut sched = base.clone();
                let n = left.min(256);
                let start = Instant::now();
                for _ in 0..n {
                    black_box(one_step(&mut sched, &mut outputs));
                }
                total += start.elapsed();
                left -= n;
            }
            total
        })
    });
}

fn allocate_and_free(c: &mut Criterion) {
    let mut pool = PagePool::new(pool_config()).unwrap();
    // Half full, so the free list is not trivially at its start.
    let held: Vec<_> = (0..PAGES / 2).map(|_| pool.allocate().unwrap()).collect();
    c.bench_function("kv_allocate_plus_free", |b| {
        b.iter(|| {
            let page = pool.allocate().unwrap();
            pool.release(black_box(page)).unwrap();
        })
    });
    black_box(held);
}

fn prefix_match(c: &mut Criterion) {
    // 16 tokens a page is vLLM's default and the hard case (8,192 pages); 64 is a common
    // disaggregated-serving page (2,048 pages).
    for page_tokens in [16, 64] {
        prefix_match_with(c, page_tokens);
    }
}

fn prefix_match_with(c: &mut Criterion, page_tokens: u32) {
    const PROMPT: usize = 128 * 1024;
    let pt = page_tokens as usize;
    let config =
        PoolConfig { pages_total: PAGES * PAGE_TOKENS / page_tokens, page_tokens, pins_max: 0 };
    let mut pool = PagePool::new(config).unwrap();
    let tokens: Vec<u32> =
        (0..PROMPT as u32).map(|t| t.wrapping_mul(2_654_435_761) % 151_000).collect();
    let keys = block_hashes(0, &tokens, pt);
    let root = root_hash(0);
    // Warm: every page of the prompt cached and evictable, as after an earlier turn ended.
    for (i, &hash) in keys.iter().enumerate() {
        let page = pool.allocate().unwrap();
        let parent = if i == 0 { root } else { keys[i - 1] };
        pool.cache_insert(page, CacheKey { hash, parent }, &tokens[i * pt..(i + 1) * pt]).unwrap();
        pool.release(page).unwrap();
    }
    let mut group = c.benchmark_group(format!("prefix_match_128k_tokens_{page_tokens}_per_page"));
    group.bench_function("hash_only", |b| {
        b.iter(|| black_box(block_hashes(0, black_box(&tokens), pt)))
    });
    group.bench_function("lookup_only", |b| {
        let mut found = Vec::with_capacity(keys.len());
        b.iter(|| {
            found.clear();
            black_box(pool.lookup_prefix(root, black_box(&keys), &tokens, &mut found))
        })
    });
    group.bench_function("hash_and_match", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut matched = Vec::with_capacity(keys.len());
            for _ in 0..iters {
                let start = Instant::now();
                let keys = block_hashes(0, black_box(&tokens), pt);
                let n = pool.match_prefix(root, &keys, &tokens, &mut matched);
                total += start.elapsed();
                assert_eq!(n, keys.len());
                for page in matched.drain(..) {
                    pool.release(page).unwrap();
                }
            }
            total
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = scheduler_step, allocate_and_free, prefix_match
}
criterion_main!(benches);
