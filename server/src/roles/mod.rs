//! Disaggregated serving (DESIGN.md sections 3 and 4): `lockstep serve --role router|prefill|
//! decode`. A router serves the same HTTP API as a single process, through the same
//! `EngineHandle`, and moves each request through a prefill and a decode worker; the workers run
//! the same step loop as a single process around their node (`core::node`). All three talk over
//! the peer transport (`peer`), which runs on tokio's network and on turmoil's.

pub mod launch;
pub mod router;
pub mod worker;

use std::sync::Arc;

use axum::serve::Listener;
use tokio::task::JoinHandle;

use crate::engine::{EngineStats, PageRunner};
use crate::metrics::Metrics;
use crate::peer::{ConfigError, Dial, PeerConfig, Transport};

/// Starts a prefill or decode worker: its transport (dialing `peer.dial`, accepting on
/// `listener`) and its engine task, which runs until the task is aborted or the process ends.
pub fn spawn_worker<R: PageRunner, D: Dial, L: Listener>(
    node: worker::WorkerNode,
    runner: R,
    peer: PeerConfig,
    dial: D,
    listener: L,
    check_invariants: bool,
    metrics: Arc<Metrics>,
) -> Result<(JoinHandle<()>, Arc<EngineStats>), ConfigError> {
    let (transport, events) = Transport::start(peer, dial)?;
    transport.listen(listener);
    let stats = Arc::new(EngineStats::new(tokio::time::Instant::now()));
    let engine = worker::WorkerEngine::new(
        node,
        runner,
        transport,
        events,
        check_invariants,
        stats.clone(),
        metrics,
    );
    Ok((tokio::spawn(engine.run()), stats))
}
