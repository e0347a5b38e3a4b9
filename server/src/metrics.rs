//! The node's metrics, in Prometheus text at `/metrics`, with vLLM's names where one exists so
//! that dashboards built for vLLM work unchanged, and `lockstep:` names for our own.
//!
//! One recorder per node, never the process-global one: the simulator runs many nodes in one
//! process, and each must report its own. Handles are registered once at start; recording is an
//! atomic add.
//!
//! Each role publishes only what it measures: a router has no KV pool and runs no steps, a worker
//! answers no client, and a series that is always zero misleads whoever averages it over the
//! fleet (a router's `vllm:kv_cache_usage_perc` of 0 halves a two-node mean). The others' handles
//! are no-ops.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::model::GrammarCompiler;
use lockstep_core::sched::FinishReason;
use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

/// vLLM's buckets for time to first token, in seconds.
const TTFT_BUCKETS: [f64; 19] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
/// vLLM's buckets for the time between two output tokens, in seconds.
const ITL_BUCKETS: [f64; 18] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0,
];
/// vLLM's buckets for whole-request latencies, in seconds.
const REQUEST_BUCKETS: [f64; 17] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
];
const STEP_BUCKETS: [f64; 12] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// Finish reasons as vLLM labels `vllm:request_success_total`, plus ours.
const FINISH_LABELS: [&str; 5] = ["stop", "length", "abort", "timeout", "error"];

pub fn finish_label(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::EndOfSequence(_) | FinishReason::StopToken(_) => "stop",
        FinishReason::Length | FinishReason::ContextLength => "length",
        FinishReason::Aborted => "abort",
        FinishReason::QueueTimeout => "timeout",
        FinishReason::StepFailed => "error",
    }
}

/// Which node the metrics are for, which decides the series it publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricsRole {
    /// One process: the HTTP app in front of its own engine. Everything but the disaggregated
    /// roles' series.
    Single,
    /// The disaggregated router: the clients' requests, and the transfers it starts.
    Router,
    /// A prefill or decode worker: its engine, its KV pool, and the KV it sends or receives.
    Worker,
}

/// Where a series is published: a set of `MetricsRole`s.
#[derive(Clone, Copy)]
struct Published(u8);

const SINGLE: Published = Published(1);
const ROUTER: Published = Published(2);
const WORKER: Published = Published(4);
/// Series about a step's work and the KV pool: where an engine runs.
const ENGINE: Published = Published(SINGLE.0 | WORKER.0);
/// Series about the clients' requests: where the HTTP API is served.
const REQUESTS: Published = Published(SINGLE.0 | ROUTER.0);
/// Series of the peer links: the disaggregated roles.
const PEERS: Published = Published(ROUTER.0 | WORKER.0);
const EVERY_ROLE: Published = Published(SINGLE.0 | ROUTER.0 | WORKER.0);

impl MetricsRole {
    fn publishes(self, published: Published) -> bool {
        let bit = match self {
            MetricsRole::Single => SINGLE,
            MetricsRole::Router => ROUTER,
            MetricsRole::Worker => WORKER,
        };
        published.0 & bit.0 != 0
    }
}

#[derive(Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
    pub requests_running: Gauge,
    pub requests_waiting: Gauge,
    pub kv_cache_usage: Gauge,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    pub preemptions: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    finished: Vec<Counter>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
    pub steps: Counter,
    pub step_failures: Counter,
    pub step_seconds: Histogram,
    pub trace_records_written: Counter,
    pub trace_records_dropped: Counter,
    pub rejected_queue_full: Counter,
    pub rejected_invalid: Counter,
    pub rejected_unauthorized: Counter,
    pub client_aborts: Counter,
    // Disaggregated roles: the data plane, the peer links and the router's transfers.
    pub kv_bytes_sent: Counter,
    pub kv_bytes_received: Counter,
    pub kv_writes_dropped: Counter,
    pub kv_writes_held: Counter,
    pub peer_send_failures: Counter,
    pub transfers_started: Counter,
    pub transfers_completed: Counter,
    pub transfers_failed: Counter,
    pub transfers_retried: Counter,
    pub transfers_busy: Counter,
    pub transfers_timed_out: Counter,
    pub transfer_seconds: Histogram,
    /// The executor's grammar compiler, whose counts of kept grammars are read at each render.
    grammars: Option<Arc<dyn GrammarCompiler>>,
    grammar_cache_queries: Counter,
    grammar_cache_hits: Counter,
}

impl Metrics {
    /// A single process's metrics.
    pub fn new(model_name: &str) -> Metrics {
        Metrics::for_role(model_name, MetricsRole::Single)
    }

