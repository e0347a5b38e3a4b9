//! The CUDA C sources of the backend's kernels (`kernels/*.cu`), compiled at run time by NVRTC
//! for the device's architecture (`nvrtc`). Each source is one idea and one module; every module
//! is `prelude.cu` (half-precision conversions by PTX instruction, warp reductions) followed by
//! its source, so no source includes a header and any NVRTC from 12.8 on compiles them alone.
//!
//! Choices that hold across the kernels:
//! - Batch invariance by construction: each output's reduction order depends on that row's data
//!   and position only (one warp per weight row and a fixed lane split in `matmul.cu`; 32-position
//!   tiles from the row's own window in `paged_attention.cu`; fixed trees in `rms_norm.cu` and
//!   `argmax.cu`). No product goes through cuBLAS or cuBLASLt: they choose an algorithm (and
//!   split-K) by the shape, so a request's bits would change with how many rows share its step;
//!   cublasLt's heuristics cannot be pinned to one algorithm for every M either. Our product is
//!   slower than cuBLAS on large prefills, and that is the price of the differential check.
//! - Activations and the residual stream are f32; weights stay in their upload type (f32, f16,
//!   bf16, or GGUF's blocks, see `weights`); the KV cache is f16, as the CPU backend's is.
//! - The residual adds are fused into the output and down products (`accumulate`), SwiGLU into
//!   the gate and up product, and Q, K and V are one product (the weights stacked at upload):
//!   at one token a step is bound by reading the weights and by the launches around them, so
//!   fewer, larger launches are the decode step's speed.
//! - Programmatic dependent launch (prelude.cu's `allow_next_kernel`, `wait_for_inputs`): every
//!   kernel lets the next one start at once and reads no activation before its wait, so that a
//!   launch with `LaunchOptions::dependent_launches` overlaps the one before; launched plainly the
//!   two are no-ops.
//! - A norm folded into the product after it (`matmul.cu`, `LaunchOptions::fold_norms`) walks
//!   `rms_norm.cu`'s reduction tree exactly, so folding changes no bit and may be chosen by the
//!   step's size. RoPE and the KV write folded into attention on steps of one token a row
//!   (`paged_attention.cu`'s `_rope` entry points, `LaunchOptions::fold_rope`) compute through
//!   the same prelude functions as `rope_kv_write.cu`, so the bits are the same there too.
//! - Quantized GGUF types are dequantized at load by the CPU backend's own dequantizer, or, with
//!   `LaunchOptions::block_weights`, kept in their blocks (5 to 10 bits a weight instead of 32:
//!   `Q4_0`, `Q4_1`, `Q5_1` and `Q8_0`, and `Q5_0` as `Q8_0`, with their half-precision
//!   scales; `Q4_K`, `Q5_K` and `Q6_K` with the dequantizer's f32 scales and minimums per 32 or
//!   16 elements) and dequantized in the
//!   products and the embedding (prelude.cu's `q4_0_value` and kin), each value rounded as the
//!   CPU's dequantizer rounds it. Either way the products multiply the same f32 values in the
//!   same order, so the two give the same bits, which the emulator's device test requires.

/// One kernel source: a module of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's name without `.cu`; also the program name NVRTC reports errors under.
    pub name: &'static str,
    pub source: &'static str,
    /// The `extern "C"` entry points it defines.
    pub functions: &'static [&'static str],
}

pub const PRELUDE: &str = include_str!("kernels/prelude.cu");

