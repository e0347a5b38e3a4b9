//! A grammar held off until the thinking ends: a reasoning model asked for JSON or for tool
//! calls thinks first, freely, and the grammar holds what follows the closing marker. Held from
//! the first token instead, the model could not think, and its thinking-shaped prompt would be
//! answered by a grammar-forced JSON the model never chose to start.

use lockstep_core::model::Grammar;

use super::ReasoningFormat;
use crate::tool_calls::{json_value, literal};

/// Whether the output must think first (the turn opened inside the thinking, or the family
/// always starts there) or may (after writing the opening marker itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thinking {
    Must,
    May,
}

/// `grammar` after the thinking: free text up to the first closing marker (and without a tool
/// block that would end it early), blanks, then what `grammar` allows. A Lark grammar must begin
/// with its `start` rule on the first line (ours do: `tool_calls::required_calls` and
/// `named_call`); `None` for one that does not.
pub fn after_thinking(
    format: ReasoningFormat,
    thinking: Thinking,
    grammar: &Grammar,
) -> Option<Grammar> {
    let (answer, rules) = match grammar {
        Grammar::JsonObject => (json_value(&serde_json::json!({"type": "object"})), ""),
        Grammar::JsonSchema(schema) => (json_value(&serde_json::from_str(schema).ok()?), ""),
        Grammar::Lark(text) => {
            let text = text.strip_prefix("start: ")?;
            let (start, rules) = text.split_once('\n').unwrap_or((text, ""));
            (format!("({start})"), rules)
        }
    };
    // Lazy: the thinking ends at the first closing marker, as the reasoning split reads it.
    let mut thought = format!("lockstep_thought[lazy]: /(.|\\n)*{}/", regex_escaped(format.end));
    // A tool block in the thinking would end it there for the split (DeepSeek V4.1): the
    // grammar's thinking holds none, so that it ends where the split's does.
    if let Some(block) = format.tool_block {
        thought.push_str(&format!(" & ~/(.|\\n)*{}(.|\\n)*/", regex_escaped(block)));
    }
    let blank = "lockstep_blank: /[ \\t\\r\\n]{1,20}/";
    let start = match thinking {
        Thinking::Must => format!("start: lockstep_thought lockstep_blank? {answer}"),
        Thinking::May => {
            format!("start: ({} lockstep_thought lockstep_blank?)? {answer}", literal(format.start))
        }
    };
    Some(Grammar::Lark(format!("{start}\n{thought}\n{blank}\n{rules}")))
}

/// `text` as a regex that matches it alone, in a Lark `/.../` literal.
fn regex_escaped(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if "\\.^$|?*+()[]{}/-".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
