//! The lockstep node runtime and HTTP front end (DESIGN.md section 4).
//!
//! This crate will hold the async glue around `lockstep_core`'s state machines: one engine task
//! per worker that owns the scheduler, page pool and executor; peer links carrying `wire` frames;
//! the router; and the axum OpenAI-compatible server. It is generic over the network so that the
//! simulator runs this same code on turmoil. Binary: `lockstep`.
//!
//! Nothing lives here yet: later issues bring it.
