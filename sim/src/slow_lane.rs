//! The slow-KV-lane fault: a prefill worker's KV lanes deliver their bytes late while its control
//! links do not, as a congested RDMA path does beside a quiet TCP control channel. turmoil's
//! latency is per pair of hosts, and both lanes join the same two hosts, so the delay is applied
//! here, at the dialer's end of a KV lane: each write leaves for the network once the lane's
//! current delay has passed since it was made, in order (a stream stays a stream).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};
use tokio::sync::mpsc::{self, OwnedPermit};
use tokio::time::{Instant, sleep_until};

/// Writes made and not yet sent on one slowed lane: a write waits for room beyond this.
const WRITES_DELAYED_MAX: usize = 1024;

/// How late the run's KV lanes deliver now; zero when the fault is off. Shared by every host's
/// dialer and the run's fault schedule (hosts run one at a time, between the schedule's steps).
#[derive(Clone, Debug, Default)]
pub struct KvLaneDelay(Arc<AtomicU64>);

impl KvLaneDelay {
    pub fn set(&self, delay: Duration) {
        self.0.store(delay.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

type Item = (Instant, Vec<u8>);
type Reserving = Pin<Box<dyn Future<Output = Result<OwnedPermit<Item>, ()>> + Send>>;

/// A stream whose writes reach the network `delay` after they were made. Reads pass straight
/// through; a task of the host's runtime sends the writes when due, and ends with the stream.
pub struct SlowLane<S> {
    read: ReadHalf<S>,
    /// `None` once shut down: the sending task sends what is queued, then shuts the stream.
    queue: Option<mpsc::Sender<Item>>,
    reserving: Option<Reserving>,
    delay: KvLaneDelay,
}

impl<S> std::fmt::Debug for SlowLane<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlowLane").field("delay", &self.delay.get()).finish_non_exhaustive()
    }
}

impl<S: AsyncRead + AsyncWrite + Send + 'static> SlowLane<S> {
    /// Wraps `stream`; must run inside the host's runtime (it starts the sending task there).
    pub fn new(stream: S, delay: KvLaneDelay) -> SlowLane<S> {
        let (read, write) = tokio::io::split(stream);
        let (queue, writes) = mpsc::channel(WRITES_DELAYED_MAX);
        tokio::spawn(send_when_due(write, writes));
        SlowLane { read, queue: Some(queue), reserving: None, delay }
    }
}

async fn send_when_due<S: AsyncWrite>(mut write: WriteHalf<S>, mut writes: mpsc::Receiver<Item>) {
    while let Some((due, bytes)) = writes.recv().await {
        sleep_until(due).await;
        if write.write_all(&bytes).await.is_err() {
            return;
        }
    }
    let _ = write.shutdown().await;
}

impl<S: AsyncRead> AsyncRead for SlowLane<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl<S> AsyncWrite for SlowLane<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            if let Some(reserving) = &mut this.reserving {
                let permit = std::task::ready!(reserving.as_mut().poll(cx));
                this.reserving = None;
                let Ok(permit) = permit else {
                    return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
                };
                permit.send((Instant::now() + this.delay.get(), buf.to_vec()));
                return Poll::Ready(Ok(buf.len()));
            }
            let Some(queue) = this.queue.clone() else {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            };
            this.reserving =
                Some(Box::pin(async move { queue.reserve_owned().await.map_err(drop) }));
        }
    }

    /// The bytes are on their way, as a socket's are once the kernel has them.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.queue = None;
        self.reserving = None;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn writes_arrive_in_order_each_the_delay_after_it_was_made() {
        let (near, mut far) = duplex(1 << 16);
        let delay = KvLaneDelay::default();
        delay.set(Duration::from_millis(200));
        let mut lane = SlowLane::new(near, delay.clone());
        let start = Instant::now();
        lane.write_all(b"first").await.expect("queued");
        delay.set(Duration::ZERO);
        // Made later with no delay, it still follows the first.
        lane.write_all(b"-second").await.expect("queued");
        let mut got = vec![0; 12];
        far.read_exact(&mut got).await.expect("both arrive");
        assert_eq!(&got, b"first-second");
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        far.write_all(b"back").await.expect("the far end writes");
        let mut back = [0; 4];
        lane.read_exact(&mut back).await.expect("reads are not delayed");
        assert_eq!(&back, b"back");
        lane.shutdown().await.expect("shuts");
        let mut rest = Vec::new();
        far.read_to_end(&mut rest).await.expect("ends after the queued bytes");
        assert!(rest.is_empty());
    }
}
