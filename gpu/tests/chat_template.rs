//! The default model's chat template rendered by minijinja, against Python jinja2's rendering of
//! the same template (the strings below came from jinja2, as transformers renders them).

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use lockstep_gpu::chat::{Message, render};

fn message(role: &str, content: &str) -> Message {
    Message { role: role.into(), content: content.into() }
}

#[test]
fn smollm2_template_renders_as_jinja2_does() {
    let Some((_, file)) = common::default_model() else { return };
    let gguf = common::parse(&file);
    let template = gguf.get_str("tokenizer.chat_template").unwrap();
    let one = render(template, &[message("user", "What is the capital of France?")], true, "", "")
        .unwrap();
    assert_eq!(
        one,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let turns = [
        message("system", "Be brief."),
        message("user", "Hi"),
        message("assistant", "Hello!"),
        message("user", "2+2?"),
    ];
    assert_eq!(
        render(template, &turns, true, "", "").unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn python_string_methods_work_and_bad_templates_are_errors() {
    let template = "{% for m in messages %}{{ m['content'].strip().upper() }}{% endfor %}";
    assert_eq!(render(template, &[message("user", "  hi  ")], false, "", "").unwrap(), "HI");
    assert!(render("{% for %}", &[], false, "", "").unwrap_err().contains("chat template"));
}
