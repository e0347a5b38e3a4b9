//! The router against scripted workers.

use super::*;
use crate::wire::{Incarnation, WorkerId};

const ME: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(3) };
const P1: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const D1: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const D2: Endpoint = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };

fn router(retries_max: u32) -> Router {
    let config =
        RouterConfig { outcome_timeout: Duration::from_millis(500), requests_max: 2, retries_max };
    Router::new(ME, config, vec![P1], vec![D1, D2])
}

fn spec(id: u64) -> RequestSpec {
    RequestSpec::new(RequestId(id), vec![1, 2, 3], 4)
}

fn drain(r: &mut Router) -> Vec<RouterOutput> {
    r.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    std::iter::from_fn(|| r.poll_output()).collect()
}

fn reserve_to(out: &[RouterOutput]) -> Vec<(Endpoint, TransferKey)> {
    out.iter()
        .filter_map(|o| match o {
            RouterOutput::Send(Envelope { to, body: Message::Reserve { key, .. }, .. }) => {
                Some((*to, *key))
            }
            _ => None,
        })
        .collect()
}

fn outcome(from: Endpoint, key: TransferKey, failure: Option<AbortReason>) -> Envelope {
    Envelope { from, to: ME, body: Message::Outcome { key, failure } }
}

#[test]
fn requests_spread_over_decode_workers_and_end_once() {
    let mut r = router(0);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    let k2 = r.submit(spec(2), Time::ZERO).unwrap();
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out), vec![(D1, k1), (D2, k2)], "the least loaded decode worker first");
    assert_eq!(r.submit(spec(3), Time::ZERO), Err(RouterError::Busy));
    assert_eq!(r.submit(spec(1), Time::ZERO), Err(RouterError::DuplicateRequest(RequestId(1))));
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Decoding { request: RequestId(1), key: k1, decode: D1 }]
    );
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    assert!(drain(&mut r).is_empty(), "a duplicate Outcome ends nothing twice");
}

#[test]
fn ids_are_never_reused_and_belong_to_the_incarnation() {
    let mut r = router(0);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    let k2 = r.submit(spec(1), Time::ZERO).unwrap();
    assert!(k2.transfer > k1.transfer);
    assert_eq!(k1.transfer.0 >> 40, 3);
    let reborn = Router::new(
        Endpoint { incarnation: Incarnation(4), ..ME },
        r.config.clone(),
        vec![P1],
        vec![D1],
    );
    assert!(
        reborn.next_transfer > k2.transfer.0,
        "a restarted router starts above every id of its past"
    );
}

#[test]
fn a_failed_transfer_is_retried_as_a_new_one_elsewhere() {
    let mut r = router(1);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    drain(&mut r);
    r.handle_envelope(outcome(D1, k1, Some(AbortReason::DecodeFailed)), Time::ZERO);
    let out = drain(&mut r);
    let retry = reserve_to(&out);
    assert_eq!(retry.len(), 1);
    assert_eq!(retry[0].0, D2, "the retry prefers another worker");
    assert!(retry[0].1.transfer > k1.transfer);
    assert_eq!(retry[0].1.epoch, Epoch(1));
    r.handle_envelope(outcome(D2, retry[0].1, Some(AbortReason::Timeout)), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Timeout }]
    );
}

#[test]
fn silence_ends_in_a_timeout_and_an_abort_to_the_decode_side() {
    let mut r = router(0);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    drain(&mut r);
    assert_eq!(r.next_timeout(), Some(Time::from_millis(500)));
    r.handle_timeout(Time::from_millis(499));
    assert!(drain(&mut r).is_empty());
    r.handle_timeout(Time::from_millis(500));
    let out = drain(&mut r);
    assert!(out.contains(&RouterOutput::Send(Envelope {
        from: ME,
        to: D1,
        body: Message::Abort { key: k1, reason: AbortReason::Router }
    })));
    assert!(
        out.contains(&RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Timeout })
    );
    r.handle_envelope(outcome(D1, k1, None), Time::from_millis(600));
    assert!(drain(&mut r).is_empty(), "a late Outcome for a transfer given up on is ignored");
}

#[test]
fn a_client_abort_ends_the_request_at_once_and_tells_the_decode_side() {
    let mut r = router(3);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    drain(&mut r);
    r.abort(RequestId(1), Time::ZERO).unwrap();
    let out = drain(&mut r);
    assert!(
        out.contains(&RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Client })
    );
    assert!(out.contains(&RouterOutput::Send(Envelope {
        from: ME,
        to: D1,
        body: Message::Abort { key: k1, reason: AbortReason::Client }
    })));
    assert_eq!(r.abort(RequestId(1), Time::ZERO), Err(RouterError::UnknownRequest(RequestId(1))));
    r.handle_envelope(outcome(D1, k1, Some(AbortReason::Client)), Time::ZERO);
    assert!(drain(&mut r).is_empty(), "no retry, no second end");
}

#[test]
fn a_restarted_decode_worker_loses_its_transfers_to_a_retry() {
    let mut r = router(1);
    let k1 = r.submit(spec(1), Time::ZERO).unwrap();
    drain(&mut r);
    let reborn = Endpoint { incarnation: Incarnation(2), ..D1 };
    r.handle_worker_restart(reborn, Time::ZERO);
    let out = drain(&mut r);
    let retry = reserve_to(&out);
    assert_eq!(retry.len(), 1);
    assert_ne!(retry[0].1, k1);
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    assert!(drain(&mut r).is_empty(), "the old incarnation's outcome is ignored");
    // By hand: a request mapped to a transfer that is gone.
    r.transfers.clear();
    assert!(r.check_invariants().is_err());
}
