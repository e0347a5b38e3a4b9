//! A request as an importer read it, before lengths are scaled and tokens made, and `finish`,
//! the one place that turns a list of them into a `SimTrace`: keep whole sessions under
//! `max_requests`, scale and cap lengths, make tokens from hash ids, number sessions and
//! turns, start `At` times from 0, then check.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lockstep_server::bench_serve::synthesize_prompt;

use super::{ImportOptions, SimRequest, SimTrace, Start};

/// One request of the file. `start`'s `After::previous` is an index into the same list.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Draft {
    /// The importer's session number; any numbers, renumbered densely by `finish`.
    pub session: Option<u32>,
    pub start: Start,
    pub input: DraftInput,
    /// Before scaling; 0 is clamped to 1.
    pub output_tokens: u32,
    pub temperature: f32,
    /// `None`: the request's index (these traces are greedy, so it decides nothing).
    pub seed: Option<u64>,
    /// (presence, frequency, repetition): a recorded request's penalties; none (0, 0, 1) for the
    /// other formats.
    pub penalties: (f32, f32, f32),
    /// A recorded request's `logit_bias`; none for the other formats.
    pub logit_bias: Vec<(u32, f32)>,
    /// A recorded request sent with a `response_format` that holds its output (`json_object`,
    /// `json_schema`); none for the other formats.
    pub constrained: bool,
    /// A recorded request's `priority` (lower first); 0 for the other formats.
    pub priority: i32,
    /// A recorded request's top alternatives per output token, when it asked for
    /// log-probabilities; none for the other formats.
    pub logprobs: Option<u8>,
    /// A recorded request asked for its prompt's log-probabilities (`echo` with `logprobs`);
    /// never for the other formats.
    pub echo: bool,
}

/// A prompt as the file gives it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum DraftInput {
    /// Token ids of a real prompt.
    Tokens(Vec<u32>),
    /// `tokens` tokens made of `block_tokens`-token blocks, one per hash id (the last id runs
    /// on past its block if the ids do not cover `tokens`).
    Blocks { hash_ids: Vec<u64>, tokens: u32, block_tokens: u32 },
}

/// The trace the drafts make, under `options`. `vocab_size` is the trace's (the native
/// header's, or `options.vocab_size`).
pub(crate) fn finish(
    name: &str,
    vocab_size: u32,
    drafts: Vec<Draft>,
    options: &ImportOptions,
) -> Result<SimTrace, String> {
    check_options(options)?;
    if vocab_size == 0 {
        return Err("vocab_size is 0: token ids must be below it".into());
    }
    if drafts.is_empty() {
        return Err("empty: no requests".into());
    }
    let total = drafts.len();
    let drafts = keep_whole_sessions(drafts, options.max_requests)?;
    if drafts.is_empty() {
        return Err(format!(
            "max_requests {} keeps no request: the first session alone has more (of {total})",
            options.max_requests.unwrap_or(0)
        ));
    }
    let first_at = drafts
        .iter()
        .filter_map(|d| match d.start {
            Start::At(at) => Some(at),
            Start::After { .. } => None,
        })
        .min()
        .unwrap_or(Duration::ZERO);
    let mut sessions: BTreeMap<u32, (u32, u32)> = BTreeMap::new(); // key: (dense, turns so far)
    let mut requests = Vec::with_capacity(drafts.len());
    for (index, draft) in drafts.into_iter().enumerate() {
        let (session, turn) = match draft.session {
            None => (None, 1),
            Some(key) => {
                let next = u32::try_from(sessions.len()).map_err(|_| "too many sessions")?;
                let (dense, turns) = sessions.entry(key).or_insert((next, 0));
                *turns += 1;
                (Some(*dense), *turns)
            }
        };
        let start = match draft.start {
            Start::At(at) => Start::At(at - first_at),
            after @ Start::After { .. } => after,
        };
        let (presence_penalty, frequency_penalty, repetition_penalty) =
            penalties(&draft, index, options);
        requests.push(SimRequest {
            index,
            session,
            turn,
            start,
            input: prompt(&draft.input, vocab_size, options),
            max_tokens: scaled(draft.output_tokens, options.scale_tokens)
                .min(options.max_output.unwrap_or(u32::MAX))
                .max(1),
            temperature: draft.temperature,
            seed: draft.seed.unwrap_or(index as u64),
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias: logit_bias(&draft, index, vocab_size, options),
            constrained: draft.constrained || (options.logit_adjustments && index % 5 == 4),
            priority: priority(&draft, index, options),
            logprobs: logprobs(&draft, index, options)
                .or(echo(&draft, index, options).then_some(1)),
            echo: echo(&draft, index, options),
        });
    }
    let trace = SimTrace { name: name.to_owned(), vocab_size, requests };
    trace.check()?;
    Ok(trace)
}

