//! Each dialect on outputs shaped like its models' (one call, two calls, text before, malformed
//! JSON, markup cut off at the end), whole and streamed at every split and character by
//! character; and the deltas a stream emits as it goes.

use serde_json::{Value, json};

use super::*;

/// The first `bytes` of `text`, less the end of a character cut in half.
fn head(text: &str, bytes: usize) -> &str {
    let mut end = bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn call(name: &str, arguments: Value) -> (String, Value) {
    (name.to_owned(), arguments)
}

/// `text` parses to `content` and `calls` whole, split in two at every character boundary, and
/// one character at a time.
async fn check(format: ToolFormat, text: &str, content: &str, calls: &[(String, Value)]) {
    let whole = parse_complete(format, text, &[]).await;
    let got: Vec<(String, Value)> = whole
        .1
        .iter()
        .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).expect("arguments are JSON")))
        .collect();
    assert_eq!((whole.0.as_str(), got.as_slice()), (content, calls), "{format:?} whole: {text:?}");
    let mut cuts: Vec<Vec<&str>> = text
        .char_indices()
        .map(|(at, _)| at)
        .chain([text.len()])
        .map(|at| vec![&text[..at], &text[at..]])
        .collect();
    cuts.push(text.char_indices().map(|(at, c)| &text[at..at + c.len_utf8()]).collect());
    for chunks in cuts {
        let mut stream = ToolCallStream::new(format, &[]);
        let mut deltas = Vec::new();
        for chunk in &chunks {
            deltas.extend(stream.push(chunk).await);
        }
        deltas.extend(stream.finish().await);
        assert_eq!(fold_deltas(&deltas), whole, "{format:?} streamed as {chunks:?}");
    }
}

#[tokio::test]
async fn hermes() {
    let f = ToolFormat::Hermes;
    let weather = r#"<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
</tool_call>"#;
    let paris = call("get_weather", json!({"city": "Paris", "unit": "celsius"}));
    check(f, weather, "", std::slice::from_ref(&paris)).await;
    let two = format!(
        "{weather}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>"
    );
    check(f, &two, "", &[paris.clone(), call("get_time", json!({}))]).await;
    let before = format!("I'll check the weather in Paris.\n{weather}");
    check(f, &before, "I'll check the weather in Paris.", std::slice::from_ref(&paris)).await;
    // Without the newlines Qwen writes (small models, our fallback prompt): still a call.
    let tight = r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>"#;
    check(f, tight, "", std::slice::from_ref(&paris)).await;
    // A call to a tool nobody offered is a call: the server decides.
    let unknown = r#"<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>"#;
    check(f, unknown, "", &[call("rm_rf", json!({"path": "/"}))]).await;
    let malformed = "Let me see.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>";
    check(f, malformed, malformed, &[]).await;
    let cut = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu";
    check(f, cut, cut, &[]).await;
    // Text after a call, and a malformed call next to a good one, stay content.
    let mixed = format!("{weather}\n<tool_call>{{oops}}</tool_call>\nDone.");
    check(f, &mixed, "<tool_call>{oops}</tool_call>\nDone.", std::slice::from_ref(&paris)).await;
    check(f, "plain answer, no tools <tool", "plain answer, no tools <tool", &[]).await;
}

#[tokio::test]
async fn llama3_json() {
    let f = ToolFormat::Llama3Json;
    let weather = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#;
    let paris = call("get_weather", json!({"city": "Paris"}));
    check(f, weather, "", std::slice::from_ref(&paris)).await;
    check(f, &format!("<|python_tag|>{weather}"), "", std::slice::from_ref(&paris)).await;
    let two = format!("{weather}; {{\"name\": \"get_time\", \"parameters\": {{\"tz\": \"CET\"}}}}");
    check(f, &two, "", &[paris.clone(), call("get_time", json!({"tz": "CET"}))]).await;
    let before = format!("Let me look that up. <|python_tag|>{weather}");
    check(f, &before, "Let me look that up.", std::slice::from_ref(&paris)).await;
    // A `;` inside an argument: LlamaParser alone loses this call (see resolve.rs).
    let sql = r#"{"name": "query", "parameters": {"sql": "SELECT 1; SELECT 2"}}"#;
    check(f, sql, "", &[call("query", json!({"sql": "SELECT 1; SELECT 2"}))]).await;
    let malformed = r#"{"name": "get_weather", "parameters": {"city": "Paris"}"#;
    check(f, malformed, malformed, &[]).await;
    let cut = "Checking <|python_tag|>{\"name\": \"get_";
    check(f, cut, cut, &[]).await;
    let trailing = format!("{weather} and then some prose");
    check(f, &trailing, &trailing, &[]).await;
    check(f, "  {braces} in prose", "  {braces} in prose", &[]).await;
    check(f, "Paris is sunny today.", "Paris is sunny today.", &[]).await;
}

