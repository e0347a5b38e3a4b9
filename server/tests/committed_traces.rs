//! The traces committed under traces/ read back with the same reader the simulator uses.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::path::Path;

use lockstep_server::record::read_trace;

#[test]
fn the_router_recorded_trace_reads_back_with_its_sessions_and_outputs() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/recorded_router_1p1d_smollm2.jsonl");
    let trace = read_trace(&path).unwrap();
    assert_eq!(trace.header.model, "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(trace.records.len(), 6);
    let turns: Vec<(String, u32)> =
        trace.records.iter().filter_map(|r| Some((r.session.clone()?, r.turn?))).collect();
    for session in ["agent-a", "agent-b"] {
        let mine: Vec<u32> = turns.iter().filter(|(s, _)| s == session).map(|(_, t)| *t).collect();
        assert_eq!(mine, vec![1, 2], "{session}");
    }
    for record in &trace.records {
        let output = record.output.as_ref().unwrap();
        assert!(!record.input_ids.is_empty() && !output.token_ids.is_empty());
    }
}
