//! What every `SimTrace` satisfies, whoever made it: the harness relies on these and checks
//! nothing again.

use std::time::Duration;

use super::{SimRequest, SimTrace, Start};

impl SimTrace {
    /// Every request: `index` its place; a non-empty prompt of ids below `vocab_size`;
    /// `max_tokens` at least 1; sessions numbered densely in order of first appearance, turns
    /// counted from 1 in order (1 out of a session). A later turn starts `After` the session's
    /// turn before it; a first turn (or a request in no session) starts `At` a time or `After`
    /// any earlier request (a sub-agent after the request that spawned it). The earliest `At`
    /// is 0.
    pub fn check(&self) -> Result<(), String> {
        if self.vocab_size == 0 {
            return Err("vocab_size is 0".into());
        }
        if self.requests.is_empty() {
            return Err("no requests".into());
        }
        let mut last_of_session: Vec<(usize, u32)> = Vec::new();
        let mut earliest_at: Option<Duration> = None;
        for (i, request) in self.requests.iter().enumerate() {
            self.check_request(i, request).map_err(|e| format!("request {i}: {e}"))?;
            let previous_turn = check_session(request, &mut last_of_session)
                .map_err(|e| format!("request {i}: {e}"))?;
            check_start(i, request.start, previous_turn)
                .map_err(|e| format!("request {i}: {e}"))?;
            if let Start::At(at) = request.start {
                earliest_at = Some(earliest_at.map_or(at, |e| e.min(at)));
            }
        }
        match earliest_at {
            Some(at) if at != Duration::ZERO => {
                Err(format!("the earliest At is {at:?}, not 0: times start at 0"))
            }
            _ => Ok(()),
        }
    }

    fn check_request(&self, i: usize, request: &SimRequest) -> Result<(), String> {
        if request.index != i {
            return Err(format!("index {} at place {i}", request.index));
        }
        if request.input.is_empty() {
            return Err("empty prompt".into());
        }
        if let Some(id) = request.input.iter().find(|&&id| id >= self.vocab_size) {
            return Err(format!("token id {id} is not below the vocab size {}", self.vocab_size));
        }
        if request.max_tokens == 0 {
            return Err("max_tokens is 0".into());
        }
        if !(request.temperature.is_finite() && request.temperature >= 0.0) {
            return Err(format!("temperature {} is not a number ≥ 0", request.temperature));
        }
        for (name, penalty) in [
            ("presence penalty", request.presence_penalty),
            ("frequency penalty", request.frequency_penalty),
        ] {
            // What the server accepts; NaN fails the range too.
            if !(-2.0..=2.0).contains(&penalty) {
                return Err(format!("{name} {penalty} is not within [-2, 2]"));
            }
        }
        let repetition = request.repetition_penalty;
        if !(repetition > 0.0 && repetition <= 2.0) {
            return Err(format!("repetition penalty {repetition} is not within (0, 2]"));
        }
        // What the server accepts: at most 300 tokens of the vocabulary, each once.
        if request.logit_bias.len() > 300 {
            return Err(format!(
                "a logit bias of {} tokens (at most 300)",
                request.logit_bias.len()
            ));
        }
        let mut biased = std::collections::BTreeSet::new();
        for &(token, bias) in &request.logit_bias {
            if token >= self.vocab_size
                || !biased.insert(token)
                || !(-100.0..=100.0).contains(&bias)
            {
                return Err(format!(
                    "logit bias {bias} for token {token}: a token of the vocabulary, once, within [-100, 100]"
                ));
            }
        }
        Ok(())
    }
}

/// Checks the request's session and turn against the sessions so far (per session: its last
/// request and turn), and records it. The index of the session's turn before it, if any.
fn check_session(
    request: &SimRequest,
    last_of_session: &mut Vec<(usize, u32)>,
) -> Result<Option<usize>, String> {
    let Some(session) = request.session else {
        return match request.turn {
            1 => Ok(None),
            turn => Err(format!("turn {turn} out of a session: 1 expected")),
        };
    };
    let session = session as usize;
    let sessions = last_of_session.len();
    if session > sessions {
        return Err(format!("session {session} before session {sessions}: numbered in order"));
    }
    let (previous, expected) = match last_of_session.get(session) {
        Some(&(index, turn)) => (Some(index), turn + 1),
        None => (None, 1),
    };
    if request.turn != expected {
        return Err(format!("turn {} of session {session}: {expected} expected", request.turn));
    }
    if session == sessions {
        last_of_session.push((request.index, request.turn));
    } else {
        last_of_session[session] = (request.index, request.turn);
    }
    Ok(previous)
}

