//! The split checked three ways: our marker table against reasoning-parser's parsers; the split
//! against a model of the rules written out here (so an upgrade of the crate that changes them
//! fails a test); and streamed against whole, however the text is chunked.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use proptest::prelude::*;
use reasoning_parser::ReasoningParser;

use super::cut::{Cutter, Piece};
use super::stream::PARSERS;
use super::{Opening, ReasoningDelta, ReasoningFormat, ReasoningStream, split_whole};

fn format(name: &str) -> ReasoningFormat {
    ReasoningFormat::from_name(name).unwrap()
}

fn crate_parser(format: ReasoningFormat) -> Box<dyn ReasoningParser> {
    PARSERS.registry().create_parser(format.name).unwrap()
}

#[test]
fn the_marker_table_is_the_crates() {
    for format in ReasoningFormat::ALL {
        let mut parser = crate_parser(format);
        let text = format!("{}thought{}answer", format.start, format.end);
        let result = parser.detect_and_parse_reasoning(&text).unwrap();
        assert_eq!(result.reasoning_text, "thought", "{}", format.name);
        assert_eq!(result.normal_text, "answer", "{}", format.name);
        // Another family's markers are text to it.
        let other = if format.start == "<think>" {
            ("◁think▷", "◁/think▷")
        } else {
            ("<think>", "</think>")
        };
        let text = format!("{}x{}y", other.0, other.1);
        let mut parser = crate_parser(format);
        let result = parser.detect_and_parse_reasoning(&text).unwrap();
        assert!(result.normal_text == text || result.reasoning_text == text, "{}", format.name);
    }
    assert!(ReasoningFormat::from_name("gemma4").is_err(), "a parser with states of its own");
    assert!(ReasoningFormat::from_name("nope").unwrap_err().contains("qwen3"));
}

#[test]
fn the_format_is_read_from_the_template() {
    let qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}";
    assert_eq!(ReasoningFormat::detect(qwen3).map(|f| f.name), Some("qwen3"));
    let kimi = "{{ '◁think▷' + reasoning + '◁/think▷' }}";
    assert_eq!(ReasoningFormat::detect(kimi).map(|f| f.name), Some("kimi"));
    let cohere = "<|START_THINKING|>{{ t }}<|END_THINKING|>";
    assert_eq!(ReasoningFormat::detect(cohere).map(|f| f.name), Some("cohere_cmd"));
    assert_eq!(ReasoningFormat::detect("{{ messages }} <tool_call>"), None);
    assert_eq!(ReasoningFormat::detect("only <think> opens"), None);
    let v41 = "{{ '<think>' + r + '</think>' }}{% if calls %}\n\n<｜DSML｜ calls>{% endif %}";
    assert_eq!(ReasoningFormat::detect(v41).map(|f| f.name), Some("deepseek_v41"));
    let v4 = "{{ '<think>' + r + '</think>' }}{% if calls %}\n\n<｜DSML｜tool_calls>{% endif %}";
    assert_eq!(ReasoningFormat::detect(v4).map(|f| f.name), Some("qwen3"));
}

#[test]
fn the_prompts_end_says_where_the_turn_starts() {
    let qwen3 = format("qwen3");
    assert_eq!(qwen3.opening("<|im_start|>assistant\n<think>\n"), Opening::Inside);
    assert_eq!(qwen3.opening("<|im_start|>assistant\n<think>\n\n</think>\n\n"), Opening::Closed);
    assert_eq!(qwen3.opening("<|im_start|>assistant\n"), Opening::ByParser);
    // An earlier turn's block is not this turn's.
    assert_eq!(qwen3.opening("<think>a</think>b<|im_start|>assistant\n"), Opening::ByParser);
}

