//! What the `tool_calls_*` targets share: input bytes become a completion cut into chunks (bytes
//! 0xF8 and up cut, 0x80 to 0xF7 pick a word of tool markup, the rest are ASCII), and the chunks
//! go through `ToolCallStream`. No panic in push or finish; the stream folds to what
//! `parse_complete` gives for the whole text; every call has a name and object arguments.
//! Words make markers reachable: libFuzzer's comparison tracing does not see into `str::find`.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use lockstep_server::tool_calls::{ToolCallStream, ToolFormat, fold_deltas, parse_complete};

const WORDS: &[&str] = &[
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
    "<｜DSML｜",
    "</｜DSML｜",
    "<｜DSML｜ calls>",
    "</｜DSML｜ calls>",
    "<｜DSML｜ invoke name=\"f\">",
    "</｜DSML｜ invoke>",
    "<｜DSML｜ parameter name=\"a\" string=\"true\">",
    "<｜DSML｜ parameter name=\"b\" string=\"false\">",
    "</｜DSML｜ parameter>",
    // V4.1 openers cut in two: a stream must hold back a partial marker of each opener.
    "<｜DSML｜ inv",
    "oke name=\"f\">",
    "<｜DSML｜ ca",
    "lls>",
    "<｜end▁of▁sentence｜>",
    "{\"name\": \"f\"",
    ", \"arguments\": {\"a\": 1}}",
    ", \"parameters\": {}}",
    "{\"a\": \"x;y\"}",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
    "null",
    "true",
    "1e400",
    "\\u003b",
    "\\ud800",
    "é",
    "😀",
    "\u{2028}",
    "\u{a0}",
];

pub fn run(format: ToolFormat, bytes: &[u8]) {
    let chunks = chunks(bytes);
    let text = chunks.concat();
    let whole = block_on(parse_complete(format, &text, &[]));
    let mut stream = ToolCallStream::new(format, &[]);
    let mut deltas = Vec::new();
    for chunk in &chunks {
        deltas.extend(block_on(stream.push(chunk)));
    }
    deltas.extend(block_on(stream.finish()));
    assert_eq!(fold_deltas(&deltas), whole, "{format:?} streamed as {chunks:?}");
    for call in &whole.1 {
        let arguments: Result<serde_json::Value, _> = serde_json::from_str(&call.arguments);
        assert!(!call.name.is_empty() && arguments.is_ok_and(|a| a.is_object()), "{call:?}");
    }
}

fn chunks(bytes: &[u8]) -> Vec<String> {
    let mut chunks = vec![String::new()];
    for &byte in bytes {
        match byte {
            0xF8.. => chunks.push(String::new()),
            0x80.. => push(&mut chunks, WORDS[usize::from(byte - 0x80) % WORDS.len()]),
            ascii => push(&mut chunks, char::from(ascii).encode_utf8(&mut [0; 4])),
        }
    }
    chunks
}

fn push(chunks: &mut [String], text: &str) {
    if let Some(last) = chunks.last_mut() {
        last.push_str(text);
    }
}

/// The parsers' futures never wait on anything (tool-parser's async functions do no IO), so one
/// poll finishes them; a loop keeps this honest if that ever changes.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
    }
}
