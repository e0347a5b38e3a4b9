//! The router against scripted workers.

use super::*;
use crate::model::TokenLogprobs;
use crate::wire::{Incarnation, WorkerId};

const ME: Endpoint = Endpoint { worker: WorkerId(0), incarnation: Incarnation(3) };
const P1: Endpoint = Endpoint { worker: WorkerId(1), incarnation: Incarnation(1) };
const D1: Endpoint = Endpoint { worker: WorkerId(2), incarnation: Incarnation(1) };
const D2: Endpoint = Endpoint { worker: WorkerId(3), incarnation: Incarnation(1) };

fn router(retries_max: u32) -> Router {
    let config = RouterConfig {
        outcome_timeout: Duration::from_millis(500),
        requests_max: 2,
        retries_max,
        decode_idle_timeout: Duration::from_secs(5),
        decode_slots: 8,
        prefill_slots: 8,
        queue_wait_max: Duration::from_secs(5),
        busy_backoff: Duration::from_millis(5),
    };
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
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
    r.submit(spec(2), Time::ZERO).unwrap();
    let k2 = r.transfer_of(RequestId(2)).unwrap();
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
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    let finish = Some(FinishReason::Length);
    let tokens = Message::Tokens {
        key: k1,
        request: RequestId(1),
        index: 0,
        tokens: vec![5],
        logprobs: vec![],
        prompt_logprobs: vec![],
        finish,
    };
    r.handle_envelope(Envelope { from: D1, to: ME, body: tokens }, Time::ZERO);
    r.submit(spec(1), Time::ZERO).unwrap();
    let k2 = r.transfer_of(RequestId(1)).unwrap();
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
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
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
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
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

/// A long prompt: its decode worker reports the transfer still at work, and each report moves
/// the outcome timeout to a whole timeout from then; a report from another worker, of another
/// attempt or older than the last changes nothing. Silence after the last report still ends it.
#[test]
fn a_transfer_reported_at_work_is_given_its_timeout_again() {
    let mut r = router(0);
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    let live = |from, key| Envelope { from, to: ME, body: Message::TransferLive { key } };
    for at in [400, 800, 1_200] {
        r.handle_envelope(live(D1, k1), Time::from_millis(at));
        assert!(drain(&mut r).is_empty());
        assert_eq!(r.next_timeout(), Some(Time::from_millis(at + 500)));
        r.handle_timeout(Time::from_millis(at + 499));
        assert!(drain(&mut r).is_empty(), "given up on at {at} + 499 ms despite the report");
    }
    let other_attempt = TransferKey { epoch: Epoch(1), ..k1 };
    r.handle_envelope(live(D2, k1), Time::from_millis(1_600));
    r.handle_envelope(live(D1, other_attempt), Time::from_millis(1_600));
    r.handle_envelope(live(D1, k1), Time::from_millis(1_000));
    drain(&mut r);
    assert_eq!(r.next_timeout(), Some(Time::from_millis(1_700)), "only its own worker's reports");
    r.handle_timeout(Time::from_millis(1_700));
    assert!(
        drain(&mut r).contains(&RouterOutput::Failed {
            request: RequestId(1),
            reason: AbortReason::Timeout
        })
    );
}

#[test]
fn a_client_abort_ends_the_request_at_once_and_tells_the_decode_side() {
    let mut r = router(3);
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
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
    r.submit(spec(1), Time::ZERO).unwrap();
    let k1 = r.transfer_of(RequestId(1)).unwrap();
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

// --- after the hand-over: the token stream ---

fn tokens(
    from: Endpoint,
    key: TransferKey,
    index: u32,
    t: &[u32],
    finish: Option<FinishReason>,
) -> Envelope {
    let body = Message::Tokens {
        key,
        request: RequestId(1),
        index,
        tokens: t.to_vec(),
        logprobs: vec![],
        prompt_logprobs: vec![],
        finish,
    };
    Envelope { from, to: ME, body }
}

fn decoding_router() -> (Router, TransferKey) {
    let mut r = router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    let key = r.transfer_of(RequestId(1)).unwrap();
    r.handle_envelope(outcome(D1, key, None), Time::ZERO);
    drain(&mut r);
    (r, key)
}

fn cancel(to: Endpoint, key: TransferKey) -> RouterOutput {
    RouterOutput::Send(Envelope {
        from: ME,
        to,
        body: Message::Cancel { key, request: RequestId(1) },
    })
}

#[test]
fn log_probabilities_pass_on_with_their_tokens_each_once() {
    let (mut r, key) = decoding_router();
    let of = |token: u32| TokenLogprobs { token, logprob: -(token as f32), top: vec![(1, -0.5)] };
    let with_logprobs = |index, t: &[u32]| {
        let mut envelope = tokens(D1, key, index, t, None);
        if let Message::Tokens { logprobs, .. } = &mut envelope.body {
            *logprobs = t.iter().map(|&t| of(t)).collect();
        }
        envelope
    };
    r.handle_envelope(with_logprobs(0, &[7, 8]), Time::ZERO);
    let passed = |tokens: Vec<u32>| {
        let logprobs = tokens.iter().map(|&t| of(t)).collect();
        vec![RouterOutput::Tokens {
            request: RequestId(1),
            tokens,
            logprobs,
            prompt_logprobs: vec![],
        }]
    };
    assert_eq!(drain(&mut r), passed(vec![7, 8]));
    // A copy overlapping what passed: the new token goes on with its own log-probabilities.
    r.handle_envelope(with_logprobs(1, &[8, 9]), Time::ZERO);
    assert_eq!(drain(&mut r), passed(vec![9]));
}

#[test]
fn tokens_pass_on_in_order_once_and_the_finish_ends_the_request() {
    let (mut r, key) = decoding_router();
    r.handle_envelope(tokens(D1, key, 0, &[7, 8], None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Tokens {
            request: RequestId(1),
            tokens: vec![7, 8],
            logprobs: vec![],
            prompt_logprobs: vec![]
        }]
    );
    // A duplicate of what passed, with one more: only the new token goes on.
    r.handle_envelope(tokens(D1, key, 0, &[7, 8, 9], None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Tokens {
            request: RequestId(1),
            tokens: vec![9],
            logprobs: vec![],
            prompt_logprobs: vec![]
        }]
    );
    r.handle_envelope(tokens(D1, key, 3, &[4], Some(FinishReason::Length)), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![
            RouterOutput::Tokens {
                request: RequestId(1),
                tokens: vec![4],
                logprobs: vec![],
                prompt_logprobs: vec![]
            },
            RouterOutput::Finished { request: RequestId(1), reason: FinishReason::Length }
        ]
    );
    assert_eq!(r.requests_decoding(), 0);
    // A late copy of the stream is told to stop, and ends nothing twice.
    r.handle_envelope(tokens(D1, key, 1, &[8], None), Time::ZERO);
    assert_eq!(drain(&mut r), vec![cancel(D1, key)]);
}

#[test]
fn tokens_that_overtake_the_outcome_prove_the_hand_over() {
    let mut r = router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    let key = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    r.handle_envelope(tokens(D1, key, 0, &[7], None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![
            RouterOutput::Decoding { request: RequestId(1), key, decode: D1 },
            RouterOutput::Tokens {
                request: RequestId(1),
                tokens: vec![7],
                logprobs: vec![],
                prompt_logprobs: vec![]
            }
        ]
    );
    r.handle_envelope(outcome(D1, key, None), Time::ZERO);
    assert!(drain(&mut r).is_empty(), "the late Outcome starts nothing twice");
}

/// The incident's shape: the success message is lost, the router retries elsewhere, and the first
/// decode worker decodes anyway. Its tokens never reach the client, and it is told to stop.
#[test]
fn a_retried_request_is_never_decoded_twice_for_the_client() {
    let mut r = router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    let first = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    r.handle_timeout(Time::from_millis(500));
    let out = drain(&mut r);
    let retry = reserve_to(&out);
    assert_eq!(retry.len(), 1);
    let (to, second) = retry[0];
    assert_eq!(to, D2, "the retry goes to the other decode worker");
    r.handle_envelope(tokens(D1, first, 0, &[7, 8], None), Time::from_millis(501));
    assert_eq!(drain(&mut r), vec![cancel(D1, first)]);
    r.handle_envelope(outcome(D2, second, None), Time::from_millis(502));
    r.handle_envelope(tokens(D2, second, 0, &[7], None), Time::from_millis(502));
    let out = drain(&mut r);
    assert_eq!(
        out.last(),
        Some(&RouterOutput::Tokens {
            request: RequestId(1),
            tokens: vec![7],
            logprobs: vec![],
            prompt_logprobs: vec![]
        })
    );
    r.handle_envelope(tokens(D1, first, 2, &[9], None), Time::from_millis(503));
    assert_eq!(drain(&mut r), vec![cancel(D1, first)]);
}

#[test]
fn a_gap_in_the_stream_fails_the_request_and_stops_the_worker() {
    let (mut r, key) = decoding_router();
    r.handle_envelope(tokens(D1, key, 2, &[9], None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![
            cancel(D1, key),
            RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Router }
        ]
    );
}

#[test]
fn silence_while_decoding_fails_the_request() {
    let (mut r, key) = decoding_router();
    r.handle_envelope(tokens(D1, key, 0, &[7], None), Time::from_millis(1_000));
    drain(&mut r);
    assert_eq!(r.next_timeout(), Some(Time::from_millis(6_000)));
    r.handle_timeout(Time::from_millis(5_999));
    assert!(drain(&mut r).is_empty());
    r.handle_timeout(Time::from_millis(6_000));
    assert_eq!(
        drain(&mut r),
        vec![
            cancel(D1, key),
            RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Timeout }
        ]
    );
}

#[test]
fn a_client_abort_while_decoding_reaches_the_decode_worker() {
    let (mut r, key) = decoding_router();
    r.abort(RequestId(1), Time::ZERO).unwrap();
    assert_eq!(
        drain(&mut r),
        vec![
            cancel(D1, key),
            RouterOutput::Failed { request: RequestId(1), reason: AbortReason::Client }
        ]
    );
    assert_eq!(r.abort(RequestId(1), Time::ZERO), Err(RouterError::UnknownRequest(RequestId(1))));
}

#[test]
fn a_worker_lost_fails_what_decodes_there_and_retries_what_transfers_through_it() {
    let (mut r, _) = decoding_router();
    r.submit(spec(2), Time::ZERO).unwrap();
    let second = r.transfer_of(RequestId(2)).unwrap();
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out), vec![(D2, second)]);
    r.handle_worker_down(D1.worker, Time::ZERO);
    let out = drain(&mut r);
    assert!(out.contains(&RouterOutput::Failed {
        request: RequestId(1),
        reason: AbortReason::PeerRestarted
    }));
    assert_eq!(r.requests_in_transfer(), 1, "request 2 goes on: it does not use D1");
    r.handle_worker_down(D2.worker, Time::ZERO);
    let out = drain(&mut r);
    assert!(out.contains(&RouterOutput::Failed {
        request: RequestId(2),
        reason: AbortReason::PeerRestarted
    }));
    assert_eq!(r.requests_queued() + r.requests_in_transfer(), 0);
}

