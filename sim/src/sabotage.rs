//! Bugs planted on purpose, in the simulated device only, so that each oracle can be shown to
//! fire on a broken run (and, later, every public bug class to be caught when planted). Nothing
//! here reaches the server: the production code runs unchanged above a device that misbehaves.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One planted bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sabotage {
    /// Every `every`-th KV page write reported landed but dropped: a transport that reports a
    /// one-sided write complete before it lands.
    DropKvWrite { every: u32 },
    /// From `after` on, each step's first sampled token is changed: KV read from the wrong page.
    CorruptSample { after: Duration },
    /// From `after` on, each step's first log-probability is one bit off: read from another
    /// row's logits, or from logits computed before the step's last write.
    SkewLogprob { after: Duration },
    /// From `after` on, launched steps never complete: a wedged device.
    Stall { after: Duration },
    /// From `after` on, a completed step panics the engine's task.
    Panic { after: Duration },
    /// Step times depend on a counter shared by every run of the process: state that outlives a
    /// run, so the same seed runs differently the second time.
    SharedCounterCost,
}

impl FromStr for Sabotage {
    type Err = String;
    fn from_str(s: &str) -> Result<Sabotage, String> {
        let at = Duration::from_secs(3);
        match s {
            "drop-kv-write" => Ok(Sabotage::DropKvWrite { every: 3 }),
            "corrupt-sample" => Ok(Sabotage::CorruptSample { after: at }),
            "skew-logprob" => Ok(Sabotage::SkewLogprob { after: at }),
            "stall" => Ok(Sabotage::Stall { after: at }),
            "panic" => Ok(Sabotage::Panic { after: at }),
            "shared-counter-cost" => Ok(Sabotage::SharedCounterCost),
            other => Err(format!(
                "sabotage {other:?} is not drop-kv-write, corrupt-sample, skew-logprob, stall, \
                 panic or shared-counter-cost"
            )),
        }
    }
}

impl fmt::Display for Sabotage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sabotage::DropKvWrite { every } => write!(f, "drop every {every}th KV write"),
            Sabotage::CorruptSample { after } => write!(f, "corrupt samples after {after:?}"),
            Sabotage::SkewLogprob { after } => write!(f, "skew log-probabilities after {after:?}"),
            Sabotage::Stall { after } => write!(f, "stall steps after {after:?}"),
            Sabotage::Panic { after } => write!(f, "panic in a step after {after:?}"),
            Sabotage::SharedCounterCost => write!(f, "step cost from a process-wide counter"),
        }
    }
}

/// The counter `SharedCounterCost` reads: deliberately global.
static SHARED_STEPS: AtomicU64 = AtomicU64::new(0);

/// Extra time a step takes under `SharedCounterCost`.
pub fn shared_counter_delay() -> Duration {
    Duration::from_micros(SHARED_STEPS.fetch_add(1, Ordering::Relaxed) % 7 * 100)
}

/// Virtual time since the run began.
pub fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}
