//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json`) rendered with minijinja, with Python's string
//! methods available as Hugging Face transformers renders them.

use minijinja::{Environment, Value, context};

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
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut env);
    env.add_template("chat", template).map_err(|e| format!("chat template: {e}"))?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            Value::from(std::collections::BTreeMap::from([
                ("role", m.role.clone()),
                ("content", m.content.clone()),
            ]))
        })
        .collect();
    let template = env.get_template("chat").map_err(|e| format!("chat template: {e}"))?;
    template
        .render(context! { messages, add_generation_prompt, bos_token => bos, eos_token => eos })
        .map_err(|e| format!("chat template: {e}"))
}
