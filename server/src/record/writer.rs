//! The one task that writes a trace: it drains the recorder's channel into a buffered sink
//! (tokio's async file IO in production, any `AsyncWrite` in tests and the simulator) and never
//! makes a handler wait. It flushes whenever the channel runs empty and at least every
//! `flush_records_max` records; on stop it writes what is still queued, flushes and returns the
//! sink. An IO error is logged once; from then on records are counted as dropped, not written.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use metrics::Counter;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::Shared;
use super::format::TraceHeader;
use crate::metrics::Metrics;

/// Bytes the writer buffers before the sink sees them.
const BUFFER_BYTES: usize = 64 << 10;

/// The writing half of a recorder, not yet running: `spawn` it once the node's metrics exist.
#[derive(Debug)]
pub struct RecordWriter<W> {
    pub(super) header: TraceHeader,
    pub(super) lines: mpsc::Receiver<Vec<u8>>,
    pub(super) shared: Arc<Shared>,
    pub(super) sink: W,
    pub(super) flush_records_max: usize,
}

/// The running writer. `finish` stops it; dropping it stops it too, without waiting.
#[derive(Debug)]
pub struct RecordTask<W> {
    stop: oneshot::Sender<()>,
    task: JoinHandle<RecordTotals<W>>,
}

/// What a writer did.
#[derive(Debug)]
pub struct RecordTotals<W> {
    /// The sink, flushed (for a file, everything written is in it).
    pub sink: W,
    /// Records in the sink (flushed without an error).
    pub written: u64,
    /// Records lost to an IO error (the handlers count what the channel refused).
    pub lost: u64,
    /// The first IO error, if any.
    pub error: Option<String>,
}

impl<W: AsyncWrite + Unpin + Send + 'static> RecordWriter<W> {
    /// Starts the writer on the current runtime; it counts into `metrics`.
    pub fn spawn(self, metrics: &Metrics) -> RecordTask<W> {
        let counters =
            (metrics.trace_records_written.clone(), metrics.trace_records_dropped.clone());
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.run(stopped, counters));
        RecordTask { stop, task }
    }

    async fn run(
        mut self,
        mut stopped: oneshot::Receiver<()>,
        (written, dropped): (Counter, Counter),
    ) -> RecordTotals<W> {
        let mut out = Out {
            sink: BufWriter::with_capacity(BUFFER_BYTES, self.sink),
            pending: 0,
            totals: (0, 0),
            error: None,
            written,
            dropped,
        };
        match serde_json::to_vec(&self.header) {
            Ok(header) => out.write(header, false).await,
            Err(e) => out.fail(&e.to_string()),
        }
        out.flush().await;
        loop {
            let line = tokio::select! {
                biased;
                line = self.lines.recv() => line,
                // Asked to stop, or the task handle is gone.
                _ = &mut stopped => None,
            };
            let Some(line) = line else { break };
            self.shared.release(line.len());
            out.write(line, true).await;
            for _ in 1..self.flush_records_max {
                let Ok(line) = self.lines.try_recv() else { break };
                self.shared.release(line.len());
                out.write(line, true).await;
            }
            out.flush().await;
        }
        // No record gets in from now on; what is queued is written.
        self.lines.close();
        while let Some(line) = self.lines.recv().await {
            self.shared.release(line.len());
            out.write(line, true).await;
            if out.pending >= self.flush_records_max as u64 {
                out.flush().await;
            }
        }
        out.flush().await;
        if out.error.is_none() {
            let _ = out.sink.shutdown().await;
        }
        RecordTotals {
            sink: out.sink.into_inner(),
            written: out.totals.0,
            lost: out.totals.1,
            error: out.error,
        }
    }
}

impl<W> RecordTask<W> {
    /// Stops taking records, writes what is queued, flushes, and returns the sink.
    pub async fn finish(self) -> Result<RecordTotals<W>, String> {
        let _ = self.stop.send(());
        self.task.await.map_err(|e| format!("the trace writer ended: {e}"))
    }
}

struct Out<W> {
    sink: BufWriter<W>,
    /// Records written into the buffer since the last flush.
    pending: u64,
    /// (written, lost).
    totals: (u64, u64),
    error: Option<String>,
    written: Counter,
    dropped: Counter,
}

impl<W: AsyncWrite + Unpin> Out<W> {
    /// Writes one line; `record`: it counts as a record (the header does not).
    async fn write(&mut self, mut line: Vec<u8>, record: bool) {
        if self.error.is_some() {
            self.lose(u64::from(record));
            return;
        }
        line.push(b'\n');
        match self.sink.write_all(&line).await {
            Ok(()) => self.pending += u64::from(record),
            Err(e) => {
                self.lose(u64::from(record));
                self.fail(&e.to_string());
            }
        }
    }

    async fn flush(&mut self) {
        if self.error.is_some() {
            return;
        }
        match self.sink.flush().await {
            Ok(()) => {
                self.totals.0 += self.pending;
                self.written.increment(self.pending);
                self.pending = 0;
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// The first IO error: logged once; the records not yet flushed count as lost.
    fn fail(&mut self, error: &str) {
        tracing::error!(error, "writing the trace failed; recording stops (records are dropped)");
        self.error = Some(error.to_owned());
        let pending = std::mem::take(&mut self.pending);
        self.lose(pending);
    }

    fn lose(&mut self, n: u64) {
        self.totals.1 += n;
        self.dropped.increment(n);
    }
}

impl Shared {
    /// `bytes` of queued lines left the channel.
    fn release(&self, bytes: usize) {
        let before = self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(before >= bytes, "released more than was queued");
    }
}
