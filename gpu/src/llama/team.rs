//! A team of threads that runs one step together, as llama.cpp's CPU backend does: every member
//! walks the same layers, takes a fixed share of each product's rows and of the attention heads,
//! and meets the others at a barrier between phases. A pool that hands out each product
//! separately (rayon) parks its threads between products, and waking them cost more than the
//! product at batch 1; members here spin through the short gaps instead. But spinning while
//! another member is off its core (another process, or the server's own runtime, wanted the
//! core) keeps it off: two `lockstep generate` processes on two cores, spinning a millisecond a
//! wait and then yielding, each took 13 to 17 times as long as alone. So members sleep when a
//! wait runs long, and how long is long is learned from step to step (`Patience`): long while
//! the team has its cores, short while members are kept off theirs.
//!
//! Results cross between members through `Shared` rows of atomics: each cell is written by one
//! member before a barrier and read by any after it. Relaxed atomic loads and stores of `u32` are
//! plain moves; the barrier's release and acquire order them. No `unsafe` is needed.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::thread_cpu_time;

/// How long members spin at a barrier before they sleep, at most and at least (`Patience`).
/// The longest covers the waits of a team that has its cores to itself: on the default model a
/// member waits up to about 400 µs for another (a thread starting, the LM head, attention at a
/// long context where 3 KV heads split 2:1), and sleeping there would add a wake-up (100 to 300
/// µs on this VM) to the step. The shortest is for contended cores, where a long wait means the
/// other member is off its core. BENCHMARKS.md ("the team's barrier") has the measurements.
const PATIENCE_MAX: Duration = Duration::from_millis(1);
const PATIENCE_MIN: Duration = Duration::from_micros(20);

/// Time off its core in one step that marks a member's cores as contended: at least this, and
/// at least a sixteenth of the step (`CONTENDED_SHARE`). Alone, the default model's members are
/// kept off theirs 0 to 90 µs in nine steps of ten at batch 1 (a woken member waiting for the
/// core of the one that woke it), now and then a few milliseconds (another process's moment on
/// the core), which in a step of 32 rows (130 ms) is a small part; two processes on two cores,
/// 1.6 to 8.5 ms of a step of about 20 ms.
const CONTENDED: Duration = Duration::from_micros(250);
const CONTENDED_SHARE: u32 = 16;

/// Spins between two looks at the clock (a look costs about as much as 2 spins).
const SPINS_PER_CLOCK_READ: u32 = 64;

/// How long a sleeping member waits before it looks again on its own. Waking is the last
/// arrival's job; this bounds the wait should a wake-up go astray, and lets a sleeper see
/// a panicked member.
const SLEEP_BOUND: Duration = Duration::from_millis(10);

/// How long a team's members spin at a barrier before they sleep, learned from step to step (an
/// executor keeps one for its teams). A step in which a member was kept off its core for
/// `CONTENDED` or more, and a sixteenth of the step, divides the spins by four, down to the
/// shortest in three such steps; a step without doubles them. Contended cores keep them short
/// (two processes on two cores: nine steps in ten or more contended), and the odd contended step
/// of a team that has its cores (4 in a hundred here: another process's moment on the core)
/// costs little, since few waits outlast the shorter spin.
#[derive(Debug)]
pub(crate) struct Patience {
    nanos: AtomicU64,
}

impl Patience {
    pub fn new() -> Patience {
        Patience { nanos: AtomicU64::new(nanos(PATIENCE_MAX)) }
    }

