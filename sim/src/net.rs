//! turmoil's TCP listener as an `axum::serve::Listener`: the one adapter between the server's
//! app and the simulated network. Everything above it is the production code.

use std::net::SocketAddr;
use std::time::Duration;

use axum::serve::Listener;

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
