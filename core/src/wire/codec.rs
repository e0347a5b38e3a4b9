//! The primitives of lockstep's binary format: LEB128 varints, zigzag signed integers, strict
//! booleans, and length-prefixed sequences whose length is checked against the bytes that remain
//! before anything is allocated. Decoding never panics and never allocates more than the input
//! could describe.

use std::fmt;

/// Why bytes did not decode. Each names what was being read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// The input ended inside a value.
    Truncated { what: &'static str },
    /// A varint longer than its type allows, or with bits beyond it.
    Overlong { what: &'static str },
    /// A value outside its type's range (a bool other than 0 or 1, an enum tag, a zero where one
    /// is forbidden).
    Invalid { what: &'static str, value: u64 },
    /// A sequence longer than its bound, or than the bytes left could hold.
    TooLong { what: &'static str, len: u64, max: u64 },
    /// A frame of a version this build does not speak.
    UnsupportedVersion { got: u8, supported: u8 },
    /// A message kind this build does not know.
    UnknownKind(u8),
    /// Bytes left over after the message ended.
    TrailingBytes { count: usize },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated { what } => write!(f, "input ends inside {what}"),
            WireError::Overlong { what } => write!(f, "overlong varint in {what}"),
            WireError::Invalid { what, value } => write!(f, "invalid {what}: {value}"),
            WireError::TooLong { what, len, max } => {
                write!(f, "{what} of length {len} is over {max}")
            }
            WireError::UnsupportedVersion { got, supported } => {
                write!(f, "wire version {got} is not supported (this build speaks {supported})")
            }
            WireError::UnknownKind(kind) => write!(f, "unknown message kind {kind}"),
            WireError::TrailingBytes { count } => write!(f, "{count} bytes after the message"),
        }
    }
}

impl std::error::Error for WireError {}

/// Appends values to a buffer.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn with_buffer(buf: Vec<u8>) -> Writer {
        Writer { buf }
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn u8(&mut self, value: u8) {
        self.buf.push(value);
    }

    pub fn bool(&mut self, value: bool) {
        self.buf.push(u8::from(value));
    }

    pub fn u64(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.buf.push(value as u8 | 0x80);
            value >>= 7;
        }
        self.buf.push(value as u8);
    }

    pub fn u32(&mut self, value: u32) {
        self.u64(u64::from(value));
    }

    pub fn i32(&mut self, value: i32) {
        self.u32(((value << 1) ^ (value >> 31)) as u32);
    }

    /// Fixed four bytes, little-endian: floats are bit patterns, not numbers to compress.
    pub fn f32(&mut self, value: f32) {
        self.buf.extend_from_slice(&value.to_bits().to_le_bytes());
    }

    /// Fixed four bytes, little-endian, for patching lengths in after the fact.
    pub fn u32_fixed(&mut self, value: u32) {
        self.buf.extend_from_slice(&value.to_le_bytes());
    }

    pub fn bytes(&mut self, value: &[u8]) {
        self.u64(value.len() as u64);
        self.buf.extend_from_slice(value);
    }

    pub fn u32s(&mut self, values: &[u32]) {
        self.u64(values.len() as u64);
        for &value in values {
            self.u32(value);
        }
    }

    /// Overwrites four bytes at `at` (a length written as a placeholder).
    pub(crate) fn patch_u32_fixed(&mut self, at: usize, value: u32) {
        self.buf[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }
}

