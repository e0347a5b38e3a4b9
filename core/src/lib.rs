//! The pure state machines of lockstep.
//!
//! Everything here is sans-IO and deterministic: no async, no threads, no clock (time is an
//! argument), no entropy (randomness is a seed handed in), no hash-map iteration order in any
//! decision. The same inputs give the same outputs, bit for bit. The server drives these machines
//! on real hardware and the simulator drives the very same ones under faults.
//!
//! Each machine follows one shape (after quinn-proto and str0m): `handle_*` and command methods
//! take input together with `now`, `poll_*` drains output, `next_timeout` says when to call
//! `handle_timeout(now)`, and `check_invariants` reports a broken internal state. A bad input is
//! an `Err`; a broken invariant is a bug in lockstep.

pub mod invariant;
pub mod kv;
pub mod model;
pub mod node;
pub mod pd;
pub mod planted;
pub mod sched;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod time;
pub mod wire;

pub use invariant::InvariantViolation;
pub use time::Time;
