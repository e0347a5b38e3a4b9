//! From token ids to the text a client sees: the model's text codec, incremental detokenization
//! that never splits a character, and stop strings matched across token boundaries.

mod codec;
mod detokenize;
mod stop;

pub use codec::{ChatEnd, ChatPrompt, ModelCodec, SyntheticCodec, TextCodec};
pub use detokenize::Detokenizer;
pub use stop::StopMatcher;
