//! A completion's text turned into content and tool calls, streamed or whole. Both run the same
//! steps on the same pieces (`split` cuts, `resolve` reads sections, `Emitter` writes deltas),
//! so a stream folds to what `parse_complete` returns however its text was chunked.

use super::resolve::resolve;
use super::split::{Piece, Splitter, split_whole};
use super::{ParsedCall, ToolDelta, ToolFormat, ToolSpec, fold_deltas};

/// Parses one completion's text as it streams. Never panics, never holds text back forever: at
/// finish() everything not part of a well-formed call comes out as Content.
///
/// Text outside markup comes out as soon as it cannot be the start of a marker (blank text
/// waits for what follows it, see `Emitter`). A tool section is held until its close marker,
/// then comes out as whole calls (`CallStart` and one `CallArguments` each), or as text if it
/// holds none. Llama 3's calls run to the end of the text, so they come out at finish().
#[derive(Debug)]
pub struct ToolCallStream {
    format: ToolFormat,
    splitter: Splitter,
    emitter: Emitter,
}

impl ToolCallStream {
    /// `tools` are the request's; the parsers do not look at them (see `resolve`), so a call
    /// to a tool the request did not offer comes out as a call like any other.
    pub fn new(format: ToolFormat, tools: &[ToolSpec]) -> ToolCallStream {
        let _ = tools;
        ToolCallStream { format, splitter: Splitter::new(format.markup()), emitter: Emitter::new() }
    }

    pub async fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        let pieces = self.splitter.push(text);
        self.emit(pieces).await
    }

    /// Ends the stream: whatever is held comes out. Calling it again gives nothing.
    pub async fn finish(&mut self) -> Vec<ToolDelta> {
        let pieces = self.splitter.finish();
        let mut deltas = self.emit(pieces).await;
        self.emitter.finish(&mut deltas);
        deltas
    }

    async fn emit(&mut self, pieces: Vec<Piece>) -> Vec<ToolDelta> {
        let mut deltas = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) => self.emitter.content(&text, &mut deltas),
                Piece::Section(section) => match resolve(self.format, &section).await {
                    Some((normal, calls)) => self.emitter.calls(&normal, calls, &mut deltas),
                    None => self.emitter.content(&section, &mut deltas),
                },
            }
        }
        deltas
    }
}

/// The whole text at once: (content left outside calls, calls). Malformed or half markup stays in
/// content.
pub async fn parse_complete(
    format: ToolFormat,
    text: &str,
    tools: &[ToolSpec],
) -> (String, Vec<ParsedCall>) {
    let _ = tools;
    let mut emitter = Emitter::new();
    let mut deltas = Vec::new();
    for piece in split_whole(format.markup(), text) {
        match piece {
            Piece::Text(text) => emitter.content(&text, &mut deltas),
            Piece::Section(section) => match resolve(format, &section).await {
                Some((normal, calls)) => emitter.calls(&normal, calls, &mut deltas),
                None => emitter.content(&section, &mut deltas),
            },
        }
    }
    emitter.finish(&mut deltas);
    fold_deltas(&deltas)
}

/// Writes deltas in order, numbering calls, and drops the blank text that touches a call: the
/// newlines a model writes between its content and a call, between calls and after the last
/// one belong to the markup (DSML's parser drops them too), and a client shown them gets a
/// stray "\n" of content next to its tool calls. Blank text elsewhere is content.
#[derive(Debug)]
struct Emitter {
    /// Blank text after the last content, waiting to see whether a call follows it.
    blank: String,
    /// The last thing written was a call: blank text now is dropped.
    after_call: bool,
    calls_count: usize,
}

impl Emitter {
    fn new() -> Emitter {
        Emitter { blank: String::new(), after_call: false, calls_count: 0 }
    }

    fn content(&mut self, text: &str, deltas: &mut Vec<ToolDelta>) {
        let text = if self.after_call { text.trim_start() } else { text };
        let body = text.trim_end();
        if body.is_empty() {
            self.blank.push_str(text);
            return;
        }
        self.after_call = false;
        let mut content = std::mem::take(&mut self.blank);
        content.push_str(body);
        deltas.push(ToolDelta::Content(content));
        self.blank.push_str(&text[body.len()..]);
    }

    fn calls(&mut self, normal: &str, calls: Vec<ParsedCall>, deltas: &mut Vec<ToolDelta>) {
        self.content(normal, deltas);
        self.blank.clear();
        for call in calls {
            let index = self.calls_count;
            self.calls_count += 1;
            deltas.push(ToolDelta::CallStart { index, name: call.name });
            deltas.push(ToolDelta::CallArguments { index, fragment: call.arguments });
        }
        self.after_call = true;
    }

    fn finish(&mut self, deltas: &mut Vec<ToolDelta>) {
        let blank = std::mem::take(&mut self.blank);
        if !blank.is_empty() {
            deltas.push(ToolDelta::Content(blank));
        }
    }
}
