//! Cuts a completion into plain text and tool sections (one of a dialect's open markers up to its
//! close marker, or to the end of the text), as it streams or all at once. Both ways cut the same text
//! the same way whatever the chunking; the property test and the fuzz targets hold them to it.
//! What a section means is `resolve`'s business; this file only finds where sections are.

use super::format::Markup;

/// One cut of a completion, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Piece {
    /// Text outside markup (or markup that never closed).
    Text(String),
    /// A whole section, markers included, for the dialect's parser to read.
    Section(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Only blank text so far, in a dialect where a leading `{` makes the whole text a section.
    Start,
    Text,
    /// Inside a section, waiting for its close marker.
    Section,
    /// Inside a section that runs to the end of the text.
    ToEnd,
}

/// The streaming cutter. Text comes out as soon as it cannot be the start of an open marker;
/// a section comes out whole once its close marker has arrived.
#[derive(Debug)]
pub(super) struct Splitter {
    markup: Markup,
    state: State,
    /// Text not yet cut: a possible open-marker prefix, or the section so far.
    held: String,
    /// In `State::Section`, bytes of `held` already searched for the close marker, so that a
    /// long section arriving in small chunks is searched once, not once per chunk.
    searched: usize,
}

impl Splitter {
    pub fn new(markup: Markup) -> Splitter {
        let state = if markup.bare_json { State::Start } else { State::Text };
        Splitter { markup, state, held: String::new(), searched: 0 }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut pieces = Vec::new();
        // Each pass either cuts a piece from `held` or returns: at most one pass per piece.
        loop {
            match self.state {
                State::Start => match self.held.trim_start().chars().next() {
                    None => return pieces,
                    Some('{') => self.state = State::ToEnd,
                    Some(_) => self.state = State::Text,
                },
                State::Text => {
                    if !self.cut_text(&mut pieces) {
                        return pieces;
                    }
                }
                State::Section => {
                    if !self.cut_section(&mut pieces) {
                        return pieces;
                    }
                }
                State::ToEnd => return pieces,
            }
        }
    }

    /// What is still held: a section that never closed and any marker prefix are text, a section
    /// that runs to the end is a section. The splitter is spent afterwards.
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        let state = std::mem::replace(&mut self.state, State::Text);
        match state {
            _ if held.is_empty() => Vec::new(),
            State::ToEnd => vec![Piece::Section(held)],
            State::Start | State::Text | State::Section => vec![Piece::Text(held)],
        }
    }

    /// In text: cuts the text before an open marker and enters the section (true), or lets out
    /// all text that cannot begin a marker and waits (false).
    fn cut_text(&mut self, pieces: &mut Vec<Piece>) -> bool {
        match first_open(self.markup, &self.held) {
            Some((at, open)) => {
                push_text(pieces, self.held.drain(..at).collect());
                self.state =
                    if self.markup.close.is_some() { State::Section } else { State::ToEnd };
                self.searched = open.len();
                true
            }
            None => {
                let keep = self
                    .markup
                    .opens
                    .iter()
                    .map(|open| partial_prefix_len(&self.held, open))
                    .max()
                    .unwrap_or(0);
                let out: String = self.held.drain(..self.held.len() - keep).collect();
                push_text(pieces, out);
                false
            }
        }
    }

    /// In a section: cuts it once its close marker is held (true), or waits (false).
    fn cut_section(&mut self, pieces: &mut Vec<Piece>) -> bool {
        let Some(close) = self.markup.close else { return false };
        let from = self.searched;
        match self.held[from..].find(close) {
            Some(at) => {
                let end = from + at + close.len();
                pieces.push(Piece::Section(self.held.drain(..end).collect()));
                self.state = State::Text;
                true
            }
            None => {
                // A close marker may begin in the last `close.len() - 1` bytes; search them again.
                let mut next = self.held.len().saturating_sub(close.len() - 1).max(from);
                while !self.held.is_char_boundary(next) {
                    next -= 1;
                }
                self.searched = next;
                false
            }
        }
    }
}

/// The same cut of a whole text at once, written plainly from `find` so that it can check the
/// streaming cutter.
pub(super) fn split_whole(markup: Markup, text: &str) -> Vec<Piece> {
    if markup.bare_json && text.trim_start().starts_with('{') {
        return vec![Piece::Section(text.to_owned())];
    }
    let mut pieces = Vec::new();
    let mut rest = text;
    while let Some((at, open)) = first_open(markup, rest) {
        push_text(&mut pieces, rest[..at].to_owned());
        let section = &rest[at..];
        let Some(close) = markup.close else {
            pieces.push(Piece::Section(section.to_owned()));
            return pieces;
        };
        let Some(close_at) = section[open.len()..].find(close) else {
            push_text(&mut pieces, section.to_owned());
            return pieces;
        };
        let end = open.len() + close_at + close.len();
        pieces.push(Piece::Section(section[..end].to_owned()));
        rest = &section[end..];
    }
    push_text(&mut pieces, rest.to_owned());
    pieces
}