    fn get(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    /// After a step that took `step`, given the longest time a member spent off its core;
    /// `None` where that is not known, taken as contended: a short spin there costs a little
    /// speed, a long one can cost a peer its core.
    fn learn(&self, off_core: Option<Duration>, step: Duration) {
        let contended = CONTENDED.max(step / CONTENDED_SHARE);
        let next = match off_core {
            Some(off) if off < contended => (self.get() * 2).min(PATIENCE_MAX),
            _ => (self.get() / 4).max(PATIENCE_MIN),
        };
        self.nanos.store(nanos(next), Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Runs `member(index)` on `count` threads (this one is member 0) and returns member 0's result.
/// If a member panics, the others stop at their next barrier and the panic is raised here.
pub(crate) fn run<R: Send>(
    count: usize,
    patience: &Patience,
    member: impl Fn(&Member<'_>) -> R + Sync,
) -> R {
    #[expect(
        clippy::disallowed_methods,
        reason = "the clock measures contention for the spin bound; it decides nothing a step computes"
    )]
    let started = Instant::now();
    let barrier = Barrier::new(count, patience.get());
    let result = std::thread::scope(|scope| {
        for index in 1..count {
            let (barrier, member) = (&barrier, &member);
            scope.spawn(move || take_part(barrier, index, member));
        }
        take_part(&barrier, 0, &member)
    });
    patience.learn(barrier.off_core(), started.elapsed());
    result
}

/// One member's part of the step, on this thread; reports how long it was kept off its core.
fn take_part<R>(barrier: &Barrier, index: usize, member: impl Fn(&Member<'_>) -> R) -> R {
    let _poison = PoisonOnPanic(barrier);
    #[expect(
        clippy::disallowed_methods,
        reason = "the clock measures contention for the spin bound; it decides nothing a step computes"
    )]
    let started = Instant::now();
    let cpu_at_start = thread_cpu_time::now();
    let me = Member { index, count: barrier.count, barrier, slept: Cell::new(Duration::ZERO) };
    let result = member(&me);
    let off_core = cpu_at_start.zip(thread_cpu_time::now()).map(|(start, end)| {
        started.elapsed().saturating_sub(end.saturating_sub(start)).saturating_sub(me.slept.get())
    });
    barrier.report(off_core);
    result
}

/// One member of a running team.
#[derive(Debug)]
pub(crate) struct Member<'a> {
    pub index: usize,
    pub count: usize,
    barrier: &'a Barrier,
    /// How long this member has slept at barriers this step.
    slept: Cell<Duration>,
}

impl Member<'_> {
    /// Waits until every member has called `sync` as often as this one. Everything a member
    /// wrote before is visible to all after.
    pub fn sync(&self) {
        let slept = self.barrier.wait();
        self.slept.set(self.slept.get() + slept);
    }

    /// This member's share of `0..len`: contiguous, fixed by `index` and `count` alone.
    pub fn share(&self, len: usize) -> std::ops::Range<usize> {
        len * self.index / self.count..len * (self.index + 1) / self.count
    }
}

#[derive(Debug)]
struct Barrier {
    count: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
    /// Members asleep in `wait`; the last arrival wakes them only when there are any, so a team
    /// that never sleeps never touches the lock.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// How long a member spins before it sleeps, this step.
    spin_max: Duration,
    /// `SLEEP_BOUND`; tests set an hour, so that a lost wake-up shows as a wedge.
    sleep_bound: Duration,
    /// The longest time off its core a member reported (nanoseconds), and how many reported one
    /// (a member whose platform does not count its CPU time reports none).
    off_core_max: AtomicU64,
    reported: AtomicUsize,
}

impl Barrier {
    fn new(count: usize, spin_max: Duration) -> Barrier {
        Barrier {
            count,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin_max,
            sleep_bound: SLEEP_BOUND,
            off_core_max: AtomicU64::new(0),
            reported: AtomicUsize::new(0),
        }
    }

    fn report(&self, off_core: Option<Duration>) {
        if let Some(off) = off_core {
            self.off_core_max.fetch_max(nanos(off), Ordering::Relaxed);
            self.reported.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The longest time a member was kept off its core this step, once all have finished;
    /// `None` if not every member could tell.
    fn off_core(&self) -> Option<Duration> {
        (self.reported.load(Ordering::Relaxed) == self.count)
            .then(|| Duration::from_nanos(self.off_core_max.load(Ordering::Relaxed)))
    }

    /// Returns how long this member slept.
    fn wait(&self) -> Duration {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.count {
            self.arrived.store(0, Ordering::Relaxed);
            // SeqCst with the sleepers' count here and in `sleep`: either a sleeper sees the new
            // generation before it waits, or this sees the sleeper and wakes it.
            self.generation.fetch_add(1, Ordering::SeqCst);
            if self.sleepers.load(Ordering::SeqCst) > 0 {
                self.wake_all();
            }
            return Duration::ZERO;
        }
        let slept = if self.spin(generation) { Duration::ZERO } else { self.sleep(generation) };
        assert!(!self.poisoned.load(Ordering::SeqCst), "another member of the team panicked");
        slept
    }

    /// Spins until the generation moves on or a member panicked (true), or until `spin_max` has
    /// passed (false).
    fn spin(&self, generation: usize) -> bool {
        #[expect(
            clippy::disallowed_methods,
            reason = "the clock bounds how long a member spins; it decides nothing a step computes"
        )]
        let started = Instant::now();
        loop {
            for _ in 0..SPINS_PER_CLOCK_READ {
                if self.generation.load(Ordering::Acquire) != generation
                    || self.poisoned.load(Ordering::Relaxed)
                {
                    return true;
                }
                std::hint::spin_loop();
            }
            if started.elapsed() >= self.spin_max {
                return false;
            }
        }
    }

