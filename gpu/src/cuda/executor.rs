//! `CudaExecutor`: scheduler plans on one NVIDIA GPU, over paged KV in device memory, sampling
//! through core's `RequestSampler` exactly as the CPU executor does.
//!
//! A step: the plan's page-table deltas are applied on the host (`PageTables`, as the CPU's), the
//! plan becomes flat arrays (`layout`), checked before anything is queued; the arrays are copied
//! into the step's fixed input buffers; the forward pass runs (`launch`), eagerly or as a
//! captured graph; then the argmax of every sampled row comes back, and the full logits of the
//! rows that need them (a sampler that is not greedy, or log-probabilities). A greedy row takes
//! the device's argmax, which is core's `argmax` to the bit (same comparisons, ties to the lowest
//! id), so it equals what the host sampler would pick from the same logits.
//!
//! Graphs: a decode-only step the scheduler put in a graph bucket (`Bucket::Graph`) runs as the
//! graph captured for its padded size (captured on first use, then replayed), with padding rows
//! on the scratch page; anything else, or a size past `graph_rows_max`, runs eagerly. Buffer
//! policy (the trtllm#15546 class, a replay reading inputs the host already overwrote): every
//! step ends by waiting for the stream (copying its results to pageable host memory waits for
//! it; a step with nothing to copy synchronizes), so no replay is in flight when the next step
//! writes the input buffers, whose copies also queue behind it on the same stream; and the
//! buffers a graph captured are never freed or moved while it exists (growing them drops every
//! graph first).
//!
//! `release_pages` is ignored, as the CPU executor does: a freed page is rewritten before any
//! correct plan reads it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags_enum, CUstreamCaptureMode_enum};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DriverError};
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{
    ExecError, Executor, GrammarCompiler, PageStore, RequestSampler, SamplingSpec, TokenLogprobs,
    record_outputs,
};
use lockstep_core::sched::{
    PageTables, PromptLogprobs, RecentSamples, RequestId, StepOutputs, StepPlan,
};
use lockstep_core::wire::KvLayout;

use super::kernel_cache::KernelCache;
use super::kernels::KernelSource;
use super::launch::{
    self, Buffers, Capacity, Dims, KernelImages, KernelOrigins, Kernels, Shape, SplitPartials,
};
pub use super::launch::{
    FOLDED_NORM_TOKENS_MAX, LaunchOptions, SPLIT_ATTENTION_TOKENS_MAX, WIDE_PRODUCT_TOKENS_MIN,
};
use super::layout::{self, KvCacheLayout, Limits, Part, StepArrays};
use super::nvrtc;
use super::probe::{self, DeviceInfo};
use super::weights::{self, DeviceWeights};
use crate::llama::LlamaWeights;

/// Which device, and how steps run on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    pub ordinal: usize,
    /// The largest padded size run as a captured graph; 0 runs every step eagerly.
    pub graph_rows_max: usize,
    /// How the forward pass is launched (`LaunchOptions`: programmatic dependent launches,
    /// norms folded into the products, wide products). All off by default until a device run
    /// has measured them (BENCHMARKS.md); the bits are the same either way, which
    /// `tests/cuda_device.rs` checks. Dependent launches need compute capability 9.0 and are
    /// ignored below it.
    pub launch: LaunchOptions,
    /// Where NVRTC's output is kept between runs (`KernelCache::from_env` is the server's);
    /// none compiles every kernel at every start.
    pub kernel_cache: Option<KernelCache>,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            ordinal: 0,
            graph_rows_max: 512,
            launch: LaunchOptions::default(),
            kernel_cache: None,
        }
    }
}

/// A captured graph. cudarc's `CudaGraph` is not `Send` because CUDA graphs are not internally
/// synchronized; the executor owns its graphs and uses them only through `&mut self`, from one
/// thread at a time, which is the serialization CUDA asks for.
struct Captured(CudaGraph);

#[allow(unsafe_code)]
// SAFETY: see `Captured`: never shared, only moved with the executor that owns it.
unsafe impl Send for Captured {}

