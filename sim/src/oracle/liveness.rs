//! Oracle 2: liveness. Once the faults heal, the deployment must serve again: every request ends
//! (no client waits out its bound), within `LIVENESS_BOUND` of the later of its sending and the
//! healing, and a request sent after the deployment had `RECOVERY` to reconnect completes,
//! unless the deployment shed it for load while it kept serving others. A client may hear
//! nothing for its read timeout (not even the keep-alives a live server sends) only if the host
//! it talks to crashed while it waited. A run without faults has nothing to recover from: every
//! request there completes, from the first, unless shed. In a calm run (none of the faults that
//! can fail a transfer's attempt, though the entry may crash: `FaultMix::is_calm`) no life of the
//! router retries a transfer (a retry means an attempt failed, which only a fault excuses; the
//! client cannot see one that then succeeded).
//!
//! Shedding is how a deployment stays live under more load than it can serve: a queue at its
//! bound refuses (429), and a request that waited past the queue's bound fails with
//! `QUEUE_TIMEOUT_MESSAGE`. A knob draw can make the pool that small (seed 111 of the long azure
//! prompts in ci/sim-seeds.txt queued 300 s behind 8k-token prompts computed 8 tokens a step). A
//! wedge sheds too, but completes nothing: so a shed request passes only if another request
//! completed while it waited, or, refused at the door, within `LIVENESS_BOUND` after.

use std::time::Duration;

use lockstep_server::http::QUEUE_TIMEOUT_MESSAGE;

use super::{Oracle, Violation};
use crate::client::{Ending, Observed};
use crate::faults::FaultMix;
use crate::run::RunOutcome;

/// The longest a request may take to end after faults heal: the router's longest queue wait
/// (300 s) plus a transfer's deadline and the outcome's margin, as the servers are configured.
pub const LIVENESS_BOUND: Duration = Duration::from_secs(400);

/// How long after the faults heal the deployment has to find its workers again: links' dead
/// bound and redial backoff, with room.
pub const RECOVERY: Duration = Duration::from_secs(10);

pub fn check(outcome: &RunOutcome) -> Vec<Violation> {
    // Without faults there is nothing to recover from; after the entry's restart, its links.
    let recovery = if outcome.mix == FaultMix::NONE { Duration::ZERO } else { RECOVERY };
    let calm = outcome.mix.is_calm();
    let crashed = &outcome.entry_crashed_at;
    let mut found = check_observed(outcome.healed_at, recovery, crashed, &outcome.observed);
    if calm && outcome.router_retries > 0 {
        found.push(Violation {
            oracle: Oracle::Liveness,
            request: None,
            detail: format!(
                "the router retried {} transfers without a fault",
                outcome.router_retries
            ),
        });
    }
    found
}

