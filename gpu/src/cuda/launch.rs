//! One step's work on the device: the kernels loaded from NVRTC's output, the buffers they read
//! and write, and the launch sequence of a forward pass over `tokens` tokens with `samples`
//! sampled rows. The sequence reads its inputs from fixed buffers and takes no other argument
//! that changes between steps of the same shape, so the same calls run eagerly or are captured
//! once into a CUDA graph and replayed (`executor`).
//!
//! Every `unsafe` here is a kernel launch (cudarc cannot check a kernel's parameters): each
//! launch's arguments follow its `.cu` signature one for one, in order and type (pointers as
//! device slices or a null `u64`, `int` as `i32`, `long` as `i64`, `float` as `f32`), and every
//! buffer holds the elements the launch touches (`Buffers::ensure` sizes them before a step).
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::kernels::{self, KernelSource};
use super::layout::{KvCacheLayout, Part};
use super::nvrtc::{self, Target};
use super::weights::{DeviceMatrix, DeviceWeights, MatrixData};
use crate::llama::{LlamaConfig, RopeStyle};

/// Every kernel, loaded.
#[derive(Debug)]
pub struct Kernels {
    embed: [CudaFunction; 3],
    matmul: [CudaFunction; 3],
    rms_norm: CudaFunction,
    rope_kv_write: CudaFunction,
    paged_attention: CudaFunction,
    swiglu: CudaFunction,
    argmax: CudaFunction,
}

/// Where the kernels' machine code comes from.
#[derive(Clone, Copy, Debug)]
pub enum KernelImages<'a> {
    /// Compiled now by NVRTC for this target.
    Nvrtc(Target),
    /// Cubins for `sm` compiled ahead of time, in this folder (`KernelSource::cubin_file`).
    Prebuilt { dir: &'a Path, sm: u32 },
}

impl KernelImages<'_> {
    fn image(&self, source: &KernelSource) -> Result<Vec<u8>, String> {
        match *self {
            KernelImages::Nvrtc(target) => Ok(nvrtc::compile(source, target)?.image),
            KernelImages::Prebuilt { dir, sm } => {
                let path = dir.join(source.cubin_file(sm));
                std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))
            }
        }
    }
}

impl Kernels {
    /// Every source's machine code, loaded into `context`.
    pub fn load(context: &Arc<CudaContext>, images: KernelImages<'_>) -> Result<Kernels, String> {
        let module = |source: &KernelSource| -> Result<Vec<CudaFunction>, String> {
            let image = Ptx::from_binary(images.image(source)?);
            let module = context
                .load_module(image)
                .map_err(|e| format!("loading {}.cu ({images:?}): {e}", source.name))?;
            source
                .functions
                .iter()
                .map(|f| module.load_function(f).map_err(|e| format!("kernel {f}: {e}")))
                .collect()
        };
        let three = |source: &KernelSource| -> Result<[CudaFunction; 3], String> {
            let functions = module(source)?;
            <[CudaFunction; 3]>::try_from(functions)
                .map_err(|_| format!("{}.cu: three kernels expected", source.name))
        };
        let one = |source: &KernelSource| -> Result<CudaFunction, String> {
            module(source)?.pop().ok_or_else(|| format!("{}.cu: no kernel", source.name))
        };
        Ok(Kernels {
            embed: three(&kernels::EMBED)?,
            matmul: three(&kernels::MATMUL)?,
            rms_norm: one(&kernels::RMS_NORM)?,
            rope_kv_write: one(&kernels::ROPE_KV_WRITE)?,
            paged_attention: one(&kernels::PAGED_ATTENTION)?,
            swiglu: one(&kernels::SWIGLU)?,
            argmax: one(&kernels::ARGMAX)?,
        })
    }
}

/// The model's shape as the kernels take it.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    /// `rope_base^(-2 / head_dim)`, computed as the CPU's `rope` does.
    pub theta_scale: f32,
    pub halves: bool,
    /// 0 without a sliding window.
    pub window: usize,
    /// `1 / sqrt(head_dim)`, as the CPU's attention.
    pub attention_scale: f32,
}

