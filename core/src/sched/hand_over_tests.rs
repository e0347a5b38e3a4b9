//! The scheduler's side of transfers: pages kept for a prefill transfer until taken, slots
//! reserved for a decode hand-over, the hand-over itself, and each new invariant check shown to
//! fire on a state broken by hand.

use super::request::Phase;
use super::*;
use crate::Time;
use crate::kv::PageRef;
use crate::model::{Executor, ProvenanceModel, SamplingSpec};
use crate::testing::{VOCAB_SIZE, request, small_config};

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 1 + (i * 7) % 90).collect()
}

struct Rig {
    sched: Scheduler,
    model: ProvenanceModel,
    now: Time,
    pending: Vec<StepOutputs>,
    events: Vec<SchedEvent>,
}

impl Rig {
    fn new(mode: StepMode) -> Rig {
        let config = small_config(mode, 16);
        let model = ProvenanceModel::new(config.pool, config.running_max, VOCAB_SIZE);
        Rig {
            sched: Scheduler::new(config).unwrap(),
            model,
            now: Time::ZERO,
            pending: Vec::new(),
            events: Vec::new(),
        }
    }

    fn check(&mut self) {
        self.sched.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        self.events.extend(std::iter::from_fn(|| self.sched.poll_event()));
    }

    /// Plans and executes one step, without applying it.
    fn plan(&mut self) -> bool {
        let Some(plan) = self.sched.plan_step(self.now) else { return false };
        self.pending.push(self.model.execute(&plan).unwrap());
        self.check();
        true
    }

    fn apply(&mut self) {
        let outputs = self.pending.remove(0);
        self.sched.apply_outputs(&outputs, self.now).unwrap();
        self.check();
    }

    fn run(&mut self) {
        for _ in 0..1000 {
            if !self.plan() && self.pending.is_empty() {
                return;
            }
            if !self.pending.is_empty() {
                self.apply();
            }
        }
        panic!("wedged");
    }

    /// Runs request 1 on `prompt(prompt_len)` for one token: its two full prompt pages stay in
    /// the prefix cache.
    fn leave_two_cached_pages(&mut self, prompt_len: u32) {
        self.sched.submit(request(1, prompt(prompt_len), 1), self.now).unwrap();
        self.model.start_request(RequestId(1), SamplingSpec::GREEDY);
        self.run();
        assert_eq!(self.sched.pool().cached_count(), 2);
    }

    /// The cached pages of `prompt(8)`, found as the decode side finds them for a transfer.
    fn match_two_cached_pages(&mut self) -> Vec<PageRef> {
        let keys = crate::kv::prefix_hash::block_hashes(0, &prompt(8), 4);
        let mut pages = Vec::new();
        let root = crate::kv::prefix_hash::root_hash(0);
        self.sched.pool_mut().match_prefix(root, &keys, &prompt(8), &mut pages);
        assert_eq!(pages.len(), 2);
        pages
    }

