//! The CPU backend against llama.cpp, a reference we did not write (goldens from
//! `gpu/tests/goldens/make_llamacpp_goldens.py`, committed): on five prompts of the default
//! model, the same tokens from our tokenizer, the same top token at the first step, every one of
//! llama.cpp's top-5 logits within `LOGIT_TOLERANCE` of ours, and the same first 8 greedy tokens
//! on at least 4 of 5 prompts.
//!
//! Not yet held: the same top-5 *set*. Three of five prompts swap the fifth token with a
//! near-tie (within 0.1 to 0.3 logits). lockstep follows llama.cpp's arithmetic closely (8-bit
//! activations into Q4_1 and Q8_0 blocks, a half-precision KV cache, iterative rotary angles), yet
//! its top logits still come out about 1% larger; finding why is the next step, with llama.cpp's
//! intermediate activations compared layer by layer.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use lockstep_gpu::llama::{LlamaWeights, Sequence};
use lockstep_gpu::sampling::argmax;
use lockstep_gpu::tokenizer::Tokenizer;
use serde_json::Value;

/// The largest gap measured between lockstep's and llama.cpp's first-step top-5 logits is 0.43
/// (printed by the test); logits here run from 13 to 31, so this is under 3%. The bound leaves a
/// little room over the measurement, no more: a real divergence moves logits by whole units.
const LOGIT_TOLERANCE: f32 = 0.5;
const GREEDY_HELD: usize = 8;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn lockstep_agrees_with_llama_cpp_on_the_default_model() {
    let Some((_, file)) = common::default_model() else { return };
    let goldens: Value = serde_json::from_str(include_str!("goldens/llamacpp.json")).unwrap();
    let gguf = common::parse(&file);
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    let weights = LlamaWeights::from_gguf(&gguf, &file).unwrap();
    let mut greedy_agreements = 0;
    let mut widest_gap = 0f32;
    for prompt in goldens["prompts"].as_array().unwrap() {
        let name = prompt["text"].as_str().unwrap();
        let tokens = ids(&prompt["tokens"]);
        assert_eq!(
            tokenizer.encode(prompt["rendered"].as_str().unwrap()).unwrap(),
            tokens,
            "{name:?}: tokens differ from llama.cpp's"
        );
        let mut sequence = Sequence::new(&weights.config);
        let mut logits = Vec::new();
        for &t in &tokens {
            logits = sequence.forward(&weights, t);
        }
        let mut ours: Vec<u32> = (0..logits.len() as u32).collect();
        ours.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let theirs: Vec<(u32, f32)> = prompt["top5"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
            .collect();
        let mut our_set = ours[..5].to_vec();
        let mut their_set: Vec<u32> = theirs.iter().map(|(i, _)| *i).collect();
        our_set.sort_unstable();
        their_set.sort_unstable();
        assert_eq!(ours[0], theirs[0].0, "{name:?}: the top token differs");
        if our_set != their_set {
            eprintln!("{name:?}: top-5 sets differ: ours {our_set:?}, llama.cpp's {their_set:?}");
        }
        for &(id, their_logit) in &theirs {
            let gap = (logits[id as usize] - their_logit).abs();
            widest_gap = widest_gap.max(gap);
            assert!(
                gap <= LOGIT_TOLERANCE,
                "{name:?}: token {id} logit {} vs llama.cpp {their_logit}",
                logits[id as usize]
            );
        }
        let expected = ids(&prompt["greedy"]);
        let mut next = argmax(&logits);
        let mut greedy = Vec::new();
        for _ in 0..GREEDY_HELD {
            greedy.push(next);
            next = argmax(&sequence.forward(&weights, next));
        }
        if greedy == expected[..GREEDY_HELD] {
            greedy_agreements += 1;
        } else {
            eprintln!(
                "{name:?}: greedy {greedy:?} parts from llama.cpp's {:?}",
                &expected[..GREEDY_HELD]
            );
        }
    }
    eprintln!("widest top-5 logit gap to llama.cpp: {widest_gap}");
    assert!(
        greedy_agreements >= 4,
        "only {greedy_agreements} of 5 prompts agree on the first {GREEDY_HELD} greedy tokens"
    );
}
