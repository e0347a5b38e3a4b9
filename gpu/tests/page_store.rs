//! The CPU executor's KV as pages of bytes (`PageStore`), on the tiny generated models: bytes
//! written read back the same, bad pages and lengths are errors, a page's bytes follow the
//! documented order whatever the thread count, and a prompt's pages copied from one executor
//! into other pages of another let the request decode there exactly what it decodes alone.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

mod tiny;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lockstep_core::Time;
use lockstep_core::kv::{PageRef, PoolConfig};
use lockstep_core::model::{Executor, PageStore, SamplingSpec};
use lockstep_core::sched::{
    NewRequest, RequestId, SchedConfig, SchedEvent, Scheduler, StepMode, StepOutputs,
};
use lockstep_core::wire::KvLayout;
use lockstep_gpu::llama::{CpuExecutor, LlamaWeights};
use lockstep_gpu::model::Model;

const PAGE_TOKENS: usize = 4;

fn config(mode: StepMode) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 32, page_tokens: PAGE_TOKENS as u32, pins_max: 0 },
        mode,
        waiting_max: 8,
        running_max: 4,
        step_tokens_max: 8,
        prefill_chunk_tokens_max: 4,
        scored_tokens_max: 4,
        request_tokens_max: 64,
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: false,
    }
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
    NewRequest {
        id: RequestId(id),
        prompt,
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: true,
        priority: 0,
        cache_salt: 0,
    }
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len).map(|i| (i * 37 + salt * 11 + 5) % tiny::VOCAB as u32).collect()
}

/// Every tiny variant's weights, by name (the model folder, one per call as tests run in
/// parallel, is removed once loaded).
fn models() -> Vec<(&'static str, Arc<LlamaWeights>)> {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    tiny::variants()
        .into_iter()
        .map(|variant| {
            let dir = std::env::temp_dir().join(format!(
                "lockstep-page-store-{}-{call}-{}",
                std::process::id(),
                variant.name
            ));
            let _ = std::fs::remove_dir_all(&dir);
            variant.write(&dir);
            let model = Model::load(&dir).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            (variant.name, model.weights)
        })
        .collect()
}

/// xorshift64* bytes.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// A scheduler and a CPU executor, driven step by step; in overlap mode a step is planned and
/// executed before the previous one's outputs are applied.
struct Rig {
    sched: Scheduler,
    executor: CpuExecutor,
    /// Executed steps whose outputs are not applied yet, oldest first.
    pending: VecDeque<StepOutputs>,
    in_flight_max: usize,
    events: Vec<SchedEvent>,
    /// Page references taken out of the scheduler and not handed back yet.
    taken: Vec<PageRef>,
}

impl Rig {
    fn new(weights: &Arc<LlamaWeights>, mode: StepMode, threads: usize) -> Rig {
        let config = config(mode);
        Rig {
            executor: CpuExecutor::with_threads(
                weights.clone(),
                config.pool,
                config.running_max,
                threads,
            ),
            sched: Scheduler::new(config).unwrap(),
            pending: VecDeque::new(),
            in_flight_max: if mode == StepMode::Overlap { 2 } else { 1 },
            events: Vec::new(),
            taken: Vec::new(),
        }
    }

    fn submit(&mut self, req: NewRequest, keep_pages: bool) {
        self.executor.start_request(req.id, SamplingSpec::GREEDY);
        if keep_pages {
            self.sched.submit_keeping_pages(req, Time::ZERO).unwrap();
        } else {
            self.sched.submit(req, Time::ZERO).unwrap();
        }
        self.check();
    }

    fn check(&mut self) {
        self.sched.check_invariants_sharing_pool(&self.taken).unwrap_or_else(|e| panic!("{e}"));
        while let Some(event) = self.sched.poll_event() {
            if let SchedEvent::Finished { request, .. } = event {
                self.executor.end_request(request);
            }
            self.events.push(event);
        }
    }

    /// Plans and executes a step if there is one, and applies the oldest outputs when as many
    /// steps as the mode allows are in flight or nothing more can be planned. False when idle.
    fn step(&mut self) -> bool {
        let planned = match self.sched.plan_step(Time::ZERO) {
            Some(plan) => {
                self.pending.push_back(self.executor.execute(&plan).unwrap());
                true
            }
            None => false,
        };
        if self.pending.len() >= self.in_flight_max || (!planned && !self.pending.is_empty()) {
            let outputs = self.pending.pop_front().unwrap();
            self.sched.apply_outputs(&outputs, Time::ZERO).unwrap();
        }
        self.check();
        planned || !self.pending.is_empty()
    }

