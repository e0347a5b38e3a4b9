//! The grammars of a synthetic vocabulary (the provenance model's, the simulator's): its tokens
//! have no text for a grammar to read, so every grammar compiles to one automaton over token ids
//! whose mask depends on the whole output so far. That is what the simulator needs of a grammar:
//! a matcher that saw any other output than the request's own (a token lost at the hand-over, a
//! recompute it did not follow) allows other tokens, and the request draws otherwise than alone.

use super::grammar::{Grammar, GrammarCompiler, TokenMask, TokenMatcher};

/// Compiles any grammar to `SyntheticMatcher`; refuses only text no real compiler would read (a
/// schema that is not a JSON object, an empty Lark grammar), so the HTTP edge of a provenance
/// server refuses what the real one surely would.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticGrammars {
    /// The vocabulary's size: what the masks cover.
    pub vocab_size: u32,
}

impl GrammarCompiler for SyntheticGrammars {
    fn compile(&self, grammar: &Grammar) -> Result<Box<dyn TokenMatcher>, String> {
        match grammar {
            Grammar::JsonSchema(text) if !text.trim_start().starts_with('{') => {
                Err("the JSON schema is not an object".into())
            }
            Grammar::Lark(text) if text.trim().is_empty() => Err("an empty grammar".into()),
            _ => Ok(Box::new(SyntheticMatcher { vocab_size: self.vocab_size })),
        }
    }
}

/// After an output whose fold is `k`, every token but those of remainder `k` by 3, token 0
/// always: of any 8 consecutive tokens (the provenance model's candidates) at least 5 stay.
#[derive(Clone, Copy, Debug)]
pub struct SyntheticMatcher {
    vocab_size: u32,
}

impl SyntheticMatcher {
    /// Which remainder by 3 `output` rules out: FNV-1a over its tokens, in order.
    pub fn ruled_out(output: &[u32]) -> u32 {
        let hash = output.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &t| {
            (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3)
        });
        (hash % 3) as u32
    }
}

impl TokenMatcher for SyntheticMatcher {
    fn allowed(&mut self, output: &[u32]) -> TokenMask {
        let k = Self::ruled_out(output);
        // A word's pattern depends only on its first token's remainder by 3 (32 is 2 by 3).
        let pattern = |first: u32| {
            (0..32u32).filter(|bit| (first + bit) % 3 != k).fold(0u32, |w, bit| w | 1 << bit)
        };
        let patterns = [pattern(0), pattern(1), pattern(2)];
        let mut words: Vec<u32> =
            (0..self.vocab_size.div_ceil(32)).map(|w| patterns[(w * 32 % 3) as usize]).collect();
        if let Some(first) = words.first_mut() {
            *first |= 1;
        }
        if let (Some(last), tail @ 1..) = (words.last_mut(), self.vocab_size % 32) {
            *last &= (1 << tail) - 1;
        }
        TokenMask::from_words(words)
    }

    fn boxed_clone(&self) -> Box<dyn TokenMatcher> {
        Box::new(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_follows_the_whole_output_and_leaves_most_of_any_window() {
        let mut m = SyntheticMatcher { vocab_size: 300 };
        let masks: Vec<u32> = [&[][..], &[1], &[2], &[1, 2], &[2, 1]]
            .iter()
            .map(|o| SyntheticMatcher::ruled_out(o))
            .collect();
        assert!(masks.iter().any(|&k| k != masks[0]), "the output moves the mask: {masks:?}");
        let swapped = |a: u32| {
            SyntheticMatcher::ruled_out(&[a, a + 1]) != SyntheticMatcher::ruled_out(&[a + 1, a])
        };
        assert!((0..20).any(swapped), "the order of the output moves the mask");
        for output in [&[][..], &[7, 8, 9], &[1; 40]] {
            let mask = m.allowed(output);
            let k = SyntheticMatcher::ruled_out(output);
            assert!(mask.allows(0));
            for base in 0..290 {
                let kept = (base..base + 8).filter(|&t| mask.allows(t)).count();
                assert!(kept >= 5, "{kept} of 8 from {base}");
            }
            // Every token of the vocabulary, the last word's (288 to 299) too.
            for token in 1..300 {
                assert_eq!(mask.allows(token), token % 3 != k, "token {token}");
            }
        }
        assert!(!m.allowed(&[]).allows(300) && !m.allowed(&[]).allows(1 << 20));
        let grammars = SyntheticGrammars { vocab_size: 300 };
        assert!(grammars.compile(&Grammar::JsonObject).is_ok());
        assert!(grammars.compile(&Grammar::JsonSchema("{\"type\": \"object\"}".into())).is_ok());
        assert!(grammars.compile(&Grammar::JsonSchema("7".into())).is_err());
        assert!(grammars.compile(&Grammar::Lark(" ".into())).is_err());
        assert!(grammars.compile(&Grammar::Lark("start: \"a\"".into())).is_ok());
    }

    /// The remainder an output rules out is FNV-1a of its tokens by 3: pinned from an
    /// independent transcription (Python), so that a change to the fold, or a remainder past 2
    /// (which would rule nothing out, and the mask above would still agree with it), shows.
    #[test]
    fn the_remainder_ruled_out_is_pinned() {
        let pinned: [(&[u32], u32); 5] =
            [(&[], 2), (&[1], 2), (&[1, 2, 3], 1), (&[7, 7], 2), (&[100, 5], 1)];
        for (output, k) in pinned {
            assert_eq!(SyntheticMatcher::ruled_out(output), k, "{output:?}");
        }
    }
}
