//! The simulated device under each worker: the real `InlineRunner` over `ProvenanceModel`, steps
//! lasting the cost model's time on turmoil's clock, and the step faults layered on top: a step
//! now and then takes longer, as a GPU's would behind a straggling collective or a page fault,
//! or fails after it ran (a device error, a lost readback), which the engine loop above, the
//! production one, must turn into errors for that step's requests and nothing else.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use lockstep_core::model::{ExecError, SamplingSpec};
use lockstep_core::sched::{RequestId, StepPlan};
use lockstep_server::engine::{PageRunner, StepCost, StepOrRead, StepResult, StepRunner};
use serde::Deserialize;
use tokio::time::Instant;

use crate::events::{Event, EventLog};
use crate::rng::SimRng;
use crate::sabotage::{self, Sabotage};

/// How long a step takes, from a JSON file (`sim/cost_model.json` is the default).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub struct CostModel {
    pub per_step_us: u64,
    pub per_prefill_token_us: u64,
    pub per_decode_token_us: u64,
}

impl CostModel {
    pub fn default_model() -> CostModel {
        CostModel::parse(include_str!("../cost_model.json")).expect("the bundled cost model parses")
    }

    pub fn load(path: &Path) -> Result<CostModel, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        CostModel::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<CostModel, String> {
        serde_json::from_str(text).map_err(|e| format!("not a cost model: {e}"))
    }

    pub fn step_cost(&self) -> StepCost {
        StepCost {
            per_step: Duration::from_micros(self.per_step_us),
            per_prefill_token: Duration::from_micros(self.per_prefill_token_us),
            per_decode_token: Duration::from_micros(self.per_decode_token_us),
        }
    }
}

/// When steps run slow or fail: of the steps completed before `until` (virtual time since the
/// run's start), a share `rate` each take `extra` longer, and a share `failure_rate` fail.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlowSteps {
    pub rate: f64,
    pub extra: Duration,
    pub failure_rate: f64,
    pub until: Duration,
}

/// Planted `TransferWithoutCancellation` only: a KV write the device acknowledged and has not
/// landed yet (its DMA is still running), and when it lands.
#[derive(Debug)]
struct InFlightWrite {
    page: u32,
    data: Vec<u8>,
    due: Duration,
    /// Its page was released while the write was in flight: nobody waits for it any more.
    orphaned: bool,
}

/// The longest a planted in-flight write takes to land.
const WRITE_LANDS_WITHIN: Duration = Duration::from_millis(100);

/// A step on the device, from its launch.
#[derive(Debug)]
struct LaunchedStep {
    at: Duration,
    requests: Vec<u64>,
    prompt_tokens: u32,
    decode_rows: u32,
}

/// A runner whose completed steps may be held back a while (the slow-step fault), and which may
/// carry a planted bug (`sabotage`).
pub struct SlowRunner<R> {
    inner: R,
    slow: SlowSteps,
    sabotage: Option<Sabotage>,
    writes: u32,
    rng: SimRng,
    /// Draws which steps fail, apart from `rng`, so that the slow steps a seed drew before
    /// failures existed stay where they were.
    failures: SimRng,
    /// Where the steps go on the timeline: this host's name and the run's log.
    host: String,
    log: EventLog,
    /// Steps launched and not yet reported, oldest first.
    launched: VecDeque<LaunchedStep>,
    /// When the last reported step ended: the next one started no earlier (steps run one after
    /// another on a device).
    last_end: Duration,
    /// A completed step held back, and until when. Kept here, not in a future, so that dropping
    /// `completed` while it waits loses nothing (the runner's cancel-safety promise).
    held: Option<(Instant, StepResult)>,
    /// Planted `PinnedBufferOverwritten` only: a step launched behind another whose block ids
    /// the device has not copied yet (it copies them when it gets to the step).
    staged: Option<StepPlan>,
    /// Planted `TransferWithoutCancellation` only: writes acknowledged and not landed, in order.
    in_flight_writes: VecDeque<InFlightWrite>,
    /// Planted `AccumulatingCorruption` only: per page, a digest of the last write landed in it.
    landed: BTreeMap<u32, u64>,
}

impl<R> std::fmt::Debug for SlowRunner<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlowRunner").field("slow", &self.slow).finish()
    }
}

impl<R: PageRunner> SlowRunner<R> {
    pub fn new(
        inner: R,
        slow: SlowSteps,
        sabotage: Option<Sabotage>,
        rng: SimRng,
        failures: SimRng,
        host: String,
        log: EventLog,
    ) -> SlowRunner<R> {
        SlowRunner {
            inner,
            slow,
            sabotage,
            writes: 0,
            rng,
            failures,
            host,
            log,
            launched: VecDeque::new(),
            last_end: Duration::ZERO,
            held: None,
            staged: None,
            in_flight_writes: VecDeque::new(),
            landed: BTreeMap::new(),
        }
    }

