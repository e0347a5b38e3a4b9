//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json`) rendered with minijinja as Hugging Face
//! transformers renders it: Python's string methods, transformers' `tojson` (no HTML escaping)
//! and `raise_exception`, and for OpenAI requests the `tools` variable and messages shaped as
//! `messages` explains. No `strftime_now`: a template then uses its fixed date, and a prompt
//! never depends on the clock.

mod json_value;
mod messages;
mod py_json;

use minijinja::{Environment, Error, ErrorKind, Value, context};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Renders `template` over `messages`, ending with the assistant's turn opened when
/// `add_generation_prompt`.
pub fn render(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos: &str,
    eos: &str,
) -> Result<String, String> {
    let env = environment(template)?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            Value::from(std::collections::BTreeMap::from([
                ("role", m.role.clone()),
                ("content", m.content.clone()),
            ]))
        })
        .collect();
    let context = context! { messages, add_generation_prompt, bos_token => bos, eos_token => eos };
    run(&env, context)
}

/// Renders OpenAI-style messages (objects with `role`, `content` as a string, null or a list of
/// `{type: "text", text}`, and optionally `tool_calls`, `tool_call_id`, `name`) and tools (the
/// request's `tools` entries, `{type: "function", function: {name, description, parameters}}`)
/// as transformers' `apply_chat_template` does: the tools as the `tools` variable (none when
/// there are none), a call's JSON-string arguments parsed into a mapping for templates that read
/// mappings. A template that never reads `tools` gets them in a system message asking for
/// Hermes `<tool_call>` markup, with earlier calls and results written in that markup too.
/// `variables` are further template variables (an OpenAI request's `chat_template_kwargs`, such
/// as Qwen 3's `enable_thinking` or DeepSeek's `thinking`), as transformers passes its keyword
/// arguments; one may not stand for a variable set here ([`RESERVED_VARIABLES`]).
/// Malformed messages are an error, never a panic.
pub fn render_json(
    template: &str,
    messages: &[serde_json::Value],
    tools: Option<&[serde_json::Value]>,
    variables: &serde_json::Map<String, serde_json::Value>,
    add_generation_prompt: bool,
    bos: &str,
    eos: &str,
) -> Result<String, String> {
    if let Some(name) = variables.keys().find(|k| RESERVED_VARIABLES.contains(&k.as_str())) {
        return Err(format!("template variable {name:?} is set by the server"));
    }
    let env = environment(template)?;
    let needs = messages::TemplateNeeds {
        tools: template_mentions_tools(template),
        argument_mappings: template_reads_argument_mappings(template),
    };
    let prepared = messages::prepare(messages, tools, needs)?;
    let messages: Vec<Value> = prepared.messages.iter().map(json_value::to_value).collect();
    let tools =
        prepared.tools.map(|tools| tools.iter().map(json_value::to_value).collect::<Vec<_>>());
    let variables = json_value::to_value(&serde_json::Value::Object(variables.clone()));
    let context = context! {
        messages, tools, add_generation_prompt, bos_token => bos, eos_token => eos, ..variables
    };
    run(&env, context)
}

/// The variables `render_json` sets itself, which a request's own variables may not replace.
pub const RESERVED_VARIABLES: [&str; 5] =
    ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// Whether the template reads the `tools` variable. When it does not (SmolLM2's, for one), the
/// tools of a request reach the model only through the system message `render_json` adds, which
/// asks for Hermes markup: the server should then parse completions as Hermes. A template that
/// does not parse does not read anything.
pub fn template_mentions_tools(template: &str) -> bool {
    let env = Environment::new();
    env.template_from_str(template)
        .is_ok_and(|template| template.undeclared_variables(false).contains("tools"))
}

/// Whether the template reads a call's arguments as a mapping: `arguments | tojson`,
/// `arguments | items`, `arguments.items()` or `arguments is mapping`, spaces aside.
fn template_reads_argument_mappings(template: &str) -> bool {
    let compact: String = template.chars().filter(|c| !c.is_whitespace()).collect();
    ["arguments|tojson", "arguments|items", "arguments.items()", "argumentsismapping"]
        .iter()
        .any(|pattern| compact.contains(pattern))
}

fn environment(template: &str) -> Result<Environment<'_>, String> {
    let mut env = Environment::new();
    // transformers compiles chat templates with both on.
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| format!("chat template syntax: {e}"))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut env);
    env.add_filter("tojson", py_json::tojson);
    env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_template("chat", template).map_err(|e| format!("chat template: {e}"))?;
    Ok(env)
}

fn run(env: &Environment<'_>, context: Value) -> Result<String, String> {
    let template = env.get_template("chat").map_err(|e| format!("chat template: {e}"))?;
    template.render(context).map_err(|e| format!("chat template: {e}"))
}
