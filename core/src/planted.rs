//! The public bug classes of shared/bugs.md, put back on purpose so the simulator can show it
//! catches each one (issue 11: proof of power).
//!
//! A planted bug is a small alternative branch at the place where the real bug lived, written
//! `if planted!(Class) { the bug } else { the correct code }`. Without feature `planted-bugs`
//! (every production build) `planted!` is the constant `false`: the branch is dead code the
//! compiler drops, and nothing at run time can turn it on. Only lockstep-sim's tests and a `sim`
//! built with `--features planted-bugs` compile the switch, and then at most one bug is planted
//! at a time, per thread: a simulated run is one thread, so parallel runs (`sim explore --jobs`)
//! each plant their own. That thread-local is the one piece of global state in core, and it
//! exists only in those builds.

use std::fmt;
use std::str::FromStr;

/// One bug class. Rows of shared/bugs.md first, then the classes issue 11 found missing, then
/// the incident this project exists for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PlantedBug {
    /// sgl#17259: decode took its first token from another request's reused metadata slot.
    SlotReuse,
    /// sgl#32564: an abort freed decode pages while a one-sided write was still in flight.
    FreeWhileWriteLands,
    /// vllm#45357: blocks freed while the step in flight (overlap) still read them.
    FreeBeforeLastReader,
    /// sgl#36707: a failed transfer's outstanding writes forgotten; the abort ack went out early.
    PrematureRelease,
    /// sgl#30352: an abort in the transfer path never reached a terminal state.
    AbortPathWedge,
    /// sgl#34692: the sender stayed in its handshake state forever.
    StuckInBootstrap,
    /// sgl#30233: after an aborted prefill, decode generated from incomplete KV and answered 200.
    FailOpen,
    /// vllm#46240: an aborted request's two completions both arrived and killed the engine.
    DoubleCompletion,
    /// vllm#46283: decode pages never reclaimed when prefill never answered.
    LeakWhenPeerSilent,
    /// vllm#50297: a prefill preempted in its last step handed an empty page list on.
    EmptyHandOff,
    /// vllm#25067: an abort raced prefill completion.
    AbortRacesCompletion,
    /// sgl#38355: a prefix cached mid chunked prefill, then its request aborted and pages freed.
    PoisonedCachedPrefix,
    /// sgl#23392: cancels near a shared prefix corrupted unrelated requests.
    CancelNearSharedPrefix,
    /// sgl#36552: an abort in one turn corrupted the next turn and leaked KV.
    AbortInMultiTurnSession,
    /// sgl#28039: one side issued a different number of collective operations after an abort.
    CollectiveMismatch,
    /// trtllm#15546: a buffer an in-flight step reads was overwritten by the next plan.
    PinnedBufferOverwritten,
    /// nixl#2067: a release returned while remote writes were still outstanding.
    TransferWithoutCancellation,
    /// sgl#23020: corruption that accumulates over many disaggregated requests.
    AccumulatingCorruption,
    /// Missing class: a stale KV page served after preemption and resume.
    StaleKvAfterResume,
    /// Missing class: a request scheduled twice in one overlap window.
    ScheduledTwiceInOverlap,
    /// Missing class: a lease that does not outlive the slowest write.
    LeaseShorterThanWrite,
    /// Missing class: a heartbeat that does not extend a lease.
    HeartbeatNotExtendingLease,
    /// Missing class: a restarted worker's old-incarnation state kept.
    OldIncarnationStateKept,
    /// Missing class: a restarted router's transfer ids start where its predecessor's did, and
    /// collide with the transfers of the old life the workers still hold.
    RouterIdsReusedAfterRestart,
    /// Missing class: per-request sampling state (the output so far that penalties count) lost
    /// at the prefill-to-decode hand-over: the decode worker counts from one position late.
    SamplerStateLostAtHandOver,
    /// Missing class: a request's grammar (`response_format`) not handed to the decode worker,
    /// which then decodes it unconstrained after a constrained first token.
    GrammarLostAtHandOver,
    /// The incident: decode read a page a transfer had not finished writing (80 agent sessions).
    DecodeReadsUnfinishedTransfer,
}

impl PlantedBug {
    /// Every class, in the order above.
    pub const ALL: [PlantedBug; 27] = [
        PlantedBug::SlotReuse,
        PlantedBug::FreeWhileWriteLands,
        PlantedBug::FreeBeforeLastReader,
        PlantedBug::PrematureRelease,
        PlantedBug::AbortPathWedge,
        PlantedBug::StuckInBootstrap,
        PlantedBug::FailOpen,
        PlantedBug::DoubleCompletion,
        PlantedBug::LeakWhenPeerSilent,
        PlantedBug::EmptyHandOff,
        PlantedBug::AbortRacesCompletion,
        PlantedBug::PoisonedCachedPrefix,
        PlantedBug::CancelNearSharedPrefix,
        PlantedBug::AbortInMultiTurnSession,
        PlantedBug::CollectiveMismatch,
        PlantedBug::PinnedBufferOverwritten,
        PlantedBug::TransferWithoutCancellation,
        PlantedBug::AccumulatingCorruption,
        PlantedBug::StaleKvAfterResume,
        PlantedBug::ScheduledTwiceInOverlap,
        PlantedBug::LeaseShorterThanWrite,
        PlantedBug::HeartbeatNotExtendingLease,
        PlantedBug::OldIncarnationStateKept,
        PlantedBug::RouterIdsReusedAfterRestart,
        PlantedBug::SamplerStateLostAtHandOver,
        PlantedBug::GrammarLostAtHandOver,
        PlantedBug::DecodeReadsUnfinishedTransfer,
    ];

