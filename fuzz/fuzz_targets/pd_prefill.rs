//! Arbitrary message, computation and write-completion sequences into the prefill side of the
//! transfer protocol: no panic, invariants after every input, one terminal output per transfer,
//! no write issued for a transfer after its end, and no transfer or pin left once every deadline
//! has passed (nothing wedges).

#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::Time;
use lockstep_core::kv::{PagePool, PoolConfig};
use lockstep_core::pd::{PrefillConfig, PrefillOutput, PrefillSide, Sampled};
use lockstep_core::sched::RequestId;
use lockstep_core::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Incarnation, Message, PageSlot, RequestSpec,
    TransferId, TransferKey, WorkerId,
};

const ME: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };

#[derive(Arbitrary, Debug)]
enum Op {
    Prepare { sender: u8, transfer: u8, prompt_len: u8, cached_pages: u8, pages: u8 },
    Grant { sender: u8, transfer: u8, seq: u8, lease_ms: u8 },
    DoneAck { sender: u8, transfer: u8 },
    Abort { sender: u8, transfer: u8 },
    Computed { transfer: u8, sources: u8 },
    ComputeFailed { transfer: u8 },
    ComputeProgress,
    Completion { transfer: u8, ordinal: u8, landed: bool },
    Advance(u8),
}

fn decode(sender: u8) -> Endpoint {
    Endpoint { worker: WorkerId(2), incarnation: Incarnation(1 + u64::from(sender % 2)) }
}

fn key(transfer: u8) -> TransferKey {
    TransferKey { transfer: TransferId(u64::from(transfer % 5)), epoch: Epoch(0) }
}

fuzz_target!(|ops: Vec<Op>| {
    let config = PrefillConfig {
        heartbeat_interval: Duration::from_millis(20),
        write_flight_max: Duration::from_millis(10),
        transfer_deadline: Duration::from_millis(300),
        done_retransmit: Duration::from_millis(40),
        transfers_max: 3,
    };
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 16, page_tokens: 4, pins_max: 32 }).expect("valid");
    let sources: Vec<_> = (0..8).map(|_| pool.allocate().expect("room")).collect();
    let mut side = PrefillSide::new(ME, config);
    let mut now = Time::ZERO;
    let mut terminals: BTreeMap<TransferKey, u32> = BTreeMap::new();
    let mut ended: BTreeSet<TransferKey> = BTreeSet::new();
    for op in ops.into_iter().take(400) {
        match op {
            Op::Prepare { sender, transfer, prompt_len, cached_pages, pages } => {
                let prompt_len = u32::from(prompt_len % 30);
                let request =
                    RequestSpec::new(RequestId(u64::from(transfer)), (0..prompt_len).collect(), 2);
                let pages = (0..u32::from(pages % 9))
                    .map(|index| PageSlot { index, generation: 0 })
                    .collect();
                let body = Message::Prepare {
                    key: key(transfer),
                    request,
                    cached_tokens: u32::from(cached_pages % 4) * 4,
                    page_tokens: 4,
                    pages,
                    lease_ms: 50,
                };
                side.handle_envelope(
                    Envelope { from: decode(sender), to: ME, body },
                    &mut pool,
                    now,
                );
            }
            Op::Grant { sender, transfer, seq, lease_ms } => {
                let body = Message::LeaseGrant {
                    key: key(transfer),
                    seq: u32::from(seq % 8),
                    lease_ms: u32::from(lease_ms),
                };
                side.handle_envelope(
                    Envelope { from: decode(sender), to: ME, body },
                    &mut pool,
                    now,
                );
            }
            Op::DoneAck { sender, transfer } => {
                let body = Message::DoneAck { key: key(transfer) };
                side.handle_envelope(
                    Envelope { from: decode(sender), to: ME, body },
                    &mut pool,
                    now,
                );
            }
            Op::Abort { sender, transfer } => {
                let body = Message::Abort { key: key(transfer), reason: AbortReason::Client };
                side.handle_envelope(
                    Envelope { from: decode(sender), to: ME, body },
                    &mut pool,
                    now,
                );
            }
            Op::Computed { transfer, sources: n } => {
                let n = usize::from(n) % (sources.len() + 1);
                side.handle_computed(
                    key(transfer),
                    Sampled::token(7),
                    &sources[..n],
                    &mut pool,
                    now,
                );
            }
            Op::ComputeFailed { transfer } => {
                side.handle_compute_failed(key(transfer), &mut pool, now)
            }
            Op::ComputeProgress => side.handle_compute_progress(now),
            Op::Completion { transfer, ordinal, landed } => {
                side.handle_write_completion(
                    key(transfer),
                    u32::from(ordinal % 9),
                    landed,
                    &mut pool,
                    now,
                );
            }
            Op::Advance(ms) => {
                now = now.saturating_add(Duration::from_millis(u64::from(ms)));
                side.handle_timeout(&mut pool, now);
            }
        }
        side.check_invariants(&pool).unwrap_or_else(|e| panic!("{e}"));
        pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        while let Some(output) = side.poll_output() {
            match output {
                PrefillOutput::Ended { key, .. } => {
                    *terminals.entry(key).or_default() += 1;
                    ended.insert(key);
                }
                PrefillOutput::Compute { key, .. } => {
                    // A transfer id may start again once forgotten; its new life is tracked anew.
                    ended.remove(&key);
                    terminals.remove(&key);
                }
                PrefillOutput::Write { key, .. } => {
                    assert!(!ended.contains(&key), "a write for {key:?} after its end")
                }
                PrefillOutput::Send(_) | PrefillOutput::Cancel { .. } => {}
            }
        }
        for (key, count) in &terminals {
            assert!(*count <= 1, "transfer {key:?} reached {count} terminal outputs");
        }
    }
    // Past every deadline and write flight, nothing is left: no wedge, no pin.
    for _ in 0..3 {
        now = now.saturating_add(Duration::from_secs(1));
        side.handle_timeout(&mut pool, now);
    }
    assert_eq!(side.transfers_live(), 0, "a transfer wedged");
    assert_eq!(pool.pins_live_count(), 0, "a source page stayed pinned");
});
