//! Mooncake's JSONL (traces/README.md): `timestamp` (ms), `input_length`, `output_length`,
//! `hash_ids` of 512-token blocks, shared across requests. Read with `lockstep bench-serve`'s
//! reader, so both agree on what a Mooncake trace is. Open loop, no sessions: each request is
//! sent at its timestamp.

use std::time::Duration;

use lockstep_server::bench_serve::{MOONCAKE_BLOCK_TOKENS, REQUESTS_MAX, parse_trace};

use super::draft::{Draft, DraftInput, finish};
use super::{ImportOptions, SimTrace, Start};

pub(crate) fn parse(name: &str, text: &str, options: &ImportOptions) -> Result<SimTrace, String> {
    // Requests alone: the first `max_requests` are all that is kept, so read no further.
    let records = parse_trace(text, options.max_requests.unwrap_or(REQUESTS_MAX))?;
    let drafts = records
        .into_iter()
        .map(|r| Draft {
            session: None,
            start: Start::At(Duration::from_millis(r.timestamp)),
            input: DraftInput::Blocks {
                hash_ids: r.hash_ids,
                tokens: r.input_length,
                block_tokens: MOONCAKE_BLOCK_TOKENS,
            },
            output_tokens: r.output_length,
            temperature: 0.0,
            seed: None,
            penalties: super::draft::NO_PENALTIES,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        })
        .collect();
    finish(name, options.vocab_size, drafts, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 3, \
                       \"hash_ids\": [7, 8]}\n{\"timestamp\": 1500, \"input_length\": 700, \
                       \"output_length\": 0, \"hash_ids\": [7, 9]}\n";

    #[test]
    fn open_loop_from_zero_with_shared_first_blocks() {
        let trace = parse("m", TWO, &ImportOptions::default()).unwrap();
        let [a, b] = &trace.requests[..] else { panic!("{trace:?}") };
        assert_eq!(
            (a.start, b.start),
            (Start::At(Duration::ZERO), Start::At(Duration::from_millis(500)))
        );
        assert_eq!((a.input.len(), b.input.len()), (600, 700));
        assert_eq!(a.input[..512], b.input[..512], "hash id 7 is the same 512 tokens");
        assert_ne!(a.input[512..600], b.input[512..600]);
        assert_eq!((a.max_tokens, b.max_tokens), (3, 1), "an output of 0 is clamped to 1");
        assert_eq!((a.session, a.turn), (None, 1));
    }

    #[test]
    fn bad_lines_are_named() {
        let bad = TWO.replace("\"input_length\": 700", "\"input_length\": -7");
        let e = parse("m", &bad, &ImportOptions::default()).unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = parse("m", "{\"timestamp\": 1}\n", &ImportOptions::default()).unwrap_err();
        assert!(e.starts_with("line 1:") && e.contains("input_length"), "{e}");
        let e = parse("m", "", &ImportOptions::default()).unwrap_err();
        assert!(e.contains("empty"), "{e}");
    }
}
