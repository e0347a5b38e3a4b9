//! One step's work on the device: the kernels loaded from NVRTC's output, the buffers they read
//! and write, and the launch sequence of a forward pass over `tokens` tokens with `samples`
//! sampled rows. The sequence reads its inputs from fixed buffers and takes no other argument
//! that changes between steps of the same shape, so the same calls run eagerly or are captured
//! once into a CUDA graph and replayed (`executor`).
//!
//! Every `unsafe` here is a kernel launch (nothing can check a kernel's parameters): each
//! launch's arguments follow its `.cu` signature one for one, in order and type (pointers as
//! buffers or `null`, `int` and `float`), and every buffer holds the elements the launch touches
//! (`Buffers::ensure` sizes them before a step).
//!
//! With `LaunchOptions::dependent_launches`, every kernel after the first is a programmatic
//! dependent launch (`kernel_call`): each kernel's source calls `allow_next_kernel()` first and
//! touches nothing another kernel writes before `wait_for_inputs()`. The first kernel follows the
//! input copy, which the attribute would not order, so it is launched plainly.
#![allow(unsafe_code)]

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DriverError,
    LaunchConfig,
};
use cudarc::nvrtc::Ptx;

pub use crate::launch_options::LaunchOptions;

use super::kernel_cache::KernelCache;
use super::kernel_call::KernelCall;
use super::kernels::{self, KernelSource};
use super::layout::{KvCacheLayout, Part};
use super::nvrtc::{self, Target};
use super::weights::{BlockKind, DeviceMatrix, DeviceWeights, MatrixData};
use crate::llama::{LlamaConfig, RopeStyle};

/// A kernel's entry points per storage type: f32, f16, bf16, and blocks of Q4_0, Q4_1, Q8_0,
/// Q4_K, Q6_K, Q5_1 and Q5_K.
type PerStorage = [CudaFunction; STORAGE_TYPES];
const STORAGE_TYPES: usize = 10;

/// Every kernel, loaded.
#[derive(Debug)]
pub struct Kernels {
    embed: PerStorage,
    matmul: PerStorage,
    matmul_swiglu: PerStorage,
    /// The same products with several output rows a warp (`LaunchOptions::wide_products`).
    matmul_wide: PerStorage,
    matmul_swiglu_wide: PerStorage,
    rms_norm: CudaFunction,
    rope_kv_write: CudaFunction,
    /// By head size: up to 64, 128 and 256.
    paged_attention: [CudaFunction; 3],
    /// The same with `rope_kv_write` folded in, for steps of one token a row
    /// (`LaunchOptions::fold_rope`).
    paged_attention_rope: [CudaFunction; 3],
    /// The two again in split blocks (`LaunchOptions::split_attention`), and the merge of the
    /// splits' states after them.
    paged_attention_split: [CudaFunction; 3],
    paged_attention_rope_split: [CudaFunction; 3],
    attention_merge: [CudaFunction; 3],
    argmax: CudaFunction,
}

/// Where the kernels' machine code comes from.
#[derive(Clone, Copy, Debug)]
pub enum KernelImages<'a> {
    /// Compiled now by NVRTC for this target, or read from `cache` where a run before kept it.
    Nvrtc { target: Target, cache: Option<&'a KernelCache> },
    /// Cubins for `sm` compiled ahead of time, in this folder (`KernelSource::cubin_file`).
    Prebuilt { dir: &'a Path, sm: u32 },
}

/// How the kernel modules were found: for the start-up log, and for tests of the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelOrigins {
    pub compiled: usize,
    pub cached: usize,
    pub prebuilt: usize,
    /// What went wrong with the cache (not kept, a damaged entry compiled again); never fatal.
    pub cache_notes: Vec<String>,
}

/// Loads modules into a context, counting where each came from.
struct ModuleLoader<'a> {
    context: &'a Arc<CudaContext>,
    images: KernelImages<'a>,
    /// NVRTC's version, part of a cached image's name; read when the cache is first asked.
    nvrtc_version: Option<(i32, i32)>,
    origins: KernelOrigins,
}