/// Where the first open marker in `text` is, and which it is (the longest of those starting
/// there).
fn first_open(markup: Markup, text: &str) -> Option<(usize, &'static str)> {
    markup
        .opens
        .iter()
        .filter_map(|&open| text.find(open).map(|at| (at, open)))
        .min_by_key(|&(at, open)| (at, std::cmp::Reverse(open.len())))
}

fn push_text(pieces: &mut Vec<Piece>, text: String) {
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
}

/// Length of the longest end of `text` that is a proper beginning of `marker`: what must wait
/// for the next chunk. Char boundaries only, as the markers hold multi-byte characters.
fn partial_prefix_len(text: &str, marker: &str) -> usize {
    marker
        .char_indices()
        .skip(1)
        .map(|(at, _)| at)
        .filter(|&len| len <= text.len() && text.ends_with(&marker[..len]))
        .last()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::ToolFormat;

    fn streamed(markup: Markup, chunks: &[&str]) -> Vec<Piece> {
        let mut splitter = Splitter::new(markup);
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| splitter.push(c)).collect();
        pieces.extend(splitter.finish());
        merged(pieces)
    }

    /// Adjacent text pieces as one, as the stream may cut text anywhere.
    fn merged(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for piece in pieces {
            match (out.last_mut(), piece) {
                (Some(Piece::Text(last)), Piece::Text(text)) => last.push_str(&text),
                (_, piece) => out.push(piece),
            }
        }
        out
    }

    #[test]
    fn marker_prefixes_wait_and_come_out_as_text_when_they_do_not_complete() {
        let markup = ToolFormat::DeepSeekV3.markup();
        let mut splitter = Splitter::new(markup);
        assert_eq!(splitter.push("ok <｜tool▁"), vec![Piece::Text("ok ".into())]);
        assert_eq!(splitter.push("x"), vec![Piece::Text("<｜tool▁x".into())]);
        assert_eq!(partial_prefix_len("a<", "<tool_call>"), 1);
        assert_eq!(partial_prefix_len("<tool_call", "<tool_call>"), 10);
        assert_eq!(partial_prefix_len("<tool_call>", "<tool_call>"), 0);
        assert_eq!(partial_prefix_len("", "<tool_call>"), 0);
    }

    #[test]
    fn sections_cut_alike_whole_and_streamed_byte_by_byte() {
        let text = "a <tool_call>{}</tool_call>\n<tool_call>{\"x\"</tool_call> <tool_call>open";
        let markup = ToolFormat::Hermes.markup();
        let whole = split_whole(markup, text);
        assert_eq!(
            whole,
            vec![
                Piece::Text("a ".into()),
                Piece::Section("<tool_call>{}</tool_call>".into()),
                Piece::Text("\n".into()),
                Piece::Section("<tool_call>{\"x\"</tool_call>".into()),
                Piece::Text(" ".into()),
                Piece::Text("<tool_call>open".into()),
            ]
        );
        let bytes: Vec<String> = text.chars().map(String::from).collect();
        let chunks: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(streamed(markup, &chunks), merged(whole));
    }

    #[test]
    fn deepseek_v41_sections_open_at_a_block_or_an_invoke_and_run_to_the_end() {
        let markup = ToolFormat::DsmlV41.markup();
        let block = "a\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>tail";
        let invoke = "a <｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>\n<｜DSML｜ calls>";
        let neither = "a <｜DSML｜ call <｜DSML｜invoke name=\"f\"> <｜DSML｜ calls";
        assert_eq!(
            split_whole(markup, block),
            vec![Piece::Text("a\n\n".into()), Piece::Section(block[3..].into())]
        );
        assert_eq!(
            split_whole(markup, invoke),
            vec![Piece::Text("a ".into()), Piece::Section(invoke[2..].into())]
        );
        assert_eq!(split_whole(markup, neither), vec![Piece::Text(neither.into())]);
        for text in [block, invoke, neither] {
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(streamed(markup, &chunks), merged(split_whole(markup, text)), "{text:?}");
        }
    }

    #[test]
    fn llama_sections_run_to_the_end() {
        let markup = ToolFormat::Llama3Json.markup();
        for text in ["  {\"name\": 1} tail", "hi <|python_tag|>{} ; x", "   ", "x {"] {
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(streamed(markup, &chunks), merged(split_whole(markup, text)), "{text:?}");
        }
    }
}
