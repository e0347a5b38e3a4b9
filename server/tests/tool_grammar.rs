//! `tool_choice`'s grammars in every dialect on a real vocabulary (the tiny generated model's
//! byte-level one, where every marker is spelled in pieces): the calls each dialect's models
//! write pass token by token and may end there, and the dialect's own parser reads them back as
//! those calls; a call outside the tools' schemas is refused. And a reasoning model's grammar,
//! JSON or calls, held off until its thinking ends.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

#[path = "common/markup.rs"]
mod markup;
#[path = "../../gpu/tests/tiny/mod.rs"]
mod tiny;

use std::sync::{Arc, OnceLock};

use lockstep_core::model::Grammar;
use lockstep_core::model::GrammarCompiler as _;
use lockstep_gpu::grammar::GrammarCompiler;
use lockstep_gpu::model::Model;
use lockstep_server::reasoning::{ReasoningFormat, Thinking, after_thinking};
use lockstep_server::tool_calls::{
    ToolFormat, ToolSpec, named_call, parse_complete, required_calls,
};
use markup::{dsml_space, render_call, render_group};
use serde_json::{Value, json};

fn specs() -> Vec<ToolSpec> {
    let spec = |name: &str, parameters: Value| ToolSpec {
        name: name.to_owned(),
        description: None,
        parameters,
    };
    vec![
        spec(
            "get_weather",
            json!({
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": false,
            }),
        ),
        // Free text, and an optional list: DSML's raw text and JSON parameter tags.
        spec(
            "note",
            json!({
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": "what to keep"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["text"],
            }),
        ),
        // More than named properties: DSML writes its arguments as one JSON object.
        spec(
            "lookup",
            json!({
                "type": "object",
                "properties": {"id": {"type": "integer"}},
                "required": ["id"],
                "additionalProperties": {"type": "boolean"},
            }),
        ),
    ]
}

/// Calls written together as `format`'s models write them; DSML parameters in the schema's
/// order (the arguments'), `lookup`'s arguments in DSML as one JSON object.
fn render(format: ToolFormat, calls: &[(&str, Value)]) -> String {
    let each: Vec<String> = calls
        .iter()
        .map(|(name, args)| match format {
            ToolFormat::DsmlV32 | ToolFormat::DsmlV4 | ToolFormat::DsmlV41 if *name == "lookup" => {
                let s = dsml_space(format);
                format!("<｜DSML｜{s}invoke name=\"{name}\">\n{args}\n</｜DSML｜{s}invoke>\n")
            }
            _ => render_call(format, name, args, false),
        })
        .collect();
    render_group(format, &each)
}

struct Vocabulary {
    model: Model,
    compiler: Arc<GrammarCompiler>,
}

impl Vocabulary {
    /// The tiny model's, loaded once for every test here.
    fn tiny() -> &'static Vocabulary {
        static TINY: OnceLock<Vocabulary> = OnceLock::new();
        TINY.get_or_init(|| {
            let dir =
                std::env::temp_dir().join(format!("lockstep-tool-grammar-{}", std::process::id()));
            tiny::variants()[0].write(&dir);
            let model = Model::load(&dir).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            let compiler = model.grammars().unwrap();
            Vocabulary { model, compiler }
        })
    }

    /// Whether `grammar` lets the output be `text`, token by token, and then end.
    fn accepts(&self, grammar: &lockstep_core::model::Grammar, text: &str) -> Result<(), String> {
        let mut matcher = self.compiler.compile(grammar)?;
        let tokens = self.model.tokenizer.encode(text)?;
        for (i, &token) in tokens.iter().enumerate() {
            if !matcher.allowed(&tokens[..i]).allows(token) {
                let at = self.model.tokenizer.decode(&tokens[..i], true)?;
                return Err(format!("refused after {at:?}"));
            }
        }
        let stop = self.model.stop_tokens[0];
        match matcher.allowed(&tokens).allows(stop) {
            true => Ok(()),
            false => Err("may not end there".to_owned()),
        }
    }
}

