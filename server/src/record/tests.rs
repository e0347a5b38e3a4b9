use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue};
use lockstep_core::model::SamplingSpec;
use lockstep_core::wire::Sampling;
use serde_json::json;
use tokio::io::AsyncWrite;

use super::*;

fn params() -> GenerationParams {
    GenerationParams {
        max_tokens: Some(8),
        spec: SamplingSpec {
            sampling: Sampling {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 40,
                seed: u64::MAX,
                presence_penalty: 0.0,
                frequency_penalty: 0.25,
                min_p: 0.05,
                repetition_penalty: 1.1,
            },
            logit_bias: vec![(3, -1.5)],
            ..SamplingSpec::GREEDY
        },
        stops: vec!["\n\n".into()],
        stop_token_ids: vec![],
        ignore_eos: false,
        stream: true,
        include_usage: false,
        return_token_ids: false,
        priority: -3,
        choices: 1,
    }
}

fn session(id: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(SESSION_HEADER, HeaderValue::from_str(id).unwrap());
    headers
}

fn counter_value(metrics: &Metrics, name: &str) -> u64 {
    let text = metrics.render();
    let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(start_paused = true)]
async fn records_written_read_back_equal_with_turns_tokens_and_timings() {
    let metrics = Metrics::new("m");
    let header = TraceHeader::new("m", 256, 1000);
    let (recorder, writer) = Recorder::new(header.clone(), Vec::new(), RecorderLimits::default());
    let task = writer.spawn(&metrics);

    tokio::time::sleep(Duration::from_millis(5)).await;
    let chat = RequestInput::Chat {
        messages: vec![json!({"role": "user", "content": "hi"})],
        tools: None,
        tool_choice: None,
        response_format: Some(json!({"type": "json_object"})),
        chat_template_kwargs: json!({"enable_thinking": false}).as_object().cloned(),
    };
    for turn in 1..=2u64 {
        let draft = recorder.arrived(&session("s")).with_input(chat.clone());
        let mut recording = draft.begin(turn, vec![1, 2, 3], &params(), &metrics);
        tokio::time::sleep(Duration::from_millis(1)).await;
        recording.token(7);
        tokio::time::sleep(Duration::from_millis(2)).await;
        recording.token(8);
        recording.finish(TraceFinish::Length);
    }
    // Dropped unended (the client went away): abort, with the tokens so far.
    let draft = recorder
        .arrived(&HeaderMap::new())
        .with_input(RequestInput::Completions { prompt: json!("t1 t2"), response_format: None });
    // It asked for its tokens' log-probabilities and its prompt's (`echo`).
    let mut scoring = params();
    (scoring.spec.logprobs, scoring.spec.prompt_logprobs) = (Some(2), Some(2));
    let mut recording = draft.begin(9, vec![1, 2], &scoring, &metrics);
    recording.token(5);
    drop(recording);

    let totals = task.finish().await.unwrap();
    assert_eq!((totals.written, totals.lost, totals.error), (3, 0, None));
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_written_total"), 3);
    let text = String::from_utf8(totals.sink).unwrap();
    let trace = parse_trace(&text).unwrap();
    assert_eq!(trace.header, header);
    let [one, two, three] = &trace.records[..] else { panic!("{text}") };
    assert_eq!((one.session.as_deref(), one.turn), (Some("s"), Some(1)));
    assert_eq!((two.session.as_deref(), two.turn), (Some("s"), Some(2)));
    assert_eq!(one.arrival_ms, 5.0);
    assert_eq!(two.arrival_ms, 8.0);
    assert_eq!(one.timings, Some(TraceTimings { ttft_ms: Some(1.0), e2e_ms: 3.0 }));
    assert_eq!(one.request, Some(chat));
    assert_eq!(one.sampling.seed, u64::MAX, "a seed survives JSON bit for bit");
    assert_eq!(one.priority, -3);
    assert!(text.contains("\"priority\":-3"), "{text}");
    assert_eq!((one.sampling.temperature, one.sampling.top_p, one.sampling.top_k), (0.7, 0.9, 40));
    let output = one.output.as_ref().unwrap();
    assert_eq!(
        (output.token_ids.as_slice(), output.finish_reason),
        (&[7, 8][..], TraceFinish::Length)
    );
    assert_eq!((three.session.as_ref(), three.turn), (None, None));
    let output = three.output.as_ref().unwrap();
    assert_eq!((output.token_ids.as_slice(), output.finish_reason), (&[5][..], TraceFinish::Abort));
    assert_eq!(three.timings.unwrap().ttft_ms, Some(0.0));
    assert_eq!((three.logprobs, three.prompt_logprobs), (Some(2), Some(2)));
    assert_eq!((one.logprobs, one.prompt_logprobs), (None, None));
    assert_eq!(text.matches("logprobs").count(), 2, "absent when not asked: {text}");
    // The serialized form reads back to the same records, and writes to the same bytes.
    let again: String = std::iter::once(serde_json::to_string(&trace.header).unwrap())
        .chain(trace.records.iter().map(|r| serde_json::to_string(r).unwrap()))
        .map(|l| l + "\n")
        .collect();
    assert_eq!(again, text);
}

