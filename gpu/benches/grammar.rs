//! `cargo bench -p lockstep-gpu --bench grammar`: what constrained decoding costs, side by side
//! in one run on the default model (LOCKSTEP_DEFAULT_MODEL) through the CPU executor and the
//! scheduler: decode tokens/s at batch 1 and 8, every request plain or held to a JSON schema
//! that cannot close within the run (so every step computes a mask), alternating, best of three;
//! and the matcher alone, masks a second over the tokens of a JSON document; and a tool's schema
//! compiled anew against the compiler's kept grammar (what the executor's compile after the HTTP
//! edge's costs, and an agent's next turn with the same tools). BENCHMARKS.md records the output.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::time::{Duration, Instant};

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{Executor, Grammar, GrammarCompiler as _, SamplingSpec};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode};
use lockstep_gpu::llama::CpuExecutor;
use lockstep_gpu::model::Model;
use serde_json::json;

const PROMPT_TOKENS: u32 = 64;
const DECODE_TOKENS: u32 = 32;

/// A tool's parameters as agents send them: nested, with enums, arrays and descriptions.
fn tool_schema() -> Grammar {
    let schema = json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "The file to edit, relative to the root."},
            "edits": {"type": "array", "items": {
                "type": "object",
                "properties": {
                    "old_text": {"type": "string"},
                    "new_text": {"type": "string"},
                    "occurrence": {"type": "integer", "minimum": 1},
                },
                "required": ["old_text", "new_text"],
                "additionalProperties": false,
            }},
            "mode": {"enum": ["replace", "insert_before", "insert_after"]},
            "dry_run": {"type": "boolean"},
        },
        "required": ["path", "edits"],
        "additionalProperties": false,
    });
    Grammar::JsonSchema(schema.to_string())
}

/// An object whose list must hold 1,000 strings: open for the whole run.
fn schema() -> Grammar {
    let list = json!({"type": "array", "items": {"type": "string"}, "minItems": 1000});
    let schema = json!({"type": "object", "properties": {"items": list}, "required": ["items"]});
    Grammar::JsonSchema(schema.to_string())
}

fn config(batch: u32) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 256, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max: batch,
        step_tokens_max: 2048,
        prefill_chunk_tokens_max: 2048,
        scored_tokens_max: 2048,
        request_tokens_max: 4096,
        capture_sizes: vec![1, 2, 4, 8],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(600),
        prefix_cache: false,
    }
}

/// Decode tokens/s of `batch` requests, each held to `grammar` if given.
fn decode(model: &Model, batch: u32, grammar: Option<&Grammar>) -> f64 {
    let config = config(batch);
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut executor = CpuExecutor::new(model.weights.clone(), config.pool, batch)
        .with_grammars(model.grammars().unwrap());
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
        let spec = SamplingSpec { grammar: grammar.cloned(), ..SamplingSpec::GREEDY };
        executor.start_request(req.id, spec.with_prompt(&req.prompt));
        sched.submit(req, Time::ZERO).unwrap();
    }
    let mut step = |sched: &mut Scheduler| -> usize {
        let plan = sched.plan_step(Time::ZERO).unwrap();
        let tokens = plan.tokens_total() as usize;
        let outputs = executor.execute(&plan).unwrap();
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        while sched.poll_event().is_some() {}
        tokens
    };
    step(&mut sched);
    let start = Instant::now();
    let mut decoded = 0;
    while sched.requests_held() > 0 {
        decoded += step(&mut sched);
    }
    decoded as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let Ok(path) = std::env::var("LOCKSTEP_DEFAULT_MODEL") else {
        eprintln!("set LOCKSTEP_DEFAULT_MODEL (ci/fetch-default-model.sh prints it)");
        return;
    };
    let model = Model::load(std::path::Path::new(&path)).unwrap();
    let start = Instant::now();
    let compiler = model.grammars().unwrap();
    println!(
        "grammar compiler (token trie of {} tokens): {:.0} ms",
        model.tokenizer.vocab_size(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let grammar = schema();
    for batch in [1, 8] {
        let (mut plain, mut held) = (0f64, 0f64);
        for _ in 0..3 {
            plain = plain.max(decode(&model, batch, None));
            held = held.max(decode(&model, batch, Some(&grammar)));
        }
        println!(
            "batch {batch}: decode {plain:7.1} tokens/s plain, {held:7.1} held to a schema: {:.3} of plain",
            held / plain
        );
    }
    // The matcher alone over a document the schema accepts, a mask a token.
    let text = format!(
        "{{\"items\": [{}",
        (0..200).map(|i| format!("\"item number {i}\"")).collect::<Vec<_>>().join(", ")
    );
    let tokens = model.tokenizer.encode(&text).unwrap();
    let tokens = &tokens[usize::from(model.tokenizer.add_bos)..];
    let start = Instant::now();
    // Anew: the decode runs above left it kept.
    let mut matcher = compiler.compile_uncached(&grammar).unwrap();
    let compiled = start.elapsed();
    let start = Instant::now();
    for n in 0..=tokens.len() {
        let mask = matcher.allowed(&tokens[..n]);
        // A token the grammar refused would leave the matcher stopped, and the rest cheap.
        assert!(tokens.get(n).is_none_or(|&t| mask.allows(t)), "token {n} refused");
    }
    let per_mask = start.elapsed().as_secs_f64() / (tokens.len() + 1) as f64;
    println!(
        "matcher: the schema compiled in {:.2} ms; {} masks, {:.1} µs each ({:.0} a second)",
        compiled.as_secs_f64() * 1e3,
        tokens.len() + 1,
        per_mask * 1e6,
        1.0 / per_mask
    );
    // Compiled anew against kept, alternating, best of 20 each.
    let tools = tool_schema();
    compiler.compile(&tools).unwrap();
    let (mut anew, mut kept) = (Duration::MAX, Duration::MAX);
    for _ in 0..20 {
        let start = Instant::now();
        compiler.compile_uncached(&tools).unwrap();
        anew = anew.min(start.elapsed());
        let start = Instant::now();
        compiler.compile(&tools).unwrap();
        kept = kept.min(start.elapsed());
    }
    println!(
        "a tool's schema compiled anew {:.3} ms, kept {:.1} µs: {:.0} times quicker ({:?})",
        anew.as_secs_f64() * 1e3,
        kept.as_secs_f64() * 1e6,
        anew.as_secs_f64() / kept.as_secs_f64(),
        compiler.compile_counts(),
    );
}
