//! Time as a value. core/ never reads a clock: callers pass `now` in, the simulator passes
//! virtual time, the server passes a monotonic clock reading.

use std::fmt;
use std::time::Duration;

/// A point in time, in nanoseconds since an epoch the driver chose (process start, simulation
/// start). Only differences between two `Time`s from the same driver mean anything.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(u64);

impl Time {
    pub const ZERO: Time = Time(0);
    /// Later than any time a driver will ever pass; used for "never".
    pub const MAX: Time = Time(u64::MAX);

    pub const fn from_nanos(nanos: u64) -> Time {
        Time(nanos)
    }

    pub const fn from_micros(micros: u64) -> Time {
        Time(micros.saturating_mul(1_000))
    }

    pub const fn from_millis(millis: u64) -> Time {
        Time(millis.saturating_mul(1_000_000))
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + duration`, pinned at `Time::MAX` rather than wrapping: a lease that would outlive
    /// the clock simply never expires.
    pub fn saturating_add(self, duration: Duration) -> Time {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(nanos))
    }

    /// The earlier of two optional deadlines: what a machine made of two machines waits for.
    pub fn earliest(a: Option<Time>, b: Option<Time>) -> Option<Time> {
        a.into_iter().chain(b).min()
    }

    /// How long after `earlier` this is; zero if `earlier` is not earlier.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Debug for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t+{}ns", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_saturates_instead_of_wrapping() {
        let late = Time::from_nanos(u64::MAX - 5);
        assert_eq!(late.saturating_add(Duration::from_secs(1)), Time::MAX);
        assert_eq!(
            Time::from_millis(2).saturating_add(Duration::from_micros(500)).as_nanos(),
            2_500_000
        );
    }

    #[test]
    fn earliest_takes_the_earlier_deadline_and_none_only_if_both_are() {
        let (a, b) = (Some(Time::from_nanos(3)), Some(Time::from_nanos(5)));
        assert_eq!(Time::earliest(a, b), a);
        assert_eq!(Time::earliest(b, a), a);
        assert_eq!(Time::earliest(None, b), b);
        assert_eq!(Time::earliest(None, None), None);
    }

    #[test]
    fn since_never_goes_negative() {
        assert_eq!(Time::from_nanos(5).saturating_since(Time::from_nanos(9)), Duration::ZERO);
        assert_eq!(
            Time::from_nanos(9).saturating_since(Time::from_nanos(5)),
            Duration::from_nanos(4)
        );
    }
}