    /// Sleeps until the generation moves on or a member panicked; returns how long.
    fn sleep(&self, generation: usize) -> Duration {
        #[expect(
            clippy::disallowed_methods,
            reason = "the clock measures contention for the spin bound; it decides nothing a step computes"
        )]
        let started = Instant::now();
        let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while self.generation.load(Ordering::SeqCst) == generation
            && !self.poisoned.load(Ordering::SeqCst)
        {
            guard = self
                .wake
                .wait_timeout(guard, self.sleep_bound)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        started.elapsed()
    }

    /// Wakes every sleeper. Taking the lock first means a member between counting itself a
    /// sleeper and waiting is already waiting when the notice goes out.
    fn wake_all(&self) {
        drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
        self.wake.notify_all();
    }
}

/// Marks the team's barrier poisoned when a member unwinds, so no one waits for it forever.
struct PoisonOnPanic<'a>(&'a Barrier);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::SeqCst);
            self.0.wake_all();
        }
    }
}

/// `rows` rows of `width` f32 values that members write and read across barriers.
#[derive(Debug)]
pub(crate) struct Shared {
    width: usize,
    cells: Vec<AtomicU32>,
}

impl Shared {
    pub fn new(rows: usize, width: usize) -> Shared {
        Shared { width, cells: (0..rows * width).map(|_| AtomicU32::new(0)).collect() }
    }

    #[inline(always)]
    pub fn set(&self, row: usize, col: usize, value: f32) {
        self.cells[row * self.width + col].store(value.to_bits(), Ordering::Relaxed);
    }

    /// Row `row` into `out`.
    pub fn read(&self, row: usize, out: &mut [f32]) {
        let cells = &self.cells[row * self.width..(row + 1) * self.width];
        for (o, c) in out.iter_mut().zip(cells) {
            *o = f32::from_bits(c.load(Ordering::Relaxed));
        }
    }

    /// Every row into `out`, one `Vec` a row, each already `width` long: a member reads each
    /// layer's results into the same buffers (fresh ones each layer were megabytes of
    /// allocation and page clearing a layer at a long prefill).
    pub fn read_all(&self, out: &mut [Vec<f32>]) {
        for (r, row) in out.iter_mut().enumerate() {
            self.read(r, row);
        }
    }

