//! Batch invariance on the real model: a request alone and the same request inside a batch of 32
//! mixed prefill and decode rows, scheduled by lockstep's own scheduler and executed over paged
//! KV, give bit-identical logits and tokens at every step, and both equal the single-sequence
//! reference, whatever number of threads computes the step. Every request samples (temperature,
//! top-k, top-p) with a generator of its own, so its tokens cannot depend on its companions
//! either.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;
mod quantized;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::Executor;
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, SchedEvent, Scheduler, StepMode};
use lockstep_gpu::llama::{CpuExecutor, LlamaWeights, Sequence};
use lockstep_gpu::sampling::{RequestSampler, Sampling, SamplingSpec};
use lockstep_gpu::tokenizer::Tokenizer;

const WATCHED: RequestId = RequestId(0);
/// Each request samples with a seed of its own (`SEED` and its id).
const SEED: u64 = 7;

/// Penalties and a min-p on two requests of three, the watched one among them, and a repetition
/// penalty on one in three: the output so far that penalties read must be the same alone and
/// in the crowd.
fn sampling(id: RequestId) -> Sampling {
    let (presence_penalty, frequency_penalty, min_p) =
        if id.0 % 3 == 2 { (0.0, 0.0, 0.0) } else { (0.6, 0.4, 0.02) };
    Sampling {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: SEED ^ id.0,
        presence_penalty,
        frequency_penalty,
        min_p,
        // The watched one's reads its prompt's tokens too.
        repetition_penalty: if id.0.is_multiple_of(3) { 1.2 } else { 1.0 },
    }
}

/// Request `id`'s spec: its sampling, and on even ids a logit bias against a few common tokens.
fn spec(id: RequestId, prompt: &[u32]) -> SamplingSpec {
    let logit_bias =
        if id.0.is_multiple_of(2) { vec![(28, -2.0), (253, 1.5), (30, -100.0)] } else { vec![] };
    SamplingSpec { logit_bias, ..SamplingSpec::for_prompt(sampling(id), prompt) }
}

fn config() -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 160, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max: 32,
        step_tokens_max: 64,
        prefill_chunk_tokens_max: 2,
        scored_tokens_max: 2,
        request_tokens_max: 256,
        capture_sizes: vec![1, 2, 4, 8, 16, 32],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: false,
    }
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
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

/// Runs the requests to completion; returns the watched request's logits at each of its sampled
/// tokens, its tokens, and how many steps had 32 rows mixing prefill and decode with it among
/// them.
fn run(
    weights: &Arc<LlamaWeights>,
    requests: Vec<NewRequest>,
    threads: usize,
) -> (Vec<Vec<f32>>, Vec<u32>, usize) {
    let config = config();
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut executor =
        CpuExecutor::with_threads(weights.clone(), config.pool, config.running_max, threads);
    for r in requests {
        executor.start_request(r.id, spec(r.id, &r.prompt));
        sched.submit(r, Time::ZERO).unwrap();
    }
    let mut watched = Vec::new();
    let mut tokens = Vec::new();
    let mut full_mixed_steps = 0;
    let mut finished = BTreeMap::new();
    for _ in 0..200 {
        let Some(plan) = sched.plan_step(Time::ZERO) else { break };
        let (outputs, logits) = executor.execute_with_logits(&plan).unwrap();
        let sampling: Vec<_> = plan.rows.iter().filter(|r| r.sample).collect();
        for (row, l) in sampling.iter().zip(&logits) {
            if row.request == WATCHED {
                watched.push(l.clone());
            }
        }
        let prefill = plan.rows.iter().any(|r| r.positions.len() > 1);
        let decode = plan.rows.iter().any(|r| r.positions.len() == 1);
        if plan.rows.len() == 32
            && prefill
            && decode
            && plan.rows.iter().any(|r| r.request == WATCHED)
        {
            full_mixed_steps += 1;
        }
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        sched.check_invariants().unwrap();
        while let Some(event) = sched.poll_event() {
            match event {
                SchedEvent::Token { request: WATCHED, token } => tokens.push(token),
                SchedEvent::Finished { request, .. } => {
                    executor.end_request(request);
                    finished.insert(request, ());
                }
                _ => {}
            }
        }
    }
    assert_eq!(sched.requests_held(), 0, "everything finishes");
    (watched, tokens, full_mixed_steps)
}

