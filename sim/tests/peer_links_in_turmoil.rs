//! The peer transport between two turmoil hosts, through `TurmoilListener` and `TurmoilDial`:
//! envelopes flow both ways; a partition makes both ends report the link down within the dead
//! bound; repairing it brings the link up again and envelopes flow again; a crashed worker is
//! reported down, and once restarted as a new incarnation it is redialed and reported up as that
//! incarnation. The same seed gives the same run, event for event.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_core::wire::{
    Endpoint, Envelope, Epoch, Incarnation, KvLayout, LinkIdentity, Message, Role, TransferId,
    TransferKey, WorkerId,
};
use lockstep_server::peer::{PeerConfig, PeerEvent, Transport};
use lockstep_sim::net::{TurmoilDial, TurmoilListener};
use tokio::time::{interval, sleep};

const PORT: u16 = 9000;
const PING_INTERVAL: Duration = Duration::from_millis(100);
const DEAD_AFTER: Duration = Duration::from_millis(500);
const PREFILL: WorkerId = WorkerId(1);
const DECODE: WorkerId = WorkerId(2);

/// What a host saw, when (simulated time since the start).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    at: Duration,
    host: &'static str,
    what: What,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum What {
    Up(Endpoint),
    Down(Endpoint, String),
    Received(u64),
    Partitioned,
    Repaired,
    Crashed,
    Restarted,
}

/// The fault the run injects between 1 s and 3 s.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The network between the two hosts, from the driver client.
    Partition,
    /// The decode host, from the test (only the `Sim` crashes and restarts hosts).
    CrashDecode,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn record(log: &Log, host: &'static str, what: What) {
    let at = turmoil::sim_elapsed().unwrap_or_default();
    log.lock().expect("one host at a time").push(Seen { at, host, what });
}

fn config(me: Endpoint, role: Role, dial: Vec<(WorkerId, String)>) -> PeerConfig {
    let kv_layout = KvLayout { layers: 2, kv_heads: 2, head_dim: 8, element_bytes: 2 };
    let identity = LinkIdentity { role, page_tokens: 16, kv_layout, model: 42 };
    let mut config = PeerConfig::new(me, identity, dial);
    config.hello_timeout = Duration::from_millis(500);
    config.ping_interval = PING_INTERVAL;
    config.dead_after = DEAD_AFTER;
    config.io_timeout = Duration::from_secs(1);
    config.backoff_min = Duration::from_millis(50);
    config.backoff_max = Duration::from_millis(400);
    config
}

/// One worker: reports what it sees; the prefill side sends a numbered envelope every 20 ms
/// while its link is up, and the decode side answers each with the same number.
async fn worker(host: &'static str, config: PeerConfig, log: Log) -> turmoil::Result {
    let me = config.me;
    let (transport, mut events) = Transport::start(config, TurmoilDial::default())?;
    transport.listen(TurmoilListener::bind((IpAddr::V4(Ipv4Addr::UNSPECIFIED), PORT)).await?);
    let mut peer = None;
    let mut ticks = interval(Duration::from_millis(20));
    let mut next = 0u64;
    loop {
        tokio::select! {
            event = events.recv() => match event.ok_or("the transport ended")? {
                PeerEvent::Up { peer: up, .. } => {
                    peer = Some(up);
                    record(&log, host, What::Up(up));
                }
                PeerEvent::Down { peer: down, reason } => {
                    peer = None;
                    record(&log, host, What::Down(down, reason.to_string()));
                }
                // Nothing here travels on a KV lane.
                PeerEvent::KvLaneDown { .. } => {}
                PeerEvent::Received(envelope) => {
                    let number = transfer_of(&envelope);
                    record(&log, host, What::Received(number));
                    if me.worker == DECODE {
                        let _ = transport.try_send(&numbered(me, envelope.from, number));
                    }
                }
            },
            _ = ticks.tick() => {
                if let (Some(peer), true) = (peer, me.worker == PREFILL) {
                    next += 1;
                    let _ = transport.try_send(&numbered(me, peer, next));
                }
            }
        }
    }
}

fn numbered(from: Endpoint, to: Endpoint, number: u64) -> Envelope {
    let key = TransferKey { transfer: TransferId(number), epoch: Epoch(0) };
    Envelope { from, to, body: Message::DoneAck { key } }
}

fn transfer_of(envelope: &Envelope) -> u64 {
    envelope.body.key().map_or(0, |key| key.transfer.0)
}

fn at(worker: WorkerId, incarnation: u64) -> Endpoint {
    Endpoint { worker, incarnation: Incarnation(incarnation) }
}

