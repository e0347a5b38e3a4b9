//! The Hugging Face path against transformers, without a download: tiny models our own code
//! generates (`tiny`) load through `Model::load` (config.json, safetensors single or sharded,
//! f32 or bf16, tokenizer.json, tokenizer_config.json's chat template) and compute what
//! transformers computes on the same files (`goldens/hf_tiny.json`, from
//! `goldens/make_hf_tiny_goldens.py`): Llama, Llama 3.1 RoPE scaling with tied embeddings,
//! Qwen2's biases, and Mistral's sliding window. Bad directories give errors that name the file
//! and the tensor.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod tiny;

use lockstep_gpu::chat::Message;
use std::path::PathBuf;
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{Executor, SamplingSpec};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, Scheduler, StepMode};
use lockstep_gpu::llama::{CpuExecutor, LlamaWeights, Sequence};
use lockstep_gpu::model::Model;
use lockstep_gpu::sampling::argmax;
use serde_json::Value;

/// transformers computes in f32 throughout; lockstep keeps the KV cache, the query against it and
/// the softmax weights in half precision (as llama.cpp does), which moves each of those by up to
/// 2^-11 relative. Measured: at most 0.014 over all variants, positions and tokens (printed
/// below; the arithmetic is deterministic, so it is the same on every machine). The bound is
/// tight on purpose: ignoring Mistral's window moves the first logit it touches by 0.037.
const LOGIT_TOLERANCE: f32 = 0.02;