    pub fn for_role(model_name: &str, role: MetricsRole) -> Metrics {
        let recorder = build_recorder();
        let handle = recorder.handle();
        let model = Label::new("model_name", model_name.to_owned());
        let meta = Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
        let key = |name: &'static str, extra: Option<Label>| {
            let mut labels = vec![model.clone()];
            labels.extend(extra);
            Key::from_parts(name, labels)
        };
        let counter = |at: Published, name: &'static str, help: &'static str| {
            if !role.publishes(at) {
                return Counter::noop();
            }
            recorder.describe_counter(name.into(), None, help.into());
            recorder.register_counter(&key(name, None), &meta)
        };
        let gauge = |at: Published, name: &'static str, help: &'static str| {
            if !role.publishes(at) {
                return Gauge::noop();
            }
            recorder.describe_gauge(name.into(), None, help.into());
            recorder.register_gauge(&key(name, None), &meta)
        };
        let histogram = |at: Published, name: &'static str, help: &'static str| {
            if !role.publishes(at) {
                return Histogram::noop();
            }
            recorder.describe_histogram(name.into(), Some(Unit::Seconds), help.into());
            recorder.register_histogram(&key(name, None), &meta)
        };
        let finished = if role.publishes(REQUESTS) {
            let name = "vllm:request_success_total";
            recorder.describe_counter(name.into(), None, "Requests finished, by reason".into());
            FINISH_LABELS
                .iter()
                .map(|&reason| {
                    let label = Label::new("finished_reason", reason);
                    recorder.register_counter(&key(name, Some(label)), &meta)
                })
                .collect()
        } else {
            FINISH_LABELS.iter().map(|_| Counter::noop()).collect()
        };
        Metrics {
            requests_running: gauge(
                ENGINE,
                "vllm:num_requests_running",
                "Requests holding a batch slot",
            ),
            requests_waiting: gauge(
                ENGINE,
                "vllm:num_requests_waiting",
                "Requests waiting for admission",
            ),
            kv_cache_usage: gauge(
                ENGINE,
                "vllm:kv_cache_usage_perc",
                "Fraction of KV pages held (0 to 1)",
            ),
            prefix_cache_queries: counter(
                ENGINE,
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_cache_hits: counter(
                ENGINE,
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            ),
            preemptions: counter(
                ENGINE,
                "vllm:num_preemptions_total",
                "Requests preempted by recompute",
            ),
            prompt_tokens: counter(REQUESTS, "vllm:prompt_tokens_total", "Prompt tokens admitted"),
            generation_tokens: counter(
                REQUESTS,
                "vllm:generation_tokens_total",
                "Output tokens generated",
            ),
            finished,
            time_to_first_token: histogram(
                REQUESTS,
                "vllm:time_to_first_token_seconds",
                "From arrival to the first output token",
            ),
            inter_token_latency: histogram(
                REQUESTS,
                "vllm:inter_token_latency_seconds",
                "Between two output tokens of one request",
            ),
            e2e_latency: histogram(
                REQUESTS,
                "vllm:e2e_request_latency_seconds",
                "From arrival to the last output token",
            ),
            queue_time: histogram(
                REQUESTS,
                "vllm:request_queue_time_seconds",
                "From arrival to the first step computing the request (a router's: to its first \
                 transfer, when a prefill and a decode worker took it)",
            ),
            steps: counter(ENGINE, "lockstep:steps_total", "Steps executed"),
            step_failures: counter(
                ENGINE,
                "lockstep:step_failures_total",
                "Steps the executor failed or panicked on (their requests ended with an error)",
            ),
            step_seconds: histogram(
                ENGINE,
                "lockstep:step_duration_seconds",
                "From launch to outputs",
            ),
            trace_records_written: counter(
                REQUESTS,
                "lockstep:trace_records_written_total",
                "Requests written to the --record-trace file",
            ),
            trace_records_dropped: counter(
                REQUESTS,
                "lockstep:trace_records_dropped_total",
                "Requests not recorded: the trace writer was behind, stopped, or failed",
            ),
            rejected_queue_full: counter(
                REQUESTS,
                "lockstep:requests_rejected_queue_full_total",
                "Requests refused with 429 because the queue was full",
            ),
            rejected_invalid: counter(
                REQUESTS,
                "lockstep:requests_rejected_invalid_total",
                "Requests refused with a 4xx for their content",
            ),
            rejected_unauthorized: counter(
                REQUESTS,
                "lockstep:requests_rejected_unauthorized_total",
                "Requests refused with 401: no API key, or another (`--api-key`)",
            ),
            client_aborts: counter(
                REQUESTS,
                "lockstep:client_aborts_total",
                "Requests whose client went away before they finished",
            ),
            kv_bytes_sent: counter(
                WORKER,
                "lockstep:kv_bytes_sent_total",
                "KV bytes written to decode workers",
            ),
            kv_bytes_received: counter(
                WORKER,
                "lockstep:kv_bytes_received_total",
                "KV bytes landed in this worker's pages",
            ),
            kv_writes_held: counter(
                WORKER,
                "lockstep:kv_writes_held_total",
                "KV writes that waited for room on their link (the data plane's back-pressure)",
            ),
            kv_writes_dropped: counter(
                WORKER,
                "lockstep:kv_writes_dropped_total",
                "KV writes dropped on arrival: their transfer had let go of the page (late)",
            ),
            peer_send_failures: counter(
                PEERS,
                "lockstep:peer_send_failures_total",
                "Messages to a peer the transport could not take (no link, queue full)",
            ),
            transfers_started: counter(
                ROUTER,
                "lockstep:kv_transfers_started_total",
                "Transfers started",
            ),
            transfers_completed: counter(
                ROUTER,
                "lockstep:kv_transfers_completed_total",
                "Transfers whose request now decodes",
            ),
            transfers_failed: counter(
                ROUTER,
                "lockstep:kv_transfers_failed_total",
                "Requests that failed before decoding, after their last retry",
            ),
            transfers_retried: counter(
                ROUTER,
                "lockstep:kv_transfer_retries_total",
                "Transfers started again after an attempt failed (up to the router's retries_max)",
            ),
            transfers_busy: counter(
                ROUTER,
                "lockstep:kv_transfers_refused_busy_total",
                "Transfers a prefill or decode worker refused for want of room, sent again after \
                 the back-off without using an attempt",
            ),
            transfers_timed_out: counter(
                ROUTER,
                "lockstep:kv_transfers_timed_out_total",
                "Requests that failed before decoding because a wait ran out",
            ),
            transfer_seconds: histogram(
                ROUTER,
                "lockstep:kv_transfer_duration_seconds",
                "From a request's arrival at the router to its hand-over to a decode worker",
            ),
            grammars: None,
            grammar_cache_queries: counter(
                EVERY_ROLE,
                "lockstep:grammar_cache_queries_total",
                "Grammar compiles asked of the compiler (at the HTTP edge and by the executor)",
            ),
            grammar_cache_hits: counter(
                EVERY_ROLE,
                "lockstep:grammar_cache_hits_total",
                "Grammar compiles answered from the compiled grammars it keeps",
            ),
            handle,
        }
    }