#[tokio::test]
async fn deepseek_v3() {
    let f = ToolFormat::DeepSeekV3;
    let one = |name: &str, args: &str| {
        format!(
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
        )
    };
    let weather = one("get_weather", r#"{"city": "Paris"}"#);
    let paris = call("get_weather", json!({"city": "Paris"}));
    let section = |calls: &str| format!("<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>");
    check(f, &section(&weather), "", std::slice::from_ref(&paris)).await;
    let two = section(&format!("{weather}\n{}", one("get_time", "{}")));
    check(f, &two, "", &[paris.clone(), call("get_time", json!({}))]).await;
    let before = format!("I'll check ```this```.{}", section(&weather));
    check(f, &before, "I'll check ```this```.", std::slice::from_ref(&paris)).await;
    let malformed = section(&one("get_weather", r#"{"city": "Par"#));
    check(f, &malformed, &malformed, &[]).await;
    let cut = format!("Sure.<｜tool▁calls▁begin｜>{}", head(&weather, 60));
    check(f, &cut, &cut, &[]).await;
}

#[tokio::test]
async fn deepseek_v31() {
    let f = ToolFormat::DeepSeekV31;
    let one = |name: &str, args: &str| {
        format!("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>")
    };
    let section = |calls: &str| format!("<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>");
    let weather = one("get_weather", r#"{"city": "Paris"}"#);
    let paris = call("get_weather", json!({"city": "Paris"}));
    check(f, &section(&weather), "", std::slice::from_ref(&paris)).await;
    let two = section(&format!("{weather}{}", one("get_time", r#"{"tz": "CET"}"#)));
    check(f, &two, "", &[paris.clone(), call("get_time", json!({"tz": "CET"}))]).await;
    let before = format!("Checking the forecast.\n\n{}", section(&weather));
    check(f, &before, "Checking the forecast.", std::slice::from_ref(&paris)).await;
    let malformed = section(&one("get_weather", "{city: Paris}"));
    check(f, &malformed, &malformed, &[]).await;
    let cut = format!("Sure.{}", head(&section(&weather), 50));
    check(f, &cut, &cut, &[]).await;
    // A call outside a section is text.
    check(f, &weather, &weather, &[]).await;
}

/// A DSML dialect's invoke and parameter tags, and its block around invokes.
struct DsmlText {
    tags: super::format::Dsml,
}

impl DsmlText {
    fn new(f: ToolFormat) -> DsmlText {
        DsmlText { tags: f.dsml().expect("a DSML dialect") }
    }

    fn invoke(&self, name: &str, params: &str) -> String {
        let t = &self.tags;
        format!("{}{name}\">\n{params}{}\n", t.invoke_open, t.invoke_close)
    }

    fn param(&self, name: &str, string: bool, value: &str) -> String {
        let t = &self.tags;
        format!(
            "{} name=\"{name}\" string=\"{string}\">{value}{}\n",
            t.parameter_open, t.parameter_close
        )
    }

    fn section(&self, invokes: &str) -> String {
        format!("{}\n{invokes}{}", self.tags.block_open, self.tags.block_close)
    }
}

async fn dsml(f: ToolFormat) {
    let d = DsmlText::new(f);
    let weather =
        d.invoke("get_weather", &(d.param("city", true, "Paris") + &d.param("days", false, "3")));
    let paris = call("get_weather", json!({"city": "Paris", "days": 3}));
    check(f, &d.section(&weather), "", std::slice::from_ref(&paris)).await;
    let two = d.section(&format!("{weather}{}", d.invoke("get_time", &d.param("tz", true, "CET"))));
    check(f, &two, "", &[paris.clone(), call("get_time", json!({"tz": "CET"}))]).await;
    let before = format!("Let me check that.\n\n{}", d.section(&weather));
    check(f, &before, "Let me check that.", std::slice::from_ref(&paris)).await;
    let direct = d.section(&d.invoke("get_weather", "{\"city\": \"Paris\", \"days\": 3}\n"));
    check(f, &direct, "", std::slice::from_ref(&paris)).await;
    // DsmlParser passes a `{...}` body through unparsed; we drop it, and the section is text.
    let malformed = d.section(&d.invoke("get_weather", "{\"city\": Paris}\n"));
    check(f, &malformed, &malformed, &[]).await;
    let cut = format!("Sure.\n\n{}", head(&d.section(&weather), 70));
    check(f, &cut, &cut, &[]).await;
}

#[tokio::test]
async fn dsml_v32() {
    dsml(ToolFormat::DsmlV32).await;
    // Text after a block is content.
    let d = DsmlText::new(ToolFormat::DsmlV32);
    let after = format!("{}\nDone.", d.section(&d.invoke("f", "")));
    check(ToolFormat::DsmlV32, &after, "Done.", &[call("f", json!({}))]).await;
}

#[tokio::test]
async fn dsml_v4() {
    dsml(ToolFormat::DsmlV4).await;
}

#[tokio::test]
async fn dsml_v41() {
    let f = ToolFormat::DsmlV41;
    dsml(f).await;
    let d = DsmlText::new(f);
    let weather = d.invoke("get_weather", &d.param("city", true, "Paris"));
    let paris = call("get_weather", json!({"city": "Paris"}));
    // An invoke without a block is a call, and so is each one after it.
    let bare = format!("Checking.\n\n{weather}{}", d.invoke("get_time", ""));
    check(f, &bare, "Checking.", &[paris.clone(), call("get_time", json!({}))]).await;
    // From the first call on nothing is content: text after the block, or between invokes.
    let after = format!("{}\nDone.<think>x</think>", d.section(&weather));
    check(f, &after, "", std::slice::from_ref(&paris)).await;
    let between = format!("{weather}and then{}", d.section(&d.invoke("get_time", "")));
    check(f, &between, "", &[paris.clone(), call("get_time", json!({}))]).await;
    // The other dialects' tags are text to it.
    let v4 = DsmlText::new(ToolFormat::DsmlV4);
    let other = v4.section(&v4.invoke("get_weather", &v4.param("city", true, "Paris")));
    check(f, &other, &other, &[]).await;
}

/// V4.1 whole texts against the reference (tool-parser's V4.1 `parse_complete` on the whole
/// text, not a section): the same calls, and the same content but for blank text touching a
/// call, which we drop (the module docs list where else we read differently on purpose).
#[tokio::test]
async fn dsml_v41_whole_texts_read_as_the_reference_reads_them() {
    use tool_parser::{DeepSeekDsmlParser, ToolParser};
    let f = ToolFormat::DsmlV41;
    let d = DsmlText::new(f);
    let a = d.invoke("f", &d.param("a", true, "1"));
    let b = d.invoke("g", &d.param("b", false, "2"));
    let reference = DeepSeekDsmlParser::v41();
    for text in [
        format!("Sure.\n\n{}", d.section(&a)),
        format!("Sure.\n\n{}tail", d.section(&a)),
        format!("Sure. {}", d.section(&format!("{a}{b}"))),
        format!("Sure.\n\n{}\n{}", d.section(&a), d.section(&b)),
        format!("x {a} y {b} z"),
        format!("{}{b}", d.section(&a)),
        // A block never closed.
        format!("x {}\n{a}", d.tags.block_open),
        "no calls".to_owned(),
    ] {
        let (content, calls) = parse_complete(f, &text, &[]).await;
        let calls: Vec<_> = calls.into_iter().map(|c| (c.name, c.arguments)).collect();
        let (expected, expected_calls) = reference.parse_complete(&text).await.unwrap();
        let expected_calls: Vec<_> =
            expected_calls.into_iter().map(|c| (c.function.name, c.function.arguments)).collect();
        assert!(!expected_calls.is_empty() || text == "no calls", "{text:?}");
        assert_eq!(calls, expected_calls, "{text:?}");
        assert_eq!(content, expected.trim_end(), "{text:?}");
    }
}

#[test]
fn dsml_tags_are_the_tool_parsers() {
    use tool_parser::parsers::DsmlDialect;
    for (format, dialect) in [
        (ToolFormat::DsmlV32, DsmlDialect::V32),
        (ToolFormat::DsmlV4, DsmlDialect::V4),
        (ToolFormat::DsmlV41, DsmlDialect::V41),
    ] {
        let tags = format.dsml().unwrap();
        let dsml = "｜DSML｜";
        assert_eq!(tags.block_open, format!("<{dsml}{}>", dialect.block()));
        assert_eq!(tags.block_close, format!("</{dsml}{}>", dialect.block()));
        assert_eq!(tags.invoke_open, format!("<{dsml}{} name=\"", dialect.invoke()));
        assert_eq!(tags.invoke_close, format!("</{dsml}{}>", dialect.invoke()));
        assert_eq!(tags.parameter_open, format!("<{dsml}{}", dialect.parameter()));
        assert_eq!(tags.parameter_close, format!("</{dsml}{}>", dialect.parameter()));
    }
}

#[tokio::test]
async fn content_streams_before_the_stream_ends() {
    let mut stream = ToolCallStream::new(ToolFormat::Hermes, &[]);
    assert_eq!(stream.push("Hello wor").await, vec![ToolDelta::Content("Hello wor".into())]);
    // Blank text and a possible marker wait; the rest goes.
    assert_eq!(stream.push("ld. <tool").await, vec![ToolDelta::Content("ld.".into())]);
    assert_eq!(
        stream.push("box> is not").await,
        vec![ToolDelta::Content(" <toolbox> is not".into())]
    );
    let call = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>";
    assert_eq!(stream.push(" a call.\n").await, vec![ToolDelta::Content(" a call.".into())]);
    assert_eq!(stream.push(head(call, 20)).await, vec![]);
    assert_eq!(
        stream.push(&call[head(call, 20).len()..]).await,
        vec![
            ToolDelta::CallStart { index: 0, name: "f".into() },
            ToolDelta::CallArguments { index: 0, fragment: "{\"x\":1}".into() },
        ]
    );
    assert_eq!(stream.push("\n").await, vec![]);
    assert_eq!(stream.finish().await, vec![]);
    assert_eq!(stream.finish().await, vec![]);
}

#[test]
fn names_round_trip_and_unknown_names_list_the_valid_ones() {
    for format in ToolFormat::ALL {
        assert_eq!(ToolFormat::from_name(format.name()), Ok(format));
    }
    let error = ToolFormat::from_name("mistral").unwrap_err();
    assert!(
        error.contains(
            "hermes, llama3_json, deepseek_v3, deepseek_v31, dsml_v32, dsml_v4, dsml_v41"
        )
    );
}

#[test]
fn formats_are_detected_from_template_markers() {
    let detect = ToolFormat::detect;
    let qwen =
        "{%- if tools %}...<tool_call>\\n{\"name\": <function-name>...</tool_call>{% endif %}";
    assert_eq!(detect(qwen), Some(ToolFormat::Hermes));
    assert_eq!(detect("{{- \"<|python_tag|>\" + tool_call.name }}"), Some(ToolFormat::Llama3Json));
    let llama32 =
        "<|start_header_id|>ipython<|end_header_id|>\\n\\n{{ message.content }}<|eot_id|>";
    assert_eq!(detect(llama32), Some(ToolFormat::Llama3Json));
    let v3 = "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json'";
    assert_eq!(detect(v3), Some(ToolFormat::DeepSeekV3));
    let v31 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args";
    assert_eq!(detect(v31), Some(ToolFormat::DeepSeekV31));
    assert_eq!(detect("<｜DSML｜function_calls>"), Some(ToolFormat::DsmlV32));
    assert_eq!(detect("<｜DSML｜tool_calls>"), Some(ToolFormat::DsmlV4));
    assert_eq!(detect("'\\n\\n<｜DSML｜ calls>\\n'"), Some(ToolFormat::DsmlV41));
    let smollm = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
    assert_eq!(detect(smollm), None);
    // It never reads `tools`, so tools reach the model as our Hermes system message.
    assert_eq!(ToolFormat::for_template(smollm), Some(ToolFormat::Hermes));
    let unknown = "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}";
    assert_eq!(ToolFormat::for_template(unknown), None);
}

#[test]
fn fold_never_panics_on_odd_deltas() {
    let deltas = [
        ToolDelta::CallArguments { index: usize::MAX, fragment: "{}".into() },
        ToolDelta::Content("a".into()),
        ToolDelta::CallStart { index: 3, name: "f".into() },
    ];
    let (content, calls) = fold_deltas(&deltas);
    assert_eq!(content, "a");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].name, "f");
}

/// The server drives streams from spawned tasks: the stream and its futures must be `Send`.
#[test]
fn streams_and_their_futures_are_send() {
    fn send<T: Send>(_: &T) {}
    let mut stream = ToolCallStream::new(ToolFormat::Hermes, &[]);
    send(&stream);
    send(&stream.push("x"));
    send(&stream.finish());
    send(&parse_complete(ToolFormat::Hermes, "x", &[]));
}
