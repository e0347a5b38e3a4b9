//! What the router says of each request, taken from its `tracing` events (the production
//! server's own debug events: `routed`, `decoding`, `finished`, `failed`) into the run's event
//! log, for the timeline and the determinism hash, and when each KV write arrives at and lands on
//! a decode worker (its `kv write arrived` and `kv write landed`). Only those events are enabled,
//! so nothing else in the run pays for a subscriber; there is one router per run, so an event's
//! host needs no lookup, and a write names its transfer, whose id is unique in the run.

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event as TracingEvent, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};

use crate::events::{Event, EventLog};

const ROUTER_TARGET: &str = "lockstep_server::roles::router";
const KV_WRITES_TARGET: &str = lockstep_server::roles::worker::KV_WRITES;

/// Sends the router's request events to `log` on this thread until the guard drops.
pub fn capture(log: EventLog) -> tracing::subscriber::DefaultGuard {
    let subscriber = tracing_subscriber::registry().with(RouterEvents { log });
    tracing::subscriber::set_default(subscriber)
}

struct RouterEvents {
    log: EventLog,
}

impl<S: Subscriber> Layer<S> for RouterEvents {
    /// Decided once per callsite, so that the spans turmoil opens for every host at every tick
    /// cost nothing.
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if wanted(metadata) { Interest::always() } else { Interest::never() }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        wanted(metadata)
    }

    fn on_event(&self, event: &TracingEvent<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if event.metadata().target() == KV_WRITES_TARGET {
            if let (Some(what), Some(transfer)) = (fields.message, fields.transfer) {
                self.log.log(Event::KvWrite { transfer, landed: what == "kv write landed" });
            }
            return;
        }
        if let (Some(what), Some(request)) = (fields.message, fields.request) {
            self.log.log(Event::Router {
                what,
                request,
                transfer: fields.transfer,
                decode: fields.decode,
            });
        }
    }
}

fn wanted(metadata: &Metadata<'_>) -> bool {
    metadata.is_event()
        && (metadata.target() == ROUTER_TARGET || metadata.target() == KV_WRITES_TARGET)
        && *metadata.level() <= tracing::Level::DEBUG
}

#[derive(Default)]
struct Fields {
    message: Option<String>,
    request: Option<u64>,
    transfer: Option<u64>,
    decode: Option<u64>,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "request" => self.request = Some(value),
            "transfer" => self.transfer = Some(value),
            "decode" => self.decode = Some(value),
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if value >= 0 {
            self.record_u64(field, value as u64);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = Some(format!("{value:?}"));
        }
    }
}
