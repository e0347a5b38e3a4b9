//! `sim explore`: many seeds, each its own knobs and faults, on `--jobs` threads; stops at the
//! first violation and prints the command that reproduces it. `--shard K/N` takes every N-th seed
//! of the range, so machines can split one range.

use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use lockstep_sim::oracle::{self, Violation};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunConfig, RunOutcome, run as run_once};
use lockstep_sim::shrink::shrink;
use lockstep_sim::trace::SimTrace;

/// The most runs `--shrink` spends.
const SHRINK_RUNS: usize = 300;

use super::{Parsed, has, number, option, refuse_unknown, report, seed_range};

pub fn run(parsed: Parsed) -> Result<ExitCode, String> {
    let Parsed { common, rest } = parsed;
    refuse_unknown(&rest, &["--seeds", "--jobs", "--shard", "--shrink"])?;
    let range = seed_range(option(&rest, "--seeds").ok_or("explore needs --seeds A..B")?)?;
    let (shard, shards) = match option(&rest, "--shard") {
        None => (0, 1),
        Some(text) => {
            let (k, n) =
                text.split_once('/').ok_or_else(|| format!("--shard: {text:?} is not K/N"))?;
            let (k, n): (u64, u64) = (number(k, "--shard")?, number(n, "--shard")?);
            if n == 0 || k >= n {
                return Err(format!("--shard: {text:?} needs 0 <= K < N"));
            }
            (k, n)
        }
    };
    let jobs = option(&rest, "--jobs")
        .map(|j| number::<usize>(j, "--jobs"))
        .transpose()?
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1);
    let seeds: Vec<u64> = range.clone().filter(|s| (s - range.start) % shards == shard).collect();
    let trace = common.load_trace()?;
    eprintln!(
        "sim explore {}: {} requests, seeds {}..{} (shard {shard}/{shards}: {} seeds), topology {}, \
         faults {}, {jobs} jobs",
        common.trace_path.display(),
        trace.requests.len(),
        range.start,
        range.end,
        seeds.len(),
        common.topology,
        common.faults
    );
    let reference = Reference::compute(&trace, common.cost, jobs)?;
    let bar = ProgressBar::new(seeds.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds  {per_sec}  eta {eta}  {msg}")
            .map_err(|e| e.to_string())?,
    );
    let found = first_violation(&trace, &reference, &seeds, jobs, &bar, |seed| common.config(seed));
    bar.finish_and_clear();
    match found {
        None => {
            println!("{} seeds, no violation", seeds.len());
            Ok(ExitCode::SUCCESS)
        }
        Some((outcome, violations)) => {
            let reproduce = common.reproduce(outcome.seed);
            print!("{}", report::header(&outcome));
            println!("{}", report::summary(&outcome, &violations));
            print!("{}", report::violations(&violations, &reproduce));
            if has(&rest, "--shrink") {
                let oracle = violations[0].oracle;
                let config = common.config(outcome.seed);
                let (requests, faults) = (trace.requests.len(), outcome.faults.len());
                let shrunk = shrink(&trace, &reference, &config, outcome, oracle, SHRINK_RUNS);
                println!(
                    "\nshrunk in {} runs, {} still firing: {} of {requests} requests, {} of \
                     {faults} faults",
                    shrunk.runs,
                    oracle.name(),
                    shrunk.requests.len(),
                    shrunk.faults.len()
                );
                let narrowed = common.narrowed(&shrunk.requests, &shrunk.faults);
                print!(
                    "{}",
                    report::violations(
                        &shrunk.violations,
                        &narrowed.reproduce(shrunk.outcome.seed)
                    )
                );
            }
            Ok(ExitCode::from(1))
        }
    }
}

/// Runs `seeds` in order on `jobs` threads until one breaks an oracle: that run (the lowest such
/// seed, however the jobs interleaved) and its violations, or `None` when every seed held.
pub fn first_violation(
    trace: &SimTrace,
    reference: &Reference,
    seeds: &[u64],
    jobs: usize,
    bar: &ProgressBar,
    config: impl Fn(u64) -> RunConfig + Sync,
) -> Option<(RunOutcome, Vec<Violation>)> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let found: Mutex<Option<(RunOutcome, Vec<Violation>)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = seeds.get(i) else { break };
                    let outcome = run_once(trace, &config(seed));
                    let violations = oracle::check(reference, &outcome);
                    bar.inc(1);
                    if !violations.is_empty() {
                        stop.store(true, Ordering::Relaxed);
                        let mut found = found.lock().expect("no job panics holding it");
                        // Seeds are taken in order, so every lower seed has been or is being
                        // run: keeping the lowest makes the answer independent of the jobs.
                        if found.as_ref().is_none_or(|(o, _)| o.seed > seed) {
                            *found = Some((outcome, violations));
                        }
                    }
                }
            });
        }
    });
    found.into_inner().expect("the jobs are over")
}
