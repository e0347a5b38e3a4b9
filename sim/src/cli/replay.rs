//! `sim replay`: one seed, judged by every oracle; `--check-determinism` runs it twice.

use std::process::ExitCode;

use lockstep_sim::oracle::{self, determinism};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::run as run_once;

use super::{Parsed, has, number, option, refuse_unknown, report};

pub fn run(parsed: Parsed) -> Result<ExitCode, String> {
    let Parsed { common, rest } = parsed;
    refuse_unknown(
        &rest,
        &["--seed", "--json", "--perfetto", "--check-determinism", "--sabotage"],
    )?;
    let seed = option(&rest, "--seed").map(|s| number(s, "--seed")).transpose()?.unwrap_or(0);
    let json = has(&rest, "--json");
    let trace = common.load_trace()?;
    let reproduce = common.reproduce(seed);
    let mut config = common.config(seed);
    // Not in the usage: plants a bug in the simulated device, to see an oracle fire.
    config.sabotage = option(&rest, "--sabotage").map(str::parse).transpose()?;
    let jobs = std::thread::available_parallelism().map_or(1, usize::from);
    let reference = Reference::compute(&trace, common.cost, jobs)?;
    let outcome = run_once(&trace, &config);
    if !json {
        print!(
            "sim replay {} ({} requests)\n{}",
            common.trace_path.display(),
            trace.requests.len(),
            report::header(&outcome)
        );
    }
    let mut violations = oracle::check(&reference, &outcome);
    if has(&rest, "--check-determinism") {
        let again = run_once(&trace, &config);
        violations.extend(determinism::check(&outcome, &again));
    }
    if let Some(path) = option(&rest, "--perfetto") {
        let timeline = lockstep_sim::perfetto::timeline(&trace, &outcome);
        std::fs::write(path, timeline).map_err(|e| format!("--perfetto {path}: {e}"))?;
    }
    if json {
        println!("{}", report::json(&outcome, &violations, &reproduce));
    } else {
        println!("{}", report::summary(&outcome, &violations));
        print!("{}", report::violations(&violations, &reproduce));
    }
    Ok(if violations.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