// --- waiting at the router ---

fn small_router(decode_slots: u32) -> Router {
    let config = RouterConfig {
        outcome_timeout: Duration::from_millis(500),
        requests_max: 4,
        retries_max: 0,
        decode_idle_timeout: Duration::from_secs(5),
        decode_slots,
        prefill_slots: 8,
        queue_wait_max: Duration::from_millis(100),
        busy_backoff: Duration::from_millis(5),
    };
    Router::new(ME, config, vec![P1], vec![D1])
}

#[test]
fn requests_beyond_the_decode_workers_room_wait_and_go_when_one_ends() {
    let mut r = small_router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    r.submit(spec(2), Time::ZERO).unwrap();
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out).len(), 1);
    assert_eq!((r.requests_in_transfer(), r.requests_queued()), (1, 1));
    let duplicate = |id| Err(RouterError::DuplicateRequest(RequestId(id)));
    assert_eq!(r.submit(spec(2), Time::ZERO), duplicate(2), "a queued request's id");
    let k1 = r.transfer_of(RequestId(1)).unwrap();
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    assert_eq!((r.requests_decoding(), r.requests_queued()), (1, 1), "still decoding: no room");
    assert_eq!(r.submit(spec(1), Time::ZERO), duplicate(1), "a decoding request's id");
    r.handle_envelope(tokens(D1, k1, 0, &[5], Some(FinishReason::Length)), Time::from_millis(1));
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out).len(), 1, "the end made room: {out:?}");
    assert_eq!(r.requests_queued(), 0);
}

