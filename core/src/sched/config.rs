//! Scheduler configuration, validated once at construction.

use std::fmt;
use std::time::Duration;

use crate::kv::PoolConfig;

/// Whether the next step may be planned while the previous one still runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// One step in flight: plan, execute, apply outputs, plan again.
    Sync,
    /// Two steps in flight, as SGLang's overlap scheduler and vLLM's async scheduling do: step
    /// N+1 is planned while step N runs, with step N's sampled tokens as placeholders the
    /// executor resolves. Nothing step N reads or writes is freed or handed out before its
    /// outputs are applied.
    Overlap,
}

impl StepMode {
    /// Steps planned and not yet applied, at most.
    pub fn steps_in_flight_max(self) -> usize {
        match self {
            StepMode::Sync => 1,
            StepMode::Overlap => 2,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    pub pool: PoolConfig,
    pub mode: StepMode,
    /// Requests waiting for admission, at most; a submit beyond it is refused.
    pub waiting_max: u32,
    /// Requests holding a batch slot (running, or draining a step in flight), at most.
    pub running_max: u32,
    /// Tokens computed in one step, prefill and decode together.
    pub step_tokens_max: u32,
    /// Prompt tokens of one request computed in one step: longer prompts are chunked.
    pub prefill_chunk_tokens_max: u32,
    /// Prompt tokens of requests that score their prompt (`Scheduler::submit_scoring`) computed
    /// in one step, all such requests together: each such position's logits over the whole
    /// vocabulary are kept until the step's scores are taken (4 bytes a token of the
    /// vocabulary), so this bounds that memory on every executor.
    pub scored_tokens_max: u32,
    /// Prompt plus output tokens of one request (the model's context length).
    pub request_tokens_max: u32,
    /// Decode batch sizes with a captured graph, ascending. A decode-only step of at most the
    /// largest runs in the smallest that fits; larger or mixed steps run eagerly.
    pub capture_sizes: Vec<u32>,
    /// Token ids that end a sequence unless the request ignores them.
    pub eos_token_ids: Vec<u32>,
    /// How long a request may wait for admission before it is refused.
    pub queue_wait_max: Duration,
    /// Whether full pages are shared between requests through the prefix cache.
    pub prefix_cache: bool,
}

impl SchedConfig {
    pub fn validate(&self) -> Result<(), SchedConfigError> {
        self.pool.validate().map_err(|e| SchedConfigError(e.to_string()))?;
        let err = |what: String| Err(SchedConfigError(what));
        if self.running_max == 0 || self.waiting_max == 0 {
            return err(format!(
                "running_max {} and waiting_max {} must be positive",
                self.running_max, self.waiting_max
            ));
        }
        if self.running_max.saturating_add(self.waiting_max) > Self::REQUESTS_MAX {
            return err(format!("running_max + waiting_max is over {}", Self::REQUESTS_MAX));
        }
        // Every running request gets its decode token in every step (vLLM checks the same).
        if self.step_tokens_max < self.running_max {
            return err(format!(
                "step_tokens_max {} is below running_max {}",
                self.step_tokens_max, self.running_max
            ));
        }
        if self.prefill_chunk_tokens_max == 0 {
            return err("prefill_chunk_tokens_max must be positive".into());
        }
        if self.scored_tokens_max == 0 {
            return err(
                "scored_tokens_max must be positive: a scored prompt would never finish".into()
            );
        }
        if self.request_tokens_max < 2 {
            return err(format!(
                "request_tokens_max {} leaves no room for a prompt and an output",
                self.request_tokens_max
            ));
        }
        if !self.capture_sizes.windows(2).all(|w| w[0] < w[1])
            || self.capture_sizes.first() == Some(&0)
        {
            return err(format!(
                "capture_sizes {:?} must be positive and strictly ascending",
                self.capture_sizes
            ));
        }
        Ok(())
    }

    /// Requests known to a scheduler at once, waiting and running.
    pub const REQUESTS_MAX: u32 = 1 << 24;
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedConfigError(String);

impl SchedConfigError {
    pub(crate) fn new(what: String) -> SchedConfigError {
        SchedConfigError(what)
    }
}

impl fmt::Display for SchedConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid scheduler config: {}", self.0)
    }
}

impl std::error::Error for SchedConfigError {}
