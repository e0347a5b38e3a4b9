//! Each oracle fires on a run broken by hand (a bug planted in the simulated device, below the
//! unchanged server), and holds on the same run unbroken.

use std::time::Duration;

use lockstep_sim::client::Ending;
use lockstep_sim::device::CostModel;
use lockstep_sim::faults::{FaultLevel, FaultMix};
use lockstep_sim::knobs::{Knobs, Topology};
use lockstep_sim::oracle::{self, Oracle, determinism};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunConfig, RunOutcome, context_needed, run};
use lockstep_sim::sabotage::Sabotage;
use lockstep_sim::trace::{SimRequest, SimTrace, Start};

/// Eight requests, two sessions of two turns sharing a prefix, the rest open loop; three ask for
/// log-probabilities.
fn trace() -> SimTrace {
    let prefix: Vec<u32> = (0..40).map(|t| 100 + t * 7).collect();
    let mut requests = Vec::new();
    for i in 0..8usize {
        let mut input = prefix.clone();
        input.extend((0..(5 + i as u32 * 9)).map(|t| 1000 + i as u32 * 50 + t));
        let start = match i {
            5 => Start::After { previous: 4, think: Duration::from_millis(30) },
            7 => Start::After { previous: 6, think: Duration::from_millis(10) },
            _ => Start::At(Duration::from_millis(i as u64 * 7)),
        };
        requests.push(SimRequest {
            index: i,
            session: None,
            turn: 1,
            start,
            input,
            max_tokens: 24,
            temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
            seed: i as u64 * 1_000_003,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: [None, Some(0), None, Some(3)][i % 4],
            echo: false,
        });
    }
    SimTrace { name: "oracles".into(), vocab_size: 32_000, requests }
}

fn config(seed: u64, topology: Topology, sabotage: Option<Sabotage>) -> RunConfig {
    let mut config = RunConfig::new(seed, topology, FaultLevel::None);
    config.sabotage = sabotage;
    config.client_timeout = Duration::from_secs(30);
    config.settle_max = Duration::from_secs(5);
    config
}

fn fired(reference: &Reference, outcome: &RunOutcome) -> Vec<Oracle> {
    let mut fired: Vec<Oracle> =
        oracle::check(reference, outcome).iter().map(|v| v.oracle).collect();
    fired.dedup();
    fired
}

fn reference(trace: &SimTrace) -> Reference {
    Reference::compute(trace, CostModel::default_model(), 2).expect("every request completes alone")
}

#[test]
fn unbroken_runs_hold_every_oracle_and_replay_identically() {
    let trace = trace();
    let reference = reference(&trace);
    for topology in [Topology::Single, Topology::OneP1D, Topology::TwoP2D] {
        for seed in 0..3 {
            let mut config = config(seed, topology, None);
            config.faults = FaultLevel::Default;
            let outcome = run(&trace, &config);
            let violations = oracle::check(&reference, &outcome);
            assert!(violations.is_empty(), "{topology} seed {seed}: {violations:?}");
            assert!(determinism::check(&outcome, &run(&trace, &config)).is_empty());
        }
    }
}

/// A device that fails 3% of its steps (the failed-step fault): the server turns each into
/// errors for that step's requests, which end cleanly; the rest complete with their outputs
/// alone, nothing leaks or wedges, and every oracle holds, in every topology.
#[test]
fn failed_steps_fail_their_requests_and_nothing_else() {
    let trace = trace();
    let reference = reference(&trace);
    for topology in [Topology::Single, Topology::OneP1D, Topology::TwoP2D] {
        let mut config = config(2, topology, None);
        config.mix = Some(FaultMix {
            window: Duration::from_secs(60),
            failed_step_rate: 0.03,
            ..FaultMix::NONE
        });
        let outcome = run(&trace, &config);
        let violations = oracle::check(&reference, &outcome);
        assert!(violations.is_empty(), "{topology}: {violations:?}");
        let endings: Vec<_> = outcome.observed.iter().map(|o| o.ending.clone()).collect();
        let failed = endings.iter().filter(|e| matches!(e, Some(Ending::Failed { .. }))).count();
        let completed =
            endings.iter().filter(|e| matches!(e, Some(Ending::Completed { .. }))).count();
        assert!(failed > 0 && completed > 0, "{topology}: {endings:?}");
        if topology == Topology::Single {
            continue;
        }
        // A failed prefill step fails its transfer's attempt, and the router tries again: the
        // faults excuse it here, and a run without them (liveness, judging it as calm) would not.
        assert!(outcome.router_retries > 0, "{topology}: no transfer was retried");
        let calm = RunOutcome { mix: FaultMix::NONE, ..outcome.clone() };
        let retried = oracle::liveness::check(&calm);
        assert!(retried.iter().any(|v| v.detail.contains("retried")), "{topology}: {retried:?}");
    }
}

#[test]
fn a_dropped_kv_write_is_caught_by_equal_alone() {
    let trace = trace();
    let reference = reference(&trace);
    let sabotage = Some(Sabotage::DropKvWrite { every: 2 });
    let outcome = run(&trace, &config(1, Topology::OneP1D, sabotage));
    assert!(fired(&reference, &outcome).contains(&Oracle::EqualAlone), "{:?}", outcome.observed);
}

