//! Deterministic simulation of lockstep clusters (DESIGN.md section 6).
//!
//! Here so far: the network seam, so that turmoil hosts run the real node runtime and HTTP app of
//! `lockstep-server` unchanged (`net::TurmoilListener`). Still to come (issue 10): trace replay
//! with faults, the oracles (every completed request equals its output alone, liveness after
//! faults heal, no leaked page, pin or transfer, invariants after every step, fail closed, seed
//! determinism), and the `sim` binary.

pub mod net;
pub mod trace;
