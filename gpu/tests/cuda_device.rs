//! The CUDA backend on a device, checked against the CPU backend (the device check of issue 12,
//! run by `ci/device-check.sh`). Without a CUDA driver and device every test here skips with the
//! reason, unless `LOCKSTEP_REQUIRE_CUDA=1` makes that a failure; the one check that needs no
//! device (a clean error with no driver) runs wherever there is none.
//!
//! - Greedy tokens and logits equal the CPU backend's on the llama.cpp golden prompts of the
//!   default model (`goldens/llamacpp.json`) and on the tiny models of every family variant
//!   (Hugging Face and GGUF, and in GGUF's block types), within tolerances stated below; every
//!   launch option (block weights included) computes the plain run's bits.
//! - A request alone equals itself in a batch of 32 mixed prefill and decode rows, bit for bit,
//!   eager steps and graph replays included.
//! - A long context's attention in split blocks and their merge has the bits of one block walking
//!   the splits (the kernels on crafted inputs, and the tiny Llama past one split).
//! - Decode tokens/s at batch 1, 32 and 256 on a random-weight Llama of about 1.2B parameters
//!   (Llama 3.2 1B's shape, f16 and Q4_1), against the HBM roofline (`#[ignore]`: a benchmark).
//!
//! Results go to stderr and, when `OUT` names a folder, to `$OUT/cuda_device.jsonl`.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;
mod quantized;
mod tiny;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{Executor, ProvenanceModel, TokenLogprobs, logprobs};
use lockstep_core::sched::{
    Bucket, NewRequest, RequestId, SchedConfig, SchedEvent, Scheduler, StepMode, StepOutputs,
    StepPlan,
};
use lockstep_gpu::cuda::executor::{CudaExecutor, CudaOptions, LaunchOptions, kernel_functions};
use lockstep_gpu::cuda::kernel_cache::KernelCache;
use lockstep_gpu::cuda::{kernels, probe};
use lockstep_gpu::gguf::{Gguf, TensorType, f32_to_f16};
use lockstep_gpu::llama::{CpuExecutor, Layer, LlamaConfig, LlamaWeights, RopeStyle, Weight};
use lockstep_gpu::model::Model;
use lockstep_gpu::sampling::{Sampling, SamplingSpec};
use serde_json::{Value, json};

/// A CUDA executor; with `LOCKSTEP_CUDA_KERNELS_DIR` set, on the cubins compiled ahead of time
/// there (a device without NVRTC), else compiled by NVRTC now.
fn cuda(
    weights: &Arc<LlamaWeights>,
    pool: PoolConfig,
    slots: u32,
    options: CudaOptions,
) -> CudaExecutor {
    let dir = std::env::var_os("LOCKSTEP_CUDA_KERNELS_DIR").map(PathBuf::from);
    CudaExecutor::with_prebuilt(weights.clone(), pool, slots, options, dir.as_deref()).unwrap()
}

