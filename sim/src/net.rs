//! turmoil's TCP as the server's network: its listener as an `axum::serve::Listener` (the HTTP
//! app and the peer transport accept through it) and its connect as a `peer::Dial`. These are
//! the only adapters between the server and the simulated network; everything above them is the
//! production code.

use std::net::SocketAddr;
use std::time::Duration;

use axum::serve::Listener;
use lockstep_server::peer::Dial;

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
/// name given to `Sim::host`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TurmoilDial;

impl Dial for TurmoilDial {
    type Io = turmoil::net::TcpStream;

    async fn dial(&self, addr: &str) -> std::io::Result<Self::Io> {
        turmoil::net::TcpStream::connect(addr).await
    }
}
