//! The router's indexes: each worker's load, the queue's timers and members, and the requests
//! changed since the last incremental check. Kept in step with the router's own maps by the few
//! methods that change them (`start`, `forget`, `start_decoding`, `forget_decoding`, `enqueue`,
//! `dequeue`), so that choosing a worker costs O(workers · log workers) and the next timer
//! O(log requests), where scans cost O(workers · requests). The full check compares each index
//! with a scan of what it indexes.

use std::collections::{BTreeMap, BTreeSet};

use super::Queued;
use crate::Time;
use crate::sched::RequestId;
use crate::wire::WorkerId;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Index {
    /// Per prefill worker: transfers it computes. Workers with none are absent.
    pub(super) prefill_loads: BTreeMap<WorkerId, usize>,
    /// Per decode worker: transfers it receives and requests it decodes. Workers with none are
    /// absent.
    pub(super) decode_loads: BTreeMap<WorkerId, usize>,
    /// The requests in the queue.
    pub(super) queued: BTreeSet<RequestId>,
    pub(super) queue_deadlines: Times,
    pub(super) queue_not_before: Times,
    /// Requests changed since the last incremental check, up to `changed_max`; past it the set is
    /// dropped and `changed_overflow` makes the next incremental check a full one, so a router
    /// nobody checks holds a bounded set.
    pub(super) changed: BTreeSet<RequestId>,
    pub(super) changed_overflow: bool,
    changed_max: usize,
}

impl Index {
    pub(super) fn new(changed_max: usize) -> Index {
        Index {
            prefill_loads: BTreeMap::new(),
            decode_loads: BTreeMap::new(),
            queued: BTreeSet::new(),
            queue_deadlines: Times::default(),
            queue_not_before: Times::default(),
            changed: BTreeSet::new(),
            changed_overflow: false,
            changed_max: changed_max.max(1),
        }
    }

    pub(super) fn prefill_load(&self, worker: WorkerId) -> usize {
        self.prefill_loads.get(&worker).copied().unwrap_or(0)
    }

    pub(super) fn decode_load(&self, worker: WorkerId) -> usize {
        self.decode_loads.get(&worker).copied().unwrap_or(0)
    }

    pub(super) fn transfer_started(
        &mut self,
        request: RequestId,
        prefill: WorkerId,
        decode: WorkerId,
    ) {
        *self.prefill_loads.entry(prefill).or_default() += 1;
        *self.decode_loads.entry(decode).or_default() += 1;
        self.changed(request);
    }

    pub(super) fn transfer_ended(
        &mut self,
        request: RequestId,
        prefill: WorkerId,
        decode: WorkerId,
    ) {
        unload(&mut self.prefill_loads, prefill);
        unload(&mut self.decode_loads, decode);
        self.changed(request);
    }

    pub(super) fn decoding_started(&mut self, request: RequestId, decode: WorkerId) {
        *self.decode_loads.entry(decode).or_default() += 1;
        self.changed(request);
    }

    pub(super) fn decoding_ended(&mut self, request: RequestId, decode: WorkerId) {
        unload(&mut self.decode_loads, decode);
        self.changed(request);
    }

    pub(super) fn enqueued(&mut self, q: &Queued) {
        let fresh = self.queued.insert(q.request.id);
        assert!(fresh, "{} queued twice", q.request.id);
        self.queue_deadlines.insert(q.deadline);
        self.queue_not_before.insert(q.not_before);
        self.changed(q.request.id);
    }

    pub(super) fn dequeued(&mut self, q: &Queued) {
        self.queued.remove(&q.request.id);
        self.queue_deadlines.remove(q.deadline);
        self.queue_not_before.remove(q.not_before);
        self.changed(q.request.id);
    }

    /// Notes a request changed, for the next incremental check.
    pub(super) fn changed(&mut self, request: RequestId) {
        if self.changed_overflow {
            return;
        }
        if self.changed.len() >= self.changed_max && !self.changed.contains(&request) {
            self.changed.clear();
            self.changed_overflow = true;
            return;
        }
        self.changed.insert(request);
    }

    /// The requests changed since the last call, or `None` if more changed than the set holds.
    pub(super) fn take_changed(&mut self) -> Option<BTreeSet<RequestId>> {
        let changed = std::mem::take(&mut self.changed);
        let overflow = std::mem::replace(&mut self.changed_overflow, false);
        (!overflow).then_some(changed)
    }

    pub(super) fn changed_within_bound(&self) -> bool {
        self.changed.len() <= self.changed_max
    }
}

fn unload(loads: &mut BTreeMap<WorkerId, usize>, worker: WorkerId) {
    let load = loads.get_mut(&worker).expect("a worker with a load is indexed");
    *load -= 1;
    if *load == 0 {
        loads.remove(&worker);
    }
}

/// A multiset of times, for the earliest of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Times(BTreeMap<Time, usize>);

impl Times {
    pub(super) fn first(&self) -> Option<Time> {
        self.0.first_key_value().map(|(&t, _)| t)
    }

    pub(super) fn insert(&mut self, t: Time) {
        *self.0.entry(t).or_default() += 1;
    }

    fn remove(&mut self, t: Time) {
        let count = self.0.get_mut(&t).expect("removing a time that was inserted");
        *count -= 1;
        if *count == 0 {
            self.0.remove(&t);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.0.values().sum()
    }
}
