//! Arbitrary fault schedules over the router, a prefill node and a decode node together
//! (`testing::Cluster`): messages delivered out of order, dropped and duplicated, writes landing
//! late or failing, steps failing, clients aborting, the clock jumping, and each machine's timers
//! fired in the order the input says. A leading byte picks the step mode and the decode pool's size (12 to 39
//! pages), the next the prefill pool's (6 to 23: small enough that the prefill node preempts,
//! as in `core/tests/pd_cluster.rs`).
//! After every action: every machine's invariants. Then the faults stop, everything runs to its
//! end, and: every request ended; one that finished passed on exactly its output alone, one that
//! failed a prefix of it; no page, pin, slot or transfer is held on either worker.

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
    StepPrefill,
    StepDecode,
    FailStep(u8),
    Advance(u8),
    Abort(u8),
    RouterTimers,
    PrefillTimers,
    DecodeTimers,
    LinkDown(u8),
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
            Op::StepPrefill => ClusterOp::StepPrefill,
            Op::StepDecode => ClusterOp::StepDecode,
            Op::FailStep(which) => ClusterOp::FailStep(which),
            Op::Advance(ms) => ClusterOp::Advance(ms),
            Op::Abort(i) => ClusterOp::Abort(i),
            Op::RouterTimers => ClusterOp::RouterTimers,
            Op::PrefillTimers => ClusterOp::PrefillTimers,
            Op::DecodeTimers => ClusterOp::DecodeTimers,
            Op::LinkDown(which) => ClusterOp::LinkDown(which),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [setup, prefill_setup, rest @ ..] = data else { return };
    let mode = if setup & 1 == 1 { StepMode::Overlap } else { StepMode::Sync };
    let pages = 12 + u32::from(setup >> 1) % 28;
    let prefill_pages = 6 + u32::from(*prefill_setup) % 18;
    let mut input = Unstructured::new(rest);
    let sched = small_config(mode, pages);
    let config = ClusterConfig {
        prefill_sched: small_config(mode, prefill_pages),
        ..ClusterConfig::new(sched.clone())
    };
    let mut cluster = Cluster::new(config);
    for _ in 0..400 {
        if input.is_empty() {
            break;
        }
        let Ok(op) = Op::arbitrary(&mut input) else { break };
        cluster.apply(&op.into());
    }
    cluster.run_until_done(20_000);
    cluster.check_outcomes(&sched, &cluster.submitted());
});
