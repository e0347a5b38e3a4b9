//! The Azure LLM inference trace 2023 (Splitwise, ISCA'24): a CSV with the header
//! `TIMESTAMP,ContextTokens,GeneratedTokens` and lines like
//! `2023-11-16 18:17:03.9799600,4808,10`. Open loop, no sessions, and no prefixes: the trace
//! says nothing about what prompts share, so every prompt is made from a hash id of its own
//! (its line's) and shares nothing. Timestamps must not decrease.

use std::time::Duration;

use super::draft::{Draft, DraftInput, finish};
use super::{ImportOptions, SimTrace, Start};

/// The header line, exactly (surrounding spaces and a byte-order mark aside).
pub(crate) const HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";

pub(crate) fn parse(name: &str, text: &str, options: &ImportOptions) -> Result<SimTrace, String> {
    let limit = options.max_requests.unwrap_or(usize::MAX);
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let Some((i, header)) = lines.next() else { return Err("empty: no header line".into()) };
    if header.trim().trim_start_matches('\u{feff}') != HEADER {
        return Err(format!("line {}: header {header:?}, expected {HEADER:?}", i + 1));
    }
    let mut drafts: Vec<Draft> = Vec::new();
    let mut last_ns = 0;
    for (i, line) in lines.take(limit) {
        let (at_ns, context, generated) =
            parse_line(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if at_ns < last_ns {
            return Err(format!("line {}: TIMESTAMP is before the previous line's", i + 1));
        }
        last_ns = at_ns;
        drafts.push(Draft {
            session: None,
            start: Start::At(Duration::from_nanos(at_ns)),
            input: DraftInput::Blocks {
                // One id for the whole prompt, the line's own: nothing is shared.
                hash_ids: vec![drafts.len() as u64],
                tokens: context,
                block_tokens: context,
            },
            output_tokens: generated,
            temperature: 0.0,
            seed: None,
            penalties: super::draft::NO_PENALTIES,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        });
    }
    finish(name, options.vocab_size, drafts, options)
}

/// (nanoseconds since 1970, context tokens, generated tokens) of one line.
fn parse_line(line: &str) -> Result<(u64, u32, u32), String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let [timestamp, context, generated] = fields[..] else {
        return Err(format!("{} fields, expected 3 ({HEADER})", fields.len()));
    };
    let at_ns = timestamp_ns(timestamp)?;
    let count = |text: &str, what: &str| {
        text.parse::<u32>().map_err(|_| format!("{what} {text:?} is not a whole number ≥ 0"))
    };
    let context = count(context, "ContextTokens")?;
    if context == 0 {
        return Err("ContextTokens is 0: a prompt has at least 1 token".into());
    }
    Ok((at_ns, context, count(generated, "GeneratedTokens")?))
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, up to 9 fraction digits, years 1970 to 2500: u64
/// nanoseconds since 1970 hold them).
fn timestamp_ns(text: &str) -> Result<u64, String> {
    let bad = || format!("TIMESTAMP {text:?} is not YYYY-MM-DD HH:MM:SS[.fraction]");
    let (date, time) = text.split_once([' ', 'T']).ok_or_else(bad)?;
    let number = |s: &str, digits: usize| -> Result<u64, String> {
        if s.len() == digits && s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse().map_err(|_| bad())
        } else {
            Err(bad())
        }
    };
    let d: Vec<&str> = date.split('-').collect();
    let [year, month, day] = d[..] else { return Err(bad()) };
    let (year, month, day) = (number(year, 4)?, number(month, 2)?, number(day, 2)?);
    let (clock, fraction) = time.split_once('.').unwrap_or((time, ""));
    let t: Vec<&str> = clock.split(':').collect();
    let [hour, minute, second] = t[..] else { return Err(bad()) };
    let (hour, minute, second) = (number(hour, 2)?, number(minute, 2)?, number(second, 2)?);
    if !(1970..=2500).contains(&year)
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
        || fraction.len() > 9
    {
        return Err(bad());
    }
    let nanos = if fraction.is_empty() {
        0
    } else {
        number(fraction, fraction.len())? * 10u64.pow(9 - fraction.len() as u32)
    };
    let seconds = ((days_since_1970(year, month, day) * 24 + hour) * 60 + minute) * 60 + second;
    Ok(seconds * 1_000_000_000 + nanos)
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar, 1970 or later (Howard
/// Hinnant's `days_from_civil`).
fn days_since_1970(year: u64, month: u64, day: u64) -> u64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                          2023-11-16 18:17:03.9799600,4808,10\n\
                          2023-11-16 18:17:04.0319600,4808,0\n";

    #[test]
    fn timestamps_are_calendar_exact() {
        assert_eq!(days_since_1970(1970, 1, 1), 0);
        assert_eq!(days_since_1970(2000, 3, 1), 11_017);
        assert_eq!(days_since_1970(2023, 11, 16), 19_677);
        let ns = timestamp_ns("2023-11-16 18:17:03.9799600").unwrap();
        assert_eq!(ns, 1_700_158_623_979_960_000);
        assert_eq!(timestamp_ns("2024-01-01 00:00:00").unwrap(), 1_704_067_200_000_000_000);
        for bad in ["2023-11-16", "2023-13-01 00:00:00", "23-11-16 00:00:00", "2023-11-16 1:2:3"] {
            assert!(timestamp_ns(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn open_loop_unique_prompts() {
        let trace = parse("a", SAMPLE, &ImportOptions::default()).unwrap();
        let [a, b] = &trace.requests[..] else { panic!("{trace:?}") };
        assert_eq!(a.start, Start::At(Duration::ZERO));
        assert_eq!(b.start, Start::At(Duration::from_micros(52_000)));
        assert_eq!((a.input.len(), b.input.len()), (4808, 4808));
        assert_ne!(a.input[..16], b.input[..16], "equal lengths, nothing shared");
        assert_eq!((a.max_tokens, b.max_tokens), (10, 1));
    }

    #[test]
    fn bad_lines_are_named() {
        let run = |text: &str| parse("a", text, &ImportOptions::default()).unwrap_err();
        let e = run(&SAMPLE.replace(",4808,0", ",-4808,0"));
        assert!(e.starts_with("line 3:") && e.contains("ContextTokens"), "{e}");
        let e = run(&SAMPLE.replace(",4808,0", ",0,3"));
        assert!(e.starts_with("line 3:"), "{e}");
        let e = run(&SAMPLE.replace("04.03", "01.03"));
        assert!(e.starts_with("line 3:") && e.contains("before"), "{e}");
        let e = run(&SAMPLE.replace(",4808,10", ",4808"));
        assert!(e.starts_with("line 2:") && e.contains("2 fields"), "{e}");
        let e = run("TIME,Context\n");
        assert!(e.starts_with("line 1:"), "{e}");
        assert!(run("").contains("empty"));
        assert!(run(HEADER).contains("empty"), "a header and no requests");
    }
}