impl ModuleLoader<'_> {
    /// `source`'s module, loaded, and its entry points in order.
    fn functions(&mut self, source: &KernelSource) -> Result<Vec<CudaFunction>, String> {
        let module = match self.images {
            KernelImages::Prebuilt { dir, sm } => {
                let path = dir.join(source.cubin_file(sm));
                let image = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                self.origins.prebuilt += 1;
                self.load(source, image)?
            }
            KernelImages::Nvrtc { target, cache: None } => {
                let image = nvrtc::compile(source, target)?.image;
                self.origins.compiled += 1;
                self.load(source, image)?
            }
            KernelImages::Nvrtc { target, cache: Some(cache) } => {
                let version = match self.nvrtc_version {
                    Some(version) => version,
                    None => *self.nvrtc_version.insert(nvrtc::version()?),
                };
                let path = cache.path(source, target, version);
                let kept = cache.get(&path).map(|image| self.load(source, image));
                match kept {
                    Some(Ok(module)) => {
                        self.origins.cached += 1;
                        module
                    }
                    damaged => {
                        if let Some(Err(e)) = damaged {
                            cache.forget(&path);
                            self.origins.cache_notes.push(format!("compiled again: {e}"));
                        }
                        let image = nvrtc::compile(source, target)?.image;
                        self.origins.compiled += 1;
                        if let Err(e) = cache.put(&path, &image) {
                            self.origins.cache_notes.push(format!("not kept: {e}"));
                        }
                        self.load(source, image)?
                    }
                }
            }
        };
        source
            .functions
            .iter()
            .map(|f| module.load_function(f).map_err(|e| format!("kernel {f}: {e}")))
            .collect()
    }

    fn load(&self, source: &KernelSource, image: Vec<u8>) -> Result<Arc<CudaModule>, String> {
        self.context
            .load_module(Ptx::from_binary(image))
            .map_err(|e| format!("loading {}.cu ({:?}): {e}", source.name, self.images))
    }
}

/// One source's entry points in order, loaded as `Kernels::load` loads them.
pub fn load_functions(
    context: &Arc<CudaContext>,
    images: KernelImages<'_>,
    source: &KernelSource,
) -> Result<Vec<CudaFunction>, String> {
    let mut loader =
        ModuleLoader { context, images, nvrtc_version: None, origins: KernelOrigins::default() };
    loader.functions(source)
}

