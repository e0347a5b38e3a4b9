//! The wire: message types of the transfer protocol and the router, and their versioned,
//! length-prefixed binary codec. Decoding arbitrary bytes returns an error, never panics, and
//! never allocates more than the input could describe.

mod codec;
mod frame;
mod link;
mod messages;

pub use codec::{Reader, WireError, Writer};
pub use frame::{
    FRAME_BYTES_MAX, GRAMMAR_BYTES_MAX, LOGIT_BIAS_MAX, PAGES_MAX, PROMPT_TOKENS_MAX,
    STOP_TOKENS_MAX, TOKENS_PER_MESSAGE_MAX, WIRE_VERSION, decode_frame, encode_frame, frame_len,
};
pub use link::{check_lane, check_link};
pub use messages::*;

#[cfg(test)]
mod tests;