impl std::fmt::Debug for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Captured")
    }
}

/// The entry points of one kernel source in its `functions` order, for a test that launches a
/// kernel on inputs of its own: loaded into `context` as an executor on device `ordinal` loads
/// them, compiled by NVRTC for the device or, with `prebuilt`, its cubin in that folder.
pub fn kernel_functions(
    context: &Arc<CudaContext>,
    ordinal: usize,
    source: &KernelSource,
    prebuilt: Option<&Path>,
) -> Result<Vec<CudaFunction>, String> {
    let device = probe::probe_device(ordinal).map_err(|e| e.to_string())?;
    launch::load_functions(context, kernel_images(&device, prebuilt, None)?, source)
}

/// Where `device`'s kernels come from: the cubins for its architecture in `prebuilt`, or NVRTC
/// (through `cache` where there is one).
fn kernel_images<'a>(
    device: &DeviceInfo,
    prebuilt: Option<&'a Path>,
    cache: Option<&'a KernelCache>,
) -> Result<KernelImages<'a>, String> {
    let (major, minor) = device.compute_capability;
    Ok(match prebuilt {
        None => KernelImages::Nvrtc {
            target: nvrtc::choose_target((major, minor), &nvrtc::supported_archs()?)?,
            cache,
        },
        Some(dir) => {
            let sm = u32::try_from(major * 10 + minor).map_err(|_| "a negative capability")?;
            KernelImages::Prebuilt { dir, sm }
        }
    })
}

/// Executes plans on a CUDA device over paged KV.
#[derive(Debug)]
pub struct CudaExecutor {
    device: DeviceInfo,
    weights: Arc<LlamaWeights>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    kernel_origins: KernelOrigins,
    device_weights: DeviceWeights,
    dims: Dims,
    kv: CudaSlice<u16>,
    kv_layout: KvCacheLayout,
    limits: Limits,
    buffers: Buffers,
    /// The host side of `buffers.inputs`, kept between steps.
    staging: Vec<i32>,
    graphs: BTreeMap<usize, Captured>,
    graph_rows_max: usize,
    launch_options: LaunchOptions,
    /// Split attention's partial states, while `launch_options.split_attention` is on.
    split_partials: Option<SplitPartials>,
    /// The most positions a row can hold: the model's context, or the pool's, the lesser.
    row_positions_max: usize,
    tables: PageTables,
    recent: RecentSamples,
    samplers: BTreeMap<RequestId, RequestSampler>,
    /// What compiles the grammars of constrained requests (`with_grammars`); without it a
    /// request with a grammar fails at its first draw.
    grammars: Option<Arc<dyn GrammarCompiler>>,
    /// Steps run eagerly and as graph replays, for tests and benchmarks.
    pub steps_eager: u64,
    pub steps_replayed: u64,
}

fn driver(what: &'static str) -> impl Fn(DriverError) -> String {
    move |e| format!("CUDA {what}: {e}")
}

impl CudaExecutor {
    /// Probes the device (a clean error when there is no driver, device or NVRTC), compiles the
    /// kernels for its architecture, uploads the weights and allocates the KV cache for `pool`
    /// plus one scratch page.
    pub fn new(
        weights: Arc<LlamaWeights>,
        pool: PoolConfig,
        slots: u32,
        options: CudaOptions,
    ) -> Result<CudaExecutor, String> {
        Self::with_prebuilt(weights, pool, slots, options, None)
    }

