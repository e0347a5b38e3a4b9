//! Why a link ended or never opened, and why a send was refused. Both are ordinary outcomes on
//! a network (peers crash, partitions happen, queues fill): values to count and log, never panics.

use std::fmt;
use std::io;

use lockstep_core::wire::{Endpoint, LinkMismatch, WireError, WorkerId};

/// Why a link ended (the reason of `PeerEvent::Down`) or why it never opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkError {
    /// Nothing arrived for `dead_after`: the peer crashed or hangs, or the network partitioned.
    Silent,
    /// The peer closed the stream.
    Closed,
    /// A frame began but did not arrive whole within `io_timeout`.
    SlowFrame,
    /// A write did not finish within `io_timeout`: the peer does not read.
    WriteTimeout,
    /// The stream failed.
    Io(io::ErrorKind),
    /// Bytes that are not a frame we accept: nothing after them on the stream can be trusted.
    BadFrame(WireError),
    /// A frame longer than `frame_bytes_max`.
    FrameTooLong { len: usize, max: usize },
    /// A frame the link does not allow at this point (a second `Hello`, data before `Hello`).
    Protocol(&'static str),
    /// No `Hello` within `hello_timeout`.
    HelloTimeout,
    /// The identities do not match (`wire::check_link`); we sent or received `LinkRefused`.
    Refused(LinkMismatch),
    /// The address we dialed answered as another worker.
    WrongPeer { expected: WorkerId, got: WorkerId },
    /// An older incarnation than one already heard from that worker.
    Stale { newest: Endpoint },
    /// A link to the same incarnation already exists and wins the tie (see `table::verdict`).
    Duplicate,
    /// The table already knows `peers_max` workers.
    TooManyPeers,
    /// Another link to the same worker took this one's place: a newer incarnation, or a redial
    /// of a link this end had not yet seen die.
    Superseded { by: Endpoint },
}

impl From<io::Error> for LinkError {
    fn from(e: io::Error) -> LinkError {
        LinkError::Io(e.kind())
    }
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::Silent => write!(f, "nothing heard within the dead bound"),
            LinkError::Closed => write!(f, "closed by the peer"),
            LinkError::SlowFrame => write!(f, "a frame did not arrive whole in time"),
            LinkError::WriteTimeout => write!(f, "a write did not finish in time"),
            LinkError::Io(kind) => write!(f, "io: {kind}"),
            LinkError::BadFrame(e) => write!(f, "bad frame: {e}"),
            LinkError::FrameTooLong { len, max } => write!(f, "frame of {len} bytes over {max}"),
            LinkError::Protocol(what) => write!(f, "protocol: {what}"),
            LinkError::HelloTimeout => write!(f, "no hello in time"),
            LinkError::Refused(mismatch) => write!(f, "refused: {mismatch:?} mismatch"),
            LinkError::WrongPeer { expected, got } => {
                write!(f, "dialed worker {} but worker {} answered", expected.0, got.0)
            }
            LinkError::Stale { newest } => {
                write!(f, "stale incarnation (newest heard: {})", newest.incarnation.0)
            }
            LinkError::Duplicate => write!(f, "a link to that incarnation already exists"),
            LinkError::TooManyPeers => write!(f, "too many peers"),
            LinkError::Superseded { by } => {
                write!(
                    f,
                    "superseded by incarnation {} of worker {}",
                    by.incarnation.0, by.worker.0
                )
            }
        }
    }
}

impl std::error::Error for LinkError {}

/// Why `Transport::send` or `try_send` refused an envelope. Nothing was sent; the protocol above
/// has timeouts and retries, so the caller counts it and goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendError {
    /// No link to that worker is up.
    NoLink { worker: WorkerId },
    /// The envelope names another incarnation than the one linked: it would be dropped there.
    OtherIncarnation { to: Endpoint, live: Endpoint },
    /// The link closed while the send waited for room.
    LinkClosed,
    /// The envelope's `from` is not this transport's endpoint.
    NotFromMe { from: Endpoint },
    /// `Hello`, `LinkRefused`, `Ping` and `Pong` belong to the link itself.
    LinkMessage,
    /// The envelope breaks a wire bound.
    Encode(WireError),
    /// The frame is larger than the link's whole in-flight budget (`send_bytes_max`).
    TooLarge { bytes: usize, max: usize },
    /// `send_queue_max` frames or `send_bytes_max` bytes are in flight (`try_send`).
    Full,
    /// No room came within `send_wait_max` (`send`).
    TimedOut,
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::NoLink { worker } => write!(f, "no link to worker {}", worker.0),
            SendError::OtherIncarnation { to, live } => write!(
                f,
                "addressed to incarnation {} of worker {}, linked to {}",
                to.incarnation.0, to.worker.0, live.incarnation.0
            ),
            SendError::LinkClosed => write!(f, "the link closed"),
            SendError::NotFromMe { from } => {
                write!(f, "from worker {}, not this one", from.worker.0)
            }
            SendError::LinkMessage => write!(f, "link messages are the transport's own"),
            SendError::Encode(e) => write!(f, "encode: {e}"),
            SendError::TooLarge { bytes, max } => {
                write!(f, "frame of {bytes} bytes over the link's budget of {max}")
            }
            SendError::Full => write!(f, "the link's send queue is full"),
            SendError::TimedOut => write!(f, "no room on the link in time"),
        }
    }
}

impl std::error::Error for SendError {}
