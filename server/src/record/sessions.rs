//! Turn numbers per session id, for at most `sessions_max` sessions: when full, the session used
//! least recently is forgotten (if it comes back, its turns count from 1 again).

use std::collections::BTreeMap;

#[derive(Debug)]
pub(super) struct Sessions {
    /// Session id to (turns so far, last use).
    by_id: BTreeMap<String, (u32, u64)>,
    /// Last use to session id: the least recently used first.
    by_use: BTreeMap<u64, String>,
    uses: u64,
    sessions_max: usize,
}

impl Sessions {
    pub(super) fn new(sessions_max: usize) -> Sessions {
        assert!(sessions_max > 0, "at least one session");
        Sessions { by_id: BTreeMap::new(), by_use: BTreeMap::new(), uses: 0, sessions_max }
    }

    /// The next turn of `session`, from 1.
    pub(super) fn next_turn(&mut self, session: &str) -> u32 {
        self.uses += 1;
        let turn = match self.by_id.get_mut(session) {
            Some((turns, last)) => {
                self.by_use.remove(last);
                *turns = turns.saturating_add(1);
                *last = self.uses;
                *turns
            }
            None => {
                if self.by_id.len() == self.sessions_max
                    && let Some((_, oldest)) = self.by_use.pop_first()
                {
                    self.by_id.remove(&oldest);
                }
                self.by_id.insert(session.to_owned(), (1, self.uses));
                1
            }
        };
        self.by_use.insert(self.uses, session.to_owned());
        debug_assert_eq!(self.by_id.len(), self.by_use.len());
        assert!(self.by_id.len() <= self.sessions_max, "sessions bounded");
        turn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_count_per_session_and_the_least_recently_used_is_forgotten() {
        let mut s = Sessions::new(2);
        assert_eq!(s.next_turn("a"), 1);
        assert_eq!(s.next_turn("b"), 1);
        assert_eq!(s.next_turn("a"), 2);
        // Full: "b" was used least recently.
        assert_eq!(s.next_turn("c"), 1);
        assert_eq!(s.next_turn("a"), 3);
        assert_eq!(s.next_turn("b"), 1, "b was forgotten");
        assert_eq!(s.next_turn("a"), 4, "a was used more recently than c");
        assert_eq!(s.next_turn("c"), 1, "c was forgotten when b came back");
    }
}
