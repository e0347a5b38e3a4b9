//! The peer transport: links between workers carrying `lockstep_core::wire` envelopes as
//! length-prefixed frames over any byte stream (DESIGN.md section 4).
//!
//! - `dial`: the dialing half of the network (`Dial`, `TcpDial`); the accepting half is any
//!   `axum::serve::Listener`, as for the HTTP app. turmoil plugs in both (`lockstep_sim::net`).
//! - `framed`: frames on a stream, into a bounded buffer, each read and write under a timeout.
//! - `handshake`: `Hello` both ways, checked with `wire::check_link`; `LinkRefused` on mismatch.
//! - `link`: one link's life: pings, the dead bound, the writer's priorities.
//! - `table`: the live link per worker, and which of two links to one worker wins.
//! - `outbound`: a link's send queue, bounded in frames and in bytes.
//! - `transport`: `Transport`, owned by one worker: dials with backoff, accepts, routes, and
//!   reports `PeerEvent`s through one bounded channel.
//!
//! Bounds: a silent peer (crashed, hung, partitioned) is reported down within `dead_after` of
//! the last byte heard, plus at most `event_wait_max` for room in the event channel. Every wait
//! has a bound; every queue has a maximum; bad bytes from a peer end its link with a reason and
//! a count, never a panic. Time is tokio's, so the same code runs under turmoil unchanged.

mod backoff;
mod config;
mod dial;
mod error;
mod event;
pub mod framed;
mod handshake;
mod link;
mod outbound;
mod shared;
mod stats;
mod table;
mod transport;

pub use config::{ConfigError, PeerConfig};
pub use dial::{Dial, TcpDial};
pub use error::{LinkError, SendError};
pub use event::PeerEvent;
pub use stats::PeerStatsSnapshot;
pub use transport::Transport;