/// Reads values from a byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Errors unless every byte was read.
    pub fn finish(self) -> Result<(), WireError> {
        match self.rest.len() {
            0 => Ok(()),
            count => Err(WireError::TrailingBytes { count }),
        }
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        let (&first, rest) = self.rest.split_first().ok_or(WireError::Truncated { what })?;
        self.rest = rest;
        Ok(first)
    }

    pub fn bool(&mut self, what: &'static str) -> Result<bool, WireError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(WireError::Invalid { what, value: u64::from(value) }),
        }
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8(what)?;
            let bits = u64::from(byte & 0x7f);
            // The tenth byte may carry only the top bit of a u64.
            if shift == 63 && bits > 1 {
                return Err(WireError::Overlong { what });
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                // One encoding per value: a last byte of zero after the first is padding.
                if byte == 0 && shift > 0 {
                    return Err(WireError::Overlong { what });
                }
                return Ok(value);
            }
        }
        Err(WireError::Overlong { what })
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let value = self.u64(what)?;
        u32::try_from(value).map_err(|_| WireError::Invalid { what, value })
    }

    pub fn i32(&mut self, what: &'static str) -> Result<i32, WireError> {
        let zigzag = self.u32(what)?;
        Ok((zigzag >> 1) as i32 ^ -((zigzag & 1) as i32))
    }

    pub fn f32(&mut self, what: &'static str) -> Result<f32, WireError> {
        Ok(f32::from_bits(u32::from_le_bytes(self.array(what)?)))
    }

    pub fn u32_fixed(&mut self, what: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed byte string of at most `max` bytes, borrowed from the input.
    pub fn bytes(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], WireError> {
        let len = self.len(what, max, 1)?;
        let (bytes, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(bytes)
    }

    /// A length-prefixed sequence of at most `max` varint `u32`s.
    pub fn u32s(&mut self, what: &'static str, max: usize) -> Result<Vec<u32>, WireError> {
        let len = self.len(what, max, 1)?;
        let mut values = Vec::with_capacity(len);
        for _ in 0..len {
            values.push(self.u32(what)?);
        }
        Ok(values)
    }

    /// A sequence length, at most `max`, and small enough that `len` elements of at least
    /// `min_element_bytes` each fit in what is left: an allocation of that length is bounded by
    /// the input's own size.
    pub fn len(
        &mut self,
        what: &'static str,
        max: usize,
        min_element_bytes: usize,
    ) -> Result<usize, WireError> {
        let len = self.u64(what)?;
        let fits = (self.rest.len() / min_element_bytes.max(1)) as u64;
        if len > max as u64 || len > fits {
            return Err(WireError::TooLong { what, len, max: (max as u64).min(fits) });
        }
        Ok(len as usize)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let (head, rest) =
            self.rest.split_first_chunk::<N>().ok_or(WireError::Truncated { what })?;
        self.rest = rest;
        Ok(*head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_the_edges() {
        for value in [0, 1, 127, 128, 16_383, 16_384, u64::from(u32::MAX), u64::MAX - 1, u64::MAX] {
            let mut w = Writer::new();
            w.u64(value);
            let bytes = w.into_bytes();
            let mut r = Reader::new(&bytes);
            assert_eq!(r.u64("v"), Ok(value));
            r.finish().unwrap();
        }
        for value in [0, 1, -1, 63, -64, i32::MAX, i32::MIN] {
            let mut w = Writer::new();
            w.i32(value);
            let bytes = w.into_bytes();
            assert_eq!(Reader::new(&bytes).i32("v"), Ok(value));
        }
    }

    #[test]
    fn malformed_varints_are_errors() {
        assert_eq!(Reader::new(&[0x80]).u64("v"), Err(WireError::Truncated { what: "v" }));
        assert_eq!(Reader::new(&[0xff; 11]).u64("v"), Err(WireError::Overlong { what: "v" }));
        let mut ten = [0xff; 10];
        ten[9] = 0x02; // a bit beyond 64
        assert_eq!(Reader::new(&ten).u64("v"), Err(WireError::Overlong { what: "v" }));
        // 0x7f padded to two bytes: the same value, a second encoding, refused.
        assert_eq!(Reader::new(&[0xff, 0x00]).u64("v"), Err(WireError::Overlong { what: "v" }));
        let mut w = Writer::new();
        w.u64(u64::from(u32::MAX) + 1);
        let bytes = w.into_bytes();
        assert!(matches!(Reader::new(&bytes).u32("v"), Err(WireError::Invalid { .. })));
        assert!(matches!(Reader::new(&[2]).bool("b"), Err(WireError::Invalid { value: 2, .. })));
    }

    #[test]
    fn lengths_are_bounded_by_max_and_by_the_input() {
        // A length of 2^40 in a 6-byte input must not allocate.
        let mut w = Writer::new();
        w.u64(1 << 40);
        let bytes = w.into_bytes();
        assert!(matches!(
            Reader::new(&bytes).u32s("tokens", usize::MAX),
            Err(WireError::TooLong { .. })
        ));
        let mut w = Writer::new();
        w.u32s(&[1, 2, 3]);
        let bytes = w.into_bytes();
        assert!(matches!(
            Reader::new(&bytes).u32s("tokens", 2),
            Err(WireError::TooLong { max: 2, .. })
        ));
        assert_eq!(Reader::new(&bytes).u32s("tokens", 3), Ok(vec![1, 2, 3]));
        // Within its max, but more elements of two bytes each than the ten bytes left hold.
        let mut w = Writer::new();
        assert!(w.is_empty());
        w.u64(8);
        assert!(!w.is_empty());
        let mut bytes = w.into_bytes();
        bytes.extend([0; 10]);
        assert_eq!(
            Reader::new(&bytes).len("pages", 1000, 2),
            Err(WireError::TooLong { what: "pages", len: 8, max: 5 })
        );
        assert_eq!(Reader::new(&bytes).len("pages", 1000, 1), Ok(8));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let r = Reader::new(&[1, 2]);
        assert_eq!(r.finish(), Err(WireError::TrailingBytes { count: 2 }));
    }
}
