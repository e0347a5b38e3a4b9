//! `sim explore --shrink`: a failing run shrinks to fewer faults and requests with the same
//! oracle still firing, and what it prints reproduces that smaller run.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use lockstep_sim::device::CostModel;
use lockstep_sim::faults::FaultLevel;
use lockstep_sim::knobs::Topology;
use lockstep_sim::oracle::{self, Oracle};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunConfig, run};
use lockstep_sim::sabotage::Sabotage;
use lockstep_sim::shrink::{closed, shrink, sub_trace, subset};
use lockstep_sim::trace::{self, ImportOptions, SimRequest, SimTrace, Start};

#[test]
fn a_dropped_write_shrinks_to_a_smaller_run_that_still_fails_the_same_way() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/recorded_router_1p1d_smollm2.jsonl");
    let trace = trace::load(&path, &ImportOptions::default()).expect("a committed trace");
    let reference = Reference::compute(&trace, CostModel::default_model(), 2)
        .expect("every request completes alone");
    // Heavy faults give the shrinker faults to take away; the device drops every third KV write.
    let (config, failed) = (0..20)
        .map(|seed| {
            let mut config = RunConfig::new(seed, Topology::OneP1D, FaultLevel::Heavy);
            config.sabotage = Some(Sabotage::DropKvWrite { every: 3 });
            let outcome = run(&trace, &config);
            (config, outcome)
        })
        .find(|(_, outcome)| {
            !outcome.faults.is_empty()
                && oracle::check(&reference, outcome).iter().any(|v| v.oracle == Oracle::EqualAlone)
        })
        .expect("a seed with faults where the dropped write shows");
    let (requests, faults) = (trace.requests.len(), failed.faults.len());

    let shrunk = shrink(&trace, &reference, &config, failed, Oracle::EqualAlone, 200);

    assert!(shrunk.violations.iter().any(|v| v.oracle == Oracle::EqualAlone));
    assert!(
        shrunk.faults.len() < faults && shrunk.requests.len() < requests,
        "nothing taken away: {} of {faults} faults, {} of {requests} requests",
        shrunk.faults.len(),
        shrunk.requests.len()
    );
    assert!(closed(&trace, &shrunk.requests));
    // What the reproduce command runs: the kept requests and faults, the seed's draws pinned.
    let (sub_trace, sub_reference) = subset(&trace, &reference, &shrunk.requests);
    let mut again = config.clone();
    again.knobs = Some(shrunk.outcome.knobs.clone());
    again.mix = Some(shrunk.outcome.mix.clone());
    again.only_faults = Some(shrunk.faults.clone());
    let replayed = run(&sub_trace, &again);
    assert_eq!(replayed.log_hash, shrunk.outcome.log_hash, "the smaller run replays identically");
    let violations = oracle::check(&sub_reference, &replayed);
    assert!(violations.iter().any(|v| v.oracle == Oracle::EqualAlone));
}

#[test]
fn a_kept_turn_keeps_the_turn_it_waits_on_and_is_renumbered() {
    let request = |index: usize, start: Start| SimRequest {
        index,
        session: Some(0),
        turn: index as u32 + 1,
        start,
        input: vec![1, 2, 3],
        max_tokens: 4,
        temperature: 0.0,
        seed: index as u64,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
        logit_bias: Vec::new(),
        constrained: false,
        priority: 0,
        logprobs: None,
        echo: false,
    };
    let think = Duration::from_millis(5);
    let trace = SimTrace {
        name: "session".into(),
        vocab_size: 100,
        requests: vec![
            request(0, Start::At(Duration::ZERO)),
            request(1, Start::At(Duration::from_millis(1))),
            request(2, Start::After { previous: 1, think }),
        ],
    };
    let set = |items: &[usize]| items.iter().copied().collect::<BTreeSet<usize>>();
    assert!(closed(&trace, &set(&[0, 1, 2])));
    assert!(closed(&trace, &set(&[0])));
    assert!(!closed(&trace, &set(&[0, 2])), "turn 2 waits on turn 1");
    let cut = sub_trace(&trace, &set(&[1, 2]));
    assert_eq!(cut.requests.len(), 2);
    assert_eq!(cut.requests[1].index, 1);
    assert_eq!(cut.requests[1].start, Start::After { previous: 0, think });
}