    pub fn rows(&self) -> Vec<Vec<f32>> {
        let n = self.cells.len() / self.width.max(1);
        (0..n)
            .map(|r| {
                let mut row = vec![0f32; self.width];
                self.read(r, &mut row);
                row
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_see_each_others_writes_after_every_barrier() {
        for count in [1, 2, 3, 5] {
            let shared = Shared::new(count, 100);
            let total = run(count, &Patience::new(), |me| {
                let mut sum = 0f32;
                for round in 0..100 {
                    shared.set(me.index, round, (me.index * 1000 + round) as f32);
                    me.sync();
                    for other in 0..me.count {
                        let mut row = vec![0f32; 100];
                        shared.read(other, &mut row);
                        assert_eq!(row[round], (other * 1000 + round) as f32);
                        sum += row[round];
                    }
                    me.sync();
                }
                sum
            });
            let expected: f32 =
                (0..count).flat_map(|m| (0..100).map(move |r| (m * 1000 + r) as f32)).sum();
            assert_eq!(total, expected);
        }
    }

    #[test]
    fn shares_cover_the_range_once() {
        let barrier = Barrier::new(3, PATIENCE_MAX);
        let shares: Vec<_> = (0..3)
            .map(|index| {
                Member { index, count: 3, barrier: &barrier, slept: Cell::default() }.share(10)
            })
            .collect();
        assert_eq!(shares, [0..3, 3..6, 6..10]);
    }

    #[test]
    fn a_panicking_member_stops_the_team_instead_of_wedging_it() {
        let result = std::panic::catch_unwind(|| {
            run(2, &Patience::new(), |me| {
                if me.index == 1 {
                    panic!("member 1 fails");
                }
                me.sync();
            })
        });
        assert!(result.is_err());
    }

    /// A barrier whose sleepers never wake on their own: only the last arrival or a panic wakes
    /// them.
    fn barrier_without_timeouts(count: usize) -> Barrier {
        Barrier { sleep_bound: Duration::from_secs(3600), ..Barrier::new(count, PATIENCE_MIN) }
    }

    /// Waits (at most a minute) until `sleepers` members are asleep at `barrier`.
    fn until_asleep(barrier: &Barrier, sleepers: usize) {
        for _ in 0..60_000 {
            if barrier.sleepers.load(Ordering::SeqCst) == sleepers {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("no member went to sleep at the barrier");
    }

    // The two tests below run members on threads of their own, not scoped ones: a member that
    // is never woken must fail the test, not hold it for the hour of its sleep.

    #[test]
    fn a_member_that_waits_long_sleeps_and_the_last_arrival_wakes_it() {
        let barrier = std::sync::Arc::new(barrier_without_timeouts(3));
        for _round in 0..3 {
            let (passed, passes) = std::sync::mpsc::channel();
            for _ in 0..2 {
                let (barrier, passed) = (barrier.clone(), passed.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    passed.send(()).unwrap();
                });
            }
            until_asleep(&barrier, 2);
            barrier.wait();
            for _ in 0..2 {
                passes
                    .recv_timeout(Duration::from_secs(60))
                    .expect("a sleeping member was not woken by the last arrival");
            }
            assert_eq!(barrier.sleepers.load(Ordering::SeqCst), 0);
        }
    }

    #[test]
    fn a_panicking_member_wakes_the_sleeping_ones() {
        let barrier = std::sync::Arc::new(barrier_without_timeouts(2));
        let (stopped, stops) = std::sync::mpsc::channel();
        let waiting = barrier.clone();
        std::thread::spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waiting.wait()));
            stopped.send(result.is_err()).unwrap();
        });
        until_asleep(&barrier, 1);
        let failing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _poison = PoisonOnPanic(&barrier);
            panic!("this member fails while the other sleeps");
        }));
        assert!(failing.is_err());
        let raised = stops
            .recv_timeout(Duration::from_secs(60))
            .expect("the sleeping member was not woken by the panic");
        assert!(raised, "the sleeping member returned as if the barrier had passed");
    }

    #[test]
    fn patience_shrinks_fourfold_after_a_contended_step_and_doubles_after_a_calm_one() {
        let patience = Patience::new();
        assert_eq!(patience.get(), PATIENCE_MAX);
        let step = Duration::from_millis(2);
        patience.learn(Some(CONTENDED), step);
        assert_eq!(patience.get(), PATIENCE_MAX / 4);
        for _ in 0..3 {
            patience.learn(Some(CONTENDED * 10), step);
        }
        assert_eq!(patience.get(), PATIENCE_MIN);
        patience.learn(Some(CONTENDED / 2), step);
        assert_eq!(patience.get(), PATIENCE_MIN * 2);
        for _ in 0..10 {
            patience.learn(Some(Duration::ZERO), step);
        }
        assert_eq!(patience.get(), PATIENCE_MAX);
        patience.learn(Some(CONTENDED * 10), step * 100);
        assert_eq!(patience.get(), PATIENCE_MAX, "2.5 ms off the core in a step of 200 ms is calm");
        for _ in 0..3 {
            patience.learn(None, step);
        }
        assert_eq!(patience.get(), PATIENCE_MIN, "not knowing is taken as contended");
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_member_kept_off_its_core_marks_the_step_contended() {
        // Member 1 leaves its core for 5 ms (as a preempted member would, unwillingly); member 0
        // spends the same 5 ms asleep at the barrier, which is its own choice.
        let barrier = Barrier::new(2, PATIENCE_MIN);
        let away = Duration::from_millis(5);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                take_part(&barrier, 1, |me| {
                    std::thread::sleep(away);
                    me.sync();
                })
            });
            take_part(&barrier, 0, |me| me.sync());
        });
        let off_core = barrier.off_core().expect("every member could tell");
        assert!(off_core >= away, "{off_core:?} off the core, at least {away:?} expected");
        let patience = Patience::new();
        patience.learn(Some(off_core), away);
        assert_eq!(patience.get(), PATIENCE_MAX / 4);
    }
}
