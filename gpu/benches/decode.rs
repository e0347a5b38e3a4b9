//! `cargo bench -p lockstep-gpu --bench decode`: decode tokens/s at batch 1 and 32 and at a
//! 2,000-token context, and prefill tokens/s, on the default model (LOCKSTEP_DEFAULT_MODEL), through the CPU executor and the
//! scheduler, as a server would run them; then, in the same run, llama.cpp on the same file,
//! threads and prompts (`llamacpp_decode.py`, when llama-cpp-python is installed) and the
//! machine's read bandwidth, the bound on batch-1 decode. BENCHMARKS.md records the output.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{Executor, SamplingSpec};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode};
use lockstep_gpu::gguf::Gguf;
use lockstep_gpu::llama::{CpuExecutor, LlamaWeights};

const PROMPT_TOKENS: u32 = 64;
const DECODE_TOKENS: u32 = 32;
/// The long-context case: one prompt this long, then `DECODE_TOKENS` decoded at a context of
/// about 2,000 tokens, where attention is a third of a decode step on the default model.
const LONG_PROMPT_TOKENS: u32 = 2000;

fn config(batch: u32) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 512, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max: batch,
        step_tokens_max: 2048,
        prefill_chunk_tokens_max: 2048,
        scored_tokens_max: 2048,
        request_tokens_max: 4096,
        capture_sizes: vec![1, 2, 4, 8, 16, 32],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(600),
        prefix_cache: false,
    }
}

/// Prefills `batch` prompts of `prompt_tokens` in one step, then decodes; returns (prefill,
/// decode) tokens/s.
fn measure(weights: &Arc<LlamaWeights>, batch: u32, prompt_tokens: u32) -> (f64, f64) {
    let config = config(batch);
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut executor = CpuExecutor::new(weights.clone(), config.pool, batch);
    for id in 0..batch {
        let prompt = (0..prompt_tokens).map(|t| 100 + (t * 37 + id * 101) % 5000).collect();
        let req = NewRequest {
            id: RequestId(u64::from(id)),
            prompt,
            max_tokens: DECODE_TOKENS + 1,
            stop_token_ids: vec![],
            ignore_eos: true,
            priority: 0,
            cache_salt: 0,
        };
        executor.start_request(req.id, SamplingSpec::GREEDY);
        sched.submit(req, Time::ZERO).unwrap();
    }
    let mut step = |sched: &mut Scheduler| -> usize {
        let plan = sched.plan_step(Time::ZERO).unwrap();
        let tokens = plan.tokens_total() as usize;
        let (outputs, _) = executor.execute_with_logits(&plan).unwrap();
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

/// Read bandwidth of this machine with `threads` threads: each sums its share of a buffer far
/// larger than the caches, best of three.
fn read_bandwidth(threads: usize) -> f64 {
    let words = (1usize << 30) / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|scope| {
            let handles: Vec<_> = buffer
                .chunks(words.div_ceil(threads))
                .map(|chunk| {
                    scope.spawn(move || chunk.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / start.elapsed().as_secs_f64());
    }
    best
}

/// llama.cpp's numbers from `llamacpp_decode.py` on the same file and threads, if llama-cpp-python
/// is installed: (prefill, decode) tokens/s at batch 1, at batch 32 and at the long context.
fn llama_cpp(path: &str, threads: usize) -> Option<[(f64, f64); 3]> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/llamacpp_decode.py");
    let out = std::process::Command::new("python3")
        .args([script, path, &threads.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut results = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("llama.cpp")) {
        println!("{line}");
        let number = |after: &str| -> Option<f64> {
            line.split(after).nth(1)?.split_whitespace().next()?.parse().ok()
        };
        results.push((number("prefill")?, number("decode")?));
    }
    results.try_into().ok()
}

fn main() {
    let Ok(path) = std::env::var("LOCKSTEP_DEFAULT_MODEL") else {
        eprintln!("set LOCKSTEP_DEFAULT_MODEL (ci/fetch-default-model.sh prints it)");
        return;
    };
    let file = std::fs::read(&path).unwrap();
    let gguf = Gguf::parse(&file).unwrap();
    let weights = Arc::new(LlamaWeights::from_gguf(&gguf, &file).unwrap());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut ours = Vec::new();
    for (case, batch, prompt_tokens) in [
        ("batch  1", 1, PROMPT_TOKENS),
        ("batch 32", 32, PROMPT_TOKENS),
        ("long    ", 1, LONG_PROMPT_TOKENS),
    ] {
        // Best of three, as the llama.cpp script takes: this machine's neighbours come and go.
        let (mut prefill, mut decode) = (0f64, 0f64);
        for _ in 0..3 {
            let (p, d) = measure(&weights, batch, prompt_tokens);
            (prefill, decode) = (prefill.max(p), decode.max(d));
        }
        ours.push((prefill, decode));
        println!(
            "lockstep  {case}: prefill {prefill:8.1} tokens/s, decode {decode:8.1} tokens/s ({threads} threads)"
        );
    }
    // A decode step reads every weight once (the output projection is the tied embedding, read
    // whole), so the file's size over the read bandwidth bounds batch-1 decode from above.
    let bandwidth = read_bandwidth(threads);
    let bound = bandwidth / file.len() as f64;
    println!(
        "memory: {:.1} GB/s read with {threads} threads; {:.0} MB of weights a token: at most {bound:.0} tokens/s at batch 1",
        bandwidth / 1e9,
        file.len() as f64 / 1e6
    );
    println!("lockstep batch-1 decode is {:.2} of that bound", ours[0].1 / bound);
    match llama_cpp(&path, threads) {
        Some([one, many, long]) => {
            println!("llama.cpp batch-1 decode is {:.2} of the bound", one.1 / bound);
            println!(
                "lockstep / llama.cpp: batch-1 decode {:.2}, prefill {:.2}; batch-32 decode {:.2}, prefill {:.2}; long context decode {:.2}, prefill {:.2}",
                ours[0].1 / one.1,
                ours[0].0 / one.0,
                ours[1].1 / many.1,
                ours[1].0 / many.0,
                ours[2].1 / long.1,
                ours[2].0 / long.0,
            );
        }
        None => println!("llama.cpp: not measured (pip install llama-cpp-python, see the script)"),
    }
}