    /// As `new`; with `prebuilt`, the kernels are the cubins for the device's architecture in
    /// that folder (compiled ahead of time, so a machine without NVRTC runs them) instead of
    /// NVRTC's.
    pub fn with_prebuilt(
        weights: Arc<LlamaWeights>,
        pool: PoolConfig,
        slots: u32,
        options: CudaOptions,
        prebuilt: Option<&Path>,
    ) -> Result<CudaExecutor, String> {
        let device = match prebuilt {
            None => probe::probe(options.ordinal),
            Some(_) => probe::probe_device(options.ordinal),
        }
        .map_err(|e| e.to_string())?;
        let c = &weights.config;
        let dims = Dims::of(c)?;
        let context = CudaContext::new(options.ordinal).map_err(driver("context"))?;
        // One stream, so cudarc's cross-stream event tracking has nothing to order; without it
        // no event is recorded inside a graph capture.
        #[allow(unsafe_code)]
        // SAFETY: every slice is created after this and used on the one stream below.
        unsafe {
            context.disable_event_tracking()
        };
        let stream = context.new_stream().map_err(driver("stream"))?;
        let images = kernel_images(&device, prebuilt, options.kernel_cache.as_ref())?;
        let (kernels, kernel_origins) = Kernels::load(&context, images)?;
        let device_weights = weights::upload(&weights, &stream, options.launch.block_weights)?;
        let page_tokens = pool.page_tokens as usize;
        let kv_layout = KvCacheLayout::new(
            c.layers,
            pool.pages_total as usize,
            page_tokens,
            c.kv_heads,
            c.head_dim,
        );
        let kv = stream.alloc_zeros::<u16>(kv_layout.total_elements()).map_err(|e| {
            let hint = weights::out_of_memory_hint(&weights, options.launch.block_weights, &e);
            format!("CUDA: allocating {} bytes of KV cache: {e}{hint}", kv_layout.total_bytes())
        })?;
        let rows = (slots as usize).max(1);
        let capacity = Capacity {
            tokens: rows.max(options.graph_rows_max).max(256),
            rows: rows.max(options.graph_rows_max),
            table_entries: 4096,
            samples: rows.max(options.graph_rows_max),
        };
        let buffers = Buffers::new(&stream, &dims, capacity).map_err(driver("buffers"))?;
        let row_positions_max = c.context_length.min(pool.pages_total as usize * page_tokens);
        let limits = Limits {
            vocab_size: c.vocab_size,
            page_tokens,
            pages_total: pool.pages_total as usize,
            sliding_window: c.sliding_window,
        };
        let mut executor = CudaExecutor {
            device,
            weights,
            stream,
            kernels,
            kernel_origins,
            device_weights,
            dims,
            kv,
            kv_layout,
            limits,
            buffers,
            staging: Vec::new(),
            graphs: BTreeMap::new(),
            graph_rows_max: options.graph_rows_max,
            launch_options: LaunchOptions::default(),
            split_partials: None,
            row_positions_max,
            tables: PageTables::new(slots),
            recent: RecentSamples::default(),
            samplers: BTreeMap::new(),
            grammars: None,
            steps_eager: 0,
            steps_replayed: 0,
        };
        executor.set_launch_options(options.launch)?;
        Ok(executor)
    }

    /// This executor, compiling requests' grammars with `grammars` (the model's).
    pub fn with_grammars(self, grammars: Arc<dyn GrammarCompiler>) -> CudaExecutor {
        CudaExecutor { grammars: Some(grammars), ..self }
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.device
    }

    /// How the kernel modules were found at start: compiled, from the kernel cache, or
    /// prebuilt; and any trouble with the cache.
    pub fn kernel_origins(&self) -> &KernelOrigins {
        &self.kernel_origins
    }

    /// Device memory the weights take.
    pub fn weight_bytes(&self) -> usize {
        self.device_weights.bytes
    }

    /// How this executor lays out a page's KV: the CPU executor's layout, so pages move between
    /// CPU and CUDA workers.
    pub fn kv_layout(&self) -> KvLayout {
        let c = &self.weights.config;
        KvLayout {
            layers: c.layers as u32,
            kv_heads: c.kv_heads as u32,
            head_dim: c.head_dim as u32,
            element_bytes: 2,
        }
    }

