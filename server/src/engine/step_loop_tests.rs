//! The engine hands the pages it frees to its executor in order with its steps
//! (`Engine::release_freed`): under page pressure (preemptions, prefix-cache evictions, pages
//! freed and handed out again within one planning) every request of a crowd still samples what
//! it samples alone, with the provenance model poisoning every page released. A release that
//! came after the launch of the step writing the page for its new owner would poison good KV,
//! and the crowd would differ.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::{ProvenanceModel, SamplingSpec};
use lockstep_core::sched::{NewRequest, RequestId, SchedConfig, StepMode, StepPlan};

use super::super::runner::{InlineRunner, StepCost, StepResult, StepRunner};
use super::super::{EngineConfig, RequestEvent, first_request_id, spawn};
use crate::metrics::Metrics;

/// An inline runner over the provenance model that counts the pages released through it.
struct Counting {
    inner: InlineRunner<ProvenanceModel>,
    released: Arc<AtomicUsize>,
}

impl StepRunner for Counting {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.inner.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.inner.end_request(request);
    }

    fn launch(&mut self, plan: StepPlan) {
        self.inner.launch(plan);
    }

    fn completed(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = StepResult> + Send + '_>> {
        self.inner.completed()
    }

    fn release_pages(&mut self, pages: Vec<u32>) {
        self.released.fetch_add(pages.len(), Ordering::Relaxed);
        self.inner.release_pages(pages);
    }
}

/// Ten pages of four tokens for up to four requests of up to 20 tokens: the pool runs dry.
fn config(mode: StepMode) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 10, page_tokens: 4, pins_max: 0 },
        mode,
        waiting_max: 16,
        running_max: 4,
        step_tokens_max: 32,
        prefill_chunk_tokens_max: 8,
        scored_tokens_max: 8,
        request_tokens_max: 64,
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    }
}

/// Eight requests; pairs share an 8-token prefix, so the prefix cache has pages to hit and to
/// evict.
fn requests() -> Vec<NewRequest> {
    (0..8u32)
        .map(|i| {
            let mut prompt: Vec<u32> = (0..8).map(|t| 100 * (i / 2) + t + 1).collect();
            prompt.extend((0..2 + i % 3).map(|t| 1_000 + 10 * i + t));
            NewRequest {
                id: RequestId(0),
                prompt,
                max_tokens: 10,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                priority: 0,
                cache_salt: 0,
            }
        })
        .collect()
}

/// Runs `requests` at once on a fresh engine; their tokens, and the pages released.
async fn run(mode: StepMode, requests: &[NewRequest]) -> (Vec<Vec<u32>>, usize) {
    let sched = config(mode);
    let model = ProvenanceModel::new(sched.pool, sched.running_max, 50_000);
    let released = Arc::new(AtomicUsize::new(0));
    let runner =
        Counting { inner: InlineRunner::new(model, StepCost::ZERO), released: released.clone() };
    let mut engine = EngineConfig::new(sched);
    engine.check_invariants = true;
    let (handle, task) = spawn(engine, runner, Arc::new(Metrics::new("test"))).unwrap();
    let mut streams = Vec::new();
    for r in requests {
        streams.push(handle.submit(r.clone(), SamplingSpec::GREEDY).await.unwrap());
    }
    let mut outputs = Vec::new();
    for mut stream in streams {
        let mut tokens = Vec::new();
        while let Some(event) = stream.next().await {
            match event {
                RequestEvent::Token { token, .. } => tokens.push(token),
                RequestEvent::PromptLogprobs { .. } => {}
                RequestEvent::Finished { .. } => break,
            }
        }
        outputs.push(tokens);
    }
    drop(handle);
    task.await.unwrap();
    (outputs, released.load(Ordering::Relaxed))
}

#[tokio::test]
async fn a_crowd_under_page_pressure_samples_what_each_request_samples_alone() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let all = requests();
        let (crowd, released) = run(mode, &all).await;
        assert!(released > 0, "{mode:?}: pages were freed, so some were released");
        for (i, request) in all.iter().enumerate() {
            let (alone, _) = run(mode, std::slice::from_ref(request)).await;
            assert_eq!(crowd[i].len(), 10, "{mode:?}: request {i} ran to its length");
            assert_eq!(crowd[i], alone[0], "{mode:?}: request {i} in the crowd and alone");
        }
    }
}

/// A process started a millisecond after another (a restart) gives ids above every id the other
/// gave, as long as it gave fewer than 2^20 a millisecond; a process at the epoch still starts
/// at 1, never at 0.
#[tokio::test]
async fn a_restarted_engine_gives_ids_above_its_predecessors() {
    let ids = async |started_ms: u64| {
        let sched = config(StepMode::Sync);
        let model = ProvenanceModel::new(sched.pool, sched.running_max, 50_000);
        let mut engine = EngineConfig::new(sched);
        engine.first_request_id = first_request_id(Duration::from_millis(started_ms));
        let runner = InlineRunner::new(model, StepCost::ZERO);
        let (handle, task) = spawn(engine, runner, Arc::new(Metrics::new("test"))).unwrap();
        let mut ids = Vec::new();
        for r in requests().into_iter().take(3) {
            ids.push(handle.submit(r, SamplingSpec::GREEDY).await.unwrap().id().0);
        }
        drop(handle);
        task.await.unwrap();
        ids
    };
    assert_eq!(ids(0).await, [1, 2, 3]);
    let earlier = 1_796_000_000_000;
    let (before, after) = (ids(earlier).await, ids(earlier + 1).await);
    assert_eq!(before, [earlier << 20, (earlier << 20) + 1, (earlier << 20) + 2]);
    assert_eq!(after[0], (earlier + 1) << 20);
}
