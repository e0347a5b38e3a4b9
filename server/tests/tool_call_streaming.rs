//! Tool-call parsing streamed against whole, for every dialect: a completion chunked anywhere
//! (every split in two, and random cuts into many pieces, at character boundaries) folds to
//! what `parse_complete` gives for the whole text. Outputs are valid calls among text, and
//! garbage made of the dialects' markers, their prefixes, JSON pieces and calls. Valid calls
//! among text that holds no marker are also recovered exactly.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

#[path = "common/markup.rs"]
mod markup;

use lockstep_server::tool_calls::{
    ParsedCall, ToolCallStream, ToolDelta, ToolFormat, fold_deltas, parse_complete,
};
use markup::render_call;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Map, Value};

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(future)
}

/// A group of calls written together: one section, or consecutive Hermes sections.
fn render_group(format: ToolFormat, calls: &[(String, Value)], tight: bool) -> String {
    let each: Vec<String> =
        calls.iter().map(|(name, args)| render_call(format, name, args, tight)).collect();
    markup::render_group(format, &each)
}

fn format() -> impl Strategy<Value = ToolFormat> {
    prop::sample::select(ToolFormat::ALL.to_vec())
}

fn name() -> impl Strategy<Value = String> {
    "[a-z_][a-z0-9_]{0,10}"
}

/// Arguments any dialect can carry: DSML parameters are strings or numbers, and DSML strings are
/// raw text in the markup, so none holds `<`.
fn arguments() -> impl Strategy<Value = Value> {
    let value = prop_oneof![
        "[a-zA-Z0-9 ;,.:{}\\[\\]\"\\\\é😀-]{0,10}".prop_map(Value::from),
        any::<i32>().prop_map(Value::from),
    ];
    prop::collection::btree_map("[a-z]{1,6}", value, 0..4)
        .prop_map(|map| Value::Object(map.into_iter().collect::<Map<String, Value>>()))
}

fn call() -> impl Strategy<Value = (String, Value)> {
    (name(), arguments())
}

/// Text with no marker in it: no `<`, and no `{` (a Llama reply opening with one is a call).
fn plain_text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 \n\t.,;:!?'\"()\\[\\]}é😀-]{0,20}"
}

#[derive(Clone, Debug)]
enum Segment {
    Text(String),
    Calls(Vec<(String, Value)>),
}

/// A valid output: text and groups of calls. Llama 3 calls are the end of the reply, after text
/// and `<|python_tag|>` or as the whole reply.
fn valid_output() -> impl Strategy<Value = (ToolFormat, Vec<Segment>, bool)> {
    let segment = prop_oneof![
        plain_text().prop_map(Segment::Text),
        prop::collection::vec(call(), 1..4).prop_map(Segment::Calls),
    ];
    (format(), prop::collection::vec(segment, 0..6), any::<bool>()).prop_map(
        |(format, segments, tight)| {
            let mut merged: Vec<Segment> = Vec::new();
            for segment in segments {
                match (merged.last_mut(), segment) {
                    (Some(Segment::Text(last)), Segment::Text(text)) => last.push_str(&text),
                    (Some(Segment::Calls(last)), Segment::Calls(calls)) => last.extend(calls),
                    (_, segment) => merged.push(segment),
                }
            }
            if format == ToolFormat::Llama3Json {
                let calls: Vec<(String, Value)> = merged
                    .iter()
                    .flat_map(|s| match s {
                        Segment::Calls(calls) => calls.clone(),
                        Segment::Text(_) => Vec::new(),
                    })
                    .collect();
                let text = match merged.first() {
                    Some(Segment::Text(text)) if tight => Some(text.clone()),
                    _ => None,
                };
                merged = text.map(Segment::Text).into_iter().collect();
                if !calls.is_empty() {
                    merged.push(Segment::Calls(calls));
                }
            }
            (format, merged, tight)
        },
    )
}

fn render(format: ToolFormat, segments: &[Segment], tight: bool) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            Segment::Text(text) => out.push_str(text),
            Segment::Calls(calls) => {
                if format == ToolFormat::Llama3Json && !out.is_empty() {
                    out.push_str("<|python_tag|>");
                }
                out.push_str(&render_group(format, calls, tight));
            }
        }
    }
    out
}

/// The content a client should see: the text, less blank text touching a call (and for
/// DeepSeek V4.1, less all text after its first call).
fn expected_content(format: ToolFormat, segments: &[Segment]) -> String {
    let is_calls = |at: Option<&Segment>| matches!(at, Some(Segment::Calls(_)));
    let first_calls = segments.iter().position(|s| matches!(s, Segment::Calls(_)));
    let segments = match first_calls {
        Some(at) if format == ToolFormat::DsmlV41 => &segments[..=at],
        _ => segments,
    };
    let mut content = String::new();
    for (at, segment) in segments.iter().enumerate() {
        if let Segment::Text(text) = segment {
            let mut text = text.as_str();
            if at > 0 && is_calls(segments.get(at - 1)) {
                text = text.trim_start();
            }
            if is_calls(segments.get(at + 1)) {
                text = text.trim_end();
            }
            content.push_str(text);
        }
    }
    content
}

