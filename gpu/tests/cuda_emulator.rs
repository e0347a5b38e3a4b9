//! The CUDA emulator (gpu/cuda-emu) against what a device does, through cudarc as the executor
//! calls it: warp shuffles and block barriers give the device's values, a captured graph replays
//! its launches with the arguments they had, and the kernel bugs a device would hang on or
//! compute garbage from (a shuffle with a lane that returned, a warp split between a shuffle and
//! `__syncthreads`, a trap) fail the launch, and the context, as a device's fails.
//!
//! These run only on the emulator (`ci/test.sh` builds it and puts it on LD_LIBRARY_PATH, with
//! `LOCKSTEP_REQUIRE_CUDA_EMULATOR=1` making its absence a failure); elsewhere they skip. The
//! CUDA executor's own checks run on it from `cuda_device.rs`.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]
#![allow(unsafe_code, reason = "kernel launches and the driver's context reset")]

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{self, CUstreamCaptureMode_enum};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::compile_ptx;
use lockstep_gpu::cuda::probe;

/// What the emulator calls its device (gpu/cuda-emu/driver.cpp).
const EMULATOR: &str = "lockstep CUDA emulator (CPU)";

/// A failed launch fails the whole context until it is reset: the tests take turns.
static CONTEXT: Mutex<()> = Mutex::new(());

struct Emulator {
    stream: Arc<CudaStream>,
    _turn: MutexGuard<'static, ()>,
}

/// The emulator's stream, or `None` (the test skips) when the device is not the emulator.
fn emulator() -> Option<Emulator> {
    let turn = CONTEXT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let required = std::env::var("LOCKSTEP_REQUIRE_CUDA_EMULATOR").as_deref() == Ok("1");
    match probe::probe(0) {
        Ok(info) if info.name == EMULATOR => {}
        other => {
            assert!(!required, "LOCKSTEP_REQUIRE_CUDA_EMULATOR=1 but the device is {other:?}");
            eprintln!("skipped: not the CUDA emulator ({other:?})");
            return None;
        }
    }
    let context = CudaContext::new(0).unwrap();
    Some(Emulator { stream: context.default_stream(), _turn: turn })
}

fn function(stream: &Arc<CudaStream>, source: &str, name: &str) -> CudaFunction {
    let module = stream.context().load_module(compile_ptx(source).unwrap()).unwrap();
    module.load_function(name).unwrap()
}