/// A request for `n` completions is `n` records: the first takes the session's turn, the others
/// arrive with it in no session (a replay sends them beside it), each with its own seed.
#[tokio::test(start_paused = true)]
async fn choices_are_records_of_their_own_and_only_the_first_takes_a_turn() {
    let metrics = Metrics::new("m");
    let (recorder, writer) =
        Recorder::new(TraceHeader::new("m", 256, 1000), Vec::new(), RecorderLimits::default());
    let task = writer.spawn(&metrics);
    tokio::time::sleep(Duration::from_millis(3)).await;
    let input = RequestInput::Completions { prompt: json!("t1"), response_format: None };
    let drafts = recorder.arrived(&session("s")).with_input(input.clone()).split(3);
    tokio::time::sleep(Duration::from_millis(4)).await;
    for (i, draft) in (0u32..).zip(drafts) {
        let params = params().for_choice(i);
        draft.begin(10 + u64::from(i), vec![1], &params, &metrics).finish(TraceFinish::Stop);
    }
    let next = recorder.arrived(&session("s")).with_input(input);
    next.begin(20, vec![1], &params(), &metrics).finish(TraceFinish::Stop);
    let totals = task.finish().await.unwrap();
    let trace = parse_trace(std::str::from_utf8(&totals.sink).unwrap()).unwrap();
    let seen: Vec<_> = trace
        .records
        .iter()
        .map(|r| (r.request_id, r.session.as_deref(), r.turn, r.arrival_ms, r.sampling.seed))
        .collect();
    let max = u64::MAX;
    assert_eq!(
        seen,
        [
            (10, Some("s"), Some(1), 3.0, max),
            (11, None, None, 3.0, 0),
            (12, None, None, 3.0, 1),
            (20, Some("s"), Some(2), 7.0, max),
        ]
    );
}

#[tokio::test]
async fn a_full_channel_or_byte_budget_drops_and_counts_and_a_stopped_writer_too() {
    let metrics = Metrics::new("m");
    let limits = RecorderLimits { records_queued_max: 2, ..RecorderLimits::default() };
    let (recorder, writer) = Recorder::new(TraceHeader::new("m", 256, 1000), Vec::new(), limits);
    let record = |id| {
        let input = RequestInput::Completions { prompt: json!([1]), response_format: None };
        let recording = recorder.arrived(&HeaderMap::new()).with_input(input).begin(
            id,
            vec![1],
            &params(),
            &metrics,
        );
        recording.finish(TraceFinish::Stop);
    };
    for id in 0..5 {
        record(id); // Never waits: the writer is not even running.
    }
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_dropped_total"), 3);
    let task = writer.spawn(&metrics);
    let totals = task.finish().await.unwrap();
    assert_eq!(totals.written, 2);
    let trace = parse_trace(std::str::from_utf8(&totals.sink).unwrap()).unwrap();
    assert_eq!(trace.records.iter().map(|r| r.request_id).collect::<Vec<_>>(), [0, 1]);
    record(5); // After the writer stopped.
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_dropped_total"), 4);

    // A byte budget smaller than one record: every record is dropped.
    let limits = RecorderLimits { queued_bytes_max: 100, ..RecorderLimits::default() };
    let (small, _writer) =
        Recorder::new(TraceHeader::new("m", 256, 1000), Vec::<u8>::new(), limits);
    let input = RequestInput::Completions { prompt: json!("x".repeat(200)), response_format: None };
    small
        .arrived(&HeaderMap::new())
        .with_input(input)
        .begin(1, vec![1], &params(), &metrics)
        .finish(TraceFinish::Stop);
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_dropped_total"), 5);
    assert_eq!(small.shared.queued_bytes.load(Ordering::Relaxed), 0);
}

