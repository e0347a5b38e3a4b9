//! The peer transport on tokio's loopback TCP: envelopes both ways, identity mismatches refused
//! by both ends, a dead or silent peer reported down within the bound, a restarted peer back up
//! with its new incarnation, a newer incarnation superseding an older, garbage closing only its
//! own link, and every task gone once the transports are dropped.
//!
//! Real sockets need real time (tokio's paused clock would jump over socket waits), so the bounds
//! are short: pings every 50 ms, dead after 300 ms.

use std::time::Duration;

use axum::serve::ListenerExt;
use lockstep_core::wire::{
    Endpoint, Envelope, Epoch, Incarnation, KvLayout, Lane, LinkIdentity, LinkMismatch, Message,
    PageSlot, Role, TransferId, TransferKey, WorkerId, decode_frame, encode_frame,
};
use lockstep_server::peer::{
    LinkError, PeerConfig, PeerEvent, PeerStatsSnapshot, SendError, TcpDial, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, timeout};

const DEAD_AFTER: Duration = Duration::from_millis(300);
/// Slack for scheduling on a loaded machine; the bound itself is `DEAD_AFTER`.
const MARGIN: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(3);

const PREFILL: WorkerId = WorkerId(1);
const DECODE: WorkerId = WorkerId(2);

fn identity(role: Role) -> LinkIdentity {
    LinkIdentity {
        role,
        page_tokens: 16,
        kv_layout: KvLayout { layers: 2, kv_heads: 2, head_dim: 8, element_bytes: 2 },
        model: 42,
    }
}

fn at(worker: WorkerId, incarnation: u64) -> Endpoint {
    Endpoint { worker, incarnation: Incarnation(incarnation) }
}

/// What each worker's `Hello` says it takes at once: its own number, so that each end's `Up`
/// shows the other's arrived, whichever end dialed.
fn places_of(worker: WorkerId) -> u32 {
    10 + worker.0
}

fn config(me: Endpoint, identity: LinkIdentity, dial: Vec<(WorkerId, String)>) -> PeerConfig {
    let mut config = PeerConfig::new(me, identity, dial);
    config.places = places_of(me.worker);
    config.hello_timeout = Duration::from_millis(300);
    config.ping_interval = Duration::from_millis(50);
    config.dead_after = DEAD_AFTER;
    config.io_timeout = Duration::from_millis(500);
    config.backoff_min = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(100);
    config
}

async fn listener_on(addr: &str) -> (impl axum::serve::Listener, String) {
    let listener = TcpListener::bind(addr).await.expect("loopback binds");
    let addr = listener.local_addr().expect("bound").to_string();
    let listener = listener.tap_io(|stream| {
        let _ = stream.set_nodelay(true);
    });
    (listener, addr)
}

struct Peer {
    transport: Transport,
    events: mpsc::Receiver<PeerEvent>,
}

/// A decode worker listening on `addr` ("127.0.0.1:0" for any port); the address it got.
async fn decode_at(incarnation: u64, addr: &str, identity: LinkIdentity) -> (Peer, String) {
    let (listener, addr) = listener_on(addr).await;
    let (transport, events) =
        Transport::start(config(at(DECODE, incarnation), identity, vec![]), TcpDial)
            .expect("a good config");
    transport.listen(listener);
    (Peer { transport, events }, addr)
}

/// A prefill worker dialing the decode worker at `decode_addr`.
fn prefill_dialing(incarnation: u64, decode_addr: &str, identity: LinkIdentity) -> Peer {
    let dial = vec![(DECODE, decode_addr.to_owned())];
    let (transport, events) =
        Transport::start(config(at(PREFILL, incarnation), identity, dial), TcpDial)
            .expect("a good config");
    Peer { transport, events }
}

impl Peer {
    /// The next event other than a KV lane's end (a prefill worker's KV lane comes and goes with
    /// its control link; the test of the lanes looks at those).
    async fn next_event(&mut self) -> PeerEvent {
        loop {
            match self.next_event_of_any_lane().await {
                PeerEvent::KvLaneDown { .. } => continue,
                event => return event,
            }
        }
    }