impl Kernels {
    /// Every source's machine code, loaded into `context`; and where each module came from.
    pub fn load(
        context: &Arc<CudaContext>,
        images: KernelImages<'_>,
    ) -> Result<(Kernels, KernelOrigins), String> {
        let mut loader = ModuleLoader {
            context,
            images,
            nvrtc_version: None,
            origins: KernelOrigins::default(),
        };
        let mut module = |source: &KernelSource| loader.functions(source);
        fn group<const N: usize>(
            functions: Vec<CudaFunction>,
            name: &str,
        ) -> Result<[CudaFunction; N], String> {
            <[CudaFunction; N]>::try_from(functions)
                .map_err(|_| format!("{name}.cu: a group of {N} kernels expected"))
        }
        fn one(functions: Vec<CudaFunction>, name: &str) -> Result<CudaFunction, String> {
            <[CudaFunction; 1]>::try_from(functions)
                .map(|[f]| f)
                .map_err(|_| format!("{name}.cu: one kernel expected"))
        }
        // matmul.cu: plain, with SwiGLU, wide, wide with SwiGLU; every storage type each.
        let mut products = module(&kernels::MATMUL)?.into_iter();
        let mut next =
            || group(products.by_ref().take(STORAGE_TYPES).collect(), kernels::MATMUL.name);
        let (matmul, matmul_swiglu) = (next()?, next()?);
        let (matmul_wide, matmul_swiglu_wide) = (next()?, next()?);
        // paged_attention.cu: plain, with RoPE folded in, the two in split blocks, the merge;
        // three head sizes each.
        let mut attention = module(&kernels::PAGED_ATTENTION)?.into_iter();
        let mut next_attention =
            || group(attention.by_ref().take(3).collect(), kernels::PAGED_ATTENTION.name);
        let (paged_attention, paged_attention_rope) = (next_attention()?, next_attention()?);
        let (paged_attention_split, paged_attention_rope_split) =
            (next_attention()?, next_attention()?);
        let attention_merge = next_attention()?;
        let kernels = Kernels {
            embed: group(module(&kernels::EMBED)?, kernels::EMBED.name)?,
            matmul,
            matmul_swiglu,
            matmul_wide,
            matmul_swiglu_wide,
            rms_norm: one(module(&kernels::RMS_NORM)?, kernels::RMS_NORM.name)?,
            rope_kv_write: one(module(&kernels::ROPE_KV_WRITE)?, kernels::ROPE_KV_WRITE.name)?,
            paged_attention,
            paged_attention_rope,
            paged_attention_split,
            paged_attention_rope_split,
            attention_merge,
            argmax: one(module(&kernels::ARGMAX)?, kernels::ARGMAX.name)?,
        };
        Ok((kernels, loader.origins))
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

    /// A token's row of the fused Q/K/V product.
    fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
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

/// One of a step's input arrays (`StepArrays`'s fields of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    Tokens,
    Positions,
    TokenRows,
    TableOffsets,
    Tables,
    SampleTokens,
}

impl Input {
    const ALL: [Input; 6] = [
        Input::Tokens,
        Input::Positions,
        Input::TokenRows,
        Input::TableOffsets,
        Input::Tables,
        Input::SampleTokens,
    ];
}

/// Where each of a step's input arrays sits in `Buffers::inputs`: fixed by the capacity, so a
/// captured graph's pointers stay valid, and one copy writes them all.
impl Capacity {
    /// Where `input` starts and how many elements it may hold.
    pub fn input_span(&self, input: Input) -> (usize, usize) {
        let c = self;
        let sizes = [c.tokens, c.tokens, c.tokens, c.rows, c.table_entries, c.samples];
        let index = input as usize;
        (sizes[..index].iter().sum(), sizes[index])
    }

    /// Input elements in all.
    pub fn input_len(&self) -> usize {
        let (start, len) = self.input_span(Input::SampleTokens);
        start + len
    }

    /// `arrays` (each within its capacity) laid out as one array to copy; only up to the last
    /// array in use.
    pub fn pack_inputs(&self, arrays: [&[i32]; 6], out: &mut Vec<i32>) {
        out.clear();
        for (input, array) in Input::ALL.into_iter().zip(arrays) {
            let (start, len) = self.input_span(input);
            assert!(array.len() <= len, "{input:?}: {} past its capacity {len}", array.len());
            if !array.is_empty() {
                out.resize(start, 0);
                out.extend_from_slice(array);
            }
        }
    }
}

/// The step's inputs (written by the host before a launch) and its activations.
#[derive(Debug)]
pub struct Buffers {
    pub capacity: Capacity,
    /// Every input array, at `Capacity::input_span`'s offsets.
    pub inputs: CudaSlice<i32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    /// Per token its Q heads, then K, then V (`Dims::qkv_width`).
    qkv: CudaSlice<f32>,
    attended: CudaSlice<f32>,
    /// SwiGLU of the gate and up products, the down product's input.
    activated: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    pub argmax: CudaSlice<i32>,
}

impl Buffers {
    /// The arrays a token's page table is found through: positions, token rows, table offsets,
    /// tables.
    fn tables(&self) -> [CudaView<'_, i32>; 4] {
        [Input::Positions, Input::TokenRows, Input::TableOffsets, Input::Tables]
            .map(|input| self.input(input))
    }

    /// The device array of `input`, a view of `inputs`.
    fn input(&self, input: Input) -> CudaView<'_, i32> {
        let (start, len) = self.capacity.input_span(input);
        self.inputs.slice(start..start + len)
    }

