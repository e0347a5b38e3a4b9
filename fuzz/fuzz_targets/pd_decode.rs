//! Arbitrary message sequences into the decode side of the transfer protocol, from the router,
//! the prefill side, a restarted prefill side and strangers, with time passing: no panic,
//! invariants after every input, one terminal output per transfer, and once every lease has run
//! out, every page back in the pool.

#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::Time;
use lockstep_core::kv::{PagePool, PoolConfig};
use lockstep_core::pd::{DecodeConfig, DecodeOutput, DecodeSide};
use lockstep_core::sched::RequestId;
use lockstep_core::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Incarnation, Message, RequestSpec, TransferId,
    TransferKey, WorkerId,
};

const ME: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };

#[derive(Arbitrary, Debug)]
enum Op {
    Reserve { transfer: u8, epoch: u8, prompt_len: u8, prefill_incarnation: u8 },
    Heartbeat { sender: u8, transfer: u8, epoch: u8, seq: u8 },
    Done { sender: u8, transfer: u8, epoch: u8, pages_written: u8 },
    Abort { sender: u8, transfer: u8, epoch: u8 },
    AbortAck { sender: u8, transfer: u8, epoch: u8 },
    Advance(u8),
}

fn endpoint(sender: u8) -> Endpoint {
    // Router, prefill incarnations 1 to 3, another worker.
    match sender % 5 {
        0 => Endpoint { worker: WorkerId(0), incarnation: Incarnation(1) },
        4 => Endpoint { worker: WorkerId(9), incarnation: Incarnation(1) },
        n => Endpoint { worker: WorkerId(1), incarnation: Incarnation(u64::from(n)) },
    }
}

fn key(transfer: u8, epoch: u8) -> TransferKey {
    TransferKey {
        transfer: TransferId(u64::from(transfer % 6)),
        epoch: Epoch(u32::from(epoch % 2)),
    }
}

fn spec(id: u8, prompt_len: u8) -> RequestSpec {
    RequestSpec::new(
        RequestId(u64::from(id)),
        (0..u32::from(prompt_len % 24)).map(|t| t % 5).collect(),
        4,
    )
}

fuzz_target!(|ops: Vec<Op>| {
    let config = DecodeConfig {
        lease: Duration::from_millis(50),
        write_flight_max: Duration::from_millis(10),
        transfers_max: 4,
        prefix_cache: true,
        live_report_interval: Duration::from_millis(100),
    };
    let mut pool =
        PagePool::new(PoolConfig { pages_total: 12, page_tokens: 4, pins_max: 12 }).expect("valid");
    let mut side = DecodeSide::new(ME, config);
    let mut now = Time::ZERO;
    let mut terminals: BTreeMap<TransferKey, u32> = BTreeMap::new();
    let mut ready_pages = Vec::new();
    for op in ops.into_iter().take(400) {
        let (from, body) = match op {
            Op::Reserve { transfer, epoch, prompt_len, prefill_incarnation } => {
                let prefill = endpoint(1 + prefill_incarnation % 3);
                (
                    endpoint(0),
                    Message::Reserve {
                        key: key(transfer, epoch),
                        request: spec(transfer, prompt_len),
                        prefill,
                    },
                )
            }
            Op::Heartbeat { sender, transfer, epoch, seq } => (
                endpoint(sender),
                Message::Heartbeat { key: key(transfer, epoch), seq: u32::from(seq), progress: 0 },
            ),
            Op::Done { sender, transfer, epoch, pages_written } => (
                endpoint(sender),
                Message::Done {
                    key: key(transfer, epoch),
                    first_token: 1,
                    pages_written: u32::from(pages_written % 8),
                    first_logprobs: None,
                    prompt_logprobs: Vec::new(),
                },
            ),
            Op::Abort { sender, transfer, epoch } => (
                endpoint(sender),
                Message::Abort { key: key(transfer, epoch), reason: AbortReason::Client },
            ),
            Op::AbortAck { sender, transfer, epoch } => {
                (endpoint(sender), Message::AbortAck { key: key(transfer, epoch) })
            }
            Op::Advance(ms) => {
                now = now.saturating_add(Duration::from_millis(u64::from(ms)));
                side.handle_timeout(&mut pool, now);
                pool.handle_timeout(now);
                (endpoint(4), Message::AbortAck { key: key(0, 0) })
            }
        };
        side.handle_envelope(Envelope { from, to: ME, body }, &mut pool, now);
        side.check_invariants(&pool).unwrap_or_else(|e| panic!("{e}"));
        pool.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        while let Some(output) = side.poll_output() {
            match output {
                DecodeOutput::Ready { key, pages, .. } => {
                    *terminals.entry(key).or_default() += 1;
                    ready_pages.extend(pages);
                }
                DecodeOutput::Ended { key, .. } => *terminals.entry(key).or_default() += 1,
                DecodeOutput::Send(_) => {}
            }
        }
    }
    for (key, count) in &terminals {
        assert_eq!(*count, 1, "transfer {key:?} reached {count} terminal outputs");
    }
    // Past every lease, nothing is held but what went to the scheduler.
    now = now.saturating_add(Duration::from_secs(10));
    side.handle_timeout(&mut pool, now);
    pool.handle_timeout(now);
    assert_eq!(side.transfers_live(), 0);
    for page in ready_pages {
        pool.release(page).expect("pages handed to the scheduler are live");
    }
    pool.check_invariants().expect("invariants at the end");
    assert_eq!(pool.available_count(), pool.pages_total(), "pages leaked");
});