#[tokio::test]
async fn every_dialect_s_calls_pass_its_grammar_and_parse_back() {
    let vocabulary = Vocabulary::tiny();
    let specs = specs();
    let calls = [
        ("get_weather", json!({"city": "Oslo", "days": 3})),
        ("note", json!({"text": "keep <b> & \"this\"\nline two"})),
        ("note", json!({"text": "x", "tags": ["p", "q"]})),
        ("lookup", json!({"id": 4, "urgent": true})),
    ];
    for format in ToolFormat::ALL {
        let grammar = required_calls(format, &specs, true);
        for count in [1, calls.len()] {
            let text = render(format, &calls[..count]);
            vocabulary
                .accepts(&grammar, &text)
                .unwrap_or_else(|e| panic!("{format:?}: {e}\n{text}"));
            let (content, parsed) = parse_complete(format, &text, &[]).await;
            assert_eq!(content, "", "{format:?}: {text}");
            let parsed: Vec<(String, Value)> = parsed
                .iter()
                .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
                .collect();
            let expected: Vec<(String, Value)> =
                calls[..count].iter().map(|(n, a)| (n.to_string(), a.clone())).collect();
            assert_eq!(parsed, expected, "{format:?}: {text}");
        }
        // One call at most unless parallel.
        let single = required_calls(format, &specs, false);
        assert!(vocabulary.accepts(&single, &render(format, &calls[..1])).is_ok(), "{format:?}");
        assert!(vocabulary.accepts(&single, &render(format, &calls[..2])).is_err(), "{format:?}");
        // Outside the schemas: an undeclared tool, a value the enum lacks, a missing required
        // argument, a number where an integer is due.
        for bad in [
            ("get_wether", json!({"city": "Oslo", "days": 3})),
            ("get_weather", json!({"city": "Rome", "days": 3})),
            ("get_weather", json!({"city": "Oslo"})),
            ("get_weather", json!({"city": "Oslo", "days": 2.5})),
            ("lookup", json!({"id": 4, "urgent": "yes"})),
        ] {
            let text = render(format, std::slice::from_ref(&bad));
            assert!(vocabulary.accepts(&grammar, &text).is_err(), "{format:?} took {text}");
        }
        // A named function with nothing in the prompt (every dialect's, and Hermes's on a server
        // that reads reasoning): its one call; another tool's is refused. (Elsewhere Hermes names
        // the tool in the prefix the server writes; server/tests/constrained.rs runs both.)
        let named = named_call(format, &specs[0], "").unwrap();
        assert!(vocabulary.accepts(&named, &render(format, &calls[..1])).is_ok(), "{format:?}");
        let other = render(format, &calls[1..2]);
        assert!(vocabulary.accepts(&named, &other).is_err(), "{format:?}");
        let two = render(format, &[calls[0].clone(), calls[0].clone()]);
        assert!(vocabulary.accepts(&named, &two).is_err(), "{format:?}: two calls");
    }
}

#[test]
fn dsml_parameters_follow_the_schema_s_order_and_its_required_ones() {
    let vocabulary = Vocabulary::tiny();
    let specs = specs();
    for format in [ToolFormat::DsmlV32, ToolFormat::DsmlV4, ToolFormat::DsmlV41] {
        let grammar = required_calls(format, &specs, true);
        // Declared order; an optional parameter may be left out, a required one may not.
        let swapped = render(format, &[("get_weather", json!({"days": 3, "city": "Oslo"}))]);
        assert!(vocabulary.accepts(&grammar, &swapped).is_err(), "{format:?}: {swapped}");
        let no_tags = render(format, &[("note", json!({"text": "t"}))]);
        assert!(vocabulary.accepts(&grammar, &no_tags).is_ok(), "{format:?}: {no_tags}");
        let no_text = render(format, &[("note", json!({"tags": []}))]);
        assert!(vocabulary.accepts(&grammar, &no_text).is_err(), "{format:?}: {no_text}");
        // An enum's words are raw text; a JSON string there is not one of them.
        let quoted = render(format, &[("get_weather", json!({"city": "Oslo", "days": 3}))])
            .replace("string=\"true\">Oslo", "string=\"false\">\"Oslo\"");
        assert!(vocabulary.accepts(&grammar, &quoted).is_err(), "{format:?}: {quoted}");
    }
}

