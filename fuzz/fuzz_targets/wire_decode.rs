//! Arbitrary bytes into the wire codec, as a peer or an attacker could send them: no panic, no
//! unbounded allocation (libFuzzer's -rss_limit_mb catches one), and whatever decodes encodes back
//! to the same bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use lockstep_core::wire::{decode_frame, encode_frame, frame_len};

fuzz_target!(|bytes: &[u8]| {
    let mut rest = bytes;
    // Read it as a stream of frames, as a peer link does.
    while let Ok(Some(len)) = frame_len(rest) {
        let Some(frame) = rest.get(..len) else { break };
        if let Ok(envelope) = decode_frame(frame) {
            let again =
                encode_frame(&envelope, Vec::new()).expect("a decoded frame is within the bounds");
            assert_eq!(again.as_slice(), frame, "a decoded frame did not encode back to its bytes");
        }
        rest = &rest[len..];
    }
});
