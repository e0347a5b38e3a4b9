//! What one worker's transport needs to know: who it is, whom it dials, and every bound.

use std::fmt;
use std::time::Duration;

use lockstep_core::wire::{Endpoint, FRAME_BYTES_MAX, LinkIdentity, Role, WorkerId};

use super::framed::LENGTH_PREFIX_BYTES;
use super::handshake::HELLO_FRAME_BYTES_MAX as FRAME_BYTES_MIN;

#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// This worker and its incarnation, the `from` of every envelope it sends.
    pub me: Endpoint,
    /// What `Hello` says about this worker; `wire::check_link` decides against the peer's.
    pub identity: LinkIdentity,
    /// Requests this worker takes at once, which its `Hello` tells a router (`Message::Hello`'s
    /// `places`). `u32::MAX` by default: no bound of its own, the router's config decides.
    pub places: u32,
    /// The peers this worker dials, with their addresses (`"ip:port"`, or a host name the
    /// network resolves). A pair of workers is best dialed from one side only; when both dial,
    /// both ends keep the link dialed by the lower worker id (`table::verdict`).
    pub dial: Vec<(WorkerId, String)>,
    /// Whether a KV lane is dialed beside each control link (`wire::Lane`): a second connection
    /// to the same address for KV writes and their acknowledgements. A prefill worker's is on
    /// (it dials the decode workers it writes to); nobody else dials one.
    pub kv_lane: bool,
    /// A link whose `Hello` does not arrive within this is dropped.
    pub hello_timeout: Duration,
    /// A `Ping` leaves this often on every open link.
    pub ping_interval: Duration,
    /// A link that receives no byte for this long is dead. Above `ping_interval`, so that a
    /// live peer's pings keep it open; with loss or delay, a few intervals.
    pub dead_after: Duration,
    /// Bounds a dial, each write, and the arrival of a frame once its first byte came.
    pub io_timeout: Duration,
    /// The first wait before a redial; it doubles after each failure up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Frames waiting to be written on one link.
    pub send_queue_max: usize,
    /// Bytes waiting to be written on one link (the queued frames together).
    pub send_bytes_max: usize,
    /// How long `Transport::send` waits for room before it gives up.
    pub send_wait_max: Duration,
    /// Capacity of the event channel to the owner.
    pub events_max: usize,
    /// How long an event waits for room in that channel; after that it is dropped and counted
    /// (the protocol above has timeouts, and learns restarts from incarnations).
    pub event_wait_max: Duration,
    /// The largest frame read, length prefix included.
    pub frame_bytes_max: usize,
    /// Distinct workers the transport keeps track of.
    pub peers_max: usize,
    /// Accepted connections still in their handshake; more are closed at once.
    pub handshakes_max: usize,
}

impl PeerConfig {
    /// Bounds suited to a data-center network: a dead peer is noticed within two seconds.
    pub fn new(me: Endpoint, identity: LinkIdentity, dial: Vec<(WorkerId, String)>) -> PeerConfig {
        let frame_bytes_max = FRAME_BYTES_MAX + LENGTH_PREFIX_BYTES;
        PeerConfig {
            me,
            kv_lane: identity.role == Role::Prefill,
            identity,
            places: u32::MAX,
            dial,
            hello_timeout: Duration::from_secs(2),
            ping_interval: Duration::from_millis(500),
            dead_after: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            send_queue_max: 1024,
            // Two of the largest frames, so one can be written while the next is queued.
            send_bytes_max: 2 * frame_bytes_max,
            send_wait_max: Duration::from_secs(1),
            events_max: 4096,
            event_wait_max: Duration::from_secs(1),
            frame_bytes_max,
            peers_max: 256,
            handshakes_max: 64,
        }
    }

    /// Refuses bounds that cannot work together.
    pub fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            ("hello_timeout", self.hello_timeout),
            ("ping_interval", self.ping_interval),
            ("io_timeout", self.io_timeout),
            ("backoff_min", self.backoff_min),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, d)| d.is_zero()) {
            return Err(ConfigError(format!("{name} must be above zero")));
        }
        if self.dead_after <= self.ping_interval {
            return Err(ConfigError("dead_after must exceed ping_interval".into()));
        }
        if self.backoff_max < self.backoff_min {
            return Err(ConfigError("backoff_max must be at least backoff_min".into()));
        }
        let counts = [
            ("send_queue_max", self.send_queue_max),
            ("send_bytes_max", self.send_bytes_max),
            ("events_max", self.events_max),
            ("peers_max", self.peers_max),
            ("handshakes_max", self.handshakes_max),
        ];
        if let Some((name, _)) = counts.iter().find(|(_, n)| *n == 0) {
            return Err(ConfigError(format!("{name} must be above zero")));
        }
        let frame_max = FRAME_BYTES_MAX + LENGTH_PREFIX_BYTES;
        if self.frame_bytes_max < FRAME_BYTES_MIN || self.frame_bytes_max > frame_max {
            return Err(ConfigError(format!(
                "frame_bytes_max must be within {FRAME_BYTES_MIN}..={frame_max}"
            )));
        }
        self.check_dial()
    }

    fn check_dial(&self) -> Result<(), ConfigError> {
        let mut workers: Vec<WorkerId> = self.dial.iter().map(|(w, _)| *w).collect();
        if workers.contains(&self.me.worker) {
            return Err(ConfigError("a worker does not dial itself".into()));
        }
        workers.sort();
        if workers.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err(ConfigError("a worker is listed twice in dial".into()));
        }
        if workers.len() > self.peers_max {
            return Err(ConfigError("more peers to dial than peers_max".into()));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer config: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use lockstep_core::wire::{Incarnation, KvLayout, Role};

    use super::*;

    fn config() -> PeerConfig {
        let me = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
        let kv_layout = KvLayout { layers: 1, kv_heads: 1, head_dim: 8, element_bytes: 2 };
        let identity = LinkIdentity { role: Role::Prefill, page_tokens: 16, kv_layout, model: 7 };
        PeerConfig::new(me, identity, vec![(WorkerId(2), "10.0.0.2:7000".into())])
    }

    #[test]
    fn the_defaults_pass_and_each_broken_bound_is_refused() {
        assert_eq!(config().check(), Ok(()));
        let broken: [fn(&mut PeerConfig); 7] = [
            |c| c.dead_after = c.ping_interval,
            |c| c.backoff_max = c.backoff_min / 2,
            |c| c.hello_timeout = Duration::ZERO,
            |c| c.send_queue_max = 0,
            |c| c.frame_bytes_max = FRAME_BYTES_MAX + LENGTH_PREFIX_BYTES + 1,
            |c| c.dial.push((WorkerId(1), "self".into())),
            |c| c.dial.push((WorkerId(2), "again".into())),
        ];
        for (i, breaks) in broken.iter().enumerate() {
            let mut config = config();
            breaks(&mut config);
            assert!(config.check().is_err(), "case {i} passed");
        }
    }
}
