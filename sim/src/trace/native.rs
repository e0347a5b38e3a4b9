//! The native format, `lockstep-trace` v1 (traces/README.md), read with the server's own
//! reader. Records are replayed in arrival order (`arrival_ms`, then `request_id`). Requests of
//! one session go closed loop, in arrival order: the first `At` its arrival (or `After` the
//! request it `follows`: a sub-agent), each later one `After` the turn before it, with the think
//! time the recording shows, arrival minus the end of the request waited for (that request's
//! arrival plus its `timings.e2e_ms`; 0 without timings), never below 0.
//!
//! The vocabulary is the header's `vocab_size`, not `ImportOptions::vocab_size`: recorded
//! token ids are a real model's, and prompts made from hash ids are drawn below it too.

use std::collections::BTreeMap;

use lockstep_server::record::{RequestInput, TraceRecord, parse_trace};

use super::draft::{Draft, DraftInput, duration_ms, finish};
use super::{ImportOptions, SimTrace, Start};

/// Output tokens of a record with `max_tokens: null` and no recorded output.
pub(crate) const MAX_TOKENS_UNKNOWN: u32 = 16;

pub(crate) fn parse(name: &str, text: &str, options: &ImportOptions) -> Result<SimTrace, String> {
    let trace = parse_trace(text)?;
    let vocab_size = trace.header.vocab_size;
    if vocab_size == 0 {
        return Err("line 1: vocab_size is 0".into());
    }
    let block_tokens = trace.header.block_tokens();
    if block_tokens == 0 {
        return Err("line 1: block_tokens is 0".into());
    }
    // `parse_trace` reads the non-blank lines in order, the header first.
    let lines: Vec<usize> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, _)| i + 1)
        .skip(1)
        .collect();
    let mut records: Vec<(usize, TraceRecord)> = lines.into_iter().zip(trace.records).collect();
    records.sort_by(|(_, a), (_, b)| {
        a.arrival_ms.total_cmp(&b.arrival_ms).then(a.request_id.cmp(&b.request_id))
    });
    let first_ms = records.first().map_or(0.0, |(_, r)| r.arrival_ms);
    let mut by_id: BTreeMap<u64, (usize, usize)> = BTreeMap::new(); // id: (index, line)
    let mut sessions: BTreeMap<&str, (u32, usize)> = BTreeMap::new(); // (number, last index)
    let mut drafts = Vec::with_capacity(records.len());
    for (index, (line, record)) in records.iter().enumerate() {
        let draft = (|| {
            if let Some((_, first)) = by_id.insert(record.request_id, (index, *line)) {
                return Err(format!("request_id {} again (line {first})", record.request_id));
            }
            let previous = previous_of(record, &by_id, &mut sessions, index)?;
            let mut draft = draft(record, previous, &records, first_ms, vocab_size, block_tokens)?;
            draft.session = record.session.as_deref().map(|s| sessions[s].0);
            Ok(draft)
        })()
        .map_err(|e| format!("line {line}: {e}"))?;
        drafts.push(draft);
    }
    finish(name, vocab_size, drafts, options)
}

/// The index of the request this record waits for, if any: the turn before it in its session,
/// or the request it `follows`. Numbers the record's session.
fn previous_of<'a>(
    record: &'a TraceRecord,
    by_id: &BTreeMap<u64, (usize, usize)>,
    sessions: &mut BTreeMap<&'a str, (u32, usize)>,
    index: usize,
) -> Result<Option<usize>, String> {
    let turn_before = match record.session.as_deref() {
        None => None,
        Some(session) => match sessions.get_mut(session) {
            Some((_, last)) => Some(std::mem::replace(last, index)),
            None => {
                let number = u32::try_from(sessions.len()).map_err(|_| "too many sessions")?;
                sessions.insert(session, (number, index));
                None
            }
        },
    };
    let Some(follows) = record.follows else { return Ok(turn_before) };
    if turn_before.is_some() {
        return Err("follows is only for the first turn of a session".into());
    }
    match by_id.get(&follows) {
        Some(&(followed, _)) if followed < index => Ok(Some(followed)),
        _ => Err(format!("follows request {follows}, which does not arrive before it")),
    }
}