/// A later turn waits for its session's turn before it; anything else waits for an earlier
/// request or starts at a time.
fn check_start(i: usize, start: Start, previous_turn: Option<usize>) -> Result<(), String> {
    match (start, previous_turn) {
        (Start::After { previous, .. }, _) if previous >= i => {
            Err(format!("waits for request {previous}, not before it"))
        }
        (Start::After { previous, .. }, Some(turn)) if previous != turn => Err(format!(
            "a later turn waits for request {previous}, not its session's turn before it ({turn})"
        )),
        (Start::At(_), Some(turn)) => {
            Err(format!("a later turn starts at a time instead of after its turn before ({turn})"))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(index: usize, session: Option<u32>, turn: u32, start: Start) -> SimRequest {
        SimRequest {
            index,
            session,
            turn,
            start,
            input: vec![1, 2],
            max_tokens: 1,
            temperature: 0.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        }
    }

    fn after(previous: usize) -> Start {
        Start::After { previous, think: Duration::ZERO }
    }

    /// Two sessions; the second is a sub-agent spawned by the first's first turn.
    fn good() -> SimTrace {
        let zero = Start::At(Duration::ZERO);
        SimTrace {
            name: "t".into(),
            vocab_size: 10,
            requests: vec![
                request(0, Some(0), 1, zero),
                request(1, Some(1), 1, after(0)),
                request(2, Some(0), 2, after(0)),
                request(3, None, 1, Start::At(Duration::from_secs(1))),
                request(4, Some(1), 2, after(1)),
            ],
        }
    }

    #[test]
    fn a_good_trace_passes() {
        assert_eq!(good().check(), Ok(()));
    }

    /// Each check fires on the one thing it guards.
    #[test]
    fn each_check_fires() {
        type Spoil = fn(&mut SimTrace);
        let cases: [(&str, Spoil); 18] = [
            ("vocab_size is 0", |t| t.vocab_size = 0),
            ("no requests", |t| t.requests.clear()),
            ("index 7", |t| t.requests[2].index = 7),
            ("empty prompt", |t| t.requests[2].input.clear()),
            ("token id 10", |t| t.requests[2].input[1] = 10),
            ("max_tokens is 0", |t| t.requests[2].max_tokens = 0),
            ("temperature", |t| t.requests[2].temperature = f32::NAN),
            ("presence penalty NaN", |t| t.requests[2].presence_penalty = f32::NAN),
            ("frequency penalty 2.5", |t| t.requests[2].frequency_penalty = 2.5),
            ("repetition penalty 0 ", |t| t.requests[2].repetition_penalty = 0.0),
            ("logit bias 1 for token 10", |t| t.requests[2].logit_bias = vec![(10, 1.0)]),
            ("logit bias 101 for token 1", |t| t.requests[2].logit_bias = vec![(1, 101.0)]),
            ("turn 2 out of a session", |t| t.requests[3].turn = 2),
            ("session 3 before session 2", |t| t.requests[3].session = Some(3)),
            ("turn 3 of session 0: 2 expected", |t| t.requests[2].turn = 3),
            ("not before it", |t| t.requests[1].start = after(1)),
            ("not its session's turn before it", |t| t.requests[4].start = after(2)),
            ("the earliest At is 1s", |t| t.requests[0].start = Start::At(Duration::from_secs(1))),
        ];
        for (expected, spoil) in cases {
            let mut trace = good();
            spoil(&mut trace);
            let e = trace.check().unwrap_err();
            assert!(e.contains(expected), "{expected:?} not in {e:?}");
        }
        let mut trace = good();
        trace.requests[4].start = Start::At(Duration::ZERO);
        assert!(trace.check().unwrap_err().contains("a later turn starts at a time"));
    }
}