#[test]
fn requests_waiting_for_room_go_by_priority_then_in_the_order_they_came() {
    let mut r = small_router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    for (id, priority) in [(2, 5), (3, 0), (4, -5)] {
        let mut request = spec(id);
        request.priority = priority;
        r.submit(request, Time::ZERO).unwrap();
    }
    drain(&mut r);
    assert_eq!((r.requests_in_transfer(), r.requests_queued()), (1, 3));
    let mut started = Vec::new();
    let mut running = RequestId(1);
    for at in 1..=3 {
        let key = r.transfer_of(running).unwrap();
        r.handle_envelope(outcome(D1, key, None), Time::from_millis(at));
        let finish = Some(FinishReason::Length);
        let body = Message::Tokens {
            key,
            request: running,
            index: 0,
            tokens: vec![5],
            logprobs: vec![],
            prompt_logprobs: vec![],
            finish,
        };
        r.handle_envelope(Envelope { from: D1, to: ME, body }, Time::from_millis(at));
        let out = drain(&mut r);
        let reserved: Vec<RequestId> = out
            .iter()
            .filter_map(|o| match o {
                RouterOutput::Send(Envelope { body: Message::Reserve { request, .. }, .. }) => {
                    Some(request.id)
                }
                _ => None,
            })
            .collect();
        assert_eq!(reserved.len(), 1, "{out:?}");
        running = reserved[0];
        started.push(running.0);
    }
    assert_eq!(started, [4, 3, 2], "lowest priority value first");
}

