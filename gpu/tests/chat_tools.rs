//! OpenAI requests with tools through chat templates: Qwen 2.5's template against transformers'
//! rendering of the same requests (goldens/chat_tools.json, made by
//! goldens/make_chat_tools_goldens.py), the default model's template (which knows no tools)
//! with our Hermes system message, and malformed requests as errors.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod common;

use std::path::Path;

use lockstep_gpu::chat::{render_json, template_mentions_tools};
use lockstep_gpu::model::Model;
use serde_json::{Map, Value, json};

fn golden(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn qwen_template_renders_requests_as_transformers_does() {
    let goldens: Value = serde_json::from_str(&golden("chat_tools.json")).unwrap();
    let template = golden(goldens["template"].as_str().unwrap());
    assert!(template_mentions_tools(&template));
    for case in goldens["cases"].as_array().unwrap() {
        let tools = case["tools"].as_array().map(Vec::as_slice);
        let rendered = render_json(
            &template,
            case["messages"].as_array().unwrap(),
            tools,
            &Map::new(),
            case["add_generation_prompt"].as_bool().unwrap(),
            "",
            "<|im_end|>",
        )
        .unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "{}", case["name"]);
    }
}

/// Keys in sorted order, so that the rendering is the same with or without serde_json's
/// `preserve_order` (which the server's build turns on).
fn weather_tool() -> Value {
    json!({
        "function": {
            "description": "Current weather",
            "name": "get_weather",
            "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
        },
        "type": "function",
    })
}

#[test]
fn the_default_models_template_gets_tools_in_a_hermes_system_message() {
    let Some((path, _)) = common::default_model() else { return };
    let model = Model::load(Path::new(&path)).unwrap();
    let template = model.chat_template.as_deref().unwrap();
    assert!(!template_mentions_tools(template));
    let tools = [weather_tool()];
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let rendered = model
        .render_chat_json(std::slice::from_ref(&user), Some(&tools), &Map::new(), true)
        .unwrap();
    let tools_block = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"function\": {\"description\": \"Current weather\", \"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \"object\"}}, \"type\": \"function\"}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    assert_eq!(
        rendered,
        format!(
            "<|im_start|>system\n{tools_block}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        )
    );
    // A system message of the client's keeps its words, the tools after them.
    let system = json!({"role": "system", "content": "Be brief."});
    let rendered =
        model.render_chat_json(&[system, user.clone()], Some(&tools), &Map::new(), true).unwrap();
    assert!(
        rendered
            .starts_with(&format!("<|im_start|>system\nBe brief.\n\n{tools_block}<|im_end|>\n"))
    );
    // Without tools, as render_chat renders.
    let plain =
        model.render_chat_json(std::slice::from_ref(&user), None, &Map::new(), true).unwrap();
    assert!(plain.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert_eq!(
        model.render_chat_json(std::slice::from_ref(&user), Some(&[]), &Map::new(), true).unwrap(),
        plain
    );
}

#[test]
fn earlier_calls_and_results_are_written_in_hermes_markup_for_a_template_without_tools() {
    let chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";
    let call = |id: &str, name: &str, args: &str| json!({"function": {"arguments": args, "name": name}, "id": id, "type": "function"});
    let messages = [
        json!({"role": "user", "content": "Weather and time?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [
            call("1", "get_weather", "{\"city\": \"Paris\"}"), call("2", "get_time", "{}"),
        ]}),
        json!({"role": "tool", "tool_call_id": "1", "content": "sunny"}),
        json!({"role": "tool", "tool_call_id": "2", "content": "noon"}),
        json!({"role": "assistant", "content": "Sunny, at noon."}),
    ];
    let rendered = render_json(chatml, &messages, None, &Map::new(), false, "", "").unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>user\nWeather and time?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
         <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\nSunny, at noon.<|im_end|>\n"
    );
}

#[test]
fn malformed_requests_are_errors() {
    let template = golden("qwen2_5_chat_template.jinja");
    let user = |content: Value| json!({"role": "user", "content": content});
    let bad_call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}},
    ]});
    let bad_messages = [
        user(json!(42)),
        user(json!({"text": "hi"})),
        user(json!([{"type": "image_url", "image_url": {"url": "x"}}])),
        user(json!([{"type": "text", "text": 3}])),
        json!({"content": "no role"}),
        json!({"role": 7, "content": "hi"}),
        json!("not an object"),
        json!({"role": "assistant", "content": "x", "tool_calls": {"a": 1}}),
        json!({"role": "assistant", "content": "x", "tool_calls": [{"type": "function"}]}),
        bad_call,
    ];
    for message in bad_messages {
        let result =
            render_json(&template, std::slice::from_ref(&message), None, &Map::new(), true, "", "");
        assert!(result.is_err(), "{message}: {result:?}");
    }
    let hi = [user(json!("hi"))];
    assert!(
        render_json(&template, &hi, Some(&[json!("a tool")]), &Map::new(), true, "", "").is_err()
    );
    let raising = "{{ raise_exception('no system messages') }}";
    let error = render_json(raising, &hi, None, &Map::new(), true, "", "").unwrap_err();
    assert!(error.contains("no system messages"), "{error}");
    assert!(render_json("{% for %}", &hi, None, &Map::new(), true, "", "").is_err());
    assert!(!template_mentions_tools("{% for %}"));
}

/// Qwen 3's generation prompt, as its template writes it: thinking unless `enable_thinking` is
/// false, when an empty thinking block closes it at once.
const QWEN3_GENERATION_PROMPT: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
    {{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
    {% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n\
    {% endif %}{% endif %}";

#[test]
fn request_variables_reach_the_template_and_may_not_replace_the_servers() {
    let hi = [json!({"role": "user", "content": "hi"})];
    let render = |variables: Value| {
        let variables = variables.as_object().unwrap().clone();
        render_json(QWEN3_GENERATION_PROMPT, &hi, None, &variables, true, "", "")
    };
    let thinking = render(json!({})).unwrap();
    assert!(thinking.ends_with("<|im_start|>assistant\n"), "{thinking:?}");
    let plain = render(json!({"enable_thinking": false})).unwrap();
    assert!(plain.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{plain:?}");
    assert_eq!(render(json!({"enable_thinking": true})).unwrap(), thinking);
    for name in ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"] {
        let error = render(json!({ name: false })).unwrap_err();
        assert!(error.contains(name), "{error}");
    }
}
