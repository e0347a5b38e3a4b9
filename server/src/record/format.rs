//! The native trace format (DESIGN.md section 7): JSON Lines, a header line, then one record per
//! request. `traces/README.md` documents every field; this file is its definition, and the
//! reader the simulator replays from.

use std::path::Path;

use lockstep_core::sched::FinishReason;
use lockstep_core::wire::Sampling;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The header's `format`.
pub const TRACE_FORMAT: &str = "lockstep-trace";
/// The header's `version`; a reader refuses any other.
pub const TRACE_VERSION: u32 = 1;
/// A trace file larger than this is refused by `read_trace`.
pub const TRACE_BYTES_MAX: u64 = 1 << 30;
/// Tokens in one block of `hash_ids` when the header does not say (WEKA's block size).
pub const HASH_BLOCK_TOKENS_DEFAULT: u32 = 64;

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
    /// Tokens in one block of the records' `hash_ids`; absent: `HASH_BLOCK_TOKENS_DEFAULT`.
    /// Recordings never write it (they carry token ids); imported traces may.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_tokens: Option<u32>,
}

impl TraceHeader {
    pub fn new(model: impl Into<String>, context_tokens: u32, vocab_size: u32) -> TraceHeader {
        TraceHeader {
            format: TRACE_FORMAT.to_owned(),
            version: TRACE_VERSION,
            model: model.into(),
            context_tokens,
            vocab_size,
            block_tokens: None,
        }
    }

    /// Tokens in one block of a record's `hash_ids`.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens.unwrap_or(HASH_BLOCK_TOKENS_DEFAULT)
    }
}

/// One request. Its input is either `input_ids` (what a recording writes) or `hash_ids` with
/// `input_tokens` (an imported trace: the prompt is made from the ids, equal ids giving equal
/// tokens); `check_input` refuses anything else.
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
    /// The `request_id` of a request in another session whose end this one, the first turn of
    /// its session, waits for: a sub-agent starts when the request that spawned it has ended.
    /// Recordings never write it (the server cannot know).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follows: Option<u64>,
    /// Milliseconds from the start of the recording to the request's arrival (tokio's clock).
    pub arrival_ms: f64,
    /// The input as the client sent it; absent in imported traces, which have no text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestInput>,
    /// The prompt's token ids as the server computed them (template and tokenizer applied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub input_ids: Vec<u32>,
    /// Instead of `input_ids`: one id per `block_tokens` block of the prompt (the header's),
    /// equal leading ids meaning a shared prefix; tokens past the last block continue it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hash_ids: Vec<u64>,
    /// With `hash_ids`: the prompt's length in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u32>,
    /// The client's `max_tokens` (or `max_completion_tokens`); `None`: up to the context.
    pub max_tokens: Option<u32>,
    pub sampling: TraceSampling,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Absent when none (and in traces written before they were served).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// (token, bias), by token; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// The request's `priority` (lower first); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub priority: i32,
    /// The client asked for server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Top alternatives per output token, when the request asked for its tokens'
    /// log-probabilities (completions' `logprobs`, chat's `logprobs` with `top_logprobs`);
    /// absent when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u8>,
    /// Top alternatives per prompt token, when the request asked for its prompt's
    /// log-probabilities (completions' `echo` with `logprobs`); absent when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<u8>,
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
    Completions {
        prompt: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_format: Option<Value>,
    },
    /// `/v1/chat/completions`.
    Chat {
        messages: Vec<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tools: Option<Vec<Value>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_format: Option<Value>,
        /// The template variables the request set (Qwen 3's `enable_thinking`, say).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chat_template_kwargs: Option<Map<String, Value>>,
    },
}

impl RequestInput {
    /// Whether the request asked for a `response_format` that holds its output to a grammar
    /// (anything but `text`).
    pub fn holds_output(&self) -> bool {
        let format = match self {
            RequestInput::Completions { response_format, .. } => response_format,
            RequestInput::Chat { response_format, .. } => response_format,
        };
        format.as_ref().is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text"))
    }
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
    /// Absent in traces written before penalties were served: none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub presence_penalty: f32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub frequency_penalty: f32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_p: f32,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub repetition_penalty: f32,
}

impl From<Sampling> for TraceSampling {
    fn from(s: Sampling) -> TraceSampling {
        TraceSampling {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            seed: s.seed,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
        }
    }
}

fn one() -> f32 {
    1.0
}

fn is_one(value: &f32) -> bool {
    *value == 1.0
}

