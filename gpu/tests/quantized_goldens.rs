//! The CPU backend's quantized products against llama.cpp, a reference we did not write: tiny
//! Llamas our own code generates (`quantized`) compute, one token at a time, the logits llama.cpp
//! computed on the same files at every position (`goldens/llamacpp_*.json`, from
//! `goldens/make_quantized_goldens.py`), and the same greedy tokens after them. One model mixes
//! `Q4_K` and `Q6_K`, one `Q5_K` and `Q6_K`, one the 32-element types; each makes llama.cpp take
//! each of its paths for its types (the fixture's docs list them).

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod quantized;

use lockstep_gpu::gguf::{Gguf, TensorType};
use lockstep_gpu::llama::{LlamaWeights, Sequence, Weight};
use lockstep_gpu::sampling::argmax;
use serde_json::Value;

/// Measured: 0 (bit-identical at every position). Both sides call the C library's `sinf`, `cosf`,
/// `powf` and `expf` (rotary angles, a few remainders), so where that library is glibc, on which
/// the goldens were recorded and CI runs, the bits must match: on this small model a wrong lane
/// order or the other Q4_K path moves logits by only about 1e-6, which no tolerance separates from
/// a C library rounding a last bit differently. Elsewhere, `llamacpp_goldens.rs`'s bound.
const EXACT: bool = cfg!(all(target_os = "linux", target_env = "gnu"));
const LOGIT_TOLERANCE: f32 = 1e-3;

#[test]
fn kquant_products_compute_what_llama_cpp_computes() {
    let goldens: Value =
        serde_json::from_str(include_str!("goldens/llamacpp_kquant.json")).unwrap();
    let file = quantized::bytes();
    let kinds = holds_to_goldens(&file, &goldens);
    assert!(kinds.contains(&TensorType::Q4K) && kinds.contains(&TensorType::Q6K));
}

/// The same for the 32-element block types on the same shape (`quantized::LEGACY`): `Q4_0`
/// (repacked by llama.cpp, and not), `Q5_0`, `Q5_1`, `Q8_0`.
#[test]
fn block_products_compute_what_llama_cpp_computes() {
    let goldens: Value =
        serde_json::from_str(include_str!("goldens/llamacpp_legacy.json")).unwrap();
    let file = quantized::bytes_of(&quantized::LEGACY);
    let kinds = holds_to_goldens(&file, &goldens);
    for kind in [TensorType::Q4_0, TensorType::Q5_0, TensorType::Q5_1, TensorType::Q8_0] {
        assert!(kinds.contains(&kind), "{kind:?}");
    }
}

/// And for `Q5_K` (with `Q6_K`, as a `Q5_K_M` file mixes them).
#[test]
fn q5_k_products_compute_what_llama_cpp_computes() {
    let goldens: Value =
        serde_json::from_str(include_str!("goldens/llamacpp_q5_k_m.json")).unwrap();
    let file = quantized::bytes_of(&quantized::Q5_K_M);
    let kinds = holds_to_goldens(&file, &goldens);
    assert!(kinds.contains(&TensorType::Q5K) && kinds.contains(&TensorType::Q6K));
}

/// `file`'s logits and greedy tokens against llama.cpp's in `goldens`; the types its matrices
/// were kept in (every matrix must stay quantized: the products are what is under test).
fn holds_to_goldens(file: &[u8], goldens: &Value) -> Vec<TensorType> {
    assert_eq!(
        fnv1a64(file),
        goldens["model_fnv1a64"].as_str().unwrap(),
        "the generated model is not the one the goldens were recorded on: regenerate them"
    );
    let gguf = Gguf::parse(file).unwrap();
    let weights = LlamaWeights::from_gguf(&gguf, file).unwrap();
    let kinds: Vec<TensorType> = weights
        .layers
        .iter()
        .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
        .chain([&weights.embed, weights.output()])
        .map(|w| match w {
            Weight::KQuantized(blocks) => blocks.kind(),
            Weight::Quantized(blocks) => blocks.kind(),
            other => panic!("a matrix left its blocks: {} rows", other.rows()),
        })
        .collect();

    let tokens: Vec<u32> = serde_json::from_value(goldens["tokens"].clone()).unwrap();
    let expected: Vec<Vec<f32>> = serde_json::from_value(goldens["logits"].clone()).unwrap();
    let mut sequence = Sequence::new(&weights.config);
    let mut widest = 0f32;
    let mut logits = Vec::new();
    for (position, (&token, theirs)) in tokens.iter().zip(&expected).enumerate() {
        logits = sequence.forward(&weights, token);
        assert_eq!(logits.len(), theirs.len());
        for (id, (&ours, &theirs)) in logits.iter().zip(theirs).enumerate() {
            let gap = (ours - theirs).abs();
            widest = widest.max(gap);
            let held =
                if EXACT { ours.to_bits() == theirs.to_bits() } else { gap <= LOGIT_TOLERANCE };
            assert!(held, "position {position}, token {id}: logit {ours} vs llama.cpp {theirs}");
        }
    }
    let greedy: Vec<u32> = serde_json::from_value(goldens["greedy"].clone()).unwrap();
    let mut ours = Vec::new();
    let mut next = argmax(&logits);
    for _ in 0..greedy.len() {
        ours.push(next);
        next = argmax(&sequence.forward(&weights, next));
    }
    assert_eq!(ours, greedy, "greedy tokens part from llama.cpp's");
    eprintln!("widest logit gap to llama.cpp over {} positions: {widest}", tokens.len());
    kinds
}

/// The file's 64-bit FNV-1a hash in hex, as the goldens' script computes it: a fingerprint of the
/// generated file (no cryptographic hash in the workspace's dependencies, and none is needed).
fn fnv1a64(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}
