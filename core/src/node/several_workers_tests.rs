//! Two prefill and two decode workers behind one router (`testing::Cluster`): the router spreads
//! the work over them, and a worker's restart costs only what that worker held. With one worker
//! of each role, as the other cluster tests have, a router sending every prompt to the same
//! worker, or a restart that failed every worker's requests, passed unseen.

use crate::sched::{FinishReason, RequestId, SchedConfig, StepMode};
use crate::testing::{
    Cluster, ClusterConfig, End, decode_endpoint, prefill_endpoint, small_config,
};
use crate::wire::{AbortReason, RequestSpec, TransferKey};

use super::tests::{alone, run_mixed_requests, spec};

fn two_of_each(sched: &SchedConfig) -> ClusterConfig {
    ClusterConfig { prefill_workers: 2, decode_workers: 2, ..ClusterConfig::new(sched.clone()) }
}

/// No end-of-sequence token: every stream runs to its length, long enough to be caught midway.
fn without_eos(sched: SchedConfig) -> SchedConfig {
    SchedConfig { eos_token_ids: Vec::new(), ..sched }
}

/// Two of each, without an end-of-sequence token, with four requests of `max_tokens` submitted.
fn two_of_each_running(max_tokens: u32) -> (Cluster, SchedConfig, Vec<RequestSpec>) {
    let sched = without_eos(small_config(StepMode::Sync, 40));
    let mut c = Cluster::new(two_of_each(&sched));
    let specs: Vec<RequestSpec> =
        (1..=4).map(|id| spec(id, 6 + id as u32, 0, max_tokens)).collect();
    for s in &specs {
        c.submit(s.clone()).unwrap();
    }
    (c, sched, specs)
}

#[test]
fn work_spreads_over_every_worker_and_outputs_equal_each_run_alone() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let sched = small_config(mode, 40);
        let mut c = Cluster::new(two_of_each(&sched));
        run_mixed_requests(&mut c, &sched, 8);
        for (role, worker) in c.prefills.iter().map(|w| ("prefill", w)) {
            assert!(
                worker.started >= 2,
                "{mode:?}: {role} {:?} computed {}",
                worker.me,
                worker.started
            );
        }
        for worker in &c.decodes {
            assert!(worker.started >= 2, "{mode:?}: {:?} decoded {}", worker.me, worker.started);
        }
        c.check_outcomes(&sched, &c.submitted());
    }
}

/// A decode worker restarts while all four requests stream: the two it decoded fail (their
/// streams have a hole), with what they passed on a prefix of their output alone; the other
/// worker's two run to their end. Whether or not the router and the prefill workers hear the old
/// life's links go down first.
#[test]
fn a_decode_worker_restart_ends_only_the_streams_it_held() {
    for events_lost in [false, true] {
        let (mut c, sched, specs) = two_of_each_running(30);
        for _ in 0..1_000 {
            if specs.iter().all(|s| !c.outputs[&s.id].is_empty()) {
                break;
            }
            c.tick();
        }
        assert!(c.ends.is_empty(), "{:?}", c.ends);
        let lost = decode_endpoint(1);
        let on_lost = |c: &Cluster, id: RequestId| c.decoding[&id].1 == lost;
        let lost_count = specs.iter().filter(|s| on_lost(&c, s.id)).count();
        assert_eq!(lost_count, 2, "the router spread the streams evenly: {:?}", c.decoding);
        let restarted_on_lost: Vec<bool> = specs.iter().map(|s| on_lost(&c, s.id)).collect();
        c.restart(lost.worker, events_lost, false);
        c.run_until_done(5_000);
        for (s, was_on_lost) in specs.iter().zip(restarted_on_lost) {
            let (end, got) = (c.ends[&s.id], &c.outputs[&s.id]);
            if was_on_lost {
                assert_eq!(end, End::Failed(AbortReason::PeerRestarted), "{}", s.id);
                assert!(alone(&sched, s).starts_with(got), "{}: {got:?}", s.id);
            } else {
                assert_eq!(
                    end,
                    End::Finished(FinishReason::Length),
                    "{} (lost: {events_lost})",
                    s.id
                );
                assert_eq!(got, &alone(&sched, s), "{}", s.id);
            }
        }
        c.check_outcomes(&sched, &c.submitted());
    }
}

/// A prefill worker restarts while both workers hold prompts not yet computed: its transfers are
/// tried again (a later epoch), the other worker's go on as they were (the same transfer and
/// epoch), and every request runs to its end with its output alone.
#[test]
fn a_prefill_worker_restart_retries_only_the_prompts_it_held() {
    for events_lost in [false, true] {
        let (mut c, sched, specs) = two_of_each_running(5);
        // Every message delivered, and no step run: each prompt waits on its prefill worker.
        while !c.network.is_empty() {
            c.deliver(0);
        }
        let lost = prefill_endpoint(1);
        let held: Vec<(TransferKey, bool)> = specs
            .iter()
            .map(|s| {
                let key = c.router.transfer_of(s.id).expect("in transfer");
                let at = |i: usize| c.prefills[i].node.side().is_computing(key);
                assert!(at(0) != at(1), "{}: computed on exactly one worker", s.id);
                (key, at(1))
            })
            .collect();
        let lost_count = held.iter().filter(|(_, on_lost)| *on_lost).count();
        assert_eq!(lost_count, 2, "the router spread the prompts evenly");
        c.restart(lost.worker, events_lost, false);
        c.run_until_done(5_000);
        for (s, (key, was_on_lost)) in specs.iter().zip(held) {
            assert_eq!(c.ends[&s.id], End::Finished(FinishReason::Length), "{}", s.id);
            assert_eq!(c.outputs[&s.id], alone(&sched, s), "{}", s.id);
            let decoded = c.decoding[&s.id].0;
            if was_on_lost {
                assert!(decoded.epoch > key.epoch, "{}: not tried again ({decoded:?})", s.id);
            } else {
                assert_eq!(decoded, key, "{}: its transfer was tried again", s.id);
            }
        }
        c.check_outcomes(&sched, &c.submitted());
    }
}
