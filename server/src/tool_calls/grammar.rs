//! `tool_choice: "required"` as a grammar: the output is one or more calls in the model's
//! markup, each to a declared tool, with arguments its `parameters` schema accepts. Only the
//! markups whose calls are plain text (Hermes, Llama 3's JSON) are written this way; the
//! DeepSeek dialects wrap calls in special tokens a grammar of text does not reach.

use lockstep_core::model::Grammar;
use lockstep_gpu::grammar::JSON_BLANKS;
use serde_json::{Value, json};

use super::{ToolFormat, ToolSpec};

/// The grammar of one or more calls to `specs` in `format`'s markup.
pub fn required_calls(format: ToolFormat, specs: &[ToolSpec]) -> Result<Grammar, String> {
    let (arguments, call, separator) = match format {
        ToolFormat::Hermes => {
            ("arguments", r#""<tool_call>\n" %json CALL "\n</tool_call>""#, r#""\n""#)
        }
        ToolFormat::Llama3Json => ("parameters", "%json CALL", r#""; ""#),
        other => {
            return Err(format!(
                "tool_choice \"required\" needs the hermes or llama3_json tool-call format; \
                 this model's is {}",
                other.name()
            ));
        }
    };
    let calls: Vec<Value> = specs
        .iter()
        .map(|spec| {
            json!({
                "type": "object",
                "properties": {"name": {"const": spec.name}, arguments: spec.parameters},
                "required": ["name", arguments],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({"anyOf": calls, "x-guidance": {"whitespace_pattern": JSON_BLANKS}});
    let call = call.replace("CALL", &schema.to_string());
    Ok(Grammar::Lark(format!("start: call ({separator} call)*\ncall: {call}\n")))
}
