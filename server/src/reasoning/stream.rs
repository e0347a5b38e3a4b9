//! A completion's text split into reasoning and content as it streams, by reasoning-parser's
//! parser for the format, fed by `cut` one marker or one marker-free text at a time; and its
//! tokens counted as reasoning or not, for `usage.completion_tokens_details.reasoning_tokens`.
//!
//! A token counts as reasoning when all of its text is reasoning: the thinking's markers are not
//! (as vLLM counts them), nor is a token that reaches across one. A token with no text of its own
//! (an end-of-sequence token; one whose text a stop string's prefix holds back and a later piece
//! brings) counts as reasoning when the completion is inside its thinking once everything before
//! it is placed. Counting needs each token's text placed first, and the cutter may hold the end of
//! it back: tokens wait in `unplaced` until it comes out.

use std::collections::VecDeque;
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
    /// The pushes whose text the cutter still holds some of, oldest first.
    unplaced: VecDeque<Unplaced>,
    reasoning_tokens: u32,
}

/// One push's tokens, until all of its text is placed.
#[derive(Debug)]
struct Unplaced {
    tokens: u32,
    /// Its bytes not placed yet.
    bytes: usize,
    /// Whether it had text at all.
    text: bool,
    /// Whether every byte of it placed so far was reasoning.
    reasoning: bool,
}

impl std::fmt::Debug for ReasoningStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReasoningStream")
            .field("cutter", &self.cutter)
            .field("in_reasoning", &self.in_reasoning())
            .field("unplaced", &self.unplaced)
            .field("reasoning_tokens", &self.reasoning_tokens)
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
        ReasoningStream {
            cutter: Cutter::new(&format.markers()),
            parser,
            unplaced: VecDeque::new(),
            reasoning_tokens: 0,
        }
    }

    /// Text with no tokens to count (the whole of a completion, a test's chunk).
    pub fn push(&mut self, text: &str) -> Vec<ReasoningDelta> {
        self.push_tokens(text, 0)
    }

    /// The text of `tokens` generated tokens.
    pub fn push_tokens(&mut self, text: &str, tokens: u32) -> Vec<ReasoningDelta> {
        self.unplaced.push_back(Unplaced {
            tokens,
            bytes: text.len(),
            text: !text.is_empty(),
            reasoning: true,
        });
        let pieces = self.cutter.push(text);
        let deltas = self.feed(pieces);
        self.count_placed();
        deltas
    }

    /// Ends the stream: whatever is held comes out. Calling it again gives nothing.
    pub fn finish(&mut self) -> Vec<ReasoningDelta> {
        let pieces = self.cutter.finish();
        let deltas = self.feed(pieces);
        self.count_placed();
        deltas
    }

    /// The tokens counted as reasoning so far; all of them once `finish` was called.
    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    /// Whether what was placed so far leaves the completion inside its thinking.
    fn in_reasoning(&self) -> bool {
        self.parser.as_ref().is_some_and(|p| p.is_in_reasoning())
    }

    /// What must hold between calls: the bytes of the pushes not yet counted are exactly the
    /// bytes the cutter holds (the parser holds none: it is flushed after every piece).
    pub fn check_invariants(&self) {
        let unplaced: usize = self.unplaced.iter().map(|u| u.bytes).sum();
        assert_eq!(unplaced, self.cutter.held_len(), "{self:?}");
        assert!(self.unplaced.front().is_none_or(|u| u.bytes > 0), "{self:?}");
    }

    fn feed(&mut self, pieces: Vec<Piece>) -> Vec<ReasoningDelta> {
        let mut deltas = Vec::new();
        for piece in pieces {
            let text = match piece {
                Piece::Text(text) => text,
                Piece::Marker(marker) => marker.to_owned(),
            };
            let Some(parser) = self.parser.as_mut() else {
                self.place(text.len(), false);
                push_delta(&mut deltas, ReasoningDelta::Content(text));
                continue;
            };
            let mut reasoning_bytes = 0;
            for part in char_chunks(&text, PIECE_BYTES_MAX) {
                // A piece alone, then flushed: the parser holds nothing between pieces, so a
                // text that looks like the start of a marker is placed now, not joined to the
                // marker after it.
                let placed = parser.parse_reasoning_streaming_incremental(part);
                let flushed = parser.flush();
                match (placed, flushed) {
                    (Ok(placed), Ok(flushed)) => {
                        reasoning_bytes +=
                            placed.reasoning_text.len() + flushed.reasoning_text.len();
                        push_result(&mut deltas, placed);
                        push_result(&mut deltas, flushed);
                    }
                    // Not reached with pieces this small; the text is kept all the same.
                    _ => push_delta(&mut deltas, ReasoningDelta::Content(part.to_owned())),
                }
            }
            // A piece is one marker or text without one, so the parser places it whole: as
            // reasoning, as content, or (a marker it acts on) as neither.
            self.place(text.len(), reasoning_bytes == text.len());
        }
        deltas
    }

    /// The oldest pushes' next `bytes` came out as reasoning or not. Called right after the
    /// parser took them, so that a push with no text that follows them is counted by the state
    /// they leave, not by what later pieces do to it.
    fn place(&mut self, mut bytes: usize, reasoning: bool) {
        self.count_placed();
        while bytes > 0 {
            let Some(front) = self.unplaced.front_mut() else { return };
            let taken = bytes.min(front.bytes);
            front.bytes -= taken;
            front.reasoning &= reasoning;
            bytes -= taken;
            self.count_placed();
        }
    }

    /// Counts the oldest pushes whose text is all placed.
    fn count_placed(&mut self) {
        while let Some(front) = self.unplaced.front()
            && front.bytes == 0
        {
            let reasoning = if front.text { front.reasoning } else { self.in_reasoning() };
            if reasoning {
                self.reasoning_tokens = self.reasoning_tokens.saturating_add(front.tokens);
            }
            self.unplaced.pop_front();
        }
    }
}

/// The whole text at once: (reasoning, content).
pub fn split_whole(format: ReasoningFormat, opening: Opening, text: &str) -> (String, String) {
    let mut stream = ReasoningStream::new(format, opening);
    let mut deltas = stream.push(text);
    deltas.extend(stream.finish());
    join_deltas(deltas)
}

/// Deltas folded into (reasoning, content).
pub fn join_deltas(deltas: Vec<ReasoningDelta>) -> (String, String) {
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