    async fn next_event_of_any_lane(&mut self) -> PeerEvent {
        timeout(WAIT, self.events.recv())
            .await
            .expect("an event within the wait")
            .expect("the transport is alive")
    }

    async fn expect_up(&mut self, peer: Endpoint) {
        assert_eq!(self.next_event().await, PeerEvent::Up { peer, places: places_of(peer.worker) });
    }

    async fn expect_down(&mut self, peer: Endpoint) -> LinkError {
        match self.next_event().await {
            PeerEvent::Down { peer: down, reason } if down == peer => reason,
            other => panic!("expected {peer:?} down, got {other:?}"),
        }
    }

    async fn stats_when(&self, done: impl Fn(&PeerStatsSnapshot) -> bool) -> PeerStatsSnapshot {
        let start = Instant::now();
        loop {
            let stats = self.transport.stats();
            if done(&stats) {
                return stats;
            }
            assert!(start.elapsed() < WAIT, "stats never got there: {stats:?}");
            sleep(Duration::from_millis(10)).await;
        }
    }
}

fn kv_write(from: Endpoint, to: Endpoint, transfer: u64, bytes: usize) -> Envelope {
    let key = TransferKey { transfer: TransferId(transfer), epoch: Epoch(0) };
    let page = PageSlot { index: 3, generation: 1 };
    Envelope {
        from,
        to,
        body: Message::KvWrite { key, page, first_token: 0, data: vec![7; bytes] },
    }
}

fn done_ack(from: Endpoint, to: Endpoint, transfer: u64) -> Envelope {
    let key = TransferKey { transfer: TransferId(transfer), epoch: Epoch(0) };
    Envelope { from, to, body: Message::DoneAck { key } }
}

#[tokio::test]
async fn envelopes_flow_both_ways_in_order() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let mut prefill = prefill_dialing(1, &addr, identity(Role::Prefill));
    prefill.expect_up(at(DECODE, 1)).await;
    decode.expect_up(at(PREFILL, 1)).await;
    let (p, d) = (prefill.transport.me(), decode.transport.me());
    for transfer in 0..100 {
        prefill.transport.send(&done_ack(p, d, transfer)).await.expect("room on the link");
        decode.transport.try_send(&done_ack(d, p, 1000 + transfer)).expect("room on the link");
    }
    for transfer in 0..100 {
        assert_eq!(decode.next_event().await, PeerEvent::Received(done_ack(p, d, transfer)));
        assert_eq!(
            prefill.next_event().await,
            PeerEvent::Received(done_ack(d, p, 1000 + transfer))
        );
    }
    // A control link, and the KV lane the prefill worker dials beside it.
    let stats = decode.stats_when(|s| s.links_opened >= 2).await;
    assert_eq!(stats.links_opened, 2);
    assert!(stats.frames_received >= 101 && stats.frames_sent >= 101, "{stats:?}");
    assert_eq!(decode.transport.live_peers(), [p]);
}

#[tokio::test]
async fn sends_without_a_link_or_to_another_life_are_refused_and_counted() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let d = decode.transport.me();
    let nobody = at(WorkerId(9), 1);
    let refused = decode.transport.try_send(&done_ack(d, nobody, 1));
    assert_eq!(refused, Err(SendError::NoLink { worker: WorkerId(9) }));
    let mut prefill = prefill_dialing(3, &addr, identity(Role::Prefill));
    decode.expect_up(at(PREFILL, 3)).await;
    let old_life = decode.transport.send(&done_ack(d, at(PREFILL, 2), 1)).await;
    assert_eq!(
        old_life,
        Err(SendError::OtherIncarnation { to: at(PREFILL, 2), live: at(PREFILL, 3) })
    );
    let ping = Envelope { from: d, to: at(PREFILL, 3), body: Message::Ping { nonce: 1 } };
    assert_eq!(decode.transport.try_send(&ping), Err(SendError::LinkMessage));
    let forged = done_ack(at(WorkerId(5), 1), at(PREFILL, 3), 1);
    assert!(matches!(decode.transport.try_send(&forged), Err(SendError::NotFromMe { .. })));
    let stats = decode.transport.stats();
    assert_eq!((stats.sends_no_link, stats.sends_invalid), (2, 2));
    prefill.expect_up(at(DECODE, 1)).await;
}