#[test]
fn a_request_waits_at_most_queue_wait_max_and_a_queued_abort_ends_it() {
    let mut r = small_router(1);
    for id in 1..=3 {
        r.submit(spec(id), Time::ZERO).unwrap();
    }
    drain(&mut r);
    r.abort(RequestId(3), Time::ZERO).unwrap();
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Failed { request: RequestId(3), reason: AbortReason::Client }]
    );
    assert_eq!(r.next_timeout(), Some(Time::from_millis(100)));
    r.handle_timeout(Time::from_millis(100));
    let out = drain(&mut r);
    assert!(
        out.contains(&RouterOutput::Failed {
            request: RequestId(2),
            reason: AbortReason::QueueTimeout
        }),
        "a wait past queue_wait_max is the queue's timeout, not a transfer's: {out:?}"
    );
}

/// A worker too busy to take a request (a decode worker without a slot or pages, a prefill
/// worker without a transfer place) fails nothing: the request goes again after the back-off,
/// with its attempt.
#[test]
fn a_busy_refusal_backs_off_and_keeps_its_attempt() {
    for busy in [AbortReason::DecodeBusy, AbortReason::PrefillBusy] {
        let mut r = small_router(2);
        r.submit(spec(1), Time::ZERO).unwrap();
        let k1 = r.transfer_of(RequestId(1)).unwrap();
        drain(&mut r);
        r.handle_envelope(outcome(D1, k1, Some(busy)), Time::ZERO);
        assert!(drain(&mut r).is_empty(), "{busy:?}: not sent again before the back-off");
        assert_eq!(r.next_timeout(), Some(Time::from_millis(5)));
        r.handle_timeout(Time::from_millis(5));
        let out = drain(&mut r);
        let again = reserve_to(&out);
        assert_eq!(again.len(), 1, "{busy:?}: retries_max is 0, yet a busy worker is tried again");
        assert_eq!(again[0].1.epoch, k1.epoch, "{busy:?}: the attempt was not used up");
    }
}

/// Busy refusals cost no attempt, so nothing but the queue's deadline bounds them: that deadline
/// counts from the submission, not from the last refusal. A worker that keeps refusing (every
/// 5 ms, over a 100 ms `queue_wait_max`) fails the request at 100 ms, as if it had waited in the
/// queue all along.
#[test]
fn busy_refusals_wait_no_longer_than_queue_wait_max_in_all() {
    let mut r = small_router(2);
    r.submit(spec(1), Time::ZERO).unwrap();
    drain(&mut r);
    let mut now = Time::ZERO;
    let mut refusals = 0;
    while let Some(key) = r.transfer_of(RequestId(1)) {
        r.handle_envelope(outcome(D1, key, Some(AbortReason::PrefillBusy)), now);
        refusals += 1;
        now = r.next_timeout().expect("a back-off or the queue's deadline");
        r.handle_timeout(now);
        assert!(refusals < 100, "refused {refusals} times, still going at {now:?}");
    }
    assert_eq!(now, Time::from_millis(100));
    assert_eq!(
        drain(&mut r).last(),
        Some(&RouterOutput::Failed { request: RequestId(1), reason: AbortReason::QueueTimeout })
    );
}

