//! Stop strings, matched across token boundaries: text that could be the start of a stop string
//! is held back until the next text shows whether it is one.

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would stop before anything).
    pub fn new(stops: &[String]) -> StopMatcher {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher { stops, held: String::new(), stopped: false }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Takes the next text; returns what may go out now. Once a stop string is seen, the text
    /// before it goes out, `stopped()` turns true, and everything after is dropped.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        let earliest = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = earliest {
            self.stopped = true;
            let out = self.held[..at].to_owned();
            self.held.clear();
            return out;
        }
        let keep = self.longest_partial_suffix();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        out
    }

    /// The text still held at the end of the output: no stop string came.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes at the end of the held text that begin some stop string, at a char boundary.
    fn longest_partial_suffix(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            for (at, _) in held.char_indices().rev().take(stop.chars().count()) {
                let suffix = &held[at..];
                if suffix.len() < stop.len() && stop.starts_with(suffix) {
                    best = best.max(suffix.len());
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| (*s).to_owned()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            out.push_str(&m.push(p));
        }
        if !m.stopped() {
            out.push_str(&m.finish());
        }
        (out, m.stopped())
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_cut() {
        assert_eq!(run(&["END"], &["abc E", "N", "D more"]), ("abc ".into(), true));
        assert_eq!(run(&["\n\n"], &["line\n", "\nnext"]), ("line".into(), true));
        assert_eq!(run(&["xy", "b"], &["aaxyb"]), ("aa".into(), true), "the earliest wins");
    }

    #[test]
    fn a_false_start_is_released_and_nothing_is_lost() {
        assert_eq!(run(&["END"], &["E", "N", "X", "!"]), ("ENX!".into(), false));
        assert_eq!(
            run(&["END"], &["the E"]),
            ("the E".into(), false),
            "held text comes at the end"
        );
        assert_eq!(run(&[""], &["a"]), ("a".into(), false), "empty stops are ignored");
        assert_eq!(run(&["é!"], &["café", "s"]), ("cafés".into(), false));
    }

    #[test]
    fn every_split_of_a_text_gives_the_same_answer() {
        let text = "one two\nthree ## four ##! five";
        for stops in [&["##!"][..], &["zz"], &["two\nth", "four"]] {
            let whole = run(stops, &[text]);
            for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
                assert_eq!(run(stops, &[&text[..cut], &text[cut..]]), whole, "cut at {cut}");
            }
        }
    }
}
