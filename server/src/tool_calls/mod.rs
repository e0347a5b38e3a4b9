//! Tool calls in a completion's text: which markup dialect a model writes, and the calls and the
//! content outside them, streamed or whole.
//!
//! The parsing is tool-parser's (the SMG project's `parse_complete` of each dialect); this module
//! decides where its sections are and keeps streaming and whole parsing in agreement:
//! - `split` cuts the text into plain text and tool sections (open marker to close marker, or to
//!   the end for Llama 3 and DeepSeek V4.1). Content outside sections streams as it comes; only
//!   a suffix that may still become an open marker waits.
//! - `resolve` gives each closed section to the dialect's `parse_complete`. A section with no
//!   well-formed call is content again, so malformed or unfinished markup is never lost.
//! - `stream` writes the deltas; `parse_complete` runs the same steps on the whole text.
//!
//! Why not tool-parser's own streaming (`parse_incremental`)? Checked against its
//! `parse_complete` on ordinary outputs (tool-parser 1.10), it depends on how the text is
//! chunked and disagrees with the whole parse: Hermes and Llama drop the text before a call when
//! it arrives in the same chunk as the call; DeepSeek V3 and V3.1 give a call that arrives in one
//! chunk empty arguments, and one that arrives in small pieces comes out as content, no call; a
//! call to a tool the request did not declare is dropped (DeepSeek, DSML) or content (Hermes,
//! Llama) where `parse_complete` returns it; the DeepSeek V3 stream deletes every "```" from
//! content; a Hermes call missing its closing brace streams as a call and parses as content.
//! Holding a section until it closes and reading it with `parse_complete` costs the incremental
//! arguments of a call, which clients do not need.
//!
//! Where we read differently from tool-parser's `parse_complete` on a whole text, on purpose:
//! text after and between calls is content (it drops it); markup that yields no call is content
//! (DSML drops it); blank text touching a call is dropped; markers outside a section (a stray
//! `<｜tool▁call▁begin｜>`) are text; a call whose arguments are not a JSON object is dropped
//! (DSML passes an unparsed `{...}` body through); and the two repairs in `resolve` (Hermes
//! without newlines, Llama arguments holding `;`). A malformed call in a section beside good
//! ones is dropped, as the parsers drop it: a DeepSeek or DSML section holds several calls, a
//! Hermes section one, so there a malformed call is content.
//!
//! DeepSeek V4.1 is read by its reference's rules instead (DeepSeek's `encoding.py`, which
//! tool-parser's V4.1 dialect and the serving engines follow): its model may open calls with a
//! block or with a bare `invoke`, and from the first of them on nothing is content, so its
//! section runs to the end of the text.

mod format;
mod grammar;
mod resolve;
mod split;
mod stream;
#[cfg(test)]
mod tests;

pub use format::ToolFormat;
pub(crate) use grammar::{json_value, literal};
pub use grammar::{named_call, required_calls};
pub use stream::{ToolCallStream, parse_complete};

/// A tool the client offered: name, description, JSON-schema parameters (from the OpenAI
/// request's `tools[i].function`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    pub parameters: serde_json::Value,
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// A JSON object as text.
    pub arguments: String,
}

/// What a stream emits, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolDelta {
    Content(String),
    CallStart { index: usize, name: String },
    CallArguments { index: usize, fragment: String },
}

/// Folds a sequence of deltas into (content, calls): the client's view of a stream. Calls come in
/// index order; arguments for an index never started make a call with an empty name rather than
/// a panic.
pub fn fold_deltas(deltas: &[ToolDelta]) -> (String, Vec<ParsedCall>) {
    let mut content = String::new();
    let mut calls: std::collections::BTreeMap<usize, ParsedCall> = Default::default();
    for delta in deltas {
        match delta {
            ToolDelta::Content(text) => content.push_str(text),
            ToolDelta::CallStart { index, name } => {
                calls.entry(*index).or_insert_with(empty_call).name.clone_from(name);
            }
            ToolDelta::CallArguments { index, fragment } => {
                calls.entry(*index).or_insert_with(empty_call).arguments.push_str(fragment);
            }
        }
    }
    (content, calls.into_values().collect())
}

fn empty_call() -> ParsedCall {
    ParsedCall { name: String::new(), arguments: String::new() }
}