    /// Reports `grammars`' kept-grammar counts too (a compiler that keeps none reports zeros).
    pub fn with_grammars(mut self, grammars: Option<Arc<dyn GrammarCompiler>>) -> Metrics {
        self.grammars = grammars;
        self
    }

    pub fn finished(&self, reason: FinishReason) {
        let label = finish_label(reason);
        let at = FINISH_LABELS.iter().position(|&l| l == label).expect("every label is listed");
        self.finished[at].increment(1);
    }

    /// Everything, in Prometheus text exposition format.
    pub fn render(&self) -> String {
        if let Some(counts) = self.grammars.as_ref().and_then(|g| g.compile_counts()) {
            self.grammar_cache_queries.absolute(counts.hits + counts.misses);
            self.grammar_cache_hits.absolute(counts.hits);
        }
        self.handle.render()
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Records a duration in seconds.
pub fn observe(histogram: &Histogram, d: Duration) {
    histogram.record(seconds(d));
}

fn build_recorder() -> PrometheusRecorder {
    let buckets: [(&str, &[f64]); 6] = [
        ("vllm:time_to_first_token_seconds", &TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", &ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds", &REQUEST_BUCKETS),
        ("vllm:request_queue_time_seconds", &REQUEST_BUCKETS),
        ("lockstep:step_duration_seconds", &STEP_BUCKETS),
        ("lockstep:kv_transfer_duration_seconds", &TTFT_BUCKETS),
    ];
    let mut builder = PrometheusBuilder::new();
    for (name, values) in buckets {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(name.to_owned()), values)
            .expect("bucket lists are non-empty constants");
    }
    builder.build_recorder()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_histograms_as_buckets() {
        let m = Metrics::new("tiny");
        m.requests_running.set(3.0);
        m.prompt_tokens.increment(5);
        m.finished(FinishReason::Length);
        observe(&m.time_to_first_token, Duration::from_millis(30));
        let text = m.render();
        for needle in [
            "vllm:num_requests_running{model_name=\"tiny\"} 3",
            "vllm:prompt_tokens_total{model_name=\"tiny\"} 5",
            "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.04\"} 1",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
    }

    /// The series each role publishes, by a name of each kind: engine, requests, data plane,
    /// transfers, peer links.
    #[test]
    fn each_role_publishes_only_what_it_measures() {
        let names = [
            "vllm:kv_cache_usage_perc",
            "lockstep:step_duration_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:request_success_total",
            "vllm:request_queue_time_seconds",
            "lockstep:kv_bytes_received_total",
            "lockstep:kv_transfers_started_total",
            "lockstep:peer_send_failures_total",
            "lockstep:grammar_cache_queries_total",
        ];
        let published = |role| {
            let text = Metrics::for_role("tiny", role).render();
            names.iter().map(|n| text.contains(&format!("# TYPE {n} "))).collect::<Vec<_>>()
        };
        let (y, n) = (true, false);
        assert_eq!(published(MetricsRole::Single), [y, y, y, y, y, n, n, n, y]);
        assert_eq!(published(MetricsRole::Router), [n, n, y, y, y, n, y, y, y]);
        assert_eq!(published(MetricsRole::Worker), [y, y, n, n, n, y, n, y, y]);
        // A series not published takes its records without a trace.
        let router = Metrics::for_role("tiny", MetricsRole::Router);
        router.kv_cache_usage.set(0.5);
        observe(&router.step_seconds, Duration::from_millis(1));
        assert!(!router.render().contains("kv_cache_usage"));
    }
}