fn simulate(seed: u64, fault: Fault) -> Vec<Seen> {
    let log: Log = Arc::default();
    let mut sim =
        turmoil::Builder::new().rng_seed(seed).simulation_duration(Duration::from_secs(30)).build();
    let decode_log = log.clone();
    // Each start of the decode host is a new incarnation.
    let decode_starts = Arc::new(AtomicU64::new(0));
    sim.host("decode", move || {
        let log = decode_log.clone();
        let incarnation = decode_starts.fetch_add(1, Ordering::Relaxed) + 1;
        let config = config(at(DECODE, incarnation), Role::Decode, vec![]);
        async move { worker("decode", config, log).await }
    });
    let prefill_log = log.clone();
    sim.host("prefill", move || {
        let log = prefill_log.clone();
        let dial = vec![(DECODE, format!("decode:{PORT}"))];
        let config = config(at(PREFILL, 1), Role::Prefill, dial);
        async move { worker("prefill", config, log).await }
    });
    let driver_log = log.clone();
    sim.client("driver", async move {
        sleep(Duration::from_secs(1)).await;
        if let Fault::Partition = fault {
            turmoil::partition("prefill", "decode");
            record(&driver_log, "driver", What::Partitioned);
        }
        sleep(Duration::from_secs(2)).await;
        if let Fault::Partition = fault {
            turmoil::repair("prefill", "decode");
            record(&driver_log, "driver", What::Repaired);
        }
        sleep(Duration::from_secs(2)).await;
        Ok(())
    });
    let mut crashed = false;
    let mut restarted = false;
    while !sim.step().expect("no host fails") {
        let Fault::CrashDecode = fault else { continue };
        let now = sim.elapsed();
        if !crashed && now >= Duration::from_secs(1) {
            sim.crash("decode");
            crashed = true;
            log.lock().expect("between steps").push(Seen {
                at: now,
                host: "test",
                what: What::Crashed,
            });
        }
        if !restarted && now >= Duration::from_secs(3) {
            sim.bounce("decode");
            restarted = true;
            log.lock().expect("between steps").push(Seen {
                at: now,
                host: "test",
                what: What::Restarted,
            });
        }
    }
    log.lock().expect("the simulation is over").clone()
}

fn when(log: &[Seen], what: &What) -> Duration {
    log.iter().find(|seen| &seen.what == what).map(|seen| seen.at).expect("it happened")
}

#[test]
fn a_partition_is_noticed_on_both_ends_within_the_bound_and_a_repair_relinks() {
    let log = simulate(1, Fault::Partition);
    let (prefill, decode) = (at(PREFILL, 1), at(DECODE, 1));
    let partitioned = when(&log, &What::Partitioned);
    let repaired = when(&log, &What::Repaired);
    let of = |host: &str, at_or_after: Duration| -> Vec<Seen> {
        log.iter().filter(|s| s.host == host && s.at >= at_or_after).cloned().collect()
    };

    for (host, peer) in [("prefill", decode), ("decode", prefill)] {
        let before = of(host, Duration::ZERO);
        assert_eq!(before[0].what, What::Up(peer), "{host} links first: {before:?}");
        let received_before = before
            .iter()
            .filter(|s| s.at < partitioned && matches!(s.what, What::Received(_)))
            .count();
        assert!(received_before >= 10, "{host} received {received_before} before the partition");

        let after = of(host, partitioned);
        let down = after
            .iter()
            .find(|s| matches!(&s.what, What::Down(p, _) if *p == peer))
            .unwrap_or_else(|| panic!("{host} never saw the link down: {after:?}"));
        let noticed = down.at - partitioned;
        // The last byte heard came at most a ping interval (plus latency) before the partition.
        assert!(noticed <= DEAD_AFTER + Duration::from_millis(20), "{host}: {noticed:?}");
        assert!(noticed >= DEAD_AFTER - PING_INTERVAL - Duration::from_millis(20), "{host}");
        assert!(down.at < repaired);

        let healed = of(host, repaired);
        let up = healed
            .iter()
            .position(|s| s.what == What::Up(peer))
            .unwrap_or_else(|| panic!("{host} never relinked: {healed:?}"));
        assert!(healed[up].at - repaired < Duration::from_secs(1), "{host} relinks within backoff");
        let received_after =
            healed[up..].iter().filter(|s| matches!(s.what, What::Received(_))).count();
        assert!(received_after >= 10, "{host} received {received_after} after the repair");
    }
}

#[test]
fn a_crashed_worker_is_reported_down_and_its_restart_relinks_as_the_new_incarnation() {
    let log = simulate(2, Fault::CrashDecode);
    let crashed = when(&log, &What::Crashed);
    let restarted = when(&log, &What::Restarted);
    let prefill: Vec<&Seen> = log.iter().filter(|s| s.host == "prefill").collect();
    let down = prefill
        .iter()
        .find(|s| matches!(&s.what, What::Down(p, _) if *p == at(DECODE, 1)))
        .unwrap_or_else(|| panic!("the crash went unnoticed: {prefill:?}"));
    assert!(down.at >= crashed && down.at - crashed <= DEAD_AFTER + Duration::from_millis(20));
    let up = prefill
        .iter()
        .position(|s| s.what == What::Up(at(DECODE, 2)))
        .unwrap_or_else(|| panic!("never relinked to the new life: {prefill:?}"));
    assert!(prefill[up].at >= restarted && prefill[up].at - restarted < Duration::from_secs(1));
    let received = prefill[up..].iter().filter(|s| matches!(s.what, What::Received(_))).count();
    assert!(received >= 10, "the prefill side received {received} answers from the new life");
    let decode_ups: Vec<&Seen> =
        log.iter().filter(|s| s.host == "decode" && matches!(s.what, What::Up(_))).collect();
    assert_eq!(decode_ups.len(), 2, "one up per life of the decode host: {decode_ups:?}");
}

#[test]
fn the_same_seed_gives_the_same_run() {
    for fault in [Fault::Partition, Fault::CrashDecode] {
        assert_eq!(simulate(7, fault), simulate(7, fault), "{fault:?}");
    }
}