    /// The name the CLI takes (`sim explore --plant NAME`).
    pub fn name(self) -> &'static str {
        match self {
            PlantedBug::SlotReuse => "slot-reuse",
            PlantedBug::FreeWhileWriteLands => "free-while-write-lands",
            PlantedBug::FreeBeforeLastReader => "free-before-last-reader",
            PlantedBug::PrematureRelease => "premature-release",
            PlantedBug::AbortPathWedge => "abort-path-wedge",
            PlantedBug::StuckInBootstrap => "stuck-in-bootstrap",
            PlantedBug::FailOpen => "fail-open",
            PlantedBug::DoubleCompletion => "double-completion",
            PlantedBug::LeakWhenPeerSilent => "leak-when-peer-silent",
            PlantedBug::EmptyHandOff => "empty-hand-off",
            PlantedBug::AbortRacesCompletion => "abort-races-completion",
            PlantedBug::PoisonedCachedPrefix => "poisoned-cached-prefix",
            PlantedBug::CancelNearSharedPrefix => "cancel-near-shared-prefix",
            PlantedBug::AbortInMultiTurnSession => "abort-in-multi-turn-session",
            PlantedBug::CollectiveMismatch => "collective-mismatch",
            PlantedBug::PinnedBufferOverwritten => "pinned-buffer-overwritten",
            PlantedBug::TransferWithoutCancellation => "transfer-without-cancellation",
            PlantedBug::AccumulatingCorruption => "accumulating-corruption",
            PlantedBug::StaleKvAfterResume => "stale-kv-after-resume",
            PlantedBug::ScheduledTwiceInOverlap => "scheduled-twice-in-overlap",
            PlantedBug::LeaseShorterThanWrite => "lease-shorter-than-write",
            PlantedBug::HeartbeatNotExtendingLease => "heartbeat-not-extending-lease",
            PlantedBug::OldIncarnationStateKept => "old-incarnation-state-kept",
            PlantedBug::RouterIdsReusedAfterRestart => "router-ids-reused-after-restart",
            PlantedBug::SamplerStateLostAtHandOver => "sampler-state-lost-at-hand-over",
            PlantedBug::GrammarLostAtHandOver => "grammar-lost-at-hand-over",
            PlantedBug::DecodeReadsUnfinishedTransfer => "decode-reads-unfinished-transfer",
        }
    }
}

impl fmt::Display for PlantedBug {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PlantedBug {
    type Err = String;
    fn from_str(s: &str) -> Result<PlantedBug, String> {
        PlantedBug::ALL.into_iter().find(|bug| bug.name() == s).ok_or_else(|| {
            let names: Vec<_> = PlantedBug::ALL.iter().map(|bug| bug.name()).collect();
            format!("no planted bug {s:?}; the classes are: {}", names.join(", "))
        })
    }
}

/// Whether `bug` is planted on this thread. Use `planted!(Class)` instead: it names the class
/// without the path and reads as what it is at the call site.
#[cfg(feature = "planted-bugs")]
#[inline]
pub fn is_planted(bug: PlantedBug) -> bool {
    PLANTED.with(|planted| planted.get() == Some(bug))
}

/// Without feature `planted-bugs` nothing is ever planted, and the compiler knows it.
#[cfg(not(feature = "planted-bugs"))]
#[inline(always)]
pub const fn is_planted(_bug: PlantedBug) -> bool {
    false
}

#[cfg(feature = "planted-bugs")]
thread_local! {
    static PLANTED: std::cell::Cell<Option<PlantedBug>> = const { std::cell::Cell::new(None) };
}

/// Plants `bug` (or nothing) on this thread until the guard drops, which restores what was
/// planted before.
#[cfg(feature = "planted-bugs")]
pub fn plant(bug: Option<PlantedBug>) -> Planting {
    Planting { before: PLANTED.with(|planted| planted.replace(bug)) }
}

/// What `plant` returns: the planting lasts as long as this does.
#[cfg(feature = "planted-bugs")]
#[derive(Debug)]
#[must_use = "the bug is unplanted when this drops"]
pub struct Planting {
    before: Option<PlantedBug>,
}

#[cfg(feature = "planted-bugs")]
impl Drop for Planting {
    fn drop(&mut self) {
        PLANTED.with(|planted| planted.set(self.before));
    }
}

/// `planted!(Class)`: whether bug class `Class` (a `PlantedBug` variant) is planted on this
/// thread. Always `false` in builds without feature `planted-bugs`.
#[macro_export]
macro_rules! planted {
    ($bug:ident) => {
        $crate::planted::is_planted($crate::planted::PlantedBug::$bug)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        for bug in PlantedBug::ALL {
            assert_eq!(bug.name().parse::<PlantedBug>(), Ok(bug));
        }
        let mut names: Vec<_> = PlantedBug::ALL.iter().map(|bug| bug.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PlantedBug::ALL.len());
        assert!("no-such-bug".parse::<PlantedBug>().unwrap_err().contains("slot-reuse"));
    }

    #[cfg(feature = "planted-bugs")]
    #[test]
    fn a_planting_lasts_as_long_as_its_guard_and_nests() {
        assert!(!planted!(FailOpen));
        {
            let _outer = plant(Some(PlantedBug::FailOpen));
            assert!(planted!(FailOpen));
            assert!(!planted!(SlotReuse));
            {
                let _inner = plant(None);
                assert!(!planted!(FailOpen));
            }
            assert!(planted!(FailOpen));
        }
        assert!(!planted!(FailOpen));
    }

    #[cfg(not(feature = "planted-bugs"))]
    #[test]
    fn without_the_feature_nothing_is_ever_planted() {
        assert!(PlantedBug::ALL.iter().all(|&bug| !is_planted(bug)));
    }
}