    /// Steps until `done` holds of the events, then applies the steps in flight.
    fn run_until(&mut self, done: impl Fn(&[SchedEvent]) -> bool) {
        for _ in 0..1000 {
            if done(&self.events) {
                while let Some(outputs) = self.pending.pop_front() {
                    self.sched.apply_outputs(&outputs, Time::ZERO).unwrap();
                    self.check();
                }
                return;
            }
            assert!(self.step(), "idle before done: {:?}", self.events);
        }
        panic!("wedged");
    }

    fn run(&mut self) {
        for _ in 0..1000 {
            if !self.step() {
                assert_eq!(self.sched.requests_held(), 0, "idle with requests held");
                return;
            }
        }
        panic!("wedged");
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

    /// Runs `req` (its pages kept) to its end and takes its pages.
    fn prefill_keeping(&mut self, req: NewRequest) -> Vec<PageRef> {
        let id = req.id;
        self.submit(req, true);
        self.run_until(|events| events.contains(&SchedEvent::PagesKept { request: id }));
        let pages = self.sched.take_kept_pages(id).unwrap();
        self.taken.extend(&pages);
        self.check();
        pages
    }

    fn read(&self, page: PageRef) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.executor.read_page(page.index(), &mut bytes).unwrap();
        assert_eq!(bytes.len(), self.executor.page_bytes());
        bytes
    }
}

#[test]
fn bytes_written_to_a_page_read_back_and_bad_pages_or_lengths_are_errors() {
    let (_, weights) = models().remove(0);
    let pool = config(StepMode::Sync).pool;
    // Three threads for two KV heads: one shard holds none.
    for threads in [1, 2, 3] {
        let mut executor = CpuExecutor::with_threads(weights.clone(), pool, 4, threads);
        let expected =
            tiny::LAYERS * 2 * PAGE_TOKENS * tiny::KV_HEADS * tiny::HEAD_DIM * size_of::<u16>();
        assert_eq!(executor.page_bytes(), expected);
        assert_eq!(
            executor.kv_layout(),
            KvLayout {
                layers: tiny::LAYERS as u32,
                kv_heads: tiny::KV_HEADS as u32,
                head_dim: tiny::HEAD_DIM as u32,
                element_bytes: 2,
            }
        );
        let last = pool.pages_total - 1;
        let data = noise(expected, threads as u64);
        executor.write_page(3, &data).unwrap();
        let other = noise(expected, 99);
        executor.write_page(last, &other).unwrap();
        // Appended after what `out` held.
        let mut out = vec![7u8; 5];
        executor.read_page(3, &mut out).unwrap();
        assert_eq!(out[..5], [7; 5]);
        assert!(out[5..] == data[..], "{threads} threads: page 3 read back differs");
        out.clear();
        executor.read_page(last, &mut out).unwrap();
        assert!(out == other, "{threads} threads: the last page read back differs");
        // Neighbours untouched.
        for page in [2, 4, last - 1] {
            out.clear();
            executor.read_page(page, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 0), "{threads} threads: page {page} was written");
        }

        for len in [0, expected - 1, expected + 1, expected * 2] {
            let e = executor.write_page(3, &vec![1; len]).unwrap_err();
            assert!(e.0.contains("bytes written to a page of"), "{e}");
        }
        for page in [pool.pages_total, pool.pages_total + 1, u32::MAX] {
            let e = executor.write_page(page, &data).unwrap_err();
            assert!(e.0.contains("outside the pool"), "{e}");
            let mut out = vec![1, 2];
            let e = executor.read_page(page, &mut out).unwrap_err();
            assert!(e.0.contains("outside the pool"), "{e}");
            assert_eq!(out, [1, 2], "a failed read appended");
        }
        // Refused writes changed nothing.
        out.clear();
        executor.read_page(3, &mut out).unwrap();
        assert!(out == data);
    }
}

