//! Completions chunked anywhere through the reasoning split: input bytes become text cut into
//! chunks (0xF8 and up cut, 0x80 to 0xF7 pick a word: the families' markers and their pieces,
//! the rest are ASCII); the first byte picks the format and how the prompt opened the turn. No
//! panic in push or finish; the stream folds to `split_whole`'s reading of the whole text; the
//! split drops nothing but whole markers; and, each chunk one token, the stream's invariants hold
//! after every push and no more tokens count as reasoning than there were chunks, none of them
//! when the prompt closed the thinking.

#![no_main]

use std::collections::BTreeSet;

use libfuzzer_sys::fuzz_target;
use lockstep_server::reasoning::{
    Opening, ReasoningDelta, ReasoningFormat, ReasoningStream, split_whole,
};

const WORDS: &[&str] = &[
    "<think>",
    "</think>",
    "<think>\n",
    "\n</think>\n\n",
    "<thi",
    "</th",
    "<",
    "</",
    "◁think▷",
    "◁/think▷",
    "◁",
    "◁/th",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START",
    "<|END_",
    "<tool_call>",
    "<｜DSML｜ calls>",
    "<｜DSML｜ ca",
    "<｜DSML｜",
    "é",
    "😀",
];

const OPENINGS: [Opening; 3] = [Opening::Inside, Opening::Closed, Opening::ByParser];

fuzz_target!(|bytes: &[u8]| {
    let Some((&pick, bytes)) = bytes.split_first() else { return };
    let format = ReasoningFormat::ALL[usize::from(pick) % ReasoningFormat::ALL.len()];
    let opening = OPENINGS[usize::from(pick / 16) % OPENINGS.len()];
    let chunks = chunks(bytes);
    let text = chunks.concat();
    let whole = split_whole(format, opening, &text);
    let mut stream = ReasoningStream::new(format, opening);
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut both = String::new();
    let mut deltas = Vec::new();
    for chunk in &chunks {
        deltas.extend(stream.push_tokens(chunk, 1));
        stream.check_invariants();
    }
    deltas.extend(stream.finish());
    stream.check_invariants();
    assert!(stream.finish().is_empty());
    let counted = stream.reasoning_tokens() as usize;
    assert!(counted <= chunks.len(), "{counted} of {} tokens", chunks.len());
    assert!(opening != Opening::Closed || counted == 0, "{counted} with the thinking closed");
    for delta in deltas {
        match delta {
            ReasoningDelta::Reasoning(t) => {
                reasoning.push_str(&t);
                both.push_str(&t);
            }
            ReasoningDelta::Content(t) => {
                content.push_str(&t);
                both.push_str(&t);
            }
        }
    }
    assert_eq!((reasoning, content), whole, "{format:?} {opening:?} streamed as {chunks:?}");
    assert!(only_markers_dropped(&text, &both, &format.markers()), "{text:?} -> {both:?}");
});

/// Whether `out` is `text` less some of its markers (found leftmost first, as the split finds
/// them), each dropped whole.
fn only_markers_dropped(text: &str, out: &str, markers: &[&str]) -> bool {
    // Where `out` may stand after each piece of `text`: a marker kept or dropped.
    let mut at = BTreeSet::from([0]);
    let mut rest = text;
    while !rest.is_empty() {
        let next = markers.iter().filter_map(|m| rest.find(m).map(|i| (i, *m))).min();
        let (plain, marker) = match next {
            Some((i, m)) => (&rest[..i], Some(m)),
            None => (rest, None),
        };
        let kept = |at: &BTreeSet<usize>, piece: &str| -> BTreeSet<usize> {
            at.iter().filter(|&&j| out[j..].starts_with(piece)).map(|&j| j + piece.len()).collect()
        };
        at = kept(&at, plain);
        if let Some(m) = marker {
            let mut either = kept(&at, m);
            either.extend(at.iter().copied());
            at = either;
        }
        rest = &rest[plain.len() + marker.map_or(0, str::len)..];
    }
    at.contains(&out.len())
}

fn chunks(bytes: &[u8]) -> Vec<String> {
    let mut chunks = vec![String::new()];
    for &byte in bytes {
        let last = chunks.len() - 1;
        match byte {
            0xF8.. => chunks.push(String::new()),
            0x80.. => chunks[last].push_str(WORDS[usize::from(byte - 0x80) % WORDS.len()]),
            ascii => chunks[last].push(char::from(ascii)),
        }
    }
    chunks
}
