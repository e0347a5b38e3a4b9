//! The default model's tokenizer, built from its GGUF metadata (CI requires the model).

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use lockstep_gpu::gguf::MetadataValue;
use lockstep_gpu::tokenizer::Tokenizer;

fn load() -> Option<(Tokenizer, Vec<String>)> {
    let (_, file) = common::default_model()?;
    let gguf = common::parse(&file);
    let vocab = gguf.get("tokenizer.ggml.tokens").and_then(MetadataValue::as_array).unwrap();
    let vocab = vocab.iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    Some((Tokenizer::from_gguf(&gguf).unwrap(), vocab))
}

#[test]
fn words_digits_and_specials() {
    let Some((tok, vocab)) = load() else { return };
    let pieces = |ids: &[u32]| ids.iter().map(|&i| vocab[i as usize].clone()).collect::<Vec<_>>();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos, tok.eos, tok.add_bos), (Some(1), Some(2), false));
    let ids = tok.encode("The capital of France is").unwrap();
    assert_eq!(pieces(&ids), ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]);
    // SmolLM2 splits numbers into single digits.
    assert_eq!(pieces(&tok.encode("in 2024").unwrap()), ["in", "Ġ", "2", "0", "2", "4"]);
    // Control tokens in the text are single tokens.
    let chat = tok.encode("<|im_start|>user\nHi<|im_end|>").unwrap();
    assert_eq!(chat[0], 1);
    assert_eq!(*chat.last().unwrap(), 2);
    for text in ["Hello, world!", "naïve café ☕ — 東京", "  spaces\tand\nnewlines  ", ""] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, true).unwrap(), text, "round trip of {text:?}");
    }
}
