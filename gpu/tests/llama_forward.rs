//! The single-sequence Llama forward pass on the bundled default model (CI requires it; see
//! ci/fetch-default-model.sh). Until the tokenizer lands, prompts are spelled in vocabulary
//! entries; the llama.cpp comparison follows with the goldens.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use lockstep_gpu::gguf::MetadataValue;
use lockstep_gpu::llama::{LlamaWeights, Sequence};
use lockstep_gpu::sampling::argmax;

struct Model {
    weights: LlamaWeights,
    vocab: Vec<String>,
}

fn model() -> Option<Model> {
    let (_, file) = common::default_model()?;
    let gguf = common::parse(&file);
    let vocab = gguf
        .get("tokenizer.ggml.tokens")
        .and_then(MetadataValue::as_array)
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    Some(Model { weights: LlamaWeights::from_gguf(&gguf, &file).unwrap(), vocab })
}

impl Model {
    fn ids(&self, pieces: &[&str]) -> Vec<u32> {
        pieces.iter().map(|p| self.vocab.iter().position(|t| t == p).unwrap() as u32).collect()
    }

    fn logits_after(&self, prompt: &[u32]) -> (Sequence, Vec<f32>) {
        let mut seq = Sequence::new(&self.weights.config);
        let mut logits = Vec::new();
        for &t in prompt {
            logits = seq.forward(&self.weights, t);
        }
        (seq, logits)
    }
}

#[test]
fn the_default_model_knows_the_capital_of_france_and_repeats_itself_exactly() {
    let Some(model) = model() else { return };
    let prompt = model.ids(&["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]);
    let (mut seq, logits) = model.logits_after(&prompt);
    assert_eq!(logits.len(), 49152);
    assert!(logits.iter().all(|l| l.is_finite()));
    assert_eq!(model.vocab[argmax(&logits) as usize], "ĠParis");
    // Same inputs, same outputs, bit for bit.
    let (_, again) = model.logits_after(&prompt);
    assert_eq!(logits, again);
    // A few greedy steps stay finite and deterministic.
    let mut next = argmax(&logits);
    for _ in 0..4 {
        let l = seq.forward(&model.weights, next);
        next = argmax(&l);
    }
    assert_eq!(seq.len(), prompt.len() + 4);
}

/// A GGUF whose metadata disagrees with its tensors, or that ends early, is refused with the
/// file, and the tensor where one is to blame, named.
#[test]
fn a_gguf_that_disagrees_with_itself_is_refused_by_name() {
    let Some((_, file)) = common::default_model() else { return };
    let dir = std::env::temp_dir().join(format!("lockstep-bad-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // llama.feed_forward_length is a u32 (type code 4) after its key: 1536 becomes 1024.
    let key = b"llama.feed_forward_length";
    let at = file.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(file[at..at + 8], [4, 0, 0, 0, 0, 6, 0, 0], "type u32, value 1536");
    let mut patched = file.clone();
    patched[at + 4..at + 8].copy_from_slice(&1024u32.to_le_bytes());
    let path = dir.join("ffn.gguf");
    std::fs::write(&path, &patched).unwrap();
    let err = LlamaWeights::load_gguf(&path).unwrap_err().to_string();
    assert!(err.contains("ffn.gguf") && err.contains("blk.0.ffn_gate.weight"), "{err}");

    let path = dir.join("short.gguf");
    std::fs::write(&path, &file[..file.len() / 3]).unwrap();
    let err = LlamaWeights::load_gguf(&path).unwrap_err().to_string();
    assert!(err.contains("short.gguf"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
