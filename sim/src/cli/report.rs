//! What a run's report says: seed and knobs first, then the summary, then each violation with the
//! command that reproduces it; as text or as JSON.

use lockstep_sim::client::Ending;
use lockstep_sim::oracle::Violation;
use lockstep_sim::run::RunOutcome;
use serde_json::{Value, json};

/// Counts of how requests ended.
#[derive(Clone, Copy, Debug, Default)]
pub struct Endings {
    pub completed: usize,
    pub refused: usize,
    pub failed: usize,
    pub cancelled: usize,
    /// Heard nothing for the read timeout: their server crashed.
    pub silent: usize,
    pub timed_out: usize,
    pub unfinished: usize,
}

impl Endings {
    pub fn of(outcome: &RunOutcome) -> Endings {
        let mut e = Endings::default();
        for observed in &outcome.observed {
            match observed.ending {
                Some(Ending::Completed { .. }) => e.completed += 1,
                Some(Ending::Refused { .. }) => e.refused += 1,
                Some(Ending::Failed { .. }) => e.failed += 1,
                Some(Ending::Cancelled) => e.cancelled += 1,
                Some(Ending::Silent) => e.silent += 1,
                Some(Ending::TimedOut) => e.timed_out += 1,
                None => e.unfinished += 1,
            }
        }
        e
    }

    /// Ended without a whole answer, each for a reason the client was told.
    pub fn failed_cleanly(&self) -> usize {
        self.refused + self.failed + self.cancelled
    }
}

/// The header: what the seed decided.
pub fn header(outcome: &RunOutcome) -> String {
    let mut text = format!(
        "seed {}  topology {}\nknobs: {}\nfaults: {}\n",
        outcome.seed, outcome.topology, outcome.knobs, outcome.mix
    );
    if !outcome.faults.is_empty() {
        let listed: Vec<String> = outcome
            .faults
            .iter()
            .map(|f| format!("{:.3}s {}", f.at.as_secs_f64(), f.action))
            .collect();
        text.push_str(&format!("scheduled: {}\n", listed.join(", ")));
    }
    text
}

pub fn summary(outcome: &RunOutcome, violations: &[Violation]) -> String {
    let e = Endings::of(outcome);
    let virtual_s = outcome.virtual_time.as_secs_f64();
    let wall_s = outcome.wall_time.as_secs_f64();
    format!(
        "requests {}  completed {}  failed cleanly {} (refused {}, failed {}, cancelled {})  \
         silent {}  timed out {}  unfinished {}  transfers retried {}\nviolations {}\nvirtual {:.3} s  wall {:.3} s  speed {:.1}x  \
         turmoil steps {}  event log {:016x}",
        outcome.observed.len(),
        e.completed,
        e.failed_cleanly(),
        e.refused,
        e.failed,
        e.cancelled,
        e.silent,
        e.timed_out,
        e.unfinished,
        outcome.router_retries,
        violations.len(),
        virtual_s,
        wall_s,
        virtual_s / wall_s.max(1e-9),
        outcome.steps,
        outcome.log_hash,
    )
}

pub fn json(outcome: &RunOutcome, violations: &[Violation], reproduce: &str) -> Value {
    let e = Endings::of(outcome);
    json!({
        "seed": outcome.seed,
        "topology": outcome.topology.to_string(),
        "knobs": outcome.knobs.to_string(),
        "faults": outcome.mix.to_string(),
        "scheduled": outcome.faults.iter().map(|f| json!({"at_ms": f.at.as_millis() as u64, "action": f.action.to_string()})).collect::<Vec<_>>(),
        "requests": outcome.observed.len(),
        "completed": e.completed,
        "refused": e.refused,
        "failed": e.failed,
        "cancelled": e.cancelled,
        "silent": e.silent,
        "timed_out": e.timed_out,
        "unfinished": e.unfinished,
        "transfers_retried": outcome.router_retries,
        "violations": violations.iter().map(|v| json!({
            "oracle": v.oracle.name(),
            "request": v.request,
            "detail": v.detail,
        })).collect::<Vec<_>>(),
        "reproduce": reproduce,
        "virtual_s": outcome.virtual_time.as_secs_f64(),
        "wall_s": outcome.wall_time.as_secs_f64(),
        "turmoil_steps": outcome.steps,
        "event_log_hash": format!("{:016x}", outcome.log_hash),
    })
}

pub fn violations(violations: &[Violation], reproduce: &str) -> String {
    let mut text = String::new();
    for v in violations {
        text.push_str(&format!("VIOLATION {v}\n"));
    }
    if !violations.is_empty() {
        text.push_str(&format!("reproduce: {reproduce}\n"));
    }
    text
}
