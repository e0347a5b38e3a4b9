//! The wait between redials: doubling from `backoff_min` to `backoff_max`, back to the minimum
//! once a link opens. No jitter: a deterministic simulation needs it drawn from its seed, and
//! each pair is dialed from one side, so redials do not synchronize into a herd.

use std::time::Duration;

#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { min, max, next: min }
    }

    /// The wait before the next attempt; the one after is twice as long, up to the cap.
    pub(crate) fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        wait
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_reset_to_the_minimum() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::new(ms(10), ms(50));
        let waits: Vec<Duration> = (0..5).map(|_| backoff.next_wait()).collect();
        assert_eq!(waits, [ms(10), ms(20), ms(40), ms(50), ms(50)]);
        backoff.reset();
        assert_eq!(backoff.next_wait(), ms(10));
    }
}
