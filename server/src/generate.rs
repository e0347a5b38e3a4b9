//! `lockstep generate`: load a model (GGUF file or Hugging Face directory), optionally apply its
//! chat template, and stream a completion to standard output, through the scheduler and the
//! executor over paged KV that the server runs (the CPU's, or CUDA's with `--device cuda[:N]`).

use std::io::Write;
use std::path::PathBuf;

use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::kv::PoolConfig;
use lockstep_core::model::Executor;
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, SchedEvent, Scheduler, StepMode};
use lockstep_gpu::chat::Message;
use lockstep_gpu::launch_options::LaunchOptions;
use lockstep_gpu::llama::CpuExecutor;
use lockstep_gpu::model::Model;
use lockstep_gpu::sampling::{Sampling, SamplingSpec};

use crate::serve::Device;

#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub model: Option<PathBuf>,
    pub chat: bool,
    pub max_tokens: u32,
    pub prompt: String,
    /// Temperature, top-k, top-p and the seed.
    pub sampling: Sampling,
    /// Where the model runs (`--device`).
    pub device: Device,
    /// How CUDA launches a step (`--cuda-launch`).
    pub cuda_launch: LaunchOptions,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            model: None,
            chat: false,
            max_tokens: 128,
            prompt: String::new(),
            sampling: Sampling::GREEDY,
            device: Device::Cpu,
            cuda_launch: LaunchOptions::default(),
        };
        let mut prompt = None;
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value =
                |name: &str| args.next().cloned().ok_or_else(|| format!("{name} needs a value"));
            match flag.as_str() {
                "--model" => options.model = Some(PathBuf::from(value("--model")?)),
                "--chat" => options.chat = true,
                "--max-tokens" => {
                    options.max_tokens = number(&value("--max-tokens")?, "--max-tokens")?
                }
                "--temperature" => {
                    options.sampling.temperature =
                        number(&value("--temperature")?, "--temperature")?
                }
                "--top-k" => options.sampling.top_k = number(&value("--top-k")?, "--top-k")?,
                "--top-p" => options.sampling.top_p = number(&value("--top-p")?, "--top-p")?,
                "--seed" => options.sampling.seed = number(&value("--seed")?, "--seed")?,
                "--prompt" => prompt = Some(value("--prompt")?),
                "--device" => options.device = Device::parse(&value("--device")?)?,
                "--cuda-launch" => {
                    options.cuda_launch = LaunchOptions::parse(&value("--cuda-launch")?)?
                }
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        options.prompt = prompt.ok_or("--prompt is required")?;
        Ok(options)
    }
}

fn number<T: std::str::FromStr>(text: &str, name: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{name}: {text:?} is not a valid number"))
}

