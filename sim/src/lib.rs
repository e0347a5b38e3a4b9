//! Deterministic simulation of lockstep clusters (DESIGN.md section 6).
//!
//! turmoil hosts run the server's real pieces (the engine loops, the router's engine, the peer
//! transport, the axum app) with turmoil's network in place of tokio's (`net`) and a simulated
//! device in place of the CPU executor (`device`: the provenance model, steps lasting a cost
//! model's time). Clients on one more host replay a trace through HTTP (`client`); each seed
//! draws its own settings (`knobs`) and faults (`faults`); `run` runs it and the oracles
//! (`oracle`) judge it against each request's output alone (`reference`).

pub mod client;
pub mod device;
pub mod events;
pub mod faults;
pub mod knobs;
pub mod net;
pub mod oracle;
pub mod panics;
pub mod perfetto;
pub mod plants;
pub mod reference;
pub mod rng;
pub mod run;
pub mod sabotage;
pub mod server_events;
pub mod shrink;
pub mod slow_lane;
pub mod topology;
pub mod trace;
