//! proptest-state-machine: the page pool against a small reference model, over sequences of up
//! to 500 operations (allocate, retain, release with stale handles too, cache insert and match,
//! pin, unpin, extend, time passing). Invariants after every step; no page leaks at the end.
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::collections::BTreeMap;

use lockstep_core::Time;
use lockstep_core::kv::prefix_hash::{block_hash, block_hashes, root_hash};
use lockstep_core::kv::{CacheInsert, CacheKey, KvError, PagePool, PageRef, PinId, PoolConfig};
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

const PAGES: u32 = 6;
const PAGE_TOKENS: usize = 2;
const PINS_MAX: u32 = 4;
const SEQS: u8 = 4;
const SEQ_PAGES: u8 = 3;

/// Tokens of page `i` of sequence `s`. Sequences 0 and 1 share their first page, 2 and 3 too.
fn page_tokens(s: u8, i: u8) -> Vec<u32> {
    let family = if i == 0 { u32::from(s / 2) } else { u32::from(s) };
    (0..PAGE_TOKENS as u32).map(|t| 100 * family + 10 * u32::from(i) + t).collect()
}

fn seq_tokens(s: u8, pages: u8) -> Vec<u32> {
    (0..pages).flat_map(|i| page_tokens(s, i)).collect()
}

/// The model's name for a cache key: the whole token prefix it stands for.
fn prefix(s: u8, i: u8) -> Vec<u32> {
    seq_tokens(s, i + 1)
}

#[derive(Clone, Debug)]
enum Op {
    Allocate,
    Retain(usize),
    Release(usize),
    CacheInsert(usize, u8, u8),
    Match(u8, u8),
    Pin(usize, u64),
    Unpin(usize),
    Extend(usize, u64),
    Advance(u64),
}

#[derive(Clone, Debug, Default)]
struct ModelPage {
    refs: u32,
    pins: u32,
    cached: Option<Vec<u32>>,
    alive: bool,
}

#[derive(Clone, Debug, Default)]
struct Model {
    /// Every page identity ever handed out, in order. A freed or evicted one stays dead.
    pages: Vec<ModelPage>,
    /// Handles the test holds, by page identity (stale ones included).
    handles: Vec<usize>,
    lru: Vec<usize>,
    cache: BTreeMap<Vec<u32>, usize>,
    /// Pins ever made: page identity, expiry, live.
    pins: Vec<(usize, u64, bool)>,
    now: u64,
}

impl Model {
    fn available(&self) -> usize {
        PAGES as usize - self.pages.iter().filter(|p| p.alive && (p.refs + p.pins > 0)).count()
    }

    fn settle(&mut self, id: usize) {
        let page = &mut self.pages[id];
        if page.refs + page.pins == 0 {
            if page.cached.is_some() {
                self.lru.push(id);
            } else {
                page.alive = false;
            }
        }
    }

    fn live_pins(&self) -> usize {
        self.pins.iter().filter(|p| p.2).count()
    }

    fn allocate(&mut self) -> Option<usize> {
        if self.available() == 0 {
            return None;
        }
        let free_exist = PAGES as usize > self.pages.iter().filter(|p| p.alive).count();
        if !free_exist {
            let victim = self.lru.remove(0);
            let key = self.pages[victim].cached.take().expect("evictable pages are cached");
            self.cache.remove(&key);
            self.pages[victim].alive = false;
        }
        self.pages.push(ModelPage { refs: 1, alive: true, ..ModelPage::default() });
        Some(self.pages.len() - 1)
    }

    fn retain(&mut self, id: usize) {
        let page = &mut self.pages[id];
        if page.refs + page.pins == 0 {
            self.lru.retain(|&p| p != id);
        }
        self.pages[id].refs += 1;
    }

    fn unpin(&mut self, pin: usize) {
        let (id, _, _) = self.pins[pin];
        self.pins[pin].2 = false;
        self.pages[id].pins -= 1;
        self.settle(id);
    }
}

struct KvReference;

