//! Model execution for lockstep (DESIGN.md section 5).
//!
//! This crate turns a scheduler step plan into tokens on real hardware: weight loading (GGUF and
//! Hugging Face safetensors), the tokenizer and chat templates, a batch-invariant CPU backend over
//! paged KV, and a CUDA backend behind the `cuda` feature. It implements `lockstep_core`'s
//! executor contract and depends on nothing above it.
//!
//! Here: GGUF and Hugging Face loading (`model::Model`), the tokenizer and chat templates,
//! sampling, the CPU backend, and the CUDA backend (`cuda`, feature `cuda`; checked on a GPU by
//! ci/device-check.sh).

pub mod chat;
mod compiled_grammars;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod default_model;
pub mod gguf;
pub mod grammar;
pub mod launch_options;
pub mod llama;
pub mod model;
pub mod sampling;
pub mod tokenizer;
