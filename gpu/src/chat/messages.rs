//! OpenAI chat messages and tools, checked and put in the shape chat templates read, as vLLM and
//! transformers hand them over; and, for a template that never reads `tools`, the same request
//! spelled in Hermes markup in plain messages.

use serde_json::{Map, Value, json};

use super::json_value::to_value;
use super::py_json::dumps;

/// What the template is given: the messages, and the tools (`None` when there are none).
#[derive(Debug)]
pub(super) struct Prepared {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
}

/// How the template reads tool calls.
#[derive(Clone, Copy, Debug)]
pub(super) struct TemplateNeeds {
    /// The template reads `tools` itself; otherwise they go into a Hermes system message.
    pub tools: bool,
    /// The template reads a call's `arguments` as a mapping (`arguments | tojson`,
    /// `arguments.items()`), as Qwen, Llama 3.1 and Mistral templates do; DeepSeek's concatenate
    /// it as a string. OpenAI clients send a JSON string, so for the first kind it is parsed, as
    /// vLLM does.
    pub argument_mappings: bool,
}

pub(super) fn prepare(
    messages: &[Value],
    tools: Option<&[Value]>,
    needs: TemplateNeeds,
) -> Result<Prepared, String> {
    let tools = tools.filter(|tools| !tools.is_empty());
    if let Some(at) = tools.and_then(|tools| tools.iter().position(|tool| !tool.is_object())) {
        return Err(format!("tools[{at}] is not an object"));
    }
    let mut prepared = Vec::with_capacity(messages.len() + 1);
    for (at, message) in messages.iter().enumerate() {
        let message = checked(message, needs.argument_mappings || !needs.tools)
            .map_err(|why| format!("messages[{at}]: {why}"))?;
        prepared.push(message);
    }
    if needs.tools {
        return Ok(Prepared { messages: prepared, tools: tools.map(<[Value]>::to_vec) });
    }
    let mut messages = hermes_history(prepared)?;
    if let Some(tools) = tools {
        add_tools_system_message(&mut messages, tools)?;
    }
    Ok(Prepared { messages, tools: None })
}

/// One message as templates read it: `content` a string or null (text parts joined with
/// newlines, as vLLM gives templates that expect a string), and each tool call's arguments
/// parsed into a mapping when `argument_mappings`. Other fields pass through untouched.
fn checked(message: &Value, argument_mappings: bool) -> Result<Value, String> {
    let Value::Object(fields) = message else { return Err("not an object".into()) };
    let mut fields = fields.clone();
    if !fields.get("role").is_some_and(Value::is_string) {
        return Err("`role` is missing or not a string".into());
    }
    if let Some(content) = fields.get_mut("content") {
        *content = content_text(content)?;
    }
    match fields.get_mut("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (at, call) in calls.iter_mut().enumerate() {
                checked_call(call, argument_mappings)
                    .map_err(|why| format!("tool_calls[{at}]: {why}"))?;
            }
        }
        Some(_) => return Err("`tool_calls` is not a list".into()),
    }
    Ok(Value::Object(fields))
}

fn content_text(content: &Value) -> Result<Value, String> {
    match content {
        Value::Null | Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => texts.push(text.as_str()),
                    _ => {
                        return Err(
                            "a content part is not {\"type\": \"text\", \"text\": ...}".into()
                        );
                    }
                }
            }
            Ok(Value::String(texts.join("\n")))
        }
        _ => Err("`content` is not a string, null or a list of text parts".into()),
    }
}

fn checked_call(call: &mut Value, argument_mappings: bool) -> Result<(), String> {
    let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
        return Err("no `function` object".into());
    };
    if !function.get("name").is_some_and(Value::is_string) {
        return Err("`function.name` is missing or not a string".into());
    }
    if argument_mappings && let Some(Value::String(text)) = function.get("arguments") {
        let parsed: Value = serde_json::from_str(text)
            .map_err(|e| format!("`function.arguments` is not JSON: {e}"))?;
        function.insert("arguments".into(), parsed);
    }
    Ok(())
}

/// For a template that knows no tools: assistant tool calls become Hermes `<tool_call>` text in
/// the content, and tool results user turns of `<tool_response>` blocks (a run of results one
/// turn), as Qwen 2.5's template writes them. Messages come checked, arguments parsed.
fn hermes_history(messages: Vec<Value>) -> Result<Vec<Value>, String> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    let mut after_tool = false;
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
        let is_tool = role == "tool";
        let content = text_of(&message);
        let calls = message.get("tool_calls").and_then(Value::as_array);
        if is_tool {
            let response = format!("<tool_response>\n{content}\n</tool_response>");
            match out.last_mut() {
                Some(last) if after_tool => {
                    let joined = format!("{}\n{response}", text_of(last));
                    set_field(last, "content", Value::String(joined));
                }
                _ => out.push(json!({"role": "user", "content": response})),
            }
        } else if let Some(calls) = calls.filter(|calls| role == "assistant" && !calls.is_empty()) {
            let mut parts: Vec<String> = Vec::new();
            if !content.is_empty() {
                parts.push(content.to_owned());
            }
            for call in calls {
                parts.push(hermes_call(call)?);
            }
            let mut message = message.clone();
            set_field(&mut message, "content", Value::String(parts.join("\n")));
            out.push(message);
        } else {
            out.push(message);
        }
        after_tool = is_tool;
    }
    Ok(out)
}

/// `<tool_call>` markup of one call, name first as Qwen's template writes it (whatever order
/// serde_json keeps keys in).
fn hermes_call(call: &Value) -> Result<String, String> {
    let function = &call["function"];
    let arguments = function.get("arguments").cloned().unwrap_or_else(|| json!({}));
    let text = |value: &Value| dumps(&to_value(value)).map_err(|e| e.to_string());
    let (name, arguments) = (text(&function["name"])?, text(&arguments)?);
    Ok(format!("<tool_call>\n{{\"name\": {name}, \"arguments\": {arguments}}}\n</tool_call>"))
}

fn text_of(message: &Value) -> &str {
    message.get("content").and_then(Value::as_str).unwrap_or_default()
}

fn set_field(message: &mut Value, key: &str, value: Value) {
    if let Value::Object(fields) = message {
        fields.insert(key.to_owned(), value);
    }
}

/// The tools in a system message asking for Hermes calls, in Qwen 2.5's words (the prompt the
/// Hermes format was trained with): added to the first message when it is a system message,
/// else a system message of its own in front.
fn add_tools_system_message(messages: &mut Vec<Value>, tools: &[Value]) -> Result<(), String> {
    let mut block = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        block.push('\n');
        block.push_str(&dumps(&to_value(tool)).map_err(|e| e.to_string())?);
    }
    block.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    match messages.first_mut() {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
            let system = text_of(first);
            let content = if system.is_empty() { block } else { format!("{system}\n\n{block}") };
            set_field(first, "content", Value::String(content));
        }
        _ => {
            let system = Map::from_iter([
                ("role".to_owned(), Value::String("system".into())),
                ("content".to_owned(), Value::String(block)),
            ]);
            messages.insert(0, Value::Object(system));
        }
    }
    Ok(())
}
