//! Arbitrary submits, aborts, outcomes (from the right worker or not, for live or stale
//! transfers), worker restarts and time into the router: no panic, invariants after every input,
//! one end per request, transfer ids strictly increasing, and nothing left in transfer once every
//! timeout has passed.

#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::Time;
use lockstep_core::pd::{Router, RouterConfig, RouterOutput};
use lockstep_core::sched::RequestId;
use lockstep_core::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Incarnation, Message, RequestSpec, TransferId,
    TransferKey, WorkerId,
};

const ME: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };

#[derive(Arbitrary, Debug)]
enum Op {
    Submit(u8),
    Abort(u8),
    Outcome { worker: u8, incarnation: u8, transfer: u8, epoch: u8, failed: bool },
    Restart { worker: u8, incarnation: u8 },
    Advance(u8),
}

fn endpoint(worker: u8, incarnation: u8) -> Endpoint {
    Endpoint {
        worker: WorkerId(1 + u32::from(worker % 3)),
        incarnation: Incarnation(1 + u64::from(incarnation % 3)),
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let config = RouterConfig {
        outcome_timeout: Duration::from_millis(100),
        requests_max: 4,
        retries_max: 2,
        decode_idle_timeout: Duration::from_millis(300),
        decode_slots: 2,
        prefill_slots: 8,
        queue_wait_max: Duration::from_millis(400),
        busy_backoff: Duration::from_millis(5),
    };
    let mut router =
        Router::new(ME, config, vec![endpoint(0, 0)], vec![endpoint(1, 0), endpoint(2, 0)]);
    let mut now = Time::ZERO;
    let mut ends: BTreeMap<RequestId, u32> = BTreeMap::new();
    let mut last_transfer = 0u64;
    let mut reserved: Vec<TransferKey> = Vec::new();
    for op in ops.into_iter().take(400) {
        match op {
            Op::Submit(id) => {
                let request = RequestSpec::new(RequestId(u64::from(id % 16)), vec![1, 2, 3], 2);
                if router.submit(request.clone(), now).is_ok() {
                    ends.remove(&request.id);
                }
            }
            Op::Abort(id) => {
                let _ = router.abort(RequestId(u64::from(id % 16)), now);
            }
            Op::Outcome { worker, incarnation, transfer, epoch, failed } => {
                let key = reserved
                    .get(usize::from(transfer) % reserved.len().max(1))
                    .copied()
                    .map(|k| {
                        if epoch % 4 == 0 {
                            TransferKey { epoch: Epoch(u32::from(epoch)), ..k }
                        } else {
                            k
                        }
                    })
                    .unwrap_or(TransferKey {
                        transfer: TransferId(u64::from(transfer)),
                        epoch: Epoch(0),
                    });
                let failure = failed.then_some(AbortReason::DecodeFailed);
                let body = Message::Outcome { key, failure };
                router.handle_envelope(
                    Envelope { from: endpoint(worker, incarnation), to: ME, body },
                    now,
                );
            }
            Op::Restart { worker, incarnation } => {
                router.handle_worker_restart(endpoint(worker, incarnation), now)
            }
            Op::Advance(ms) => {
                now = now.saturating_add(Duration::from_millis(u64::from(ms)));
                router.handle_timeout(now);
            }
        }
        router.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        while let Some(output) = router.poll_output() {
            match output {
                RouterOutput::Send(Envelope { body: Message::Reserve { key, .. }, .. }) => {
                    assert!(
                        key.transfer.0 > last_transfer,
                        "transfer id {key:?} not above {last_transfer}"
                    );
                    last_transfer = key.transfer.0;
                    reserved.push(key);
                }
                RouterOutput::Send(_) => {}
                RouterOutput::Decoding { request, .. } | RouterOutput::Failed { request, .. } => {
                    let count = ends.entry(request).or_default();
                    *count += 1;
                    assert_eq!(*count, 1, "{request} ended twice");
                }
            }
        }
    }
    for _ in 0..4 {
        now = now.saturating_add(Duration::from_secs(1));
        router.handle_timeout(now);
        while router.poll_output().is_some() {}
    }
    assert_eq!(router.requests_in_transfer(), 0, "a request stayed in transfer past every timeout");
});
