//! Completions chunked anywhere through the dsml_v41 tool-call stream: see tool_calls_harness.rs.

#![no_main]

use libfuzzer_sys::fuzz_target;
use lockstep_server::tool_calls::ToolFormat;

#[path = "tool_calls_harness.rs"]
mod harness;

fuzz_target!(|bytes: &[u8]| harness::run(ToolFormat::DsmlV41, bytes));
