//! `tool_choice` as a grammar. `"required"`: the output is one or more calls in the model's
//! markup, each to a declared tool, with arguments its `parameters` schema accepts. A named
//! function: exactly one call to it. Only the markups whose calls are plain text (Hermes,
//! Llama 3's JSON) are written this way; the DeepSeek dialects wrap calls in special tokens a
//! grammar of text does not reach.

use lockstep_core::model::Grammar;
use lockstep_gpu::grammar::JSON_BLANKS;
use serde_json::{Value, json};

use super::{ToolFormat, ToolSpec};

/// The grammar of one or more calls to `specs` in `format`'s markup; of exactly one unless
/// `parallel`.
pub fn required_calls(
    format: ToolFormat,
    specs: &[ToolSpec],
    parallel: bool,
) -> Result<Grammar, String> {
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
    let calls: Vec<Value> = specs.iter().map(|spec| call_schema(spec, arguments)).collect();
    let schema = json!({"anyOf": calls, "x-guidance": {"whitespace_pattern": JSON_BLANKS}});
    let call = call.replace("CALL", &schema.to_string());
    let start = match parallel {
        true => format!("start: call ({separator} call)*"),
        false => "start: call".to_owned(),
    };
    Ok(Grammar::Lark(format!("{start}\ncall: {call}\n")))
}

/// The grammar of one call to `spec` after `prefix`, the text the server opened the
/// assistant's turn with (`chat::tools`: for Hermes, the call up to its arguments); `None` for
/// the markups without a grammar.
pub fn named_call(format: ToolFormat, spec: &ToolSpec, prefix: &str) -> Option<Grammar> {
    let blanks = json!({"whitespace_pattern": JSON_BLANKS});
    let lark = match format {
        // The prefix ends where the arguments begin: they, the call's brace, the close.
        ToolFormat::Hermes if prefix.ends_with("\"arguments\": ") => {
            let mut arguments = spec.parameters.clone();
            if let Some(fields) = arguments.as_object_mut() {
                fields.entry("x-guidance").or_insert(blanks);
            }
            format!("start: %json {arguments} \"}}\\n</tool_call>\"\n")
        }
        ToolFormat::Llama3Json if prefix.is_empty() => {
            let mut call = call_schema(spec, "parameters");
            call["x-guidance"] = blanks;
            format!("start: %json {call}\n")
        }
        _ => return None,
    };
    Some(Grammar::Lark(lark))
}

/// A call to `spec` as a JSON object: its name, and its arguments under `arguments`.
fn call_schema(spec: &ToolSpec, arguments: &str) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": spec.name}, arguments: spec.parameters},
        "required": ["name", arguments],
        "additionalProperties": false,
    })
}