/// Whether the options make sense: checked before any file is read, and again here.
pub(crate) fn check_options(options: &ImportOptions) -> Result<(), String> {
    if !(options.scale_tokens.is_finite() && options.scale_tokens > 0.0) {
        return Err(format!("scale_tokens {} is not a positive number", options.scale_tokens));
    }
    if options.max_input == Some(0) {
        return Err("max_input 0: a prompt has at least 1 token".into());
    }
    if options.max_requests == Some(0) {
        return Err("max_requests 0 keeps no request".into());
    }
    Ok(())
}

/// `length` scaled by `factor`, rounded, at least 1.
pub(crate) fn scaled(length: u32, factor: f64) -> u32 {
    // `as` saturates: a length scaled past u32::MAX stays u32::MAX (and is capped later).
    ((f64::from(length) * factor).round() as u32).max(1)
}

/// `ms` milliseconds, to the microsecond; negative (or not a number) is 0.
pub(crate) fn duration_ms(ms: f64) -> Duration {
    // `as` saturates, and sends NaN to 0.
    Duration::from_micros((ms * 1000.0).round().max(0.0) as u64)
}

/// The prompt's token ids: scaled, capped from the end, made from hash ids when it has none.
fn prompt(input: &DraftInput, vocab_size: u32, options: &ImportOptions) -> Vec<u32> {
    let cap = options.max_input.unwrap_or(u32::MAX);
    match input {
        DraftInput::Tokens(ids) => {
            let length = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            let keep = scaled(length, options.scale_tokens).min(length).min(cap);
            ids[..keep as usize].to_vec()
        }
        DraftInput::Blocks { hash_ids, tokens, block_tokens } => {
            let tokens = scaled(*tokens, options.scale_tokens).min(cap);
            let block_tokens = scaled(*block_tokens, options.scale_tokens);
            synthesize_prompt(hash_ids, tokens, block_tokens, vocab_size, options.seed)
        }
    }
}

/// What a request belongs to when whole sessions are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Unit {
    Session(u32),
    /// A request in no session, by its index.
    Alone(usize),
}

/// (presence, frequency, repetition) penalties of request `index`: its own, or with
/// `--logit-adjustments` and none of its own, by `index`'s remainder by 3: none, a presence
/// penalty, or all three (one negative).
fn penalties(draft: &Draft, index: usize, options: &ImportOptions) -> (f32, f32, f32) {
    match (options.logit_adjustments && draft.penalties == NO_PENALTIES, index % 3) {
        (false, _) | (true, 0) => draft.penalties,
        (true, 1) => (2.0, 0.0, 1.0),
        (true, _) => (-0.5, 1.25, 1.5),
    }
}

/// Request `index`'s priority: its own, or with `--priorities` and none of its own, -1 for one
/// request in three and 2 for another (so some are admitted before earlier arrivals, some after,
/// and preemption picks by priority first).
fn priority(draft: &Draft, index: usize, options: &ImportOptions) -> i32 {
    match (options.priorities && draft.priority == 0, index % 3) {
        (false, _) | (true, 0) => draft.priority,
        (true, 1) => -1,
        (true, _) => 2,
    }
}

/// Request `index`'s log-probabilities: its own, or with `--logprobs` one request in three asks
/// for them, with 0, 1 or 5 top alternatives in turn.
fn logprobs(draft: &Draft, index: usize, options: &ImportOptions) -> Option<u8> {
    draft
        .logprobs
        .or_else(|| (options.logprobs && index % 3 == 2).then(|| [0, 1, 5][index / 3 % 3]))
}