impl Dims {
    /// The dims of `c`, refused if a kernel cannot hold them.
    pub fn of(c: &LlamaConfig) -> Result<Dims, String> {
        if c.head_dim > kernels::HEAD_DIM_MAX {
            return Err(format!(
                "head size {} is more than the CUDA kernels' {}",
                c.head_dim,
                kernels::HEAD_DIM_MAX
            ));
        }
        let widest = [c.hidden, c.ffn, c.vocab_size, c.heads * c.head_dim].into_iter().max();
        if widest.is_some_and(|w| i32::try_from(w).is_err()) {
            return Err("a dimension past the kernels' i32".into());
        }
        Ok(Dims {
            hidden: c.hidden,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            ffn: c.ffn,
            vocab: c.vocab_size,
            rms_eps: c.rms_eps,
            theta_scale: c.rope_base.powf(-2.0 / c.head_dim as f32),
            halves: c.rope_style == RopeStyle::Halves,
            window: c.sliding_window.unwrap_or(0),
            attention_scale: 1.0 / (c.head_dim as f32).sqrt(),
        })
    }

    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// How much a step's buffers hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub tokens: usize,
    pub rows: usize,
    pub table_entries: usize,
    pub samples: usize,
}

impl Capacity {
    pub fn holds(&self, need: &Capacity) -> bool {
        self.tokens >= need.tokens
            && self.rows >= need.rows
            && self.table_entries >= need.table_entries
            && self.samples >= need.samples
    }

    /// At least `need`, doubling what grows so that a slowly growing load reallocates rarely.
    pub fn grown_to(&self, need: &Capacity) -> Capacity {
        let grow = |have: usize, need: usize| if have >= need { have } else { need.max(2 * have) };
        Capacity {
            tokens: grow(self.tokens, need.tokens),
            rows: grow(self.rows, need.rows),
            table_entries: grow(self.table_entries, need.table_entries),
            samples: grow(self.samples, need.samples),
        }
    }
}

/// The step's inputs (written by the host before a launch) and its activations.
#[derive(Debug)]
pub struct Buffers {
    pub capacity: Capacity,
    pub tokens: CudaSlice<i32>,
    pub positions: CudaSlice<i32>,
    pub token_rows: CudaSlice<i32>,
    pub table_offsets: CudaSlice<i32>,
    pub tables: CudaSlice<i32>,
    pub sample_tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attended: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    pub argmax: CudaSlice<i32>,
}

impl Buffers {
    pub fn new(stream: &Arc<CudaStream>, d: &Dims, c: Capacity) -> Result<Buffers, DriverError> {
        let f = |n: usize| stream.alloc_zeros::<f32>(n.max(1));
        let i = |n: usize| stream.alloc_zeros::<i32>(n.max(1));
        let n = c.tokens;
        Ok(Buffers {
            capacity: c,
            tokens: i(n)?,
            positions: i(n)?,
            token_rows: i(n)?,
            table_offsets: i(c.rows)?,
            tables: i(c.table_entries)?,
            sample_tokens: i(c.samples)?,
            x: f(n * d.hidden)?,
            h: f(n * d.hidden)?,
            q: f(n * d.q_width())?,
            k: f(n * d.kv_width())?,
            v: f(n * d.kv_width())?,
            attended: f(n * d.q_width())?,
            gate: f(n * d.ffn)?,
            up: f(n * d.ffn)?,
            normed: f(c.samples * d.hidden)?,
            logits: f(c.samples * d.vocab)?,
            argmax: i(c.samples)?,
        })
    }
}

fn grid(n: usize) -> Result<u32, DriverError> {
    u32::try_from(n.max(1))
        .map_err(|_| DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE))
}

fn config(grid_x: u32, grid_y: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid_x, grid_y, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// What one launch sequence computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub tokens: usize,
    pub samples: usize,
}

/// Everything a launch sequence reads besides the buffers.
#[derive(Debug)]
pub struct Model<'a> {
    pub kernels: &'a Kernels,
    pub weights: &'a DeviceWeights,
    pub dims: Dims,
    pub kv: &'a CudaSlice<u16>,
    pub kv_layout: KvCacheLayout,
}

