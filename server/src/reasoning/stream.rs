//! A completion's text split into reasoning and content as it streams, by reasoning-parser's
//! parser for the format, fed by `cut` one marker or one marker-free text at a time.

use std::sync::LazyLock;

use reasoning_parser::{ParserFactory, ParserResult, ReasoningParser};

use super::cut::{Cutter, Piece};
use super::{Opening, ReasoningDelta, ReasoningFormat};

/// reasoning-parser's registry, built once: parsers are made from it per completion.
pub(super) static PARSERS: LazyLock<ParserFactory> = LazyLock::new(ParserFactory::new);

/// The most text handed to the parser at once, well under its buffer bound (4 MiB), past which
/// it refuses text.
const PIECE_BYTES_MAX: usize = 1 << 16;

/// Splits one completion's text as it streams. Never panics, never loses text: what the parser
/// cannot place comes out as content.
pub struct ReasoningStream {
    cutter: Cutter,
    /// None when the prompt closed the thinking: everything is content.
    parser: Option<Box<dyn ReasoningParser>>,
}

impl std::fmt::Debug for ReasoningStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReasoningStream")
            .field("cutter", &self.cutter)
            .field("in_reasoning", &self.parser.as_ref().map(|p| p.is_in_reasoning()))
            .finish()
    }
}

impl ReasoningStream {
    /// For a completion whose turn starts as `opening` says (`ReasoningFormat::opening` of its
    /// prompt).
    pub fn new(format: ReasoningFormat, opening: Opening) -> ReasoningStream {
        let parser = match opening {
            Opening::Closed => None,
            Opening::ByParser => PARSERS.registry().create_parser(format.name),
            Opening::Inside => PARSERS.registry().create_parser(format.name).map(|mut parser| {
                parser.mark_reasoning_started();
                parser.mark_think_start_stripped();
                parser
            }),
        };
        ReasoningStream { cutter: Cutter::new([format.start, format.end]), parser }
    }

    pub fn push(&mut self, text: &str) -> Vec<ReasoningDelta> {
        let pieces = self.cutter.push(text);
        self.feed(pieces)
    }

    /// Ends the stream: whatever is held comes out. Calling it again gives nothing.
    pub fn finish(&mut self) -> Vec<ReasoningDelta> {
        let pieces = self.cutter.finish();
        self.feed(pieces)
    }

    fn feed(&mut self, pieces: Vec<Piece>) -> Vec<ReasoningDelta> {
        let mut deltas = Vec::new();
        for piece in pieces {
            let text = match piece {
                Piece::Text(text) => text,
                Piece::Marker(marker) => marker.to_owned(),
            };
            let Some(parser) = self.parser.as_mut() else {
                push_delta(&mut deltas, ReasoningDelta::Content(text));
                continue;
            };
            for part in char_chunks(&text, PIECE_BYTES_MAX) {
                // A piece alone, then flushed: the parser holds nothing between pieces, so a
                // text that looks like the start of a marker is placed now, not joined to the
                // marker after it.
                let placed = parser.parse_reasoning_streaming_incremental(part);
                let flushed = parser.flush();
                match (placed, flushed) {
                    (Ok(placed), Ok(flushed)) => {
                        push_result(&mut deltas, placed);
                        push_result(&mut deltas, flushed);
                    }
                    // Not reached with pieces this small; the text is kept all the same.
                    _ => push_delta(&mut deltas, ReasoningDelta::Content(part.to_owned())),
                }
            }
        }
        deltas
    }
}

/// The whole text at once: (reasoning, content).
pub fn split_whole(format: ReasoningFormat, opening: Opening, text: &str) -> (String, String) {
    let mut stream = ReasoningStream::new(format, opening);
    let mut deltas = stream.push(text);
    deltas.extend(stream.finish());
    let (mut reasoning, mut content) = (String::new(), String::new());
    for delta in deltas {
        match delta {
            ReasoningDelta::Reasoning(text) => reasoning.push_str(&text),
            ReasoningDelta::Content(text) => content.push_str(&text),
        }
    }
    (reasoning, content)
}

fn push_result(deltas: &mut Vec<ReasoningDelta>, result: ParserResult) {
    // The parser gives a piece's reasoning before its content (a piece ending the reasoning).
    push_delta(deltas, ReasoningDelta::Reasoning(result.reasoning_text));
    push_delta(deltas, ReasoningDelta::Content(result.normal_text));
}

/// Appends `delta`, joined to the last one when of the same kind; empty text is dropped.
fn push_delta(deltas: &mut Vec<ReasoningDelta>, delta: ReasoningDelta) {
    match (deltas.last_mut(), delta) {
        (_, ReasoningDelta::Reasoning(t) | ReasoningDelta::Content(t)) if t.is_empty() => {}
        (Some(ReasoningDelta::Reasoning(last)), ReasoningDelta::Reasoning(t))
        | (Some(ReasoningDelta::Content(last)), ReasoningDelta::Content(t)) => last.push_str(&t),
        (_, delta) => deltas.push(delta),
    }
}

/// `text` in pieces of at most `max` bytes (more for a character longer than that), cut at
/// character boundaries.
fn char_chunks(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        let (head, tail) = rest.split_at(end);
        rest = tail;
        Some(head)
    })
}
