//! One serving node: an engine task and the HTTP app in front of it, served from any listener,
//! with a bounded drain at shutdown. The binary, the tests and the simulator all start nodes
//! through here.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::engine::{self, EngineConfig, StepRunner};
use crate::http::{AppConfig, AppState, router};
use crate::metrics::{Metrics, MetricsRole};
use crate::text::TextCodec;

#[derive(Debug)]
pub struct Node {
    pub state: Arc<AppState>,
    pub engine_task: JoinHandle<()>,
}

/// Starts the engine task on the current runtime and builds the app's state.
pub fn start<R: StepRunner>(
    engine_config: EngineConfig,
    runner: R,
    codec: Arc<dyn TextCodec>,
    app_config: AppConfig,
) -> Result<Node, String> {
    let metrics =
        Arc::new(Metrics::new(&app_config.model_name).with_grammars(codec.grammars().ok()));
    let (engine, engine_task) =
        engine::spawn(engine_config, runner, metrics.clone()).map_err(|e| e.to_string())?;
    let state = Arc::new(AppState::new(app_config, engine, codec, metrics));
    Ok(Node { state, engine_task })
}

/// Starts a router's engine (`roles::router`) in front of prefill and decode workers reached
/// through `transport`, and builds the same app's state around it.
pub fn start_router(
    config: crate::roles::router::RouterEngineConfig,
    transport: crate::peer::Transport,
    peer_events: tokio::sync::mpsc::Receiver<crate::peer::PeerEvent>,
    codec: Arc<dyn TextCodec>,
    app_config: AppConfig,
) -> Node {
    let metrics = Arc::new(
        Metrics::for_role(&app_config.model_name, MetricsRole::Router)
            .with_grammars(codec.grammars().ok()),
    );
    let (engine, engine_task) =
        crate::roles::router::spawn(config, transport, peer_events, metrics.clone());
    let state = Arc::new(AppState::new(app_config, engine, codec, metrics));
    Node { state, engine_task }
}

/// How the node ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drained {
    /// Every connection finished within the bound.
    Cleanly,
    /// The bound passed with requests still open; they are cut off.
    BoundReached,
}

impl Node {
    /// Serves the app from `listener` until `shutdown` resolves; then refuses new requests (503,
    /// and `/health` fails so balancers stop sending), lets open ones finish for at most
    /// `drain_max`, and returns.
    pub async fn serve<L>(
        &self,
        listener: L,
        shutdown: impl Future<Output = ()> + Send + 'static,
        drain_max: Duration,
    ) -> std::io::Result<Drained>
    where
        L: Listener,
        L::Addr: Debug,
    {
        let (signalled, on_signal) = oneshot::channel();
        let state = self.state.clone();
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down: draining open requests");
            state.engine.stats().start_draining();
            let _ = signalled.send(());
        };
        let server =
            axum::serve(listener, router(self.state.clone())).with_graceful_shutdown(signal);
        let bound = async move {
            if on_signal.await.is_err() {
                return std::future::pending().await;
            }
            tokio::time::sleep(drain_max).await;
        };
        tokio::select! {
            served = server => served.map(|()| Drained::Cleanly),
            () = bound => {
                let open = self.state.engine.stats().requests_held();
                tracing::warn!(open, "drain bound reached; cutting off what is still open");
                Ok(Drained::BoundReached)
            }
        }
    }
}
