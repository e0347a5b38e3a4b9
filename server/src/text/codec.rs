//! What the HTTP side needs of a model's text: encode, decode, and chat rendering.
//!
//! `ModelCodec` is a real model's tokenizer and template. `SyntheticCodec` serves models without
//! a tokenizer (the provenance model in the simulator, test executors): token `n` is the word
//! `t<n>`, so that completions with token-id prompts run through the very same HTTP app.

use std::sync::Arc;

use lockstep_core::model::{GrammarCompiler, SyntheticGrammars};
use lockstep_gpu::model::Model;
use serde_json::{Map, Value};

pub trait TextCodec: Send + Sync + std::fmt::Debug + 'static {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// As `encode`, without the special tokens the tokenizer adds (its BOS).
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Text of `ids`, special tokens left out.
    fn decode(&self, ids: &[u32]) -> Result<String, String>;
    /// OpenAI messages (and tools, and further template variables) through the chat template,
    /// ending as `end` says.
    fn encode_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        variables: &Map<String, Value>,
        end: ChatEnd<'_>,
    ) -> Result<ChatPrompt, String>;
    /// The chat template, if the model has one (the tool-call format is detected from it).
    fn chat_template(&self) -> Option<&str>;
    fn vocab_size(&self) -> u32;
    /// The text of one token, as OpenAI's log-probabilities show it.
    fn token_text(&self, id: u32) -> String;
    /// What compiles constrained requests' grammars over this vocabulary, or why there is none.
    fn grammars(&self) -> Result<Arc<dyn GrammarCompiler>, String>;
}

/// Where a rendered chat ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatEnd<'a> {
    /// In the assistant's turn, opened, with this written at its start (a forced call's
    /// opening; empty for a plain turn): what a chat request is answered from.
    AssistantTurn(&'a str),
    /// After the last message (the template's `add_generation_prompt` false): the conversation
    /// as it stands, which `/tokenize` can count.
    LastMessage,
}

/// A chat request's prompt: the text the template wrote (where a reasoning model's turn opens
/// or closes its thinking), and its tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
}

#[derive(Debug)]
pub struct ModelCodec(pub Arc<Model>);

impl TextCodec for ModelCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.0.tokenizer.encode(text)
    }

    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.0.tokenizer.encode_plain(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.0.tokenizer.decode(ids, false)
    }

    fn encode_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        variables: &Map<String, Value>,
        end: ChatEnd<'_>,
    ) -> Result<ChatPrompt, String> {
        let open_turn = matches!(end, ChatEnd::AssistantTurn(_));
        let mut text = self.0.render_chat_json(messages, tools, variables, open_turn)?;
        if let ChatEnd::AssistantTurn(prefix) = end {
            text.push_str(prefix);
        }
        Ok(ChatPrompt { tokens: self.0.encode_chat(&text)?, text })
    }

    fn chat_template(&self) -> Option<&str> {
        self.0.chat_template.as_deref()
    }

    fn vocab_size(&self) -> u32 {
        self.0.weights.config.vocab_size as u32
    }

    fn token_text(&self, id: u32) -> String {
        self.0.tokenizer.decode(&[id], true).unwrap_or_default()
    }

    fn grammars(&self) -> Result<Arc<dyn GrammarCompiler>, String> {
        Ok(self.0.grammars()?)
    }
}

/// Token `n` is the word `t<n>`; any other word is a token chosen by its hash.
#[derive(Debug)]
pub struct SyntheticCodec {
    vocab_size: u32,
}

impl SyntheticCodec {
    pub fn new(vocab_size: u32) -> SyntheticCodec {
        SyntheticCodec { vocab_size: vocab_size.max(1) }
    }

    fn word(&self, word: &str) -> u32 {
        match word.strip_prefix('t').and_then(|n| n.parse::<u32>().ok()) {
            Some(n) if n < self.vocab_size => n,
            _ => {
                // FNV-1a: stable across runs and platforms.
                let hash = word.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
                });
                (hash % u64::from(self.vocab_size)) as u32
            }
        }
    }
}

impl TextCodec for SyntheticCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.split_whitespace().map(|w| self.word(w)).collect())
    }

    /// The synthetic vocabulary has no special tokens: `encode`'s.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        Ok(ids.iter().map(|id| format!(" t{id}")).collect())
    }

    fn encode_chat(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        variables: &Map<String, Value>,
        end: ChatEnd<'_>,
    ) -> Result<ChatPrompt, String> {
        let mut text = String::new();
        if !variables.is_empty() {
            text.push_str(&format!("variables {} ", Value::from(variables.clone())));
        }
        if let Some(tools) = tools {
            text.push_str(&format!("tools {} ", Value::from(tools.to_vec())));
        }
        for m in messages {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
            let content = m.get("content").map(Value::to_string).unwrap_or_default();
            text.push_str(&format!("{role} {content} "));
        }
        if let ChatEnd::AssistantTurn(prefix) = end {
            text.push_str("assistant ");
            text.push_str(prefix);
        }
        Ok(ChatPrompt { tokens: self.encode(&text)?, text })
    }

    fn chat_template(&self) -> Option<&str> {
        None
    }

    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    fn token_text(&self, id: u32) -> String {
        format!(" t{id}")
    }

    /// The provenance model's: a mask over token ids that follows the output
    /// (`SyntheticGrammars`), so a grammar's hand-over meets the simulator's faults.
    fn grammars(&self) -> Result<Arc<dyn GrammarCompiler>, String> {
        Ok(Arc::new(SyntheticGrammars { vocab_size: self.vocab_size }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::Detokenizer;

    #[test]
    fn synthetic_words_round_trip_and_detokenize_incrementally() {
        let codec = SyntheticCodec::new(100);
        assert_eq!(codec.encode("t5 t99 t100").unwrap()[..2], [5, 99]);
        assert_eq!(codec.decode(&[5, 7]).unwrap(), " t5 t7");
        let mut d = Detokenizer::new();
        let text: String = [3, 4, 5].iter().map(|&t| d.push(&codec, t).unwrap()).collect();
        assert_eq!(text, " t3 t4 t5");
    }
}
