//! The Llama family (Llama 2 and 3, SmolLM2, Qwen2, Mistral) on the CPU.
//!
//! So far: the configuration and weights from a GGUF file, and a single-sequence forward pass
//! with a contiguous KV cache, the reference the batched forward over paged KV will be held to.

mod blocks;
mod config;
mod forward;
mod hf_weights;
mod kernels;
mod kquants;
mod matmul;
mod numerics;
mod paged;
mod team;
mod thread_cpu_time;
mod weights;

pub use blocks::BlockRows;
pub use config::{LlamaConfig, RopeStyle};
pub use forward::Sequence;
pub use hf_weights::load_hf_dir;
#[cfg(all(test, feature = "cuda"))]
pub(crate) use kquants::random_kquant_blocks;
pub use kquants::{GroupValues, KBlockRows};
pub use matmul::Weight;
pub use paged::CpuExecutor;
pub use weights::{Layer, LlamaWeights, LoadError};