/// Whether request `index` asks for `echo`: as recorded, or with `--echo` one request in four,
/// with its own log-probabilities' alternatives, or 1.
fn echo(draft: &Draft, index: usize, options: &ImportOptions) -> bool {
    draft.echo || (options.echo && index % 4 == 1)
}

/// (presence, frequency, repetition) as no penalty at all.
pub(crate) const NO_PENALTIES: (f32, f32, f32) = (0.0, 0.0, 1.0);

/// Request `index`'s logit bias: its own, or with `--logit-adjustments` and none of its own, on
/// one request in four, a few tokens of the vocabulary pushed up or down (by token).
fn logit_bias(
    draft: &Draft,
    index: usize,
    vocab_size: u32,
    options: &ImportOptions,
) -> Vec<(u32, f32)> {
    if !(options.logit_adjustments && draft.logit_bias.is_empty() && index % 4 == 3) {
        return draft.logit_bias.clone();
    }
    let mut bias: Vec<(u32, f32)> =
        [(5, 4.0), (17, -100.0), (40, 2.5)].into_iter().map(|(t, b)| (t % vocab_size, b)).collect();
    bias.sort_by_key(|&(token, _)| token);
    bias.dedup_by_key(|&mut (token, _)| token);
    bias
}

/// The drafts of the first units (sessions, or requests alone) in order of first appearance,
/// while their total stays within `max_requests`; `After` links renumbered to match.
fn keep_whole_sessions(
    drafts: Vec<Draft>,
    max_requests: Option<usize>,
) -> Result<Vec<Draft>, String> {
    let Some(max_requests) = max_requests else { return Ok(drafts) };
    let unit_of = |i: usize, d: &Draft| d.session.map_or(Unit::Alone(i), Unit::Session);
    let mut sizes: BTreeMap<Unit, usize> = BTreeMap::new();
    let mut order = Vec::new();
    for (i, d) in drafts.iter().enumerate() {
        let size = sizes.entry(unit_of(i, d)).or_insert(0);
        if *size == 0 {
            order.push(unit_of(i, d));
        }
        *size += 1;
    }
    let mut kept = BTreeSet::new();
    let mut total = 0;
    for unit in order {
        total += sizes[&unit];
        if total > max_requests {
            break;
        }
        kept.insert(unit);
    }
    let mut new_index: Vec<Option<usize>> = vec![None; drafts.len()];
    let mut out = Vec::with_capacity(total.min(max_requests));
    for (i, mut d) in drafts.into_iter().enumerate() {
        if !kept.contains(&unit_of(i, &d)) {
            continue;
        }
        if let Start::After { previous, think } = d.start {
            if previous >= i {
                return Err(format!("request {i} waits for request {previous}, not before it"));
            }
            // A later turn follows its own session, a sub-agent a session that appeared
            // before it: either is kept when this one is.
            let previous = new_index.get(previous).copied().flatten().ok_or_else(|| {
                format!("request {i} waits for request {previous}, which max_requests left out")
            })?;
            d.start = Start::After { previous, think };
        }
        new_index[i] = Some(out.len());
        out.push(d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(session: Option<u32>, start: Start) -> Draft {
        Draft {
            session,
            start,
            input: DraftInput::Blocks { hash_ids: vec![1, 2], tokens: 8, block_tokens: 4 },
            output_tokens: 3,
            temperature: 0.0,
            seed: None,
            penalties: NO_PENALTIES,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        }
    }

    fn after(previous: usize) -> Start {
        Start::After { previous, think: Duration::from_millis(5) }
    }

    #[test]
    fn sessions_are_numbered_densely_and_turns_counted() {
        let at = Start::At(Duration::from_millis(7));
        let drafts = vec![
            draft(Some(40), at),
            draft(Some(9), at),
            draft(Some(40), after(0)),
            draft(None, Start::At(Duration::from_millis(9))),
        ];
        let trace = finish("t", 100, drafts, &ImportOptions::default()).unwrap();
        let got: Vec<_> = trace.requests.iter().map(|r| (r.session, r.turn)).collect();
        assert_eq!(got, vec![(Some(0), 1), (Some(1), 1), (Some(0), 2), (None, 1)]);
        assert_eq!(trace.requests[0].start, Start::At(Duration::ZERO), "At starts at 0");
        assert_eq!(trace.requests[3].start, Start::At(Duration::from_millis(2)));
    }

    #[test]
    fn max_requests_keeps_whole_sessions_while_they_fit() {
        let at = Start::At(Duration::ZERO);
        let drafts = vec![
            draft(Some(0), at),
            draft(Some(1), at),
            draft(Some(0), after(0)),
            draft(Some(2), after(2)), // a sub-agent spawned by session 0's second turn
            draft(Some(1), after(1)),
            draft(Some(1), after(4)),
        ];
        let options = |n| ImportOptions { max_requests: Some(n), ..ImportOptions::default() };
        let kept = |n| finish("t", 100, drafts.clone(), &options(n)).map(|t| t.requests.len());
        assert_eq!(kept(2), Ok(2), "session 0 fits, session 1 (3 turns) does not");
        assert_eq!(kept(4), Ok(2), "session 1 is never cut, and it ends the trace");
        assert_eq!(kept(5), Ok(5));
        assert_eq!(kept(6), Ok(6));
        let trace = finish("t", 100, drafts.clone(), &options(5)).unwrap();
        let sessions: Vec<_> = trace.requests.iter().map(|r| r.session).collect();
        assert_eq!(sessions, [Some(0), Some(1), Some(0), Some(1), Some(1)], "the sub-agent left");
        assert_eq!(trace.requests[4].start, after(3), "links renumbered");
        assert!(kept(1).unwrap_err().contains("keeps no request"));
    }

    #[test]
    fn lengths_scale_with_their_blocks_and_outputs_are_at_least_one() {
        let mut d = draft(None, Start::At(Duration::ZERO));
        d.input = DraftInput::Blocks { hash_ids: vec![1, 2, 3], tokens: 300, block_tokens: 100 };
        d.output_tokens = 0;
        let mut e = d.clone();
        e.input = DraftInput::Blocks { hash_ids: vec![1, 2, 4], tokens: 300, block_tokens: 100 };
        let options = ImportOptions { scale_tokens: 0.1, ..ImportOptions::default() };
        let trace = finish("t", 1000, vec![d, e], &options).unwrap();
        let (a, b) = (&trace.requests[0], &trace.requests[1]);
        assert_eq!((a.input.len(), a.max_tokens), (30, 1));
        assert_eq!(a.input[..20], b.input[..20], "two shared blocks of 10 tokens");
        assert_ne!(a.input[20..], b.input[20..]);
    }

    #[test]
    fn token_prompts_are_cut_never_lengthened() {
        let mut d = draft(None, Start::At(Duration::ZERO));
        d.input = DraftInput::Tokens(vec![5, 6, 7, 8]);
        let run = |scale, max_input| {
            let options = ImportOptions { scale_tokens: scale, max_input, ..Default::default() };
            finish("t", 10, vec![d.clone()], &options).unwrap().requests[0].input.clone()
        };
        assert_eq!(run(2.0, None), vec![5, 6, 7, 8]);
        assert_eq!(run(0.5, None), vec![5, 6]);
        assert_eq!(run(1.0, Some(3)), vec![5, 6, 7]);
    }

    #[test]
    fn bad_options_and_empty_traces_are_errors() {
        let d = draft(None, Start::At(Duration::ZERO));
        for scale in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let options = ImportOptions { scale_tokens: scale, ..Default::default() };
            assert!(finish("t", 10, vec![d.clone()], &options).is_err(), "{scale}");
        }
        let options = ImportOptions { max_input: Some(0), ..Default::default() };
        assert!(finish("t", 10, vec![d.clone()], &options).is_err());
        let options = ImportOptions { max_requests: Some(0), ..Default::default() };
        assert!(finish("t", 10, vec![d.clone()], &options).unwrap_err().contains("max_requests 0"));
        assert!(finish("t", 0, vec![d], &ImportOptions::default()).is_err());
        assert!(finish("t", 10, vec![], &ImportOptions::default()).unwrap_err().contains("empty"));
    }
}
