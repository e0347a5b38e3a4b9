//! The dialing half of the network, as `axum::serve::Listener` is the accepting half: the
//! transport dials through this trait, so the same code runs on tokio's TCP and on turmoil's
//! (`lockstep_sim::net::TurmoilDial`).

use std::future::Future;
use std::io;

use lockstep_core::wire::Lane;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

pub trait Dial: Clone + Send + Sync + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Opens a stream to `addr` for a link on `lane` (a network may treat the lanes apart, as
    /// the simulator does when it slows the KV lanes alone). The transport bounds the wait with
    /// `io_timeout`.
    fn dial(&self, addr: &str, lane: Lane) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

/// tokio's TCP. An address that is not `ip:port` goes through tokio's resolver, which runs on a
/// blocking thread: deployments give addresses, the simulator never comes here.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpDial;

impl Dial for TcpDial {
    type Io = TcpStream;

    async fn dial(&self, addr: &str, _lane: Lane) -> io::Result<TcpStream> {
        let stream = TcpStream::connect(addr).await?;
        // Pings, pongs and protocol messages are small and latency-bound: no Nagle delay.
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}