    pub fn new(stream: &Arc<CudaStream>, d: &Dims, c: Capacity) -> Result<Buffers, DriverError> {
        let f = |n: usize| stream.alloc_zeros::<f32>(n.max(1));
        let i = |n: usize| stream.alloc_zeros::<i32>(n.max(1));
        let n = c.tokens;
        Ok(Buffers {
            capacity: c,
            inputs: i(c.input_len())?,
            x: f(n * d.hidden)?,
            h: f(n * d.hidden)?,
            qkv: f(n * d.qkv_width())?,
            attended: f(n * d.q_width())?,
            activated: f(n * d.ffn)?,
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

/// Where split attention blocks leave each split's softmax state for the merge
/// (`paged_attention.cu`'s `Partials`): room for `tokens` tokens of `heads` heads of up to
/// `max_splits` splits each. Allocated by the executor while `LaunchOptions::split_attention`
/// is on.
#[derive(Debug)]
pub struct SplitPartials {
    acc: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    max_splits: usize,
}

impl SplitPartials {
    /// For a model of `d`'s shape whose rows hold at most `positions` positions:
    /// `SPLIT_ATTENTION_TOKENS_MAX` tokens of as many splits as `positions` fill. A token past
    /// them is still right: one block takes it whole.
    pub fn new(
        stream: &Arc<CudaStream>,
        d: &Dims,
        positions: usize,
    ) -> Result<SplitPartials, DriverError> {
        let max_splits = split_count(positions).max(2);
        let states = SPLIT_ATTENTION_TOKENS_MAX * d.heads * max_splits;
        Ok(SplitPartials {
            acc: stream.alloc_zeros::<f32>(states * d.head_dim)?,
            stats: stream.alloc_zeros::<f32>(states * 2)?,
            max_splits,
        })
    }
}

/// How many splits of `ATTENTION_SPLIT_POSITIONS` a row of `positions` positions spans at most:
/// its positions counted from its window's first tile, which starts up to 31 positions before.
pub fn split_count(positions: usize) -> usize {
    (positions + 31).div_ceil(kernels::ATTENTION_SPLIT_POSITIONS)
}

/// The entry point for a matrix's storage type, of a kernel's `PerStorage`.
fn for_type<'k>(kernels: &'k PerStorage, data: &MatrixData) -> &'k CudaFunction {
    let [f32_kernel, f16_kernel, bf16_kernel, q4_0, q4_1, q8_0, q4_k, q6_k, q5_1, q5_k] = kernels;
    match data {
        MatrixData::F32(_) => f32_kernel,
        MatrixData::F16(_) => f16_kernel,
        MatrixData::Bf16(_) => bf16_kernel,
        MatrixData::Blocks { kind: BlockKind::Q4_0, .. } => q4_0,
        MatrixData::Blocks { kind: BlockKind::Q4_1, .. } => q4_1,
        MatrixData::Blocks { kind: BlockKind::Q8_0, .. } => q8_0,
        MatrixData::Blocks { kind: BlockKind::Q4K, .. } => q4_k,
        MatrixData::Blocks { kind: BlockKind::Q6K, .. } => q6_k,
        MatrixData::Blocks { kind: BlockKind::Q5_1, .. } => q5_1,
        MatrixData::Blocks { kind: BlockKind::Q5K, .. } => q5_k,
    }
}

/// A matrix as its type's entry point takes it: its elements as one `const T*` parameter, or its
/// blocks as two, the quants and the scales.
fn matrix(call: &mut KernelCall<'_>, data: &MatrixData) {
    match data {
        MatrixData::F32(d) => call.buffer(d),
        MatrixData::F16(d) => call.buffer(d),
        MatrixData::Bf16(d) => call.buffer(d),
        MatrixData::Blocks { quants, scales, .. } => call.buffer(quants).buffer(scales),
    };
}

/// What one launch sequence computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub tokens: usize,
    pub rows: usize,
    pub samples: usize,
}

impl Shape {
    /// Every row one token (a decode step): each token's K and V are read by its own attention
    /// only, so RoPE and the KV write can fold into it (`LaunchOptions::fold_rope`).
    pub fn one_token_a_row(&self) -> bool {
        self.tokens == self.rows
    }
}

/// Everything a launch sequence reads besides the buffers.
#[derive(Debug)]
pub struct Model<'a> {
    pub kernels: &'a Kernels,
    pub weights: &'a DeviceWeights,
    pub dims: Dims,
    pub kv: &'a CudaSlice<u16>,
    pub kv_layout: KvCacheLayout,
    pub options: LaunchOptions,
    /// Present while `options.split_attention` is on.
    pub partials: Option<&'a SplitPartials>,
}

