//! The committed agentic sample, `traces/weka_agentic_80.jsonl`: WEKA sessions written in the
//! native format with hash ids (traces/README.md says how it was drawn and how to redo it).
//!
//! The sample keeps what the simulator needs of an agent's traffic (sessions, turns in order,
//! think times, sub-agents following the request that spawned them, prefixes shared within a
//! session and between sub-agents) at lengths a small simulated pool holds: every length is
//! scaled by `block_tokens / (64 * blocks_per_block)`, `blocks_per_block` WEKA blocks becoming
//! one block of the sample (its id stands for those ids together), and prompts are cut to
//! `input_max` from the end. Ids are renumbered from 1 in order of first appearance, which keeps
//! equal ids equal and different ones different.

use std::collections::BTreeMap;
use std::path::Path;

use lockstep_core::wire::Sampling;
use lockstep_server::record::{TraceHeader, TraceRecord, TraceSampling, TraceTimings};

use super::draft::scaled;
use super::weka::{Session, Turn, flatten, read_session_file, session_files};

/// How the sample is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    /// Sessions kept: the first ones in file-name order that qualify.
    pub sessions: usize,
    /// A session qualifies with at least this many requests of its main agent.
    pub requests_min: usize,
    /// Each agent (main or sub) keeps its first turns, at most this many.
    pub turns_max: u32,
    /// WEKA blocks (of 64 tokens) that become one block of the sample.
    pub blocks_per_block: u32,
    /// Tokens of one block of the sample (the header's `block_tokens`).
    pub block_tokens: u32,
    /// Prompts are cut to this many tokens (after scaling), from the end.
    pub input_max: u32,
    /// Outputs are cut to this many tokens (after scaling).
    pub output_max: u32,
    /// The header's `vocab_size`.
    pub vocab_size: u32,
}

impl Default for SampleOptions {
    /// What made `traces/weka_agentic_80.jsonl`: 1,024 WEKA tokens become 16.
    fn default() -> SampleOptions {
        SampleOptions {
            sessions: 80,
            requests_min: 2,
            turns_max: 8,
            blocks_per_block: 16,
            block_tokens: 16,
            input_max: 2048,
            output_max: 256,
            vocab_size: 32_000,
        }
    }
}

/// The sample, as the text of a native trace file, from a directory of WEKA session files
/// (the unpacked `weka_sessions_0001-0399.tar.gz`). Reads files only until enough qualify.
pub fn to_native(dir: &Path, options: &SampleOptions) -> Result<String, String> {
    let mut sessions = Vec::with_capacity(options.sessions);
    for file in session_files(dir)? {
        if sessions.len() == options.sessions {
            break;
        }
        let session = read_session_file(&file)?;
        let main_requests = session.entries.iter().filter(|e| e.is_request()).count();
        if main_requests >= options.requests_min {
            sessions.push(session);
        }
    }
    if sessions.len() < options.sessions {
        return Err(format!(
            "{}: {} sessions have {} requests or more, {} wanted",
            dir.display(),
            sessions.len(),
            options.requests_min,
            options.sessions
        ));
    }
    sessions_to_native(&sessions, options)
}

/// The native trace text of `sessions`, each agent cut to `turns_max` turns.
pub(crate) fn sessions_to_native(
    sessions: &[Session],
    options: &SampleOptions,
) -> Result<String, String> {
    if options.block_tokens == 0 || options.blocks_per_block == 0 || options.input_max == 0 {
        return Err(format!("{options:?}: block_tokens, blocks_per_block, input_max must be > 0"));
    }
    let turns = flatten(sessions, Some(options.turns_max));
    let mut header = TraceHeader::new(
        "weka-agentic",
        options.input_max + options.output_max,
        options.vocab_size,
    );
    header.block_tokens = Some(options.block_tokens);
    let mut text = json_line(&header)?;
    let mut renumbered: BTreeMap<Vec<u64>, u64> = BTreeMap::new();
    let mut arrival_us: Vec<u64> = Vec::with_capacity(turns.len());
    for (index, turn) in turns.iter().enumerate() {
        let session = &sessions[turn.session];
        let (e2e_us, arrival) = schedule(turn, &turns, &arrival_us);
        arrival_us.push(arrival);
        let record = record(index, turn, session, options, &mut renumbered, arrival, e2e_us);
        text += &json_line(&record)?;
    }
    Ok(text)
}

