//! Opening a link: the dialer says `Hello` first and the acceptor answers with its own, so each
//! end learns the other's incarnation and checks its identity (`wire::check_link`, symmetric:
//! both ends reach the same verdict). A mismatch is answered with `LinkRefused` and the link
//! closes; a `Hello` must arrive within `hello_timeout`. The dialer's `Hello` names the lane the
//! connection is for (`wire::Lane`); the acceptor checks the pair of roles may open it
//! (`wire::check_lane`) and repeats it.
//!
//! The dialer's `Hello` goes to `Endpoint { worker: <the worker it dialed>, incarnation: 0 }`:
//! it knows whom it dialed but not which life answers, and incarnation 0 says "not yet known"
//! (the acceptor ignores the `to` of a `Hello`). The acceptor's `Hello` names the dialer exactly.
//! The acceptor answers only after its own table accepts the peer, so a stale incarnation never
//! sees the link open.
//!
//! Until the peer is known, frames are bounded by `HELLO_FRAME_BYTES_MAX`: a stranger's length
//! prefix must not make us allocate a full frame's buffer, per connection we are still vetting.

use lockstep_core::wire::{
    Endpoint, Envelope, Incarnation, Lane, LinkIdentity, LinkMismatch, Message, WorkerId,
    check_lane, check_link, encode_frame,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::timeout;

use super::error::LinkError;
use super::framed::{FrameReader, write_frame};
use super::shared::Shared;
use super::stats::PeerStats;

/// The largest frame read before the handshake ends: a `Hello` or `LinkRefused` with the widest
/// varints is under 100 bytes.
pub(crate) const HELLO_FRAME_BYTES_MAX: usize = 256;

/// The dialer's half: `Hello` to `expected` for `lane`, then its answer. The peer's endpoint and
/// the places its `Hello` said on success.
pub(crate) async fn dialer<R, W>(
    shared: &Shared,
    reader: &mut FrameReader<R>,
    writer: &mut W,
    expected: WorkerId,
    lane: Lane,
) -> Result<(Endpoint, u32), LinkError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let unknown = Endpoint { worker: expected, incarnation: Incarnation(0) };
    let hello =
        Message::Hello { identity: shared.config.identity, lane, places: shared.config.places };
    write_link_message(shared, writer, unknown, hello).await?;
    let answer = receive(shared, reader).await?;
    match answer.body {
        Message::LinkRefused { mismatch } => Err(LinkError::Refused(mismatch)),
        Message::Hello { .. } if answer.from.worker != expected => {
            Err(LinkError::WrongPeer { expected, got: answer.from.worker })
        }
        Message::Hello { lane: answered, .. } if answered != lane => {
            Err(LinkError::Protocol("the answer named another lane"))
        }
        Message::Hello { identity, places, .. } => {
            match check(&shared.config.identity, &identity, lane) {
                Ok(()) => Ok((answer.from, places)),
                Err(mismatch) => {
                    refuse(shared, writer, answer.from, mismatch).await;
                    Err(LinkError::Refused(mismatch))
                }
            }
        }
        _ => Err(LinkError::Protocol("expected Hello or LinkRefused")),
    }
}

/// The acceptor's half: the dialer's `Hello`, checked against our identity and our table,
/// then our `Hello`. The peer's endpoint, the link's lane and the places the peer's `Hello` said
/// on success.
pub(crate) async fn acceptor<R, W>(
    shared: &Shared,
    reader: &mut FrameReader<R>,
    writer: &mut W,
) -> Result<(Endpoint, Lane, u32), LinkError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello = receive(shared, reader).await?;
    let Message::Hello { identity, lane, places } = hello.body else {
        return Err(LinkError::Protocol("expected Hello"));
    };
    let peer = hello.from;
    if let Err(mismatch) = check(&shared.config.identity, &identity, lane) {
        refuse(shared, writer, peer, mismatch).await;
        return Err(LinkError::Refused(mismatch));
    }
    // The dialer of an accepted link is the peer.
    shared.admits(peer, lane, peer.worker)?;
    let answer =
        Message::Hello { identity: shared.config.identity, lane, places: shared.config.places };
    write_link_message(shared, writer, peer, answer).await?;
    Ok((peer, lane, places))
}

/// Both checks on a peer's identity: the link at all, then this lane of it.
fn check(mine: &LinkIdentity, theirs: &LinkIdentity, lane: Lane) -> Result<(), LinkMismatch> {
    check_link(mine, theirs)?;
    check_lane(mine.role, theirs.role, lane)
}

/// The first frame of the other end, within `hello_timeout`.
async fn receive<R: AsyncRead + Unpin>(
    shared: &Shared,
    reader: &mut FrameReader<R>,
) -> Result<Envelope, LinkError> {
    let config = &shared.config;
    let read = reader.read(config.hello_timeout, config.io_timeout);
    let (envelope, bytes) = match timeout(config.hello_timeout, read).await {
        Err(_) | Ok(Err(LinkError::Silent)) => return Err(LinkError::HelloTimeout),
        Ok(result) => result?,
    };
    PeerStats::bump(&shared.stats.frames_received);
    PeerStats::add(&shared.stats.bytes_received, bytes);
    Ok(envelope)
}

/// Tells the peer why, as well as the link still allows; the link closes either way.
async fn refuse<W: AsyncWrite + Unpin>(
    shared: &Shared,
    writer: &mut W,
    to: Endpoint,
    mismatch: LinkMismatch,
) {
    let _ = write_link_message(shared, writer, to, Message::LinkRefused { mismatch }).await;
}

/// Writes one of the link's own messages from this worker to `to`.
pub(crate) async fn write_link_message<W: AsyncWrite + Unpin>(
    shared: &Shared,
    writer: &mut W,
    to: Endpoint,
    body: Message,
) -> Result<(), LinkError> {
    let envelope = Envelope { from: shared.config.me, to, body };
    let frame = encode_frame(&envelope, Vec::new()).map_err(LinkError::BadFrame)?;
    write_frame(writer, &frame, shared.config.io_timeout).await?;
    PeerStats::bump(&shared.stats.frames_sent);
    PeerStats::add(&shared.stats.bytes_sent, frame.len());
    Ok(())
}