pub fn run(options: &Options) -> Result<(), String> {
    // Before the model loads: a machine without CUDA says so at once.
    options.device.check()?;
    let path = options.model.clone().unwrap_or_else(lockstep_gpu::default_model::path);
    if options.model.is_none() && !path.exists() {
        return Err(format!(
            "{}: no default model here (fetch it with ci/fetch-default-model.sh)",
            path.display()
        ));
    }
    let model = Model::load(&path).map_err(|e| e.to_string())?;
    let prompt = if options.chat {
        let messages = [Message { role: "user".into(), content: options.prompt.clone() }];
        model.encode_chat(&model.render_chat(&messages, true)?)?
    } else {
        model.tokenizer.encode(&options.prompt)?
    };
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    let config = engine_config(&model, prompt.len(), options.max_tokens)?;
    let mut sched = Scheduler::new(config.clone()).map_err(|e| e.to_string())?;
    let mut executor: Box<dyn Executor> = match options.device {
        Device::Cpu => {
            Box::new(CpuExecutor::new(model.weights.clone(), config.pool, config.running_max))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let launch = options.cuda_launch;
            Box::new(crate::serve::cuda_executor(model.weights.clone(), &config, n, launch)?)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return options.device.check(),
    };
    let id = RequestId(0);
    executor.start_request(id, SamplingSpec::for_prompt(options.sampling, &prompt));
    let request = NewRequest {
        id,
        prompt,
        max_tokens: options.max_tokens,
        stop_token_ids: vec![],
        ignore_eos: false,
        priority: 0,
        cache_salt: 0,
    };
    sched.submit(request, Time::ZERO).map_err(|e| e.to_string())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut generated = Vec::new();
    let mut printed = 0;
    while sched.requests_held() > 0 {
        // One request on a pool sized for it always has a step to run; no step would be a wedge.
        let plan = sched.plan_step(Time::ZERO).ok_or("the scheduler planned no step")?;
        let outputs = executor.execute(&plan).map_err(|e| e.to_string())?;
        sched.apply_outputs(&outputs, Time::ZERO).map_err(|e| e.to_string())?;
        while let Some(event) = sched.poll_event() {
            match event {
                SchedEvent::Token { token, .. } if model.stop_tokens.contains(&token) => {}
                SchedEvent::Token { token, .. } => {
                    generated.push(token);
                    // Print what the tokens so far decode to beyond what is out: a character
                    // split across tokens appears once whole.
                    let text = model.tokenizer.decode(&generated, false)?;
                    if text.len() > printed
                        && text.is_char_boundary(printed)
                        && !text.ends_with('\u{fffd}')
                    {
                        write!(out, "{}", &text[printed..])
                            .and_then(|()| out.flush())
                            .map_err(|e| e.to_string())?;
                        printed = text.len();
                    }
                }
                SchedEvent::Finished { request, .. } => executor.end_request(request),
                SchedEvent::Preempted { .. } | SchedEvent::PagesKept { .. } => {}
            }
        }
    }
    writeln!(out).map_err(|e| e.to_string())
}

/// A scheduler for one request of `prompt` tokens and up to `max_tokens` more: the same engine
/// the server runs, sized to the request. Refuses what the model's context cannot hold.
fn engine_config(model: &Model, prompt: usize, max_tokens: u32) -> Result<SchedConfig, String> {
    let context = model.weights.config.context_length;
    let total = prompt + max_tokens as usize;
    if total > context {
        return Err(format!(
            "{prompt} prompt tokens and --max-tokens {max_tokens} exceed the model's context of {context}"
        ));
    }
    let page_tokens = 16u32;
    let total = u32::try_from(total).map_err(|_| "the request is too long".to_owned())?;
    Ok(SchedConfig {
        pool: PoolConfig { pages_total: total.div_ceil(page_tokens) + 1, page_tokens, pins_max: 0 },
        mode: StepMode::Sync,
        waiting_max: 1,
        running_max: 1,
        step_tokens_max: 512,
        prefill_chunk_tokens_max: 512,
        scored_tokens_max: 512,
        request_tokens_max: total,
        capture_sizes: vec![1],
        eos_token_ids: model.stop_tokens.clone(),
        queue_wait_max: Duration::from_secs(3600),
        prefix_cache: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn options_parse_and_refuse_clearly() {
        let o = Options::parse(&args(&[
            "--chat",
            "--max-tokens",
            "8",
            "--prompt",
            "hi",
            "--temperature",
            "0.7",
            "--seed",
            "3",
        ]))
        .unwrap();
        assert!(o.chat);
        assert_eq!((o.max_tokens, o.prompt.as_str(), o.sampling.seed), (8, "hi", 3));
        assert_eq!(o.sampling.temperature, 0.7);
        assert_eq!(Options::parse(&args(&["--chat"])).unwrap_err(), "--prompt is required");
        assert!(
            Options::parse(&args(&["--max-tokens", "x", "--prompt", "a"]))
                .unwrap_err()
                .contains("not a valid number")
        );
        assert!(Options::parse(&args(&["--prompt"])).unwrap_err().contains("needs a value"));
        assert!(Options::parse(&args(&["--bogus"])).unwrap_err().contains("unknown option"));
        let cuda = Options::parse(&args(&["--device", "cuda:2", "--prompt", "a"])).unwrap();
        assert_eq!(cuda.device, Device::Cuda(2));
        assert!(Options::parse(&args(&["--device", "tpu"])).unwrap_err().contains("cuda:N"));
        let launch = Options::parse(&args(&["--cuda-launch", "all", "--prompt", "a"])).unwrap();
        assert_eq!(launch.cuda_launch, LaunchOptions::ALL);
        assert!(
            Options::parse(&args(&["--cuda-launch", "x", "--prompt", "a"]))
                .unwrap_err()
                .starts_with("--cuda-launch: ")
        );
    }

    #[test]
    fn cuda_without_a_driver_fails_before_loading_a_model() {
        #[cfg(feature = "cuda")]
        if lockstep_gpu::cuda::probe::driver_present() {
            return;
        }
        let options = Options::parse(&args(&[
            "--device",
            "cuda",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ]))
        .unwrap();
        let err = run(&options).unwrap_err();
        assert!(err.starts_with("--device cuda:0: ") && !err.contains("nonexistent"), "{err}");
    }
}
