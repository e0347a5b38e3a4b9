//! Shrinking a failing run (`sim explore --shrink`): fewer faults and fewer requests while the
//! same oracle still fires, so the reproduction a person reads is small.
//!
//! The seed's knobs and fault mix are pinned to the failing run's (they are drawn from the
//! trace's size, which shrinking changes), and the fault schedule keeps its indices, so a kept
//! fault is the same fault. Requests go with everything that waits on them (a session's later
//! turns, the sub-agents a turn spawned): a turn is never sent after an answer that no longer
//! comes. Each candidate is one run; removals are tried in halves, then quarters, down to single
//! items (a simple delta debugging), and a removal is kept when the oracle still fires.

use std::collections::BTreeSet;

use crate::oracle::{self, Oracle, Violation};
use crate::reference::Reference;
use crate::run::{RunConfig, RunOutcome, run};
use crate::trace::{SimTrace, Start};

/// What is left of a failing run.
#[derive(Clone, Debug)]
pub struct Shrunk {
    /// The kept requests, by their index in the whole trace.
    pub requests: BTreeSet<usize>,
    /// The kept faults, by their index in the seed's schedule.
    pub faults: BTreeSet<usize>,
    pub outcome: RunOutcome,
    pub violations: Vec<Violation>,
    /// Runs it took.
    pub runs: usize,
}

/// Shrinks `failed` (a run of `config` on `trace`) while `oracle` still fires, in at most
/// `max_runs` runs.
pub fn shrink(
    trace: &SimTrace,
    reference: &Reference,
    config: &RunConfig,
    failed: RunOutcome,
    oracle: Oracle,
    max_runs: usize,
) -> Shrunk {
    let mut config = config.clone();
    config.knobs = Some(failed.knobs.clone());
    config.mix = Some(failed.mix.clone());
    let all_faults: BTreeSet<usize> = match &config.only_faults {
        Some(only) => only.clone(),
        None => (0..failed.faults.len()).collect(),
    };
    let violations = oracle::check(reference, &failed);
    let mut best = Shrunk {
        requests: (0..trace.requests.len()).collect(),
        faults: all_faults,
        outcome: failed,
        violations,
        runs: 0,
    };
    let attempt = |best: &mut Shrunk, requests: BTreeSet<usize>, faults: BTreeSet<usize>| {
        if best.runs >= max_runs || requests.is_empty() {
            return false;
        }
        best.runs += 1;
        let (sub_trace, sub_reference) = subset(trace, reference, &requests);
        let mut candidate = config.clone();
        candidate.only_faults = Some(faults.clone());
        let outcome = run(&sub_trace, &candidate);
        let violations = oracle::check(&sub_reference, &outcome);
        if violations.iter().any(|v| v.oracle == oracle) {
            *best = Shrunk { requests, faults, outcome, violations, runs: best.runs };
            true
        } else {
            false
        }
    };
    // Faults first: a run without them is the easier one to read.
    let mut chunk = best.faults.len().div_ceil(2).max(1);
    loop {
        let mut start = 0;
        while start < best.faults.len() {
            let faults: Vec<usize> = best.faults.iter().copied().collect();
            let removed: BTreeSet<usize> = faults.iter().skip(start).take(chunk).copied().collect();
            let kept = best.faults.difference(&removed).copied().collect();
            let requests = best.requests.clone();
            if !attempt(&mut best, requests, kept) {
                start += chunk;
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    // Then requests, latest first (they depend on earlier ones, never the other way).
    let mut chunk = best.requests.len().div_ceil(2).max(1);
    loop {
        let mut end = best.requests.len();
        while end > 0 {
            let requests: Vec<usize> = best.requests.iter().copied().collect();
            let from = end.saturating_sub(chunk);
            let removed = with_dependents(trace, &requests[from..end]);
            let kept: BTreeSet<usize> = best.requests.difference(&removed).copied().collect();
            let faults = best.faults.clone();
            if !attempt(&mut best, kept, faults) {
                end = from;
            } else {
                end = end.min(best.requests.len());
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    best
}

/// `removed` and every request that (transitively) waits on one of them.
fn with_dependents(trace: &SimTrace, removed: &[usize]) -> BTreeSet<usize> {
    let mut gone: BTreeSet<usize> = removed.iter().copied().collect();
    // `previous` is always an earlier index, so one pass in order closes the set.
    for request in &trace.requests {
        if let Start::After { previous, .. } = request.start
            && gone.contains(&previous)
        {
            gone.insert(request.index);
        }
    }
    gone
}

/// The trace cut to `keep` and its C=1 outputs.
pub fn subset(
    trace: &SimTrace,
    reference: &Reference,
    keep: &BTreeSet<usize>,
) -> (SimTrace, Reference) {
    let outputs = keep.iter().map(|&old| reference.outputs[old].clone()).collect();
    let logprobs = keep.iter().map(|&old| reference.logprobs[old].clone()).collect();
    (sub_trace(trace, keep), Reference { outputs, logprobs })
}

/// The trace cut to `keep` (closed under `previous`: see `closed`), renumbered from 0.
pub fn sub_trace(trace: &SimTrace, keep: &BTreeSet<usize>) -> SimTrace {
    let position: std::collections::BTreeMap<usize, usize> =
        keep.iter().enumerate().map(|(new, &old)| (old, new)).collect();
    let requests = keep
        .iter()
        .map(|&old| {
            let mut request = trace.requests[old].clone();
            request.index = position[&old];
            if let Start::After { previous, think } = request.start {
                let previous =
                    *position.get(&previous).expect("a kept request's predecessor is kept");
                request.start = Start::After { previous, think };
            }
            request
        })
        .collect();
    SimTrace { requests, ..trace.clone() }
}

/// Whether `keep` may stand alone: every kept request's predecessor is kept.
pub fn closed(trace: &SimTrace, keep: &BTreeSet<usize>) -> bool {
    keep.iter().all(|&i| match trace.requests.get(i).map(|r| r.start) {
        Some(Start::After { previous, .. }) => keep.contains(&previous),
        Some(Start::At(_)) => true,
        None => false,
    })
}