/// Fragments garbage is made of: every dialect's markers, their halves, JSON and call pieces.
fn fragment(format: ToolFormat) -> impl Strategy<Value = String> {
    const PIECES: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "<tool_call>\n",
        "\n</tool_call>",
        "<tool_",
        "</tool",
        "<|python_tag|>",
        "<|python",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁",
        "｜",
        "▁",
        "function",
        "\n```json\n",
        "\n```",
        "<｜DSML｜function_calls>",
        "</｜DSML｜function_calls>",
        "<｜DSML｜tool_calls>",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜invoke name=\"f\">",
        "</｜DSML｜invoke>",
        "<｜DSML｜parameter name=\"a\" string=\"true\">",
        "<｜DSML｜parameter name=\"b\" string=\"false\">",
        "</｜DSML｜parameter>",
        "<｜DSML｜ calls>",
        "</｜DSML｜ calls>",
        "<｜DSML｜ invoke name=\"f\">",
        "</｜DSML｜ invoke>",
        "<｜DSML｜ parameter name=\"a\" string=\"true\">",
        "</｜DSML｜ parameter>",
        "<｜DSML｜",
        "</｜DSML｜",
        "<｜DSML｜ ",
        "<｜end▁of▁sentence｜>",
        "{",
        "}",
        "\"",
        ";",
        "\\",
        "{\"name\": \"f\"",
        ", \"arguments\": {\"a\": 1}}",
        ", \"parameters\": {}}",
        "{\"a\": \"x;y\"}",
        "\n",
        " ",
    ];
    prop_oneof![
        3 => prop::sample::select(PIECES).prop_map(str::to_owned),
        1 => "[ -~é😀\n]{0,5}",
        1 => prop::collection::vec(call(), 1..3)
            .prop_map(move |calls| render_group(format, &calls, false)),
    ]
}

fn garbage() -> impl Strategy<Value = (ToolFormat, String)> {
    format().prop_flat_map(|format| {
        prop::collection::vec(fragment(format), 0..14)
            .prop_map(move |parts| (format, parts.concat()))
    })
}

async fn streamed(format: ToolFormat, chunks: &[&str]) -> (String, Vec<ParsedCall>) {
    let mut stream = ToolCallStream::new(format, &[]);
    let mut deltas: Vec<ToolDelta> = Vec::new();
    for chunk in chunks {
        deltas.extend(stream.push(chunk).await);
    }
    deltas.extend(stream.finish().await);
    fold_deltas(&deltas)
}

/// Checks every split in two and the random cuts; returns the whole parse.
fn check_agreement(format: ToolFormat, text: &str, cuts: &[Index]) -> (String, Vec<ParsedCall>) {
    block_on(async {
        let whole = parse_complete(format, text, &[]).await;
        let boundaries: Vec<usize> =
            text.char_indices().map(|(at, _)| at).chain([text.len()]).collect();
        for &at in &boundaries {
            let chunks = [&text[..at], &text[at..]];
            assert_eq!(
                streamed(format, &chunks).await,
                whole,
                "{format:?} split at {at}: {text:?}"
            );
        }
        let mut at: Vec<usize> =
            cuts.iter().map(|cut| boundaries[cut.index(boundaries.len())]).collect();
        at.sort_unstable();
        at.dedup();
        let mut chunks = Vec::new();
        let mut from = 0;
        for &to in at.iter().chain([&text.len()]) {
            chunks.push(&text[from..to]);
            from = to;
        }
        assert_eq!(streamed(format, &chunks).await, whole, "{format:?} cut into {chunks:?}");
        whole
    })
}

proptest! {
    #[test]
    fn valid_calls_stream_as_they_parse_and_are_recovered(
        (format, segments, tight) in valid_output(),
        cuts in prop::collection::vec(any::<Index>(), 0..8),
    ) {
        let text = render(format, &segments, tight);
        let (content, calls) = check_agreement(format, &text, &cuts);
        let expected: Vec<(String, Value)> = segments
            .iter()
            .flat_map(|s| match s {
                Segment::Calls(calls) => calls.clone(),
                Segment::Text(_) => Vec::new(),
            })
            .collect();
        let got: Vec<(String, Value)> = calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        prop_assert_eq!(got, expected, "{:?}: {:?}", format, text);
        prop_assert_eq!(content, expected_content(format, &segments), "{:?}: {:?}", format, text);
    }

    #[test]
    fn garbage_streams_as_it_parses(
        (format, text) in garbage(),
        cuts in prop::collection::vec(any::<Index>(), 0..8),
    ) {
        let (_, calls) = check_agreement(format, &text, &cuts);
        for call in calls {
            let arguments: Value = serde_json::from_str(&call.arguments).unwrap();
            prop_assert!(arguments.is_object() && !call.name.is_empty(), "{:?}", call);
        }
    }
}