#[test]
fn a_grammar_waits_for_the_thinking_to_end() {
    let vocabulary = Vocabulary::tiny();
    let format = |name| ReasoningFormat::from_name(name).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": false,
    });
    let json = Grammar::JsonSchema(schema.to_string());
    let answer = "{\"city\": \"Oslo\"}";
    let held = |name, thinking, grammar: &Grammar| {
        after_thinking(format(name), thinking, grammar).unwrap()
    };
    let must = held("qwen3", Thinking::Must, &json);
    for text in
        [format!("Cold? Maybe {{\"city\"...</think>\n\n{answer}"), format!("</think>{answer}")]
    {
        vocabulary.accepts(&must, &text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    }
    // The thinking must end first, and ends at its first closing marker.
    for text in [
        answer.to_owned(),
        format!("a</think>b</think>{answer}"),
        "a</think>{\"city\": \"Rome\"}".to_owned(),
    ] {
        assert!(vocabulary.accepts(&must, &text).is_err(), "{text:?}");
    }
    // May: straight to the answer, or after a block the model opened itself.
    let may = held("qwen3", Thinking::May, &json);
    for text in [answer.to_owned(), format!("<think>\nhm\n</think>\n\n{answer}")] {
        vocabulary.accepts(&may, &text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    }
    assert!(vocabulary.accepts(&may, &format!("hm</think>{answer}")).is_err());
    // Markers with regex characters, any object, and tool calls.
    let object = held("kimi", Thinking::Must, &Grammar::JsonObject);
    vocabulary.accepts(&object, "t◁/think▷{\"a\": [1]}").unwrap();
    let cohere = held("cohere_cmd", Thinking::Must, &json);
    vocabulary.accepts(&cohere, &format!("t<|END_THINKING|>{answer}")).unwrap();
    assert!(vocabulary.accepts(&cohere, &format!("t<|END_THINKING>{answer}")).is_err());
    let calls = required_calls(ToolFormat::Hermes, &specs(), true);
    let call = render(ToolFormat::Hermes, &[("get_weather", json!({"city": "Oslo", "days": 3}))]);
    let thought_calls = held("deepseek_r1", Thinking::Must, &calls);
    vocabulary.accepts(&thought_calls, &format!("Oslo, then.</think>\n\n{call}")).unwrap();
    assert!(vocabulary.accepts(&thought_calls, "Oslo, then.</think>\n\nSure.").is_err());
    assert!(
        after_thinking(format("qwen3"), Thinking::Must, &Grammar::Lark("x: \"a\"".into()))
            .is_none()
    );
    // DeepSeek V4.1: its thinking ends at `</think>`, and holds no tool block, which would end
    // it early for the reasoning split.
    let v41 = ToolFormat::DsmlV41;
    let calls = required_calls(v41, &specs(), true);
    let call = render(v41, &[("get_weather", json!({"city": "Oslo", "days": 3}))]);
    let thought_calls = held("deepseek_v41", Thinking::Must, &calls);
    vocabulary.accepts(&thought_calls, &format!("Oslo.</think>\n\n{call}")).unwrap();
    for text in [format!("Oslo.\n\n{call}"), format!("Oslo. <｜DSML｜ calls></think>{call}")] {
        assert!(vocabulary.accepts(&thought_calls, &text).is_err(), "{text:?}");
    }
    vocabulary.accepts(&thought_calls, &format!("<｜DSML｜ call</think>{call}")).unwrap();
}
