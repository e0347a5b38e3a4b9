//! Arbitrary operation sequences on the page pool, stale handles and unknown pins included: no
//! panic, invariants after every operation, and everything comes back once let go.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use lockstep_core::Time;
use lockstep_core::kv::prefix_hash::{block_hashes, root_hash};
use lockstep_core::kv::{CacheKey, PagePool, PageRef, PinId, PoolConfig};

#[derive(Arbitrary, Debug)]
enum Op {
    Allocate,
    AllocateMany(u8),
    Retain(u8),
    Release(u8),
    CacheInsert { handle: u8, seq: u8, page: u8 },
    Match { seq: u8, pages: u8 },
    Pin { handle: u8, lease_ms: u8 },
    Unpin(u8),
    Extend { pin: u8, lease_ms: u8 },
    Advance(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    pages_total: u8,
    page_tokens: u8,
    pins_max: u8,
    ops: Vec<Op>,
}

const SEQ_PAGES: usize = 6;

/// Four sequences; 0 and 1 share their first two pages.
fn seq_tokens(seq: u8, page_tokens: usize) -> Vec<u32> {
    (0..SEQ_PAGES * page_tokens)
        .map(|i| {
            let family =
                if i < 2 * page_tokens { u32::from(seq % 4 / 2) } else { u32::from(seq % 4) };
            family * 1000 + i as u32
        })
        .collect()
}

fuzz_target!(|input: Input| {
    let config = PoolConfig {
        pages_total: u32::from(input.pages_total % 32) + 1,
        page_tokens: u32::from(input.page_tokens % 4) + 1,
        pins_max: u32::from(input.pins_max % 8),
    };
    let pt = config.page_tokens as usize;
    let mut pool = PagePool::new(config).expect("valid config");
    let mut handles: Vec<PageRef> = Vec::new();
    let mut pins: Vec<PinId> = Vec::new();
    let mut now = 0u64;
    let pick = |v: &[PageRef], i: u8| v.get(i as usize % v.len().max(1)).copied();
    for op in input.ops.into_iter().take(2_000) {
        match op {
            Op::Allocate => handles.extend(pool.allocate().ok()),
            Op::AllocateMany(n) => {
                let _ = pool.allocate_many(u32::from(n % 8), &mut handles);
            }
            Op::Retain(i) => {
                if let Some(h) = pick(&handles, i) {
                    if pool.retain(h).is_ok() {
                        handles.push(h);
                    }
                }
            }
            Op::Release(i) => {
                if let Some(h) = pick(&handles, i) {
                    let _ = pool.release(h);
                }
            }
            Op::CacheInsert { handle, seq, page } => {
                if let Some(h) = pick(&handles, handle) {
                    let tokens = seq_tokens(seq, pt);
                    let keys = block_hashes(0, &tokens, pt);
                    let i = page as usize % SEQ_PAGES;
                    let parent = if i == 0 { root_hash(0) } else { keys[i - 1] };
                    let _ = pool.cache_insert(
                        h,
                        CacheKey { hash: keys[i], parent },
                        &tokens[i * pt..(i + 1) * pt],
                    );
                }
            }
            Op::Match { seq, pages } => {
                let tokens = seq_tokens(seq, pt);
                let n = pages as usize % (SEQ_PAGES + 1);
                let keys = block_hashes(0, &tokens[..n * pt], pt);
                pool.match_prefix(root_hash(0), &keys, &tokens, &mut handles);
            }
            Op::Pin { handle, lease_ms } => {
                if let Some(h) = pick(&handles, handle) {
                    pins.extend(pool.pin(h, Time::from_millis(now + u64::from(lease_ms))).ok());
                }
            }
            Op::Unpin(i) => {
                if let Some(&p) = pins.get(i as usize % pins.len().max(1)) {
                    let _ = pool.unpin(p);
                }
            }
            Op::Extend { pin, lease_ms } => {
                if let Some(&p) = pins.get(pin as usize % pins.len().max(1)) {
                    let _ = pool.extend_pin(p, Time::from_millis(now + u64::from(lease_ms)));
                }
            }
            Op::Advance(ms) => {
                now += u64::from(ms);
                pool.handle_timeout(Time::from_millis(now));
                while pool.poll_expired().is_some() {}
            }
        }
        if let Err(e) = pool.check_invariants() {
            panic!("{e}");
        }
    }
    // Let go of everything: the pool must come back whole.
    for p in pins {
        let _ = pool.unpin(p);
    }
    for h in handles {
        let _ = pool.release(h);
    }
    pool.check_invariants().expect("invariants at the end");
    assert_eq!(pool.available_count(), pool.pages_total(), "pages leaked: {pool:?}");
});
