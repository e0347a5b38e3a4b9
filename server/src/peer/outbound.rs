//! One link's outbound queue, bounded twice: at most `send_queue_max` frames, and at most
//! `send_bytes_max` bytes in them (a few KV writes of large pages must not hold gigabytes).
//! A frame holds its bytes' share of the budget until the writer has written it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::timeout;

use super::error::SendError;

/// An encoded frame waiting for the writer, with its share of the byte budget.
#[derive(Debug)]
pub(crate) struct Outbound {
    pub(crate) frame: Vec<u8>,
    _bytes: OwnedSemaphorePermit,
}

/// The sending end, kept in the link table and cloned by each send.
#[derive(Clone, Debug)]
pub(crate) struct LinkSender {
    queue: mpsc::Sender<Outbound>,
    bytes: Arc<Semaphore>,
    bytes_max: usize,
}

/// The writer's end. Dropping it (the link ended) wakes every send still waiting for room.
#[derive(Debug)]
pub(crate) struct OutboundQueue {
    queue: mpsc::Receiver<Outbound>,
    bytes: Arc<Semaphore>,
}

pub(crate) fn channel(frames_max: usize, bytes_max: usize) -> (LinkSender, OutboundQueue) {
    let (tx, rx) = mpsc::channel(frames_max);
    // The semaphore's limit is far above any byte budget a configuration could ask for.
    let bytes = Arc::new(Semaphore::new(bytes_max.min(Semaphore::MAX_PERMITS)));
    let bytes_max = bytes_max.min(Semaphore::MAX_PERMITS);
    (LinkSender { queue: tx, bytes: bytes.clone(), bytes_max }, OutboundQueue { queue: rx, bytes })
}

impl LinkSender {
    /// Queues `frame` if there is room now.
    pub(crate) fn try_send(&self, frame: Vec<u8>) -> Result<(), SendError> {
        let permits = self.permits(&frame)?;
        let bytes = match self.bytes.clone().try_acquire_many_owned(permits) {
            Ok(bytes) => bytes,
            Err(tokio::sync::TryAcquireError::Closed) => return Err(SendError::LinkClosed),
            Err(tokio::sync::TryAcquireError::NoPermits) => return Err(SendError::Full),
        };
        self.queue.try_send(Outbound { frame, _bytes: bytes }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => SendError::Full,
            mpsc::error::TrySendError::Closed(_) => SendError::LinkClosed,
        })
    }

    /// Queues `frame`, waiting at most `wait_max` for bytes and a slot.
    pub(crate) async fn send(&self, frame: Vec<u8>, wait_max: Duration) -> Result<(), SendError> {
        let permits = self.permits(&frame)?;
        let room = async {
            let bytes = self.bytes.clone().acquire_many_owned(permits).await;
            let bytes = bytes.map_err(|_| SendError::LinkClosed)?;
            let slot = self.queue.reserve().await.map_err(|_| SendError::LinkClosed)?;
            slot.send(Outbound { frame, _bytes: bytes });
            Ok(())
        };
        timeout(wait_max, room).await.unwrap_or(Err(SendError::TimedOut))
    }

    /// The frame's share of the budget; a frame larger than the whole budget can never be sent.
    fn permits(&self, frame: &[u8]) -> Result<u32, SendError> {
        let too_large = SendError::TooLarge { bytes: frame.len(), max: self.bytes_max };
        if frame.len() > self.bytes_max {
            return Err(too_large);
        }
        u32::try_from(frame.len()).map_err(|_| too_large)
    }
}

impl OutboundQueue {
    /// The next frame to write; `None` once every sender is gone.
    pub(crate) async fn recv(&mut self) -> Option<Outbound> {
        self.queue.recv().await
    }
}

impl Drop for OutboundQueue {
    fn drop(&mut self) {
        self.bytes.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn frames_and_bytes_are_both_bounded_and_freed_once_written() {
        let (sender, mut queue) = channel(2, 100);
        sender.try_send(vec![0; 60]).expect("room for 60 bytes");
        assert_eq!(sender.try_send(vec![0; 60]), Err(SendError::Full), "bytes bound");
        sender.try_send(vec![0; 40]).expect("room for 40 more");
        assert_eq!(sender.try_send(vec![]), Err(SendError::Full), "frames bound");
        assert_eq!(
            sender.try_send(vec![0; 101]),
            Err(SendError::TooLarge { bytes: 101, max: 100 })
        );
        let waited = sender.send(vec![0; 10], Duration::from_millis(5)).await;
        assert_eq!(waited, Err(SendError::TimedOut));
        let first = queue.recv().await.expect("queued");
        assert_eq!(first.frame.len(), 60);
        drop(first);
        sender.send(vec![0; 60], Duration::from_millis(5)).await.expect("room again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_waiting_for_room_ends_when_the_link_ends() {
        let (sender, queue) = channel(1, 10);
        sender.try_send(vec![0; 10]).expect("room");
        let waiting = tokio::spawn({
            let sender = sender.clone();
            async move { sender.send(vec![0; 10], Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        drop(queue);
        assert_eq!(waiting.await.expect("no panic"), Err(SendError::LinkClosed));
        assert_eq!(sender.try_send(vec![0; 1]), Err(SendError::LinkClosed));
    }
}
