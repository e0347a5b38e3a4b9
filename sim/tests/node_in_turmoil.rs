//! The server's node runtime and HTTP app, unchanged, on a turmoil host: the provenance model
//! behind the real engine loop, steps lasting a modelled time on turmoil's virtual clock, clients
//! on other hosts completing requests over simulated TCP. Each request's output equals its output
//! alone, and the same seed replays to the same outputs.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::ProvenanceModel;
use lockstep_core::sched::{SchedConfig, StepMode};
use lockstep_server::client::Connection;
use lockstep_server::engine::{EngineConfig, InlineRunner, StepCost};
use lockstep_server::http::AppConfig;
use lockstep_server::node;
use lockstep_server::text::SyntheticCodec;
use lockstep_sim::net::TurmoilListener;
use serde_json::{Value, json};

const PORT: u16 = 8000;
const VOCAB: u32 = 500;

fn sched(mode: StepMode) -> SchedConfig {
    SchedConfig {
        pool: PoolConfig { pages_total: 64, page_tokens: 4, pins_max: 0 },
        mode,
        waiting_max: 16,
        running_max: 4,
        step_tokens_max: 32,
        prefill_chunk_tokens_max: 8,
        scored_tokens_max: 8,
        request_tokens_max: 128,
        capture_sizes: vec![1, 2, 4],
        eos_token_ids: vec![],
        queue_wait_max: Duration::from_secs(60),
        prefix_cache: true,
    }
}

fn cost() -> StepCost {
    StepCost {
        per_step: Duration::from_millis(2),
        per_prefill_token: Duration::from_micros(50),
        per_decode_token: Duration::from_micros(200),
    }
}

/// Runs one server host and `prompts.len()` client hosts; each client's completion text.
fn simulate(seed: u64, mode: StepMode, prompts: &[Vec<u32>], streamed: bool) -> Vec<String> {
    let mut sim =
        turmoil::Builder::new().rng_seed(seed).simulation_duration(Duration::from_secs(60)).build();
    sim.host("server", move || async move {
        let config = sched(mode);
        let model = ProvenanceModel::new(config.pool, config.running_max, VOCAB);
        let mut engine = EngineConfig::new(config.clone());
        engine.check_invariants = true;
        let runner = InlineRunner::new(model, cost());
        let codec = Arc::new(SyntheticCodec::new(VOCAB));
        let node = node::start(engine, runner, codec, AppConfig::new("sim", 128))?;
        let listener = TurmoilListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?;
        node.serve(listener, std::future::pending(), Duration::from_secs(1)).await?;
        Ok(())
    });
    let outputs = Arc::new(Mutex::new(vec![String::new(); prompts.len()]));
    for (i, prompt) in prompts.iter().enumerate() {
        let (prompt, outputs) = (prompt.clone(), outputs.clone());
        sim.client(format!("client{i}"), async move {
            // Arrivals spread over a few virtual milliseconds.
            tokio::time::sleep(Duration::from_millis(i as u64 % 5)).await;
            let io = turmoil::net::TcpStream::connect(("server", PORT)).await?;
            let mut connection = Connection::new(io).await?;
            let body =
                json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": streamed});
            let response = connection.post("/v1/completions", &body.to_string()).await?;
            assert_eq!(response.status.as_u16(), 200);
            let text = if streamed {
                let events = response.events().await?;
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
                events[..events.len() - 1]
                    .iter()
                    .map(|e| serde_json::from_str::<Value>(e).map_err(|e| e.to_string()))
                    .map(|e| e.map(|e| e["choices"][0]["text"].as_str().unwrap_or("").to_owned()))
                    .collect::<Result<String, String>>()?
            } else {
                let body = response.json().await?;
                body["choices"][0]["text"].as_str().unwrap_or("").to_owned()
            };
            outputs.lock().expect("one client at a time holds it")[i] = text;
            Ok(())
        });
    }
    sim.run().expect("the simulation runs to the end of every client");
    outputs.lock().expect("the simulation is over").clone()
}

fn prompts() -> Vec<Vec<u32>> {
    (0..8u32).map(|i| (0..2 + i * 3).map(|t| 1 + (i * 31 + t * 7) % 400).collect()).collect()
}

#[test]
fn requests_complete_through_http_inside_turmoil_and_equal_each_alone() {
    let prompts = prompts();
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let crowd = simulate(1, mode, &prompts, false);
        for (i, prompt) in prompts.iter().enumerate() {
            let alone = simulate(1, mode, std::slice::from_ref(prompt), false);
            assert_eq!(crowd[i], alone[0], "{mode:?}: request {i} differs in the crowd");
            assert_eq!(crowd[i].split_whitespace().count(), 8);
        }
        assert_eq!(simulate(7, mode, &prompts, true), crowd, "{mode:?}: streamed differs");
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let prompts = prompts();
    assert_eq!(
        simulate(42, StepMode::Overlap, &prompts, true),
        simulate(42, StepMode::Overlap, &prompts, true)
    );
}
