//! The Perfetto timeline of a 1P1D run: valid Chrome-trace JSON with, for every completed request,
//! its prefill, transfer and decode spans (and its queue, when it waited) in order, and a track of device steps per host;
//! and the incident (decode reading pages its transfer had not finished writing) drawn as overlapping spans.

use std::time::Duration;

use lockstep_sim::client::Ending;
use lockstep_sim::faults::FaultLevel;
use lockstep_sim::knobs::Topology;
use lockstep_sim::perfetto::timeline;
use lockstep_sim::run::{RunConfig, run};
use lockstep_sim::trace::{SimRequest, SimTrace, Start};
use serde_json::Value;

fn trace() -> SimTrace {
    let requests = (0..4usize)
        .map(|i| SimRequest {
            index: i,
            session: None,
            turn: 1,
            start: Start::At(Duration::from_millis(i as u64 * 3)),
            input: (0..30 + i as u32 * 11).map(|t| 7 + t * 13 + i as u32).collect(),
            max_tokens: 12,
            temperature: 0.0,
            seed: 1,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        })
        .collect();
    SimTrace { name: "perfetto".into(), vocab_size: 32_000, requests }
}

#[test]
fn every_completed_request_shows_its_phases_and_every_worker_its_steps() {
    let trace = trace();
    let outcome = run(&trace, &RunConfig::new(5, Topology::OneP1D, FaultLevel::None));
    let json: Value = serde_json::from_str(&timeline(&trace, &outcome)).expect("JSON");
    let events = json["traceEvents"].as_array().expect("a list of events");
    for (index, observed) in outcome.observed.iter().enumerate() {
        assert!(matches!(observed.ending, Some(Ending::Completed { .. })), "{observed:?}");
        let spans: Vec<(&str, f64, f64)> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == 1 && e["tid"] == index as u64 + 1)
            .map(|e| {
                let ts = e["ts"].as_f64().expect("ts");
                (e["name"].as_str().expect("name"), ts, ts + e["dur"].as_f64().expect("dur"))
            })
            .collect();
        let names: Vec<&str> = spans.iter().map(|s| s.0).collect();
        // A phase of no length is left out; decode and prefill always take time.
        for phase in ["prefill", "transfer", "decode"] {
            assert!(names.contains(&phase), "{index}: {names:?}");
        }
        assert!(spans.windows(2).all(|w| w[0].2 <= w[1].1 + 1e-6), "{index}: {spans:?}");
    }
    let step_hosts: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| &e["args"]["name"])
        .collect();
    for host in ["prefill1", "decode1"] {
        assert!(step_hosts.iter().any(|h| *h == host), "{step_hosts:?}");
    }
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "X" && e["name"] == "step" && e["pid"].as_u64() >= Some(10))
    );
}

/// The incident (issue 11, `DecodeReadsUnfinishedTransfer`) on its timeline: planted, some
/// request's decode span begins while its transfer's `kv writes` span (first write arriving to
/// last landing, on the decode worker) is still open; unplanted, at the same seed, never.
#[test]
fn the_incident_shows_as_decode_overlapping_its_transfers_writes() {
    use lockstep_core::planted::PlantedBug;
    use lockstep_sim::perfetto::decode_before_writes_landed;
    use lockstep_sim::plants;

    let bug = PlantedBug::DecodeReadsUnfinishedTransfer;
    let scenario = plants::scenario(bug);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(scenario.trace);
    let options = scenario.import_options().expect("valid options");
    let trace = lockstep_sim::trace::load(&path, &options).expect("a committed trace");
    let mut config = RunConfig::new(scenario.caught_at, scenario.topology, scenario.faults);

    let overlaps = |outcome: &lockstep_sim::run::RunOutcome| {
        let json: Value = serde_json::from_str(&timeline(&trace, outcome)).expect("JSON");
        let events = json["traceEvents"].as_array().expect("a list of events").clone();
        let spans = |pid: u64, name: &str| -> Vec<(u64, f64, f64)> {
            events
                .iter()
                .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["name"] == name)
                .map(|e| {
                    let ts = e["ts"].as_f64().expect("ts");
                    (e["tid"].as_u64().expect("tid"), ts, ts + e["dur"].as_f64().expect("dur"))
                })
                .collect()
        };
        let (writes, decodes) = (spans(3, "kv writes"), spans(1, "decode"));
        assert!(!writes.is_empty(), "every decoded transfer has its kv writes span");
        let drawn: Vec<u64> = writes
            .iter()
            .filter(|w| decodes.iter().any(|d| d.0 == w.0 && d.1 < w.2))
            .map(|w| w.0 - 1)
            .collect();
        let found: Vec<u64> =
            decode_before_writes_landed(outcome).iter().map(|&(i, ..)| i as u64).collect();
        // A decode span of no length is left out of the timeline; the rest are drawn.
        assert!(drawn.iter().all(|i| found.contains(i)), "drawn {drawn:?}, found {found:?}");
        (drawn, found)
    };

    config.plant = Some(bug);
    let (drawn, _) = overlaps(&run(&trace, &config));
    assert!(!drawn.is_empty(), "planted: no decode span began before its writes landed");
    config.plant = None;
    let (drawn, found) = overlaps(&run(&trace, &config));
    assert!(drawn.is_empty() && found.is_empty(), "unplanted: {drawn:?} {found:?}");
}