/// The turn's (e2e, arrival) in µs: it arrives its think time after the end of the turn it
/// waits for (arrival plus e2e), or at 0. The e2e is the recorded `api_time` (0 without one).
fn schedule(turn: &Turn, turns: &[Turn], arrival_us: &[u64]) -> (u64, u64) {
    let micros = |s: f64| (s * 1e6).round() as u64; // Saturating; every value here is ≥ 0.
    let e2e_us = micros(turn.request.api_time.unwrap_or(0.0));
    let arrival = match turn.after {
        None => 0,
        Some((previous, think_s)) => {
            let before = micros(turns[previous].request.api_time.unwrap_or(0.0));
            arrival_us[previous].saturating_add(before).saturating_add(micros(think_s))
        }
    };
    (e2e_us, arrival)
}

fn record(
    index: usize,
    turn: &Turn,
    session: &Session,
    options: &SampleOptions,
    renumbered: &mut BTreeMap<Vec<u64>, u64>,
    arrival_us: u64,
    e2e_us: u64,
) -> TraceRecord {
    let scale = f64::from(options.block_tokens)
        / (f64::from(session.block_tokens) * f64::from(options.blocks_per_block));
    let input_tokens = scaled(turn.request.input, scale).min(options.input_max);
    let blocks = input_tokens.div_ceil(options.block_tokens) as usize;
    let hash_ids = turn
        .hash_ids
        .chunks(options.blocks_per_block as usize)
        .take(blocks)
        .map(|group| {
            let next = renumbered.len() as u64 + 1;
            *renumbered.entry(group.to_vec()).or_insert(next)
        })
        .collect();
    let ms = |us: u64| us as f64 / 1000.0;
    let session_name = match &turn.agent {
        None => session.id.clone(),
        Some(agent) => format!("{}/{agent}", session.id),
    };
    TraceRecord {
        request_id: index as u64,
        session: Some(session_name),
        turn: Some(turn.turn),
        // A sub-agent's first turn names the turn that spawned it; later turns follow their own.
        follows: turn.after.filter(|_| turn.turn == 1).map(|(previous, _)| previous as u64),
        arrival_ms: ms(arrival_us),
        request: None,
        input_ids: Vec::new(),
        hash_ids,
        input_tokens: Some(input_tokens),
        max_tokens: Some(scaled(turn.request.output, scale).min(options.output_max)),
        sampling: TraceSampling::from(Sampling::GREEDY),
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        logit_bias: Vec::new(),
        // The recorded output lengths are what the model produced: generate all of them.
        ignore_eos: true,
        priority: 0,
        stream: turn.request.kind == "s",
        logprobs: None,
        prompt_logprobs: None,
        output: None,
        timings: Some(TraceTimings {
            ttft_ms: turn.request.ttft.map(|s| ms((s * 1e6).round() as u64)),
            e2e_ms: ms(e2e_us),
        }),
    }
}

