//! Proof of power (issue 11): every bug class of shared/bugs.md, put back with `planted!`, is
//! caught at its scenario's known seed by the oracle the scenario names, and the same seed
//! without the bug holds every oracle. `sim hunt` measures how many seeds each takes from
//! arbitrary starting points (BENCHMARKS.md); this is the small budget CI affords.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use lockstep_core::planted::PlantedBug;
use lockstep_sim::device::CostModel;
use lockstep_sim::oracle::{self, Violation};
use lockstep_sim::plants::{self, Scenario};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunConfig, run};
use lockstep_sim::trace::{self, SimTrace};

/// Traces and their C=1 outputs, loaded once per scenario trace for all tests.
type Loaded = Arc<(SimTrace, Reference)>;

fn loaded(scenario: &Scenario) -> Loaded {
    static CACHE: OnceLock<Mutex<BTreeMap<String, Loaded>>> = OnceLock::new();
    let key = format!("{} {:?}", scenario.trace, scenario.import);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(hit) = cache.lock().expect("no test panics holding it").get(&key) {
        return hit.clone();
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(scenario.trace);
    let options = scenario.import_options().expect("scenario options are valid");
    let trace = trace::load(&path, &options).expect("a committed trace");
    let reference = Reference::compute(&trace, CostModel::default_model(), 1)
        .expect("every request completes alone");
    let entry = Arc::new((trace, reference));
    cache.lock().expect("no test panics holding it").insert(key, entry.clone());
    entry
}

fn judged(bug: PlantedBug, plant: bool) -> Vec<Violation> {
    let scenario = plants::scenario(bug);
    let loaded = loaded(&scenario);
    let (trace, reference) = (&loaded.0, &loaded.1);
    let mut config = RunConfig::new(scenario.caught_at, scenario.topology, scenario.faults);
    config.plant = plant.then_some(bug);
    oracle::check(reference, &run(trace, &config))
}

fn caught_when_planted_and_absent_when_not(bug: PlantedBug) {
    let scenario = plants::scenario(bug);
    let planted = judged(bug, true);
    assert!(
        planted.iter().any(|v| v.oracle == scenario.fires),
        "{bug} planted, seed {}: expected {} to fire, got {planted:#?}",
        scenario.caught_at,
        scenario.fires.name()
    );
    let clean = judged(bug, false);
    assert!(clean.is_empty(), "{bug} not planted, seed {}: {clean:#?}", scenario.caught_at);
}

macro_rules! planted_classes {
    ($($(#[$attribute:meta])* $test:ident: $bug:ident,)*) => {
        $(
            #[test]
            $(#[$attribute])*
            fn $test() {
                caught_when_planted_and_absent_when_not(PlantedBug::$bug);
            }
        )*

        #[test]
        fn every_class_has_its_test() {
            let tested = [$(PlantedBug::$bug),*];
            assert_eq!(tested.as_slice(), PlantedBug::ALL.as_slice());
        }
    };
}

planted_classes! {
    slot_reuse: SlotReuse,
    free_while_write_lands: FreeWhileWriteLands,
    free_before_last_reader: FreeBeforeLastReader,
    premature_release: PrematureRelease,
    abort_path_wedge: AbortPathWedge,
    stuck_in_bootstrap: StuckInBootstrap,
    fail_open: FailOpen,
    double_completion: DoubleCompletion,
    leak_when_peer_silent: LeakWhenPeerSilent,
    empty_hand_off: EmptyHandOff,
    abort_races_completion: AbortRacesCompletion,
    poisoned_cached_prefix: PoisonedCachedPrefix,
    cancel_near_shared_prefix: CancelNearSharedPrefix,
    abort_in_multi_turn_session: AbortInMultiTurnSession,
    collective_mismatch: CollectiveMismatch,
    pinned_buffer_overwritten: PinnedBufferOverwritten,
    transfer_without_cancellation: TransferWithoutCancellation,
    accumulating_corruption: AccumulatingCorruption,
    stale_kv_after_resume: StaleKvAfterResume,
    scheduled_twice_in_overlap: ScheduledTwiceInOverlap,
    lease_shorter_than_write: LeaseShorterThanWrite,
    heartbeat_not_extending_lease: HeartbeatNotExtendingLease,
    old_incarnation_state_kept: OldIncarnationStateKept,
    router_ids_reused_after_restart: RouterIdsReusedAfterRestart,
    sampler_state_lost_at_hand_over: SamplerStateLostAtHandOver,
    grammar_lost_at_hand_over: GrammarLostAtHandOver,
    decode_reads_unfinished_transfer: DecodeReadsUnfinishedTransfer,
}