#[test]
fn workers_join_when_their_links_come_up_and_leave_when_they_go_down() {
    let config = RouterConfig { retries_max: 1, ..small_router(4).config.clone() };
    let mut r = Router::new(ME, config, vec![], vec![]);
    assert_eq!(r.submit(spec(1), Time::ZERO), Err(RouterError::NoWorkers));
    r.handle_worker_up(D2, crate::wire::Role::Decode, 8, Time::ZERO);
    r.handle_worker_up(D1, crate::wire::Role::Decode, 8, Time::ZERO);
    assert_eq!(r.submit(spec(1), Time::ZERO), Err(RouterError::NoWorkers), "no prefill worker");
    r.handle_worker_up(P1, crate::wire::Role::Prefill, 8, Time::ZERO);
    assert_eq!(r.workers(), (&[P1][..], &[D1, D2][..]), "kept in id order");
    r.submit(spec(1), Time::ZERO).unwrap();
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out).len(), 1);
    r.handle_worker_down(P1.worker, Time::ZERO);
    assert_eq!(
        drain(&mut r).last(),
        Some(&RouterOutput::Failed { request: RequestId(1), reason: AbortReason::PeerRestarted }),
        "no prefill worker: nothing waits for one"
    );
    let p1_again = Endpoint { incarnation: Incarnation(2), ..P1 };
    r.handle_worker_up(p1_again, crate::wire::Role::Prefill, 8, Time::from_millis(1));
    r.submit(spec(2), Time::from_millis(1)).unwrap();
    let out = drain(&mut r);
    assert_eq!(reserve_to(&out).len(), 1, "it goes as soon as one is up: {out:?}");
}

/// A worker takes no more requests at once than its `Hello` said, though the config allows
/// more (prefill 8, decode 4 here): each process has its own command line, and a router that
/// sent more would have them refused as busy, one refusal per back-off. A restart may say
/// otherwise.
#[test]
fn a_worker_gets_no_more_requests_at_once_than_its_hello_said() {
    use crate::wire::Role::{Decode, Prefill};
    let mut r = Router::new(ME, small_router(4).config.clone(), vec![], vec![]);
    r.handle_worker_up(P1, Prefill, 1, Time::ZERO);
    r.handle_worker_up(D1, Decode, 2, Time::ZERO);
    for id in 1..=3 {
        r.submit(spec(id), Time::ZERO).unwrap();
    }
    let first = reserve_to(&drain(&mut r));
    assert_eq!(first.len(), 1, "one prompt at a time on the prefill worker");
    r.handle_envelope(outcome(D1, first[0].1, None), Time::ZERO);
    let second = reserve_to(&drain(&mut r));
    assert_eq!(second.len(), 1, "request 1 decodes: the prefill worker is free");
    r.handle_envelope(outcome(D1, second[0].1, None), Time::ZERO);
    assert!(reserve_to(&drain(&mut r)).is_empty(), "the decode worker's two places are taken");
    assert_eq!(r.requests_queued(), 1);
    let d2 = Endpoint { worker: WorkerId(4), incarnation: Incarnation(1) };
    r.handle_worker_up(d2, Decode, 2, Time::ZERO);
    assert_eq!(reserve_to(&drain(&mut r)).iter().map(|(d, _)| *d).collect::<Vec<_>>(), [d2]);

    let mut r = Router::new(ME, small_router(4).config.clone(), vec![], vec![]);
    r.handle_worker_up(P1, Prefill, 1, Time::ZERO);
    r.handle_worker_up(D1, Decode, 4, Time::ZERO);
    let p1_again = Endpoint { incarnation: Incarnation(2), ..P1 };
    r.handle_worker_up(p1_again, Prefill, 2, Time::ZERO);
    for id in 1..=3 {
        r.submit(spec(id), Time::ZERO).unwrap();
    }
    assert_eq!(reserve_to(&drain(&mut r)).len(), 2, "its new life's two places");
}

/// Found by the cluster proptest: a late duplicate wholly covered by what passed since.
#[test]
fn a_late_copy_shorter_than_what_passed_is_skipped_without_a_panic() {
    let (mut r, key) = decoding_router();
    r.handle_envelope(tokens(D1, key, 0, &[7, 8, 9], None), Time::ZERO);
    drain(&mut r);
    r.handle_envelope(tokens(D1, key, 0, &[7], None), Time::ZERO);
    assert!(drain(&mut r).is_empty());
}

