//! A team of threads that runs one step together, as llama.cpp's CPU backend does: every member
//! walks the same layers, takes a fixed share of each product's rows and of the attention heads,
//! and meets the others at a spinning barrier between phases. A pool that hands out each product
//! separately (rayon) parks its threads between products, and waking them cost more than the
//! product at batch 1; members here spin through the short gaps instead.
//!
//! Results cross between members through `Shared` rows of atomics: each cell is written by one
//! member before a barrier and read by any after it. Relaxed atomic loads and stores of `u32` are
//! plain moves; the barrier's release and acquire order them. No `unsafe` is needed.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Spins before yielding the CPU: long enough to cover a phase of another member (tens of
/// microseconds), short enough not to starve a thread that shares the core.
const SPINS_BEFORE_YIELD: u32 = 1 << 16;

/// Runs `member(index)` on `count` threads (this one is member 0) and returns member 0's result.
/// If a member panics, the others stop at their next barrier and the panic is raised here.
pub(crate) fn run<R: Send>(count: usize, member: impl Fn(&Member<'_>) -> R + Sync) -> R {
    let barrier = Barrier {
        count,
        arrived: AtomicUsize::new(0),
        generation: AtomicUsize::new(0),
        poisoned: AtomicBool::new(false),
    };
    std::thread::scope(|scope| {
        for index in 1..count {
            let (barrier, member) = (&barrier, &member);
            scope.spawn(move || {
                let me = Member { index, count, barrier };
                let _poison = PoisonOnPanic(barrier);
                member(&me);
            });
        }
        let me = Member { index: 0, count, barrier: &barrier };
        let _poison = PoisonOnPanic(&barrier);
        member(&me)
    })
}

/// One member of a running team.
#[derive(Debug)]
pub(crate) struct Member<'a> {
    pub index: usize,
    pub count: usize,
    barrier: &'a Barrier,
}

impl Member<'_> {
    /// Waits until every member has called `sync` as often as this one. Everything a member
    /// wrote before is visible to all after.
    pub fn sync(&self) {
        self.barrier.wait();
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
}

impl Barrier {
    fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.count {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            assert!(!self.poisoned.load(Ordering::Relaxed), "another member of the team panicked");
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Marks the team's barrier poisoned when a member unwinds, so no one waits for it forever.
struct PoisonOnPanic<'a>(&'a Barrier);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned.store(true, Ordering::Relaxed);
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
            let total = run(count, |me| {
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
        let barrier = Barrier {
            count: 3,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        };
        let shares: Vec<_> =
            (0..3).map(|index| Member { index, count: 3, barrier: &barrier }.share(10)).collect();
        assert_eq!(shares, [0..3, 3..6, 6..10]);
    }

    #[test]
    fn a_panicking_member_stops_the_team_instead_of_wedging_it() {
        let result = std::panic::catch_unwind(|| {
            run(2, |me| {
                if me.index == 1 {
                    panic!("member 1 fails");
                }
                me.sync();
            })
        });
        assert!(result.is_err());
    }
}
