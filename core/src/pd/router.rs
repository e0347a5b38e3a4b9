//! The router's side of the transfer protocol: pairs a prefill and a decode worker for each
//! request, allocates transfer ids that are never reused, retries a failed transfer as a new one,
//! and ends every request exactly once: decoding, or failed with a reason.
//!
//! Per request: `Reserving → (Decoding | Failed)`, with retries as fresh transfers in between.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use crate::Time;
use crate::ensure_invariant;
use crate::invariant::InvariantViolation;
use crate::sched::RequestId;
use crate::wire::{
    AbortReason, Endpoint, Envelope, Epoch, Message, RequestSpec, TransferId, TransferKey,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterConfig {
    /// How long a transfer may go without an `Outcome` before the router gives up on it. Longer
    /// than the prefill side's deadline, so the router does not give up on a transfer the workers
    /// are still finishing.
    pub outcome_timeout: Duration,
    /// Requests in transfer at once; a submit beyond it is refused.
    pub requests_max: u32,
    /// Fresh transfers tried after the first fails.
    pub retries_max: u32,
}

/// What the router asks its driver to do. Drained with `poll_output` after every input.
#[derive(Clone, Debug, PartialEq)]
pub enum RouterOutput {
    Send(Envelope),
    /// The request's KV is on `decode`, which now generates its tokens.
    Decoding {
        request: RequestId,
        key: TransferKey,
        decode: Endpoint,
    },
    /// The request could not be handed to a decode worker.
    Failed {
        request: RequestId,
        reason: AbortReason,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterError {
    /// `requests_max` requests are in transfer: try later (HTTP 429/503).
    Busy,
    /// A request with this id is in transfer.
    DuplicateRequest(RequestId),
    /// No prefill or no decode worker is configured.
    NoWorkers,
    /// No such request in transfer: never submitted, or already decoding or failed.
    UnknownRequest(RequestId),
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouterError::Busy => write!(f, "too many requests in transfer"),
            RouterError::DuplicateRequest(id) => write!(f, "request {id} is already in transfer"),
            RouterError::NoWorkers => write!(f, "no prefill or decode worker"),
            RouterError::UnknownRequest(id) => write!(f, "request {id} is not in transfer"),
        }
    }
}

impl std::error::Error for RouterError {}

#[derive(Clone, Debug)]
struct Transfer {
    key: TransferKey,
    request: RequestSpec,
    prefill: Endpoint,
    decode: Endpoint,
    deadline: Time,
    attempt: u32,
}

#[derive(Clone, Debug)]
pub struct Router {
    me: Endpoint,
    config: RouterConfig,
    prefills: Vec<Endpoint>,
    decodes: Vec<Endpoint>,
    next_transfer: u64,
    transfers: BTreeMap<TransferId, Transfer>,
    by_request: BTreeMap<RequestId, TransferId>,
    deadlines: BTreeSet<(Time, TransferId)>,
    outputs: VecDeque<RouterOutput>,
}

impl Router {
    /// Transfer ids of one router incarnation live above `incarnation << ID_BITS`, so a restarted
    /// router (a higher incarnation) never reuses one.
    const ID_BITS: u32 = 40;

    pub fn new(
        me: Endpoint,
        config: RouterConfig,
        prefills: Vec<Endpoint>,
        decodes: Vec<Endpoint>,
    ) -> Router {
        Router {
            next_transfer: me.incarnation.0 << Self::ID_BITS,
            me,
            config,
            prefills,
            decodes,
            transfers: BTreeMap::new(),
            by_request: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            outputs: VecDeque::new(),
        }
    }

    pub fn requests_in_transfer(&self) -> usize {
        self.by_request.len()
    }

    pub fn poll_output(&mut self) -> Option<RouterOutput> {
        self.outputs.pop_front()
    }

    pub fn next_timeout(&self) -> Option<Time> {
        self.deadlines.first().map(|(t, _)| *t)
    }

    /// Starts moving a request's KV to a decode worker.
    pub fn submit(&mut self, request: RequestSpec, now: Time) -> Result<TransferKey, RouterError> {
        if self.by_request.contains_key(&request.id) {
            return Err(RouterError::DuplicateRequest(request.id));
        }
        if self.by_request.len() >= self.config.requests_max as usize {
            return Err(RouterError::Busy);
        }
        if self.prefills.is_empty() || self.decodes.is_empty() {
            return Err(RouterError::NoWorkers);
        }
        Ok(self.start(request, 0, now))
    }

    /// The client went away: the request fails now, and the decode side is told to let go.
    pub fn abort(&mut self, request: RequestId, _now: Time) -> Result<(), RouterError> {
        let Some(&id) = self.by_request.get(&request) else {
            return Err(RouterError::UnknownRequest(request));
        };
        let t = self.forget(id);
        self.send(t.decode, Message::Abort { key: t.key, reason: AbortReason::Client });
        self.outputs.push_back(RouterOutput::Failed { request, reason: AbortReason::Client });
        Ok(())
    }

    /// A worker came back as a new incarnation: address it so from now on, and retry what its old
    /// life held.
    pub fn handle_worker_restart(&mut self, worker: Endpoint, now: Time) {
        for list in [&mut self.prefills, &mut self.decodes] {
            for known in list
                .iter_mut()
                .filter(|k| k.worker == worker.worker && k.incarnation < worker.incarnation)
            {
                *known = worker;
            }
        }
        let lost: Vec<TransferId> = self
            .transfers
            .values()
            .filter(|t| {
                (t.decode.worker == worker.worker && t.decode.incarnation < worker.incarnation)
                    || (t.prefill.worker == worker.worker
                        && t.prefill.incarnation < worker.incarnation)
            })
            .map(|t| t.key.transfer)
            .collect();
        for id in lost {
            self.fail_or_retry(id, AbortReason::PeerRestarted, now);
        }
    }

    pub fn handle_envelope(&mut self, envelope: Envelope, now: Time) {
        if envelope.to != self.me {
            return;
        }
        let Message::Outcome { key, failure } = envelope.body else { return };
        let Some(t) = self.transfers.get(&key.transfer) else { return };
        if t.key != key || t.decode != envelope.from {
            return;
        }
        match failure {
            None => {
                let t = self.forget(key.transfer);
                self.outputs.push_back(RouterOutput::Decoding {
                    request: t.request.id,
                    key,
                    decode: t.decode,
                });
            }
            Some(reason) => self.fail_or_retry(key.transfer, reason, now),
        }
    }

    /// Gives up on transfers that heard no `Outcome` in time: the decode side is told to let go
    /// (its own lease would end it anyway), and the request is retried or fails.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            let (decode, key) = {
                let t = &self.transfers[&id];
                (t.decode, t.key)
            };
            self.send(decode, Message::Abort { key, reason: AbortReason::Router });
            self.fail_or_retry(id, AbortReason::Timeout, now);
        }
    }

    fn start(&mut self, request: RequestSpec, attempt: u32, now: Time) -> TransferKey {
        let key = TransferKey { transfer: TransferId(self.next_transfer), epoch: Epoch(attempt) };
        self.next_transfer += 1;
        let prefill = least_loaded(&self.prefills, &self.transfers, |t| t.prefill, attempt);
        let decode = least_loaded(&self.decodes, &self.transfers, |t| t.decode, attempt);
        let deadline = now.saturating_add(self.config.outcome_timeout);
        self.send(decode, Message::Reserve { key, request: request.clone(), prefill });
        self.by_request.insert(request.id, key.transfer);
        self.deadlines.insert((deadline, key.transfer));
        self.transfers
            .insert(key.transfer, Transfer { key, request, prefill, decode, deadline, attempt });
        key
    }

    fn fail_or_retry(&mut self, id: TransferId, reason: AbortReason, now: Time) {
        let t = self.forget(id);
        if t.attempt < self.config.retries_max && reason != AbortReason::Client {
            self.start(t.request, t.attempt + 1, now);
        } else {
            self.outputs.push_back(RouterOutput::Failed { request: t.request.id, reason });
        }
    }

    fn forget(&mut self, id: TransferId) -> Transfer {
        let t = self.transfers.remove(&id).expect("forgetting a live transfer");
        self.deadlines.remove(&(t.deadline, id));
        self.by_request.remove(&t.request.id);
        t
    }

    fn send(&mut self, to: Endpoint, body: Message) {
        self.outputs.push_back(RouterOutput::Send(Envelope { from: self.me, to, body }));
    }

    /// Each request in transfer has exactly one live transfer and the reverse; the deadline index
    /// matches; ids are below the next one to allocate and within this incarnation's range;
    /// bounds hold.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        const PD: &str = "pd-router";
        ensure_invariant!(
            PD,
            self.by_request.len() == self.transfers.len(),
            "{} requests for {} transfers",
            self.by_request.len(),
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.deadlines.len() == self.transfers.len(),
            "{} deadlines for {} transfers",
            self.deadlines.len(),
            self.transfers.len()
        );
        ensure_invariant!(
            PD,
            self.transfers.len() <= self.config.requests_max as usize,
            "{} transfers over the bound",
            self.transfers.len()
        );
        let first = self.me.incarnation.0 << Self::ID_BITS;
        for (&id, t) in &self.transfers {
            ensure_invariant!(PD, t.key.transfer == id, "transfer {id:?} filed under another id");
            ensure_invariant!(
                PD,
                id.0 >= first && id.0 < self.next_transfer,
                "transfer {id:?} outside this incarnation's ids"
            );
            ensure_invariant!(
                PD,
                self.by_request.get(&t.request.id) == Some(&id),
                "{} does not map to its transfer {id:?}",
                t.request.id
            );
            ensure_invariant!(
                PD,
                self.deadlines.contains(&(t.deadline, id)),
                "transfer {id:?} missing from the deadlines"
            );
            ensure_invariant!(
                PD,
                t.attempt <= self.config.retries_max,
                "transfer {id:?} is attempt {} of {}",
                t.attempt,
                self.config.retries_max
            );
        }
        Ok(())
    }
}

/// The worker with the fewest live transfers; ties go to the lowest in the list, rotated by the
/// attempt number so that a retry prefers another worker.
fn least_loaded(
    workers: &[Endpoint],
    transfers: &BTreeMap<TransferId, Transfer>,
    of: impl Fn(&Transfer) -> Endpoint,
    attempt: u32,
) -> Endpoint {
    let n = workers.len();
    (0..n)
        .map(|i| workers[(i + attempt as usize) % n])
        .min_by_key(|w| transfers.values().filter(|t| of(t).worker == w.worker).count())
        .expect("workers were checked to be there")
}

#[cfg(test)]
#[path = "router_invariant_tests.rs"]
mod invariant_tests;
#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