    /// A step leaves the device: its planted bug applied, its span logged.
    fn report(&mut self, result: StepResult) -> StepResult {
        let result = self.tamper(result);
        let now = sabotage::now();
        if let Some(step) = self.launched.pop_front() {
            let started = step.at.max(self.last_end).min(now);
            self.log.log(Event::Step {
                host: self.host.clone(),
                step: result.0.0,
                started,
                requests: step.requests,
                prompt_tokens: step.prompt_tokens,
                decode_rows: step.decode_rows,
            });
        }
        self.last_end = now;
        result
    }

    /// How much longer a step just completed takes.
    fn draw_delay(&mut self) -> Duration {
        let now = sabotage::now();
        let mut delay = Duration::ZERO;
        if self.slow.rate > 0.0 && now < self.slow.until && self.rng.chance(self.slow.rate) {
            delay = self.slow.extra;
        }
        match self.sabotage {
            Some(Sabotage::SharedCounterCost) => delay += sabotage::shared_counter_delay(),
            Some(Sabotage::Stall { after }) if now >= after => delay = Duration::from_secs(1 << 30),
            _ => {}
        }
        delay
    }

    /// What a planted bug, or the failed-step fault, does to a completed step.
    fn tamper(&mut self, mut result: StepResult) -> StepResult {
        let failing = self.slow.failure_rate > 0.0 && sabotage::now() < self.slow.until;
        if failing && result.1.is_ok() && self.failures.chance(self.slow.failure_rate) {
            result.1 = Err(ExecError("the device failed the step (simulated)".into()));
        }
        match self.sabotage {
            Some(Sabotage::CorruptSample { after }) if sabotage::now() >= after => {
                if let Ok(outputs) = &mut result.1
                    && let Some(token) = outputs.sampled.first_mut()
                {
                    *token = token.wrapping_add(1) % 1000;
                }
            }
            Some(Sabotage::SkewLogprob { after }) if sabotage::now() >= after => {
                if let Ok(outputs) = &mut result.1
                    && let Some(Some(first)) = outputs.logprobs.first_mut()
                {
                    first.logprob = f32::from_bits(first.logprob.to_bits() ^ 1);
                }
            }
            Some(Sabotage::Panic { after }) if sabotage::now() >= after => {
                panic!("planted: a step panicked the engine (sabotage)");
            }
            _ => {}
        }
        result
    }

    /// Planted `PinnedBufferOverwritten` only: hands the staged step to the device, which copies
    /// its block ids now. Every call that reaches the device does this first, in call order.
    fn copy_staged(&mut self) {
        if let Some(plan) = self.staged.take() {
            self.inner.launch(plan);
        }
    }

    /// Planted `PinnedBufferOverwritten` only: the device copies a step's block ids from one
    /// pinned host buffer when it starts the step, which for a step launched behind another is
    /// once that one is done.
    fn launch_staged(&mut self, plan: StepPlan) {
        if let Some(mut staged) = self.staged.take() {
            // trtllm#15546: the next plan's block ids went into the pinned buffer before the
            // async copy of the staged step's read it; that step runs with another batch's ids.
            let overwritten = staged.page_updates.len().min(plan.page_updates.len());
            staged.page_updates[..overwritten].copy_from_slice(&plan.page_updates[..overwritten]);
            self.inner.launch(staged);
        }
        if self.launched.len() > 1 {
            self.staged = Some(plan);
        } else {
            self.inner.launch(plan);
        }
    }

    /// Planted `TransferWithoutCancellation` only: lands the in-flight writes that are due, or
    /// that `wait_for` waits for, in the order they were issued.
    fn land_writes(&mut self, wait_for: impl Fn(&InFlightWrite) -> bool) {
        if self.in_flight_writes.is_empty() {
            return;
        }
        let now = sabotage::now();
        let mut still = VecDeque::new();
        for write in std::mem::take(&mut self.in_flight_writes) {
            if write.due <= now || wait_for(&write) {
                let _ = self.inner.write_page(write.page, write.data);
            } else {
                still.push_back(write);
            }
        }
        self.in_flight_writes = still;
    }

    async fn release_held(&mut self) -> StepResult {
        let (at, _) = self.held.as_ref().expect("called with a step held");
        tokio::time::sleep_until(*at).await;
        let result = self.held.take().expect("still held").1;
        self.report(result)
    }
}

