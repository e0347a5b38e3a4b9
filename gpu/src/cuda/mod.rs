//! The CUDA backend (feature `cuda`, DESIGN.md section 5): the Llama family on one NVIDIA GPU,
//! through cudarc's driver bindings, kernels of our own compiled at run time by NVRTC for the
//! device's architecture, and paged KV in device memory. It runs the same `StepPlan`s as the CPU
//! backend and samples through the same `Sampler`.
//!
//! - `probe`: whether libcuda, a device and NVRTC are there, before anything calls the driver
//!   (cudarc panics when a library is missing); errors name what is missing.
//! - `kernels` and `kernels/*.cu`: the CUDA C, batch-invariant by construction.
//! - `nvrtc`: compiling them for an architecture, warnings refused; `kernel_cache`: what it
//!   compiled, kept on disk so a restart does not compile again.
//! - `layout`: a step plan as the flat arrays the kernels read, the KV cache's byte layout, and
//!   which captured graph a step replays. Pure host code, tested without a device.
//! - `weights`: the model's tensors in device memory.
//! - `launch` and `kernel_call`: a forward pass as a sequence of kernel launches, each through
//!   `cuLaunchKernelEx` so that it may be a programmatic dependent launch.
//! - `executor`: `CudaExecutor`, the `Executor` over all of the above.

pub mod executor;
pub mod kernel_cache;
mod kernel_call;
pub mod kernels;
mod launch;
pub mod layout;
pub mod nvrtc;
pub mod probe;
pub mod weights;
