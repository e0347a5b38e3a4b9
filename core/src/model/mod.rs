//! Models that execute scheduler plans without weights.
//!
//! `ProvenanceModel` is the simulator's oracle of record (DESIGN.md section 5): any KV read that
//! does not belong to the request, or was not completely written, changes its output.

mod provenance;

pub use provenance::{ProvenanceError, ProvenanceModel};