#[tokio::test]
async fn an_identity_mismatch_refuses_the_link_on_both_ends_and_counts_it() {
    let other_model = LinkIdentity { model: 43, ..identity(Role::Prefill) };
    let other_pages = LinkIdentity { page_tokens: 32, ..identity(Role::Prefill) };
    for (theirs, mismatch) in [
        (other_model, LinkMismatch::Model),
        (other_pages, LinkMismatch::PageTokens),
        (identity(Role::Decode), LinkMismatch::Roles),
    ] {
        let (decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
        let prefill = prefill_dialing(1, &addr, theirs);
        // The dialer retries with backoff: at least two refusals on each end.
        decode.stats_when(|s| s.links_refused >= 2).await;
        let stats = prefill.stats_when(|s| s.links_refused >= 2).await;
        assert_eq!(stats.links_opened, 0, "{mismatch:?}");
        assert_eq!(decode.transport.stats().links_opened, 0, "{mismatch:?}");
        assert!(decode.transport.live_peers().is_empty());
        assert!(prefill.transport.live_peers().is_empty());
    }
}

#[tokio::test]
async fn a_dropped_peer_is_reported_down_and_its_restart_comes_up_with_the_new_incarnation() {
    let (decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let mut prefill = prefill_dialing(1, &addr, identity(Role::Prefill));
    prefill.expect_up(at(DECODE, 1)).await;

    let dropped = Instant::now();
    drop(decode);
    let reason = prefill.expect_down(at(DECODE, 1)).await;
    assert!(dropped.elapsed() < DEAD_AFTER + MARGIN, "{:?}: {reason}", dropped.elapsed());

    // The prefill side redials with backoff while nobody listens.
    prefill.stats_when(|s| s.dials_failed >= 2).await;
    let (mut decode, _) = decode_at(2, &addr, identity(Role::Decode)).await;
    prefill.expect_up(at(DECODE, 2)).await;
    decode.expect_up(at(PREFILL, 1)).await;
    let (p, d) = (prefill.transport.me(), decode.transport.me());
    prefill.transport.send(&done_ack(p, d, 7)).await.expect("room on the new link");
    assert_eq!(decode.next_event().await, PeerEvent::Received(done_ack(p, d, 7)));
}

/// Does a real handshake as the prefill worker, then never sends another byte.
async fn silent_prefill(addr: &str, incarnation: u64) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("loopback connects");
    let hello = Envelope {
        from: at(PREFILL, incarnation),
        to: at(DECODE, 0),
        body: Message::Hello {
            identity: identity(Role::Prefill),
            lane: Lane::Control,
            places: places_of(PREFILL),
        },
    };
    let frame = encode_frame(&hello, Vec::new()).expect("a hello encodes");
    stream.write_all(&frame).await.expect("the decode side reads");
    stream
}

#[tokio::test]
async fn a_silent_peer_is_reported_down_within_the_dead_bound_and_not_before() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let _silent = silent_prefill(&addr, 1).await;
    decode.expect_up(at(PREFILL, 1)).await;
    let up = Instant::now();
    assert_eq!(decode.expect_down(at(PREFILL, 1)).await, LinkError::Silent);
    let silent_for = up.elapsed();
    assert!(silent_for >= DEAD_AFTER - Duration::from_millis(20), "{silent_for:?}");
    assert!(silent_for < DEAD_AFTER + MARGIN, "{silent_for:?}");
    assert_eq!(decode.transport.stats().links_died, 1);
}

