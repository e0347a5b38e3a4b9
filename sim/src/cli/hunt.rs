//! `sim hunt`: how many seeds the simulator needs to catch each planted bug class. For every
//! class (or `--plant CLASS`), its scenario (sim/src/plants.rs) is explored from `--ranges`
//! starting points a million seeds apart, up to `--budget` seeds each; a row gives the seeds to
//! first detection from each start, their median, the median wall time to detection, the oracle
//! that fired, and whether each detecting seed holds every oracle with the bug not planted.
//! The rows are BENCHMARKS.md's table. Needs a sim built with feature `planted-bugs`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use lockstep_core::planted::PlantedBug;
use lockstep_sim::oracle;
use lockstep_sim::plants::{self, Scenario};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::run as run_once;
use lockstep_sim::trace::SimTrace;

use super::explore::first_violation;
use super::{Common, number, option, parse, refuse_unknown};

/// Seed ranges start this far apart, so they share no seed.
const RANGE_STRIDE: u64 = 1_000_000;

pub fn run(args: &[String]) -> Result<ExitCode, String> {
    let parsed = parse_hunt(args)?;
    let bugs = match parsed.plant {
        Some(bug) => vec![bug],
        None => PlantedBug::ALL.to_vec(),
    };
    if !cfg!(feature = "planted-bugs") {
        return Err("sim hunt plants bugs: run it from a sim built with --features planted-bugs \
                    (cargo run --release -p lockstep-sim --features planted-bugs --bin sim -- \
                    hunt)"
            .into());
    }
    println!(
        "| class | scenario | seeds to detection ({} ranges of ≤ {} seeds) | median | median \
         wall to detection | oracle | clean unplanted |",
        parsed.ranges, parsed.budget
    );
    println!("|---|---|---|---|---|---|---|");
    let mut loaded: BTreeMap<String, (SimTrace, Reference)> = BTreeMap::new();
    let mut all_caught = true;
    let mut reproduce = Vec::new();
    for bug in bugs {
        let scenario = plants::scenario(bug);
        let common = common_of(bug, &scenario)?;
        let key = format!("{} {:?}", scenario.trace, scenario.import);
        if !loaded.contains_key(&key) {
            let trace = common.load_trace()?;
            let reference = Reference::compute(&trace, common.cost, parsed.jobs)?;
            loaded.insert(key.clone(), (trace, reference));
        }
        let (trace, reference) = &loaded[&key];
        let mut seeds_to_detection = Vec::new();
        let mut walls = Vec::new();
        let mut oracles = Vec::new();
        let mut clean = true;
        for range in 0..parsed.ranges {
            let start = range * RANGE_STRIDE;
            let seeds: Vec<u64> = (start..start + parsed.budget).collect();
            // The one wall-clock read: how long detection took, for the table.
            #[allow(clippy::disallowed_methods)]
            let began = Instant::now();
            let found = first_violation(
                trace,
                reference,
                &seeds,
                parsed.jobs,
                &ProgressBar::hidden(),
                |seed| common.config(seed),
            );
            let wall = began.elapsed();
            match found {
                None => seeds_to_detection.push(None),
                Some((outcome, violations)) => {
                    seeds_to_detection.push(Some(outcome.seed - start + 1));
                    walls.push(wall);
                    oracles.push(violations[0].oracle.name());
                    if range == 0 {
                        reproduce.push(common.reproduce(outcome.seed));
                    }
                    let mut unplanted = common.config(outcome.seed);
                    unplanted.plant = None;
                    clean &= oracle::check(reference, &run_once(trace, &unplanted)).is_empty();
                }
            }
        }
        all_caught &= seeds_to_detection.iter().all(Option::is_some) && clean;
        oracles.sort_unstable();
        oracles.dedup();
        println!(
            "| {bug} | {} | {} | {} | {} | {} | {} |",
            describe(&scenario),
            seeds_to_detection
                .iter()
                .map(|n| n.map_or_else(|| format!(">{}", parsed.budget), |n| n.to_string()))
                .collect::<Vec<_>>()
                .join(", "),
            median(&seeds_to_detection)
                .map_or_else(|| format!(">{}", parsed.budget), |n| n.to_string()),
            median_wall(&walls),
            oracles.join(", "),
            if clean { "yes" } else { "NO" }
        );
    }
    println!();
    for command in reproduce {
        println!("  {command}");
    }
    Ok(if all_caught { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

struct Hunt {
    plant: Option<PlantedBug>,
    ranges: u64,
    budget: u64,
    jobs: usize,
}

fn parse_hunt(args: &[String]) -> Result<Hunt, String> {
    let mut rest = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].clone();
        let value = args.get(i + 1).ok_or_else(|| format!("{flag} needs a value"))?.clone();
        rest.push((flag, Some(value)));
        i += 2;
    }
    refuse_unknown(&rest, &["--plant", "--ranges", "--budget", "--jobs"])?;
    let number_or = |flag: &str, default: u64| -> Result<u64, String> {
        option(&rest, flag).map_or(Ok(default), |v| number(v, flag))
    };
    Ok(Hunt {
        plant: option(&rest, "--plant").map(str::parse).transpose()?,
        ranges: number_or("--ranges", 5)?.max(1),
        budget: number_or("--budget", 10_000)?.max(1),
        jobs: option(&rest, "--jobs")
            .map(|j| number::<usize>(j, "--jobs"))
            .transpose()?
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
            .max(1),
    })
}

/// The scenario as `sim explore` options, parsed as the command line would be, so the
/// reproduce commands are the ones `sim explore` prints.
fn common_of(bug: PlantedBug, scenario: &Scenario) -> Result<Common, String> {
    let mut args = vec![
        scenario.trace.to_owned(),
        "--topology".into(),
        scenario.topology.to_string(),
        "--faults".into(),
        scenario.faults.to_string(),
        "--plant".into(),
        bug.name().into(),
    ];
    args.extend(scenario.import.iter().map(|a| a.to_string()));
    Ok(parse(&args)?.common)
}

fn describe(scenario: &Scenario) -> String {
    let trace = scenario.trace.trim_start_matches("traces/");
    let mut text = format!("{trace} {} {}", scenario.topology, scenario.faults);
    for arg in scenario.import {
        text.push(' ');
        text.push_str(arg);
    }
    text
}

/// The median of the counts, a range that found nothing counting as more than any that did.
fn median(counts: &[Option<u64>]) -> Option<u64> {
    let mut sorted: Vec<u64> = counts.iter().map(|n| n.unwrap_or(u64::MAX)).collect();
    sorted.sort_unstable();
    let middle = sorted[sorted.len() / 2];
    (middle != u64::MAX).then_some(middle)
}

fn median_wall(walls: &[Duration]) -> String {
    let mut sorted = walls.to_vec();
    sorted.sort_unstable();
    match sorted.get(sorted.len() / 2) {
        Some(wall) => format!("{:.1} s", wall.as_secs_f64()),
        None => "—".into(),
    }
}
