//! `lockstep`: the serving engine's command line. `lockstep serve` runs the OpenAI-compatible
//! server; `lockstep generate` prints one completion; `lockstep bench-serve` replays a trace
//! against a running server. The disaggregated roles follow.

use std::process::ExitCode;

mod generate;

use lockstep_server::{bench_serve, serve};

const USAGE: &str = "\
usage: lockstep serve [options]        (lockstep serve --help lists them)
       lockstep bench-serve [options]  (lockstep bench-serve --help lists them)
       lockstep generate [--model PATH] [--chat] [--max-tokens N] [--temperature T]
                         [--top-k K] [--top-p P] [--seed S] [--device cpu|cuda[:N]]
                         [--cuda-launch OPTIONS] --prompt TEXT

  --model PATH    a GGUF file, or a Hugging Face model directory (config.json, safetensors,
                  tokenizer.json); default: the bundled SmolLM2-135M-Instruct, fetched by
                  ci/fetch-default-model.sh
  --chat          wrap the prompt in the model's chat template as a user message
  --max-tokens N  tokens to generate at most (default 128)
  --temperature   0 (the default) is greedy; with --top-k, --top-p and --seed to sample
  --device D      cpu (the default) or cuda[:N], the N-th NVIDIA GPU (0 by default)
  --cuda-launch O how CUDA launches a step (serve --help says more); none by default";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("generate") if args[1..].iter().any(|a| a == "--help" || a == "-h") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("serve") if args[1..].iter().any(|a| a == "--help" || a == "-h") => {
            println!("{}", serve::USAGE);
            return ExitCode::SUCCESS;
        }
        Some("bench-serve") if args[1..].iter().any(|a| a == "--help" || a == "-h") => {
            println!("{}", bench_serve::USAGE);
            return ExitCode::SUCCESS;
        }
        Some("serve") => serve::ServeOptions::parse(&args[1..])
            .and_then(serve::ServeOptions::with_key_from_env)
            .and_then(|o| serve::run(&o)),
        Some("bench-serve") => bench_serve::BenchOptions::parse(&args[1..])
            .and_then(bench_serve::BenchOptions::with_key_from_env)
            .and_then(|o| bench_serve::run(&o)),
        Some("generate") => {
            generate::Options::parse(&args[1..]).and_then(|options| generate::run(&options))
        }
        Some("--help" | "-h" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => Err(format!("unknown or missing command\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("lockstep: {message}");
            ExitCode::FAILURE
        }
    }
}