#[tokio::test]
async fn a_newer_incarnation_supersedes_the_live_link_and_the_older_is_refused_after() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let mut old = prefill_dialing(1, &addr, identity(Role::Prefill));
    decode.expect_up(at(PREFILL, 1)).await;
    old.expect_up(at(DECODE, 1)).await;

    let new = prefill_dialing(2, &addr, identity(Role::Prefill));
    let reason = decode.expect_down(at(PREFILL, 1)).await;
    assert_eq!(reason, LinkError::Superseded { by: at(PREFILL, 2) });
    decode.expect_up(at(PREFILL, 2)).await;
    // The old life sees its link closed, redials, and is refused from then on.
    old.expect_down(at(DECODE, 1)).await;
    decode.stats_when(|s| s.links_stale >= 2).await;
    assert_eq!(decode.transport.live_peers(), [at(PREFILL, 2)]);
    // The old life's control link and its KV lane.
    assert_eq!(decode.transport.stats().links_superseded, 2);
    drop(new);
}

#[tokio::test]
async fn garbage_or_an_oversized_frame_closes_only_that_link() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let oversized = u32::MAX.to_le_bytes().to_vec();
    let undecodable = [8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff].to_vec();
    // Within the wire's bound, but far over a Hello's: refused before the bytes come.
    let too_long_for_a_hello = (1u32 << 20).to_le_bytes().to_vec();
    let strangers = [oversized.clone(), undecodable.clone(), too_long_for_a_hello];
    for (n, garbage) in strangers.into_iter().enumerate() {
        let mut raw = TcpStream::connect(&addr).await.expect("loopback connects");
        raw.write_all(&garbage).await.expect("the decode side reads");
        // The decode side closes the stream (an end of stream or a reset, either will do).
        let mut rest = Vec::new();
        let _ = timeout(WAIT, raw.read_to_end(&mut rest)).await.expect("closed in time");
        assert!(rest.is_empty(), "no answer to garbage");
        decode.stats_when(|s| s.handshakes_failed > n as u64).await;
    }

    // After a good handshake too: the open link goes down with the reason.
    for (garbage, incarnation) in [(oversized, 1), (undecodable, 2)] {
        let mut raw = silent_prefill(&addr, incarnation).await;
        decode.expect_up(at(PREFILL, incarnation)).await;
        raw.write_all(&garbage).await.expect("the decode side reads");
        let reason = decode.expect_down(at(PREFILL, incarnation)).await;
        assert!(
            matches!(reason, LinkError::FrameTooLong { .. } | LinkError::BadFrame(_)),
            "{reason:?}"
        );
    }

    // The decode side still serves.
    let mut prefill = prefill_dialing(3, &addr, identity(Role::Prefill));
    prefill.expect_up(at(DECODE, 1)).await;
    decode.expect_up(at(PREFILL, 3)).await;
}

#[tokio::test]
async fn two_workers_dialing_each_other_settle_on_one_link() {
    let (decode_listener, decode_addr) = listener_on("127.0.0.1:0").await;
    let (prefill_listener, prefill_addr) = listener_on("127.0.0.1:0").await;
    let mut decode = {
        let dial = vec![(PREFILL, prefill_addr)];
        let config = config(at(DECODE, 1), identity(Role::Decode), dial);
        let (transport, events) = Transport::start(config, TcpDial).expect("a good config");
        transport.listen(decode_listener);
        Peer { transport, events }
    };
    let mut prefill = prefill_dialing(1, &decode_addr, identity(Role::Prefill));
    prefill.transport.listen(prefill_listener);
    // Both ends keep the link the lower worker id dialed; a start-up race may flap once.
    sleep(DEAD_AFTER * 2).await;
    while decode.events.try_recv().is_ok() || prefill.events.try_recv().is_ok() {}
    assert_eq!(decode.transport.live_peers(), [at(PREFILL, 1)]);
    assert_eq!(prefill.transport.live_peers(), [at(DECODE, 1)]);
    sleep(DEAD_AFTER * 2).await;
    assert!(decode.events.try_recv().is_err(), "the link stays up");
    assert!(prefill.events.try_recv().is_err(), "the link stays up");
}

