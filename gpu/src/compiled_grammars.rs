//! The grammars a compiler compiled lately, so that a grammar seen again costs a clone, not a
//! compile. Each request's grammar is compiled twice even when nobody repeats it (the HTTP edge
//! compiles it to answer a bad schema with a 400, the executor again to decode it; a reasoning
//! server's edge once more, wrapped after the thinking), and the executor's compile stalls the
//! step of every request in the batch. And agents repeat them: every turn of a session sends the
//! same tools, so `tool_choice: "required"` or a named tool gives the same grammar turn after
//! turn.
//!
//! A compile's result is a function of the grammar alone (the cache holds the matcher before any
//! output, and hands out clones), so what the cache holds changes no output, only how long an
//! admission takes. Bounded by entries and by the grammars' text, least recently used out first.

use std::collections::VecDeque;

use lockstep_core::model::{CompileCounts, Grammar};

/// At most this many compiled grammars are kept...
pub const COMPILED_GRAMMARS_MAX: usize = 64;
/// ...and at most this much grammar text among them (a compiled grammar's size follows its
/// text's; a grammar longer than this is compiled every time).
pub const COMPILED_GRAMMAR_BYTES_MAX: usize = 4 << 20;

/// Compiled grammars (`T`: a compile's result, errors included: a schema refused once is refused
/// again without compiling it), most recently used first.
#[derive(Debug)]
pub(crate) struct CompiledGrammars<T> {
    entries: VecDeque<(Grammar, T)>,
    entries_max: usize,
    bytes_max: usize,
    /// The text of the grammars in `entries`.
    bytes: usize,
    counts: CompileCounts,
}

impl<T: Clone> CompiledGrammars<T> {
    pub(crate) fn new(entries_max: usize, bytes_max: usize) -> CompiledGrammars<T> {
        CompiledGrammars {
            entries: VecDeque::new(),
            entries_max,
            bytes_max,
            bytes: 0,
            counts: CompileCounts::default(),
        }
    }

    /// `grammar`'s compiled result, if kept; it becomes the most recently used.
    pub(crate) fn get(&mut self, grammar: &Grammar) -> Option<T> {
        let found = self.entries.iter().position(|(kept, _)| kept == grammar);
        let entry = found.and_then(|at| self.entries.remove(at));
        let Some(entry) = entry else {
            self.counts.misses += 1;
            return None;
        };
        self.counts.hits += 1;
        let value = entry.1.clone();
        self.entries.push_front(entry);
        Some(value)
    }

    /// Keeps `value` as `grammar`'s result (replacing one kept already: two compiles of one
    /// grammar may race), dropping the least recently used past the bounds.
    pub(crate) fn insert(&mut self, grammar: Grammar, value: T) {
        let size = text_bytes(&grammar);
        if self.entries_max == 0 || size > self.bytes_max {
            return;
        }
        if let Some(at) = self.entries.iter().position(|(kept, _)| *kept == grammar) {
            self.entries.remove(at);
            self.bytes -= size;
        }
        self.entries.push_front((grammar, value));
        self.bytes += size;
        while self.entries.len() > self.entries_max || self.bytes > self.bytes_max {
            let Some((dropped, _)) = self.entries.pop_back() else { break };
            self.bytes -= text_bytes(&dropped);
        }
        if cfg!(debug_assertions) {
            self.check_invariants();
        }
    }

    pub(crate) fn counts(&self) -> CompileCounts {
        self.counts
    }

    pub(crate) fn check_invariants(&self) {
        assert!(self.entries.len() <= self.entries_max, "more grammars kept than the bound");
        let bytes: usize = self.entries.iter().map(|(g, _)| text_bytes(g)).sum();
        assert_eq!(bytes, self.bytes, "the kept text's size is off");
        assert!(self.bytes <= self.bytes_max, "more grammar text kept than the bound");
        for (at, (grammar, _)) in self.entries.iter().enumerate() {
            let again = self.entries.iter().skip(at + 1).any(|(other, _)| other == grammar);
            assert!(!again, "a grammar kept twice");
        }
    }
}

fn text_bytes(grammar: &Grammar) -> usize {
    match grammar {
        Grammar::JsonObject => 0,
        Grammar::JsonSchema(text) | Grammar::Lark(text) => text.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lark(n: usize) -> Grammar {
        Grammar::Lark(format!("start: \"{n}\""))
    }

    #[test]
    fn a_grammar_seen_again_is_a_hit_and_the_least_recently_used_goes_first() {
        let mut cache = CompiledGrammars::new(3, 1 << 20);
        for n in 0..3 {
            assert_eq!(cache.get(&lark(n)), None);
            cache.insert(lark(n), n);
        }
        // 0 used again: 1 is now the least recently used, and the fourth grammar drops it.
        assert_eq!(cache.get(&lark(0)), Some(0));
        cache.insert(lark(3), 3);
        assert_eq!(cache.get(&lark(1)), None);
        assert_eq!(cache.get(&lark(0)), Some(0));
        assert_eq!(cache.get(&lark(2)), Some(2));
        assert_eq!(cache.get(&lark(3)), Some(3));
        assert_eq!(cache.counts(), CompileCounts { hits: 4, misses: 4 });
        assert_eq!(cache.get(&Grammar::JsonObject), None);
        cache.check_invariants();
    }

    #[test]
    fn the_text_bound_drops_old_grammars_and_never_keeps_one_over_it() {
        let text = |n: usize| Grammar::JsonSchema("x".repeat(n));
        let mut cache = CompiledGrammars::new(8, 100);
        cache.insert(text(40), 1);
        cache.insert(text(50), 2);
        cache.insert(text(30), 3);
        assert_eq!(cache.get(&text(40)), None, "90 + 30 is over 100: the oldest goes");
        assert_eq!(cache.get(&text(50)), Some(2));
        cache.insert(text(101), 4);
        assert_eq!(cache.get(&text(101)), None, "longer than the bound: never kept");
        assert_eq!(cache.get(&text(30)), Some(3), "and it dropped nothing");
        cache.check_invariants();
    }

    #[test]
    fn a_grammar_compiled_twice_at_once_is_kept_once() {
        let mut cache = CompiledGrammars::new(4, 1 << 20);
        cache.insert(lark(1), 1);
        cache.insert(lark(1), 10);
        cache.check_invariants();
        assert_eq!(cache.get(&lark(1)), Some(10));
        let mut off = CompiledGrammars::new(0, 1 << 20);
        off.insert(lark(1), 1);
        assert_eq!(off.get(&lark(1)), None);
    }
}
