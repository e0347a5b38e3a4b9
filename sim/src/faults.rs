//! The faults of one run (swarm testing: each seed draws which kinds are on and how hard), as a
//! schedule the run applies between turmoil steps, plus the per-request and per-step draws the
//! clients and runners make. Every fault ends inside the safety window; after it, the liveness
//! phase runs without faults.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::knobs::Topology;
use crate::rng::SimRng;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultLevel {
    None,
    Default,
    Heavy,
    /// No fault but the entry's crashes: a calm run whose router (or single server) restarts.
    /// What a crash loses is the fault's; everything else is judged as calm (`FaultMix::is_calm`).
    EntryCrashes,
    /// Heavy's faults, and the entry's crashes among them (each seed's coin): the workers must
    /// let go of a dead router's work while links fail and workers crash.
    All,
}

impl FromStr for FaultLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<FaultLevel, String> {
        match s {
            "none" => Ok(FaultLevel::None),
            "default" => Ok(FaultLevel::Default),
            "heavy" => Ok(FaultLevel::Heavy),
            "entry-crashes" => Ok(FaultLevel::EntryCrashes),
            "all" => Ok(FaultLevel::All),
            other => {
                Err(format!("faults {other:?} is not none, default, heavy, entry-crashes or all"))
            }
        }
    }
}

impl fmt::Display for FaultLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FaultLevel::None => "none",
            FaultLevel::Default => "default",
            FaultLevel::Heavy => "heavy",
            FaultLevel::EntryCrashes => "entry-crashes",
            FaultLevel::All => "all",
        })
    }
}

/// How hard each kind of fault hits in this run; zero is off.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultMix {
    /// Faults start and end inside `[0, window)`; the liveness phase follows.
    pub window: Duration,
    /// Every message's latency is drawn in `[0, latency_max]` (turmoil's curve), all run long.
    pub latency_max: Duration,
    pub partitions: u32,
    pub holds: u32,
    /// Crashes of workers.
    pub crashes: u32,
    /// Crashes of the host clients talk to (the router, or the single server): the requests it
    /// held are lost with it, and their clients hear nothing more.
    pub entry_crashes: u32,
    /// The longest a partition, hold or crash lasts.
    pub outage_max: Duration,
    /// Share of requests whose client goes away, at a moment in `[0, cancel_within]` after
    /// sending, to the millisecond.
    pub cancel_rate: f64,
    pub cancel_within: Duration,
    /// Share of steps that take `slow_step_extra` longer (inside the window only).
    pub slow_step_rate: f64,
    pub slow_step_extra: Duration,
    /// Share of steps the device fails after running them (inside the window only): every
    /// request in such a step ends with an error, as on a device error or a lost readback.
    pub failed_step_rate: f64,
    /// How late the prefill workers' KV lanes deliver during some of the window (their control
    /// links are not slowed): writes that land past the flight bound, after protocol messages
    /// sent later. Zero is off.
    pub kv_lane_delay: Duration,
}

impl FaultMix {
    pub const NONE: FaultMix = FaultMix {
        window: Duration::ZERO,
        latency_max: Duration::ZERO,
        partitions: 0,
        holds: 0,
        crashes: 0,
        entry_crashes: 0,
        outage_max: Duration::ZERO,
        cancel_rate: 0.0,
        cancel_within: Duration::ZERO,
        slow_step_rate: 0.0,
        slow_step_extra: Duration::ZERO,
        failed_step_rate: 0.0,
        kv_lane_delay: Duration::ZERO,
    };

