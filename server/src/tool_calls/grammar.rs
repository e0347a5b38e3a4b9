//! `tool_choice` as a grammar. `"required"`: the output is one or more calls in the model's
//! markup, each to a declared tool, with arguments its `parameters` schema accepts. A named
//! function: exactly one call to it.
//!
//! Every dialect's markers are written as text. The DeepSeek markers (`<｜tool▁call▁begin｜>`)
//! are added tokens that DeepSeek's tokenizers do not mark special; llguidance lets the output
//! spell a text marker as that one token or in pieces, and the parser reads either. (A marker a
//! tokenizer marked special would be dropped when the output is decoded, so no parser of ours
//! could read it either.)
//!
//! DSML calls are written as DeepSeek's models write them, a tag per parameter, in the order
//! the schema declares them: a string as raw text, anything else as JSON. A schema that is more
//! than named properties (`anyOf` at the top, `patternProperties`, extra properties allowed by
//! name) has its arguments written as one JSON object inside the invoke tag instead, which the
//! DSML parser also reads (tool-parser's "direct JSON" path).

use lockstep_core::model::Grammar;
use lockstep_gpu::grammar::JSON_BLANKS;
use serde_json::{Map, Value, json};

use super::format::Dsml;
use super::{ToolFormat, ToolSpec};

/// The grammar of one or more calls to `specs` in `format`'s markup; of exactly one unless
/// `parallel`.
pub fn required_calls(format: ToolFormat, specs: &[ToolSpec], parallel: bool) -> Grammar {
    let (open, separator, close) = match (format.dsml(), format) {
        (Some(dsml), _) => (format!("{}\n", dsml.block_open), "", dsml.block_close),
        (None, ToolFormat::Llama3Json) => (String::new(), "; ", ""),
        (None, ToolFormat::DeepSeekV3) => {
            ("<｜tool▁calls▁begin｜>".to_owned(), "\n", "<｜tool▁calls▁end｜>")
        }
        (None, ToolFormat::DeepSeekV31) => {
            ("<｜tool▁calls▁begin｜>".to_owned(), "", "<｜tool▁calls▁end｜>")
        }
        // Hermes: each call its own `<tool_call>` section, one a line.
        (None, _) => (String::new(), "\n", ""),
    };
    let mut lark = Lark::default();
    let call = lark.call(format, specs);
    let calls = match (parallel, separator) {
        (false, _) => call,
        (true, "") => format!("{call}+"),
        (true, separator) => format!("{call} ({} {call})*", literal(separator)),
    };
    let start = [literal(&open), calls, literal(close)];
    // A Lark literal is never empty.
    let start: Vec<String> = start.into_iter().filter(|part| part != "\"\"").collect();
    lark.finish(&start.join(" "))
}

/// The grammar of one call to `spec` after `prefix`, the text the server opened the
/// assistant's turn with (`chat::tools`: for Hermes, the call up to its arguments, except on a
/// server that reads reasoning, which opens nothing so that the model may think first).
pub fn named_call(format: ToolFormat, spec: &ToolSpec, prefix: &str) -> Option<Grammar> {
    match format {
        // The prefix ends where the arguments begin: they, the call's brace, the close.
        ToolFormat::Hermes if prefix.ends_with("\"arguments\": ") => {
            let lark = Lark::default();
            let arguments = json_value(&spec.parameters);
            Some(lark.finish(&format!("{arguments} {}", literal("}\n</tool_call>"))))
        }
        _ if prefix.is_empty() => Some(required_calls(format, std::slice::from_ref(spec), false)),
        _ => None,
    }
}

/// A Lark grammar under construction: the rules beside `start`.
#[derive(Default)]
struct Lark {
    rules: Vec<String>,
}

impl Lark {
    fn finish(self, start: &str) -> Grammar {
        let mut text = format!("start: {start}\n");
        for rule in self.rules {
            text.push_str(&rule);
            text.push('\n');
        }
        Grammar::Lark(text)
    }

    /// A rule named `name` (unique within the grammar) for `body`; the name, to refer to it.
    fn rule(&mut self, name: String, body: &str) -> String {
        self.rules.push(format!("{name}: {body}"));
        name
    }

