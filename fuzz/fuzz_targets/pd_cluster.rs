//! Arbitrary fault schedules over the router and one or two prefill and decode nodes together
//! (`testing::Cluster`): messages delivered out of order, dropped and duplicated, links breaking,
//! workers and the router restarting, writes landing late or failing, steps failing, clients
//! aborting, the clock jumping, and each machine's timers fired in the order the input says. A
//! leading byte picks the step mode and the decode pool's size (12 to 39 pages), the next the
//! prefill pool's (6 to 23: small enough that the prefill node preempts, as in
//! `core/tests/pd_cluster.rs`), the third how many workers of each role and whether the schedule is
//! calm: its faults left out (`ClusterOp::calm`), and then also `Cluster::check_calm_outcomes`
//! (nothing fails but what a client aborts or a router's restart ends, nothing is retried).
//! After every action: every machine's invariants. Then the faults stop, everything runs to its
//! end, and: every request ended; one that finished passed on exactly its output alone, one that
//! failed a prefix of it; no page, pin, slot or transfer is held on any worker; and the cluster
//! serves again (`Cluster::check_serves_again`).

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lockstep_core::sched::StepMode;
use lockstep_core::testing::{Cluster, ClusterConfig, ClusterOp, small_config};

#[derive(Arbitrary, Debug)]
enum Op {
    Submit { len: u8, shared: u8, max_tokens: u8 },
    Deliver(u8),
    Drop(u8),
    Duplicate(u8),
    Land(u8),
    FailWrite(u8),
    StepPrefill(u8),
    StepDecode(u8),
    FailStep(u8),
    Advance(u8),
    Abort(u8),
    RouterTimers,
    PrefillTimers(u8),
    DecodeTimers(u8),
    LinkDown(u8),
    Restart(u8),
    RestartRouter(u8),
}

impl From<Op> for ClusterOp {
    fn from(op: Op) -> ClusterOp {
        match op {
            Op::Submit { len, shared, max_tokens } => ClusterOp::Submit { len, shared, max_tokens },
            Op::Deliver(i) => ClusterOp::Deliver(i),
            Op::Drop(i) => ClusterOp::Drop(i),
            Op::Duplicate(i) => ClusterOp::Duplicate(i),
            Op::Land(i) => ClusterOp::Land(i),
            Op::FailWrite(i) => ClusterOp::FailWrite(i),
            Op::StepPrefill(i) => ClusterOp::StepPrefill(i),
            Op::StepDecode(i) => ClusterOp::StepDecode(i),
            Op::FailStep(which) => ClusterOp::FailStep(which),
            Op::Advance(ms) => ClusterOp::Advance(ms),
            Op::Abort(i) => ClusterOp::Abort(i),
            Op::RouterTimers => ClusterOp::RouterTimers,
            Op::PrefillTimers(i) => ClusterOp::PrefillTimers(i),
            Op::DecodeTimers(i) => ClusterOp::DecodeTimers(i),
            Op::LinkDown(which) => ClusterOp::LinkDown(which),
            Op::Restart(which) => ClusterOp::Restart(which),
            Op::RestartRouter(lap) => ClusterOp::RestartRouter(lap),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [setup, prefill_setup, workers, rest @ ..] = data else { return };
    let mode = if setup & 1 == 1 { StepMode::Overlap } else { StepMode::Sync };
    let pages = 12 + u32::from(setup >> 1) % 28;
    let prefill_pages = 6 + u32::from(*prefill_setup) % 18;
    let mut input = Unstructured::new(rest);
    let sched = small_config(mode, pages);
    let config = ClusterConfig {
        prefill_sched: small_config(mode, prefill_pages),
        prefill_workers: 1 + u32::from(workers & 1),
        decode_workers: 1 + u32::from((workers >> 1) & 1),
        ..ClusterConfig::new(sched.clone())
    };
    let calm = workers & 4 != 0;
    let mut cluster = Cluster::new(config);
    for _ in 0..400 {
        if input.is_empty() {
            break;
        }
        let Ok(op) = Op::arbitrary(&mut input) else { break };
        let op = ClusterOp::from(op);
        if !calm {
            cluster.apply(&op);
        } else if let Some(op) = op.calm() {
            cluster.apply(&op);
        }
    }
    cluster.run_until_done(20_000);
    cluster.check_outcomes(&sched, &cluster.submitted());
    cluster.check_serves_again(&sched);
    if calm {
        cluster.check_calm_outcomes();
    }
});
