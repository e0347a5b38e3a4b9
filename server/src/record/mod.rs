//! `--record-trace FILE`: every request the HTTP app serves, written in the native trace format
//! (`format`, documented in `traces/README.md`) so that `sim replay` can replay production
//! traffic.
//!
//! The recorder is an `Option` in the app's config: without it nothing here runs. With it, a
//! request goes through three values: an `Arrival` (time and session, taken when the handler
//! starts), a `Draft` (plus the input as the client sent it), and, once the engine took the
//! request, a `Recording` that `http::generation` feeds each output token and ends when the
//! outcome is known (or, dropped unended, the client went away: finish `abort`). The finished
//! record is serialized on the handler's task and handed to a bounded channel with `try_send`:
//! serving never waits on the trace. A full channel drops the record and counts it
//! (`lockstep:trace_records_dropped_total`). One writer task (`RecordWriter`) drains the channel
//! into the file with tokio's async IO and counts what it wrote
//! (`lockstep:trace_records_written_total`).
//!
//! Requests refused before the engine took them (4xx, 429, 503) are not recorded; their
//! counts are in the `lockstep:requests_rejected_*` counters.

mod format;
mod sessions;
mod writer;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
pub use format::{
    HASH_BLOCK_TOKENS_DEFAULT, RequestInput, TRACE_BYTES_MAX, TRACE_FORMAT, TRACE_VERSION, Trace,
    TraceFinish, TraceHeader, TraceOutput, TraceRecord, TraceSampling, TraceTimings, parse_trace,
    read_trace,
};
use metrics::Counter;
use sessions::Sessions;
use tokio::sync::mpsc;
use tokio::time::Instant;
pub use writer::{RecordTask, RecordTotals, RecordWriter};

use crate::http::GenerationParams;
use crate::metrics::Metrics;

/// The header a client names its session with.
pub const SESSION_HEADER: &str = "x-session-id";
/// A longer session id is not recorded (the request is, without a session).
pub const SESSION_ID_BYTES_MAX: usize = 256;

/// Every bound of a recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecorderLimits {
    /// Records waiting for the writer, at most; more are dropped and counted.
    pub records_queued_max: usize,
    /// Bytes of records waiting for the writer, at most (a record larger than this is dropped).
    pub queued_bytes_max: usize,
    /// The writer flushes at least this often, in records (and whenever the channel runs empty).
    pub flush_records_max: usize,
    /// Sessions whose turns are counted; beyond, the least recently used is forgotten.
    pub sessions_max: usize,
}

impl Default for RecorderLimits {
    fn default() -> RecorderLimits {
        RecorderLimits {
            records_queued_max: 4096,
            queued_bytes_max: 64 << 20,
            flush_records_max: 256,
            sessions_max: 1 << 16,
        }
    }
}

/// The handlers' side of a recording: cheap to clone, never waits.
#[derive(Clone, Debug)]
pub struct Recorder {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    lines: mpsc::Sender<Vec<u8>>,
    /// Arrivals count from here.
    started: Instant,
    sessions: Mutex<Sessions>,
    queued_bytes: AtomicUsize,
    queued_bytes_max: usize,
}

/// Creates (or truncates) a trace file, so that a path that cannot be written fails at start.
pub async fn create_file(path: &Path) -> std::io::Result<tokio::fs::File> {
    tokio::fs::File::create(path).await
}

impl Recorder {
    /// A recorder writing `header` and then its records into `sink`; arrivals count from now.
    /// Records queue until the writer is spawned.
    pub fn new<W>(
        header: TraceHeader,
        sink: W,
        limits: RecorderLimits,
    ) -> (Recorder, RecordWriter<W>) {
        assert!(limits.records_queued_max > 0 && limits.flush_records_max > 0, "limits > 0");
        let (tx, rx) = mpsc::channel(limits.records_queued_max);
        let shared = Arc::new(Shared {
            lines: tx,
            started: Instant::now(),
            sessions: Mutex::new(Sessions::new(limits.sessions_max)),
            queued_bytes: AtomicUsize::new(0),
            queued_bytes_max: limits.queued_bytes_max,
        });
        let writer = RecordWriter {
            header,
            lines: rx,
            shared: shared.clone(),
            sink,
            flush_records_max: limits.flush_records_max,
        };
        (Recorder { shared }, writer)
    }