#[tokio::test]
async fn dropping_the_transports_ends_every_task_they_started() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let mut prefill = prefill_dialing(1, &addr, identity(Role::Prefill));
    prefill.expect_up(at(DECODE, 1)).await;
    decode.expect_up(at(PREFILL, 1)).await;
    assert!(metrics.num_alive_tasks() > before);
    drop((decode, prefill));
    let start = Instant::now();
    while metrics.num_alive_tasks() > before {
        assert!(start.elapsed() < WAIT, "{} tasks left", metrics.num_alive_tasks() - before);
        sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn kv_writes_take_a_lane_of_their_own_that_only_prefill_and_decode_open() {
    let (mut decode, addr) = decode_at(1, "127.0.0.1:0", identity(Role::Decode)).await;
    let mut prefill = prefill_dialing(1, &addr, identity(Role::Prefill));
    prefill.expect_up(at(DECODE, 1)).await;
    decode.expect_up(at(PREFILL, 1)).await;
    decode.stats_when(|s| s.links_opened >= 2).await;
    let (p, d) = (prefill.transport.me(), decode.transport.me());
    // A megabyte of KV and a protocol message: both arrive, each on its own connection.
    prefill.transport.send(&kv_write(p, d, 1, 1 << 20)).await.expect("room on the KV lane");
    prefill.transport.send(&done_ack(p, d, 2)).await.expect("room on the control link");
    let mut got = vec![decode.next_event().await, decode.next_event().await];
    got.sort_by_key(|e| {
        matches!(e, PeerEvent::Received(Envelope { body: Message::DoneAck { .. }, .. }))
    });
    assert_eq!(
        got,
        [PeerEvent::Received(kv_write(p, d, 1, 1 << 20)), PeerEvent::Received(done_ack(p, d, 2))]
    );

    // A router asking for a KV lane is refused: it moves no KV.
    let mut raw = TcpStream::connect(&addr).await.expect("loopback connects");
    let router = LinkIdentity { role: Role::Router, ..identity(Role::Prefill) };
    let hello = Message::Hello { identity: router, lane: Lane::Kv, places: 0 };
    let hello = Envelope { from: at(WorkerId(9), 1), to: at(DECODE, 0), body: hello };
    raw.write_all(&encode_frame(&hello, Vec::new()).expect("encodes")).await.expect("written");
    let mut answer = Vec::new();
    let _ = timeout(WAIT, raw.read_to_end(&mut answer)).await.expect("closed in time");
    let answer = decode_frame(&answer).expect("one whole frame");
    assert_eq!(answer.body, Message::LinkRefused { mismatch: LinkMismatch::Roles });

    // A protocol message on a KV lane ends that lane alone: reported as the KV lane's end (its
    // writes will not be acknowledged), not as the peer's.
    let mut raw = TcpStream::connect(&addr).await.expect("loopback connects");
    let hello = Message::Hello { identity: identity(Role::Prefill), lane: Lane::Kv, places: 1 };
    let other = at(WorkerId(7), 1);
    let hello = Envelope { from: other, to: at(DECODE, 0), body: hello };
    raw.write_all(&encode_frame(&hello, Vec::new()).expect("encodes")).await.expect("written");
    decode.stats_when(|s| s.links_opened >= 3).await;
    let died = decode.transport.stats().links_died;
    let misplaced = encode_frame(&done_ack(other, d, 3), Vec::new()).expect("encodes");
    raw.write_all(&misplaced).await.expect("written");
    decode.stats_when(|s| s.links_died > died).await;
    let reason = LinkError::Protocol("a message on the other lane's link");
    assert_eq!(
        decode.next_event_of_any_lane().await,
        PeerEvent::KvLaneDown { peer: other, reason }
    );
    assert_eq!(decode.transport.live_peers(), [p], "the control link stays up");
}
