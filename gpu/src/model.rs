//! A model ready to serve: weights, tokenizer, chat template and stop tokens, from a GGUF file or
//! a Hugging Face model directory (`config.json`, safetensors, `tokenizer.json`,
//! `tokenizer_config.json`), whichever `path` is.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use crate::chat::{self, Message};
use crate::gguf::{Gguf, MetadataValue};
use crate::grammar::GrammarCompiler;
use crate::llama::{LlamaWeights, LoadError, load_hf_dir};
use crate::tokenizer::Tokenizer;

#[derive(Debug)]
pub struct Model {
    /// Shared, so that an executor owning them can live in its own task or thread.
    pub weights: Arc<LlamaWeights>,
    pub tokenizer: Tokenizer,
    /// The Jinja chat template the model ships, if any.
    pub chat_template: Option<String>,
    /// Tokens that end a completion (end of sequence, end of turn), in increasing order.
    pub stop_tokens: Vec<u32>,
    /// Built at the first constrained request (a token trie of the vocabulary), then shared.
    grammars: OnceLock<Result<Arc<GrammarCompiler>, String>>,
}

impl Model {
    pub fn load(path: &Path) -> Result<Model, LoadError> {
        if path.is_dir() { Self::load_hf(path) } else { Self::load_gguf(path) }
    }

    fn load_gguf(path: &Path) -> Result<Model, LoadError> {
        let err = |what: String| LoadError::new(path, what);
        let file = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let gguf = Gguf::parse(&file).map_err(|e| err(e.to_string()))?;
        let tokenizer = Tokenizer::from_gguf(&gguf).map_err(err)?;
        let weights = LlamaWeights::from_gguf(&gguf, &file).map_err(err)?;
        let id = |key: &str| gguf.get_u64(key).map(|v| v as u32);
        let stop_tokens =
            sorted([id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.eot_token_id")]);
        let chat_template = match gguf.get("tokenizer.chat_template") {
            Some(MetadataValue::String(t)) => Some(t.clone()),
            _ => None,
        };
        Ok(Model {
            weights: Arc::new(weights),
            tokenizer,
            chat_template,
            stop_tokens,
            grammars: OnceLock::new(),
        })
    }

    fn load_hf(dir: &Path) -> Result<Model, LoadError> {
        let weights = load_hf_dir(dir)?;
        let json_file = |name: &str| -> Result<Option<Value>, LoadError> {
            let path = dir.join(name);
            match std::fs::read_to_string(&path) {
                Ok(text) => serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| LoadError::new(&path, e.to_string())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(LoadError::new(&path, e.to_string())),
            }
        };
        let config = json_file("tokenizer_config.json")?;
        let tokenizer_path = dir.join("tokenizer.json");
        let json = std::fs::read(&tokenizer_path)
            .map_err(|e| LoadError::new(&tokenizer_path, e.to_string()))?;
        let tokenizer = Tokenizer::from_hf(&json, config.as_ref())
            .map_err(|what| LoadError::new(&tokenizer_path, what))?;
        let chat_template = match chat_template(config.as_ref()) {
            Some(t) => Some(t),
            None => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        // generation_config.json's eos_token_id is what transformers stops on: one id or a list.
        let generation = json_file("generation_config.json")?;
        let mut stops: Vec<Option<u32>> = vec![tokenizer.eos];
        match generation.as_ref().and_then(|g| g.get("eos_token_id")) {
            Some(Value::Array(ids)) => {
                stops.extend(ids.iter().map(|v| v.as_u64().map(|v| v as u32)));
            }
            Some(v) => stops.push(v.as_u64().map(|v| v as u32)),
            None => {}
        }
        Ok(Model {
            weights: Arc::new(weights),
            tokenizer,
            chat_template,
            stop_tokens: sorted(stops),
            grammars: OnceLock::new(),
        })
    }

    /// The compiler of constrained requests' grammars over this model's vocabulary, built once.
    pub fn grammars(&self) -> Result<Arc<GrammarCompiler>, String> {
        let built = self
            .grammars
            .get_or_init(|| GrammarCompiler::new(&self.tokenizer, &self.stop_tokens).map(Arc::new));
        built.clone()
    }

    /// `messages` through the model's chat template, ending with the assistant's turn opened
    /// when `add_generation_prompt`.
    pub fn render_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self.chat_template.as_deref().ok_or("the model has no chat template")?;
        let (bos, eos) = self.bos_eos_text();
        chat::render(
            template,
            messages,
            add_generation_prompt,
            bos.as_deref().unwrap_or(""),
            eos.as_deref().unwrap_or(""),
        )
    }

    /// OpenAI-style `messages` and `tools` through the model's chat template, as
    /// `chat::render_json` renders them (tools the template does not read go into a Hermes
    /// system message) and further template `variables`, ending with the assistant's turn
    /// opened when `add_generation_prompt`.
    pub fn render_chat_json(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        variables: &serde_json::Map<String, Value>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self.chat_template.as_deref().ok_or("the model has no chat template")?;
        let (bos, eos) = self.bos_eos_text();
        chat::render_json(
            template,
            messages,
            tools,
            variables,
            add_generation_prompt,
            bos.as_deref().unwrap_or(""),
            eos.as_deref().unwrap_or(""),
        )
    }

    /// The text of the BOS and EOS tokens, which templates read as `bos_token` and `eos_token`.
    fn bos_eos_text(&self) -> (Option<String>, Option<String>) {
        let text = |id: Option<u32>| id.and_then(|id| self.tokenizer.token_text(id));
        (text(self.tokenizer.bos), text(self.tokenizer.eos))
    }
}

impl Model {
    /// Token ids of a rendered chat: BOS is added only if the template did not write it (most
    /// Llama templates open with `{{ bos_token }}`), so it is never doubled.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, String> {
        let mut ids = self.tokenizer.encode(rendered)?;
        let bos_text = self.tokenizer.bos.and_then(|id| self.tokenizer.token_text(id));
        if self.tokenizer.add_bos
            && let Some(bos) = bos_text
            && rendered.starts_with(&bos)
            && ids.len() >= 2
            && ids[0] == ids[1]
        {
            ids.remove(0);
        }
        Ok(ids)
    }
}

/// `chat_template` of tokenizer_config.json: a string, or a list of named templates of which
/// transformers takes "default".
fn chat_template(config: Option<&Value>) -> Option<String> {
    match config?.get("chat_template")? {
        Value::String(t) => Some(t.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

fn sorted(ids: impl IntoIterator<Item = Option<u32>>) -> Vec<u32> {
    let mut ids: Vec<u32> = ids.into_iter().flatten().collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}