/// A prompt of six tokens on pages of four: its second page holds positions 4 and 5, and 6 and 7
/// are unwritten. In every (layer, keys or values) block of the page, the first two positions'
/// heads are written and the last two's are zero; and the bytes are the same whatever the number
/// of threads (each holding different heads) that computed them.
#[test]
fn a_pages_bytes_follow_the_documented_order_on_any_number_of_threads() {
    for (name, weights) in models() {
        let mut pages_by_threads = Vec::new();
        for threads in [1, 2, 3] {
            let mut rig = Rig::new(&weights, StepMode::Sync, threads);
            let pages = rig.prefill_keeping(request(1, prompt(6, 0), 1));
            assert_eq!(pages.len(), 2);
            pages_by_threads.push(pages.iter().map(|&p| rig.read(p)).collect::<Vec<_>>());
        }
        assert!(pages_by_threads[0] == pages_by_threads[1], "{name}: 1 and 2 threads differ");
        assert!(pages_by_threads[0] == pages_by_threads[2], "{name}: 1 and 3 threads differ");

        let position_bytes = tiny::KV_HEADS * tiny::HEAD_DIM * 2;
        let block = PAGE_TOKENS * position_bytes;
        let [first, second] = &pages_by_threads[0][..] else { unreachable!() };
        assert_eq!(second.len(), tiny::LAYERS * 2 * block);
        for (b, chunk) in second.chunks_exact(block).enumerate() {
            for (t, position) in chunk.chunks_exact(position_bytes).enumerate() {
                let zero = position.iter().all(|&x| x == 0);
                // Each head of a written position is written (no key or value is exactly 0).
                let heads_written = position
                    .chunks_exact(tiny::HEAD_DIM * 2)
                    .all(|head| head.iter().any(|&x| x != 0));
                if t < 2 {
                    assert!(heads_written, "{name}: block {b}: position {t} not written");
                } else {
                    assert!(zero, "{name}: block {b}: position {t} written");
                }
            }
        }
        // The first page is full, and its blocks (layer 0 keys, values, layer 1 keys, values)
        // all differ.
        let blocks: Vec<&[u8]> = first.chunks_exact(block).collect();
        for (i, a) in blocks.iter().enumerate() {
            assert!(a.chunks_exact(position_bytes).all(|p| p.iter().any(|&x| x != 0)), "{name}");
            for b in &blocks[i + 1..] {
                assert!(a != b, "{name}: two blocks of the first page are equal");
            }
        }
    }
}

/// The request's run on one executor alone, greedy.
fn alone(weights: &Arc<LlamaWeights>, req: &NewRequest) -> Vec<u32> {
    let mut rig = Rig::new(weights, StepMode::Sync, 1);
    rig.submit(req.clone(), false);
    rig.run();
    rig.tokens(req.id.0)
}

/// The prompt prefilled on executor A (two threads, its pages kept), the pages' bytes copied
/// into other pages of executor B (three threads, overlap mode, another request decoding
/// alongside), and the request handed over to B's scheduler with A's first token: B decodes what
/// the request decodes alone, token for token, on every tiny variant (biases, sliding window and
/// RoPE scaling included).
#[test]
fn a_prompts_pages_copied_to_another_executor_decode_what_the_request_decodes_alone() {
    for (name, weights) in models() {
        let req = request(1, prompt(10, 0), 8);
        let alone = alone(&weights, &req);
        assert_eq!(alone.len(), 8, "{name}");

        let mut a = Rig::new(&weights, StepMode::Sync, 2);
        let sources = a.prefill_keeping(NewRequest { max_tokens: 1, ..req.clone() });
        let first = a.tokens(1);
        assert_eq!(first, alone[..1], "{name}: the first token");
        assert_eq!(sources.len(), 3, "{name}");

        let mut b = Rig::new(&weights, StepMode::Overlap, 3);
        // Another request first, running on through the hand-over, so B's pages differ from A's.
        b.submit(request(2, prompt(5, 1), 16), false);
        b.step();
        // Pages of B's pool for the transfer: those a request with another prompt of the same
        // length kept, so they hold other KV until the copy overwrites it.
        let pages = b.prefill_keeping(request(3, prompt(10, 2), 1));
        let (from, to): (Vec<u32>, Vec<u32>) =
            sources.iter().zip(&pages).map(|(s, p)| (s.index(), p.index())).unzip();
        assert!(from.iter().zip(&to).all(|(f, t)| f != t), "{name}: pages {from:?} to {to:?}");
        assert!(b.sched.requests_held() > 0, "{name}: request 2 still runs");

        b.sched.reserve(req.clone(), Time::ZERO).unwrap();
        for (&source, &page) in sources.iter().zip(&pages) {
            let bytes = a.read(source);
            assert!(b.read(page) != bytes, "{name}: page {} already held the KV", page.index());
            b.executor.write_page(page.index(), &bytes).unwrap();
            assert!(b.read(page) == bytes, "{name}");
        }
        b.executor.start_request(req.id, SamplingSpec::GREEDY);
        b.sched.hand_over(req.id, pages, 0, first[0], Time::ZERO).unwrap();
        b.taken.clear();
        b.check();
        b.run();
        assert_eq!(b.tokens(1), alone, "{name}: decoded after the transfer");
        assert_eq!(b.tokens(2).len(), 16, "{name}");
    }
}