/// The fewest tokens a step has for its products to go wide: past one tile of `matmul.cu`
/// (TILE, 8), where a warp goes over its weight rows once per 8 tokens.
pub const WIDE_PRODUCT_TOKENS_MIN: usize = 9;

/// The most tokens a step may have for its norms to be folded into the products (`matmul.cu`):
/// each block of a folded product computes every token's norm itself, which costs a block per
/// layer less than a norm kernel's latency at a few tokens and far more at hundreds. Folded or
/// not, the bits are the same, so the choice by size keeps a request's bits its own.
pub const FOLDED_NORM_TOKENS_MAX: usize = 8;

/// The most tokens a step may have for its attention to go in split blocks: a block per (token,
/// head) already fills the device at a few dozen tokens, and the partials are sized for this
/// many.
pub const SPLIT_ATTENTION_TOKENS_MAX: usize = 16;

/// The blocks split attention aims for: about four resident blocks an SM on Hopper and
/// Blackwell (132 to 148 SMs). A constant, not the device's count, so the launch shapes are the
/// same everywhere; the bits do not depend on it either way.
const SPLIT_ATTENTION_BLOCKS: usize = 512;

/// Blocks a (token, head) of a step of `tokens` tokens of `heads` heads: enough for
/// `SPLIT_ATTENTION_BLOCKS` in all, at most `max_splits` (a token's splits past them wait for
/// a block that walks several).
fn split_blocks(tokens: usize, heads: usize, max_splits: usize) -> usize {
    SPLIT_ATTENTION_BLOCKS.div_ceil(tokens.max(1) * heads.max(1)).min(max_splits)
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
        let input = normed(stream, m, b, &layer.attn_norm, n)?;
        matmul(stream, m, Product::Plain, &layer.qkv, input, &b.qkv, n, false)?;
        let bias = layer.qkv_bias.as_ref();
        if m.options.fold_rope && shape.one_token_a_row() {
            attention(stream, m, b, l, n, Some(bias))?;
        } else {
            rope_kv_write(stream, m, b, l, bias, n)?;
            attention(stream, m, b, l, n, None)?;
        }
        let attended = Normed { x: &b.attended, norm: None };
        matmul(stream, m, Product::Plain, &layer.o, attended, &b.x, n, true)?;
        let input = normed(stream, m, b, &layer.ffn_norm, n)?;
        matmul(stream, m, Product::SwiGlu, &layer.gate_up, input, &b.activated, n, false)?;
        let activated = Normed { x: &b.activated, norm: None };
        matmul(stream, m, Product::Plain, &layer.down, activated, &b.x, n, true)?;
    }
    let s = shape.samples;
    if s == 0 {
        return Ok(());
    }
    let sample_tokens = b.input(Input::SampleTokens);
    rms_norm(stream, m, &b.x, Some(&sample_tokens), &m.weights.output_norm, &b.normed, s)?;
    let normed = Normed { x: &b.normed, norm: None };
    matmul(stream, m, Product::Plain, m.weights.output(), normed, &b.logits, s, false)?;
    let mut call = KernelCall::new(stream, &m.kernels.argmax);
    call.buffer(&b.logits).buffer(&b.argmax).int(d.vocab as i32);
    // SAFETY: argmax(const float* logits, int* out, int vocab); `s` rows of logits; 1024
    // threads, as argmax.cu's ARGMAX_THREADS.
    unsafe { call.launch(config(grid(s)?, 1, 1024), m.options.dependent_launches) }
}