    /// This seed's mix: each kind on or off by a coin, its strength drawn; `heavy` turns more on
    /// and harder. `write_flight_max` is the run's flight bound (late writes go past it).
    /// Failed steps only with `failed_steps` (`sim --failed-steps`): a step's failure ends its
    /// requests with errors, which would hide the wrong outputs the other faults are there to
    /// provoke (three planted bug classes went unseen at their seeds with it always drawn).
    pub fn draw(
        seed: u64,
        level: FaultLevel,
        topology: Topology,
        write_flight_max: Duration,
        failed_steps: bool,
    ) -> FaultMix {
        let mut rng = SimRng::stream(seed, "fault-mix");
        let (on, scale) = match level {
            FaultLevel::None => return FaultMix::NONE,
            FaultLevel::EntryCrashes => {
                let window = rng.millis(Duration::from_secs(5), Duration::from_secs(30));
                let outage_max = rng.millis(Duration::from_millis(50), Duration::from_secs(3));
                let entry_crashes = 1 + rng.below(2) as u32;
                return FaultMix { window, entry_crashes, outage_max, ..FaultMix::NONE };
            }
            FaultLevel::Default => (0.5, 1),
            FaultLevel::Heavy => (0.8, 3),
            FaultLevel::All => {
                let heavy = FaultMix::draw(
                    seed,
                    FaultLevel::Heavy,
                    topology,
                    write_flight_max,
                    failed_steps,
                );
                // From a stream of its own: the rest is the seed's heavy mix.
                let mut entry = SimRng::stream(seed, "entry-crashes");
                let entry_crashes = if entry.chance(0.8) { 1 + entry.below(3) as u32 } else { 0 };
                return FaultMix { entry_crashes, ..heavy };
            }
        };
        let coin = |rng: &mut SimRng| rng.chance(on);
        let disaggregated = topology != Topology::Single;
        let window = rng.millis(Duration::from_secs(5), Duration::from_secs(30));
        let latency_max = if coin(&mut rng) {
            rng.millis(Duration::from_millis(1), Duration::from_millis(20))
        } else {
            Duration::from_millis(1)
        };
        let partitions =
            if disaggregated && coin(&mut rng) { 1 + rng.below(3) as u32 * scale } else { 0 };
        let holds =
            if disaggregated && coin(&mut rng) { 1 + rng.below(3) as u32 * scale } else { 0 };
        let crashes =
            if disaggregated && coin(&mut rng) { 1 + rng.below(2) as u32 * scale } else { 0 };
        let outage_max = rng.millis(Duration::from_millis(50), Duration::from_secs(3));
        let cancel = coin(&mut rng);
        let cancel_rate = if cancel { 0.05 * f64::from(scale) * (0.5 + rng.unit()) } else { 0.0 };
        let cancel_within = rng.millis(Duration::from_millis(1), Duration::from_millis(500));
        let slow = coin(&mut rng);
        let slow_step_rate = if slow { 0.02 * f64::from(scale) } else { 0.0 };
        let slow_step_extra = rng.millis(Duration::from_millis(10), Duration::from_millis(500));
        let kv_lane_delay = if disaggregated && coin(&mut rng) {
            write_flight_max + rng.millis(Duration::ZERO, write_flight_max)
        } else {
            Duration::ZERO
        };
        // From a stream of its own: the faults drawn before it existed keep their seeds.
        let mut failing = SimRng::stream(seed, "failed-steps");
        let failed_step_rate =
            if failed_steps && failing.chance(on) { 0.005 * f64::from(scale) } else { 0.0 };
        FaultMix {
            window,
            latency_max,
            partitions,
            holds,
            crashes,
            // Only at their own level: every request the entry holds is lost with it, unchecked
            // by equal-alone, and the planted classes' seeds were measured without them.
            entry_crashes: 0,
            outage_max,
            cancel_rate: cancel_rate.min(0.9),
            cancel_within,
            slow_step_rate,
            slow_step_extra,
            failed_step_rate,
            kv_lane_delay,
        }
    }
}

impl FaultMix {
    /// Whether nothing in this mix can fail a transfer's attempt: the network, the workers and
    /// their devices are faultless, and at most the entry crashes (which ends the requests it
    /// holds, as their clients see, and starts a router that has never sent a transfer).
    pub fn is_calm(&self) -> bool {
        let without_entry = FaultMix {
            window: Duration::ZERO,
            entry_crashes: 0,
            outage_max: Duration::ZERO,
            ..self.clone()
        };
        without_entry == FaultMix::NONE
    }
}

impl fmt::Display for FaultMix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "window={}ms latency_max={}ms partitions={} holds={} crashes={} entry_crashes={} \
             outage_max={}ms \
             cancel_rate={:.3} cancel_within={}ms slow_steps={:.3}x+{}ms failed_steps={:.3} \
             kv_lane_delay={}ms",
            self.window.as_millis(),
            self.latency_max.as_millis(),
            self.partitions,
            self.holds,
            self.crashes,
            self.entry_crashes,
            self.outage_max.as_millis(),
            self.cancel_rate,
            self.cancel_within.as_millis(),
            self.slow_step_rate,
            self.slow_step_extra.as_millis(),
            self.failed_step_rate,
            self.kv_lane_delay.as_millis(),
        )
    }
}

