//! Deterministic simulation of lockstep clusters (DESIGN.md section 6).
//!
//! This crate will run the real node runtime and HTTP server on turmoil hosts, replay traces with
//! faults, and check the oracles: every completed request equals its output when run alone,
//! liveness after faults heal, no leaked page, pin or transfer, invariants after every step, fail
//! closed, and seed determinism. Binary: `sim`.
//!
//! Nothing lives here yet: later issues bring it.