#[test]
fn a_request_is_bit_identical_alone_and_in_a_batch_of_32() {
    let Some((_, file)) = common::default_model() else { return };
    let gguf = common::parse(&file);
    let weights = Arc::new(LlamaWeights::from_gguf(&gguf, &file).unwrap());
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    let prompt = tokenizer.encode("The capital of France is").unwrap();
    alone_and_in_a_crowd(&weights, prompt, 4000);
}

/// The same on the generated quantized Llamas (`quantized`): every block type's products take
/// four inputs a pass in a batch and one alone, through each of llama.cpp's paths.
#[test]
fn a_quantized_request_is_bit_identical_alone_and_in_a_batch_of_32() {
    for shape in [&quantized::TINY, &quantized::LEGACY, &quantized::Q5_K_M] {
        let file = quantized::bytes_of(shape);
        let gguf = common::parse(&file);
        let weights = Arc::new(LlamaWeights::from_gguf(&gguf, &file).unwrap());
        alone_and_in_a_crowd(&weights, vec![1, 300, 72, 101, 108], 280);
    }
}

/// `prompt` alone and among 31 companions whose prompts hold tokens 100 to `100 + span`.
fn alone_and_in_a_crowd(weights: &Arc<LlamaWeights>, prompt: Vec<u32>, span: u32) {
    let watched = request(0, prompt.clone(), 6);

    // Alone on one thread; in the crowd on three, which split every product and the KV heads
    // differently: neither may change a bit.
    let (alone, alone_tokens, _) = run(weights, vec![watched.clone()], 1);
    assert_eq!((alone.len(), alone_tokens.len()), (6, 6));

    // 31 companions with prompts of 3 to 17 tokens: chunked 2 at a time, the long ones keep
    // prefilling while the short ones decode, and every step has a row for each of the 32.
    let mut crowd = vec![watched];
    for id in 1..32u64 {
        let len = 3 + (id as usize * 7) % 15;
        let companion: Vec<u32> =
            (0..len).map(|i| 100 + ((id as u32 * 131 + i as u32 * 17) % span)).collect();
        crowd.push(request(id, companion, 3 + (id as u32 % 4)));
    }
    let (in_batch, batch_tokens, mixed) = run(weights, crowd, 3);
    assert!(mixed > 0, "no step had 32 rows mixing prefill and decode with the watched request");
    assert_eq!(alone.len(), in_batch.len());
    for (step, (a, b)) in alone.iter().zip(&in_batch).enumerate() {
        assert!(a == b, "step {step}: logits differ alone and in the batch");
    }
    assert_eq!(alone_tokens, batch_tokens, "sampled tokens differ alone and in the batch");

    // And both equal the single-sequence reference, sampling with the same generator, bias and
    // penalties (the output so far recorded as the executors record it: from the inputs).
    let mut sampler = RequestSampler::new(spec(WATCHED, &prompt), None);
    let mut sequence = Sequence::new(&weights.config);
    let mut logits = Vec::new();
    for (position, &t) in (0u32..).zip(&prompt) {
        sampler.record(position, t).unwrap();
        logits = sequence.forward(weights, t);
    }
    for (step, expected) in alone.iter().enumerate() {
        assert!(&logits == expected, "step {step}: the paged executor differs from the reference");
        let position = (prompt.len() + step) as u32;
        let (next, _) = sampler.sample(&logits, position).unwrap();
        assert_eq!(next, alone_tokens[step], "step {step}: the reference samples another token");
        sampler.record(position, next).unwrap();
        logits = sequence.forward(weights, next);
    }
}
