//! The CPU time the calling thread has used, user and system: with the wall time and the time it
//! chose to sleep, it says how long the thread was kept off its core while it could have run.

use std::time::Duration;

/// This thread's CPU time so far, or `None` where the platform does not count it per thread.
/// The clock, not `getrusage`: `getrusage` splits the time into user and system by timer ticks
/// and its sum moved by half a step's time against the wall clock on this VM.
#[cfg(target_os = "linux")]
pub(crate) fn now() -> Option<Duration> {
    let mut time = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `clock_gettime` writes only the `timespec` it is handed;
    // `CLOCK_THREAD_CPUTIME_ID` is the calling thread's CPU-time clock.
    #[allow(unsafe_code, reason = "the one call into libc, for the thread's CPU-time clock")]
    let read = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut time) };
    if read != 0 {
        return None;
    }
    Some(Duration::new(u64::try_from(time.tv_sec).ok()?, u32::try_from(time.tv_nsec).ok()?))
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn now() -> Option<Duration> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn work_on_this_thread_counts_and_sleep_does_not() {
        let start = now().expect("Linux counts a thread's CPU time");
        std::thread::sleep(Duration::from_millis(50));
        let slept = now().expect("still counted") - start;
        let mut x = 0u64;
        let busy = Duration::from_millis(50);
        #[expect(clippy::disallowed_methods, reason = "the test spins for a wall-clock while")]
        let began = std::time::Instant::now();
        while began.elapsed() < busy {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let worked = now().expect("still counted") - start - slept;
        // Sleeping uses next to no CPU; spinning for 50 ms uses most of 50 ms unless the
        // machine is very busy, so only an order of magnitude is asserted.
        assert!(slept < Duration::from_millis(10), "{slept:?} of CPU while asleep");
        assert!(worked > Duration::from_millis(5), "{worked:?} of CPU while spinning 50 ms");
    }
}
