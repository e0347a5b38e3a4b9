//! `lockstep generate`: load a model, optionally apply its chat template, and stream a completion
//! to standard output.

use std::io::Write;
use std::path::PathBuf;

use lockstep_gpu::chat::{self, Message};
use lockstep_gpu::gguf::Gguf;
use lockstep_gpu::llama::{LlamaWeights, Sequence};
use lockstep_gpu::sampling::{Sampler, SamplingParams};
use lockstep_gpu::tokenizer::Tokenizer;

#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub model: Option<PathBuf>,
    pub chat: bool,
    pub max_tokens: u32,
    pub prompt: String,
    pub sampling: SamplingParams,
    pub seed: u64,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            model: None,
            chat: false,
            max_tokens: 128,
            prompt: String::new(),
            sampling: SamplingParams::GREEDY,
            seed: 0,
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
                "--seed" => options.seed = number(&value("--seed")?, "--seed")?,
                "--prompt" => prompt = Some(value("--prompt")?),
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
    let path = options.model.clone().unwrap_or_else(lockstep_gpu::default_model::path);
    let file = std::fs::read(&path).map_err(|e| {
        let hint = if options.model.is_none() {
            " (fetch the default model with ci/fetch-default-model.sh)"
        } else {
            ""
        };
        format!("{}: {e}{hint}", path.display())
    })?;
    let gguf = Gguf::parse(&file).map_err(|e| format!("{}: {e}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| format!("{}: {e}", path.display()))?;
    let weights =
        LlamaWeights::from_gguf(&gguf, &file).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = if options.chat {
        let template = gguf
            .get_str("tokenizer.chat_template")
            .ok_or_else(|| format!("{}: no chat template", path.display()))?;
        let messages = [Message { role: "user".into(), content: options.prompt.clone() }];
        chat::render(template, &messages, true, "", "")?
    } else {
        options.prompt.clone()
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    let mut sequence = Sequence::new(&weights.config);
    let mut logits = Vec::new();
    for &token in &prompt {
        logits = sequence.forward(&weights, token);
    }
    let mut sampler = Sampler::new(options.sampling, options.seed, 0);
    let mut generated = Vec::new();
    let mut printed = 0;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for _ in 0..options.max_tokens {
        let token = sampler.sample(&logits);
        if Some(token) == tokenizer.eos {
            break;
        }
        generated.push(token);
        // Print what the tokens so far decode to beyond what is out: a character split across
        // tokens appears once whole.
        let text = tokenizer.decode(&generated, false)?;
        if text.len() > printed && text.is_char_boundary(printed) && !text.ends_with('\u{fffd}') {
            write!(out, "{}", &text[printed..])
                .and_then(|()| out.flush())
                .map_err(|e| e.to_string())?;
            printed = text.len();
        }
        logits = sequence.forward(&weights, token);
    }
    writeln!(out).map_err(|e| e.to_string())
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
        assert_eq!((o.max_tokens, o.prompt.as_str(), o.seed), (8, "hi", 3));
        assert_eq!(o.sampling.temperature, 0.7);
        assert_eq!(Options::parse(&args(&["--chat"])).unwrap_err(), "--prompt is required");
        assert!(
            Options::parse(&args(&["--max-tokens", "x", "--prompt", "a"]))
                .unwrap_err()
                .contains("not a valid number")
        );
        assert!(Options::parse(&args(&["--prompt"])).unwrap_err().contains("needs a value"));
        assert!(Options::parse(&args(&["--bogus"])).unwrap_err().contains("unknown option"));
    }
}