#[test]
fn families_split_as_their_models_write() {
    let cases: [(&str, &str, &str, (&str, &str)); 15] = [
        // Qwen 3 thinks when it opens a block itself.
        ("qwen3", "assistant\n", "<think>\nhm\n</think>\n\nYes.", ("\nhm\n", "\n\nYes.")),
        ("qwen3", "assistant\n", "Yes.", ("", "Yes.")),
        // Its template turned thinking off: a block the model writes anyway is content.
        (
            "qwen3",
            "assistant\n<think>\n\n</think>\n\n",
            "<think>a</think>b",
            ("", "<think>a</think>b"),
        ),
        // DeepSeek V3.1 in thinking mode: the prompt opened the block.
        ("deepseek_v31", "<｜Assistant｜><think>", "hm</think>Yes.", ("hm", "Yes.")),
        ("deepseek_v31", "<｜Assistant｜></think>", "Yes.", ("", "Yes.")),
        // R1 starts inside whether or not it writes the opening marker.
        ("deepseek_r1", "<｜Assistant｜>", "hm</think>Yes.", ("hm", "Yes.")),
        ("deepseek_r1", "<｜Assistant｜>", "<think>hm</think>Yes.", ("hm", "Yes.")),
        // Cut off while thinking: all reasoning; a second block after the answer is answer.
        ("qwen3", "", "<think>still going", ("still going", "")),
        ("qwen3", "", "<think>a</think>b<think>c</think>", ("a", "b<think>c</think>")),
        // DeepSeek V4.1: the tool block ends the thinking and is the answer's, with all after it.
        (
            "deepseek_v41",
            "<｜Assistant｜><think>",
            "hm\n\n<｜DSML｜ calls>\n<think>x</think>",
            ("hm\n\n", "<｜DSML｜ calls>\n<think>x</think>"),
        ),
        ("deepseek_v41", "<｜Assistant｜><think>", "a</think>b", ("a", "b")),
        ("deepseek_v41", "<｜Assistant｜></think>", "<think>a</think>b", ("", "<think>a</think>b")),
        // A stray closing marker in the answer and a second opening one in the thinking drop;
        // a later block is reasoning again.
        ("deepseek_v41", "", "x</think>y", ("", "xy")),
        ("deepseek_v41", "", "<think>a<think>b</think>c", ("ab", "c")),
        ("deepseek_v41", "", "<think>a</think>b<think>c</think>d", ("ac", "bd")),
    ];
    for (name, prompt, text, (reasoning, content)) in cases {
        let format = format(name);
        let got = split_whole(format, format.opening(prompt), text);
        assert_eq!(got, (reasoning.to_owned(), content.to_owned()), "{name} {prompt:?} {text:?}");
    }
}

#[test]
fn the_cutter_holds_only_what_may_become_a_marker() {
    let mut cutter = Cutter::new(&["<think>", "</think>"]);
    assert_eq!(cutter.push("ab</th"), vec![Piece::Text("ab".into())]);
    assert_eq!(cutter.push("ink>c<"), vec![Piece::Marker("</think>"), Piece::Text("c".into())]);
    assert_eq!(cutter.push("x"), vec![Piece::Text("<x".into())]);
    assert_eq!(cutter.push("é<"), vec![Piece::Text("é".into())]);
    assert_eq!(cutter.finish(), vec![Piece::Text("<".into())]);
    assert_eq!(cutter.finish(), vec![]);
}

/// The rules as written out in the module docs, on the whole text: the model the crate's
/// parsers are checked against.
#[derive(Debug, Default)]
struct ModelReading {
    reasoning: String,
    content: String,
    /// Per byte of the text: whether it is reasoning (not content, not a marker acted on).
    reasoning_bytes: Vec<bool>,
    /// Inside the thinking before the first byte, and after each byte's piece.
    inside_at_start: bool,
    inside_after: Vec<bool>,
}

fn model_split(
    format: ReasoningFormat,
    inside_at_start: bool,
    opening: Opening,
    text: &str,
) -> ModelReading {
    let mut model = ModelReading::default();
    if opening == Opening::Closed {
        model.content = text.to_owned();
        model.reasoning_bytes = vec![false; text.len()];
        model.inside_after = vec![false; text.len()];
        return model;
    }
    let mut inside = opening == Opening::Inside || inside_at_start;
    model.inside_at_start = inside;
    // Whether an opening marker was already taken (in the prompt, or in the output).
    let mut opened = opening == Opening::Inside;
    let mut cutter = Cutter::new(&format.markers());
    let mut pieces = cutter.push(text);
    pieces.extend(cutter.finish());
    if format.tool_block.is_some() {
        deepseek_v41_split(&mut model, inside, pieces);
        return model;
    }
    for piece in pieces {
        let (len, reasoning) = match piece {
            Piece::Marker(m) if m == format.start && !opened => {
                opened = true;
                inside = true;
                (m.len(), false)
            }
            Piece::Marker(m) if m == format.end && inside => {
                inside = false;
                (m.len(), false)
            }
            Piece::Marker(m) if inside => {
                model.reasoning.push_str(m);
                (m.len(), true)
            }
            Piece::Marker(m) => {
                model.content.push_str(m);
                (m.len(), false)
            }
            Piece::Text(t) if inside => {
                model.reasoning.push_str(&t);
                (t.len(), true)
            }
            Piece::Text(t) => {
                model.content.push_str(&t);
                (t.len(), false)
            }
        };
        model.reasoning_bytes.extend(std::iter::repeat_n(reasoning, len));
        model.inside_after.extend(std::iter::repeat_n(inside, len));
    }
    model
}