#[test]
fn a_log_probability_one_bit_off_is_caught_by_equal_alone() {
    let trace = trace();
    let reference = reference(&trace);
    assert!(reference.logprobs.iter().filter(|l| !l.is_empty()).count() >= 3, "{reference:?}");
    let sabotage = Some(Sabotage::SkewLogprob { after: Duration::ZERO });
    let outcome = run(&trace, &config(1, Topology::OneP1D, sabotage));
    assert_eq!(fired(&reference, &outcome), vec![Oracle::EqualAlone], "{:?}", outcome.observed);
}

#[test]
fn corrupt_tokens_a_client_got_before_leaving_are_caught_by_fail_closed() {
    let trace = trace();
    let reference = reference(&trace);
    let mut config =
        config(1, Topology::Single, Some(Sabotage::CorruptSample { after: Duration::ZERO }));
    // A prompt takes one step (the seed's knobs may cut it into chunks, and then no client sees a
    // token before it leaves).
    let mut knobs = Knobs::draw(1, context_needed(&trace), trace.requests.len());
    knobs.prefill_chunk_tokens = knobs.step_tokens;
    config.knobs = Some(knobs);
    // Every client leaves after its first tokens, before its answer is whole.
    config.mix = Some(FaultMix {
        cancel_rate: 1.0,
        cancel_within: Duration::from_millis(60),
        ..FaultMix::NONE
    });
    let outcome = run(&trace, &config);
    let fired_now = fired(&reference, &outcome);
    assert!(fired_now.contains(&Oracle::FailClosed), "{fired_now:?}: {:?}", outcome.observed);
}

#[test]
fn a_wedged_device_is_caught_by_liveness_and_leaks() {
    let trace = trace();
    let reference = reference(&trace);
    // Stalls once the clients have started (they start after the two-second warm-up).
    let sabotage = Some(Sabotage::Stall { after: Duration::from_millis(2_010) });
    let outcome = run(&trace, &config(1, Topology::OneP1D, sabotage));
    let fired = fired(&reference, &outcome);
    assert!(fired.contains(&Oracle::Liveness), "{fired:?}");
    assert!(fired.contains(&Oracle::Leaks), "{fired:?}: {:?}", outcome.held_at_end);
}

#[test]
fn a_panicking_engine_is_caught_by_invariants() {
    let trace = trace();
    let reference = reference(&trace);
    let sabotage = Some(Sabotage::Panic { after: Duration::from_millis(2_010) });
    let outcome = run(&trace, &config(1, Topology::Single, sabotage));
    assert_eq!(fired(&reference, &outcome)[0], Oracle::Invariants, "{:?}", outcome.panics);
    assert!(outcome.panics[0].contains("planted"), "{:?}", outcome.panics);
}

#[test]
fn state_that_outlives_a_run_is_caught_by_determinism() {
    let trace = trace();
    let config = config(3, Topology::OneP1D, Some(Sabotage::SharedCounterCost));
    let first = run(&trace, &config);
    let second = run(&trace, &config);
    let violations = determinism::check(&first, &second);
    assert_eq!(violations.len(), 1, "{:?}", first.log_hash);
    assert_eq!(violations[0].oracle, Oracle::Determinism);
}

/// The router (or the single server) crashes while every request is out: their clients hear
/// nothing more, not even keep-alives, and give up at their read timeout. The crash excuses that
/// and nothing else: the same run judged as if nothing had crashed fails liveness for each.
#[test]
fn clients_of_a_crashed_entry_go_silent_and_only_its_crash_excuses_them() {
    let trace = trace();
    let reference = reference(&trace);
    for topology in [Topology::Single, Topology::OneP1D, Topology::TwoP2D] {
        let mut config = config(0, topology, None);
        config.client_timeout = 2 * config.client_read_timeout;
        config.mix = Some(FaultMix {
            window: Duration::from_millis(100),
            entry_crashes: 1,
            outage_max: Duration::from_millis(50),
            ..FaultMix::NONE
        });
        let outcome = run(&trace, &config);
        assert!(outcome.mix.is_calm(), "{topology}: an entry's crash alone is judged as calm");
        let violations = oracle::check(&reference, &outcome);
        assert!(violations.is_empty(), "{topology}: {violations:?}");
        assert_eq!(outcome.entry_crashed_at.len(), 1, "{topology}");
        let silent: Vec<usize> = (0..trace.requests.len())
            .filter(|&i| outcome.observed[i].ending == Some(Ending::Silent))
            .collect();
        assert!(!silent.is_empty(), "{topology}: {:?}", outcome.observed);
        assert_eq!(outcome.router_retries, 0, "{topology}");
        let uncrashed = RunOutcome { entry_crashed_at: Vec::new(), ..outcome.clone() };
        let judged: Vec<Option<usize>> =
            oracle::liveness::check(&uncrashed).into_iter().map(|v| v.request).collect();
        assert_eq!(judged, silent.into_iter().map(Some).collect::<Vec<_>>(), "{topology}");
    }
}