fn check_observed(
    healed: Duration,
    recovery: Duration,
    entry_crashed_at: &[Duration],
    observed: &[Observed],
) -> Vec<Violation> {
    let mut found = Vec::new();
    for (index, seen) in observed.iter().enumerate() {
        let violation =
            |detail: String| Violation { oracle: Oracle::Liveness, request: Some(index), detail };
        let (Some(sent), Some(ending)) = (seen.sent_at, &seen.ending) else {
            found.push(violation("never ended".into()));
            continue;
        };
        if *ending == Ending::TimedOut {
            found.push(violation("the client waited out its bound without an answer".into()));
            continue;
        }
        let ended = seen.ended_at.unwrap_or_default();
        if *ending == Ending::Silent && !entry_crashed_at.iter().any(|&c| sent <= c && c <= ended) {
            found.push(violation(
                "the client heard nothing for its read timeout, and its server had not crashed"
                    .into(),
            ));
            continue;
        }
        let limit = sent.max(healed) + LIVENESS_BOUND;
        if ended > limit {
            found.push(violation(format!(
                "ended at {:.3} s, past the bound {:.3} s",
                ended.as_secs_f64(),
                limit.as_secs_f64()
            )));
        }
        if sent < healed + recovery
            || !matches!(ending, Ending::Refused { .. } | Ending::Failed { .. })
        {
            continue;
        }
        let shed = shed_for_load(ending);
        let window =
            if shed == Some(Shed::AtTheDoor) { sent..sent + LIVENESS_BOUND } else { sent..ended };
        if shed.is_some() && completed_within(observed, index, window) {
            continue;
        }
        let why = if shed.is_some() {
            " (shed for load, and nothing else completed meanwhile)"
        } else {
            ""
        };
        found.push(violation(format!(
            "sent {:.3} s after the faults healed and not served{why}: {ending:?}",
            (sent - healed).as_secs_f64()
        )));
    }
    found
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shed {
    /// Refused on arrival: the queue was at its bound.
    AtTheDoor,
    /// Failed after waiting past the queue's bound.
    FromTheQueue,
}

fn shed_for_load(ending: &Ending) -> Option<Shed> {
    match ending {
        Ending::Refused { status: 429, .. } => Some(Shed::AtTheDoor),
        Ending::Refused { message, .. } if message.contains(QUEUE_TIMEOUT_MESSAGE) => {
            Some(Shed::FromTheQueue)
        }
        Ending::Failed { why } if why.contains(QUEUE_TIMEOUT_MESSAGE) => Some(Shed::FromTheQueue),
        _ => None,
    }
}

/// Whether a request other than `index` completed within `window`.
fn completed_within(
    observed: &[Observed],
    index: usize,
    window: std::ops::Range<Duration>,
) -> bool {
    observed.iter().enumerate().any(|(other, seen)| {
        other != index
            && matches!(seen.ending, Some(Ending::Completed { .. }))
            && seen.ended_at.is_some_and(|at| window.start <= at && at <= window.end)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEALED: Duration = Duration::from_secs(20);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn request(sent: u64, ended: u64, ending: Ending) -> Observed {
        Observed {
            sent_at: Some(secs(sent)),
            ended_at: Some(secs(ended)),
            ending: Some(ending),
            ..Observed::default()
        }
    }

    fn completed(sent: u64, ended: u64) -> Observed {
        request(sent, ended, Ending::Completed { finish_reason: "length".into() })
    }

    fn queue_timeout() -> Ending {
        Ending::Failed { why: format!("error event: {{\"message\":\"{QUEUE_TIMEOUT_MESSAGE}\"}}") }
    }

    fn at_capacity() -> Ending {
        Ending::Refused { status: 429, message: "the server is at capacity".into() }
    }

    fn violations(observed: &[Observed]) -> Vec<Option<usize>> {
        check_observed(HEALED, RECOVERY, &[], observed).into_iter().map(|v| v.request).collect()
    }

    #[test]
    fn a_request_shed_from_the_queue_while_others_completed_is_overload() {
        let observed = [completed(0, 200), request(40, 340, queue_timeout()), completed(30, 330)];
        assert_eq!(violations(&observed), []);
    }

    #[test]
    fn a_request_shed_from_the_queue_while_nothing_completed_is_a_wedge() {
        // One completion before it was sent and one after it ended: neither was while it waited.
        let observed = [completed(0, 35), request(40, 340, queue_timeout()), completed(30, 345)];
        assert_eq!(violations(&observed), [Some(1)]);
    }

    #[test]
    fn a_refusal_at_capacity_passes_only_if_the_deployment_went_on_serving() {
        let served = [request(40, 40, at_capacity()), completed(10, 300)];
        assert_eq!(violations(&served), []);
        let wedged = [request(40, 40, at_capacity()), completed(10, 39)];
        assert_eq!(violations(&wedged), [Some(0)]);
    }

    #[test]
    fn a_failure_that_is_not_shedding_is_never_excused() {
        let failed = Ending::Failed { why: "error event: the engine failed".into() };
        let observed = [request(40, 50, failed), completed(30, 45)];
        assert_eq!(violations(&observed), [Some(0)]);
    }

    #[test]
    fn shedding_before_the_deployment_recovered_is_not_judged() {
        let observed = [request(25, 325, queue_timeout())];
        assert_eq!(violations(&observed), []);
    }

    /// Without faults there is no recovery to wait for: a failure at once after the start is
    /// judged, as every later one is.
    #[test]
    fn without_faults_a_failure_before_the_recovery_bound_is_judged_too() {
        let failed = Ending::Failed { why: "error event: the engine failed".into() };
        let observed = [request(21, 22, failed), completed(21, 23)];
        assert_eq!(violations(&observed), []);
        let judged = check_observed(HEALED, Duration::ZERO, &[], &observed);
        assert_eq!(judged.into_iter().map(|v| v.request).collect::<Vec<_>>(), [Some(0)]);
    }

    /// Silence is a crash's: a client whose server crashed while it waited gives up, and that is
    /// the fault's; silence without one is a server that stopped even its keep-alives.
    #[test]
    fn a_silent_server_is_excused_only_by_its_crash_while_the_client_waited() {
        let observed = [request(5, 15, Ending::Silent), completed(21, 23)];
        let judge = |crashes: &[u64]| {
            let crashes: Vec<Duration> = crashes.iter().map(|&c| secs(c)).collect();
            let found = check_observed(HEALED, RECOVERY, &crashes, &observed);
            found.into_iter().map(|v| v.request).collect::<Vec<_>>()
        };
        assert_eq!(judge(&[7]), []);
        assert_eq!(judge(&[5]), []);
        assert_eq!(judge(&[15]), []);
        assert_eq!(judge(&[]), [Some(0)]);
        assert_eq!(judge(&[4, 16]), [Some(0)], "crashes before it was sent and after it ended");
    }
}