fn json_line(value: &impl serde::Serialize) -> Result<String, String> {
    serde_json::to_string(value).map(|line| line + "\n").map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::trace::weka::read_session;
    use crate::trace::weka::tests::SESSION;
    use crate::trace::{ImportOptions, parse};

    fn options(blocks_per_block: u32, block_tokens: u32) -> SampleOptions {
        SampleOptions { sessions: 1, blocks_per_block, block_tokens, ..SampleOptions::default() }
    }

    #[test]
    fn the_native_sample_replays_as_the_sessions_do() {
        let session = read_session("s", SESSION).unwrap();
        let text = sessions_to_native(&[session], &options(1, 4)).unwrap();
        let native = parse("native", &text, &ImportOptions::default()).unwrap();
        let weka = parse("weka", SESSION, &ImportOptions::default()).unwrap();
        let shape = |t: &crate::trace::SimTrace| -> Vec<_> {
            t.requests
                .iter()
                .map(|r| (r.session, r.turn, r.start, r.input.len(), r.max_tokens))
                .collect()
        };
        assert_eq!(shape(&native), shape(&weka), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains(r#""block_tokens":4"#), "{}", lines[0]);
        assert!(
            lines[2].contains(r#""session":"s1/agent_001","turn":1,"follows":0"#),
            "{}",
            lines[2]
        );
        assert!(
            lines[1].contains(r#""hash_ids":[1,2,3]"#),
            "ids renumbered, and the partial block's"
        );
    }

    /// The records' `field`s, of a sample of `SESSION`.
    fn fields(options: &SampleOptions, field: &str) -> Vec<serde_json::Value> {
        let session = read_session("s", SESSION).unwrap();
        let text = sessions_to_native(&[session], options).unwrap();
        text.lines()
            .skip(1)
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[field].clone())
            .collect()
    }

    #[test]
    fn blocks_are_grouped_and_prompts_cut() {
        use serde_json::json;
        // Two blocks of 4 tokens become one of 2: lengths scaled by 1/4 (9 -> 2, 13 -> 3).
        let grouped = options(2, 2);
        assert_eq!(fields(&grouped, "input_tokens"), [2, 2, 3, 3, 3].map(|n| json!(n)));
        let ids = [json!([1]), json!([1]), json!([1, 2]), json!([1, 3]), json!([1, 4])];
        assert_eq!(fields(&grouped, "hash_ids"), ids, "ids 1,2 are the sample's 1");
        assert_eq!(fields(&grouped, "max_tokens"), [1, 1, 1, 1, 1].map(|n| json!(n)));
        // Cut to 10 tokens: 3 blocks of 4 at most.
        let cut = SampleOptions { input_max: 10, ..options(1, 4) };
        assert_eq!(fields(&cut, "input_tokens"), [9, 8, 10, 10, 10].map(|n| json!(n)));
        let ids =
            [json!([1, 2, 3]), json!([1, 2]), json!([1, 2, 4]), json!([1, 2, 5]), json!([1, 2, 6])];
        assert_eq!(fields(&cut, "hash_ids"), ids);
    }

    #[test]
    fn sessions_qualify_by_their_main_requests() {
        let dir = std::env::temp_dir().join(format!("lockstep-weka-sample-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let single = r#"{"id":"one","requests":[{"t":0,"type":"n","in":3,"out":1,"hash_ids":[]}]}"#;
        std::fs::write(dir.join("a.json"), single).unwrap();
        std::fs::write(dir.join("b.json"), SESSION).unwrap();
        std::fs::write(dir.join("c.txt"), "not a session").unwrap();
        let text = to_native(&dir, &options(1, 4)).unwrap();
        assert!(text.lines().skip(1).all(|l| l.contains(r#""session":"s1"#)), "{text}");
        let two = SampleOptions { sessions: 2, ..options(1, 4) };
        assert!(to_native(&dir, &two).unwrap_err().contains("1 sessions have 2 requests"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Regenerates `traces/weka_agentic_80.jsonl` from the unpacked WEKA sessions, by default
    /// in /tmp/weka/traces, else in `$WEKA_SESSIONS` (traces/README.md has the commands).
    #[test]
    #[ignore = "needs ../shared/traces/weka/weka_sessions_0001-0399.tar.gz unpacked"]
    fn regenerate_weka_agentic_80() {
        let dir = std::env::var_os("WEKA_SESSIONS")
            .map_or_else(|| PathBuf::from("/tmp/weka/traces"), PathBuf::from);
        let text = to_native(&dir, &SampleOptions::default()).unwrap();
        let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/weka_agentic_80.jsonl");
        std::fs::write(&out, text).unwrap();
    }
}