pub const EMBED: KernelSource = KernelSource {
    name: "embed",
    source: include_str!("kernels/embed.cu"),
    functions: &[
        "embed_f32",
        "embed_f16",
        "embed_bf16",
        "embed_q4_0",
        "embed_q4_1",
        "embed_q8_0",
        "embed_q4_k",
        "embed_q6_k",
        "embed_q5_1",
        "embed_q5_k",
    ],
};
pub const RMS_NORM: KernelSource = KernelSource {
    name: "rms_norm",
    source: include_str!("kernels/rms_norm.cu"),
    functions: &["rms_norm"],
};
pub const MATMUL: KernelSource = KernelSource {
    name: "matmul",
    source: include_str!("kernels/matmul.cu"),
    functions: &[
        "matmul_f32",
        "matmul_f16",
        "matmul_bf16",
        "matmul_q4_0",
        "matmul_q4_1",
        "matmul_q8_0",
        "matmul_q4_k",
        "matmul_q6_k",
        "matmul_q5_1",
        "matmul_q5_k",
        "matmul_swiglu_f32",
        "matmul_swiglu_f16",
        "matmul_swiglu_bf16",
        "matmul_swiglu_q4_0",
        "matmul_swiglu_q4_1",
        "matmul_swiglu_q8_0",
        "matmul_swiglu_q4_k",
        "matmul_swiglu_q6_k",
        "matmul_swiglu_q5_1",
        "matmul_swiglu_q5_k",
        "matmul_wide_f32",
        "matmul_wide_f16",
        "matmul_wide_bf16",
        "matmul_wide_q4_0",
        "matmul_wide_q4_1",
        "matmul_wide_q8_0",
        "matmul_wide_q4_k",
        "matmul_wide_q6_k",
        "matmul_wide_q5_1",
        "matmul_wide_q5_k",
        "matmul_swiglu_wide_f32",
        "matmul_swiglu_wide_f16",
        "matmul_swiglu_wide_bf16",
        "matmul_swiglu_wide_q4_0",
        "matmul_swiglu_wide_q4_1",
        "matmul_swiglu_wide_q8_0",
        "matmul_swiglu_wide_q4_k",
        "matmul_swiglu_wide_q6_k",
        "matmul_swiglu_wide_q5_1",
        "matmul_swiglu_wide_q5_k",
    ],
};
pub const ROPE_KV_WRITE: KernelSource = KernelSource {
    name: "rope_kv_write",
    source: include_str!("kernels/rope_kv_write.cu"),
    functions: &["rope_kv_write"],
};
pub const PAGED_ATTENTION: KernelSource = KernelSource {
    name: "paged_attention",
    source: include_str!("kernels/paged_attention.cu"),
    functions: &[
        "paged_attention_d64",
        "paged_attention_d128",
        "paged_attention_d256",
        "paged_attention_rope_d64",
        "paged_attention_rope_d128",
        "paged_attention_rope_d256",
        "paged_attention_split_d64",
        "paged_attention_split_d128",
        "paged_attention_split_d256",
        "paged_attention_rope_split_d64",
        "paged_attention_rope_split_d128",
        "paged_attention_rope_split_d256",
        "attention_merge_d64",
        "attention_merge_d128",
        "attention_merge_d256",
    ],
};
pub const ARGMAX: KernelSource = KernelSource {
    name: "argmax",
    source: include_str!("kernels/argmax.cu"),
    functions: &["argmax"],
};

/// Every kernel source, each compiled as its own module.
pub const ALL: [KernelSource; 6] =
    [EMBED, RMS_NORM, MATMUL, ROPE_KV_WRITE, PAGED_ATTENTION, ARGMAX];

/// The largest head size `paged_attention.cu` holds (its `HEAD_DIM_MAX`); `rope_kv_write.cu`
/// holds more rotary pairs than that (its `ROPE_PAIRS_MAX`). A model past it is refused at load.
pub const HEAD_DIM_MAX: usize = 256;

/// The positions of one split of a token's attention (`paged_attention.cu`'s
/// `ATTENTION_SPLIT_POSITIONS`): the bits of a long context depend on it, so it is fixed.
pub const ATTENTION_SPLIT_POSITIONS: usize = 512;

impl KernelSource {
    /// The file a cubin of this source for `sm_{sm}` is kept in, compiled ahead of time
    /// (`CudaExecutor::with_prebuilt`; `tests/cuda_nvrtc.rs` writes them).
    pub fn cubin_file(&self, sm: u32) -> String {
        format!("{}.sm_{sm}.cubin", self.name)
    }

    /// What NVRTC compiles: the prelude, then the source.
    pub fn program(&self) -> String {
        format!("{PRELUDE}\n// ---- {}.cu\n{}", self.name, self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_is_defined_in_its_source() {
        for kernel in ALL {
            for function in kernel.functions {
                let definition = format!("__global__ void {function}(");
                assert!(kernel.source.contains(&definition), "{}: {function}", kernel.name);
                assert!(
                    kernel.source.contains(&format!("extern \"C\" {definition}")),
                    "{function} must be extern \"C\" so the driver finds it by name"
                );
            }
        }
    }

    #[test]
    fn the_limits_match_the_sources() {
        assert!(PAGED_ATTENTION.source.contains(&format!("#define HEAD_DIM_MAX {HEAD_DIM_MAX}")));
        assert!(
            PAGED_ATTENTION.source.contains(&format!(
                "#define ATTENTION_SPLIT_POSITIONS {ATTENTION_SPLIT_POSITIONS}"
            ))
        );
        // At least HEAD_DIM_MAX / 2 pairs.
        assert!(ROPE_KV_WRITE.source.contains(&format!("#define ROPE_PAIRS_MAX {HEAD_DIM_MAX}")));
        assert!(
            !PRELUDE.contains("#include") && ALL.iter().all(|k| !k.source.contains("#include"))
        );
    }
}
