//! The native trace format (DESIGN.md section 7): JSON Lines, a header line, then one record per
//! request. `traces/README.md` documents every field; this file is its definition, and the
//! reader the simulator replays from.

use std::path::Path;

use lockstep_core::sched::FinishReason;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The header's `format`.
pub const TRACE_FORMAT: &str = "lockstep-trace";
/// The header's `version`; a reader refuses any other.
pub const TRACE_VERSION: u32 = 1;
/// A trace file larger than this is refused by `read_trace`.
pub const TRACE_BYTES_MAX: u64 = 1 << 30;

/// The first line. No wall-clock time: arrivals count from the start of the recording on
/// tokio's clock, which is virtual under the simulator, and the server reads no wall clock
/// where the simulator runs it (a recording of a simulated run is the same bytes every time).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Always `TRACE_FORMAT`.
    pub format: String,
    /// Always `TRACE_VERSION`.
    pub version: u32,
    /// The served model's name.
    pub model: String,
    /// Prompt plus output tokens of one request, at most, on the recording server.
    pub context_tokens: u32,
    /// Token ids are below this.
    pub vocab_size: u32,
}

impl TraceHeader {
    pub fn new(model: impl Into<String>, context_tokens: u32, vocab_size: u32) -> TraceHeader {
        TraceHeader {
            format: TRACE_FORMAT.to_owned(),
            version: TRACE_VERSION,
            model: model.into(),
            context_tokens,
            vocab_size,
        }
    }
}

/// One request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// The engine's id of the request (`cmpl-<id>`, `chatcmpl-<id>` in responses).
    pub request_id: u64,
    /// The client's `X-Session-Id`, if it sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The request's place in its session, from 1, in the order the server took them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// Milliseconds from the start of the recording to the request's arrival (tokio's clock).
    pub arrival_ms: f64,
    /// The input as the client sent it.
    pub request: RequestInput,
    /// The prompt's token ids as the server computed them (template and tokenizer applied).
    pub input_ids: Vec<u32>,
    /// The client's `max_tokens` (or `max_completion_tokens`); `None`: up to the context.
    pub max_tokens: Option<u32>,
    pub sampling: TraceSampling,
    #[serde(default)]
    pub stop: Vec<String>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// The client asked for server-sent events.
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<TraceOutput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<TraceTimings>,
}

/// What the client sent as input, by endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "endpoint", rename_all = "snake_case")]
pub enum RequestInput {
    /// `/v1/completions`: `prompt` as sent (text, token ids, or a list of one of either).
    Completions { prompt: Value },
    /// `/v1/chat/completions`.
    Chat {
        messages: Vec<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tools: Option<Vec<Value>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<Value>,
    },
}

/// The sampling the request ran with: the client's values, or the server's defaults and, for a
/// request that gave no seed, the server's draw.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceSampling {
    pub temperature: f32,
    pub top_p: f32,
    /// 0: every token.
    pub top_k: u32,
    pub seed: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceOutput {
    /// Every output token the server produced, in order (a stop string's last token included).
    pub token_ids: Vec<u32>,
    pub finish_reason: TraceFinish,
}

/// How a request ended, labelled as `vllm:request_success_total` labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFinish {
    /// End of sequence, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// The client went away, or the engine aborted it.
    Abort,
    /// The queue wait or the request time limit ran out.
    Timeout,
    /// A step failed, detokenizing failed, or the engine stopped.
    Error,
}

impl TraceFinish {
    pub fn from_reason(reason: FinishReason) -> TraceFinish {
        match reason {
            FinishReason::EndOfSequence(_) | FinishReason::StopToken(_) => TraceFinish::Stop,
            FinishReason::Length | FinishReason::ContextLength => TraceFinish::Length,
            FinishReason::Aborted => TraceFinish::Abort,
            FinishReason::QueueTimeout => TraceFinish::Timeout,
            FinishReason::StepFailed => TraceFinish::Error,
        }
    }
}

/// Milliseconds on tokio's clock, to the microsecond.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceTimings {
    /// From arrival to the first output token; `None` if there was none.
    pub ttft_ms: Option<f64>,
    /// From arrival to the end of the request.
    pub e2e_ms: f64,
}

/// A whole trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    /// In the order they were written: the order requests ended, not the order they arrived.
    pub records: Vec<TraceRecord>,
}

/// Reads the trace at `path` (at most `TRACE_BYTES_MAX` bytes).
pub fn read_trace(path: &Path) -> Result<Trace, String> {
    let name = path.display();
    let size = std::fs::metadata(path).map_err(|e| format!("{name}: {e}"))?.len();
    if size > TRACE_BYTES_MAX {
        return Err(format!("{name}: {size} bytes, more than {TRACE_BYTES_MAX}"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
    parse_trace(&text).map_err(|e| format!("{name}: {e}"))
}

/// Parses a trace: the header (format and version checked), then records. Blank lines are
/// skipped. A last line without its newline that does not parse is left out: a server killed
/// while writing cuts its last record short. Any other bad line is an error naming it.
pub fn parse_trace(text: &str) -> Result<Trace, String> {
    let cut_short = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<(usize, &str)> =
        text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).collect();
    let Some(&(_, first)) = lines.first() else {
        return Err("empty: no header line".into());
    };
    let header: TraceHeader =
        serde_json::from_str(first).map_err(|e| format!("line 1: not a trace header: {e}"))?;
    if header.format != TRACE_FORMAT || header.version != TRACE_VERSION {
        return Err(format!(
            "line 1: format {:?} version {}; this reader reads {TRACE_FORMAT:?} version \
             {TRACE_VERSION}",
            header.format, header.version
        ));
    }
    let mut records = Vec::with_capacity(lines.len() - 1);
    for (at, &(i, line)) in lines.iter().enumerate().skip(1) {
        match serde_json::from_str::<TraceRecord>(line) {
            Ok(record) => records.push(record),
            Err(_) if cut_short && at + 1 == lines.len() => {}
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        }
    }
    Ok(Trace { header, records })
}
