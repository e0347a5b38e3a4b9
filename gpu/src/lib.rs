//! Model execution for lockstep (DESIGN.md section 5).
//!
//! This crate will hold what turns a scheduler step plan into tokens on real hardware: weight
//! loading (GGUF and Hugging Face safetensors), the tokenizer and chat templates, a
//! batch-invariant CPU backend over paged KV, and a CUDA backend behind the `cuda` feature.
//! It implements `lockstep_core`'s executor contract and depends on nothing above it.
//!
//! Nothing lives here yet: issue 4 brings it.