/// The input of a product that a norm of the residual stream precedes: the norm's output, or
/// (folded) the residual stream and the norm's weights, for the product to apply.
fn normed<'a>(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &'a Buffers,
    norm: &'a CudaSlice<f32>,
    n: usize,
) -> Result<Normed<'a>, DriverError> {
    if m.options.fold_norms && n <= FOLDED_NORM_TOKENS_MAX {
        return Ok(Normed { x: &b.x, norm: Some(norm) });
    }
    rms_norm(stream, m, &b.x, None, norm, &b.h, n)?;
    Ok(Normed { x: &b.h, norm: None })
}

/// The step's first kernel: launched plainly, after the input copy.
fn embed(stream: &CudaStream, m: &Model<'_>, b: &Buffers, n: usize) -> Result<(), DriverError> {
    let table = &m.weights.embed.data;
    let mut call = KernelCall::new(stream, for_type(&m.kernels.embed, table));
    matrix(&mut call, table);
    call.buffer(&b.input(Input::Tokens)).buffer(&b.x).int(m.dims.hidden as i32);
    // SAFETY: embed_*(const T* table, const int* tokens, float* x, int hidden), the table as
    // two pointers (quants, scales) for blocks; tokens were checked against the vocabulary on
    // the host.
    unsafe { call.launch(config(grid(n)?, 1, 256), false) }
}

fn rms_norm(
    stream: &CudaStream,
    m: &Model<'_>,
    x: &CudaSlice<f32>,
    rows: Option<&CudaView<'_, i32>>,
    weight: &CudaSlice<f32>,
    out: &CudaSlice<f32>,
    count: usize,
) -> Result<(), DriverError> {
    let mut call = KernelCall::new(stream, &m.kernels.rms_norm);
    call.buffer(x);
    match rows {
        Some(rows) => call.buffer(rows),
        None => call.null(),
    };
    call.buffer(weight).buffer(out).int(m.dims.hidden as i32).float(m.dims.rms_eps);
    // SAFETY: rms_norm(const float* x, const int* rows, const float* weight, float* out,
    // int hidden, float eps); 256 threads, as NORM_THREADS; `count` rows.
    unsafe { call.launch(config(grid(count)?, 1, 256), m.options.dependent_launches) }
}

/// A product's input: `x`, or with `norm`, `x` normalized by those weights in the product.
#[derive(Clone, Copy, Debug)]
struct Normed<'a> {
    x: &'a CudaSlice<f32>,
    norm: Option<&'a CudaSlice<f32>>,
}

/// Which product of `matmul.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Product {
    /// `y (+)= w x`.
    Plain,
    /// `w` is the gate's rows then the up's: `y = silu(gate x) * (up x)`, half of `w`'s rows.
    SwiGlu,
}

