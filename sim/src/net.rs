//! turmoil's TCP as the server's network: its listener as an `axum::serve::Listener` (the HTTP
//! app and the peer transport accept through it) and its connect as a `peer::Dial`. These are
//! the only adapters between the server and the simulated network; everything above them is the
//! production code.

use std::net::SocketAddr;
use std::time::Duration;

use axum::serve::Listener;
use lockstep_core::wire::Lane;
use lockstep_server::peer::Dial;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::slow_lane::{KvLaneDelay, SlowLane};

pub struct TurmoilListener(pub turmoil::net::TcpListener);

impl std::fmt::Debug for TurmoilListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TurmoilListener").field(&self.0.local_addr().ok()).finish()
    }
}

impl TurmoilListener {
    pub async fn bind(addr: (std::net::IpAddr, u16)) -> std::io::Result<TurmoilListener> {
        turmoil::net::TcpListener::bind(addr).await.map(TurmoilListener)
    }
}

impl Listener for TurmoilListener {
    type Io = turmoil::net::TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok(connection) => return connection,
                // As axum does for tokio's listener: wait a moment and go on accepting.
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// turmoil's connect as the peer transport's dialer. Addresses are `"host:port"`, the host a
/// name given to `Sim::host`. A prefill worker's dialer slows its KV lanes by the run's current
/// `KvLaneDelay` (the slow-KV-lane fault, `slow_lane`); every other stream is turmoil's as is.
#[derive(Clone, Debug, Default)]
pub struct TurmoilDial {
    kv_lanes: Option<KvLaneDelay>,
}

impl TurmoilDial {
    pub fn slowing_kv_lanes(delay: KvLaneDelay) -> TurmoilDial {
        TurmoilDial { kv_lanes: Some(delay) }
    }
}

/// A dialed stream: turmoil's, or a KV lane the fault can slow.
pub trait DialedStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<S: AsyncRead + AsyncWrite + Send + Unpin + 'static> DialedStream for S {}

impl Dial for TurmoilDial {
    type Io = Box<dyn DialedStream>;

    async fn dial(&self, addr: &str, lane: Lane) -> std::io::Result<Self::Io> {
        let stream = turmoil::net::TcpStream::connect(addr).await?;
        Ok(match (&self.kv_lanes, lane) {
            (Some(delay), Lane::Kv) => Box::new(SlowLane::new(stream, delay.clone())),
            _ => Box::new(stream),
        })
    }
}