fn config(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Clears the sticky error a failed launch left (the driver's primary-context reset).
fn reset() {
    // SAFETY: device 0 exists (the emulator's); no buffer of the failed test is used after it.
    unsafe { sys::cuDevicePrimaryCtxReset_v2(0) }.result().unwrap();
}

const SHUFFLES: &str = r#"
extern "C" __global__ void shuffles(const float* in, float* sums, float* broadcast,
                                    long long* wide) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    float v = in[t];
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    sums[t] = v;
    broadcast[t] = __shfl_sync(0xffffffffu, in[t], 5);
    wide[t] = __shfl_sync(0xffffffffu, (long long)t << 40, (threadIdx.x + 1) % 32);
}
"#;

#[test]
fn shuffles_exchange_within_each_warp_as_on_a_device() {
    let Some(emu) = emulator() else { return };
    let s = &emu.stream;
    let f = function(s, SHUFFLES, "shuffles");
    let n = 128;
    let input: Vec<f32> = (0..n).map(|i| (i * i % 17) as f32).collect();
    let i = s.clone_htod(&input).unwrap();
    let (mut sums, mut broadcast) =
        (s.alloc_zeros::<f32>(n).unwrap(), s.alloc_zeros::<f32>(n).unwrap());
    let mut wide = s.alloc_zeros::<i64>(n).unwrap();
    let mut launch = s.launch_builder(&f);
    launch.arg(&i).arg(&mut sums).arg(&mut broadcast).arg(&mut wide);
    // SAFETY: the arguments are the kernel's, each buffer `n` long for 2 blocks of 64.
    unsafe { launch.launch(config(2, 64)) }.unwrap();
    let (sums, broadcast, wide) = (
        s.clone_dtoh(&sums).unwrap(),
        s.clone_dtoh(&broadcast).unwrap(),
        s.clone_dtoh(&wide).unwrap(),
    );
    for t in 0..n {
        let warp = t / 32 * 32;
        assert_eq!(sums[t], input[warp..warp + 32].iter().sum::<f32>(), "thread {t}");
        assert_eq!(broadcast[t], input[warp + 5], "thread {t}");
        assert_eq!(wide[t], ((warp + (t + 1) % 32 % 32) as i64) << 40, "thread {t}");
    }
}

const BLOCK_SUM: &str = r#"
extern "C" __global__ void block_sum(const int* in, int* out) {
    __shared__ int partial[256];
    partial[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
    __syncthreads();
    for (int half = 128; half > 0; half >>= 1) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}
"#;

#[test]
fn block_barriers_order_shared_memory_within_each_block() {
    let Some(emu) = emulator() else { return };
    let s = &emu.stream;
    let f = function(s, BLOCK_SUM, "block_sum");
    let input: Vec<i32> = (0..3 * 256).map(|i| i * 7 % 101).collect();
    let i = s.clone_htod(&input).unwrap();
    let mut out = s.alloc_zeros::<i32>(3).unwrap();
    let mut launch = s.launch_builder(&f);
    launch.arg(&i).arg(&mut out);
    // SAFETY: 3 blocks of 256 read 768 inputs and write 3 sums.
    unsafe { launch.launch(config(3, 256)) }.unwrap();
    let expected: Vec<i32> = input.chunks(256).map(|c| c.iter().sum()).collect();
    assert_eq!(s.clone_dtoh(&out).unwrap(), expected);
}

const ADD: &str = r#"
extern "C" __global__ void add(int* x, int amount) { x[threadIdx.x] += amount; }
"#;

#[test]
fn a_graph_replays_its_launches_with_the_arguments_they_were_captured_with() {
    let Some(emu) = emulator() else { return };
    let s = &emu.stream;
    let f = function(s, ADD, "add");
    let context = s.context().clone();
    let stream = context.new_stream().unwrap();
    let mut x = stream.alloc_zeros::<i32>(32).unwrap();
    stream.begin_capture(CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    let mut amount = 5;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut x).arg(&amount);
    // SAFETY: 32 threads add to 32 elements.
    unsafe { launch.launch(config(1, 32)) }.unwrap();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags_enum(0)).unwrap().unwrap();
    amount = 1000;
    assert_eq!(amount, 1000);
    // Captured, not run: nothing added yet.
    assert_eq!(stream.clone_dtoh(&x).unwrap(), vec![0; 32]);
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    assert_eq!(stream.clone_dtoh(&x).unwrap(), vec![15; 32]);
}

/// Launches `name` from `source` on one block of `threads` with one buffer, on a context of its
/// own, expecting the launch to fail and every call after it, until the device is reset.
fn fails(source: &str, name: &str, threads: u32) {
    let stream = CudaContext::new(0).unwrap().default_stream();
    let f = function(&stream, source, name);
    let mut x = stream.alloc_zeros::<i32>(threads as usize).unwrap();
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut x);
    // SAFETY: one buffer of `threads` elements, as every kernel below takes.
    let launched: Result<_, DriverError> = unsafe { launch.launch(config(1, threads)) };
    let error = launched.map(|_| ()).unwrap_err();
    assert_eq!(error.0, sys::CUresult::CUDA_ERROR_LAUNCH_FAILED, "{name}");
    // Sticky: the context fails every call after it, as a device's does (cudarc's context
    // keeps the error too, so the next case takes a context of its own).
    assert!(stream.alloc_zeros::<i32>(1).is_err(), "{name}: the error is not sticky");
    reset();
    CudaContext::new(0).unwrap().default_stream().alloc_zeros::<i32>(1).unwrap();
}

#[test]
fn kernel_bugs_a_device_hangs_or_computes_garbage_on_fail_the_launch() {
    let Some(_emu) = emulator() else { return };
    // A lane returned before its warp's shuffle: the shuffle reads an exited lane.
    fails(
        r#"extern "C" __global__ void early_return(int* x) {
            if (threadIdx.x == 3) return;
            x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
        }"#,
        "early_return",
        32,
    );
    // Half a warp at a shuffle, the other half at __syncthreads: neither can complete.
    fails(
        r#"extern "C" __global__ void split_warp(int* x) {
            if (threadIdx.x < 16) x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
            else __syncthreads();
        }"#,
        "split_warp",
        64,
    );
    fails(
        r#"extern "C" __global__ void traps(int* x) {
            if (threadIdx.x == 7) __trap();
            x[threadIdx.x] = 1;
        }"#,
        "traps",
        32,
    );
    // Those launches left fibers of this thread mid-kernel (the trapped lane, the lanes
    // stranded at a barrier): the next launch here starts them afresh and computes as if none
    // had failed.
    let stream = CudaContext::new(0).unwrap().default_stream();
    let source = r#"extern "C" __global__ void pairs(int* x) {
        x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
    }"#;
    let f = function(&stream, source, "pairs");
    let mut x = stream.alloc_zeros::<i32>(64).unwrap();
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut x);
    // SAFETY: one buffer of 64 elements for one block of 64.
    unsafe { launch.launch(config(1, 64)) }.unwrap();
    let expected: Vec<i32> = (0..64).map(|t| t ^ 1).collect();
    assert_eq!(stream.clone_dtoh(&x).unwrap(), expected);
}