impl<R: PageRunner> StepRunner for SlowRunner<R> {
    fn start_request(&mut self, request: RequestId, spec: SamplingSpec) {
        self.copy_staged();
        self.inner.start_request(request, spec);
    }

    fn end_request(&mut self, request: RequestId) {
        self.copy_staged();
        self.inner.end_request(request);
    }

    fn launch(&mut self, plan: StepPlan) {
        let mut step = LaunchedStep {
            at: sabotage::now(),
            requests: plan.rows.iter().map(|r| r.request.0).collect(),
            prompt_tokens: 0,
            decode_rows: 0,
        };
        for row in &plan.rows {
            let tokens = row.positions.len() as u32;
            if tokens == 1 && row.sample && row.positions.start > 0 {
                step.decode_rows += 1;
            } else {
                step.prompt_tokens += tokens;
            }
        }
        self.launched.push_back(step);
        // A step waits for the in-flight writes into the pages its table takes on.
        self.land_writes(|w| !w.orphaned && plan.page_updates.iter().any(|p| p.index() == w.page));
        if lockstep_core::planted!(PinnedBufferOverwritten) {
            return self.launch_staged(plan);
        }
        self.inner.launch(plan);
    }

    fn release_pages(&mut self, pages: Vec<u32>) {
        self.copy_staged();
        self.land_writes(|_| false);
        if lockstep_core::planted!(TransferWithoutCancellation) {
            // nixl#2067, nixl#2044: the release returns while writes into these pages are still
            // in flight (no cancellation); they land whenever they land, on the pages' next owner.
            for write in &mut self.in_flight_writes {
                write.orphaned |= pages.contains(&write.page);
            }
        }
        self.inner.release_pages(pages);
    }

    fn completed(&mut self) -> Pin<Box<dyn Future<Output = StepResult> + Send + '_>> {
        Box::pin(async move {
            if self.launched.len() == 1 {
                // The staged step is the oldest: the device gets to it.
                self.copy_staged();
            }
            if self.held.is_none() {
                let result = self.inner.completed().await;
                let delay = self.draw_delay();
                if delay.is_zero() {
                    return self.report(result);
                }
                self.held = Some((Instant::now() + delay, result));
            }
            self.release_held().await
        })
    }
}

impl<R: PageRunner> PageRunner for SlowRunner<R> {
    fn page_bytes(&self) -> usize {
        self.inner.page_bytes()
    }

    fn read_page(&mut self, tag: u64, page: u32) {
        self.copy_staged();
        self.land_writes(|w| !w.orphaned && w.page == page);
        self.inner.read_page(tag, page);
    }

    fn step_or_read(&mut self) -> Pin<Box<dyn Future<Output = StepOrRead> + Send + '_>> {
        Box::pin(async move {
            if self.launched.len() == 1 {
                // The staged step is the oldest: the device gets to it.
                self.copy_staged();
            }
            if self.held.is_some() {
                return StepOrRead::Step(self.release_held().await);
            }
            match self.inner.step_or_read().await {
                StepOrRead::Step(result) => {
                    let delay = self.draw_delay();
                    if delay.is_zero() {
                        return StepOrRead::Step(self.report(result));
                    }
                    self.held = Some((Instant::now() + delay, result));
                    StepOrRead::Step(self.release_held().await)
                }
                read => read,
            }
        })
    }

    fn write_page(&mut self, page: u32, data: Vec<u8>) -> Result<(), ExecError> {
        self.copy_staged();
        self.land_writes(|_| false);
        if lockstep_core::planted!(AccumulatingCorruption) && data.len() == self.page_bytes() {
            // sgl#23020: a write equal to the last one landed in the page is taken for a resent
            // duplicate and skipped, and a release never forgets that record: the page keeps
            // what its occupants left since (here their poison), more of them as pages recycle.
            let digest = data.iter().fold(0xcbf2_9ce4_8422_2325, |h: u64, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            if self.landed.insert(page, digest) == Some(digest) {
                return Ok(());
            }
        }
        if lockstep_core::planted!(TransferWithoutCancellation) && data.len() == self.page_bytes() {
            // The write is acknowledged once issued; its DMA lands within a bound, in order.
            let due = sabotage::now() + self.rng.millis(Duration::ZERO, WRITE_LANDS_WITHIN);
            self.in_flight_writes.push_back(InFlightWrite { page, data, due, orphaned: false });
            return Ok(());
        }
        if let Some(Sabotage::DropKvWrite { every }) = self.sabotage {
            self.writes += 1;
            if self.writes.is_multiple_of(every.max(1)) {
                return Ok(());
            }
        }
        self.inner.write_page(page, data)
    }
}
