//! `cargo bench -p lockstep-gpu --bench decode`: decode tokens/s at batch 1 and 32 and prefill
//! tokens/s on the default model (LOCKSTEP_DEFAULT_MODEL), through the CPU executor and the
//! scheduler, as a server would run them. `gpu/benches/llamacpp_decode.py` measures llama.cpp the
//! same way on the same file; BENCHMARKS.md holds both, side by side.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::time::{Duration, Instant};

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode};
use lockstep_gpu::gguf::Gguf;
use lockstep_gpu::llama::{CpuExecutor, LlamaWeights};

const PROMPT_TOKENS: u32 = 64;
const DECODE_TOKENS: u32 = 32;

fn config(batch: u32) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 512, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max: batch,
        step_tokens_max: 2048,
        prefill_chunk_tokens_max: 2048,
        request_tokens_max: 1024,
        capture_sizes: vec![1, 2, 4, 8, 16, 32],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(600),
        prefix_cache: false,
    }
}

/// Prefills `batch` prompts in one step, then decodes; returns (prefill, decode) tokens/s.
fn measure(weights: &LlamaWeights, batch: u32) -> (f64, f64) {
    let config = config(batch);
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut executor = CpuExecutor::new(weights, config.pool, batch);
    for id in 0..batch {
        let prompt = (0..PROMPT_TOKENS).map(|t| 100 + (t * 37 + id * 101) % 5000).collect();
        let req = NewRequest {
            id: RequestId(u64::from(id)),
            prompt,
            max_tokens: DECODE_TOKENS + 1,
            stop_token_ids: vec![],
            ignore_eos: true,
            priority: 0,
            cache_salt: 0,
        };
        sched.submit(req, Time::ZERO).unwrap();
    }
    let mut step = |sched: &mut Scheduler| -> usize {
        let plan = sched.plan_step(Time::ZERO).unwrap();
        let tokens = plan.tokens_total() as usize;
        let (outputs, _) = executor.execute(&plan).unwrap();
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        while sched.poll_event().is_some() {}
        tokens
    };
    let start = Instant::now();
    let prefilled = step(&mut sched);
    let prefill = prefilled as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut decoded = 0;
    while sched.requests_held() > 0 {
        decoded += step(&mut sched);
    }
    (prefill, decoded as f64 / start.elapsed().as_secs_f64())
}

fn main() {
    let Ok(path) = std::env::var("LOCKSTEP_DEFAULT_MODEL") else {
        eprintln!("set LOCKSTEP_DEFAULT_MODEL (ci/fetch-default-model.sh prints it)");
        return;
    };
    let file = std::fs::read(&path).unwrap();
    let gguf = Gguf::parse(&file).unwrap();
    let weights = LlamaWeights::from_gguf(&gguf, &file).unwrap();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for batch in [1, 32] {
        let (prefill, decode) = measure(&weights, batch);
        println!(
            "lockstep  batch {batch:>2}: prefill {prefill:8.1} tokens/s, decode {decode:8.1} tokens/s ({threads} threads)"
        );
    }
}