fn is_zero(value: &f32) -> bool {
    *value == 0.0
}

fn is_zero_i32(value: &i32) -> bool {
    *value == 0
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceOutput {
    /// Every output token the server produced, in order (a stop string's last token included).
    pub token_ids: Vec<u32>,
    pub finish_reason: TraceFinish,
}

impl TraceRecord {
    /// Whether the record has exactly one input: non-empty `input_ids`, or `hash_ids` with
    /// `input_tokens` of at least 1.
    pub fn check_input(&self) -> Result<(), String> {
        let ids = !self.input_ids.is_empty();
        match (ids, self.hash_ids.is_empty(), self.input_tokens) {
            (true, true, None) => Ok(()),
            (false, false, Some(tokens)) if tokens >= 1 => Ok(()),
            (false, false, Some(_)) => Err("input_tokens is 0: a prompt has at least 1".into()),
            (false, true, None) => {
                Err("no input: give input_ids, or hash_ids with input_tokens".into())
            }
            (false, true, Some(_)) => Err("input_tokens without hash_ids".into()),
            (false, false, None) => Err("hash_ids without input_tokens".into()),
            (true, _, _) => Err("both input_ids and hash_ids/input_tokens: give one".into()),
        }
    }
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
            Ok(record) => {
                record.check_input().map_err(|e| format!("line {}: {e}", i + 1))?;
                records.push(record);
            }
            Err(_) if cut_short && at + 1 == lines.len() => {}
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        }
    }
    Ok(Trace { header, records })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = r#"{"format":"lockstep-trace","version":1,"model":"m","context_tokens":64,"vocab_size":100}"#;
    const SAMPLING: &str = r#""sampling":{"temperature":1.0,"top_p":1.0,"top_k":0,"seed":3}"#;

    fn record(input: &str) -> String {
        format!(r#"{{"request_id":1,"arrival_ms":0.0,{input}"max_tokens":null,{SAMPLING}}}"#)
    }

    #[test]
    fn an_imported_record_gives_hash_ids_and_a_length_instead_of_token_ids() {
        let header = HEADER.replace('}', r#","block_tokens":16}"#);
        let text = format!("{header}\n{}\n", record(r#""hash_ids":[4,5],"input_tokens":20,"#));
        let trace = parse_trace(&text).unwrap();
        assert_eq!(trace.header.block_tokens(), 16);
        let r = &trace.records[0];
        assert_eq!((r.request.as_ref(), r.input_ids.len()), (None, 0));
        assert_eq!((r.hash_ids.as_slice(), r.input_tokens), (&[4, 5][..], Some(20)));
        // Written, it has no `request` and no `input_ids`, and reads back the same.
        let line = serde_json::to_string(r).unwrap();
        assert!(!line.contains("request\"") && !line.contains("input_ids"), "{line}");
        assert_eq!(&serde_json::from_str::<TraceRecord>(&line).unwrap(), r);
        assert_eq!(serde_json::to_string(&trace.header).unwrap(), header);
        let plain = parse_trace(&format!("{HEADER}\n")).unwrap();
        assert_eq!(plain.header.block_tokens(), HASH_BLOCK_TOKENS_DEFAULT);
    }

    #[test]
    fn a_record_needs_exactly_one_input() {
        let cases = [
            ("", "no input"),
            (r#""input_ids":[],"#, "no input"),
            (r#""hash_ids":[4],"#, "hash_ids without input_tokens"),
            (r#""input_tokens":3,"#, "input_tokens without hash_ids"),
            (r#""hash_ids":[4],"input_tokens":0,"#, "input_tokens is 0"),
            (r#""input_ids":[1],"hash_ids":[4],"input_tokens":3,"#, "both"),
        ];
        for (input, expected) in cases {
            let e = parse_trace(&format!("{HEADER}\n\n{}\n", record(input))).unwrap_err();
            assert!(e.starts_with("line 3:") && e.contains(expected), "{expected:?}: {e}");
        }
    }

    #[test]
    fn the_committed_recording_writes_back_byte_for_byte() {
        let path =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/recorded_router_1p1d_smollm2.jsonl");
        let text = std::fs::read_to_string(path).unwrap();
        let trace = parse_trace(&text).unwrap();
        let again: String = std::iter::once(serde_json::to_string(&trace.header).unwrap())
            .chain(trace.records.iter().map(|r| serde_json::to_string(r).unwrap()))
            .map(|l| l + "\n")
            .collect();
        assert_eq!(again, text);
    }
}