#[test]
fn a_prefill_worker_computes_at_most_prefill_slots_prompts_and_the_rest_wait() {
    let config = RouterConfig { prefill_slots: 1, ..small_router(4).config.clone() };
    let mut r = Router::new(ME, config, vec![P1], vec![D1]);
    r.submit(spec(1), Time::ZERO).unwrap();
    r.submit(spec(2), Time::ZERO).unwrap();
    assert_eq!(reserve_to(&drain(&mut r)).len(), 1);
    assert_eq!(r.requests_queued(), 1, "the prefill worker is busy: request 2 waits");
    let k1 = r.transfer_of(RequestId(1)).unwrap();
    r.handle_envelope(outcome(D1, k1, None), Time::ZERO);
    assert_eq!(
        reserve_to(&drain(&mut r)).len(),
        1,
        "request 1 decodes: the prefill worker is free"
    );
}

/// Prompts spread over the prefill workers as requests do over the decode workers: each goes to
/// the least loaded.
#[test]
fn prompts_spread_over_prefill_workers() {
    let p2 = Endpoint { worker: WorkerId(4), incarnation: Incarnation(1) };
    let mut r = Router::new(ME, small_router(4).config.clone(), vec![P1, p2], vec![D1]);
    for id in 1..=2 {
        r.submit(spec(id), Time::ZERO).unwrap();
    }
    let prefills: Vec<Endpoint> = drain(&mut r)
        .iter()
        .filter_map(|o| match o {
            RouterOutput::Send(Envelope { body: Message::Reserve { prefill, .. }, .. }) => {
                Some(*prefill)
            }
            _ => None,
        })
        .collect();
    assert_eq!(prefills, vec![P1, p2]);
}

/// A decode worker, then the prefill worker, come back as new incarnations. Each is addressed
/// so from then on, in its place; what the old life held (transfers through it, requests it
/// decoded) is retried or failed; nothing of the other workers' is touched.
#[test]
fn a_restart_loses_only_what_the_old_incarnation_held() {
    let config = RouterConfig { retries_max: 1, ..small_router(4).config.clone() };
    let mut r = Router::new(ME, config, vec![P1], vec![D1, D2]);
    for id in 1..=4 {
        r.submit(spec(id), Time::ZERO).unwrap();
    }
    let to: Vec<(Endpoint, TransferKey)> = reserve_to(&drain(&mut r));
    assert_eq!(to.iter().map(|(d, _)| *d).collect::<Vec<_>>(), vec![D1, D2, D1, D2]);
    // Requests 1 and 2 decode, on D1 and D2; 3 and 4 are in transfer to them.
    r.handle_envelope(outcome(D1, to[0].1, None), Time::ZERO);
    r.handle_envelope(outcome(D2, to[1].1, None), Time::ZERO);
    drain(&mut r);
    let d1_again = Endpoint { incarnation: Incarnation(2), ..D1 };
    r.handle_worker_up(d1_again, crate::wire::Role::Decode, 8, Time::ZERO);
    assert_eq!(r.workers(), (&[P1][..], &[d1_again, D2][..]));
    let out = drain(&mut r);
    let failed = RouterOutput::Failed { request: RequestId(1), reason: AbortReason::PeerRestarted };
    assert!(out.contains(&failed), "{out:?}");
    assert!(
        !out.iter().any(|o| matches!(o, RouterOutput::Failed { request, .. }
        if *request != RequestId(1))),
        "{out:?}"
    );
    let retried = reserve_to(&out);
    assert_eq!(retried.len(), 1, "request 3 again: {out:?}");
    assert_eq!(r.transfer_of(RequestId(3)), Some(retried[0].1));
    assert_eq!(r.transfer_of(RequestId(4)), Some(to[3].1), "D2's transfer is untouched");
    // The prefill worker restarts: both transfers through it are lost (retried once each, or
    // failed if retried already), and nothing that decodes.
    let p1_again = Endpoint { incarnation: Incarnation(2), ..P1 };
    r.handle_worker_up(p1_again, crate::wire::Role::Prefill, 8, Time::ZERO);
    assert_eq!(r.workers().0, &[p1_again][..]);
    let out = drain(&mut r);
    assert_ne!(r.transfer_of(RequestId(4)), Some(to[3].1), "{out:?}");
    assert!(
        !out.iter().any(|o| matches!(o, RouterOutput::Failed { request, .. }
        if *request == RequestId(2))),
        "{out:?}"
    );
    // A worker new to the router goes after the others, in id order.
    let d3 = Endpoint { worker: WorkerId(5), incarnation: Incarnation(1) };
    r.handle_worker_up(d3, crate::wire::Role::Decode, 8, Time::ZERO);
    assert_eq!(r.workers().1, &[d1_again, D2, d3][..]);
}

