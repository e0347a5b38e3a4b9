//! The idle fast-forward: turmoil's `Sim::step_for` (the vendored patch, sim/vendor/) moves time
//! by its duration with timers firing at their own times inside it, and a run that crosses its
//! idle spans in long steps ends as the same run stepped tick by tick.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_sim::device::CostModel;
use lockstep_sim::faults::FaultLevel;
use lockstep_sim::knobs::Topology;
use lockstep_sim::oracle::{self, determinism};
use lockstep_sim::reference::Reference;
use lockstep_sim::run::{RunConfig, run};
use lockstep_sim::trace::{SimRequest, SimTrace, Start};

const MS: Duration = Duration::from_millis(1);

#[test]
fn step_for_moves_time_by_its_duration_and_fires_timers_at_their_own_times() {
    let mut sim = turmoil::Builder::new().tick_duration(MS).build();
    let fired = Arc::new(Mutex::new(Vec::new()));
    let seen = fired.clone();
    sim.client("sleeper", async move {
        for at in [2, 3, 7] {
            let now = turmoil::sim_elapsed().expect("in the simulation");
            tokio::time::sleep(at * MS - now).await;
            seen.lock().expect("one host").push(turmoil::sim_elapsed().expect("in the simulation"));
        }
        Ok(())
    });
    assert!(!sim.step_for(5 * MS).expect("runs"));
    assert_eq!(sim.elapsed(), 5 * MS);
    assert_eq!(*fired.lock().expect("between steps"), [2 * MS, 3 * MS]);
    // Back to the tick.
    assert!(!sim.step().expect("runs"));
    assert_eq!(sim.elapsed(), 6 * MS);
    assert!(sim.step_for(2 * MS).expect("runs"), "the client ends at 7 ms");
    assert_eq!(sim.elapsed(), 8 * MS);
    assert_eq!(*fired.lock().expect("after"), [2 * MS, 3 * MS, 7 * MS]);
}

/// A sim whose client sends one datagram at 2 ms to a host that notes the step boundary it
/// arrives by; every message takes 3.5 ms.
fn ping_sim(received: Arc<Mutex<Option<Duration>>>) -> turmoil::Sim<'static> {
    let latency = Duration::from_micros(3_500);
    let mut sim = turmoil::Builder::new()
        .tick_duration(MS)
        .min_message_latency(latency)
        .max_message_latency(latency)
        .build();
    sim.host("listener", move || {
        let received = received.clone();
        async move {
            let socket = turmoil::net::UdpSocket::bind(("0.0.0.0", 9_000)).await?;
            let mut buf = [0u8; 8];
            socket.recv_from(&mut buf).await?;
            *received.lock().expect("one host") = Some(turmoil::sim_elapsed().expect("in it"));
            std::future::pending::<()>().await;
            Ok(())
        }
    });
    sim.client("pinger", async move {
        tokio::time::sleep(2 * MS).await;
        let socket = turmoil::net::UdpSocket::bind(("0.0.0.0", 9_001)).await?;
        socket.send_to(b"ping", ("listener", 9_000)).await?;
        std::future::pending::<()>().await;
        Ok(())
    });
    sim
}

/// When each message in flight is due (the vendored patch's `SentRef::deliver_in`) and where a
/// long step may end so that the message arrives at the same step as tick by tick.
fn in_flight(sim: &turmoil::Sim<'_>) -> Vec<Option<Duration>> {
    let mut due = Vec::new();
    sim.links(|links| {
        for link in links {
            due.extend(link.map(|sent| sent.deliver_in()));
        }
    });
    due
}