    /// Runs a step; returns the outputs and, per sampling row, the logits sampled from (all of
    /// them copied back: for tests and checks; `execute` copies only what sampling needs).
    pub fn execute_with_logits(
        &mut self,
        plan: &StepPlan,
    ) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        self.step(plan, true)
    }

    fn step(
        &mut self,
        plan: &StepPlan,
        all_logits: bool,
    ) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        for row in plan.rows.iter().filter(|r| r.sample) {
            if !self.samplers.contains_key(&row.request) {
                return Err(format!("{}: a sampling row of a request never started", row.request));
            }
        }
        self.tables.apply(plan)?;
        record_outputs(&mut self.samplers, plan, &self.recent)?;
        let (tables, recent) = (&self.tables, &self.recent);
        let mut arrays = StepArrays::build(
            plan,
            |slot| tables.table(slot),
            |input| recent.resolve(input),
            self.limits,
        )?;
        let real_samples = arrays.sample_rows.len();
        let samplers = &self.samplers;
        let scored = arrays.add_scored(plan, |row| match samplers.get(&row.request) {
            Some(sampler) => sampler.scored_positions(row.positions.clone()),
            None => 0..0,
        })?;
        let graph = layout::graph_rows(plan, &arrays, self.graph_rows_max);
        if let Some(rows) = graph {
            arrays.pad_to(rows, self.limits)?;
        }
        self.ensure_capacity(&arrays)?;
        self.write_inputs(&arrays).map_err(driver("copying a step's inputs"))?;
        let shape = Shape {
            tokens: arrays.token_count(),
            rows: arrays.row_count(),
            samples: arrays.sample_tokens.len(),
        };
        match graph {
            Some(rows) => self.replay(rows, shape)?,
            None => {
                launch::forward(&self.stream, &self.model(), &self.buffers, shape)
                    .map_err(driver("launching a step"))?;
                self.steps_eager += 1;
            }
        }
        self.finish(plan, &arrays.sample_rows[..real_samples], &scored, all_logits)
    }

    /// Switches the launch options for the steps from now on, dropping the graphs captured
    /// with the old ones; a benchmark compares them on one executor. Switching `block_weights`
    /// uploads the weights again (the new upload first: on an error the old one stays, with
    /// the old options). No step is in flight between steps (`step` waits for the stream).
    pub fn set_launch_options(&mut self, options: LaunchOptions) -> Result<(), String> {
        self.graphs.clear();
        let new_partials = match (options.split_attention, &self.split_partials) {
            (true, None) => {
                let partials = SplitPartials::new(&self.stream, &self.dims, self.row_positions_max);
                Some(partials.map_err(driver("allocating split attention's partials"))?)
            }
            _ => None,
        };
        if options.block_weights != self.device_weights.blocks {
            self.device_weights =
                weights::upload(&self.weights, &self.stream, options.block_weights)?;
        }
        if !options.split_attention {
            self.split_partials = None;
        } else if new_partials.is_some() {
            self.split_partials = new_partials;
        }
        // `griddepcontrol` is sm_90's; the kernels compile it out below.
        let dependent_launches =
            options.dependent_launches && self.device.compute_capability.0 >= 9;
        self.launch_options = LaunchOptions { dependent_launches, ..options };
        Ok(())
    }

    fn model(&self) -> launch::Model<'_> {
        launch::Model {
            kernels: &self.kernels,
            weights: &self.device_weights,
            dims: self.dims,
            kv: &self.kv,
            kv_layout: self.kv_layout,
            options: self.launch_options,
            partials: self.split_partials.as_ref(),
        }
    }

    /// Grows the buffers when `arrays` does not fit; the graphs read the old ones, so they go
    /// first.
    fn ensure_capacity(&mut self, arrays: &StepArrays) -> Result<(), String> {
        let need = Capacity {
            tokens: arrays.token_count(),
            rows: arrays.row_count(),
            table_entries: arrays.tables.len(),
            samples: arrays.sample_tokens.len(),
        };
        if self.buffers.capacity.holds(&need) {
            return Ok(());
        }
        self.graphs.clear();
        self.stream.synchronize().map_err(driver("synchronize"))?;
        let grown = self.buffers.capacity.grown_to(&need);
        self.buffers = Buffers::new(&self.stream, &self.dims, grown).map_err(driver("buffers"))?;
        Ok(())
    }

    /// The step's input arrays in one copy (each copy from pageable memory costs the driver a
    /// staging round of its own).
    fn write_inputs(&mut self, a: &StepArrays) -> Result<(), DriverError> {
        let arrays = [
            &a.tokens[..],
            &a.positions,
            &a.token_rows,
            &a.table_offsets,
            &a.tables,
            &a.sample_tokens,
        ];
        self.buffers.capacity.pack_inputs(arrays, &mut self.staging);
        self.stream.memcpy_htod(&self.staging, &mut self.buffers.inputs)
    }

    /// Replays the graph of `rows` rows, capturing it first if this is its first use.
    fn replay(&mut self, rows: usize, shape: Shape) -> Result<(), String> {
        if !self.graphs.contains_key(&rows) {
            let graph = self.capture(shape)?;
            self.graphs.insert(rows, Captured(graph));
        }
        let graph = &self.graphs[&rows].0;
        graph.launch().map_err(driver("replaying a graph"))?;
        self.steps_replayed += 1;
        Ok(())
    }

    fn capture(&self, shape: Shape) -> Result<CudaGraph, String> {
        let mode = CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(mode).map_err(driver("beginning a capture"))?;
        let launched = launch::forward(&self.stream, &self.model(), &self.buffers, shape);
        // The capture ends whatever happened, or the stream stays in capture mode.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags_enum(0));
        launched.map_err(driver("capturing a step"))?;
        graph.map_err(driver("instantiating a graph"))?.ok_or_else(|| "CUDA: an empty graph".into())
    }

    /// Copies back the sampled rows' argmax (and logits where needed), samples, records; then
    /// the logits of the positions that score prompt tokens (`scored`, from
    /// `StepArrays::add_scored`), after the sampled rows'.
    fn finish(
        &mut self,
        plan: &StepPlan,
        sample_rows: &[usize],
        scored: &[(usize, u32, usize)],
        all_logits: bool,
    ) -> Result<(StepOutputs, Vec<Vec<f32>>), String> {
        let s = sample_rows.len();
        let mut argmax = vec![0i32; s];
        if s > 0 {
            self.stream
                .memcpy_dtoh(&self.buffers.argmax.slice(0..s), &mut argmax)
                .map_err(driver("copying sampled tokens"))?;
        } else {
            // Nothing to copy back: wait anyway, so a step is done (or its error known) when
            // `execute` returns, graph or not.
            self.stream.synchronize().map_err(driver("a step"))?;
        }
        let vocab = self.dims.vocab;
        let mut sampled = Vec::with_capacity(s);
        let mut row_logprobs: Vec<Option<TokenLogprobs>> = Vec::with_capacity(s);
        let mut logits_out = Vec::new();
        for (i, &r) in sample_rows.iter().enumerate() {
            let row = &plan.rows[r];
            let sampler = self.samplers.get_mut(&row.request).ok_or("a request never started")?;
            let logits = match all_logits || sampler.needs_logits() {
                true => {
                    let mut l = vec![0f32; vocab];
                    let view = self.buffers.logits.slice(i * vocab..(i + 1) * vocab);
                    self.stream.memcpy_dtoh(&view, &mut l).map_err(driver("copying logits"))?;
                    Some(l)
                }
                false => None,
            };
            // Greedy without penalties or log-probabilities: the device's argmax, the same
            // token (`argmax`'s ties go to the lower id there too).
            let (token, lp) = match (&logits, sampler.needs_logits()) {
                (Some(l), true) => sampler
                    .sample(l, row.positions.end)
                    .map_err(|e| format!("{}: {e}", row.request))?,
                _ => (u32::try_from(argmax[i]).map_err(|_| "CUDA: a negative argmax")?, None),
            };
            sampled.push(token);
            row_logprobs.push(lp);
            if all_logits {
                logits_out.push(logits.unwrap_or_default());
            }
        }
        let mut by_row = vec![None; plan.rows.len()];
        for (&r, &token) in sample_rows.iter().zip(&sampled) {
            by_row[r] = Some(token);
        }
        self.recent.record(plan.step, by_row);
        if row_logprobs.iter().all(Option::is_none) {
            row_logprobs.clear();
        }
        let prompt_logprobs = self.prompt_logprobs(plan, s, scored)?;
        let outputs =
            StepOutputs { step: plan.step, sampled, logprobs: row_logprobs, prompt_logprobs };
        Ok((outputs, logits_out))
    }

    /// The scored rows' log-probabilities of their prompt tokens, from the logits the step
    /// left after the `sampled` rows' (one copy a row).
    fn prompt_logprobs(
        &self,
        plan: &StepPlan,
        sampled: usize,
        scored: &[(usize, u32, usize)],
    ) -> Result<Vec<PromptLogprobs>, String> {
        let vocab = self.dims.vocab;
        let mut at = sampled;
        let mut out = Vec::with_capacity(scored.len());
        for &(r, first, count) in scored {
            let row = &plan.rows[r];
            let sampler = self.samplers.get(&row.request).ok_or("a request never started")?;
            let mut logits = vec![0f32; count * vocab];
            let view = self.buffers.logits.slice(at * vocab..(at + count) * vocab);
            self.stream.memcpy_dtoh(&view, &mut logits).map_err(driver("copying logits"))?;
            at += count;
            out.push(sampler.score_positions(row.request, first, logits.chunks_exact(vocab))?);
        }
        Ok(out)
    }

    fn check_page(&self, page: u32) -> Result<usize, ExecError> {
        let page = page as usize;
        match page < self.limits.pages_total {
            true => Ok(page),
            false => Err(ExecError(format!(
                "page {page} is outside the pool of {}",
                self.limits.pages_total
            ))),
        }
    }
}