/// Queues a forward pass of `shape` on `stream`: embeddings, every layer, the final norm of the
/// sampled rows, their logits and their argmax.
pub fn forward(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &Buffers,
    shape: Shape,
) -> Result<(), DriverError> {
    let d = &m.dims;
    let n = shape.tokens;
    embed(stream, m, b, n)?;
    for (l, layer) in m.weights.layers.iter().enumerate() {
        rms_norm(stream, m, &b.x, None, &layer.attn_norm, &b.h, n)?;
        matmul(stream, m, &layer.q, &b.h, &b.q, n, false)?;
        matmul(stream, m, &layer.k, &b.h, &b.k, n, false)?;
        matmul(stream, m, &layer.v, &b.h, &b.v, n, false)?;
        rope_kv_write(stream, m, b, l, layer.qkv_bias.as_ref(), n)?;
        attention(stream, m, b, l, n)?;
        matmul(stream, m, &layer.o, &b.attended, &b.x, n, true)?;
        rms_norm(stream, m, &b.x, None, &layer.ffn_norm, &b.h, n)?;
        matmul(stream, m, &layer.gate, &b.h, &b.gate, n, false)?;
        matmul(stream, m, &layer.up, &b.h, &b.up, n, false)?;
        swiglu(stream, m, b, n * d.ffn)?;
        matmul(stream, m, &layer.down, &b.gate, &b.x, n, true)?;
    }
    let s = shape.samples;
    if s == 0 {
        return Ok(());
    }
    rms_norm(stream, m, &b.x, Some(&b.sample_tokens), &m.weights.output_norm, &b.normed, s)?;
    matmul(stream, m, m.weights.output(), &b.normed, &b.logits, s, false)?;
    let vocab = d.vocab as i32;
    // SAFETY: argmax(const float* logits, int* out, int vocab); `s` rows of logits.
    unsafe {
        stream
            .launch_builder(&m.kernels.argmax)
            .arg(&b.logits)
            .arg(&b.argmax)
            .arg(&vocab)
            .launch(config(grid(s)?, 1, 256))
    }?;
    Ok(())
}

fn embed(stream: &CudaStream, m: &Model<'_>, b: &Buffers, n: usize) -> Result<(), DriverError> {
    let hidden = m.dims.hidden as i32;
    let cfg = config(grid(n)?, 1, 256);
    let [f32_kernel, f16_kernel, bf16_kernel] = &m.kernels.embed;
    // SAFETY: embed_*(const T* table, const int* tokens, float* x, int hidden); tokens were
    // checked against the vocabulary on the host.
    unsafe {
        match &m.weights.embed.data {
            MatrixData::F32(t) => stream
                .launch_builder(f32_kernel)
                .arg(t)
                .arg(&b.tokens)
                .arg(&b.x)
                .arg(&hidden)
                .launch(cfg),
            MatrixData::F16(t) => stream
                .launch_builder(f16_kernel)
                .arg(t)
                .arg(&b.tokens)
                .arg(&b.x)
                .arg(&hidden)
                .launch(cfg),
            MatrixData::Bf16(t) => stream
                .launch_builder(bf16_kernel)
                .arg(t)
                .arg(&b.tokens)
                .arg(&b.x)
                .arg(&hidden)
                .launch(cfg),
        }
    }?;
    Ok(())
}

fn rms_norm(
    stream: &CudaStream,
    m: &Model<'_>,
    x: &CudaSlice<f32>,
    rows: Option<&CudaSlice<i32>>,
    weight: &CudaSlice<f32>,
    out: &CudaSlice<f32>,
    count: usize,
) -> Result<(), DriverError> {
    let (hidden, eps) = (m.dims.hidden as i32, m.dims.rms_eps);
    let null = 0u64;
    let mut launch = stream.launch_builder(&m.kernels.rms_norm);
    launch.arg(x);
    match rows {
        Some(rows) => launch.arg(rows),
        None => launch.arg(&null),
    };
    launch.arg(weight).arg(out).arg(&hidden).arg(&eps);
    // SAFETY: rms_norm(const float* x, const int* rows, const float* weight, float* out,
    // int hidden, float eps); 256 threads, as NORM_THREADS; `count` rows.
    unsafe { launch.launch(config(grid(count)?, 1, 256)) }?;
    Ok(())
}

