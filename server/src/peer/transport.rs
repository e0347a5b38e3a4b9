//! One worker's transport: dials its configured peers (redialing with backoff), accepts links
//! from any listener, routes the owner's envelopes by worker, and reports links and envelopes
//! through one bounded channel. Dropping it is the shutdown signal: every task it started ends.

use std::future::Future;
use std::sync::Arc;

use axum::serve::Listener;
use lockstep_core::wire::{Endpoint, Envelope, Lane, WorkerId, encode_frame};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::{sleep, timeout};

use super::backoff::Backoff;
use super::config::{ConfigError, PeerConfig};
use super::dial::Dial;
use super::error::SendError;
use super::event::PeerEvent;
use super::link::{self, Side};
use super::outbound::LinkSender;
use super::shared::Shared;
use super::stats::{PeerStats, PeerStatsSnapshot};

#[derive(Debug)]
pub struct Transport {
    shared: Arc<Shared>,
    /// Never sent on: dropping it (with the transport) wakes every task's receiver to end.
    shutdown: watch::Sender<()>,
}

impl Transport {
    /// Starts dialing every peer in `config.dial` on the current tokio runtime, on both lanes if
    /// `config.kv_lane`. Returns the transport and the receiver of its events
    /// (`config.events_max` of them at most waiting).
    pub fn start<D: Dial>(
        config: PeerConfig,
        dial: D,
    ) -> Result<(Transport, mpsc::Receiver<PeerEvent>), ConfigError> {
        config.check()?;
        let (events, events_rx) = mpsc::channel(config.events_max);
        let (shutdown, _) = watch::channel(());
        let transport = Transport { shared: Arc::new(Shared::new(config, events)), shutdown };
        let lanes: &[Lane] = if transport.shared.config.kv_lane {
            &[Lane::Control, Lane::Kv]
        } else {
            &[Lane::Control]
        };
        for (worker, addr) in &transport.shared.config.dial {
            for &lane in lanes {
                let (shared, dial, addr) = (transport.shared.clone(), dial.clone(), addr.clone());
                let task = dial_forever(shared, dial, *worker, lane, addr);
                spawn_until_shutdown(transport.shutdown.subscribe(), task);
            }
        }
        Ok((transport, events_rx))
    }

    /// Accepts links on `listener` until the transport is dropped; an accepted link names its
    /// peer in its `Hello`. For tokio's listener, `axum::serve::ListenerExt::tap_io` can set
    /// `TCP_NODELAY` on accepted streams, as `TcpDial` does on dialed ones.
    pub fn listen<L: Listener>(&self, listener: L) {
        let task = accept_forever(self.shared.clone(), listener, self.shutdown.subscribe());
        spawn_until_shutdown(self.shutdown.subscribe(), task);
    }

    /// Queues `envelope` on the link to `envelope.to.worker` on its lane (`Message::lane`) if
    /// there is room now.
    pub fn try_send(&self, envelope: &Envelope) -> Result<(), SendError> {
        let result = self.encode_for_link(envelope).and_then(|(link, frame)| link.try_send(frame));
        self.shared.count_send(&result);
        result
    }

    /// Queues `envelope` on the link to `envelope.to.worker`, waiting at most `send_wait_max`
    /// for room in its queue and byte budget (a large KV write waits for earlier ones to go out).
    pub async fn send(&self, envelope: &Envelope) -> Result<(), SendError> {
        let result = match self.encode_for_link(envelope) {
            Ok((link, frame)) => link.send(frame, self.shared.config.send_wait_max).await,
            Err(error) => Err(error),
        };
        self.shared.count_send(&result);
        result
    }

    /// This worker's endpoint.
    pub fn me(&self) -> Endpoint {
        self.shared.config.me
    }

    /// The peers with a control link up now, by worker id.
    pub fn live_peers(&self) -> Vec<Endpoint> {
        self.shared.table().live_peers()
    }

    pub fn stats(&self) -> PeerStatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// The link `envelope` goes on, and the envelope as a frame.
    fn encode_for_link(&self, envelope: &Envelope) -> Result<(LinkSender, Vec<u8>), SendError> {
        if envelope.from != self.shared.config.me {
            return Err(SendError::NotFromMe { from: envelope.from });
        }
        let Some(lane) = envelope.body.lane() else {
            return Err(SendError::LinkMessage);
        };
        let route = self.shared.table().route(envelope.to.worker, lane);
        let Some((live, link)) = route else {
            return Err(SendError::NoLink { worker: envelope.to.worker });
        };
        if live != envelope.to {
            return Err(SendError::OtherIncarnation { to: envelope.to, live });
        }
        let frame = encode_frame(envelope, Vec::new()).map_err(SendError::Encode)?;
        Ok((link, frame))
    }
}

/// Runs `task` until it ends or the transport is dropped, whichever comes first.
fn spawn_until_shutdown(
    mut shutdown: watch::Receiver<()>,
    task: impl Future<Output = ()> + Send + 'static,
) {
    tokio::spawn(async move {
        tokio::select! {
            _ = shutdown.changed() => {}
            () = task => {}
        }
    });
}

/// Keeps a link to `worker` on `lane` open: dials whenever none is up, backing off after each
/// failure.
async fn dial_forever<D: Dial>(
    shared: Arc<Shared>,
    dial: D,
    worker: WorkerId,
    lane: Lane,
    addr: String,
) {
    let config = &shared.config;
    let mut backoff = Backoff::new(config.backoff_min, config.backoff_max);
    loop {
        // An accepted link from the worker counts: no second link while one is up.
        shared.until_no_link(worker, lane).await;
        let opened = match timeout(config.io_timeout, dial.dial(&addr, lane)).await {
            Ok(Ok(io)) => link::run(&shared, io, Side::Dialed(worker, lane)).await,
            Ok(Err(error)) => {
                tracing::debug!(worker = worker.0, %addr, %error, "dial failed");
                PeerStats::bump(&shared.stats.dials_failed);
                false
            }
            Err(_) => {
                PeerStats::bump(&shared.stats.dials_failed);
                false
            }
        };
        if opened {
            backoff.reset();
        }
        sleep(backoff.next_wait()).await;
    }
}

/// Accepts connections and runs a link on each, at most `handshakes_max` still unidentified.
async fn accept_forever<L: Listener>(
    shared: Arc<Shared>,
    mut listener: L,
    shutdown: watch::Receiver<()>,
) {
    let handshakes = Arc::new(Semaphore::new(shared.config.handshakes_max));
    loop {
        let (io, _addr) = listener.accept().await;
        let Ok(slot) = handshakes.clone().try_acquire_owned() else {
            PeerStats::bump(&shared.stats.accepts_dropped);
            continue;
        };
        let shared = shared.clone();
        spawn_until_shutdown(shutdown.clone(), async move {
            link::run(&shared, io, Side::Accepted { _handshake_slot: slot }).await;
        });
    }
}
