//! What the engine shares with the HTTP side without a channel: a few atomics, written by the
//! engine loop only, read by `/health` and the submit path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
pub struct EngineStats {
    /// The engine's clock starts here (tokio's clock: virtual under turmoil).
    epoch: Instant,
    /// When the loop last made progress: a step completed, or it had nothing to do.
    progress_ns: AtomicU64,
    requests_held: AtomicU64,
    /// KV pages referenced or pinned (not the free or evictable cached ones).
    pages_held: AtomicU64,
    /// Transfers a prefill or decode worker's protocol side holds, and their pins (zero
    /// elsewhere).
    transfers_held: AtomicU64,
    pins_held: AtomicU64,
    /// Transfers the router started again after an attempt failed (zero elsewhere).
    transfers_retried: AtomicU64,
    draining: AtomicBool,
    stopped: AtomicBool,
}

impl EngineStats {
    pub(crate) fn new(epoch: Instant) -> EngineStats {
        EngineStats {
            epoch,
            progress_ns: AtomicU64::new(0),
            requests_held: AtomicU64::new(0),
            pages_held: AtomicU64::new(0),
            transfers_held: AtomicU64::new(0),
            pins_held: AtomicU64::new(0),
            transfers_retried: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Nanoseconds since the epoch, now.
    pub fn now_ns(&self) -> u64 {
        u64::try_from(Instant::now().saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
    }

    pub(crate) fn record_progress(&self, requests_held: usize) {
        self.progress_ns.store(self.now_ns(), Ordering::Relaxed);
        self.requests_held.store(requests_held as u64, Ordering::Relaxed);
    }

    pub(crate) fn set_requests_held(&self, requests_held: usize) {
        if requests_held == 0 {
            // Nothing to do is progress: an idle engine is healthy however long it idles.
            self.record_progress(0);
        } else {
            self.requests_held.store(requests_held as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn set_pages_held(&self, pages: u32) {
        self.pages_held.store(u64::from(pages), Ordering::Relaxed);
    }

    pub(crate) fn set_transfers_held(&self, transfers: usize, pins: usize) {
        self.transfers_held.store(transfers as u64, Ordering::Relaxed);
        self.pins_held.store(pins as u64, Ordering::Relaxed);
    }

    /// Transfers held, as of the engine's last turn: zero at quiescence, or a leak.
    pub fn transfers_held(&self) -> u64 {
        self.transfers_held.load(Ordering::Relaxed)
    }

    /// Pool pins transfers hold, as of the engine's last turn: zero at quiescence, or a leak.
    pub fn pins_held(&self) -> u64 {
        self.pins_held.load(Ordering::Relaxed)
    }

    pub(crate) fn record_transfer_retry(&self) {
        self.transfers_retried.fetch_add(1, Ordering::Relaxed);
    }

    /// Transfers the router started again after an attempt failed, since it started: none
    /// without a fault.
    pub fn transfers_retried(&self) -> u64 {
        self.transfers_retried.load(Ordering::Relaxed)
    }

    /// KV pages held by requests, as of the engine's last turn: zero at quiescence, or a leak.
    pub fn pages_held(&self) -> u64 {
        self.pages_held.load(Ordering::Relaxed)
    }

    pub fn requests_held(&self) -> u64 {
        self.requests_held.load(Ordering::Relaxed)
    }

    /// How long the engine has held work without completing a step; zero when idle.
    pub fn stalled_for(&self) -> Duration {
        if self.requests_held() == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.now_ns().saturating_sub(self.progress_ns.load(Ordering::Relaxed)))
    }

    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub(crate) fn set_stopped(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }
}