#[allow(clippy::too_many_arguments, reason = "one launch's operands, each named at the call")]
fn matmul(
    stream: &CudaStream,
    m: &Model<'_>,
    product: Product,
    w: &DeviceMatrix,
    input: Normed<'_>,
    y: &CudaSlice<f32>,
    tokens: usize,
    accumulate: bool,
) -> Result<(), DriverError> {
    let out_rows = match product {
        Product::Plain => w.rows,
        Product::SwiGlu => w.rows / 2,
    };
    // Four warps a block (matmul.cu's WARPS), each `per_warp` output rows (its WIDE_OUT and
    // WIDE_SWIGLU_OUT when wide; the wide entry points have only the vector path, for rows a
    // multiple of 8 long).
    let wide =
        m.options.wide_products && tokens >= WIDE_PRODUCT_TOKENS_MIN && w.cols.is_multiple_of(8);
    let (kernels, per_warp) = match (product, wide) {
        (Product::Plain, false) => (&m.kernels.matmul, 1),
        (Product::SwiGlu, false) => (&m.kernels.matmul_swiglu, 1),
        (Product::Plain, true) => (&m.kernels.matmul_wide, 4),
        (Product::SwiGlu, true) => (&m.kernels.matmul_swiglu_wide, 2),
    };
    let cfg = config(grid(out_rows.div_ceil(4 * per_warp))?, 1, 128);
    let mut call = KernelCall::new(stream, for_type(kernels, &w.data));
    matrix(&mut call, &w.data);
    call.buffer(input.x);
    match input.norm {
        Some(norm) => call.buffer(norm),
        None => call.null(),
    };
    call.float(m.dims.rms_eps).buffer(y);
    call.int(out_rows as i32).int(w.cols as i32).int(tokens as i32);
    if product == Product::Plain {
        call.int(i32::from(accumulate));
    }
    // SAFETY: matmul_*(const T* w, const float* x, const float* norm, float eps, float* y,
    // int rows, int k_len, int tokens, int accumulate), or matmul_swiglu_* without `accumulate`
    // (and `w` of `2 * rows` rows); a block type's `w` is two pointers, its quants and scales,
    // rows of whole blocks (`DeviceBlocks`); `x` holds `tokens * cols`, `norm` (if not null)
    // `cols`, `y` `tokens * rows` (the buffers' sizes).
    unsafe { call.launch(cfg, m.options.dependent_launches) }
}

fn rope_kv_write(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &Buffers,
    layer: usize,
    bias: Option<&CudaSlice<f32>>,
    n: usize,
) -> Result<(), DriverError> {
    let d = &m.dims;
    let (keys, values) = layer_cache(m, layer);
    let mut call = KernelCall::new(stream, &m.kernels.rope_kv_write);
    call.buffer(&b.qkv);
    match bias {
        Some(bias) => call.buffer(bias),
        None => call.null(),
    };
    let [positions, token_rows, table_offsets, tables] = b.tables();
    call.buffer(&positions).buffer(&token_rows).buffer(&table_offsets).buffer(&tables);
    call.buffer(&keys).buffer(&values);
    match &m.weights.rope_freq_factors {
        Some(f) => call.buffer(f),
        None => call.null(),
    };
    call.float(d.theta_scale).int(i32::from(d.halves));
    call.int(d.heads as i32).int(d.kv_heads as i32).int(d.head_dim as i32);
    call.int(m.kv_layout.page_tokens as i32);
    // SAFETY: rope_kv_write's 15 parameters in order; page-table entries were checked against
    // the cache's pages on the host.
    unsafe { call.launch(config(grid(n)?, 1, 128), m.options.dependent_launches) }
}