    /// One call, to any of `specs`.
    fn call(&mut self, format: ToolFormat, specs: &[ToolSpec]) -> String {
        let body = match (format.dsml(), format) {
            (Some(dsml), _) => {
                let invokes: Vec<String> = specs
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| self.dsml_invoke(dsml, i, spec))
                    .collect();
                invokes.join(" | ")
            }
            (None, ToolFormat::DeepSeekV3) => alternatives(specs, |spec| {
                let head =
                    format!("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n", spec.name);
                let arguments = json_value(&spec.parameters);
                format!("{} {arguments} {}", literal(&head), literal("\n```<｜tool▁call▁end｜>"))
            }),
            (None, ToolFormat::DeepSeekV31) => alternatives(specs, |spec| {
                let head = format!("<｜tool▁call▁begin｜>{}<｜tool▁sep｜>", spec.name);
                let arguments = json_value(&spec.parameters);
                format!("{} {arguments} {}", literal(&head), literal("<｜tool▁call▁end｜>"))
            }),
            // The JSON dialects (Hermes, Llama 3): one object, its name picking its arguments'
            // schema.
            (None, _) => {
                let key = if format == ToolFormat::Hermes { "arguments" } else { "parameters" };
                let calls: Vec<Value> = specs.iter().map(|spec| call_schema(spec, key)).collect();
                let object = json_value(&json!({"anyOf": calls}));
                match format {
                    ToolFormat::Hermes => {
                        format!(
                            "{} {object} {}",
                            literal("<tool_call>\n"),
                            literal("\n</tool_call>")
                        )
                    }
                    _ => object,
                }
            }
        };
        self.rule("call".to_owned(), &body)
    }

    /// The DSML invoke tag of a call to `spec` (the `i`th tool): its parameters as tags, or its
    /// arguments as one JSON object when the schema is more than named properties.
    fn dsml_invoke(&mut self, dsml: Dsml, i: usize, spec: &ToolSpec) -> String {
        let open = literal(&format!("{}{}\">\n", dsml.invoke_open, spec.name));
        let close = literal(&format!("{}\n", dsml.invoke_close));
        let Some(properties) = named_properties(&spec.parameters) else {
            let arguments = json_value(&spec.parameters);
            let body = format!("{open} {arguments} {} {close}", literal("\n"));
            return self.rule(format!("invoke_{i}"), &body);
        };
        let required: Vec<&str> = match spec.parameters.get("required") {
            Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let mut body = vec![open];
        for (j, (key, schema)) in properties.iter().enumerate() {
            let tag = self.dsml_parameter(dsml, format!("parameter_{i}_{j}"), key, schema);
            body.push(if required.contains(&key.as_str()) { tag } else { format!("{tag}?") });
        }
        body.push(close);
        self.rule(format!("invoke_{i}"), &body.join(" "))
    }

    /// A rule named `name` for the parameter tag of `key`, whose value `schema` holds.
    fn dsml_parameter(&mut self, dsml: Dsml, name: String, key: &str, schema: &Value) -> String {
        let open = |string: bool| {
            literal(&format!("{} name=\"{key}\" string=\"{string}\">", dsml.parameter_open))
        };
        let close = literal(&format!("{}\n", dsml.parameter_close));
        let body = match raw_text(schema) {
            // Any text up to the first closing tag: the tag itself ends it.
            Some(RawText::Any) => {
                let end = dsml.parameter_close.replace('/', "\\/");
                self.rules.push(format!("{name}_text[lazy]: /(.|\\n)*{end}/"));
                format!("{} {name}_text {}", open(true), literal("\n"))
            }
            Some(RawText::OneOf(words)) => {
                let words: Vec<String> = words.iter().map(|w| literal(w)).collect();
                format!("{} ({}) {close}", open(true), words.join(" | "))
            }
            None => format!("{} {} {close}", open(false), json_value(schema)),
        };
        self.rule(name, &body)
    }
}

/// `one(spec)` for each of `specs`, as alternatives.
fn alternatives(specs: &[ToolSpec], one: impl Fn(&ToolSpec) -> String) -> String {
    let each: Vec<String> = specs.iter().map(one).collect();
    each.join(" | ")
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

/// `%json` of `schema`, its blanks bounded unless the schema says otherwise.
pub(crate) fn json_value(schema: &Value) -> String {
    let mut schema = schema.clone();
    if let Some(fields) = schema.as_object_mut() {
        fields.entry("x-guidance").or_insert_with(|| json!({"whitespace_pattern": JSON_BLANKS}));
    }
    format!("%json {schema}")
}

/// `text` as a Lark string literal (JSON's escapes are Lark's).
pub(crate) fn literal(text: &str) -> String {
    Value::from(text).to_string()
}

/// The properties of an object schema that is nothing but named properties (so DSML's tags,
/// one a property, can say all it allows).
fn named_properties(schema: &Value) -> Option<&Map<String, Value>> {
    const PLAIN: [&str; 8] = [
        "type",
        "properties",
        "required",
        "additionalProperties",
        "description",
        "title",
        "$schema",
        "strict",
    ];
    let fields = schema.as_object()?;
    if fields.keys().any(|key| !PLAIN.contains(&key.as_str())) {
        return None;
    }
    if fields.get("type").is_some_and(|t| t != "object") {
        return None;
    }
    // Extra properties the schema allows could not be named in a tag; `false` or absent
    // (JSON Schema's default allows them, but a model calling a tool writes the declared ones).
    if fields.get("additionalProperties").is_some_and(|a| a != &Value::Bool(false)) {
        return None;
    }
    static NONE: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);
    match fields.get("properties") {
        None => Some(&NONE),
        Some(properties) => properties.as_object(),
    }
}

/// How a parameter whose value is a string is written as DSML's raw text.
enum RawText {
    /// Any text: a plain string.
    Any,
    /// One of these strings (`enum` or `const`).
    OneOf(Vec<String>),
}

/// Whether every value `schema` allows is a string DSML can write raw, and which ones.
fn raw_text(schema: &Value) -> Option<RawText> {
    const ANNOTATIONS: [&str; 5] = ["type", "description", "title", "examples", "default"];
    let fields = schema.as_object()?;
    // Non-empty strings: an empty one is JSON's `""` (a Lark literal cannot be empty).
    let strings = |values: &[Value]| -> Option<Vec<String>> {
        values.iter().map(|v| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)).collect()
    };
    let typed = fields.get("type").map(|t| t == "string");
    if let Some(Value::Array(values)) = fields.get("enum") {
        let only = fields.keys().all(|k| k == "enum" || ANNOTATIONS.contains(&k.as_str()));
        return (only && typed != Some(false))
            .then(|| strings(values))
            .flatten()
            .map(RawText::OneOf);
    }
    if let Some(value) = fields.get("const") {
        let only = fields.keys().all(|k| k == "const" || ANNOTATIONS.contains(&k.as_str()));
        let one = strings(std::slice::from_ref(value));
        return (only && typed != Some(false)).then_some(one).flatten().map(RawText::OneOf);
    }
    let only = fields.keys().all(|k| ANNOTATIONS.contains(&k.as_str()));
    (only && typed == Some(true)).then_some(RawText::Any)
}
