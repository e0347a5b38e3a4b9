//! Arbitrary submits, aborts, outcomes and token streams (from the right worker or not, for live
//! or stale transfers, in order or with gaps and duplicates), worker restarts, links down and up,
//! and time into the router: no panic, invariants after every input, each request `Decoding` at
//! most once and then ended at most once (`Finished` only after `Decoding`), tokens only while
//! decoding, transfer ids strictly increasing, and nothing left in transfer, decoding or queued
//! once every timeout has passed.

#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::Time;
use lockstep_core::pd::{Router, RouterConfig, RouterOutput};
use lockstep_core::sched::{FinishReason, RequestId};
use lockstep_core::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Incarnation, Message, RequestSpec, Role, TransferId,
    TransferKey, WorkerId,
};

const ME: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) };

#[derive(Arbitrary, Debug)]
enum Op {
    Submit(u8),
    Abort(u8),
    Outcome { worker: u8, incarnation: u8, transfer: u8, epoch: u8, failed: bool },
    Live { worker: u8, incarnation: u8, transfer: u8 },
    Restart { worker: u8, incarnation: u8 },
    Tokens { worker: u8, incarnation: u8, transfer: u8, index: u8, count: u8, finish: bool },
    Down { worker: u8 },
    Up { worker: u8, incarnation: u8, places: u8 },
    Advance(u8),
}

/// What the router said of a request so far.
#[derive(Default)]
struct Seen {
    decoding: bool,
    ended: bool,
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
    let mut seen: BTreeMap<RequestId, Seen> = BTreeMap::new();
    let mut last_transfer = 0u64;
    let mut reserved: Vec<TransferKey> = Vec::new();
    for op in ops.into_iter().take(400) {
        match op {
            Op::Submit(id) => {
                let request = RequestSpec::new(RequestId(u64::from(id % 16)), vec![1, 2, 3], 2);
                if router.submit(request.clone(), now).is_ok() {
                    seen.insert(request.id, Seen::default());
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
            Op::Live { worker, incarnation, transfer } => {
                let key = reserved.get(usize::from(transfer) % reserved.len().max(1)).copied();
                let key = key.unwrap_or(TransferKey {
                    transfer: TransferId(u64::from(transfer)),
                    epoch: Epoch(0),
                });
                let body = Message::TransferLive { key };
                router.handle_envelope(
                    Envelope { from: endpoint(worker, incarnation), to: ME, body },
                    now,
                );
            }
            Op::Restart { worker, incarnation } => {
                router.handle_worker_restart(endpoint(worker, incarnation), now)
            }
            Op::Tokens { worker, incarnation, transfer, index, count, finish } => {
                let key = reserved.get(usize::from(transfer) % reserved.len().max(1)).copied();
                let key = key.unwrap_or(TransferKey {
                    transfer: TransferId(u64::from(transfer)),
                    epoch: Epoch(0),
                });
                // The request the transfer was for is not known here: any of the 16 ids.
                let request = RequestId(u64::from(transfer % 16));
                let body = Message::Tokens {
                    key,
                    request,
                    index: u32::from(index % 8),
                    tokens: (0..u32::from(count % 5)).collect(),
                    logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    finish: finish.then_some(FinishReason::Length),
                };
                router.handle_envelope(
                    Envelope { from: endpoint(worker, incarnation), to: ME, body },
                    now,
                );
            }
            Op::Down { worker } => router.handle_worker_down(endpoint(worker, 0).worker, now),
            Op::Up { worker, incarnation, places } => {
                let role = if worker % 3 == 0 { Role::Prefill } else { Role::Decode };
                router.handle_worker_up(endpoint(worker, incarnation), role, u32::from(places), now)
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
                RouterOutput::Decoding { request, .. } => {
                    let s = seen.entry(request).or_default();
                    assert!(!s.decoding && !s.ended, "{request} decoding twice, or after its end");
                    s.decoding = true;
                }
                RouterOutput::Tokens { request, .. } => {
                    let s = seen.entry(request).or_default();
                    assert!(s.decoding && !s.ended, "{request}: tokens while not decoding");
                }
                RouterOutput::Finished { request, .. } => {
                    let s = seen.entry(request).or_default();
                    assert!(
                        s.decoding && !s.ended,
                        "{request} finished without decoding, or twice"
                    );
                    s.ended = true;
                }
                RouterOutput::Failed { request, .. } => {
                    let s = seen.entry(request).or_default();
                    assert!(!s.ended, "{request} ended twice");
                    s.ended = true;
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
    assert_eq!(router.requests_decoding(), 0, "a request stayed decoding past its idle timeout");
    assert_eq!(router.requests_queued(), 0, "a request stayed queued past its deadline");
});