impl ReferenceStateMachine for KvReference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        let handles = state.handles.len().max(1);
        let pins = state.pins.len().max(1);
        prop_oneof![
            3 => Just(Op::Allocate),
            2 => (0..handles).prop_map(Op::Retain),
            4 => (0..handles).prop_map(Op::Release),
            3 => (0..handles, 0..SEQS, 0..SEQ_PAGES).prop_map(|(h, s, i)| Op::CacheInsert(h, s, i)),
            2 => (0..SEQS, 1..=SEQ_PAGES).prop_map(|(s, n)| Op::Match(s, n)),
            2 => (0..handles, 1..50u64).prop_map(|(h, l)| Op::Pin(h, l)),
            2 => (0..pins).prop_map(Op::Unpin),
            1 => (0..pins, 1..50u64).prop_map(|(p, l)| Op::Extend(p, l)),
            2 => (1..30u64).prop_map(Op::Advance),
        ]
        .boxed()
    }

    fn preconditions(state: &Model, op: &Op) -> bool {
        match op {
            Op::Retain(h) | Op::Release(h) | Op::CacheInsert(h, _, _) | Op::Pin(h, _) => {
                *h < state.handles.len()
            }
            Op::Unpin(p) | Op::Extend(p, _) => *p < state.pins.len(),
            _ => true,
        }
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        match *op {
            Op::Allocate => {
                if let Some(id) = state.allocate() {
                    state.handles.push(id);
                }
            }
            Op::Retain(h) => {
                let id = state.handles[h];
                if state.pages[id].alive {
                    state.retain(id);
                }
            }
            Op::Release(h) => {
                let id = state.handles[h];
                if state.pages[id].alive && state.pages[id].refs > 0 {
                    state.pages[id].refs -= 1;
                    state.settle(id);
                }
            }
            Op::CacheInsert(h, s, i) => {
                let id = state.handles[h];
                let page = &state.pages[id];
                let held = page.alive && page.refs + page.pins > 0;
                let key = prefix(s, i);
                if held && page.cached.is_none() && !state.cache.contains_key(&key) {
                    state.cache.insert(key.clone(), id);
                    state.pages[id].cached = Some(key);
                }
            }
            Op::Match(s, n) => {
                for i in 0..n {
                    let Some(&id) = state.cache.get(&prefix(s, i)) else { break };
                    state.retain(id);
                    state.handles.push(id);
                }
            }
            Op::Pin(h, lease) => {
                let id = state.handles[h];
                let page = &state.pages[id];
                if page.alive && page.refs + page.pins > 0 && state.live_pins() < PINS_MAX as usize
                {
                    state.pages[id].pins += 1;
                    let expiry = state.now + lease;
                    state.pins.push((id, expiry, true));
                }
            }
            Op::Unpin(p) => {
                if state.pins[p].2 {
                    state.unpin(p);
                }
            }
            Op::Extend(p, lease) => {
                if state.pins[p].2 {
                    state.pins[p].1 = state.now + lease;
                }
            }
            Op::Advance(ms) => {
                state.now += ms;
                let now = state.now;
                // Expired pins go in expiry order, then in the order they were made.
                let mut expired: Vec<usize> = (0..state.pins.len())
                    .filter(|&p| state.pins[p].2 && state.pins[p].1 <= now)
                    .collect();
                expired.sort_by_key(|&p| (state.pins[p].1, p));
                for p in expired {
                    state.unpin(p);
                }
            }
        }
        state
    }
}

struct Sut {
    pool: PagePool,
    handles: Vec<PageRef>,
    pins: Vec<PinId>,
    /// Handle of each model page identity, to compare what a match returns.
    identity: BTreeMap<PageRef, usize>,
}

struct KvTest;

fn key_of(s: u8, i: u8) -> (CacheKey, Vec<u32>) {
    let tokens = page_tokens(s, i);
    let parent = if i == 0 {
        root_hash(0)
    } else {
        block_hashes(0, &seq_tokens(s, i), PAGE_TOKENS)[i as usize - 1]
    };
    (CacheKey { hash: block_hash(parent, &tokens), parent }, tokens)
}

impl StateMachineTest for KvTest {
    type SystemUnderTest = Sut;
    type Reference = KvReference;

    fn init_test(_: &Model) -> Sut {
        let pool = PagePool::new(PoolConfig {
            pages_total: PAGES,
            page_tokens: PAGE_TOKENS as u32,
            pins_max: PINS_MAX,
        })
        .unwrap();
        Sut { pool, handles: Vec::new(), pins: Vec::new(), identity: BTreeMap::new() }
    }

