//! Text cut into pieces at a format's markers (two, or three with DeepSeek V4.1's tool block), so
//! that each marker is a piece of its own however the text arrives: a suffix that may still grow
//! into a marker waits for what follows it.

/// One piece of the text.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Piece {
    /// Text with no marker in it.
    Text(String),
    /// One marker, whole.
    Marker(&'static str),
}

#[derive(Debug)]
pub(super) struct Cutter {
    markers: Vec<&'static str>,
    /// Text not yet cut: at most a marker's length less one, between pushes.
    held: String,
}

impl Cutter {
    /// No marker may be empty, nor hold another.
    pub(super) fn new(markers: &[&'static str]) -> Cutter {
        debug_assert!(markers.iter().all(|m| !m.is_empty()));
        debug_assert!(
            markers.iter().enumerate().all(|(i, a)| {
                markers.iter().enumerate().all(|(j, b)| i == j || !a.contains(b))
            })
        );
        Cutter { markers: markers.to_vec(), held: String::new() }
    }

    pub(super) fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut pieces = Vec::new();
        let mut rest = self.held.as_str();
        loop {
            let first = self
                .markers
                .iter()
                .filter_map(|&marker| rest.find(marker).map(|at| (at, marker)))
                .min_by_key(|&(at, _)| at);
            let Some((at, marker)) = first else { break };
            if at > 0 {
                pieces.push(Piece::Text(rest[..at].to_owned()));
            }
            pieces.push(Piece::Marker(marker));
            rest = &rest[at + marker.len()..];
        }
        let keep = self.partial_marker_len(rest);
        if keep < rest.len() {
            pieces.push(Piece::Text(rest[..rest.len() - keep].to_owned()));
        }
        self.held = rest[rest.len() - keep..].to_owned();
        pieces
    }

    /// The bytes held back, waiting for what follows them.
    pub(super) fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Ends the text: what was held is text.
    pub(super) fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() { Vec::new() } else { vec![Piece::Text(held)] }
    }

    /// The length of `text`'s longest suffix that is the start of a marker (not all of one).
    fn partial_marker_len(&self, text: &str) -> usize {
        let longest = self.markers.iter().map(|m| m.len() - 1).max().unwrap_or(0);
        (1..=longest.min(text.len()))
            .rev()
            .filter(|&n| text.is_char_boundary(text.len() - n))
            .find(|&n| self.markers.iter().any(|m| m.starts_with(&text[text.len() - n..])))
            .unwrap_or(0)
    }
}
