//! The simulator's one source of chance: SplitMix64, seeded by the run's seed. Every draw the
//! harness makes (knobs, faults, cancellations, slow steps) comes from here in a fixed order, so a
//! seed names a run. turmoil draws its own (latency, loss) from the same seed.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    /// An independent stream for one purpose, so that adding draws to one purpose does not shift
    /// every other purpose's draws (a seed keeps meaning the same faults as knobs are added).
    pub fn stream(seed: u64, purpose: &str) -> SimRng {
        let salt = purpose.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        SimRng(mix(seed ^ salt))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// One of `items`, uniformly.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    /// Uniform in `[low, high]`, to the millisecond.
    pub fn millis(&mut self, low: Duration, high: Duration) -> Duration {
        let (low, high) = (low.as_millis() as u64, high.as_millis() as u64);
        Duration::from_millis(low + self.below(high.saturating_sub(low) + 1))
    }
}

pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_fixed_by_seed_and_purpose() {
        let a: Vec<u64> = (0..4).map(|_| SimRng::stream(7, "faults").next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(SimRng::stream(7, "faults").next_u64(), SimRng::stream(7, "knobs").next_u64());
        assert_ne!(SimRng::stream(7, "faults").next_u64(), SimRng::stream(8, "faults").next_u64());
        let mut r = SimRng::new(1);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            let d = r.millis(Duration::from_millis(5), Duration::from_millis(9));
            assert!((5..=9).contains(&d.as_millis()));
        }
    }
}