/// transformers' results, and the tokens they are for.
fn goldens() -> (Value, Vec<u32>) {
    let goldens: Value = serde_json::from_str(include_str!("goldens/hf_tiny.json")).unwrap();
    let tokens = serde_json::from_value(goldens["tokens"].clone()).unwrap();
    (goldens, tokens)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-tiny-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn tiny_models_compute_what_transformers_computes() {
    let (goldens, tokens) = goldens();
    let mut widest = 0f32;
    for variant in tiny::variants() {
        let expected = &goldens["models"][variant.name];
        assert!(expected.is_object(), "no golden for {}", variant.name);
        let dir = scratch(variant.name);
        variant.write(&dir);
        let model = Model::load(&dir).unwrap();
        let name = variant.name;

        let encoded = model.tokenizer.encode("hello there, the tiny test!").unwrap();
        let their_encoded: Vec<u32> = serde_json::from_value(expected["encoded"].clone()).unwrap();
        assert_eq!(encoded, their_encoded, "{name}: tokens");
        let messages = [Message { role: "user".into(), content: "hi there".into() }];
        let chat = model.render_chat(&messages, true).unwrap();
        assert_eq!(chat, expected["chat"].as_str().unwrap(), "{name}: chat template");
        assert_eq!(model.stop_tokens, [tiny::IM_END], "{name}: stop tokens");

        let mut sequence = Sequence::new(&model.weights.config);
        let mut logits = Vec::new();
        for (position, &token) in tokens.iter().enumerate() {
            logits = sequence.forward(&model.weights, token);
            let theirs = expected["logits"][position].as_array().unwrap();
            assert_eq!(theirs.len(), logits.len(), "{name}: vocabulary");
            for (i, (ours, theirs)) in logits.iter().zip(theirs).enumerate() {
                let gap = (ours - theirs.as_f64().unwrap() as f32).abs();
                widest = widest.max(gap);
                assert!(
                    gap <= LOGIT_TOLERANCE,
                    "{name}: position {position} token {i}: {ours} vs transformers {theirs}"
                );
            }
        }
        let mut greedy = Vec::new();
        let mut next = argmax(&logits);
        for _ in 0..8 {
            greedy.push(next);
            next = argmax(&sequence.forward(&model.weights, next));
        }
        let their_greedy: Vec<u32> = serde_json::from_value(expected["greedy"].clone()).unwrap();
        assert_eq!(greedy, their_greedy, "{name}: greedy continuation");
        // The executor the server runs (chunked prefill over paged KV, three threads) gives the
        // reference's logits bit for bit, biases, window and RoPE factors included.
        let mut reference = Sequence::new(&model.weights.config);
        let mut expected_logits = Vec::new();
        for &t in tokens.iter().chain(&greedy[..7]) {
            expected_logits.push(reference.forward(&model.weights, t));
        }
        let served = executor_logits(&model, &tokens, greedy.len() as u32);
        assert_eq!(served.len(), greedy.len(), "{name}: one sampled step per token");
        for (step, logits) in served.iter().enumerate() {
            assert!(
                logits == &expected_logits[tokens.len() - 1 + step],
                "{name}: step {step}: the executor differs from the reference"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    eprintln!("widest logit gap to transformers: {widest}");
}

/// The logits of each sampled step of one greedy request through the scheduler and
/// `CpuExecutor`, its prompt prefilled five tokens a step.
fn executor_logits(model: &Model, prompt: &[u32], max_tokens: u32) -> Vec<Vec<f32>> {
    let config = SchedConfig {
        pool: PoolConfig { pages_total: 16, page_tokens: 4, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 1,
        running_max: 1,
        step_tokens_max: 5,
        prefill_chunk_tokens_max: 5,
        scored_tokens_max: 5,
        request_tokens_max: 64,
        capture_sizes: vec![1],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: false,
    };
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut executor = CpuExecutor::with_threads(model.weights.clone(), config.pool, 1, 3);
    executor.start_request(RequestId(0), SamplingSpec::GREEDY);
    let request = NewRequest {
        id: RequestId(0),
        prompt: prompt.to_vec(),
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: true,
        priority: 0,
        cache_salt: 0,
    };
    sched.submit(request, Time::ZERO).unwrap();
    let mut sampled = Vec::new();
    while let Some(plan) = sched.plan_step(Time::ZERO) {
        let (outputs, logits) = executor.execute_with_logits(&plan).unwrap();
        sampled.extend(logits);
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        while sched.poll_event().is_some() {}
    }
    sampled
}

/// The same tiny models converted to GGUF as llama.cpp's converter does (Q and K permuted for
/// interleaved RoPE, qwen2's biases, Llama 3.1's `rope_freqs`) compute what transformers computes
/// too, through the GGUF loader: the permutation, the qwen2 architecture and the RoPE factors
/// are checked against a reference we did not write.
#[test]
fn the_same_models_as_gguf_compute_what_transformers_computes() {
    let (goldens, tokens) = goldens();
    let mut converted = 0;
    for variant in tiny::variants() {
        let dir = scratch(&format!("gguf-{}", variant.name));
        variant.write(&dir);
        let hf = Model::load(&dir).unwrap();
        let path = dir.join("model.gguf");
        let factors = hf.weights.config.rope_freq_factors.clone();
        if variant.write_gguf(&path, factors.as_deref()).is_none() {
            continue;
        }
        converted += 1;
        let weights = LlamaWeights::load_gguf(&path).unwrap();
        assert_eq!(weights.config.rope_freq_factors, factors, "{}", variant.name);
        let expected = &goldens["models"][variant.name]["logits"];
        let mut sequence = Sequence::new(&weights.config);
        for (position, &token) in tokens.iter().enumerate() {
            let logits = sequence.forward(&weights, token);
            for (i, (ours, theirs)) in
                logits.iter().zip(expected[position].as_array().unwrap()).enumerate()
            {
                let gap = (ours - theirs.as_f64().unwrap() as f32).abs();
                assert!(
                    gap <= LOGIT_TOLERANCE,
                    "{} as GGUF: position {position} token {i}: {ours} vs transformers {theirs}",
                    variant.name
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert_eq!(converted, 3, "llama, llama 3.1 and qwen2 convert; mistral's window does not");
}

#[test]
fn bad_model_directories_name_the_file_and_the_tensor() {
    let variant = &tiny::variants()[0];
    let load = |dir: &PathBuf| Model::load(dir).unwrap_err().to_string();

    let dir = scratch("truncated");
    variant.write(&dir);
    let weights = dir.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let err = load(&dir);
    assert!(err.contains("model.safetensors") && err.contains("not a safetensors file"), "{err}");

    std::fs::write(&weights, b"GGUF nonsense").unwrap();
    assert!(load(&dir).contains("not a safetensors file"));

    // A config that disagrees with the tensors: the shape error names both.
    let dir = scratch("shape");
    variant.write(&dir);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"intermediate_size\":96", "\"intermediate_size\":80"),
    )
    .unwrap();
    let err = load(&dir);
    assert!(err.contains("model.safetensors") && err.contains("mlp.gate_proj.weight"), "{err}");
    assert!(err.contains("[96, 64]") && err.contains("[80, 64]"), "{err}");

    // More layers than stored: the missing tensor is named.
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":3"),
    )
    .unwrap();
    let err = load(&dir);
    assert!(
        err.contains("model.layers.2.input_layernorm.weight") && err.contains("missing"),
        "{err}"
    );

    std::fs::write(dir.join("config.json"), config.replace("\"llama\"", "\"gpt_neox\"")).unwrap();
    let err = load(&dir);
    assert!(err.contains("config.json") && err.contains("gpt_neox"), "{err}");

    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(load(&dir).contains("config.json"));

    // A sharded index may only name files beside it.
    let dir = scratch("index");
    tiny::variants()[1].write(&dir);
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(&index, text.replace("model-00002-of-00002", "../../etc/passwd")).unwrap();
    let err = load(&dir);
    assert!(err.contains("index.json") && err.contains("not a plain file name"), "{err}");

    for name in ["truncated", "shape", "index"] {
        std::fs::remove_dir_all(scratch(name)).ok();
    }
}
