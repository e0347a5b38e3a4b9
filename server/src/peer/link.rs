//! One link's life: the handshake, a place in the table, then reading and writing until the
//! peer goes silent for `dead_after`, the stream fails, or a newer link takes its place; then
//! out of the table and reported down.
//!
//! While open, a `Ping` leaves every `ping_interval` and each `Ping` received is answered by a
//! `Pong`. Any frame received proves the peer alive; a large frame counts from its first byte,
//! so pings queued behind a long KV write cannot make a busy link look dead (the frame itself
//! is bounded by `io_timeout`).

use lockstep_core::wire::{Endpoint, Lane, Message, WorkerId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::{Instant, MissedTickBehavior, interval_at};

use super::error::LinkError;
use super::framed::{FrameReader, write_frame};
use super::handshake::{self, HELLO_FRAME_BYTES_MAX, write_link_message};
use super::outbound::OutboundQueue;
use super::shared::{Opened, Shared};
use super::stats::PeerStats;
use super::table::LinkId;

/// How the stream came to be.
#[derive(Debug)]
pub(crate) enum Side {
    /// We dialed this worker, for this lane.
    Dialed(WorkerId, Lane),
    /// The listener accepted it. The permit is its handshake slot, held until the handshake ends.
    Accepted { _handshake_slot: OwnedSemaphorePermit },
}

/// Runs a link on `io` to its end. Whether it opened (a dialer then starts its backoff over).
pub(crate) async fn run<Io>(shared: &Shared, io: Io, side: Side) -> bool
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (read_half, mut writer) = tokio::io::split(io);
    let mut reader = FrameReader::new(read_half, HELLO_FRAME_BYTES_MAX);
    let handshake = match &side {
        Side::Dialed(worker, lane) => {
            handshake::dialer(shared, &mut reader, &mut writer, *worker, *lane)
                .await
                .map(|(peer, places)| (peer, *lane, shared.config.me.worker, places))
        }
        Side::Accepted { .. } => handshake::acceptor(shared, &mut reader, &mut writer)
            .await
            .map(|(peer, lane, places)| (peer, lane, peer.worker, places)),
    };
    drop(side);
    reader.set_frame_bytes_max(shared.config.frame_bytes_max);
    let opened = match handshake {
        Ok((peer, lane, dialer, places)) => shared.open(peer, lane, dialer, places).await,
        Err(error) => Err(error),
    };
    let opened = match opened {
        Ok(opened) => opened,
        Err(error) => {
            tracing::debug!(%error, "peer link not opened");
            shared.count_refusal(&error);
            return false;
        }
    };
    let (id, peer, lane) = (opened.id, opened.peer, opened.lane);
    if let Some(reason) = run_open(shared, &mut reader, &mut writer, peer, opened).await {
        shared.close(peer, lane, id, reason).await;
    }
    true
}

/// Reads and writes until the link fails (the reason) or leaves the table (`None`: whoever
/// removed it reported it).
async fn run_open<R, W>(
    shared: &Shared,
    reader: &mut FrameReader<R>,
    writer: &mut W,
    peer: Endpoint,
    opened: Opened,
) -> Option<LinkError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Opened { id, lane, queue, removed, .. } = opened;
    // One pong waiting is enough: any frame proves us alive to the peer.
    let (pongs_tx, pongs_rx) = mpsc::channel(1);
    tokio::select! {
        error = read(shared, reader, id, peer, lane, pongs_tx) => Some(error),
        error = write(shared, writer, peer, queue, pongs_rx) => error,
        _ = removed => None,
    }
}

/// Reads frames: link messages are handled here, the protocol's go to the owner if they belong
/// on this link's lane.
async fn read<R: AsyncRead + Unpin>(
    shared: &Shared,
    reader: &mut FrameReader<R>,
    id: LinkId,
    peer: Endpoint,
    lane: Lane,
    pongs: mpsc::Sender<u64>,
) -> LinkError {
    let config = &shared.config;
    loop {
        let (envelope, bytes) = match reader.read(config.dead_after, config.io_timeout).await {
            Ok(frame) => frame,
            Err(error) => return error,
        };
        PeerStats::bump(&shared.stats.frames_received);
        PeerStats::add(&shared.stats.bytes_received, bytes);
        match envelope.body {
            Message::Ping { nonce } => {
                let _ = pongs.try_send(nonce);
            }
            Message::Pong { .. } => {}
            Message::Hello { .. } | Message::LinkRefused { .. } => {
                return LinkError::Protocol("a handshake message on an open link");
            }
            body if body.lane() != Some(lane) => {
                return LinkError::Protocol("a message on the other lane's link");
            }
            _ => shared.deliver(id, peer, lane, envelope).await,
        }
    }
}

/// Writes pongs first, then pings when due, then the owner's frames in order. `None` when the
/// queue's senders are gone (the link left the table).
async fn write<W: AsyncWrite + Unpin>(
    shared: &Shared,
    writer: &mut W,
    peer: Endpoint,
    mut queue: OutboundQueue,
    mut pongs: mpsc::Receiver<u64>,
) -> Option<LinkError> {
    let config = &shared.config;
    let mut pings = interval_at(Instant::now() + config.ping_interval, config.ping_interval);
    pings.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut nonce = 0u64;
    loop {
        let written = tokio::select! {
            biased;
            Some(nonce) = pongs.recv() => {
                write_link_message(shared, writer, peer, Message::Pong { nonce }).await
            }
            _ = pings.tick() => {
                nonce += 1;
                write_link_message(shared, writer, peer, Message::Ping { nonce }).await
            }
            outbound = queue.recv() => {
                let outbound = outbound?;
                let written = write_frame(writer, &outbound.frame, config.io_timeout).await;
                if written.is_ok() {
                    PeerStats::bump(&shared.stats.frames_sent);
                    PeerStats::add(&shared.stats.bytes_sent, outbound.frame.len());
                }
                written
            }
        };
        if let Err(error) = written {
            return Some(error);
        }
    }
}
