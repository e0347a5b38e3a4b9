//! `sim bench`: how fast simulation goes on this trace, and what bounds it. turmoil steps every
//! host every tick whether it has work or not, so wall time grows with hosts x virtual time /
//! tick; the report splits a run's wall time into turmoil steps and the cost of one.

use std::process::ExitCode;

use lockstep_sim::run::run as run_once;

use super::{Parsed, option, refuse_unknown, report, seed_range};

pub fn run(parsed: Parsed) -> Result<ExitCode, String> {
    let Parsed { common, rest } = parsed;
    refuse_unknown(&rest, &["--seeds"])?;
    let seeds = seed_range(option(&rest, "--seeds").unwrap_or("0..5"))?;
    let trace = common.load_trace()?;
    let hosts = 1 + match common.topology {
        lockstep_sim::knobs::Topology::Single => 1,
        lockstep_sim::knobs::Topology::OneP1D => 3,
        lockstep_sim::knobs::Topology::TwoP2D => 5,
    };
    println!(
        "sim bench {}: {} requests, topology {} ({hosts} hosts with the clients), faults {}, one \
         core",
        common.trace_path.display(),
        trace.requests.len(),
        common.topology,
        common.faults
    );
    println!(
        "{:>6} {:>10} {:>9} {:>8} {:>10} {:>13} {:>9}",
        "seed", "virtual s", "wall s", "speed", "steps", "us/host-step", "completed"
    );
    let (mut virtual_total, mut wall_total) = (0.0, 0.0);
    for seed in seeds.clone() {
        let config = common.config(seed);
        let outcome = run_once(&trace, &config);
        let (v, w) = (outcome.virtual_time.as_secs_f64(), outcome.wall_time.as_secs_f64());
        virtual_total += v;
        wall_total += w;
        println!(
            "{seed:>6} {v:>10.3} {w:>9.3} {:>7.1}x {:>10} {:>13.2} {:>9}",
            v / w.max(1e-9),
            outcome.steps,
            w * 1e6 / (outcome.steps.max(1) * hosts) as f64,
            report::Endings::of(&outcome).completed,
        );
    }
    let n = (seeds.end - seeds.start) as f64;
    println!(
        "total: virtual {virtual_total:.3} s, wall {wall_total:.3} s, speed {:.1}x real time, {:.2} \
         seeds/s",
        virtual_total / wall_total.max(1e-9),
        n / wall_total.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