/// A sink that takes `ok_bytes` and then fails every write.
#[derive(Debug)]
struct FailingSink {
    ok_bytes: usize,
    failures: usize,
}

impl AsyncWrite for FailingSink {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.ok_bytes >= buf.len() {
            self.ok_bytes -= buf.len();
            return Poll::Ready(Ok(buf.len()));
        }
        self.failures += 1;
        Poll::Ready(Err(io::Error::other("disk full")))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn an_io_error_stops_writing_counts_what_is_lost_and_never_panics() {
    let metrics = Metrics::new("m");
    let limits = RecorderLimits { flush_records_max: 1, ..RecorderLimits::default() };
    let sink = FailingSink { ok_bytes: 1000, failures: 0 };
    let (recorder, writer) = Recorder::new(TraceHeader::new("m", 256, 1000), sink, limits);
    let task = writer.spawn(&metrics);
    for id in 0..6 {
        let input = RequestInput::Completions { prompt: json!([1, 2, 3]), response_format: None };
        let recording = recorder.arrived(&HeaderMap::new()).with_input(input).begin(
            id,
            vec![1, 2, 3],
            &params(),
            &metrics,
        );
        recording.finish(TraceFinish::Stop);
        tokio::task::yield_now().await;
    }
    let totals = task.finish().await.unwrap();
    assert_eq!(totals.error.as_deref(), Some("disk full"));
    assert_eq!(totals.sink.failures, 1, "nothing is written after the first error");
    assert_eq!(totals.written + totals.lost, 6);
    assert!(totals.written >= 1 && totals.lost >= 1, "{totals:?}");
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_written_total"), totals.written);
    assert_eq!(counter_value(&metrics, "lockstep:trace_records_dropped_total"), totals.lost);
}

#[test]
fn the_reader_checks_the_header_names_bad_lines_and_skips_a_cut_last_line() {
    let header = serde_json::to_string(&TraceHeader::new("m", 64, 100)).unwrap();
    let record = r#"{"request_id":1,"arrival_ms":0.0,"request":{"endpoint":"completions","prompt":[1]},"input_ids":[1],"max_tokens":null,"sampling":{"temperature":1.0,"top_p":1.0,"top_k":0,"seed":3}}"#;
    let trace = parse_trace(&format!("{header}\n{record}\n\n{record}\n")).unwrap();
    assert_eq!(trace.records.len(), 2);
    assert_eq!(trace.records[0].output, None, "output is optional (imported traces)");
    // Cut short by a crash: the last line has no newline and does not parse.
    let cut = &record[..record.len() / 2];
    assert_eq!(parse_trace(&format!("{header}\n{record}\n{cut}")).unwrap().records.len(), 1);
    // The same line with its newline is an error, and names its line.
    let e = parse_trace(&format!("{header}\n{record}\n{cut}\n")).unwrap_err();
    assert!(e.starts_with("line 3:"), "{e}");
    let e = parse_trace(&header.replace("\"version\":1", "\"version\":2")).unwrap_err();
    assert!(e.contains("version 2"), "{e}");
    let e = parse_trace(&header.replace(TRACE_FORMAT, "mooncake")).unwrap_err();
    assert!(e.contains("\"mooncake\""), "{e}");
    assert!(parse_trace("").is_err());
    assert!(parse_trace(&format!("{record}\n")).unwrap_err().starts_with("line 1:"));
}

#[tokio::test]
async fn read_trace_reads_a_file_the_writer_wrote() {
    let path =
        std::env::temp_dir().join(format!("lockstep-record-unit-{}.jsonl", std::process::id()));
    let file = create_file(&path).await.unwrap();
    let metrics = Metrics::new("m");
    let (recorder, writer) =
        Recorder::new(TraceHeader::new("m", 64, 100), file, RecorderLimits::default());
    let task = writer.spawn(&metrics);
    let input = RequestInput::Completions { prompt: json!("t1"), response_format: None };
    let recording =
        recorder.arrived(&session("a")).with_input(input).begin(4, vec![1], &params(), &metrics);
    recording.finish(TraceFinish::Stop);
    task.finish().await.unwrap();
    let trace = read_trace(&path).unwrap();
    assert_eq!(trace.records.len(), 1);
    assert_eq!(trace.records[0].request_id, 4);
    std::fs::remove_file(&path).unwrap();
    assert!(read_trace(&path).unwrap_err().contains("lockstep-record-unit"));
}