/// An `Outcome` counts only from the transfer's own decode worker and of its own epoch: a stale
/// epoch's success must not hand the request over under a key no worker decodes.
#[test]
fn an_outcome_counts_only_from_its_decode_worker_and_epoch() {
    let mut r = router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    let key = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    let other_epoch = TransferKey { epoch: Epoch(key.epoch.0 + 1), ..key };
    r.handle_envelope(outcome(D1, other_epoch, None), Time::ZERO);
    r.handle_envelope(outcome(D2, key, None), Time::ZERO);
    assert!(drain(&mut r).is_empty(), "a foreign outcome was taken");
    assert_eq!(r.requests_in_transfer(), 1);
    r.handle_envelope(outcome(D1, key, None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Decoding { request: RequestId(1), key, decode: D1 }]
    );
}

/// Tokens prove the hand-over only with the transfer's own key from its own decode worker.
/// Another epoch's tokens from that worker, or the key's from another worker, start nothing and
/// are never passed on: the sender is told to stop.
#[test]
fn tokens_of_another_attempt_prove_no_hand_over() {
    let mut r = router(1);
    r.submit(spec(1), Time::ZERO).unwrap();
    let key = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    let other_epoch = TransferKey { epoch: Epoch(key.epoch.0 + 1), ..key };
    r.handle_envelope(tokens(D1, other_epoch, 0, &[7], None), Time::ZERO);
    assert_eq!(drain(&mut r), vec![cancel(D1, other_epoch)]);
    r.handle_envelope(tokens(D2, key, 0, &[7], None), Time::ZERO);
    assert_eq!(drain(&mut r), vec![cancel(D2, key)]);
    assert_eq!((r.requests_in_transfer(), r.requests_decoding()), (1, 0));
}

/// A prefill worker lost mid-transfer: the transfer's decode worker is told to let go of the
/// pages at once (rather than at its lease), and nothing is sent to the lost worker.
#[test]
fn a_prefill_worker_lost_mid_transfer_releases_the_decode_side_at_once() {
    let mut r = router(0);
    r.submit(spec(1), Time::ZERO).unwrap();
    let key = r.transfer_of(RequestId(1)).unwrap();
    drain(&mut r);
    r.handle_worker_down(P1.worker, Time::ZERO);
    let out = drain(&mut r);
    let abort = Message::Abort { key, reason: AbortReason::Router };
    assert!(
        out.contains(&RouterOutput::Send(Envelope { from: ME, to: D1, body: abort })),
        "{out:?}"
    );
    let to_lost = |o: &RouterOutput| matches!(o, RouterOutput::Send(e) if e.to == P1);
    assert!(!out.iter().any(to_lost), "a message to the lost worker: {out:?}");
}

/// Once decoding, only the stream's own worker and key pass tokens on: another epoch's from that
/// worker, or the key's from another worker, are told to stop, and the stream goes on.
#[test]
fn while_decoding_only_the_streams_own_worker_and_key_pass_tokens_on() {
    let (mut r, key) = decoding_router();
    let other_epoch = TransferKey { epoch: Epoch(key.epoch.0 + 1), ..key };
    r.handle_envelope(tokens(D1, other_epoch, 0, &[7], None), Time::ZERO);
    assert_eq!(drain(&mut r), vec![cancel(D1, other_epoch)]);
    r.handle_envelope(tokens(D2, key, 0, &[7], None), Time::ZERO);
    assert_eq!(drain(&mut r), vec![cancel(D2, key)]);
    r.handle_envelope(tokens(D1, key, 0, &[8], None), Time::ZERO);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Tokens {
            request: RequestId(1),
            tokens: vec![8],
            logprobs: vec![],
            prompt_logprobs: vec![]
        }]
    );
}
