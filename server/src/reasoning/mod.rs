//! Reasoning ("thinking") in a chat completion's text: which markers a model writes around it,
//! whether its turn opens inside it, and the text split into reasoning and content, streamed or
//! whole, so that a client gets `reasoning_content` apart from the answer (and tool calls are
//! read from the answer alone).
//!
//! The rules per model family are reasoning-parser's (the SMG project's, tool-parser's
//! sibling): which markers, whether a model starts inside its thinking (DeepSeek R1,
//! Qwen 3 Thinking), a second opening marker inside the thinking kept as text, a closing marker
//! outside it kept as text. `cut` hands its parser every marker as a piece of its own: fed
//! arbitrary chunks, its streaming parser depends on where they fall (reasoning-parser 1.10:
//! `"</thi"` then `"nk>"` comes out as reasoning, `"x<think>a"` in one chunk puts the `x` in
//! the reasoning too, where `"x"` then `"<think>a"` makes it content). With markers cut out the
//! split is the same however the text arrives, and the whole text is one push.
//!
//! Where a turn starts is read from the prompt the template wrote: a prompt ending in an open
//! thinking marker (DeepSeek R1's and V3.1's thinking mode, Qwen 3 Thinking) starts inside it,
//! one ending in a closed block (Qwen 3 with `enable_thinking: false`, DeepSeek V3.1 without
//! `thinking`) has no reasoning to find, and otherwise the parser's own rule holds. A request's
//! grammar holds what follows the thinking (`grammar::after_thinking`), so a reasoning model asked
//! for JSON or calls still thinks first.

mod cut;
mod grammar;
mod stream;
#[cfg(test)]
mod tests;

pub use grammar::{Thinking, after_thinking};
pub use stream::{ReasoningStream, join_deltas, split_whole};

/// A model family's reasoning markers, by reasoning-parser's name for its parser.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReasoningFormat {
    /// The name `--reasoning-parser` takes: reasoning-parser's registry name.
    pub name: &'static str,
    /// Opens the reasoning.
    pub start: &'static str,
    /// Ends it; what follows is the answer.
    pub end: &'static str,
    /// A tool block's opener that also ends the reasoning, kept in the content for the tool-call
    /// parser: DeepSeek V4.1 may go from its thinking straight into its calls. Everything after
    /// it is content, markers included.
    pub tool_block: Option<&'static str>,
}

const THINK: (&str, &str) = ("<think>", "</think>");

/// DeepSeek V4.1's tool block opener.
const DSML_V41_BLOCK: &str = reasoning_parser::parsers::deepseek_v41::TOOL_BLOCK_START;

impl ReasoningFormat {
    /// reasoning-parser's parsers whose rules are two markers, or two and DeepSeek V4.1's tool
    /// block, and those markers (checked against the crate by a test). Its parsers with states of
    /// their own beyond those (Gemma 4's channels, Kimi K3, MiniMax M3, Hunyuan V4, Inkling) are
    /// not served: `cut` would have to know every marker they act on.
    ///
    /// DeepSeek V4.1's rules differ from the two-marker families' in more than its third marker:
    /// a `</think>` outside the thinking is dropped (not content), a `<think>` inside it is
    /// dropped (not reasoning), and after the answer a new `<think>` opens reasoning again.
    pub const ALL: [ReasoningFormat; 14] = [
        ReasoningFormat {
            name: "deepseek_v41",
            start: THINK.0,
            end: THINK.1,
            tool_block: Some(DSML_V41_BLOCK),
        },
        ReasoningFormat::think("deepseek_r1"),
        ReasoningFormat::think("deepseek_v31"),
        ReasoningFormat::think("deepseek_v4"),
        ReasoningFormat::think("qwen3"),
        ReasoningFormat::think("qwen3_thinking"),
        ReasoningFormat::think("glm45"),
        ReasoningFormat::think("kimi_k25"),
        ReasoningFormat::think("kimi_thinking"),
        ReasoningFormat::think("minimax"),
        ReasoningFormat::think("step3"),
        ReasoningFormat::think("nano_v3"),
        ReasoningFormat {
            name: "kimi", start: "◁think▷", end: "◁/think▷", tool_block: None
        },
        ReasoningFormat {
            name: "cohere_cmd",
            start: "<|START_THINKING|>",
            end: "<|END_THINKING|>",
            tool_block: None,
        },
    ];

    const fn think(name: &'static str) -> ReasoningFormat {
        ReasoningFormat { name, start: THINK.0, end: THINK.1, tool_block: None }
    }

    /// Every marker the format's parser acts on.
    pub fn markers(self) -> Vec<&'static str> {
        [Some(self.start), Some(self.end), self.tool_block].into_iter().flatten().collect()
    }

    /// The format a `--reasoning-parser` name stands for; the error lists the valid names.
    pub fn from_name(name: &str) -> Result<ReasoningFormat, String> {
        ReasoningFormat::ALL.into_iter().find(|f| f.name == name).ok_or_else(|| {
            let names: Vec<&str> = ReasoningFormat::ALL.iter().map(|f| f.name).collect();
            format!(
                "unknown reasoning parser {name:?}: expected none or one of {}",
                names.join(", ")
            )
        })
    }

    /// Chosen from a chat template by the markers it writes; None when it writes none. A
    /// template with `<think>` and DeepSeek V4.1's tool block gets V4.1's rules; one with
    /// `<think>` alone gets Qwen 3's (reasoning only after an opening marker, in the output or
    /// at the end of the prompt), which read every `<think>` family whose template opens the
    /// thinking itself; a model that starts thinking without one (the first DeepSeek R1
    /// templates) needs `--reasoning-parser deepseek_r1`.
    pub fn detect(chat_template: &str) -> Option<ReasoningFormat> {
        ReasoningFormat::ALL
            .into_iter()
            .filter(|f| f.start != THINK.0 || f.name == "qwen3" || f.tool_block.is_some())
            .find(|f| f.markers().iter().all(|marker| chat_template.contains(marker)))
    }

    /// Whether the family's models start inside their thinking (DeepSeek R1, Qwen 3 Thinking),
    /// by reasoning-parser's parser.
    pub fn starts_inside(self) -> bool {
        stream::PARSERS.registry().create_parser(self.name).is_some_and(|p| p.is_in_reasoning())
    }

    /// How a turn whose prompt is `prompt` starts, read from the prompt's end.
    pub fn opening(self, prompt: &str) -> Opening {
        let tail = prompt.trim_end();
        if tail.ends_with(self.start) {
            Opening::Inside
        } else if tail.ends_with(self.end) {
            Opening::Closed
        } else {
            Opening::ByParser
        }
    }
}

/// How a turn starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opening {
    /// The prompt opened the thinking: the output starts inside it.
    Inside,
    /// The prompt closed it (thinking turned off): the output is all answer.
    Closed,
    /// The prompt says nothing: the parser's rule (inside for the families that always think).
    ByParser,
}

/// What a stream emits, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum ReasoningDelta {
    Reasoning(String),
    Content(String),
}