fn matmul(
    stream: &CudaStream,
    m: &Model<'_>,
    w: &DeviceMatrix,
    x: &CudaSlice<f32>,
    y: &CudaSlice<f32>,
    tokens: usize,
    accumulate: bool,
) -> Result<(), DriverError> {
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    let (tokens, accumulate) = (tokens as i32, i32::from(accumulate));
    // Four warps a block, one weight row each (matmul.cu's WARPS).
    let cfg = config(grid(w.rows.div_ceil(4))?, 1, 128);
    let [f32_kernel, f16_kernel, bf16_kernel] = &m.kernels.matmul;
    macro_rules! go {
        ($kernel:expr, $data:expr) => {
            stream
                .launch_builder($kernel)
                .arg($data)
                .arg(x)
                .arg(y)
                .arg(&rows)
                .arg(&cols)
                .arg(&tokens)
                .arg(&accumulate)
                .launch(cfg)
        };
    }
    // SAFETY: matmul_*(const T* w, const float* x, float* y, int rows, int k_len, int tokens,
    // int accumulate); `x` holds `tokens * cols`, `y` `tokens * rows` (the buffers' sizes).
    unsafe {
        match &w.data {
            MatrixData::F32(data) => go!(f32_kernel, data),
            MatrixData::F16(data) => go!(f16_kernel, data),
            MatrixData::Bf16(data) => go!(bf16_kernel, data),
        }
    }?;
    Ok(())
}

fn rope_kv_write(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &Buffers,
    layer: usize,
    bias: Option<&[CudaSlice<f32>; 3]>,
    n: usize,
) -> Result<(), DriverError> {
    let d = &m.dims;
    let null = 0u64;
    let (keys, values) = layer_cache(m, layer);
    let (theta_scale, halves) = (d.theta_scale, i32::from(d.halves));
    let (heads, kv_heads, head_dim) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32);
    let page_tokens = m.kv_layout.page_tokens as i32;
    let mut launch = stream.launch_builder(&m.kernels.rope_kv_write);
    launch.arg(&b.q).arg(&b.k).arg(&b.v);
    match bias {
        Some([qb, kb, vb]) => launch.arg(qb).arg(kb).arg(vb),
        None => launch.arg(&null).arg(&null).arg(&null),
    };
    launch.arg(&b.positions).arg(&b.token_rows).arg(&b.table_offsets).arg(&b.tables);
    launch.arg(&keys).arg(&values);
    match &m.weights.rope_freq_factors {
        Some(f) => launch.arg(f),
        None => launch.arg(&null),
    };
    launch.arg(&theta_scale).arg(&halves).arg(&heads).arg(&kv_heads).arg(&head_dim);
    launch.arg(&page_tokens);
    // SAFETY: rope_kv_write's 20 parameters in order; page-table entries were checked against
    // the cache's pages on the host.
    unsafe { launch.launch(config(grid(n)?, 1, 128)) }?;
    Ok(())
}

fn attention(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &Buffers,
    layer: usize,
    n: usize,
) -> Result<(), DriverError> {
    let d = &m.dims;
    let (keys, values) = layer_cache(m, layer);
    let (heads, kv_heads, head_dim) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32);
    let (page_tokens, window) = (m.kv_layout.page_tokens as i32, d.window as i32);
    let scale = d.attention_scale;
    let mut launch = stream.launch_builder(&m.kernels.paged_attention);
    launch.arg(&b.q).arg(&b.attended);
    launch.arg(&b.positions).arg(&b.token_rows).arg(&b.table_offsets).arg(&b.tables);
    launch.arg(&keys).arg(&values);
    launch.arg(&heads).arg(&kv_heads).arg(&head_dim).arg(&page_tokens).arg(&window).arg(&scale);
    // SAFETY: paged_attention's 14 parameters in order; one warp per (token, head), heads on
    // the grid's y (at most 65,535 there; a model has far fewer heads).
    unsafe { launch.launch(config(grid(n)?, grid(d.heads)?, 32)) }?;
    Ok(())
}

fn swiglu(stream: &CudaStream, m: &Model<'_>, b: &Buffers, len: usize) -> Result<(), DriverError> {
    let count = len as i64;
    // SAFETY: swiglu(const float* gate, const float* up, float* out, long n); in place on gate.
    unsafe {
        stream
            .launch_builder(&m.kernels.swiglu)
            .arg(&b.gate)
            .arg(&b.up)
            .arg(&b.gate)
            .arg(&count)
            .launch(config(grid(len.div_ceil(256))?, 1, 256))
    }?;
    Ok(())
}

/// Layer `layer`'s keys and values, all pages.
fn layer_cache<'a>(
    m: &'a Model<'_>,
    layer: usize,
) -> (cudarc::driver::CudaView<'a, u16>, cudarc::driver::CudaView<'a, u16>) {
    let l = &m.kv_layout;
    let part = |p: Part| {
        let at = l.part_offset(layer, p);
        m.kv.slice(at..at + l.part_elements())
    };
    (part(Part::Keys), part(Part::Values))
}
