//! Oracle 2: liveness. Once the faults heal, the deployment must serve again: every request ends
//! (no client waits out its bound), within `LIVENESS_BOUND` of the later of its sending and the
//! healing, and a request sent after the deployment had `RECOVERY` to reconnect completes.

use std::time::Duration;

use super::{Oracle, Violation};
use crate::client::Ending;
use crate::run::RunOutcome;

/// The longest a request may take to end after faults heal: the router's longest queue wait
/// (300 s) plus a transfer's deadline and the outcome's margin, as the servers are configured.
pub const LIVENESS_BOUND: Duration = Duration::from_secs(400);

/// How long after the faults heal the deployment has to find its workers again: links' dead
/// bound and redial backoff, with room.
pub const RECOVERY: Duration = Duration::from_secs(10);

pub fn check(outcome: &RunOutcome) -> Vec<Violation> {
    let healed = outcome.healed_at;
    let mut found = Vec::new();
    for (index, observed) in outcome.observed.iter().enumerate() {
        let violation =
            |detail: String| Violation { oracle: Oracle::Liveness, request: Some(index), detail };
        let (Some(sent), Some(ending)) = (observed.sent_at, &observed.ending) else {
            found.push(violation("never ended".into()));
            continue;
        };
        if *ending == Ending::TimedOut {
            found.push(violation("the client waited out its bound without an answer".into()));
            continue;
        }
        let ended = observed.ended_at.unwrap_or_default();
        let limit = sent.max(healed) + LIVENESS_BOUND;
        if ended > limit {
            found.push(violation(format!(
                "ended at {:.3} s, past the bound {:.3} s",
                ended.as_secs_f64(),
                limit.as_secs_f64()
            )));
        }
        if sent >= healed + RECOVERY
            && matches!(ending, Ending::Refused { .. } | Ending::Failed { .. })
        {
            found.push(violation(format!(
                "sent {:.3} s after the faults healed and not served: {ending:?}",
                (sent - healed).as_secs_f64()
            )));
        }
    }
    found
}