/// What the run does to the network or a host at a moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    Partition(String, String),
    Repair(String, String),
    Hold(String, String),
    Release(String, String),
    Crash(String),
    Restart(String),
    /// A prefill host's KV lanes deliver this late (`None`: back on time).
    KvLanesSlow(String, Option<Duration>),
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultAction::Partition(a, b) => write!(f, "partition {a} {b}"),
            FaultAction::Repair(a, b) => write!(f, "repair {a} {b}"),
            FaultAction::Hold(a, b) => write!(f, "hold {a} {b}"),
            FaultAction::Release(a, b) => write!(f, "release {a} {b}"),
            FaultAction::Crash(h) => write!(f, "crash {h}"),
            FaultAction::Restart(h) => write!(f, "restart {h}"),
            FaultAction::KvLanesSlow(h, Some(d)) => {
                write!(f, "KV lanes of {h} late by {}ms", d.as_millis())
            }
            FaultAction::KvLanesSlow(h, None) => write!(f, "KV lanes of {h} back on time"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledFault {
    pub at: Duration,
    pub action: FaultAction,
    /// The outage this starts or ends: the run skips an outage whose link or host is already
    /// out, start and end both.
    pub outage: u32,
}

/// The run's network and host faults in time order: each outage's start and its end, both
/// inside the window. `links` are the pairs of hosts that talk to each other; `workers` the hosts
/// that may crash; `entry` the host clients talk to; `kv_senders` the hosts whose KV lanes may
/// run late (the prefill workers).
pub fn schedule(
    seed: u64,
    mix: &FaultMix,
    links: &[(String, String)],
    workers: &[String],
    entry: &str,
    kv_senders: &[String],
) -> Vec<ScheduledFault> {
    let mut rng = SimRng::stream(seed, "fault-schedule");
    let mut faults = Vec::new();
    let mut next_outage = 0;
    let mut outage = |rng: &mut SimRng, start: fn(&str, &str) -> (FaultAction, FaultAction)| {
        let (a, b) = links[rng.below(links.len() as u64) as usize].clone();
        let (begin, end) = start(&a, &b);
        let (at, until) = span(rng, mix);
        next_outage += 1;
        [
            ScheduledFault { at, action: begin, outage: next_outage },
            ScheduledFault { at: until, action: end, outage: next_outage },
        ]
    };
    if !links.is_empty() {
        for _ in 0..mix.partitions {
            faults.extend(outage(&mut rng, |a, b| {
                (
                    FaultAction::Partition(a.into(), b.into()),
                    FaultAction::Repair(a.into(), b.into()),
                )
            }));
        }
        for _ in 0..mix.holds {
            faults.extend(outage(&mut rng, |a, b| {
                (FaultAction::Hold(a.into(), b.into()), FaultAction::Release(a.into(), b.into()))
            }));
        }
    }
    let mut outage = 1000;
    if !workers.is_empty() {
        for _ in 0..mix.crashes {
            let host = workers[rng.below(workers.len() as u64) as usize].clone();
            let (at, until) = span(&mut rng, mix);
            outage += 1;
            faults.push(ScheduledFault { at, action: FaultAction::Crash(host.clone()), outage });
            faults.push(ScheduledFault { at: until, action: FaultAction::Restart(host), outage });
        }
    }
    if !mix.kv_lane_delay.is_zero() && !kv_senders.is_empty() {
        // One sender's data path congested for a while, a quarter of the window to all of it:
        // transfers of every kind (cancelled, aborted, crashing) have writes still on their way,
        // while the other senders' writes and every protocol message arrive on time.
        let host = kv_senders[rng.below(kv_senders.len() as u64) as usize].clone();
        let length = rng.millis(mix.window / 4, mix.window);
        let at = rng.millis(Duration::ZERO, mix.window - length);
        let until = at + length;
        let delay = Some(mix.kv_lane_delay);
        outage += 1;
        let slow = FaultAction::KvLanesSlow(host.clone(), delay);
        faults.push(ScheduledFault { at, action: slow, outage });
        let on_time = FaultAction::KvLanesSlow(host, None);
        faults.push(ScheduledFault { at: until, action: on_time, outage });
    }
    // From a stream of its own, as the mix draws them: the other faults keep their seeds.
    let mut entry_rng = SimRng::stream(seed, "entry-crash-schedule");
    for _ in 0..mix.entry_crashes {
        let (at, until) = span(&mut entry_rng, mix);
        outage += 1;
        faults.push(ScheduledFault { at, action: FaultAction::Crash(entry.into()), outage });
        faults.push(ScheduledFault {
            at: until,
            action: FaultAction::Restart(entry.into()),
            outage,
        });
    }
    // Stable: equal times keep the order drawn.
    faults.sort_by_key(|f| f.at);
    faults
}

/// An outage's start and end inside the window.
fn span(rng: &mut SimRng, mix: &FaultMix) -> (Duration, Duration) {
    let length = rng.millis(Duration::from_millis(10), mix.outage_max);
    let latest_start = mix.window.saturating_sub(length);
    let at = rng.millis(Duration::ZERO, latest_start);
    (at, (at + length).min(mix.window))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_end_inside_the_window_and_none_means_none() {
        let links = vec![("router".to_owned(), "prefill1".to_owned())];
        let workers = vec!["prefill1".to_owned()];
        for seed in 0..200 {
            let mix = FaultMix::draw(
                seed,
                FaultLevel::Heavy,
                Topology::OneP1D,
                Duration::from_millis(250),
                true,
            );
            let faults = schedule(seed, &mix, &links, &workers, "router", &workers);
            assert!(faults.iter().all(|f| f.at <= mix.window), "{seed}: {faults:?}");
            assert!(faults.windows(2).all(|w| w[0].at <= w[1].at));
            assert_eq!(faults, schedule(seed, &mix, &links, &workers, "router", &workers));
        }
        let none =
            FaultMix::draw(1, FaultLevel::None, Topology::OneP1D, Duration::from_millis(250), true);
        assert!(schedule(1, &none, &links, &workers, "router", &workers).is_empty());
        assert_eq!(none.cancel_rate, 0.0);
        assert_eq!(none.failed_step_rate, 0.0);
        // Failed steps only when asked for, and then every other fault as drawn without them.
        for seed in 0..50 {
            let flight = Duration::from_millis(250);
            let without = FaultMix::draw(seed, FaultLevel::Heavy, Topology::TwoP2D, flight, false);
            let with = FaultMix::draw(seed, FaultLevel::Heavy, Topology::TwoP2D, flight, true);
            assert_eq!(without.failed_step_rate, 0.0);
            assert_eq!(FaultMix { failed_step_rate: 0.0, ..with }, without, "{seed}");
        }
    }

    /// The entry's crashes come from streams of their own: with them or without, every other
    /// fault of a seed is the same. Their own level draws nothing else; level all draws the
    /// seed's heavy mix beside them.
    #[test]
    fn entry_crashes_leave_every_other_fault_as_drawn() {
        let links = vec![("router".to_owned(), "prefill1".to_owned())];
        let workers = vec!["prefill1".to_owned()];
        let flight = Duration::from_millis(250);
        let of_entry = |f: &ScheduledFault| match &f.action {
            FaultAction::Crash(h) | FaultAction::Restart(h) => h == "router",
            _ => false,
        };
        let mut drawn = 0;
        for seed in 0..200 {
            let without = FaultMix::draw(seed, FaultLevel::Heavy, Topology::OneP1D, flight, false);
            assert_eq!(without.entry_crashes, 0);
            let with = FaultMix { entry_crashes: 1 + seed as u32 % 3, ..without.clone() };
            let faults = schedule(seed, &with, &links, &workers, "router", &workers);
            let (crashes, others): (Vec<_>, Vec<_>) = faults.into_iter().partition(of_entry);
            assert_eq!(crashes.len(), 2 * with.entry_crashes as usize, "{seed}: {crashes:?}");
            assert!(crashes.iter().all(|f| f.at <= with.window));
            assert_eq!(others, schedule(seed, &without, &links, &workers, "router", &workers));

            let alone =
                FaultMix::draw(seed, FaultLevel::EntryCrashes, Topology::OneP1D, flight, true);
            assert!((1..=2).contains(&alone.entry_crashes) && alone.is_calm(), "{alone}");
            let faults = schedule(seed, &alone, &links, &workers, "router", &workers);
            assert!(faults.iter().all(of_entry), "{seed}: {faults:?}");

            let all = FaultMix::draw(seed, FaultLevel::All, Topology::OneP1D, flight, false);
            assert_eq!(FaultMix { entry_crashes: 0, ..all.clone() }, without, "{seed}: {all}");
            drawn += all.entry_crashes;
        }
        // All: on for 80% of seeds, 1 to 3 each, 1.6 a seed in all.
        assert!((240..=400).contains(&drawn), "{drawn} entry crashes in 200 seeds");
        let heavy = FaultMix::draw(1, FaultLevel::Heavy, Topology::OneP1D, flight, false);
        assert!(!heavy.is_calm());
    }
}