/// Whether a device is here; otherwise the test skips (or fails under LOCKSTEP_REQUIRE_CUDA=1).
fn device_or_skip() -> bool {
    let probed = match std::env::var_os("LOCKSTEP_CUDA_KERNELS_DIR") {
        Some(_) => probe::probe_device(0),
        None => probe::probe(0),
    };
    match probed {
        Ok(info) => {
            eprintln!("device: {info:?}");
            true
        }
        Err(e) if std::env::var("LOCKSTEP_REQUIRE_CUDA").as_deref() == Ok("1") => {
            panic!("LOCKSTEP_REQUIRE_CUDA=1 but {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn report(check: &str, result: Value) {
    let line = json!({"check": check, "result": result}).to_string();
    eprintln!("{line}");
    if let Some(out) = std::env::var_os("OUT") {
        let path = PathBuf::from(out).join("cuda_device.jsonl");
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
        writeln!(file, "{line}").unwrap();
    }
}

/// The two executors under one face.
trait Backend {
    fn start(&mut self, request: RequestId, spec: SamplingSpec);
    fn end(&mut self, request: RequestId);
    fn step(&mut self, plan: &StepPlan) -> (StepOutputs, Vec<Vec<f32>>);
}

impl Backend for CpuExecutor {
    fn start(&mut self, request: RequestId, spec: SamplingSpec) {
        self.start_request(request, spec);
    }
    fn end(&mut self, request: RequestId) {
        self.end_request(request);
    }
    fn step(&mut self, plan: &StepPlan) -> (StepOutputs, Vec<Vec<f32>>) {
        self.execute_with_logits(plan).unwrap()
    }
}

impl Backend for CudaExecutor {
    fn start(&mut self, request: RequestId, spec: SamplingSpec) {
        self.start_request(request, spec);
    }
    fn end(&mut self, request: RequestId) {
        self.end_request(request);
    }
    fn step(&mut self, plan: &StepPlan) -> (StepOutputs, Vec<Vec<f32>>) {
        self.execute_with_logits(plan).unwrap()
    }
}

fn config(running_max: u32, chunk: u32) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 640, page_tokens: 16, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 64,
        running_max,
        step_tokens_max: 256,
        prefill_chunk_tokens_max: chunk,
        scored_tokens_max: chunk,
        request_tokens_max: 320,
        capture_sizes: vec![1, 2, 4, 8, 16, 32],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(600),
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

/// Per request: its sampled tokens and the logits each was sampled from.
type Runs = BTreeMap<RequestId, (Vec<u32>, Vec<Vec<f32>>)>;

/// Runs `requests` (each with its sampling) to completion through lockstep's scheduler.
fn run(
    backend: &mut dyn Backend,
    config: &SchedConfig,
    requests: Vec<(NewRequest, Sampling)>,
) -> Runs {
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let mut runs = Runs::new();
    for (r, sampling) in requests {
        backend.start(r.id, SamplingSpec::for_prompt(sampling, &r.prompt));
        runs.insert(r.id, (Vec::new(), Vec::new()));
        sched.submit(r, Time::ZERO).unwrap();
    }
    for _ in 0..10_000 {
        let Some(plan) = sched.plan_step(Time::ZERO) else { break };
        let (outputs, logits) = backend.step(&plan);
        for (row, l) in plan.rows.iter().filter(|r| r.sample).zip(logits) {
            runs.get_mut(&row.request).unwrap().1.push(l);
        }
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        while let Some(event) = sched.poll_event() {
            match event {
                SchedEvent::Token { request, token } => {
                    runs.get_mut(&request).unwrap().0.push(token)
                }
                SchedEvent::Finished { request, .. } => backend.end(request),
                _ => {}
            }
        }
    }
    assert_eq!(sched.requests_held(), 0, "everything finishes");
    runs
}

/// How far CUDA's greedy run of one prompt stayed with the CPU's.
#[derive(Debug)]
struct Comparison {
    /// The widest logit gap over the steps compared.
    widest: f32,
    /// The prompt step's widest gap (the first step: a fault there is in the forward pass, one
    /// that shows only later is in the KV cache or decode).
    first_step: f32,
    /// Steps compared (up to a near tie, see `compare`).
    steps: usize,
    /// What broke the tolerance, if anything.
    failure: Option<String>,
}

/// Compares CUDA's run of one prompt with the CPU's: tokens must agree at every step and logits
/// within `tolerance`; at a step where the CPU's two best logits are within `2 * tolerance` (a
/// near tie either backend may break either way) a different token ends the comparison there
/// instead of failing it.
fn compare(
    cpu: &(Vec<u32>, Vec<Vec<f32>>),
    cuda: &(Vec<u32>, Vec<Vec<f32>>),
    tolerance: f32,
) -> Comparison {
    let mut c = Comparison { widest: 0.0, first_step: 0.0, steps: 0, failure: None };
    if cpu.1.len() != cuda.1.len() {
        c.failure = Some(format!("CPU {} steps, CUDA {}", cpu.1.len(), cuda.1.len()));
        return c;
    }
    for (step, (a, b)) in cpu.1.iter().zip(&cuda.1).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let gap = if x.is_nan() || y.is_nan() { f32::INFINITY } else { (x - y).abs() };
            c.widest = c.widest.max(gap);
            if step == 0 {
                c.first_step = c.first_step.max(gap);
            }
            if gap > tolerance && c.failure.is_none() {
                c.failure = Some(format!("step {step} token {i}: CPU {x}, CUDA {y}"));
            }
        }
        if c.failure.is_some() {
            return c;
        }
        if cpu.0[step] != cuda.0[step] {
            let mut sorted = a.clone();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let margin = sorted[0] - sorted[1];
            if margin > 2.0 * tolerance {
                c.failure = Some(format!(
                    "step {step}: CPU picks {}, CUDA {} with a margin of {margin}",
                    cpu.0[step], cuda.0[step]
                ));
            }
            return c;
        }
        c.steps = step + 1;
    }
    c
}

/// Greedy requests of `max_tokens` for `prompts`, run one at a time.
fn greedy(prompts: &[Vec<u32>], max_tokens: u32) -> Vec<(NewRequest, Sampling)> {
    (prompts.iter().enumerate())
        .map(|(i, p)| (request(i as u64, p.clone(), max_tokens), Sampling::GREEDY))
        .collect()
}

/// The CPU backend on `prompts` (`both`'s first half).
fn both_on_the_cpu(
    weights: &Arc<LlamaWeights>,
    prompts: &[Vec<u32>],
    max_tokens: u32,
) -> (Runs, SchedConfig, Vec<(NewRequest, Sampling)>) {
    let config = config(1, 7);
    let requests = greedy(prompts, max_tokens);
    let mut cpu = CpuExecutor::new(weights.clone(), config.pool, config.running_max);
    (run(&mut cpu, &config, requests.clone()), config, requests)
}

/// Both backends on `prompts`, greedy, `max_tokens` each, one prompt at a time; then CUDA again
/// with every launch option, which may change no bit. The CPU runs `cpu_weights`: the device's
/// weights, or the same dequantized (see `DEFAULT_MODEL_TOLERANCE`); with every launch option
/// the device keeps a quantized model's block-typed matrices in their blocks.
struct Both {
    cpu: Runs,
    cuda: Runs,
    /// The graph replays of the plain CUDA run.
    replayed: u64,
    cuda_with_options: Runs,
}

fn both(
    cpu_weights: &Arc<LlamaWeights>,
    weights: &Arc<LlamaWeights>,
    prompts: &[Vec<u32>],
    max_tokens: u32,
) -> Both {
    let (cpu, config, requests) = both_on_the_cpu(cpu_weights, prompts, max_tokens);
    let mut executor = cuda(weights, config.pool, config.running_max, CudaOptions::default());
    let cuda_runs = run(&mut executor, &config, requests.clone());
    let options = CudaOptions { launch: LaunchOptions::ALL, ..CudaOptions::default() };
    let mut with_options = cuda(weights, config.pool, config.running_max, options);
    let cuda_with_options = run(&mut with_options, &config, requests);
    Both { cpu, cuda: cuda_runs, replayed: executor.steps_replayed, cuda_with_options }
}

/// Where the run with every launch option left the plain run's bits: the steps whose logits
/// differ, or the tokens' disagreement.
fn options_changed(
    plain: &(Vec<u32>, Vec<Vec<f32>>),
    options: &(Vec<u32>, Vec<Vec<f32>>),
) -> Option<String> {
    let differing = steps_differing(&plain.1, &options.1);
    match (differing.is_empty() && plain.1.len() == options.1.len(), plain.0 == options.0) {
        (true, true) => None,
        (true, false) => Some("the launch options changed the tokens".into()),
        (false, _) => Some(format!("the launch options changed the logits at steps {differing:?}")),
    }
}

/// The tiny models carry f32 or bf16 weights, multiplied exactly on both sides; what differs is
/// the order of the sums (lanes of 8 on the CPU, 32 lanes of 8 on the device), the device's
/// `expf`/`sincosf` against the CPU's, and above all the softmax weights: the CPU rounds them to
/// half precision before they weigh the values (llama.cpp's KQV product takes them as f16), the
/// device keeps them f32, a relative 2^-11 per weight. Measured on the H200 (2026-12-04): at most
/// 5.1e-3 on logits of order 1 to 10 over 24 steps, so about twice that. A real fault (a wrong
/// RoPE pair, mask or page) moves logits by whole units.
const TINY_TOLERANCE: f32 = 1e-2;
/// The default model is Q4_1. The device multiplies its weights dequantized (by the CPU's own
/// dequantizer) with f32 activations; the CPU's quantized path first rounds each activation to 8
/// bits (llama.cpp's `Q8_1`), which moves the default model's logits by up to 1.44 on the golden
/// prompts (the CPU against itself on the dequantized model, measured here: first-step gaps
/// 0.62, 1.38, 0.76, 0.73, 0.59) and changes greedy tokens after 0 to 25 steps. So the device is
/// held to the CPU backend running the dequantized model, the same arithmetic but for the f16
/// softmax weights (see `TINY_TOLERANCE`), whose relative 2^-11 grows over 30 layers, logits up
/// to 20 and 32 steps of cache to at most 0.042 (measured on the H200, 2026-12-04; 0.015 at the
/// prompt step). The tolerance is about twice that, as the tiny models' is; the gap to the
/// quantized path and agreement with llama.cpp are reported beside it.
const DEFAULT_MODEL_TOLERANCE: f32 = 0.1;

#[test]
fn cuda_greedy_tokens_and_logits_equal_the_cpu_backend_s_on_the_tiny_models() {
    if !device_or_skip() {
        return;
    }
    let mut failures = Vec::new();
    let goldens: Value = serde_json::from_str(include_str!("goldens/hf_tiny.json")).unwrap();
    let tokens: Vec<u32> = serde_json::from_value(goldens["tokens"].clone()).unwrap();
    let mut check = |name: &str, cpu_weights: &Arc<LlamaWeights>, weights: &Arc<LlamaWeights>| {
        let prompts = [tokens.clone(), tokens[..3].to_vec()];
        let Both { cpu, cuda, replayed, cuda_with_options } =
            both(cpu_weights, weights, &prompts, 24);
        if replayed == 0 {
            failures.push(format!("{name}: no decode step replayed a captured graph"));
        }
        for (id, run) in &cpu {
            let c = compare(run, &cuda[id], TINY_TOLERANCE);
            let options = options_changed(&cuda[id], &cuda_with_options[id]);
            report(
                "tiny model vs CPU",
                json!({"model": name, "prompt": id.0, "widest_logit_gap": c.widest,
                "prompt_step_gap": c.first_step, "steps_agreeing": c.steps,
                "steps": run.0.len(), "failure": c.failure, "every_launch_option": options}),
            );
            for f in c.failure.iter().chain(&options) {
                failures.push(format!("{name}, prompt {}: {f}", id.0));
            }
        }
    };
    for variant in tiny::variants() {
        let dir = std::env::temp_dir().join(format!("lockstep-cuda-{}", variant.name));
        let _ = std::fs::remove_dir_all(&dir);
        variant.write(&dir);
        let weights = Model::load(&dir).unwrap().weights;
        check(variant.name, &weights, &weights);
        let gguf = dir.join("model.gguf");
        let factors = weights.config.rope_freq_factors.clone();
        if variant.write_gguf(&gguf, factors.as_deref()).is_some() {
            let weights = Arc::new(LlamaWeights::load_gguf(&gguf).unwrap());
            check(&format!("{} as GGUF", variant.name), &weights, &weights);
        }
        if let Some((blocks, kind_of)) = quantized_variant(variant.name) {
            let quantized = Arc::new(quantized(&weights, kind_of));
            let name = format!("{} in {blocks}", variant.name);
            check(&name, &Arc::new(dequantized(&quantized)), &quantized);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // The generated quantized Llamas: Q4_K and Q6_K, the 32-element types, Q5_K and Q6_K (with
    // every option the K-quants, Q4_0 and Q8_0 go up in their blocks, Q5_0, Q5_1 and Q5_K as f32).
    for (name, shape) in [
        ("the K-quant Llama", &quantized::TINY),
        ("the 32-element-block Llama", &quantized::LEGACY),
        ("the Q5_K_M Llama", &quantized::Q5_K_M),
    ] {
        let file = quantized::bytes_of(shape);
        let gguf = Gguf::parse(&file).unwrap();
        let weights = Arc::new(LlamaWeights::from_gguf(&gguf, &file).unwrap());
        check(name, &Arc::new(dequantized(&weights)), &weights);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn cuda_greedy_tokens_and_logits_equal_the_cpu_backend_s_on_the_default_model() {
    if !device_or_skip() {
        return;
    }
    let Some((_, file)) = common::default_model() else { return };
    let weights = Arc::new(LlamaWeights::from_gguf(&common::parse(&file), &file).unwrap());
    let goldens: Value = serde_json::from_str(include_str!("goldens/llamacpp.json")).unwrap();
    let prompts: Vec<Vec<u32>> = goldens["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::from_value(p["tokens"].clone()).unwrap())
        .collect();
    let (quantized_cpu, _, _) = both_on_the_cpu(&weights, &prompts, 32);
    let Both { cpu, cuda, cuda_with_options, .. } =
        both(&Arc::new(dequantized(&weights)), &weights, &prompts, 32);
    let mut failures = Vec::new();
    for (id, run) in &cpu {
        let c = compare(run, &cuda[id], DEFAULT_MODEL_TOLERANCE);
        let options = options_changed(&cuda[id], &cuda_with_options[id]);
        let quantized = compare(&quantized_cpu[id], &cuda[id], f32::INFINITY);
        let golden: Vec<u32> =
            serde_json::from_value(goldens["prompts"][id.0 as usize]["greedy"].clone()).unwrap();
        let agree = |tokens: &[u32]| tokens.iter().zip(&golden).take_while(|(a, b)| a == b).count();
        report(
            "default model vs CPU",
            json!({"prompt": id.0, "widest_logit_gap": c.widest,
            "prompt_step_gap": c.first_step, "steps_agreeing": c.steps, "steps": run.0.len(),
            "quantized_cpu_prompt_step_gap": quantized.first_step,
            "cuda_greedy_tokens_equal_to_llama_cpp": agree(&cuda[id].0),
            "dequantized_cpu_greedy_tokens_equal_to_llama_cpp": agree(&run.0),
            "quantized_cpu_greedy_tokens_equal_to_llama_cpp": agree(&quantized_cpu[id].0),
            "failure": c.failure, "every_launch_option": options}),
        );
        for f in c.failure.iter().chain(&options) {
            failures.push(format!("prompt {}: {f}", id.0));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `weights` with every matrix replaced by `f(its name, it)`.
fn with_matrices(weights: &LlamaWeights, f: impl Fn(&str, &Weight) -> Weight) -> LlamaWeights {
    LlamaWeights {
        embed: f("embed", &weights.embed),
        layers: (weights.layers.iter())
            .map(|l| Layer {
                attn_norm: l.attn_norm.clone(),
                q: f("q", &l.q),
                k: f("k", &l.k),
                v: f("v", &l.v),
                qkv_bias: l.qkv_bias.clone(),
                o: f("o", &l.o),
                ffn_norm: l.ffn_norm.clone(),
                gate: f("gate", &l.gate),
                up: f("up", &l.up),
                down: f("down", &l.down),
            })
            .collect(),
        output_norm: weights.output_norm.clone(),
        output: weights.output.as_ref().map(|w| f("output", w)),
        config: weights.config.clone(),
    }
}

/// `weights` with every quantized matrix dequantized (the CPU backend's own dequantizer) into a
/// dense f32 one: the CPU backend then multiplies the values the device multiplies, with f32
/// activations as the device's (a quantized matrix makes the CPU round activations to 8 bits).
fn dequantized(weights: &LlamaWeights) -> LlamaWeights {
    with_matrices(weights, |_, w| match w {
        Weight::Dense { .. } => w.clone(),
        Weight::Quantized(_) | Weight::KQuantized(_) => Weight::Dense {
            rows: w.rows(),
            cols: w.cols(),
            data: (0..w.rows()).flat_map(|r| w.row(r)).collect(),
        },
    })
}

/// Which GGUF block type a matrix of a given name is rounded to (`quantized`).
type BlockTypes = fn(&str) -> TensorType;

/// The tiny variants also checked with their matrices in GGUF blocks, and each matrix's type
/// there: every block type, an embedding tied to the output in blocks, Qwen2's biases, and a Q/K/V
/// stack of two types (which goes up dequantized, the rest in blocks).
fn quantized_variant(variant: &str) -> Option<(&'static str, BlockTypes)> {
    match variant {
        "llama" => Some(("Q4_0", |_| TensorType::Q4_0)),
        "llama3_scaled_tied_bf16_sharded" => Some(("Q4_1", |_| TensorType::Q4_1)),
        "qwen2" => Some(("Q8_0 with V in Q4_1", |name| match name {
            "v" => TensorType::Q4_1,
            _ => TensorType::Q8_0,
        })),
        _ => None,
    }
}

/// `weights` with every matrix `m` rounded to GGUF blocks of type `kind_of(m's name)`, scales
/// chosen as ggml's reference quantizers choose them (the value of largest magnitude over -8 for
/// `Q4_0`, the range over 15 above the minimum for `Q4_1`, the largest magnitude over 127 for
/// `Q8_0`).
fn quantized(weights: &LlamaWeights, kind_of: BlockTypes) -> LlamaWeights {
    with_matrices(weights, |name, w| {
        let kind = kind_of(name);
        let data: Vec<f32> = (0..w.rows()).flat_map(|r| w.row(r)).collect();
        let mut bytes = Vec::new();
        for block in data.chunks_exact(32) {
            let half = |v: f32| f32_to_f16(v).to_le_bytes();
            let inverse = |d: f32| if d == 0.0 { 0.0 } else { 1.0 / d };
            match kind {
                TensorType::Q4_0 => {
                    let max =
                        block.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                    let d = max / -8.0;
                    let q = |v: f32| ((v * inverse(d) + 8.5) as i32).clamp(0, 15) as u8;
                    bytes.extend(half(d));
                    bytes.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
                }
                TensorType::Q4_1 => {
                    let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let q = |v: f32| (((v - min) * inverse(d) + 0.5) as i32).clamp(0, 15) as u8;
                    bytes.extend(half(d));
                    bytes.extend(half(min));
                    bytes.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
                }
                _ => {
                    let d = block.iter().fold(0f32, |m, &v| m.max(v.abs())) / 127.0;
                    bytes.extend(half(d));
                    bytes.extend(block.iter().map(|&v| (v * inverse(d)).round() as i8 as u8));
                }
            }
        }
        Weight::new(kind, w.rows(), w.cols(), &bytes)
    })
}

/// Runs one watched request alone, then among 31 companions whose prompts of 3 to 17 tokens
/// prefill 2 at a time while the short ones decode; then both again with every launch option,
/// none of which may change a bit (programmatic dependent launches; norms folded into the
/// products, which the steps alone take, of at most 2 tokens; wide products, which the crowd's
/// steps of more than 8 tokens take). Returns the watched request's four runs: alone, in the
/// crowd, and the same with the options.
fn alone_and_in_a_crowd(weights: &Arc<LlamaWeights>, vocab: u32) -> [(Vec<u32>, Vec<Vec<f32>>); 4] {
    let config = config(32, 2);
    // Penalties on two requests of three, the watched one among them (sampled on the host).
    let sampling = |id: u64| Sampling {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 7 ^ id,
        presence_penalty: if id % 3 == 2 { 0.0 } else { 0.6 },
        frequency_penalty: if id % 3 == 2 { 0.0 } else { 0.4 },
        min_p: 0.0,
        repetition_penalty: if id % 3 == 2 { 1.0 } else { 1.3 },
    };
    let prompt: Vec<u32> = (0..5).map(|i| (11 + 37 * i) % vocab).collect();
    let watched = (request(0, prompt, 6), sampling(0));
    let mut crowd = vec![watched.clone()];
    for id in 1..32u64 {
        let len = 3 + (id as usize * 7) % 15;
        let p: Vec<u32> =
            (0..len).map(|i| (100 + id as u32 * 131 + i as u32 * 17) % vocab).collect();
        crowd.push((request(id, p, 3 + (id as u32 % 4)), sampling(id)));
    }
    let new = |on| {
        let launch = if on { LaunchOptions::ALL } else { LaunchOptions::default() };
        let options = CudaOptions { launch, ..CudaOptions::default() };
        cuda(weights, config.pool, config.running_max, options)
    };
    let mut runs = [false, true].into_iter().flat_map(|on| {
        let mut alone_executor = new(on);
        let alone =
            run(&mut alone_executor, &config, vec![watched.clone()]).remove(&RequestId(0)).unwrap();
        let mut crowd_executor = new(on);
        let in_crowd =
            run(&mut crowd_executor, &config, crowd.clone()).remove(&RequestId(0)).unwrap();
        assert!(alone_executor.steps_replayed > 0 && crowd_executor.steps_eager > 0);
        [alone, in_crowd]
    });
    std::array::from_fn(|_| runs.next().unwrap())
}

/// The steps at which two runs' logits differ in any bit.
fn steps_differing(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<usize> {
    (a.iter().zip(b).enumerate())
        .filter(|(_, (a, b))| {
            a.len() != b.len() || a.iter().zip(*b).any(|(x, y)| x.to_bits() != y.to_bits())
        })
        .map(|(step, _)| step)
        .collect()
}

/// The watched request's logits alone and in the crowd are the same bits at every step.
fn batch_invariant(name: &str, weights: &Arc<LlamaWeights>) {
    let vocab = weights.config.vocab_size as u32;
    let [alone, in_crowd, alone_options, in_crowd_options] = alone_and_in_a_crowd(weights, vocab);
    assert_eq!((alone.1.len(), alone_options.1.len(), in_crowd_options.1.len()), (6, 6, 6));
    let differing = steps_differing(&alone.1, &in_crowd.1);
    let options_alone = steps_differing(&alone.1, &alone_options.1);
    let options_in_crowd = steps_differing(&in_crowd.1, &in_crowd_options.1);
    report(
        "batch invariance",
        json!({"model": name, "steps": alone.1.len(), "steps_differing": differing,
        "steps_differing_with_every_launch_option":
            {"alone": options_alone, "in_the_batch": options_in_crowd},
        "tokens_alone": alone.0, "tokens_in_the_batch": in_crowd.0}),
    );
    assert!(differing.is_empty(), "{name}: logits differ alone and in the batch at {differing:?}");
    assert_eq!(alone.0, in_crowd.0, "{name}: tokens differ alone and in the batch");
    assert!(
        options_alone.is_empty() && options_in_crowd.is_empty(),
        "{name}: the launch options changed the logits at steps {options_alone:?} alone, \
         {options_in_crowd:?} in the batch"
    );
}

#[test]
fn a_request_alone_equals_itself_in_a_batch_of_32_on_cuda() {
    if !device_or_skip() {
        return;
    }
    let weights = tiny_llama("invariance");
    batch_invariant("tiny llama", &weights);
    // Every launch option includes block weights: the products and the wide products on blocks.
    batch_invariant("tiny llama in Q4_1", &Arc::new(quantized(&weights, |_| TensorType::Q4_1)));
}

/// A long context: split attention (each decoding token's 512-position splits in blocks of their
/// own, then merged) gives the bits of the plain kernel walking the splits in one block, alone
/// and with every option (RoPE folded into the split blocks too), and both stay with the CPU.
/// The prefill chunks (64 tokens: more than split attention takes) walk the splits one after
/// another in the plain kernel, so the prompt step already crosses a split boundary there.
/// (`split_attention_blocks_and_their_merge_give_the_one_block_bits` takes more splits than
/// blocks, windows, and tokens past the partials.)
#[test]
fn a_long_context_in_split_blocks_has_the_bits_of_one_block() {
    if !device_or_skip() {
        return;
    }
    let weights = tiny_llama("long");
    let vocab = weights.config.vocab_size as u32;
    let mut config = config(2, 64);
    config.request_tokens_max = 800;
    // Two rows, so a decode step has a token in split blocks beside another, both in their
    // second split.
    let prompts: Vec<Vec<u32>> = [(700, 7), (530, 11)]
        .map(|(len, seed)| (0..len).map(|i| (seed + 31 * i) % vocab).collect())
        .to_vec();
    let requests = greedy(&prompts, 24);
    let mut cpu = CpuExecutor::new(weights.clone(), config.pool, config.running_max);
    let cpu = run(&mut cpu, &config, requests.clone());
    let on = |launch| {
        let options = CudaOptions { launch, ..CudaOptions::default() };
        let mut executor = cuda(&weights, config.pool, config.running_max, options);
        run(&mut executor, &config, requests.clone())
    };
    let plain = on(LaunchOptions::default());
    let split = on(LaunchOptions { split_attention: true, ..LaunchOptions::default() });
    let every = on(LaunchOptions::ALL);
    let mut failures = Vec::new();
    for (id, run) in &cpu {
        let c = compare(run, &plain[id], TINY_TOLERANCE);
        let split_changed = options_changed(&plain[id], &split[id]);
        let every_changed = options_changed(&plain[id], &every[id]);
        report(
            "long context in split blocks",
            json!({"prompt_tokens": prompts[id.0 as usize].len(), "widest_logit_gap": c.widest,
            "steps_agreeing": c.steps, "steps": run.0.len(), "failure": c.failure,
            "split_attention": split_changed, "every_launch_option": every_changed}),
        );
        for f in c.failure.iter().chain(&split_changed).chain(&every_changed) {
            failures.push(format!("prompt {}: {f}", id.0));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Split attention at the kernel level, past what the tiny models reach: one token at position
/// 2,500 of a paged cache whose pages sit in a shuffled order, with no window (5 splits) and a
/// 1,500-position window (3 splits, from the window's first tile), in both head size classes the
/// tiny models do not use. The plain kernel walks the splits in one block; split blocks, 2 a
/// (token, head) so that each walks several splits, and the merge after them must give the same
/// bits; so must the split kernel with partials for fewer splits than the token has (one block
/// takes it whole and the merge leaves it).
#[test]
#[allow(unsafe_code, reason = "kernel launches on inputs of the test's own")]
fn split_attention_blocks_and_their_merge_give_the_one_block_bits() {
    if !device_or_skip() {
        return;
    }
    let context = CudaContext::new(0).unwrap();
    let stream = context.default_stream();
    let dir = std::env::var_os("LOCKSTEP_CUDA_KERNELS_DIR").map(PathBuf::from);
    let source = &kernels::PAGED_ATTENTION;
    let functions = kernel_functions(&context, 0, source, dir.as_deref()).unwrap();
    let entry = |name: String| {
        let at = source.functions.iter().position(|f| *f == name).unwrap();
        functions[at].clone()
    };
    let (heads, kv_heads, page_tokens, position) = (4usize, 2usize, 16usize, 2500usize);
    // 157 pages, a prime, so page `i` of the row is page `61 i mod 157` of the cache.
    let pages = position / page_tokens + 1;
    let table: Vec<i32> = (0..pages).map(|i| (i * 61 % pages) as i32).collect();
    let mut state = 0x9e37_79b9u32;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state as f32 / u32::MAX as f32 * 2.0 - 1.0
    };
    let ints = |v: &[i32]| stream.clone_htod(v).unwrap();
    let (positions, token_rows, table_offsets) = (ints(&[position as i32]), ints(&[0]), ints(&[0]));
    let tables = ints(&table);
    let mut failures = Vec::new();
    for (head_dim, class) in [(64usize, "d64"), (128, "d128")] {
        let kv_width = kv_heads * head_dim;
        let mut halves = |n: usize| (0..n).map(|_| f32_to_f16(uniform())).collect::<Vec<u16>>();
        let cache = pages * page_tokens * kv_width;
        let (keys, values) = (stream.clone_htod(&halves(cache)).unwrap(), {
            let v = halves(cache);
            stream.clone_htod(&v).unwrap()
        });
        let qkv: Vec<f32> = (0..heads * head_dim + 2 * kv_width).map(|_| 4.0 * uniform()).collect();
        let qkv = stream.clone_htod(&qkv).unwrap();
        let scale = 1.0 / (head_dim as f32).sqrt();
        for window in [0i32, 1500] {
            // `max_splits` of 0: the plain kernel; else split blocks with partials of that many.
            let attend = |max_splits: usize| {
                let out = stream.alloc_zeros::<f32>(heads * head_dim).unwrap();
                let acc = stream.alloc_zeros::<f32>(heads * max_splits.max(1) * head_dim).unwrap();
                let stats = stream.alloc_zeros::<f32>(heads * max_splits.max(1) * 2).unwrap();
                let (heads_, kv_heads_, head_dim_) =
                    (heads as i32, kv_heads as i32, head_dim as i32);
                let (page_tokens_, max_splits_) = (page_tokens as i32, max_splits as i32);
                let split = max_splits > 0;
                let kernel = match split {
                    false => entry(format!("paged_attention_{class}")),
                    true => entry(format!("paged_attention_split_{class}")),
                };
                let mut launch = stream.launch_builder(&kernel);
                launch.arg(&qkv).arg(&out).arg(&positions).arg(&token_rows);
                launch.arg(&table_offsets).arg(&tables).arg(&keys).arg(&values);
                launch.arg(&heads_).arg(&kv_heads_).arg(&head_dim_).arg(&page_tokens_);
                launch.arg(&window).arg(&scale);
                if split {
                    launch.arg(&acc).arg(&stats).arg(&max_splits_);
                }
                let blocks = if split { 2 } else { 1 };
                let cfg = LaunchConfig {
                    grid_dim: (1, heads as u32, blocks),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: paged_attention(_split)_d*'s parameters in order (the split one's
                // partials for one token of `heads` heads of `max_splits` splits); the caches
                // hold every page the table names; 4 warps a block.
                unsafe { launch.launch(cfg) }.unwrap();
                if split {
                    let merge = entry(format!("attention_merge_{class}"));
                    let mut launch = stream.launch_builder(&merge);
                    launch.arg(&positions).arg(&out).arg(&heads_).arg(&head_dim_).arg(&window);
                    launch.arg(&acc).arg(&stats).arg(&max_splits_);
                    let cfg = LaunchConfig {
                        grid_dim: (1, heads as u32, 1),
                        block_dim: (32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: attention_merge_d*'s parameters in order, the partials above.
                    unsafe { launch.launch(cfg) }.unwrap();
                }
                stream.clone_dtoh(&out).unwrap()
            };
            let plain = attend(0);
            let splits = if window == 0 { 5 } else { 3 };
            for (max_splits, what) in [(8, "split blocks"), (splits - 1, "taken whole")] {
                let other = attend(max_splits);
                let same = plain.iter().zip(&other).all(|(a, b)| a.to_bits() == b.to_bits());
                report(
                    "split attention kernels",
                    json!({"head_dim": head_dim, "window": window, "splits": splits,
                    "partials_for": max_splits, "bits_of_one_block": same}),
                );
                if !same || plain.iter().any(|x| !x.is_finite()) {
                    failures.push(format!("head_dim {head_dim}, window {window}: {what}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The first tiny variant (Llama, f32), written to and loaded from a folder named for `test`.
fn tiny_llama(test: &str) -> Arc<LlamaWeights> {
    let dir = std::env::temp_dir().join(format!("lockstep-cuda-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tiny::variants()[0].write(&dir);
    let weights = Model::load(&dir).unwrap().weights;
    std::fs::remove_dir_all(&dir).unwrap();
    weights
}

/// Switching `block_weights` on a live executor uploads the weights again, in the other form,
/// and the same request computes the same bits on each upload; the weights take a fifth of the
/// memory in blocks.
#[test]
fn switching_block_weights_on_an_executor_changes_no_bit() {
    if !device_or_skip() {
        return;
    }
    let weights = Arc::new(quantized(&tiny_llama("switch"), |_| TensorType::Q4_1));
    let config = config(2, 7);
    let requests = greedy(&[vec![5, 9, 200, 14, 3, 77, 41, 8, 9], vec![1, 2, 3]], 8);
    let mut executor = cuda(&weights, config.pool, config.running_max, CudaOptions::default());
    let at_load = (run(&mut executor, &config, requests.clone()), executor.weight_bytes());
    let blocks = LaunchOptions { block_weights: true, ..LaunchOptions::default() };
    executor.set_launch_options(blocks).unwrap();
    let in_blocks = (run(&mut executor, &config, requests.clone()), executor.weight_bytes());
    executor.set_launch_options(LaunchOptions::default()).unwrap();
    let again = (run(&mut executor, &config, requests), executor.weight_bytes());
    assert_eq!(at_load, again, "back to f32: the first run's bits and bytes");
    assert_eq!(at_load.0, in_blocks.0, "in blocks: the same bits");
    // Q4_1 is 20 bytes a block of 32 against 128 in f32; the norms stay f32.
    assert!(in_blocks.1 * 5 < at_load.1, "{} bytes in blocks, {} at load", in_blocks.1, at_load.1);
}

/// NVRTC's output kept in a kernel cache: the first executor compiles every module and keeps
/// it, the next compiles none, and one whose kept product module was damaged compiles that one
/// again and keeps it anew; all compute the same bits. (With prebuilt kernels, the device kit's,
/// there is no NVRTC to skip.)
#[test]
fn the_kernel_cache_keeps_what_nvrtc_compiled_and_replaces_a_damaged_image() {
    if !device_or_skip() {
        return;
    }
    if std::env::var_os("LOCKSTEP_CUDA_KERNELS_DIR").is_some() {
        eprintln!("skipped: prebuilt kernels, nothing compiled to keep");
        return;
    }
    let dir = std::env::temp_dir().join(format!("lockstep-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options =
        CudaOptions { kernel_cache: Some(KernelCache::at(&dir)), ..CudaOptions::default() };
    let weights = tiny_llama("kernel-cache");
    let config = config(2, 7);
    let requests = greedy(&[vec![5, 9, 200, 14, 3], vec![1, 2, 3]], 6);
    let modules = kernels::ALL.len();
    let origins = |executor: &CudaExecutor| {
        let o = executor.kernel_origins();
        (o.compiled, o.cached, o.cache_notes.clone())
    };

    let mut first = cuda(&weights, config.pool, 2, options.clone());
    assert_eq!(origins(&first), (modules, 0, vec![]));
    let expected = run(&mut first, &config, requests.clone());
    drop(first);
    let mut kept: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().path()).collect();
    kept.sort();
    assert_eq!(kept.len(), modules, "one image a module, nothing else: {kept:?}");

    let mut second = cuda(&weights, config.pool, 2, options.clone());
    assert_eq!(origins(&second), (0, modules, vec![]));
    assert_eq!(run(&mut second, &config, requests.clone()), expected);
    drop(second);

    let products = kept
        .iter()
        .find(|path| path.file_name().unwrap().to_str().unwrap().starts_with("matmul."))
        .unwrap();
    std::fs::write(products, b"not an image").unwrap();
    let mut third = cuda(&weights, config.pool, 2, options);
    let (compiled, cached, notes) = origins(&third);
    assert_eq!((compiled, cached), (1, modules - 1));
    assert!(
        notes.len() == 1 && notes[0].starts_with("compiled again: loading matmul.cu"),
        "{notes:?}"
    );
    assert_ne!(std::fs::read(products).unwrap(), b"not an image", "kept anew");
    assert_eq!(run(&mut third, &config, requests), expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Set in the child process `a_quantized_model_past_device_memory_names_block_weights` starts,
/// where the emulator's device memory is cut down.
const SMALL_DEVICE_CHILD: &str = "LOCKSTEP_CUDA_SMALL_DEVICE_CHILD";

/// A Q4_1 model whose weights as f32 are past device memory fails to load with an error that
/// says so and names block weights; in its blocks the same model loads and runs. On the
/// emulator only, whose memory a process sets (`LOCKSTEP_CUDA_EMU_MEMORY`): 4 MiB here, against
/// about 9.4 MB as f32 (an 8.4 MB embedding) and 2 MB in blocks.
#[test]
fn a_quantized_model_past_device_memory_names_block_weights() {
    if !device_or_skip() {
        return;
    }
    if std::env::var_os(SMALL_DEVICE_CHILD).is_none() {
        if !probe::probe_device(0).unwrap().name.contains("emulator") {
            eprintln!("skipped: a device's memory is what it is");
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["a_quantized_model_past_device_memory_names_block_weights", "--exact"])
            .env(SMALL_DEVICE_CHILD, "1")
            .env("LOCKSTEP_CUDA_EMU_MEMORY", (4u64 << 20).to_string())
            .output()
            .unwrap();
        let output =
            String::from_utf8_lossy(&child.stdout) + String::from_utf8_lossy(&child.stderr);
        assert!(child.status.success(), "the child failed: {output}");
        assert!(output.contains("1 passed"), "the child ran no test: {output}");
        return;
    }
    let weights = Arc::new(random_llama(TensorType::Q4_1, small_llama(32_768)));
    // 16 pages of KV: 131 kB.
    let pool = PoolConfig { pages_total: 16, page_tokens: 16, pins_max: 0 };
    let config = SchedConfig { pool, ..config(1, 7) };
    let at_load = CudaOptions { graph_rows_max: 0, ..CudaOptions::default() };
    let err = CudaExecutor::new(weights.clone(), config.pool, 1, at_load.clone()).unwrap_err();
    assert!(
        err.starts_with("CUDA: uploading the embedding")
            && err.contains("OUT_OF_MEMORY")
            && err.contains("`--cuda-launch block-weights` keeps them in their blocks"),
        "{err}"
    );
    let launch = LaunchOptions { block_weights: true, ..LaunchOptions::default() };
    let mut in_blocks = cuda(&weights, config.pool, 1, CudaOptions { launch, ..at_load });
    let runs = run(&mut in_blocks, &config, greedy(&[vec![1, 2, 3]], 4));
    assert_eq!(runs[&RequestId(0)].0.len(), 4);
}

#[test]
fn a_request_alone_equals_itself_in_a_batch_of_32_on_cuda_on_the_default_model() {
    if !device_or_skip() {
        return;
    }
    let Some((_, file)) = common::default_model() else { return };
    let weights = LlamaWeights::from_gguf(&common::parse(&file), &file).unwrap();
    batch_invariant("default model", &Arc::new(weights));
}

#[test]
fn without_a_driver_the_executor_is_a_clean_error() {
    if probe::driver_present() {
        eprintln!("skipped: a CUDA driver is present");
        return;
    }
    let weights = tiny_llama("nodriver");
    let pool = PoolConfig { pages_total: 8, page_tokens: 16, pins_max: 0 };
    let err = CudaExecutor::new(weights, pool, 1, CudaOptions::default()).unwrap_err();
    assert!(err.starts_with("no CUDA driver: libcuda.so.1 not found"), "{err}");
}

/// Llama 3.2 1B's shape: 1.24B parameters, tied embedding.
fn llama_3_2_1b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 128_256,
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        ffn: 8192,
        rms_eps: 1e-5,
        rope_base: 500_000.0,
        rope_style: RopeStyle::Halves,
        rope_freq_factors: None,
        qkv_bias: false,
        sliding_window: None,
        context_length: 4096,
    }
}

/// Llama 3.2 1B's architecture at a few kilobytes a layer, with `vocab` tokens.
fn small_llama(vocab: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size: vocab,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        ..llama_3_2_1b()
    }
}

/// A Llama of `config`'s shape (tied embedding) with random weights of `kind`: `F16`, values
/// `k / 2^15` for integers `|k| <= 1024`, exact in f16, so the executor stores them as f16;
/// `Q4_1`, random nibbles under scales `2^-12` and minimums `-2^-9` (the same range), 5 bits a
/// weight; or `Q4_K`, random nibbles and 6-bit scales and minimums under block scales `2^-15`
/// (weights within about ±0.03), 4.5 bits a weight. The executor stores the quantized ones as f32
/// or in their blocks by `block_weights`.
fn random_llama(kind: TensorType, config: LlamaConfig) -> LlamaWeights {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut matrix = |rows: usize, cols: usize| match kind {
        TensorType::F16 => {
            let data = (0..rows * cols)
                .map(|_| ((next() >> 40) % 2049) as f32 / 32768.0 - 1024.0 / 32768.0)
                .collect();
            Weight::Dense { rows, cols, data }
        }
        TensorType::Q4_1 => {
            let mut bytes = Vec::with_capacity(rows * cols / 32 * 20);
            for _ in 0..rows * cols / 32 {
                bytes.extend(f32_to_f16(1.0 / 4096.0).to_le_bytes());
                bytes.extend(f32_to_f16(-1.0 / 512.0).to_le_bytes());
                bytes.extend(next().to_le_bytes());
                bytes.extend(next().to_le_bytes());
            }
            Weight::new(kind, rows, cols, &bytes)
        }
        TensorType::Q4K => {
            let mut bytes = Vec::with_capacity(rows * cols / 256 * 144);
            for _ in 0..rows * cols / 256 {
                bytes.extend(f32_to_f16(1.0 / 32768.0).to_le_bytes());
                bytes.extend(f32_to_f16(1.0 / 32768.0).to_le_bytes());
                // Any 12 bytes are valid 6-bit scales and minimums, any 128 valid nibbles.
                bytes.extend(&next().to_le_bytes()[..8]);
                bytes.extend(&next().to_le_bytes()[..4]);
                (0..16).for_each(|_| bytes.extend(next().to_le_bytes()));
            }
            Weight::new(kind, rows, cols, &bytes)
        }
        other => unreachable!("{other:?}: not a benchmark weight type"),
    };
    let c = &config;
    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let layers = (0..c.layers)
        .map(|_| Layer {
            attn_norm: vec![1.0; c.hidden],
            q: matrix(q, c.hidden),
            k: matrix(kv, c.hidden),
            v: matrix(kv, c.hidden),
            qkv_bias: None,
            o: matrix(c.hidden, q),
            ffn_norm: vec![1.0; c.hidden],
            gate: matrix(c.ffn, c.hidden),
            up: matrix(c.ffn, c.hidden),
            down: matrix(c.hidden, c.ffn),
        })
        .collect();
    let embed = matrix(c.vocab_size, c.hidden);
    LlamaWeights { embed, layers, output_norm: vec![1.0; c.hidden], output: None, config }
}

/// The benchmark's prompt and decode lengths.
const BENCH_PROMPT: u32 = 32;
const BENCH_DECODE: u32 = 48;
/// Decode tokens a request of the harness's own test makes: three timed steps after the two
/// warm-up ones, enough to run every part of the harness (on the emulator the test took 44 s
/// at 48, 28 at 6).
const HARNESS_DECODE: u32 = 6;
/// The long-context case's prompt: where a multi-turn agent's decode steps spend their time, and
/// where split attention (8 splits of 512 positions a head) is meant to pay.
const BENCH_LONG_PROMPT: u32 = 4096;

/// The benchmark's scheduler at `batch` requests of `prompt` tokens: all prompts in one step,
/// then full decode steps of `batch` rows, each a captured graph.
fn bench_config(batch: u32, prompt: u32) -> SchedConfig {
    let pages_a_row = (prompt + BENCH_DECODE + 8).div_ceil(16);
    SchedConfig {
        pool: PoolConfig { pages_total: pages_a_row * batch + 64, page_tokens: 16, pins_max: 0 },
        running_max: batch,
        waiting_max: batch,
        step_tokens_max: 8192,
        prefill_chunk_tokens_max: 8192,
        scored_tokens_max: 8192,
        request_tokens_max: prompt + BENCH_DECODE + 8,
        capture_sizes: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
        ..config(batch, 8192)
    }
}

/// The comparison harness, checked anywhere on the CPU against itself at another thread count:
/// every step compared, no gap, and a planted change of one logit caught.
#[test]
fn the_comparison_harness_holds_the_cpu_to_itself() {
    let weights = tiny_llama("harness");
    let config = config(1, 7);
    let requests: Vec<_> = [vec![5u32, 9, 200, 14, 3, 77, 41, 8, 9], vec![1, 2, 3]]
        .into_iter()
        .enumerate()
        .map(|(i, p)| (request(i as u64, p, 10), Sampling::GREEDY))
        .collect();
    let mut one = CpuExecutor::with_threads(weights.clone(), config.pool, 1, 1);
    let mut three = CpuExecutor::with_threads(weights, config.pool, 1, 3);
    let a = run(&mut one, &config, requests.clone());
    let mut b = run(&mut three, &config, requests);
    for (id, run) in &a {
        assert_eq!((run.0.len(), run.1.len()), (10, 10));
        let c = compare(run, &b[id], 0.0);
        assert_eq!((c.widest, c.steps, c.failure), (0.0, 10, None));
    }
    let planted = b.get_mut(&RequestId(0)).unwrap();
    planted.1[4][7] += 0.01;
    let c = compare(&a[&RequestId(0)], planted, 1e-3);
    let failure = c.failure.expect("a logit moved by 0.01 fails a tolerance of 0.001");
    assert!(failure.starts_with("step 4 token 7"), "{failure}");
    assert_eq!((c.steps, c.first_step), (4, 0.0));
    planted.1[4][7] = f32::NAN;
    assert!(compare(&a[&RequestId(0)], planted, 1e-3).failure.is_some(), "NaN never passes");
}

/// A prompt's tokens scored in one request (`SamplingSpec::prompt_logprobs`, chunks of 7) against
/// the log-probabilities of the logits a request of the prompt up to each token samples from:
/// the same logits, so the same bits. Returns the scores.
fn scores_equal_each_prefix_s(backend: &mut dyn Backend, prompt: &[u32]) -> Vec<TokenLogprobs> {
    const TOP: u8 = 3;
    let config = config(1, 7);
    let mut sched = Scheduler::new(config.clone()).unwrap();
    let scored = request(0, prompt.to_vec(), 2);
    backend
        .start(scored.id, SamplingSpec::for_prompt(Sampling::GREEDY, prompt).scoring(prompt, TOP));
    sched.submit_scoring(scored, Time::ZERO).unwrap();
    let mut scores = Vec::new();
    while let Some(plan) = sched.plan_step(Time::ZERO) {
        let (outputs, _) = backend.step(&plan);
        for p in &outputs.prompt_logprobs {
            assert_eq!(p.from as usize, scores.len() + 1, "scored in order, each once");
            scores.extend(p.logprobs.iter().cloned());
        }
        sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        while sched.poll_event().is_some() {}
    }
    backend.end(RequestId(0));
    assert_eq!(scores.len(), prompt.len() - 1, "every token but the first scored");
    let prefixes = (1..prompt.len()).map(|k| prompt[..k].to_vec()).collect::<Vec<_>>();
    let runs = run(backend, &config, greedy(&prefixes, 1));
    for (k, score) in (1..).zip(&scores) {
        let logits = &runs[&RequestId(k as u64 - 1)].1[0];
        assert_eq!(*score, logprobs(logits, prompt[k], TOP), "prompt token {k}");
    }
    scores
}

/// The CPU backend scores a prompt's tokens with the logits each prefix samples from, bit for
/// bit, whatever chunk a position falls in.
#[test]
fn prompt_scores_are_the_logits_of_each_prefix_on_the_cpu() {
    let weights = tiny_llama("scores");
    let config = config(1, 7);
    let mut cpu = CpuExecutor::new(weights, config.pool, config.running_max);
    let prompt = [5u32, 9, 200, 14, 3, 77, 41, 8, 9, 120, 33, 64, 2, 250, 17, 90, 4];
    let scores = scores_equal_each_prefix_s(&mut cpu, &prompt);
    assert!(scores.iter().all(|s| s.logprob <= 0.0 && s.top.len() == 3), "{scores:?}");
}

/// CUDA scores a prompt's tokens with the logits each of its prefixes samples from, bit for bit,
/// and within the tiny models' tolerance of the CPU's scores.
#[test]
fn prompt_scores_on_cuda_are_its_logits_of_each_prefix_and_near_the_cpu_s() {
    if !device_or_skip() {
        return;
    }
    let weights = tiny_llama("cuda-scores");
    let config = config(1, 7);
    let prompt = [5u32, 9, 200, 14, 3, 77, 41, 8, 9, 120, 33, 64, 2, 250, 17, 90, 4];
    let mut cpu = CpuExecutor::new(weights.clone(), config.pool, config.running_max);
    let on_cpu = scores_equal_each_prefix_s(&mut cpu, &prompt);
    let mut executor = cuda(&weights, config.pool, config.running_max, CudaOptions::default());
    let on_cuda = scores_equal_each_prefix_s(&mut executor, &prompt);
    let widest = on_cpu
        .iter()
        .zip(&on_cuda)
        .map(|(a, b)| (a.logprob - b.logprob).abs())
        .fold(0f32, f32::max);
    report("prompt scores vs CPU", json!({"widest_logprob_gap": widest}));
    assert!(widest <= 2.0 * TINY_TOLERANCE, "CUDA's scores are {widest} from the CPU's");
}

/// What the device run relies on, checked anywhere: the harness's schedules are valid, and the
/// benchmark's reach full decode steps in a graph bucket (driven by the provenance model).
#[test]
fn the_schedules_the_device_checks_use_are_valid() {
    for (running, chunk) in [(1, 7), (32, 2)] {
        Scheduler::new(config(running, chunk)).unwrap();
    }
    for (batch, prompt) in
        [(1u32, BENCH_PROMPT), (32, BENCH_PROMPT), (256, BENCH_PROMPT), (1, BENCH_LONG_PROMPT)]
    {
        let config = bench_config(batch, prompt);
        let mut sched = Scheduler::new(config.clone()).unwrap();
        let mut model = ProvenanceModel::new(config.pool, batch, 128_000);
        for id in 0..u64::from(batch) {
            model.start_request(RequestId(id), SamplingSpec::GREEDY);
            let prompt = (0..prompt).map(|i| i + 1).collect();
            sched.submit(request(id, prompt, BENCH_DECODE), Time::ZERO).unwrap();
        }
        let mut full_graph_steps = 0;
        while let Some(plan) = sched.plan_step(Time::ZERO) {
            let full = plan.rows.len() == batch as usize;
            if full && plan.rows.iter().all(|r| r.positions.len() == 1) {
                assert_eq!(plan.bucket, Bucket::Graph { padded_rows: batch });
                full_graph_steps += 1;
            }
            let outputs = model.execute(&plan).unwrap();
            sched.apply_outputs(&outputs, Time::ZERO).unwrap();
            while sched.poll_event().is_some() {}
        }
        assert_eq!(full_graph_steps, BENCH_DECODE - 1, "batch {batch}");
    }
}

#[test]
#[ignore = "a benchmark: ci/device-check.sh runs it on the device"]
fn decode_throughput_against_the_hbm_roofline() {
    if !device_or_skip() {
        return;
    }
    // `LOCKSTEP_BENCH_BATCHES=1` (a comma-separated list): fewer sizes, for a profiler's run;
    // `LOCKSTEP_BENCH_WEIGHTS=q4_1`: one of the two models (f16, q4_1), or `q4_k`, a third.
    let batches: Vec<u32> = match std::env::var("LOCKSTEP_BENCH_BATCHES") {
        Ok(list) => list.split(',').map(|b| b.trim().parse().unwrap()).collect(),
        Err(_) => vec![1, 32, 256],
    };
    let models = std::env::var("LOCKSTEP_BENCH_WEIGHTS").unwrap_or_else(|_| "f16,q4_1".into());
    for model in models.split(',').map(str::trim) {
        let (kind, alternative) = bench_model(model);
        let weights = Arc::new(random_llama(kind, llama_3_2_1b()));
        for &batch in &batches {
            decode_throughput(&weights, model, batch, BENCH_PROMPT, BENCH_DECODE, alternative);
        }
        // Batch 1 at a long context: plain, split attention, every option.
        if model == "f16" && std::env::var_os("LOCKSTEP_BENCH_BATCHES").is_none() {
            let split = LaunchOptions { split_attention: true, ..LaunchOptions::default() };
            decode_throughput(&weights, model, 1, BENCH_LONG_PROMPT, BENCH_DECODE, split);
        }
    }
}

/// A benchmark model's weight type (`f16`, `q4_1` or `q4_k`), and the launch options its second
/// run takes: for f16 programmatic dependent launches against plain ones, for the quantized ones
/// their blocks against f32 dequantized at load.
fn bench_model(name: &str) -> (TensorType, LaunchOptions) {
    match name {
        "f16" => {
            (TensorType::F16, LaunchOptions { dependent_launches: true, ..Default::default() })
        }
        "q4_1" => (TensorType::Q4_1, LaunchOptions { block_weights: true, ..Default::default() }),
        "q4_k" => (TensorType::Q4K, LaunchOptions { block_weights: true, ..Default::default() }),
        other => panic!("LOCKSTEP_BENCH_WEIGHTS: {other:?} is not f16, q4_1 or q4_k"),
    }
}

/// The benchmark's harness on small models (the emulator stands in for a device in CI): the Q4_1
/// and Q4_K models, whose variants upload the weights again, with their timed steps and graph
/// replays, so that a device run's minutes go to measuring.
#[test]
fn the_throughput_benchmark_runs_on_a_small_model() {
    if !device_or_skip() {
        return;
    }
    let (kind, alternative) = bench_model("q4_1");
    let small = Arc::new(random_llama(kind, small_llama(512)));
    decode_throughput(&small, "q4_1", 2, BENCH_PROMPT, HARNESS_DECODE, alternative);
    // The long-context case's harness at a context of two splits.
    let split = LaunchOptions { split_attention: true, ..LaunchOptions::default() };
    decode_throughput(&small, "q4_1", 1, 600, HARNESS_DECODE, split);
    // K-quant rows are whole blocks of 256.
    let shape = LlamaConfig { hidden: 256, head_dim: 64, ffn: 512, ..small_llama(512) };
    let (kind, alternative) = bench_model("q4_k");
    let weights = Arc::new(random_llama(kind, shape));
    decode_throughput(&weights, "q4_k", 2, BENCH_PROMPT, HARNESS_DECODE, alternative);
}

/// Decode tokens/s of `weights` at `batch` rows of `prompt_len`-token prompts, each decoding
/// `decode_steps` tokens (at most `BENCH_DECODE`), plain, with `alternative`, and with every
/// option, side by side on one executor.
fn decode_throughput(
    weights: &Arc<LlamaWeights>,
    model: &str,
    batch: u32,
    prompt_len: u32,
    decode_steps: u32,
    alternative: LaunchOptions,
) {
    let c = weights.config.clone();
    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let params = c.vocab_size * c.hidden + c.layers * c.hidden * (2 * q + 2 * kv + 3 * c.ffn);
    let kv_bytes_per_position = c.layers * 2 * c.kv_heads * c.head_dim * 2;
    assert!(decode_steps <= BENCH_DECODE, "the benchmark's pool has room for {BENCH_DECODE}");
    let config = bench_config(batch, prompt_len);
    let options = CudaOptions { graph_rows_max: 256, ..CudaOptions::default() };
    // One executor a size, its launch options switched between runs (every option adds the
    // folded norms and RoPE at batch 1, the wide products at 32 and 256, the blocks on a
    // quantized model, which uploads the weights again).
    let mut executor = cuda(weights, config.pool, batch, options);
    // The device's own peak (an H100's 3.35 TB/s, an H200's 4.8); none on the emulator, whose
    // fractions would mean nothing anyway.
    let memory_bytes_per_s = executor.device().memory_bytes_per_s.map(|b| b as f64);
    let variants = [LaunchOptions::default(), alternative, LaunchOptions::ALL];
    for (run, launch) in variants.into_iter().enumerate() {
        executor.set_launch_options(launch).unwrap();
        let weight_bytes = executor.weight_bytes();
        let (replayed, eager) = (executor.steps_replayed, executor.steps_eager);
        let mut sched = Scheduler::new(config.clone()).unwrap();
        let ids: Vec<u64> = (0..u64::from(batch)).map(|i| run as u64 * 100_000 + i).collect();
        for &id in &ids {
            let prompt =
                (0..prompt_len).map(|i| (id as u32 * 977 + i * 31) % c.vocab_size as u32).collect();
            executor.start_request(RequestId(id), SamplingSpec::GREEDY);
            sched.submit(request(id, prompt, decode_steps), Time::ZERO).unwrap();
        }
        let (mut decode_time, mut decode_tokens, mut roofline_bytes, mut decode_only_steps) =
            (Duration::ZERO, 0u64, 0f64, 0u32);
        while let Some(plan) = sched.plan_step(Time::ZERO) {
            let decode_only = plan.rows.iter().all(|r| r.positions.len() == 1);
            #[allow(clippy::disallowed_methods)] // A benchmark's timer.
            let start = Instant::now();
            let outputs = executor.execute(&plan).unwrap();
            let took = start.elapsed();
            // Full decode steps after two warm-up ones (the first captures the graph).
            if decode_only && plan.rows.len() == batch as usize {
                decode_only_steps += 1;
                if decode_only_steps > 2 {
                    decode_time += took;
                    decode_tokens += plan.rows.len() as u64;
                    let kv: usize = plan
                        .rows
                        .iter()
                        .map(|r| r.positions.end as usize * kv_bytes_per_position)
                        .sum();
                    roofline_bytes += (weight_bytes + kv) as f64;
                }
            }
            sched.apply_outputs(&outputs, Time::ZERO).unwrap();
            while sched.poll_event().is_some() {}
        }
        for &id in &ids {
            executor.end_request(RequestId(id));
        }
        assert!(decode_only_steps > 2, "{model}, batch {batch}: no full decode step was timed");
        assert!(executor.steps_replayed > replayed, "{model}, batch {batch}: no graph replay");
        let seconds = decode_time.as_secs_f64();
        report(
            "decode throughput",
            json!({"weights": model, "batch": batch, "prompt_tokens": prompt_len,
            "dependent_launches": launch.dependent_launches,
            "fold_norms": launch.fold_norms, "wide_products": launch.wide_products,
            "fold_rope": launch.fold_rope, "block_weights": launch.block_weights,
            "split_attention": launch.split_attention,
            "params": params, "weight_bytes": weight_bytes,
            "decode_steps_timed": decode_only_steps.saturating_sub(2),
            "tokens_per_s": decode_tokens as f64 / seconds,
            "step_ms": 1e3 * seconds / f64::from(decode_only_steps.saturating_sub(2).max(1)),
            "memory_bytes_per_s": memory_bytes_per_s,
            "roofline_fraction": memory_bytes_per_s.map(|peak| roofline_bytes / peak / seconds),
            "graph_replays": executor.steps_replayed - replayed,
            "eager_steps": executor.steps_eager - eager}),
        );
    }
}
