//! Frames on a byte stream: `wire` envelopes behind a 4-byte length, read into a buffer bounded
//! by `frame_bytes_max` and written one frame at a time, every wait under a timeout. A frame
//! that is too long or does not decode breaks the link (an error, never a panic): after it,
//! nothing on the stream can be trusted to start at a frame boundary.

use std::time::Duration;

use lockstep_core::wire::{Envelope, decode_frame, frame_len};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout, timeout_at};

use super::error::LinkError;

/// The length prefix in front of every frame (`wire::frame_len` reads it).
pub const LENGTH_PREFIX_BYTES: usize = 4;
/// How far a read may run ahead of the frame it needs, so that small frames arriving together
/// take one read. The buffer shrinks back to this after a larger frame.
const READ_AHEAD_BYTES: usize = 64 << 10;

/// Reads frames from one stream.
#[derive(Debug)]
pub struct FrameReader<R> {
    io: R,
    /// `buf[..filled]` are bytes read and not yet returned as a frame.
    buf: Vec<u8>,
    filled: usize,
    frame_bytes_max: usize,
    /// When the first byte of the frame now arriving came; `None` between frames.
    frame_started: Option<Instant>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(io: R, frame_bytes_max: usize) -> FrameReader<R> {
        FrameReader { io, buf: Vec::new(), filled: 0, frame_bytes_max, frame_started: None }
    }

    /// Changes the bound on frames read from now on (the handshake reads with a small one).
    pub fn set_frame_bytes_max(&mut self, frame_bytes_max: usize) {
        self.frame_bytes_max = frame_bytes_max;
    }

    /// The next whole frame and its size in bytes. Fails when no byte arrives for
    /// `silence_max`, when a frame is not whole `frame_time_max` after its first byte, at the
    /// end of the stream, and on a frame over the bound or one that does not decode.
    ///
    /// Cancel-safe: bytes read stay in the buffer for the next call.
    pub async fn read(
        &mut self,
        silence_max: Duration,
        frame_time_max: Duration,
    ) -> Result<(Envelope, usize), LinkError> {
        loop {
            let wanted = match self.buffered_frame_len()? {
                Some(len) if len <= self.filled => return self.take_frame(len),
                Some(len) => len,
                None => LENGTH_PREFIX_BYTES,
            };
            let end = wanted.max(READ_AHEAD_BYTES.min(self.frame_bytes_max));
            if self.buf.len() < end {
                self.buf.resize(end, 0);
            }
            let silence_end = Instant::now() + silence_max;
            let frame_end = self.frame_started.map(|start| start + frame_time_max);
            let deadline = frame_end.map_or(silence_end, |end| end.min(silence_end));
            let read = timeout_at(deadline, self.io.read(&mut self.buf[self.filled..end])).await;
            match read {
                Err(_) if frame_end.is_some_and(|end| end <= silence_end) => {
                    return Err(LinkError::SlowFrame);
                }
                Err(_) => return Err(LinkError::Silent),
                Ok(Err(e)) => return Err(e.into()),
                Ok(Ok(0)) => return Err(LinkError::Closed),
                Ok(Ok(n)) => {
                    if self.filled == 0 {
                        self.frame_started = Some(Instant::now());
                    }
                    self.filled += n;
                }
            }
        }
    }

    /// The length of the frame at the start of the buffer, once its prefix is in.
    fn buffered_frame_len(&self) -> Result<Option<usize>, LinkError> {
        let len = frame_len(&self.buf[..self.filled]).map_err(LinkError::BadFrame)?;
        match len {
            Some(len) if len > self.frame_bytes_max => {
                Err(LinkError::FrameTooLong { len, max: self.frame_bytes_max })
            }
            len => Ok(len),
        }
    }

    fn take_frame(&mut self, len: usize) -> Result<(Envelope, usize), LinkError> {
        let envelope = decode_frame(&self.buf[..len]).map_err(LinkError::BadFrame)?;
        self.buf.copy_within(len..self.filled, 0);
        self.filled -= len;
        // The bytes after this frame began the next one; they arrived no earlier than now.
        self.frame_started = (self.filled > 0).then(Instant::now);
        if self.buf.len() > 2 * READ_AHEAD_BYTES && self.filled <= READ_AHEAD_BYTES {
            self.buf.truncate(READ_AHEAD_BYTES);
            self.buf.shrink_to_fit();
        }
        Ok((envelope, len))
    }
}

/// Writes one encoded frame whole within `write_time_max`. Not cancel-safe (a frame cut short
/// breaks the stream), so the link never races a write against anything but shutdown.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    io: &mut W,
    frame: &[u8],
    write_time_max: Duration,
) -> Result<(), LinkError> {
    let write = async {
        io.write_all(frame).await?;
        io.flush().await
    };
    match timeout(write_time_max, write).await {
        Err(_) => Err(LinkError::WriteTimeout),
        Ok(result) => result.map_err(LinkError::from),
    }
}

#[cfg(test)]
mod tests {
    use lockstep_core::wire::{Endpoint, Incarnation, Message, WorkerId, encode_frame};
    use tokio::io::duplex;

    use super::*;

    fn ping(nonce: u64) -> Vec<u8> {
        let e = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
        let envelope = Envelope { from: e, to: e, body: Message::Ping { nonce } };
        encode_frame(&envelope, Vec::new()).expect("a ping encodes")
    }

    const LONG: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn frames_split_and_joined_arbitrarily_come_out_whole_and_in_order() {
        let (mut tx, rx) = duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 1 << 10);
        let bytes: Vec<u8> = (0..50).flat_map(ping).collect();
        for chunk in bytes.chunks(7) {
            tx.write_all(chunk).await.expect("duplex takes it");
        }
        for nonce in 0..50 {
            let (envelope, _) = reader.read(LONG, LONG).await.expect("a whole frame");
            assert_eq!(envelope.body, Message::Ping { nonce });
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_length_over_the_bound_is_an_error_before_any_allocation() {
        let (mut tx, rx) = duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 1 << 10);
        tx.write_all(&(1u32 << 20).to_le_bytes()).await.expect("duplex takes it");
        let error = reader.read(LONG, LONG).await.expect_err("over the bound");
        assert!(matches!(error, LinkError::FrameTooLong { max: 1024, .. }), "{error:?}");
        assert!(reader.buf.len() <= 1 << 10);
    }

    #[tokio::test(start_paused = true)]
    async fn garbage_inside_a_frame_is_an_error() {
        let (mut tx, rx) = duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 1 << 10);
        tx.write_all(&[8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])
            .await
            .expect("duplex takes it");
        let error = reader.read(LONG, LONG).await.expect_err("not a frame");
        assert!(matches!(error, LinkError::BadFrame(_)), "{error:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn silence_and_a_stalled_frame_are_told_apart() {
        let (mut tx, rx) = duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 1 << 10);
        let silence = reader.read(Duration::from_secs(1), LONG).await.expect_err("silence");
        assert_eq!(silence, LinkError::Silent);
        tx.write_all(&ping(1)[..3]).await.expect("duplex takes it");
        let started = Instant::now();
        let stalled = reader.read(LONG, Duration::from_secs(2)).await.expect_err("stalled");
        assert_eq!(stalled, LinkError::SlowFrame);
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_the_stream_closes_the_link() {
        let (tx, rx) = duplex(1 << 16);
        let mut reader = FrameReader::new(rx, 1 << 10);
        drop(tx);
        assert_eq!(reader.read(LONG, LONG).await.expect_err("closed"), LinkError::Closed);
    }
}