    fn apply(mut sut: Sut, model: &Model, op: Op) -> Sut {
        let now = |m: &Model| Time::from_millis(m.now);
        match op {
            Op::Allocate => match sut.pool.allocate() {
                Ok(page) => {
                    assert_eq!(
                        model.handles.len(),
                        sut.handles.len() + 1,
                        "allocated where the model had no page"
                    );
                    sut.identity.insert(page, *model.handles.last().unwrap());
                    sut.handles.push(page);
                }
                Err(KvError::OutOfPages { .. }) => assert_eq!(
                    model.handles.len(),
                    sut.handles.len(),
                    "refused where the model had a page"
                ),
                Err(e) => panic!("{e}"),
            },
            Op::Retain(h) => {
                let result = sut.pool.retain(sut.handles[h]);
                assert_eq!(result.is_ok(), model.pages[model.handles[h]].alive, "{result:?}");
            }
            Op::Release(h) => {
                let id = model.handles[h];
                let result = sut.pool.release(sut.handles[h]);
                // The model already applied it: a successful release left refs one lower.
                let pre_ok = result.is_ok();
                let alive_before = model.pages[id].alive || pre_ok;
                assert!(
                    alive_before || matches!(result, Err(KvError::StaleHandle(_))),
                    "{result:?}"
                );
            }
            Op::CacheInsert(h, s, i) => {
                let (key, tokens) = key_of(s, i);
                let result = sut.pool.cache_insert(sut.handles[h], key, &tokens);
                let inserted = model.pages[model.handles[h]].cached.as_ref() == Some(&prefix(s, i))
                    && model.cache.get(&prefix(s, i)) == Some(&model.handles[h]);
                match result {
                    Ok(CacheInsert::Inserted) => assert!(inserted),
                    Ok(CacheInsert::KeyTaken(other)) => {
                        assert_eq!(sut.identity.get(&other), model.cache.get(&prefix(s, i)))
                    }
                    Err(_) => {}
                }
            }
            Op::Match(s, n) => {
                let tokens = seq_tokens(s, n);
                let keys = block_hashes(0, &tokens, PAGE_TOKENS);
                let mut out = Vec::new();
                let matched = sut.pool.match_prefix(root_hash(0), &keys, &tokens, &mut out);
                assert_eq!(
                    matched,
                    model.handles.len() - sut.handles.len(),
                    "match length differs from the model"
                );
                for (page, &id) in out.iter().zip(&model.handles[sut.handles.len()..]) {
                    assert_eq!(
                        sut.identity.get(page),
                        Some(&id),
                        "matched a page the model did not"
                    );
                }
                sut.handles.extend(out);
            }
            Op::Pin(h, _) => match sut
                .pool
                .pin(sut.handles[h], Time::from_millis(model.pins.last().map_or(0, |p| p.1)))
            {
                Ok(pin) => {
                    assert_eq!(
                        model.pins.len(),
                        sut.pins.len() + 1,
                        "pinned where the model refused"
                    );
                    sut.pins.push(pin);
                }
                Err(_) => {
                    assert_eq!(model.pins.len(), sut.pins.len(), "refused a pin the model made")
                }
            },
            Op::Unpin(p) => {
                let result = sut.pool.unpin(sut.pins[p]);
                assert!(result.is_ok() || matches!(result, Err(KvError::UnknownPin(_))));
            }
            Op::Extend(p, _) => {
                let result = sut.pool.extend_pin(sut.pins[p], Time::from_millis(model.pins[p].1));
                assert_eq!(result.is_ok(), model.pins[p].2);
            }
            Op::Advance(_) => {
                sut.pool.handle_timeout(now(model));
                while sut.pool.poll_expired().is_some() {}
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, model: &Model) {
        if let Err(e) = sut.pool.check_invariants() {
            panic!("{e}");
        }
        assert_eq!(
            sut.pool.available_count() as usize,
            model.available(),
            "available pages differ"
        );
        assert_eq!(sut.pool.cached_count() as usize, model.cache.len(), "cached pages differ");
        assert_eq!(sut.pool.pins_live_count() as usize, model.live_pins(), "live pins differ");
        for (h, &page) in sut.handles.iter().enumerate() {
            let m = &model.pages[model.handles[h]];
            assert_eq!(sut.pool.is_live(page), m.alive, "handle {h} liveness differs");
            if m.alive {
                assert_eq!(sut.pool.refs(page), Ok(m.refs), "handle {h} refs differ");
                assert_eq!(sut.pool.pin_count(page), Ok(m.pins), "handle {h} pins differ");
            }
        }
    }

    fn teardown(mut sut: Sut, model: Model) {
        // Let go of everything the model still holds: the pool must come back whole.
        for pin in sut.pins.iter().zip(&model.pins).filter(|(_, m)| m.2).map(|(p, _)| *p) {
            sut.pool.unpin(pin).unwrap();
        }
        for (h, &page) in sut.handles.iter().enumerate() {
            let id = model.handles[h];
            if !model.handles[..h].contains(&id) && model.pages[id].alive {
                for _ in 0..model.pages[id].refs {
                    sut.pool.release(page).unwrap();
                }
            }
        }
        sut.pool.check_invariants().unwrap();
        assert_eq!(sut.pool.available_count(), PAGES, "pages leaked");
    }
}

prop_state_machine! {
    #![proptest_config(Config { max_shrink_iters: 4096, ..Config::default() })]
    #[test]
    fn kv_pool_matches_its_model(sequential 1..500 => KvTest);
}
