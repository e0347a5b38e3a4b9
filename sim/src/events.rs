//! The run's event log: what clients saw and what faults did, at virtual times. Its hash is the
//! determinism oracle's evidence (one seed, one log); the Perfetto timeline is drawn from it.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Sent {
        request: usize,
    },
    FirstToken {
        request: usize,
    },
    Ended {
        request: usize,
        how: String,
        tokens: usize,
    },
    Fault(String),
    /// A host's software (re)started.
    Started {
        host: String,
    },
    /// A step a worker's device ran: when it started (it ended at the entry's time), the
    /// requests in it (on a worker, a request's id is its transfer's), prompt tokens computed and
    /// decode rows.
    Step {
        host: String,
        step: u64,
        started: Duration,
        requests: Vec<u64>,
        prompt_tokens: u32,
        decode_rows: u32,
    },
    /// What the router's engine said of a request (`routed`, `decoding`, `finished`, `failed`):
    /// its id there, and for `decoding` its transfer and decode worker.
    Router {
        what: String,
        request: u64,
        transfer: Option<u64>,
        decode: Option<u64>,
    },
    /// A KV write of `transfer` on a decode worker: it arrived (and was acknowledged), or it
    /// landed in the KV buffer (the worker's own debug events; the two coincide unless a write
    /// is acknowledged before it lands).
    KvWrite {
        transfer: u64,
        landed: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    pub at: Duration,
    pub event: Event,
}

impl fmt::Display for Logged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>10.3}ms {:?}", self.at.as_secs_f64() * 1e3, self.event)
    }
}

#[derive(Clone, Debug, Default)]
pub struct EventLog(Arc<Mutex<Vec<Logged>>>);

impl EventLog {
    /// Logs `event` at the simulation's time now.
    pub fn log(&self, event: Event) {
        let at = turmoil::sim_elapsed().unwrap_or_default();
        self.log_at(at, event);
    }

    pub fn log_at(&self, at: Duration, event: Event) {
        self.0.lock().expect("hosts run one at a time").push(Logged { at, event });
    }

    pub fn entries(&self) -> Vec<Logged> {
        self.0.lock().expect("hosts run one at a time").clone()
    }

    /// FNV-1a over every entry as written: stable across builds and platforms.
    pub fn hash(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325_u64;
        for entry in self.0.lock().expect("hosts run one at a time").iter() {
            for b in entry.to_string().bytes().chain(std::iter::once(b'\n')) {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }
}
