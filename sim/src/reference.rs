//! The C=1 outputs: each request of a trace run alone, on a fresh single server with the
//! production defaults and no faults. The equal-alone oracle compares every crowded run against
//! these. The provenance model makes a request's output a function of its own tokens and
//! sampling only, so one reference serves every seed, topology and knob of the trace.

use std::time::Duration;

use crate::client::Ending;
use crate::device::CostModel;
use crate::faults::FaultLevel;
use crate::knobs::{Knobs, Topology};
use crate::run::{RunConfig, context_needed, run};
use crate::trace::{SimRequest, SimTrace, Start};

/// Each request's tokens when it ran alone, by index, and their log-probabilities as the client
/// saw them (`Observed::logprobs`; none for a request that did not ask).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub outputs: Vec<Vec<u32>>,
    pub logprobs: Vec<Vec<String>>,
}

impl Reference {
    /// Runs every request of `trace` alone, on up to `jobs` threads.
    pub fn compute(trace: &SimTrace, cost: CostModel, jobs: usize) -> Result<Reference, String> {
        let context = context_needed(trace);
        let indices: Vec<usize> = (0..trace.requests.len()).collect();
        let chunk = indices.len().div_ceil(jobs.max(1)).max(1);
        let results: Vec<Result<Alone, String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = indices
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter().map(|&i| alone(trace, i, context, cost)).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| vec![Err("a reference run panicked".into())])
                })
                .collect()
        });
        let (outputs, logprobs) =
            results.into_iter().collect::<Result<Vec<Alone>, _>>()?.into_iter().unzip();
        Ok(Reference { outputs, logprobs })
    }
}

/// A request's tokens alone, and their log-probabilities.
type Alone = (Vec<u32>, Vec<String>);

/// Request `index` alone on a fresh single server.
fn alone(trace: &SimTrace, index: usize, context: u32, cost: CostModel) -> Result<Alone, String> {
    let request = SimRequest {
        index: 0,
        session: None,
        turn: 1,
        start: Start::At(Duration::ZERO),
        ..trace.requests[index].clone()
    };
    let single = SimTrace {
        name: trace.name.clone(),
        vocab_size: trace.vocab_size,
        requests: vec![request],
    };
    let mut config = RunConfig::new(0, Topology::Single, FaultLevel::None);
    config.cost = cost;
    config.knobs = Some(Knobs::plain(context, 1));
    // A single server has no links to wait for: the warm-up would be most of each run.
    config.warmup = Duration::ZERO;
    let outcome = run(&single, &config);
    let observed = &outcome.observed[0];
    match &observed.ending {
        Some(Ending::Completed { .. }) if outcome.panics.is_empty() => {
            Ok((observed.tokens.clone(), observed.logprobs.clone()))
        }
        other => Err(format!(
            "request {index} alone did not complete: {other:?}, panics {:?}, error {:?}",
            outcome.panics, outcome.sim_error
        )),
    }
}
