//! `sim explore`: many seeds, each its own knobs and faults, on `--jobs` threads; stops at the
//! first violation and prints the command that reproduces it. `--shard K/N` takes every N-th seed
//! of the range, so machines can split one range.

use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use lockstep_sim::oracle::{self, Violation};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunOutcome, run as run_once};

use super::{Parsed, number, option, refuse_unknown, report, seed_range};

pub fn run(parsed: Parsed) -> Result<ExitCode, String> {
    let Parsed { common, rest } = parsed;
    refuse_unknown(&rest, &["--seeds", "--jobs", "--shard"])?;
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
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let found: Mutex<Option<(RunOutcome, Vec<Violation>)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = seeds.get(i) else { break };
                    let config = common.config(seed);
                    let outcome = run_once(&trace, &config);
                    let violations = oracle::check(&reference, &outcome);
                    bar.inc(1);
                    if !violations.is_empty() {
                        stop.store(true, Ordering::Relaxed);
                        let mut found = found.lock().expect("no job panics holding it");
                        // Several jobs may find one: keep the lowest seed, so the report is the
                        // same however the jobs interleaved.
                        if found.as_ref().is_none_or(|(o, _)| o.seed > seed) {
                            *found = Some((outcome, violations));
                        }
                    }
                }
            });
        }
    });
    bar.finish_and_clear();
    let found = found.into_inner().expect("the jobs are over");
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
            Ok(ExitCode::from(1))
        }
    }
}