/// Paged attention of the step's `n` tokens; with `rope` (the layer's Q/K/V bias, if any), the
/// entry point that folds `rope_kv_write` in, for a step of one token a row. With split
/// attention on and a step of few tokens, each token's splits go to blocks of their own and a
/// merge follows.
fn attention(
    stream: &CudaStream,
    m: &Model<'_>,
    b: &Buffers,
    layer: usize,
    n: usize,
    rope: Option<Option<&CudaSlice<f32>>>,
) -> Result<(), DriverError> {
    let d = &m.dims;
    let split = match m.partials {
        Some(partials) if n <= SPLIT_ATTENTION_TOKENS_MAX => {
            let blocks = split_blocks(n, d.heads, partials.max_splits);
            (blocks > 1).then_some((partials, blocks))
        }
        _ => None,
    };
    let (keys, values) = layer_cache(m, layer);
    let kernels = match (rope, split) {
        (None, None) => &m.kernels.paged_attention,
        (Some(_), None) => &m.kernels.paged_attention_rope,
        (None, Some(_)) => &m.kernels.paged_attention_split,
        (Some(_), Some(_)) => &m.kernels.paged_attention_rope_split,
    };
    let size_class = match d.head_dim {
        ..=64 => 0,
        65..=128 => 1,
        _ => 2,
    };
    let mut call = KernelCall::new(stream, &kernels[size_class]);
    call.buffer(&b.qkv).buffer(&b.attended);
    let [positions, token_rows, table_offsets, tables] = b.tables();
    call.buffer(&positions).buffer(&token_rows).buffer(&table_offsets).buffer(&tables);
    call.buffer(&keys).buffer(&values);
    call.int(d.heads as i32).int(d.kv_heads as i32).int(d.head_dim as i32);
    call.int(m.kv_layout.page_tokens as i32).int(d.window as i32).float(d.attention_scale);
    if let Some(bias) = rope {
        match bias {
            Some(bias) => call.buffer(bias),
            None => call.null(),
        };
        match &m.weights.rope_freq_factors {
            Some(f) => call.buffer(f),
            None => call.null(),
        };
        call.float(d.theta_scale).int(i32::from(d.halves));
        // The caches again, as the pointers it writes the token's key and value through.
        call.buffer(&keys).buffer(&values);
    }
    let mut cfg = config(grid(n)?, grid(d.heads)?, 128);
    if let Some((partials, blocks)) = split {
        call.buffer(&partials.acc).buffer(&partials.stats).int(partials.max_splits as i32);
        cfg.grid_dim.2 = grid(blocks)?;
    }
    // SAFETY: paged_attention_d*'s 14 parameters in order, or paged_attention_rope_d*'s 20
    // (the same, then bias, freq_factors, theta_scale, halves and the caches to write), either
    // followed by the partials' two pointers and their splits a (token, head) for the `_split`
    // entry points (partials of SPLIT_ATTENTION_TOKENS_MAX >= n tokens of `heads` heads); the
    // entry point for the head size (`Dims::of` refused more than 256); a block of
    // ATTENTION_WARPS (4) warps per (token, head, split block), heads on the grid's y (at most
    // 65,535 there; a model has far fewer heads). The folded one only for a step of one token
    // a row (its header says why that makes its cache writes race with no read).
    unsafe { call.launch(cfg, m.options.dependent_launches) }?;
    let Some((partials, _)) = split else {
        return Ok(());
    };
    let mut call = KernelCall::new(stream, &m.kernels.attention_merge[size_class]);
    call.buffer(&positions).buffer(&b.attended);
    call.int(d.heads as i32).int(d.head_dim as i32).int(d.window as i32);
    call.buffer(&partials.acc).buffer(&partials.stats).int(partials.max_splits as i32);
    // SAFETY: attention_merge_d*(const int* positions, float* out, int heads, int head_dim,
    // int window, float* partial_acc, float* partial_stats, int max_splits), the split entry
    // point's partials; one warp per (token, head).
    unsafe { call.launch(config(grid(n)?, grid(d.heads)?, 32), m.options.dependent_launches) }
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

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: Capacity = Capacity { tokens: 4, rows: 2, table_entries: 3, samples: 2 };

    #[test]
    fn a_step_s_inputs_pack_at_offsets_fixed_by_the_capacity() {
        assert_eq!(LAYOUT.input_len(), 4 * 3 + 2 + 3 + 2);
        assert_eq!(LAYOUT.input_span(Input::Tables), (14, 3));
        let mut out = Vec::new();
        LAYOUT.pack_inputs([&[1, 2], &[10, 11], &[0, 0], &[0], &[7, 8, 9], &[1]], &mut out);
        assert_eq!(out, [1, 2, 0, 0, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0, 7, 8, 9, 1]);
        // The next step's arrays start where they did; nothing of the last step's is left past
        // what this step uses.
        LAYOUT.pack_inputs([&[5], &[6], &[0], &[0], &[3], &[]], &mut out);
        assert_eq!(out, [5, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]);
    }

    #[test]
    #[should_panic(expected = "past its capacity")]
    fn an_array_past_its_capacity_is_refused() {
        LAYOUT.pack_inputs([&[1, 2, 3, 4, 5], &[], &[], &[], &[], &[]], &mut Vec::new());
    }
}
