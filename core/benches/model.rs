//! `cargo bench -p lockstep-core --bench model`: what one decode token costs the provenance
//! model at a context of 256, 4,096 and 32,768 tokens (issue 10). The model is the simulator's
//! oracle, so its cost per token is what bounds how long a simulated trace may be.
//!
//! One request in one slot, prefilled once; then each iteration is one decode step: write the
//! KV of the next position and sample from everything the page table holds. The position walks
//! over one page and starts again, so the context stays at N to N + 15 tokens and every page
//! boundary is crossed as often as in a real decode.

#![allow(clippy::disallowed_methods, reason = "a benchmark reads the clock")]
#![allow(clippy::unwrap_used, reason = "benchmark setup: a panic is the report")]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use lockstep_core::kv::{PageRef, PoolConfig};
use lockstep_core::model::{Executor, ProvenanceModel, SamplingSpec};
use lockstep_core::sched::{Bucket, InputToken, RequestId, RowPlan, StepId, StepPlan};

const PAGE_TOKENS: u32 = 16;
const REQUEST: RequestId = RequestId(1);

/// A one-row plan: positions `positions` of slot 0, its table cut at `from` and `pages` appended.
fn plan(step: u64, positions: std::ops::Range<u32>, from: u32, pages: &[PageRef]) -> StepPlan {
    let tokens = positions.len() as u32;
    StepPlan {
        step: StepId(step),
        rows: vec![RowPlan {
            request: REQUEST,
            slot: 0,
            positions: positions.clone(),
            inputs: 0..tokens,
            page_table_from: from,
            page_updates: 0..pages.len() as u32,
            sample: true,
        }],
        input_tokens: positions
            .map(|p| InputToken::Known(p.wrapping_mul(7_919) % 50_000))
            .collect(),
        page_updates: pages.to_vec(),
        bucket: Bucket::Eager,
    }
}

fn decode_token(c: &mut Criterion) {
    let mut group = c.benchmark_group("provenance_decode_token");
    for context in [256u32, 4_096, 32_768] {
        let pages_total = context / PAGE_TOKENS + 1;
        let pool = PoolConfig { pages_total, page_tokens: PAGE_TOKENS, pins_max: 0 };
        let mut model = ProvenanceModel::new(pool, 1, 50_000);
        model.start_request(REQUEST, SamplingSpec::GREEDY);
        let pages: Vec<PageRef> = (0..pages_total).map(|i| PageRef::from_parts(i, 0)).collect();
        model.execute(&plan(0, 0..context, 0, &pages)).unwrap();
        // The decode plans, made once: one per position of the last page.
        let decodes: Vec<StepPlan> = (0..PAGE_TOKENS)
            .map(|i| plan(1 + u64::from(i), context + i..context + i + 1, pages_total, &[]))
            .collect();
        group.bench_function(BenchmarkId::from_parameter(context), |b| {
            let mut next = 0;
            b.iter(|| {
                let outputs = model.execute(&decodes[next]).unwrap();
                next = (next + 1) % decodes.len();
                black_box(outputs)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = decode_token
}
criterion_main!(benches);
