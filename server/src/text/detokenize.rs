//! Incremental detokenization: each new token yields the text it adds, once that text is whole.
//!
//! Decoding token by token goes wrong twice: a character split across tokens decodes to U+FFFD
//! halves, and tokenizers that strip or merge spaces decode a token differently after its
//! neighbours. So each token decodes a short window of the tokens before it, and the new text is
//! what the window with it adds to the window without it (as vLLM and TGI do). The window moves
//! on only once its text is whole, so a step costs O(window), not O(sequence).

use super::TextCodec;

#[derive(Debug, Default)]
pub struct Detokenizer {
    tokens: Vec<u32>,
    /// The window starts here...
    prefix_offset: usize,
    /// ...and its text up to here is out already.
    read_offset: usize,
}

impl Detokenizer {
    pub fn new() -> Detokenizer {
        Detokenizer::default()
    }

    /// The text `token` adds, possibly empty while a character is incomplete.
    pub fn push(&mut self, codec: &dyn TextCodec, token: u32) -> Result<String, String> {
        self.tokens.push(token);
        let before = codec.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let after = codec.decode(&self.tokens[self.prefix_offset..])?;
        if after.len() > before.len()
            && after.is_char_boundary(before.len())
            && after.starts_with(&before)
            && !after.ends_with('\u{fffd}')
        {
            let delta = after[before.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the end of the output).
    pub fn finish(&mut self, codec: &dyn TextCodec) -> Result<String, String> {
        let before = codec.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let after = codec.decode(&self.tokens[self.prefix_offset..])?;
        self.read_offset = self.tokens.len();
        self.prefix_offset = self.read_offset;
        Ok(match after.strip_prefix(&before) {
            Some(rest) => rest.to_owned(),
            None => String::new(),
        })
    }
}
