//! What a closed tool section means: tool-parser's `parse_complete` reads it, after two repairs
//! of inputs its parsers get wrong, and its calls are kept only if they are well formed. A
//! section that yields no call is given back as text.
//!
//! Only `parse_complete` is used, never tool-parser's streaming parsers: those disagree with
//! `parse_complete` on ordinary outputs (see the module docs), and a section is short, so
//! waiting for its close marker costs little.

use std::sync::LazyLock;

use serde_json::Value;
use tool_parser::{
    DeepSeek31Parser, DeepSeekDsmlParser, DeepSeekParser, LlamaParser, QwenParser, ToolParser,
};

use super::ParsedCall;
use super::format::ToolFormat;

// One parser of each kind for the process: `parse_complete` takes `&self` and keeps no state, and
// building one compiles its regexes.
static HERMES: LazyLock<QwenParser> = LazyLock::new(QwenParser::new);
static LLAMA3_JSON: LazyLock<LlamaParser> = LazyLock::new(LlamaParser::new);
static DEEPSEEK_V3: LazyLock<DeepSeekParser> = LazyLock::new(DeepSeekParser::new);
static DEEPSEEK_V31: LazyLock<DeepSeek31Parser> = LazyLock::new(DeepSeek31Parser::new);
static DSML_V32: LazyLock<DeepSeekDsmlParser> = LazyLock::new(DeepSeekDsmlParser::v32);
static DSML_V4: LazyLock<DeepSeekDsmlParser> = LazyLock::new(DeepSeekDsmlParser::v4);
static DSML_V41: LazyLock<DeepSeekDsmlParser> = LazyLock::new(DeepSeekDsmlParser::v41);

fn parser(format: ToolFormat) -> &'static dyn ToolParser {
    match format {
        ToolFormat::Hermes => &*HERMES,
        ToolFormat::Llama3Json => &*LLAMA3_JSON,
        ToolFormat::DeepSeekV3 => &*DEEPSEEK_V3,
        ToolFormat::DeepSeekV31 => &*DEEPSEEK_V31,
        ToolFormat::DsmlV32 => &*DSML_V32,
        ToolFormat::DsmlV4 => &*DSML_V4,
        ToolFormat::DsmlV41 => &*DSML_V41,
    }
}

/// The calls in one section, with any text the parser found in front of them; None when the
/// section holds no well-formed call (then it is text). A call's name is not checked against
/// the request's tools: `parse_complete` of these seven parsers never does, so a call to an
/// undeclared tool is a call, and the server decides what to do with it.
pub(super) async fn resolve(
    format: ToolFormat,
    section: &str,
) -> Option<(String, Vec<ParsedCall>)> {
    let repaired = match format {
        ToolFormat::Hermes => Some(hermes_with_newlines(section)),
        ToolFormat::Llama3Json => llama_without_inner_semicolons(section),
        _ => None,
    };
    let text = repaired.as_deref().unwrap_or(section);
    let (normal, calls) = parser(format).parse_complete(text).await.ok()?;
    let calls: Vec<ParsedCall> = calls
        .into_iter()
        .map(|call| ParsedCall { name: call.function.name, arguments: call.function.arguments })
        .filter(well_formed)
        .collect();
    (!calls.is_empty()).then_some((normal, calls))
}

/// A call we hand on: a name, and arguments that are a JSON object. The DSML parsers pass a body
/// that starts with `{` and ends with `}` through as the arguments without parsing it, and the
/// Hermes one serializes whatever `arguments` held (a string, a list); such a call is dropped,
/// as the parsers themselves drop a call they cannot read.
fn well_formed(call: &ParsedCall) -> bool {
    !call.name.is_empty()
        && matches!(serde_json::from_str::<Value>(&call.arguments), Ok(Value::Object(_)))
}

/// `QwenParser` reads a call only as `<tool_call>\n{...}\n</tool_call>`, newlines exactly there.
/// Qwen writes them, but Hermes-style models (and small models following our fallback prompt)
/// often write `<tool_call>{...}</tool_call>`; the JSON inside is the same, so we give the
/// parser the spelling it reads, as vLLM's Hermes parser accepts both. The section is a single
/// call from `<tool_call>` to the first `</tool_call>`.
fn hermes_with_newlines(section: &str) -> String {
    let inner = section
        .strip_prefix("<tool_call>")
        .and_then(|rest| rest.strip_suffix("</tool_call>"))
        .unwrap_or(section);
    format!("<tool_call>\n{}\n</tool_call>", inner.trim())
}

/// `LlamaParser` splits its JSON at every `;`, inside strings too, so one call whose arguments
/// hold a `;` (code, SQL, prose) is lost. When the text after the marker is JSON values with
/// `;` between them, we hand it over re-serialized with every `;` inside a string written as
/// `\u003b`, which JSON reads back as `;`: the parser then splits only between calls. Anything
/// else goes to the parser as it is. None when nothing needs repairing.
fn llama_without_inner_semicolons(section: &str) -> Option<String> {
    const PYTHON_TAG: &str = "<|python_tag|>";
    // The parser reads after the first tag if there is one, else the whole text.
    let start = section.find(PYTHON_TAG).map_or(0, |at| at + PYTHON_TAG.len());
    let json = &section[start..];
    if !json.contains(';') {
        return None;
    }
    let mut parts = Vec::new();
    let mut rest = json.trim_start();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        rest = rest[values.byte_offset()..].trim_start();
        parts.push(serde_json::to_string(&value).ok()?);
        match rest.strip_prefix(';') {
            Some(after) => rest = after.trim_start(),
            None if rest.is_empty() => {}
            None => return None,
        }
    }
    if !parts.iter().any(|part| part.contains(';')) {
        return None;
    }
    // Compact JSON has no `;` outside strings, so each one left is inside a string.
    let parts: Vec<String> = parts.iter().map(|part| part.replace(';', "\\u003b")).collect();
    Some(format!("{}{}", &section[..start], parts.join(";")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_spacing_is_normalized_only_around_the_json() {
        assert_eq!(
            hermes_with_newlines("<tool_call> {\"a\": \"x\\n\"}\n\n</tool_call>"),
            "<tool_call>\n{\"a\": \"x\\n\"}\n</tool_call>"
        );
    }

    #[test]
    fn llama_semicolons_inside_strings_are_escaped_and_others_left_alone() {
        let one = r#"<|python_tag|>{"name": "sql", "parameters": {"q": "a; b"}}"#;
        assert_eq!(
            llama_without_inner_semicolons(one).unwrap(),
            r#"<|python_tag|>{"name":"sql","parameters":{"q":"a\u003b b"}}"#
        );
        let two = r#"{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"s": ";"}}"#;
        assert_eq!(
            llama_without_inner_semicolons(two).unwrap(),
            r#"{"name":"a","parameters":{}};{"name":"b","parameters":{"s":"\u003b"}}"#
        );
        assert_eq!(llama_without_inner_semicolons(r#"{"name": "a"}; {"name": "b"}"#), None);
        assert_eq!(llama_without_inner_semicolons(r#"{"q": "a; b"} trailing"#), None);
        assert_eq!(llama_without_inner_semicolons("no json; here"), None);
    }
}
