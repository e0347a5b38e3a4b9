//! A request's output so far, by position, as an executor learns it from the plans it runs:
//! what presence and frequency penalties count (`RequestSampler`).

/// Each token of `output` with how often it occurs, by token.
pub fn counts(output: &[u32]) -> Vec<(u32, u32)> {
    let mut sorted = output.to_vec();
    sorted.sort_unstable();
    let mut counts: Vec<(u32, u32)> = Vec::new();
    for token in sorted {
        match counts.last_mut() {
            Some((last, count)) if *last == token => *count += 1,
            _ => counts.push((token, 1)),
        }
    }
    counts
}

/// One request's output tokens by position, as an executor learns them from the plans it runs:
/// every output token is the input of the position after it. So the record is the same whether
/// the request ran alone, was preempted and recomputed (its recompute feeds the same tokens
/// again), ran under overlap scheduling (its inputs resolved from the step before), or came
/// from a prefill worker (the first output token is the decode worker's first input).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputTokens {
    prompt_tokens: u32,
    /// The token at position `prompt_tokens + i`.
    tokens: Vec<u32>,
}

impl OutputTokens {
    pub fn new(prompt_tokens: u32) -> OutputTokens {
        OutputTokens { prompt_tokens, tokens: Vec::new() }
    }

    /// `token` is the input at `position`. A prompt position is not output; a position already
    /// known takes the new token and forgets the ones after it (they followed from the old one).
    /// A position past the next unknown one is an error: the output before it is unknown, and a
    /// penalty computed without it would be silently wrong.
    pub fn record(&mut self, position: u32, token: u32) -> Result<(), String> {
        let Some(at) = position.checked_sub(self.prompt_tokens) else { return Ok(()) };
        let at = at as usize;
        match at.cmp(&self.tokens.len()) {
            std::cmp::Ordering::Less => {
                if self.tokens[at] != token {
                    self.tokens.truncate(at);
                    self.tokens.push(token);
                }
            }
            std::cmp::Ordering::Equal => self.tokens.push(token),
            std::cmp::Ordering::Greater => {
                return Err(format!(
                    "output position {position} before {} was recorded (output starts at {})",
                    self.prompt_tokens as usize + self.tokens.len(),
                    self.prompt_tokens
                ));
            }
        }
        Ok(())
    }

    /// The output before `position`: what a token sampled for `position` is penalized by.
    pub fn before(&self, position: u32) -> Result<&[u32], String> {
        let len = position.saturating_sub(self.prompt_tokens) as usize;
        self.tokens.get(..len).ok_or_else(|| {
            format!(
                "sampling position {position} with only {} output tokens known (output starts at {})",
                self.tokens.len(),
                self.prompt_tokens
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tokens_are_recorded_by_position_and_a_gap_is_an_error() {
        let mut out = OutputTokens::new(3);
        for (position, token) in [(0, 9), (1, 9), (2, 9), (3, 7), (4, 8)] {
            out.record(position, token).unwrap();
        }
        assert_eq!(out.before(5).unwrap(), [7, 8], "the prompt's positions are not output");
        assert_eq!(out.before(4).unwrap(), [7]);
        assert_eq!(out.before(3).unwrap(), [] as [u32; 0]);
        // A recompute feeds the same tokens again: nothing changes.
        out.record(3, 7).unwrap();
        assert_eq!(out.before(5).unwrap(), [7, 8]);
        // Another token at a known position: the ones after it followed from the old one.
        out.record(3, 6).unwrap();
        assert_eq!(out.before(4).unwrap(), [6]);
        assert!(out.before(5).is_err(), "position 4 is no longer known");
        let err = out.record(6, 1).unwrap_err();
        assert!(err.contains("output position 6 before 4"), "{err}");
    }
}