#[test]
fn an_image_not_built_by_the_emulator_is_refused() {
    let Some(emu) = emulator() else { return };
    let image = cudarc::nvrtc::Ptx::from_binary(b"\x7fELF a real cubin\0".to_vec());
    let error = emu.stream.context().load_module(image).unwrap_err();
    assert_eq!(error.0, sys::CUresult::CUDA_ERROR_INVALID_IMAGE);
}

/// Runs `test` of this binary alone in a child process with `child_variable` set, where it is to
/// die of a fault; returns what it printed to stderr.
fn dies_in_a_child(test: &str, child_variable: &str) -> String {
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(child_variable, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&child.stderr).into_owned();
    assert!(!child.status.success(), "the child survived: {stderr}");
    stderr
}

const PAST_THE_END: &str = r#"
extern "C" __global__ void past_the_end(int* x, int n) { x[threadIdx.x] = x[n + threadIdx.x]; }
"#;

/// Set in the child process the fault test starts, where the read past the end runs.
const FAULT_CHILD: &str = "LOCKSTEP_CUDA_EMULATOR_FAULT_CHILD";

#[test]
fn reading_past_the_end_of_a_buffer_faults_naming_the_kernel() {
    let Some(emu) = emulator() else { return };
    if std::env::var_os(FAULT_CHILD).is_some() {
        let s = &emu.stream;
        let f = function(s, PAST_THE_END, "past_the_end");
        // 64 ints: 256 bytes, the allocator's rounding, so element 64 is on the guard page.
        let mut x = s.alloc_zeros::<i32>(64).unwrap();
        let mut launch = s.launch_builder(&f);
        let n = 64i32;
        launch.arg(&mut x).arg(&n);
        // SAFETY: not safe, on purpose: the kernel reads past the end, and the process dies.
        let _ = unsafe { launch.launch(config(1, 32)) };
        eprintln!("the read past the end did not fault");
        std::process::exit(0);
    }
    // The fault kills the process, so it happens in a child: this test, run alone.
    let stderr =
        dies_in_a_child("reading_past_the_end_of_a_buffer_faults_naming_the_kernel", FAULT_CHILD);
    assert!(
        stderr.contains("kernel past_the_end touched") && stderr.contains("past the end"),
        "{stderr}"
    );
}

/// Kernel `write` fills a buffer; `read_early` and `read_after` copy it to another, touching it
/// before or after `wait_for_inputs()` (the prelude's, as the executor's kernels have it).
fn dependent_kernels() -> String {
    format!(
        "{}\n{}",
        lockstep_gpu::cuda::kernels::PRELUDE,
        r#"
extern "C" __global__ void write(int* x) { x[threadIdx.x] = 7 * threadIdx.x; }
extern "C" __global__ void read_after(const int* x, int* y) {
    allow_next_kernel();
    wait_for_inputs();
    y[threadIdx.x] = x[threadIdx.x] + 1;
}
extern "C" __global__ void read_early(const int* x, int* y) {
    allow_next_kernel();
    const int early = x[threadIdx.x];
    wait_for_inputs();
    y[threadIdx.x] = early + 1;
}
"#
    )
}