    /// A request arrived now, with these headers.
    pub fn arrived(&self, headers: &HeaderMap) -> Arrival {
        let session = headers
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.is_empty() && s.len() <= SESSION_ID_BYTES_MAX)
            .map(str::to_owned);
        Arrival { recorder: self.clone(), arrival: Instant::now(), session }
    }

    /// Hands a finished record to the writer, or drops and counts it.
    fn submit(&self, record: &TraceRecord, dropped: &Counter) {
        let Ok(line) = serde_json::to_vec(record) else {
            dropped.increment(1);
            return;
        };
        let bytes = line.len();
        let before = self.shared.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > self.shared.queued_bytes_max {
            self.shared.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            dropped.increment(1);
            return;
        }
        if self.shared.lines.try_send(line).is_err() {
            // Full, or the writer stopped.
            self.shared.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            dropped.increment(1);
        }
    }

    fn next_turn(&self, session: &str) -> u32 {
        let mut sessions = self.shared.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions.next_turn(session)
    }

    fn ms_since(&self, from: Instant, to: Instant) -> f64 {
        ms(to.saturating_duration_since(from))
    }
}

/// Milliseconds, to the microsecond.
fn ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// A request as it arrived: when, and in which session.
#[derive(Clone, Debug)]
pub struct Arrival {
    recorder: Recorder,
    arrival: Instant,
    session: Option<String>,
}

impl Arrival {
    /// A request that arrived with this one but is recorded in no session: another prompt of
    /// the same completion request, which a replay sends beside it, not as a later turn.
    pub fn beside(&self) -> Arrival {
        Arrival { session: None, ..self.clone() }
    }

    /// With the input as the client sent it.
    pub fn with_input(self, input: RequestInput) -> Draft {
        Draft { arrival: self, input }
    }
}

/// A request parsed, not yet taken by the engine.
#[derive(Debug)]
pub struct Draft {
    arrival: Arrival,
    input: RequestInput,
}

impl Draft {
    /// The records of a request's `n` completions (`n` in the API), each its own request in the
    /// engine: the first keeps the session and its turn; the others are recorded as requests of
    /// no session arriving with it, so that a replay sends them beside it, not as later turns.
    pub fn split(self, n: usize) -> Vec<Draft> {
        let mut drafts = Vec::with_capacity(n);
        for _ in 1..n {
            let arrival = Arrival { session: None, ..self.arrival.clone() };
            drafts.push(Draft { arrival, input: self.input.clone() });
        }
        drafts.insert(0, self);
        drafts
    }

    /// The engine took the request as `request_id`, with prompt `input_ids`: its turn in its
    /// session is counted now.
    pub fn begin(
        self,
        request_id: u64,
        input_ids: Vec<u32>,
        params: &GenerationParams,
        metrics: &Metrics,
    ) -> Recording {
        let Arrival { recorder, arrival, session } = self.arrival;
        let turn = session.as_deref().map(|s| recorder.next_turn(s));
        let record = TraceRecord {
            request_id,
            session,
            turn,
            arrival_ms: recorder.ms_since(recorder.shared.started, arrival),
            follows: None,
            request: Some(self.input),
            input_ids,
            hash_ids: Vec::new(),
            input_tokens: None,
            max_tokens: params.max_tokens,
            sampling: TraceSampling::from(params.spec.sampling),
            stop: params.stops.clone(),
            stop_token_ids: params.stop_token_ids.clone(),
            logit_bias: params.spec.logit_bias.clone(),
            ignore_eos: params.ignore_eos,
            priority: params.priority,
            stream: params.stream,
            logprobs: params.spec.logprobs,
            prompt_logprobs: params.spec.prompt_logprobs,
            output: Some(TraceOutput { token_ids: Vec::new(), finish_reason: TraceFinish::Abort }),
            timings: None,
        };
        Recording {
            recorder,
            arrival,
            first_token: None,
            record: Some(record),
            dropped: metrics.trace_records_dropped.clone(),
        }
    }
}

/// A request in the engine: its output so far. Dropped before `finish`, it is recorded as
/// ended by `abort` with the tokens it had.
#[derive(Debug)]
pub struct Recording {
    recorder: Recorder,
    arrival: Instant,
    first_token: Option<Instant>,
    /// `None` once submitted.
    record: Option<TraceRecord>,
    dropped: Counter,
}

impl Recording {
    /// An output token, now.
    pub fn token(&mut self, token: u32) {
        self.first_token.get_or_insert_with(Instant::now);
        if let Some(output) = self.record.as_mut().and_then(|r| r.output.as_mut()) {
            output.token_ids.push(token);
        }
    }

    /// The request ended now, for `reason`: the record goes to the writer.
    pub fn finish(mut self, reason: TraceFinish) {
        self.submit(reason);
    }

    fn submit(&mut self, reason: TraceFinish) {
        let Some(mut record) = self.record.take() else { return };
        let now = Instant::now();
        if let Some(output) = record.output.as_mut() {
            output.finish_reason = reason;
        }
        record.timings = Some(TraceTimings {
            ttft_ms: self.first_token.map(|t| self.recorder.ms_since(self.arrival, t)),
            e2e_ms: self.recorder.ms_since(self.arrival, now),
        });
        self.recorder.submit(&record, &self.dropped);
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.submit(TraceFinish::Abort);
    }
}

#[cfg(test)]
mod tests;
