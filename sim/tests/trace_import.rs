//! The trace importers on the traces committed under traces/ (CI has no ../shared), each read
//! through `trace::load` as the harness reads them, and on bad input, which must be an error
//! naming the file and line, never a panic.

#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use lockstep_sim::trace::{ImportOptions, SimRequest, SimTrace, Start, load, parse};
use serde_json::Value;

fn committed(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces").join(name)
}

fn load_committed(name: &str, options: &ImportOptions) -> SimTrace {
    let trace = load(&committed(name), options).unwrap();
    assert_eq!(trace.check(), Ok(()));
    trace
}

/// The JSON lines of a committed file.
fn json_lines(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(committed(name)).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Tokens two prompts share from the start.
fn shared_prefix(a: &SimRequest, b: &SimRequest) -> usize {
    a.input.iter().zip(&b.input).take_while(|(x, y)| x == y).count()
}

fn at(request: &SimRequest) -> Duration {
    match request.start {
        Start::At(at) => at,
        Start::After { .. } => panic!("request {} is closed loop", request.index),
    }
}

#[test]
fn mooncake_opens_loop_and_equal_hash_ids_are_equal_tokens() {
    let trace = load_committed("mooncake_conversation_200.jsonl", &ImportOptions::default());
    assert_eq!(trace.requests.len(), 200);
    assert_eq!(trace.vocab_size, 32_000);
    let lines = json_lines("mooncake_conversation_200.jsonl");
    let first_ms = lines[0]["timestamp"].as_u64().unwrap();
    for (request, line) in trace.requests.iter().zip(&lines) {
        assert_eq!(request.session, None);
        let ms = line["timestamp"].as_u64().unwrap() - first_ms;
        assert_eq!(at(request), Duration::from_millis(ms));
        assert_eq!(request.input.len() as u64, line["input_length"].as_u64().unwrap());
        assert_eq!(u64::from(request.max_tokens), line["output_length"].as_u64().unwrap().max(1));
    }
    // Requests whose ids agree on the first k blocks agree on the first k * 512 tokens.
    let ids: Vec<Vec<u64>> = lines
        .iter()
        .map(|l| l["hash_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect())
        .collect();
    let mut pairs = 0;
    for i in 0..ids.len() {
        for j in i + 1..ids.len() {
            let blocks = ids[i].iter().zip(&ids[j]).take_while(|(a, b)| a == b).count();
            let (a, b) = (&trace.requests[i], &trace.requests[j]);
            let full = (blocks * 512).min(a.input.len()).min(b.input.len());
            assert!(shared_prefix(a, b) >= full, "requests {i} and {j}");
            if blocks > 0 && full < a.input.len().min(b.input.len()) {
                assert!(shared_prefix(a, b) < full + 512, "{i}, {j}: the next block differs");
                pairs += 1;
            }
        }
    }
    assert!(pairs > 100, "the sample shares prefixes: {pairs} pairs");
}

#[test]
fn scaling_keeps_shared_prefixes_shared() {
    let options = ImportOptions {
        scale_tokens: 0.05,
        max_input: Some(2048),
        max_output: Some(64),
        ..ImportOptions::default()
    };
    let full = load_committed("mooncake_conversation_200.jsonl", &ImportOptions::default());
    let small = load_committed("mooncake_conversation_200.jsonl", &options);
    let block = 26; // 512 * 0.05, rounded
    for (i, (f, s)) in full.requests.iter().zip(&small.requests).enumerate() {
        assert!(s.input.len() <= 2048 && s.max_tokens <= 64);
        assert_eq!(s.input.len(), ((f.input.len() as f64 * 0.05).round() as usize).min(2048));
        for (g, t) in full.requests.iter().zip(&small.requests).take(i) {
            let blocks = shared_prefix(f, g) / 512;
            let expected = (blocks * block).min(s.input.len()).min(t.input.len());
            assert!(shared_prefix(s, t) >= expected, "{i}: {blocks} blocks were shared");
        }
    }
}

#[test]
fn the_recorded_trace_replays_its_sessions_closed_loop() {
    let trace = load_committed("recorded_router_1p1d_smollm2.jsonl", &ImportOptions::default());
    assert_eq!(trace.name, "recorded_router_1p1d_smollm2");
    assert_eq!(trace.vocab_size, 49_152, "the header's, not the options'");
    let lines = json_lines("recorded_router_1p1d_smollm2.jsonl");
    let mut records: Vec<&Value> = lines[1..].iter().collect();
    records.sort_by(|a, b| {
        a["arrival_ms"].as_f64().unwrap().total_cmp(&b["arrival_ms"].as_f64().unwrap())
    });
    assert_eq!(trace.requests.len(), records.len());
    for (request, record) in trace.requests.iter().zip(&records) {
        let ids: Vec<u32> = serde_json::from_value(record["input_ids"].clone()).unwrap();
        assert_eq!(request.input, ids, "token ids as recorded");
        assert_eq!(Value::from(request.max_tokens), record["max_tokens"]);
        assert_eq!(Value::from(request.seed), record["sampling"]["seed"]);
        let turn = record["turn"].as_u64().unwrap_or(1);
        assert_eq!(u64::from(request.turn), turn);
        let Start::After { previous, think } = request.start else {
            assert_eq!(turn, 1);
            continue;
        };
        // The think time the recording shows: arrival minus the previous turn's end.
        let before = records[previous];
        let ended =
            before["arrival_ms"].as_f64().unwrap() + before["timings"]["e2e_ms"].as_f64().unwrap();
        let ms = record["arrival_ms"].as_f64().unwrap() - ended;
        assert_eq!(think, Duration::from_micros((ms * 1000.0).round() as u64));
        assert_eq!(trace.requests[previous].session, request.session);
        assert_eq!(trace.requests[previous].turn + 1, request.turn);
    }
    let sessions = trace.requests.iter().filter_map(|r| r.session).max();
    assert_eq!(sessions, Some(2), "agent-a, agent-b, agent-c");
}

#[test]
fn the_agentic_sample_keeps_sessions_sub_agents_and_their_prefixes() {
    let trace = load_committed("weka_agentic_80.jsonl", &ImportOptions::default());
    assert_eq!(trace.requests.len(), 634);
    let lines = json_lines("weka_agentic_80.jsonl");
    assert_eq!(lines[0]["block_tokens"], 16);
    let session_names: std::collections::BTreeSet<&str> =
        lines[1..].iter().map(|l| l["session"].as_str().unwrap()).collect();
    assert_eq!(session_names.len(), 83);
    assert_eq!(session_names.iter().filter(|s| s.contains('/')).count(), 3, "sub-agents");
    let (mut spawned, mut later_turns, mut extending) = (0, 0, 0);
    for request in &trace.requests {
        assert!(request.input.len() <= 2048 && request.turn <= 8);
        match request.start {
            Start::At(at) => assert_eq!((at, request.turn), (Duration::ZERO, 1)),
            Start::After { previous, .. } => {
                let before = &trace.requests[previous];
                assert!(previous < request.index);
                if request.turn == 1 {
                    assert_ne!(before.session, request.session, "a sub-agent follows its parent");
                    spawned += 1;
                } else {
                    assert_eq!((before.session, before.turn + 1), (request.session, request.turn));
                    later_turns += 1;
                    // An agent's next prompt mostly extends its last one.
                    extending += usize::from(shared_prefix(before, request) >= 16);
                }
            }
        }
    }
    assert_eq!(spawned, 3);
    assert!(extending * 10 > later_turns * 9, "{extending} of {later_turns} share a prefix");
    // Sessions are different files: their hash ids never meet, so neither do their prompts.
    let firsts: Vec<&SimRequest> = trace.requests.iter().filter(|r| r.turn == 1).collect();
    for (i, a) in firsts.iter().enumerate() {
        for b in &firsts[..i] {
            let same_file = lines[a.index + 1]["session"].as_str().unwrap().split('/').next()
                == lines[b.index + 1]["session"].as_str().unwrap().split('/').next();
            if !same_file {
                assert!(shared_prefix(a, b) < 16, "{} and {}", a.index, b.index);
            }
        }
    }
}

#[test]
fn max_requests_keeps_whole_sessions() {
    let options = ImportOptions { max_requests: Some(40), ..ImportOptions::default() };
    let trace = load_committed("weka_agentic_80.jsonl", &options);
    assert!(trace.requests.len() <= 40);
    let all = load_committed("weka_agentic_80.jsonl", &ImportOptions::default());
    for session in trace.requests.iter().filter_map(|r| r.session) {
        let kept = trace.requests.iter().filter(|r| r.session == Some(session)).count();
        let first = trace.requests.iter().find(|r| r.session == Some(session)).unwrap();
        let in_all = all.requests.iter().find(|r| r.input == first.input).unwrap();
        let whole = all.requests.iter().filter(|r| r.session == in_all.session).count();
        assert_eq!(kept, whole, "session {session} is whole");
    }
    let options = ImportOptions { max_requests: Some(10), ..ImportOptions::default() };
    assert_eq!(load_committed("azure_code_50.csv", &options).requests.len(), 10);
}

#[test]
fn azure_opens_loop_with_prompts_of_their_own() {
    let trace = load_committed("azure_code_50.csv", &ImportOptions::default());
    assert_eq!(trace.requests.len(), 50);
    assert_eq!(at(&trace.requests[0]), Duration::ZERO);
    // 18:17:03.9799600 to 18:17:40.6293580.
    assert_eq!(at(&trace.requests[49]), Duration::from_nanos(36_649_398_000));
    assert_eq!((trace.requests[0].input.len(), trace.requests[0].max_tokens), (4808, 10));
    for (i, a) in trace.requests.iter().enumerate() {
        assert!(at(a) >= at(&trace.requests[i.saturating_sub(1)]));
        for b in &trace.requests[..i] {
            assert!(shared_prefix(a, b) < 4, "{} and {} share nothing", a.index, b.index);
        }
    }
}

#[test]
fn a_weka_session_from_shared_traces_if_there() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/weka/trace_0277.json");
    if !path.exists() {
        eprintln!("{} is not here (a clean clone): skipped", path.display());
        return;
    }
    let trace =
        load(&path, &ImportOptions { scale_tokens: 1.0 / 64.0, ..ImportOptions::default() })
            .unwrap();
    // 9 requests of the main agent, 4 sub-agents of 4, 12, 17 and 11.
    assert_eq!(trace.requests.len(), 9 + 4 + 12 + 17 + 11);
    let sub_agents =
        trace.requests.iter().filter(|r| r.turn == 1 && matches!(r.start, Start::After { .. }));
    assert_eq!(sub_agents.count(), 4);
}

#[test]
fn the_format_is_told_by_content() {
    let options = ImportOptions::default();
    let mooncake = r#"{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}"#;
    assert_eq!(parse("m", mooncake, &options).unwrap().requests[0].input.len(), 3);
    let azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,5,1\n";
    assert_eq!(parse("a", azure, &options).unwrap().requests[0].input.len(), 5);
    let weka = r#"{"id":"w","requests":[{"t":0,"type":"n","in":70,"out":1,"hash_ids":[1]}]}"#;
    assert_eq!(parse("w", weka, &options).unwrap().requests[0].input.len(), 70);
    let native = std::fs::read_to_string(committed("recorded_router_1p1d_smollm2.jsonl")).unwrap();
    assert_eq!(parse("n", &native, &options).unwrap().vocab_size, 49_152);
}

#[test]
fn bad_input_is_an_error_naming_the_file_and_line() {
    let options = ImportOptions::default();
    let mooncake = r#"{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}"#;
    let native = std::fs::read_to_string(committed("recorded_router_1p1d_smollm2.jsonl")).unwrap();
    let native_lines: Vec<&str> = native.lines().collect();
    let cases: Vec<(&str, String, &str)> = vec![
        ("broken.jsonl", format!("{mooncake}\n{{\"timestamp\": 5,\n"), "broken.jsonl: line 2:"),
        (
            "missing.jsonl",
            format!("{mooncake}\n{}\n", mooncake.replace("\"input_length\": 3, ", "")),
            "missing.jsonl: line 2: missing field `input_length`",
        ),
        (
            "negative.jsonl",
            format!(
                "{mooncake}\n{}\n",
                mooncake.replace("\"output_length\": 1", "\"output_length\": -1")
            ),
            "negative.jsonl: line 2: invalid value",
        ),
        ("empty.jsonl", String::new(), "empty.jsonl: empty"),
        ("blank.jsonl", "\n  \n".into(), "blank.jsonl: empty"),
        (
            "native.jsonl",
            format!("{}\n{}\n{{\"request_id\":\n", native_lines[0], native_lines[1]),
            "native.jsonl: line 3:",
        ),
        ("nonsense.txt", "hello\n".into(), "nonsense.txt: line 1: not a trace"),
        ("neither.jsonl", "{\"a\": 1}\n".into(), "neither.jsonl: line 1: neither"),
        (
            "azure.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,5\n".into(),
            "azure.csv: line 2: 2 fields",
        ),
        (
            "weka.json",
            r#"{"requests":[{"t":0,"type":"n","out":1,"hash_ids":[]}]}"#.into(),
            "weka.json: requests[0]: missing field `in`",
        ),
    ];
    let dir = std::env::temp_dir().join(format!("lockstep-trace-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, &text).unwrap();
        let e = load(&path, &options).unwrap_err();
        assert!(e.starts_with(&path.display().to_string()), "{e}");
        assert!(e.contains(expected), "{expected:?} not in {e:?}");
        let e = parse(name, &text, &options).unwrap_err();
        assert!(e.starts_with(name), "{e}");
    }
    let missing = dir.join("not-there.jsonl");
    assert!(load(&missing, &options).unwrap_err().contains("not-there.jsonl"));
    let empty_dir = dir.join("no-sessions");
    std::fs::create_dir_all(&empty_dir).unwrap();
    assert!(load(&empty_dir, &options).unwrap_err().contains("no *.json session files"));
    std::fs::remove_dir_all(&dir).unwrap();
}
