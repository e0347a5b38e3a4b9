//! `sim bench`: how fast simulation goes on this trace, and what bounds it. turmoil steps every
//! host every step whether it has work or not, so wall time grows with hosts x steps; a step is a
//! tick (1 ms) while anything is going on, and one long step crosses each idle span (the
//! fast-forward, `--no-fast-forward` to compare). The report splits a run's wall time into turmoil
//! steps and the cost of one, and says how much virtual time the long steps covered.

use std::process::ExitCode;
use std::time::Duration;

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
        "sim bench {}: {} requests, topology {} ({hosts} hosts with the clients), faults {}, tick \
         {} ms, fast-forward {}, one core",
        common.trace_path.display(),
        trace.requests.len(),
        common.topology,
        common.faults,
        common.tick_ms,
        if common.fast_forward { "on" } else { "off" },
    );
    println!(
        "{:>6} {:>10} {:>9} {:>8} {:>10} {:>10} {:>10} {:>13} {:>9}",
        "seed",
        "virtual s",
        "wall s",
        "speed",
        "steps",
        "long",
        "long cover",
        "us/host-step",
        "completed"
    );
    let (mut virtual_total, mut wall_total) = (0.0, 0.0);
    let (mut steps_total, mut long_total, mut covered_total) = (0, 0, Duration::ZERO);
    for seed in seeds.clone() {
        let config = common.config(seed);
        let outcome = run_once(&trace, &config);
        let (v, w) = (outcome.virtual_time.as_secs_f64(), outcome.wall_time.as_secs_f64());
        virtual_total += v;
        wall_total += w;
        steps_total += outcome.steps;
        long_total += outcome.long_steps;
        covered_total += outcome.fast_forwarded;
        println!(
            "{seed:>6} {v:>10.3} {w:>9.3} {:>7.1}x {:>10} {:>10} {:>9.1}% {:>13.2} {:>9}",
            v / w.max(1e-9),
            outcome.steps,
            outcome.long_steps,
            100.0 * outcome.fast_forwarded.as_secs_f64() / v.max(1e-9),
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
    let ticked = steps_total - long_total;
    println!(
        "what bounds it: {steps_total} turmoil steps x {hosts} hosts at {:.2} us a host-step; \
         {long_total} long steps covered {:.1}% of virtual time, the other {ticked} steps are \
         ticks (something on the network, held, or out)",
        wall_total * 1e6 / (steps_total.max(1) * hosts) as f64,
        100.0 * covered_total.as_secs_f64() / virtual_total.max(1e-9),
    );
    Ok(ExitCode::SUCCESS)
}