/// DeepSeek V4.1's table (reasoning-parser's `deepseek_v41`): in the answer, `<think>` opens
/// reasoning and a `</think>` is dropped; in the reasoning, `</think>` ends it and a `<think>` is
/// dropped; the tool block ends either, is content, and everything after it is content as written.
fn deepseek_v41_split(model: &mut ModelReading, mut inside: bool, pieces: Vec<Piece>) {
    let mut in_tool_block = false;
    for piece in pieces {
        let text = match &piece {
            Piece::Marker(m) => (*m).to_owned(),
            Piece::Text(t) => t.clone(),
        };
        let reasoning = match piece {
            _ if in_tool_block => {
                model.content.push_str(&text);
                false
            }
            Piece::Marker("<｜DSML｜ calls>") => {
                (in_tool_block, inside) = (true, false);
                model.content.push_str(&text);
                false
            }
            // Opens, ends, or (the state unchanged) is dropped.
            Piece::Marker(m) => {
                inside = m == "<think>";
                false
            }
            Piece::Text(_) if inside => {
                model.reasoning.push_str(&text);
                true
            }
            Piece::Text(_) => {
                model.content.push_str(&text);
                false
            }
        };
        model.reasoning_bytes.extend(std::iter::repeat_n(reasoning, text.len()));
        model.inside_after.extend(std::iter::repeat_n(inside, text.len()));
    }
}

impl ModelReading {
    /// The tokens of `chunks` (one token each, cut from the text in order) that the module
    /// docs' rule counts as reasoning.
    fn reasoning_tokens(&self, chunks: &[&str]) -> u32 {
        let mut at = 0;
        let mut count = 0;
        for chunk in chunks {
            let reasoning = match chunk.len() {
                0 if at == 0 => self.inside_at_start,
                0 => self.inside_after[at - 1],
                n => self.reasoning_bytes[at..at + n].iter().all(|&r| r),
            };
            count += u32::from(reasoning);
            at += chunk.len();
        }
        count
    }
}

fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<think>".to_owned()),
        Just("</think>".to_owned()),
        Just("◁think▷".to_owned()),
        Just("◁/think▷".to_owned()),
        Just("<|END_THINKING|>".to_owned()),
        Just("<|START_THINKING|>".to_owned()),
        Just("<｜DSML｜ calls>".to_owned()),
        "(<|</|<th|</thi|◁|◁/th|<\\|START|<｜DSML｜ c|<｜DSML｜calls>)",
        "[a-z <>/\n|é😀]{0,8}",
    ]
}

fn case() -> impl Strategy<Value = (ReasoningFormat, &'static str, String, Vec<prop::sample::Index>)>
{
    let prompt = prop::sample::select(vec![
        "",
        "assistant\n",
        "<think>\n",
        "<think></think>\n",
        "◁think▷",
        "<|START_THINKING|>",
    ]);
    (
        prop::sample::select(ReasoningFormat::ALL.to_vec()),
        prompt,
        prop::collection::vec(fragment(), 0..12).prop_map(|f| f.concat()),
        prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    )
}

/// `text` cut at the given places (character boundaries).
fn chunks<'a>(text: &'a str, cuts: &[prop::sample::Index]) -> Vec<&'a str> {
    let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    let mut at: Vec<usize> = cuts.iter().map(|c| *c.get(&boundaries)).collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn streamed_equals_whole_equals_the_written_rules((format, prompt, text, cuts) in case()) {
        let opening = format.opening(prompt);
        let whole = split_whole(format, opening, &text);
        let mut stream = ReasoningStream::new(format, opening);
        let mut deltas = Vec::new();
        let chunks = chunks(&text, &cuts);
        for chunk in &chunks {
            deltas.extend(stream.push_tokens(chunk, 1));
            stream.check_invariants();
        }
        deltas.extend(stream.finish());
        stream.check_invariants();
        prop_assert!(stream.finish().is_empty());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for delta in &deltas {
            match delta {
                ReasoningDelta::Reasoning(t) => reasoning.push_str(t),
                ReasoningDelta::Content(t) => content.push_str(t),
            }
        }
        prop_assert_eq!(&(reasoning, content), &whole);
        let inside_at_start = crate_parser(format).is_in_reasoning();
        let model = model_split(format, inside_at_start, opening, &text);
        prop_assert_eq!(&whole, &(model.reasoning.clone(), model.content.clone()));
        prop_assert_eq!(stream.reasoning_tokens(), model.reasoning_tokens(&chunks));
    }
}
