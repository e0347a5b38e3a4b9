//! The `sim` command line: options shared by every subcommand, then each subcommand's own file.

mod bench;
mod explore;
mod hunt;
mod replay;
mod report;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::OnceLock;

use lockstep_core::planted::PlantedBug;
use lockstep_sim::device::CostModel;
use lockstep_sim::faults::FaultLevel;
use lockstep_sim::faults::FaultMix;
use lockstep_sim::knobs::Knobs;
use lockstep_sim::knobs::Topology;
use lockstep_sim::run::{RunConfig, context_needed};
use lockstep_sim::shrink;
use lockstep_sim::trace::{self, ImportOptions, SimTrace};

pub const USAGE: &str = "\
usage:
  sim replay TRACE [--seed N] [--topology T] [--faults F] [--json] [--perfetto FILE]
                   [--check-determinism] [TRACE OPTIONS]
  sim explore TRACE --seeds A..B [--jobs N] [--shard K/N] [--shrink] [--topology T] [--faults F]
                   [TRACE OPTIONS]
  sim hunt [--plant CLASS] [--ranges N] [--budget B] [--jobs N]
                   each planted bug class's seeds to detection (a sim built with
                   --features planted-bugs); no --plant: every class
  sim bench TRACE [--seeds A..B] [--topology T] [--faults F] [TRACE OPTIONS]

  --topology single|1p1d|2p2d   what runs (default 1p1d: a router, a prefill and a decode worker)
  --faults none|default|heavy|entry-crashes|all
                                each seed draws its own mix at this level (default: default);
                                entry-crashes: no fault but the router's (or single server's)
                                crashes, the rest judged as without faults; all: heavy's, and
                                the entry's crashes too
  --seeds A..B                  seeds A to B-1
  --shard K/N                   only seeds with (seed - A) % N == K, K from 0: spreads a range
                                over N machines (a CI matrix, a Kubernetes indexed Job)
  --jobs N                      seeds run on N threads (default: the machine's cores)
  --cost FILE                   the step cost model (default: sim/cost_model.json, built in)
  --tick-ms N                   turmoil's tick (default 1): messages are delivered on its
                                boundaries; 2 runs about twice as fast
  --no-fast-forward             step tick by tick through idle spans too (by default one long
                                step crosses each: run.rs, `idle_step`)
  --failed-steps                the device may also fail steps in the fault window (each seed's
                                coin, as for the other faults): their requests end with errors.
                                Off by default: those errors hide wrong outputs
  --plant CLASS                 put back one bug class of shared/bugs.md (`sim hunt` lists
                                them); needs a sim built with --features planted-bugs
  --only-requests LIST, --only-faults LIST
                                only these requests (trace indices) / scheduled faults (as a
                                report numbers them), the rest of the seed unchanged: what
                                `explore --shrink` prints; LIST is 0,3,7 or - for none
TRACE OPTIONS (how the trace becomes requests; a reproduce command repeats them):
  --scale-tokens F  --max-input N  --max-output N  --max-requests N  --vocab N  --token-seed N
  --logit-adjustments  two requests in three get presence/frequency penalties, one in four a
                    logit bias (those with none of their own), one in five a grammar
                    (response_format json_object: the provenance model's synthetic mask)
  --priorities      one request in three gets priority -1, another 2 (those with none of their
                    own): admitted before earlier arrivals or after, preempted by priority
  --logprobs        one request in three asks for log-probabilities (0, 1 or 5 alternatives),
                    held to the request alone's bit for bit like its tokens
  --echo            one request in four asks for echo with log-probabilities: the prompt
                    ahead of the answer and its tokens scored (by the prefill worker in P/D)
TRACE is a native lockstep-trace (JSONL), a Mooncake JSONL, an Azure 2023 CSV, or a WEKA
session JSON or directory. Exit status: 0 when every oracle held, 1 on a violation, 2 on bad
usage or input.";

/// Options every subcommand takes.
#[derive(Clone, Debug)]
pub struct Common {
    pub trace_path: PathBuf,
    pub import: ImportOptions,
    /// The trace options as given, for reproduce commands.
    pub import_args: Vec<String>,
    pub topology: Topology,
    pub faults: FaultLevel,
    pub cost: CostModel,
    pub cost_arg: Option<String>,
    /// turmoil's tick: network deliveries happen on its boundaries (timers fire at their own
    /// times within it); a longer one runs faster.
    pub tick_ms: u64,
    /// Idle spans in one long step each (`RunConfig::fast_forward`).
    pub fast_forward: bool,
    /// The device may fail steps (`RunConfig::failed_steps`).
    pub failed_steps: bool,
    /// A bug class put back (`--plant`), in a sim built with feature `planted-bugs`.
    pub plant: Option<PlantedBug>,
    /// Only these requests of the trace (`--only-requests`, indices in the whole trace; what
    /// `--shrink` left), with the seed's knobs and faults drawn as for the whole trace.
    pub only_requests: Option<BTreeSet<usize>>,
    /// Only these faults of the seed's schedule (`--only-faults`).
    pub only_faults: Option<BTreeSet<usize>>,
    /// The whole trace's context and length, which the seed's draws depend on, once loaded.
    whole: OnceLock<(u32, usize)>,
}

impl Common {
    pub fn load_trace(&self) -> Result<SimTrace, String> {
        let trace = trace::load(&self.trace_path, &self.import)?;
        if trace.requests.is_empty() {
            return Err(format!("{}: no requests", self.trace_path.display()));
        }
        let Some(only) = &self.only_requests else { return Ok(trace) };
        if let Some(&past) = only.iter().find(|&&i| i >= trace.requests.len()) {
            return Err(format!("--only-requests: the trace has no request {past}"));
        }
        if !shrink::closed(&trace, only) {
            return Err("--only-requests: a kept request waits on one that is not kept".into());
        }
        // Cannot be set already: load_trace runs once per command.
        let _ = self.whole.set((context_needed(&trace), trace.requests.len()));
        Ok(shrink::sub_trace(&trace, only))
    }

    /// These options with only `requests` (positions in the loaded trace) and `faults` kept.
    pub fn narrowed(&self, requests: &BTreeSet<usize>, faults: &BTreeSet<usize>) -> Common {
        let mut narrowed = self.clone();
        let original: Vec<usize> = match &self.only_requests {
            Some(only) => only.iter().copied().collect(),
            None => (0..=requests.last().copied().unwrap_or(0)).collect(),
        };
        narrowed.only_requests = Some(requests.iter().map(|&i| original[i]).collect());
        narrowed.only_faults = Some(faults.clone());
        narrowed
    }

    /// How to run `seed` with these options.
    pub fn config(&self, seed: u64) -> RunConfig {
        let mut config = RunConfig::new(seed, self.topology, self.faults);
        config.cost = self.cost;
        config.tick = std::time::Duration::from_millis(self.tick_ms);
        config.fast_forward = self.fast_forward;
        config.failed_steps = self.failed_steps;
        config.plant = self.plant;
        config.only_faults = self.only_faults.clone();
        if let Some(&(context, requests)) = self.whole.get() {
            let knobs = Knobs::draw(seed, context, requests);
            let flight = knobs.timing.write_flight_max;
            let failed_steps = self.failed_steps;
            config.mix =
                Some(FaultMix::draw(seed, self.faults, self.topology, flight, failed_steps));
            config.knobs = Some(knobs);
        }
        config
    }

    /// `sim replay` of one seed with these options: how to reproduce it.
    pub fn reproduce(&self, seed: u64) -> String {
        let mut command = format!(
            "sim replay {} --seed {seed} --topology {} --faults {}",
            self.trace_path.display(),
            self.topology,
            self.faults
        );
        let cost = self.cost_arg.iter().flat_map(|c| ["--cost", c.as_str()]);
        for arg in self.import_args.iter().map(String::as_str).chain(cost) {
            command.push(' ');
            command.push_str(arg);
        }
        if let Some(bug) = self.plant {
            command.push_str(&format!(" --plant {bug}"));
        }
        if let Some(only) = &self.only_requests {
            command.push_str(&format!(" --only-requests {}", list(only)));
        }
        if let Some(only) = &self.only_faults {
            command.push_str(&format!(" --only-faults {}", list(only)));
        }
        if self.tick_ms != 1 {
            command.push_str(&format!(" --tick-ms {}", self.tick_ms));
        }
        if !self.fast_forward {
            command.push_str(" --no-fast-forward");
        }
        if self.failed_steps {
            command.push_str(" --failed-steps");
        }
        command
    }
}

/// Splits `args` into the common options and the rest (`--flag value` pairs and lone flags).
pub struct Parsed {
    pub common: Common,
    pub rest: Vec<(String, Option<String>)>,
}

const LONE_FLAGS: &[&str] = &["--json", "--check-determinism", "--shrink"];

/// Sets an import option.
type SwitchOn = fn(&mut ImportOptions);

/// The trace options that are a flag alone, each switching on what some requests send; a
/// reproduce command repeats them.
const IMPORT_SWITCHES: [(&str, SwitchOn); 4] = [
    ("--logit-adjustments", |o| o.logit_adjustments = true),
    ("--priorities", |o| o.priorities = true),
    ("--logprobs", |o| o.logprobs = true),
    ("--echo", |o| o.echo = true),
];

pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut trace_path = None;
    let mut import = ImportOptions::default();
    let mut import_args = Vec::new();
    let mut topology = Topology::OneP1D;
    let mut faults = FaultLevel::Default;
    let mut cost = CostModel::default_model();
    let mut cost_arg = None;
    let mut tick_ms = 1;
    let mut plant = None;
    let (mut only_requests, mut only_faults) = (None, None);
    let mut fast_forward = true;
    let mut failed_steps = false;
    let mut rest = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if !flag.starts_with("--") {
            if trace_path.replace(PathBuf::from(flag)).is_some() {
                return Err(format!("one trace at a time ({flag:?} is a second)"));
            }
            i += 1;
            continue;
        }
        if flag == "--no-fast-forward" {
            fast_forward = false;
            i += 1;
            continue;
        }
        if flag == "--failed-steps" {
            failed_steps = true;
            i += 1;
            continue;
        }
        if let Some((_, switch_on)) = IMPORT_SWITCHES.iter().find(|(name, _)| *name == flag) {
            switch_on(&mut import);
            import_args.push(flag.to_owned());
            i += 1;
            continue;
        }
        if LONE_FLAGS.contains(&flag) {
            rest.push((flag.to_owned(), None));
            i += 1;
            continue;
        }
        let value = args.get(i + 1).ok_or_else(|| format!("{flag} needs a value"))?.clone();
        i += 2;
        let mut import_flag = true;
        match flag {
            "--scale-tokens" => import.scale_tokens = number(&value, flag)?,
            "--max-input" => import.max_input = Some(number(&value, flag)?),
            "--max-output" => import.max_output = Some(number(&value, flag)?),
            "--max-requests" => import.max_requests = Some(number(&value, flag)?),
            "--vocab" => import.vocab_size = number(&value, flag)?,
            "--token-seed" => import.seed = number(&value, flag)?,
            _ => import_flag = false,
        }
        if import_flag {
            import_args.push(flag.to_owned());
            import_args.push(value);
            continue;
        }
        match flag {
            "--topology" => topology = value.parse()?,
            "--tick-ms" => {
                tick_ms = number(&value, flag)?;
                if tick_ms == 0 {
                    return Err("--tick-ms: at least 1".into());
                }
            }
            "--faults" => faults = value.parse()?,
            "--plant" => plant = Some(planted_bug(&value)?),
            "--only-requests" => only_requests = Some(indices(&value, flag)?),
            "--only-faults" => only_faults = Some(indices(&value, flag)?),
            "--cost" => {
                cost = CostModel::load(std::path::Path::new(&value))?;
                cost_arg = Some(value);
            }
            _ => rest.push((flag.to_owned(), Some(value))),
        }
    }
    let trace_path = trace_path.ok_or("no trace given")?;
    Ok(Parsed {
        common: Common {
            trace_path,
            import,
            import_args,
            topology,
            faults,
            cost,
            cost_arg,
            tick_ms,
            fast_forward,
            failed_steps,
            plant,
            only_requests,
            only_faults,
            whole: OnceLock::new(),
        },
        rest,
    })
}