/// Launches `f` on one block of 32 with `x` and `y` as a programmatic dependent launch of the
/// kernel before it, as the executor's `KernelCall` does.
fn launch_dependent(
    stream: &CudaStream,
    f: &CudaFunction,
    x: u64,
    y: u64,
) -> Result<(), DriverError> {
    let (mut x, mut y) = (x, y);
    let mut parameters = [&mut x as *mut u64 as *mut std::ffi::c_void, &mut y as *mut u64 as _];
    // SAFETY: all-zero is a valid value of this C union; the field set is the attribute's.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream.cu_stream(),
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: `f` takes two pointers to 32 ints each; `parameters` outlives the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            parameters.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Set in the child process the dependent-launch test starts, where the early read runs.
const EARLY_READ_CHILD: &str = "LOCKSTEP_CUDA_EMULATOR_EARLY_READ_CHILD";

#[test]
fn a_dependent_launch_touching_what_a_kernel_wrote_before_its_wait_faults() {
    let Some(emu) = emulator() else { return };
    let stream = emu.stream.context().new_stream().unwrap();
    let source = dependent_kernels();
    let module = stream.context().load_module(compile_ptx(&source).unwrap()).unwrap();
    let write = module.load_function("write").unwrap();
    let mut x = stream.alloc_zeros::<i32>(32).unwrap();
    let y = stream.alloc_zeros::<i32>(32).unwrap();
    let mut launch = stream.launch_builder(&write);
    launch.arg(&mut x);
    // SAFETY: 32 threads write 32 ints.
    unsafe { launch.launch(config(1, 32)) }.unwrap();
    eprintln!("DEBUG x {:?}", stream.clone_dtoh(&x).unwrap());
    let (xp, yp) = (x.device_ptr(&stream).0, y.device_ptr(&stream).0);
    let early = std::env::var_os(EARLY_READ_CHILD).is_some();
    let name = if early { "read_early" } else { "read_after" };
    launch_dependent(&stream, &module.load_function(name).unwrap(), xp, yp).unwrap();
    if early {
        eprintln!("the early read did not fault");
        std::process::exit(0);
    }
    let expected: Vec<i32> = (0..32).map(|i| 7 * i + 1).collect();
    assert_eq!(stream.clone_dtoh(&y).unwrap(), expected);
    // Reading before the wait kills the process, so it happens in a child: this test, alone.
    drop(emu);
    let stderr = dies_in_a_child(
        "a_dependent_launch_touching_what_a_kernel_wrote_before_its_wait_faults",
        EARLY_READ_CHILD,
    );
    assert!(
        stderr.contains("kernel read_early touched") && stderr.contains("before wait_for_inputs()"),
        "{stderr}"
    );
}

const RACY: &str = r#"
extern "C" __global__ void racy(int* out) {
    __shared__ int s;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) s = blockIdx.x;
    // No __syncthreads(): warp 1 may read `s` before warp 0 wrote it, as on a device.
    if (warp == 1 && lane == 0) out[blockIdx.x] = s;
}
"#;

#[test]
fn a_read_without_a_barrier_before_it_sees_the_write_only_sometimes() {
    let Some(emu) = emulator() else { return };
    let s = &emu.stream;
    let f = function(s, RACY, "racy");
    let blocks = 64;
    let mut out = s.alloc_zeros::<i32>(blocks).unwrap();
    let mut launch = s.launch_builder(&f);
    launch.arg(&mut out);
    // SAFETY: `blocks` blocks of 64 threads, one output each.
    unsafe { launch.launch(config(blocks as u32, 64)) }.unwrap();
    let out = s.clone_dtoh(&out).unwrap();
    // The warps' order is drawn per block: in order, every block would read its own write.
    let fresh = (0..blocks).filter(|&b| out[b] == b as i32).count();
    assert!(0 < fresh && fresh < blocks, "{fresh} of {blocks} blocks read the write: {out:?}");
}

const ORDER: &str = r#"
extern "C" __global__ void order(volatile int* next, int* ran) {
    // A block's threads run one at a time on the emulator: no race there (there would be on a
    // device). Blocks may run on several host threads at once, so each counts its own.
    const int k = next[blockIdx.x];
    ran[blockIdx.x * blockDim.x + k] = threadIdx.x;
    next[blockIdx.x] = k + 1;
}
"#;

#[test]
fn warps_and_lanes_run_in_a_drawn_order() {
    let Some(emu) = emulator() else { return };
    let s = &emu.stream;
    let f = function(s, ORDER, "order");
    let (blocks, threads) = (8, 64);
    let mut next = s.alloc_zeros::<i32>(blocks).unwrap();
    let mut ran = s.alloc_zeros::<i32>(blocks * threads).unwrap();
    let mut launch = s.launch_builder(&f);
    launch.arg(&mut next).arg(&mut ran);
    // SAFETY: a counter per block, and a slot per thread.
    unsafe { launch.launch(config(blocks as u32, threads as u32)) }.unwrap();
    let ran = s.clone_dtoh(&ran).unwrap();
    let in_order: Vec<i32> = (0..threads as i32).collect();
    for block in ran.chunks(threads) {
        let mut sorted = block.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, in_order, "each thread of a block once: {block:?}");
    }
    assert!(ran.chunks(threads).all(|b| b != in_order), "a block ran in thread order: {ran:?}");
}