fn draft(
    record: &TraceRecord,
    previous: Option<usize>,
    records: &[(usize, TraceRecord)],
    first_ms: f64,
    vocab_size: u32,
    block_tokens: u32,
) -> Result<Draft, String> {
    let start = match previous {
        None => Start::At(duration_ms(record.arrival_ms - first_ms)),
        Some(previous) => {
            let (_, before) = &records[previous];
            let ended_ms = before.arrival_ms + before.timings.map_or(0.0, |t| t.e2e_ms);
            let think_ms =
                if before.timings.is_some() { record.arrival_ms - ended_ms } else { 0.0 };
            Start::After { previous, think: duration_ms(think_ms) }
        }
    };
    let input = if record.input_ids.is_empty() {
        let tokens = record.input_tokens.ok_or("no input")?;
        DraftInput::Blocks { hash_ids: record.hash_ids.clone(), tokens, block_tokens }
    } else {
        if let Some(id) = record.input_ids.iter().find(|&&id| id >= vocab_size) {
            return Err(format!("token id {id} is not below the header's vocab_size {vocab_size}"));
        }
        DraftInput::Tokens(record.input_ids.clone())
    };
    let recorded = record.output.as_ref().map(|o| o.token_ids.len());
    let output_tokens = match (record.max_tokens, recorded) {
        (Some(n), _) => n,
        (None, Some(n)) => u32::try_from(n).unwrap_or(u32::MAX),
        (None, None) => MAX_TOKENS_UNKNOWN,
    };
    let sampling = record.sampling;
    if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
        return Err(format!("temperature {} is not a number ≥ 0", sampling.temperature));
    }
    Ok(Draft {
        session: None, // set by the caller
        start,
        input,
        output_tokens,
        temperature: sampling.temperature,
        seed: Some(sampling.seed),
        penalties: (
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
        ),
        logit_bias: record.logit_bias.clone(),
        constrained: record.request.as_ref().is_some_and(RequestInput::holds_output),
        priority: record.priority,
        logprobs: record.logprobs,
        // Over HTTP a prompt is scored only with `echo`, which a replay sends.
        echo: record.prompt_logprobs.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const HEADER: &str = r#"{"format":"lockstep-trace","version":1,"model":"m","context_tokens":64,"vocab_size":50,"block_tokens":4}"#;
    const SAMPLING: &str = r#""sampling":{"temperature":0.5,"top_p":1.0,"top_k":0,"seed":9}"#;

    /// A record line: `rest` is everything after the request id, before the sampling.
    fn line(id: u64, rest: &str) -> String {
        format!(r#"{{"request_id":{id},{rest},{SAMPLING}}}"#)
    }

    fn trace(lines: &[String]) -> String {
        std::iter::once(HEADER.to_owned()).chain(lines.iter().cloned()).map(|l| l + "\n").collect()
    }

    fn run(lines: &[String]) -> Result<SimTrace, String> {
        parse("n", &trace(lines), &ImportOptions::default())
    }

    const TIMED: &str = r#""timings":{"ttft_ms":1.0,"e2e_ms":100.0}"#;

    #[test]
    fn sessions_go_closed_loop_in_arrival_order() {
        let lines = [
            // Written in the order they ended, as a recording is.
            line(
                5,
                &format!(
                    r#""session":"a","turn":2,"arrival_ms":400.5,"input_ids":[1,2,3],"max_tokens":null,{TIMED}"#
                ),
            ),
            line(
                3,
                &format!(
                    r#""session":"a","turn":1,"arrival_ms":100.0,"input_ids":[1,2],"max_tokens":4,{TIMED}"#
                ),
            ),
            line(4, r#""arrival_ms":150.0,"hash_ids":[7,8],"input_tokens":6,"max_tokens":0"#),
            line(
                6,
                r#""session":"sub","follows":3,"arrival_ms":250.0,"hash_ids":[7,9],"input_tokens":6,"max_tokens":2"#,
            ),
        ];
        let trace = run(&lines).unwrap();
        assert_eq!(trace.vocab_size, 50, "the header's");
        let [a1, alone, sub, a2] = &trace.requests[..] else { panic!("{trace:?}") };
        assert_eq!((a1.session, a1.turn, a1.start), (Some(0), 1, Start::At(Duration::ZERO)));
        assert_eq!(alone.start, Start::At(Duration::from_millis(50)));
        assert_eq!((alone.session, alone.max_tokens), (None, 1), "max_tokens 0 is clamped");
        let think = Duration::from_millis(50); // 250 - (100 + 100)
        assert_eq!(
            (sub.session, sub.turn, sub.start),
            (Some(1), 1, Start::After { previous: 0, think })
        );
        let think = Duration::from_micros(200_500); // 400.5 - (100 + 100)
        assert_eq!(
            (a2.session, a2.turn, a2.start),
            (Some(0), 2, Start::After { previous: 0, think })
        );
        assert_eq!(a2.max_tokens, MAX_TOKENS_UNKNOWN, "null and no output");
        assert_eq!((a1.input.clone(), a1.temperature, a1.seed), (vec![1, 2], 0.5, 9));
        assert_eq!(alone.input[..4], sub.input[..4], "hash id 7: the same block of 4 tokens");
        assert_ne!(alone.input[4..], sub.input[4..]);
        assert!(alone.input.iter().all(|&t| t < 50));
    }

    #[test]
    fn a_recorded_response_format_is_sent_again() {
        let with = |format: &str| {
            let request = format!(
                r#""request":{{"endpoint":"chat","messages":[],"response_format":{format}}}"#
            );
            line(1, &format!(r#""arrival_ms":0.0,{request},"input_ids":[1],"max_tokens":1"#))
        };
        let trace = run(&[with(r#"{"type":"json_object"}"#)]).unwrap();
        assert!(trace.requests[0].constrained);
        let trace = run(&[with(r#"{"type":"text"}"#)]).unwrap();
        assert!(!trace.requests[0].constrained);
        let plain = line(1, r#""arrival_ms":0.0,"input_ids":[1],"max_tokens":1"#);
        assert!(!run(&[plain]).unwrap().requests[0].constrained);
    }

    #[test]
    fn recorded_log_probabilities_are_asked_again() {
        let base = r#""arrival_ms":0.0,"input_ids":[1],"max_tokens":1"#;
        let asks = |rest: &str| {
            let request = &run(&[line(1, &format!("{base}{rest}"))]).unwrap().requests[0];
            (request.logprobs, request.echo)
        };
        assert_eq!(asks(""), (None, false));
        assert_eq!(asks(r#","logprobs":0"#), (Some(0), false));
        assert_eq!(asks(r#","logprobs":4,"prompt_logprobs":4"#), (Some(4), true));
    }

    #[test]
    fn no_timings_means_no_think_time() {
        let lines = [
            line(1, r#""session":"a","arrival_ms":10.0,"input_ids":[1],"max_tokens":1"#),
            line(2, r#""session":"a","arrival_ms":90.0,"input_ids":[1],"max_tokens":1"#),
        ];
        let trace = run(&lines).unwrap();
        assert_eq!(trace.requests[1].start, Start::After { previous: 0, think: Duration::ZERO });
    }

    #[test]
    fn bad_records_are_named_by_line() {
        let ok = line(1, r#""arrival_ms":0.0,"input_ids":[1],"max_tokens":1"#);
        let cases = [
            (line(2, r#""arrival_ms":1.0,"max_tokens":1"#), "no input"),
            (line(2, r#""arrival_ms":1.0,"input_ids":[50],"max_tokens":1"#), "not below"),
            (line(2, r#""arrival_ms":1.0,"hash_ids":[1],"max_tokens":1"#), "without input_tokens"),
            (line(2, r#""arrival_ms":1.0,"input_ids":[1],"max_tokens":-1"#), "invalid value"),
            (line(1, r#""arrival_ms":1.0,"input_ids":[1],"max_tokens":1"#), "request_id 1 again"),
            (line(2, r#""follows":9,"arrival_ms":1.0,"input_ids":[1],"max_tokens":1"#), "follows"),
            ("{\"request_id\":2,".to_owned(), "EOF"),
        ];
        for (bad, expected) in cases {
            let e = run(&[ok.clone(), bad]).unwrap_err();
            assert!(e.starts_with("line 3:") && e.contains(expected), "{expected:?}: {e}");
        }
        let later =
            line(3, r#""session":"a","follows":1,"arrival_ms":5.0,"input_ids":[1],"max_tokens":1"#);
        let first = line(2, r#""session":"a","arrival_ms":2.0,"input_ids":[1],"max_tokens":1"#);
        let e = run(&[ok, first, later]).unwrap_err();
        assert!(e.starts_with("line 4:") && e.contains("first turn"), "{e}");
        let e = parse(
            "n",
            &HEADER.replace("\"block_tokens\":4", "\"block_tokens\":0"),
            &ImportOptions::default(),
        );
        assert!(e.unwrap_err().contains("block_tokens is 0"));
        let e = parse("n", &format!("{HEADER}\n"), &ImportOptions::default()).unwrap_err();
        assert!(e.contains("empty"), "{e}");
    }
}