impl Executor for CudaExecutor {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        let sampler = RequestSampler::new(spec, self.grammars.as_deref());
        self.samplers.insert(request, sampler);
    }

    fn end_request(&mut self, request: RequestId) {
        self.samplers.remove(&request);
    }

    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutputs, ExecError> {
        self.step(plan, false).map(|(outputs, _)| outputs).map_err(ExecError)
    }
}

/// Pages in the CPU executor's byte order (`KvCacheLayout`): `2 * layers` contiguous copies.
/// Copies run on the executor's stream, so a read after a step sees its writes and a write
/// lands before the next step reads it.
impl PageStore for CudaExecutor {
    fn page_bytes(&self) -> usize {
        self.kv_layout.page_bytes()
    }

    fn read_page(&self, page: u32, out: &mut Vec<u8>) -> Result<(), ExecError> {
        let page = self.check_page(page)?;
        let l = self.kv_layout;
        let mut part = vec![0u16; l.page_elements()];
        for layer in 0..l.layers {
            for p in [Part::Keys, Part::Values] {
                let at = l.page_offset(layer, p, page);
                self.stream
                    .memcpy_dtoh(&self.kv.slice(at..at + l.page_elements()), &mut part)
                    .map_err(|e| ExecError(format!("CUDA: reading page {page}: {e}")))?;
                out.extend(part.iter().flat_map(|h| h.to_le_bytes()));
            }
        }
        Ok(())
    }

    fn write_page(&mut self, page: u32, data: &[u8]) -> Result<(), ExecError> {
        let page = self.check_page(page)?;
        if data.len() != self.page_bytes() {
            return Err(ExecError(format!(
                "a page write of {} bytes, a page is {}",
                data.len(),
                self.page_bytes()
            )));
        }
        let l = self.kv_layout;
        let halves: Vec<u16> =
            data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        for (i, chunk) in halves.chunks_exact(l.page_elements()).enumerate() {
            let (layer, p) = (i / 2, if i % 2 == 0 { Part::Keys } else { Part::Values });
            let at = l.page_offset(layer, p, page);
            let mut view = self.kv.slice_mut(at..at + l.page_elements());
            self.stream
                .memcpy_htod(chunk, &mut view)
                .map_err(|e| ExecError(format!("CUDA: writing page {page}: {e}")))?;
        }
        Ok(())
    }
}