#[test]
fn a_long_step_up_to_the_delivering_tick_delivers_in_flight_messages_at_the_same_step() {
    let (ticked, long) = (Arc::new(Mutex::new(None)), Arc::new(Mutex::new(None)));
    let (mut a, mut b) = (ping_sim(ticked.clone()), ping_sim(long.clone()));
    while in_flight(&a).is_empty() {
        a.step().expect("runs");
        b.step().expect("runs");
    }
    let sent_by = a.elapsed();
    assert_eq!(in_flight(&b), [Some(Duration::from_micros(3_500))], "stamped at the step's end");
    while ticked.lock().expect("between steps").is_none() {
        a.step().expect("runs");
    }
    let arrival = *ticked.lock().expect("between steps");
    assert_eq!(a.elapsed(), sent_by + 4 * MS, "by the fourth tick after the send");

    // Released at the start of the first step that ends at or after its delivery time: the
    // fourth tick after the send (it ends 4 ms after it). A long step of the ticks before it.
    let due = in_flight(&b)[0].expect("not held");
    let before = due.as_nanos().div_ceil(MS.as_nanos()) - 1;
    assert_eq!(before, 3);
    b.step_for(MS * before as u32).expect("runs");
    assert_eq!(*long.lock().expect("between steps"), None, "not delivered early");
    assert_eq!(in_flight(&b), [Some(Duration::from_micros(500))]);
    b.step().expect("runs");
    assert_eq!(*long.lock().expect("between steps"), arrival);
    assert_eq!(b.elapsed(), sent_by + 4 * MS);
    assert!(in_flight(&b).is_empty());
}

/// Three sessions of three turns, 20 s of think time between turns: mostly idle, as agentic
/// traces are.
fn thinking_trace() -> SimTrace {
    let mut requests = Vec::new();
    for session in 0..3u32 {
        for turn in 1..=3u32 {
            let index = requests.len();
            let start = if turn == 1 {
                Start::At(Duration::from_millis(u64::from(session) * 13))
            } else {
                Start::After { previous: index - 1, think: Duration::from_secs(20) }
            };
            let input = (0..(20 + turn * 11)).map(|t| 100 + session * 1_000 + t * 3).collect();
            requests.push(SimRequest {
                index,
                session: Some(session),
                turn,
                start,
                input,
                max_tokens: 16,
                temperature: if session == 1 { 0.7 } else { 0.0 },
                seed: u64::from(session * 10 + turn),
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
                logit_bias: Vec::new(),
                constrained: false,
                priority: 0,
                logprobs: None,
                echo: false,
            });
        }
    }
    SimTrace { name: "thinking".into(), vocab_size: 32_000, requests }
}

#[test]
fn idle_spans_are_crossed_in_long_steps_with_the_same_outcome() {
    let trace = thinking_trace();
    let reference =
        Reference::compute(&trace, CostModel::default_model(), 2).expect("each completes alone");
    for (topology, faults, seeds) in [
        (Topology::Single, FaultLevel::None, 0..1),
        (Topology::OneP1D, FaultLevel::None, 0..1),
        (Topology::OneP1D, FaultLevel::Default, 0..2),
        (Topology::TwoP2D, FaultLevel::Heavy, 0..1),
    ] {
        for seed in seeds {
            let mut config = RunConfig::new(seed, topology, faults);
            config.client_timeout = Duration::from_secs(60);
            config.settle_max = Duration::from_secs(5);
            let fast = run(&trace, &config);
            let what = format!("{topology} {faults} seed {seed}");
            let violations = oracle::check(&reference, &fast);
            assert!(violations.is_empty(), "{what}: {violations:?}");
            assert!(determinism::check(&fast, &run(&trace, &config)).is_empty(), "{what}");
            let covered = fast.fast_forwarded.as_secs_f64() / fast.virtual_time.as_secs_f64();
            assert!(fast.long_steps > 0 && covered > 0.8, "{what}: {covered}");

            config.fast_forward = false;
            let exact = run(&trace, &config);
            assert_eq!(exact.long_steps, 0);
            assert!(oracle::check(&reference, &exact).is_empty(), "{what}");
            assert!(fast.steps * 5 < exact.steps, "{what}: {} vs {}", fast.steps, exact.steps);
            if faults == FaultLevel::None {
                // Nothing drawn depends on time: every client sees the same answer.
                let answers = |o: &lockstep_sim::run::RunOutcome| {
                    o.observed
                        .iter()
                        .map(|s| (s.ending.clone(), s.tokens.clone()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(answers(&fast), answers(&exact), "{what}");
            }
        }
    }
}