    fn tokens(&self, id: u64) -> Vec<u32> {
        self.events
            .iter()
            .filter_map(|e| match *e {
                SchedEvent::Token { request, token } if request == RequestId(id) => Some(token),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn a_prefill_request_keeps_its_pages_until_they_are_taken() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let mut rig = Rig::new(mode);
        rig.sched.submit_keeping_pages(request(1, prompt(6), 1), rig.now).unwrap();
        rig.model.start_request(RequestId(1), SamplingSpec::GREEDY);
        rig.check();
        rig.run();
        let kept_at =
            rig.events.iter().position(|e| *e == SchedEvent::PagesKept { request: RequestId(1) });
        let finished_at = rig.events.iter().position(|e| matches!(e, SchedEvent::Finished { .. }));
        assert!(finished_at.unwrap() < kept_at.expect("pages kept"), "{mode:?}: {:?}", rig.events);
        assert_eq!(rig.tokens(1).len(), 1);
        // Nothing else holds the prompt's two pages: they are alive only because they are kept.
        assert_eq!(rig.sched.pool().held_count(), 2, "{mode:?}");
        let pages = rig.sched.take_kept_pages(RequestId(1)).unwrap();
        assert_eq!(pages.len(), 2);
        assert!(rig.sched.check_invariants().is_err(), "taken references went uncounted");
        rig.sched.check_invariants_sharing_pool(&pages).unwrap();
        for page in pages {
            rig.sched.pool_mut().release(page).unwrap();
        }
        rig.check();
        assert_eq!(rig.sched.pool().held_count(), 0);
        assert_eq!(rig.sched.take_kept_pages(RequestId(1)), None);
    }
}

#[test]
fn a_preempted_or_aborted_request_keeps_only_what_it_holds_at_its_end() {
    let mut rig = Rig::new(StepMode::Sync);
    rig.sched.submit_keeping_pages(request(1, prompt(6), 1), rig.now).unwrap();
    rig.model.start_request(RequestId(1), SamplingSpec::GREEDY);
    rig.plan();
    rig.sched.abort(RequestId(1), rig.now).unwrap();
    rig.check();
    assert!(!rig.events.iter().any(|e| matches!(e, SchedEvent::PagesKept { .. })));
    rig.apply();
    // Aborted mid-prefill: the pages it held are kept all the same; the caller decides.
    assert_eq!(rig.events.last(), Some(&SchedEvent::PagesKept { request: RequestId(1) }));
    for page in rig.sched.take_kept_pages(RequestId(1)).unwrap() {
        rig.sched.pool_mut().release(page).unwrap();
    }
    rig.check();
}

#[test]
fn a_reservation_holds_a_slot_is_never_scheduled_and_is_refused_when_none_is_free() {
    let mut rig = Rig::new(StepMode::Sync);
    for id in 1..=4 {
        rig.sched.reserve(request(id, prompt(6), 4), rig.now).unwrap();
    }
    rig.check();
    assert_eq!(rig.sched.slots_held(), 4);
    assert_eq!(
        rig.sched.reserve(request(5, prompt(6), 4), rig.now),
        Err(AdmissionError::NoSlot { running_max: 4 })
    );
    assert_eq!(
        rig.sched.reserve(request(4, prompt(6), 4), rig.now),
        Err(AdmissionError::DuplicateId(RequestId(4)))
    );
    assert!(!rig.plan(), "a reserved request was scheduled before its KV came");
    rig.sched.cancel_reservation(RequestId(4)).unwrap();
    rig.check();
    assert_eq!(rig.sched.slots_held(), 3);
    assert_eq!(
        rig.sched.cancel_reservation(RequestId(4)),
        Err(HandOverError::NotReserved(RequestId(4)))
    );
    rig.sched.abort(RequestId(3), rig.now).unwrap();
    rig.check();
    assert_eq!(rig.sched.slots_held(), 2);
    assert!(rig.events.contains(&SchedEvent::Finished {
        request: RequestId(3),
        reason: FinishReason::Aborted,
        output_tokens: 0
    }));
}

/// The prompt computed on one scheduler and model, its pages' KV copied into another's, and the
/// request handed over there: the output equals the request's run alone, token for token.
#[test]
fn a_handed_over_request_decodes_what_it_would_have_alone() {
    use crate::model::PageStore;
    let req = request(1, prompt(10), 6);
    let alone = crate::testing::run_alone(&small_config(StepMode::Sync, 16), &req);

    let mut prefill = Rig::new(StepMode::Sync);
    prefill
        .sched
        .submit_keeping_pages(NewRequest { max_tokens: 1, ..req.clone() }, prefill.now)
        .unwrap();
    prefill.model.start_request(req.id, SamplingSpec::GREEDY);
    prefill.run();
    let first = prefill.tokens(1)[0];
    let sources = prefill.sched.take_kept_pages(req.id).unwrap();

    let mut decode = Rig::new(StepMode::Overlap);
    // Another request first, so the decode side's pages differ from the prefill side's.
    decode.sched.submit(request(2, prompt(5), 2), decode.now).unwrap();
    decode.model.start_request(RequestId(2), SamplingSpec::GREEDY);
    decode.plan();
    decode.sched.reserve(req.clone(), decode.now).unwrap();
    let mut pages = Vec::new();
    decode.sched.pool_mut().allocate_many(3, &mut pages).unwrap();
    let mut bytes = Vec::new();
    for (source, page) in sources.iter().zip(&pages) {
        bytes.clear();
        prefill.model.read_page(source.index(), &mut bytes).unwrap();
        decode.model.write_page(page.index(), &bytes).unwrap();
    }
    assert_eq!(
        decode.sched.hand_over(req.id, pages[..2].to_vec(), 0, first, decode.now),
        Err(HandOverError::WrongPageCount { request: req.id, expected: 3, got: 2 })
    );
    // More cached pages than pages, or than the prompt fills (3 pages of 4 tokens, 10 tokens).
    for cached in [4, 3] {
        assert_eq!(
            decode.sched.hand_over(req.id, pages.clone(), cached, first, decode.now),
            Err(HandOverError::TooManyCachedPages { request: req.id, cached, pages: 3 })
        );
    }
    decode.model.start_request(req.id, SamplingSpec::GREEDY);
    decode.sched.hand_over(req.id, pages.clone(), 0, first, decode.now).unwrap();
    decode.check();
    // Once running, it is no longer reserved: a second hand-over is refused.
    assert_eq!(
        decode.sched.hand_over(req.id, pages, 0, first, decode.now),
        Err(HandOverError::NotReserved(req.id))
    );
    decode.check();
    decode.run();
    assert_eq!(decode.tokens(1), alone);
}

#[test]
fn pages_from_the_decode_sides_cache_are_not_offered_to_it_again() {
    let mut rig = Rig::new(StepMode::Sync);
    rig.leave_two_cached_pages(9);
    rig.sched.reserve(request(2, prompt(10), 4), rig.now).unwrap();
    let mut pages = rig.match_two_cached_pages();
    rig.sched.pool_mut().allocate_many(1, &mut pages).unwrap();
    rig.model.start_request(RequestId(2), SamplingSpec::GREEDY);
    // KV of the third page is not copied: the point is the cache bookkeeping, not the output.
    rig.sched.hand_over(RequestId(2), pages, 2, 5, rig.now).unwrap();
    rig.check();
    rig.run();
    assert_eq!(rig.tokens(2).len(), 4);
}

/// A prompt of whole pages may come wholly from the decode side's cache: every page cached is
/// not too many (the bound is the prompt, not one page short of it).
#[test]
fn a_prompt_of_whole_pages_may_come_wholly_from_the_cache() {
    let mut rig = Rig::new(StepMode::Sync);
    rig.leave_two_cached_pages(8);
    rig.sched.reserve(request(2, prompt(8), 3), rig.now).unwrap();
    let pages = rig.match_two_cached_pages();
    rig.model.start_request(RequestId(2), SamplingSpec::GREEDY);
    rig.sched.hand_over(RequestId(2), pages, 2, 5, rig.now).unwrap();
    rig.check();
    rig.run();
    assert_eq!(rig.tokens(2).len(), 3);
}

#[test]
fn a_first_token_that_ends_the_request_ends_it_at_once() {
    let mut rig = Rig::new(StepMode::Sync);
    rig.sched.reserve(request(1, prompt(5), 4), rig.now).unwrap();
    let mut pages = Vec::new();
    rig.sched.pool_mut().allocate_many(2, &mut pages).unwrap();
    rig.sched.hand_over(RequestId(1), pages, 0, 0, rig.now).unwrap();
    rig.check();
    assert_eq!(
        rig.events,
        vec![
            SchedEvent::Token { request: RequestId(1), token: 0 },
            SchedEvent::Finished {
                request: RequestId(1),
                reason: FinishReason::EndOfSequence(0),
                output_tokens: 1
            }
        ]
    );
    assert_eq!((rig.sched.pool().held_count(), rig.sched.slots_held()), (0, 0));
}

// --- the checks, each shown to fire ---

fn reserved_rig() -> Rig {
    let mut rig = Rig::new(StepMode::Sync);
    rig.sched.reserve(request(1, prompt(5), 4), rig.now).unwrap();
    rig.check();
    rig
}

#[test]
fn a_reserved_request_in_an_order_is_caught() {
    let mut rig = reserved_rig();
    let entry = rig.sched.by_id[&RequestId(1)];
    let order = rig.sched.entry(entry).order;
    rig.sched.running.push((order, entry));
    let e = rig.sched.check_invariants().unwrap_err();
    assert!(e.what().contains("is reserved but ordered"), "{e}");
}

#[test]
fn a_reserved_request_holding_pages_is_caught() {
    let mut rig = reserved_rig();
    let page = rig.sched.pool_mut().allocate().unwrap();
    let entry = rig.sched.by_id[&RequestId(1)];
    rig.sched.entry_mut(entry).pages.push(page);
    let e = rig.sched.check_invariants().unwrap_err();
    assert!(e.what().contains("is reserved holding 1 pages"), "{e}");
    assert!(matches!(rig.sched.entry(entry).phase, Phase::Reserved { .. }));
}

#[test]
fn pages_kept_for_a_request_still_held_are_caught() {
    let mut rig = reserved_rig();
    rig.sched.kept.insert(RequestId(1), Vec::new());
    let e = rig.sched.check_invariants().unwrap_err();
    assert!(e.what().contains("kept page sets, or one of a request still held"), "{e}");
}

#[test]
fn a_transfers_reference_is_counted_only_when_listed() {
    let mut rig = reserved_rig();
    let page = rig.sched.pool_mut().allocate().unwrap();
    let e = rig.sched.check_invariants().unwrap_err();
    assert!(e.what().contains("page tables and transfers hold 0"), "{e}");
    rig.sched.check_invariants_sharing_pool(&[page]).unwrap();
    rig.sched.pool_mut().release(page).unwrap();
    let e = rig.sched.check_invariants_sharing_pool(&[page]).unwrap_err();
    assert!(e.what().contains("a transfer holds page"), "{e}");
}