/// `--plant CLASS`: only a sim built with feature `planted-bugs` has the bugs to plant.
fn planted_bug(name: &str) -> Result<PlantedBug, String> {
    let bug = name.parse()?;
    if cfg!(feature = "planted-bugs") {
        Ok(bug)
    } else {
        Err(format!(
            "--plant {bug}: this sim was built without the planted bugs; run it as \
             `cargo run --release -p lockstep-sim --features planted-bugs --bin sim -- ...`"
        ))
    }
}

/// `0,3,7`: indices (an empty list is `-`).
fn indices(text: &str, flag: &str) -> Result<BTreeSet<usize>, String> {
    if text == "-" {
        return Ok(BTreeSet::new());
    }
    text.split(',').map(|i| number(i, flag)).collect()
}

fn list(indices: &BTreeSet<usize>) -> String {
    if indices.is_empty() {
        return "-".into();
    }
    indices.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

pub fn number<T: std::str::FromStr>(text: &str, flag: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{flag}: {text:?} is not a valid number"))
}

/// `A..B`: seeds A to B-1.
pub fn seed_range(text: &str) -> Result<std::ops::Range<u64>, String> {
    let (a, b) = text.split_once("..").ok_or_else(|| format!("--seeds: {text:?} is not A..B"))?;
    let (a, b) = (number(a, "--seeds")?, number(b, "--seeds")?);
    if a >= b {
        return Err(format!("--seeds: {text:?} is empty"));
    }
    Ok(a..b)
}

pub fn run(args: &[String]) -> Result<ExitCode, String> {
    let Some((command, rest)) = args.split_first() else {
        return Err(USAGE.into());
    };
    match command.as_str() {
        "replay" => replay::run(parse(rest)?),
        "explore" => explore::run(parse(rest)?),
        "bench" => bench::run(parse(rest)?),
        "hunt" => hunt::run(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        other => Err(format!("unknown command {other:?}\n{USAGE}")),
    }
}

/// Refuses options the subcommand does not take.
pub fn refuse_unknown(rest: &[(String, Option<String>)], known: &[&str]) -> Result<(), String> {
    match rest.iter().find(|(flag, _)| !known.contains(&flag.as_str())) {
        Some((flag, _)) => Err(format!("unknown option {flag}\n{USAGE}")),
        None => Ok(()),
    }
}

pub fn option<'a>(rest: &'a [(String, Option<String>)], flag: &str) -> Option<&'a str> {
    rest.iter().find(|(f, _)| f == flag).and_then(|(_, v)| v.as_deref())
}

pub fn has(rest: &[(String, Option<String>)], flag: &str) -> bool {
    rest.iter().any(|(f, _)| f == flag)
}
