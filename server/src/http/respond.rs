//! What both generation endpoints do alike: read the body, start the request in the engine
//! (mapping every refusal to its status), and write usage and server-sent events.

use std::convert::Infallible;
use std::future::Future;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use lockstep_core::sched::{AdmissionError, NewRequest};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;
use super::generation::Generation;
use super::protocol::GenerationParams;
use crate::engine::SubmitError;
use crate::record::Draft;

/// The body as JSON of type `T`, or a 4xx saying what is wrong with it.
pub(super) fn parse_body<T: DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let parsed = match body {
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            Err(ApiError::too_large(format!(
                "the body is larger than {} bytes",
                state.config.body_bytes_max
            )))
        }
        Err(rejection) => Err(ApiError::invalid(rejection.body_text())),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"))),
    };
    if parsed.is_err() {
        state.metrics.rejected_invalid.increment(1);
    }
    parsed
}

/// Queues the request; the generation that reads its output.
pub(super) async fn start(
    state: &AppState,
    prompt: Vec<u32>,
    params: &GenerationParams,
    draft: Option<Draft>,
) -> Result<Generation, ApiError> {
    let refused = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    let context = state.config.context_tokens;
    let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    if prompt_tokens == 0 {
        return Err(refused(ApiError::invalid_param("prompt", "the prompt is empty")));
    }
    if prompt_tokens >= context {
        return Err(refused(ApiError::invalid_param(
            "prompt",
            format!(
                "this model's maximum context length is {context} tokens; the prompt has \
                 {prompt_tokens}, which leaves no room for output"
            ),
        )));
    }
    if let Some(token) = prompt.iter().find(|&&t| t >= state.codec.vocab_size()) {
        return Err(refused(ApiError::invalid_param(
            "prompt",
            format!("token id {token} is outside the vocabulary of {}", state.codec.vocab_size()),
        )));
    }
    let max_tokens = match params.max_tokens {
        Some(n) if u64::from(prompt_tokens) + u64::from(n) > u64::from(context) => {
            return Err(refused(ApiError::invalid_param(
                "max_tokens",
                format!(
                    "this model's maximum context length is {context} tokens; the prompt has \
                     {prompt_tokens} and max_tokens asks for {n} more"
                ),
            )));
        }
        Some(n) => n,
        None => context - prompt_tokens,
    };
    let input_ids = draft.as_ref().map(|_| prompt.clone());
    let request = NewRequest {
        id: lockstep_core::sched::RequestId(0),
        prompt,
        max_tokens,
        stop_token_ids: Vec::new(),
        ignore_eos: params.ignore_eos,
        priority: 0,
        cache_salt: 0,
    };
    let stream =
        state.engine.submit(request, params.spec).await.map_err(|e| submit_error(state, e))?;
    let deadline = tokio::time::Instant::now() + state.config.request_time_max;
    let recording =
        draft.zip(input_ids).map(|(d, ids)| d.begin(stream.id().0, ids, params, &state.metrics));
    Ok(Generation::new(stream, state.codec.clone(), &params.stops, prompt_tokens, deadline)
        .with_recording(recording))
}

fn submit_error(state: &AppState, e: SubmitError) -> ApiError {
    let retry = state.config.retry_after_s;
    match e {
        SubmitError::Refused(AdmissionError::QueueFull { .. }) | SubmitError::Busy => {
            state.metrics.rejected_queue_full.increment(1);
            ApiError::overloaded(format!("the server is at capacity ({e}); retry later"), retry)
        }
        SubmitError::Refused(AdmissionError::DuplicateId(_)) => {
            ApiError::internal(format!("request ids collided: {e}"))
        }
        SubmitError::Refused(refusal) => {
            state.metrics.rejected_invalid.increment(1);
            ApiError::invalid_param("prompt", refusal.to_string())
        }
        SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down", retry),
        SubmitError::Timeout => ApiError::unavailable("the engine did not answer in time", retry),
        SubmitError::Unsupported { param, why } => {
            state.metrics.rejected_invalid.increment(1);
            ApiError::invalid_param(param, why.to_string())
        }
        SubmitError::NoWorkers | SubmitError::Unavailable(_) => {
            ApiError::unavailable(format!("{e}"), retry)
        }
    }
}

pub(super) fn usage(generation: &Generation) -> Value {
    let (prompt, completion) = (generation.prompt_tokens, generation.output_tokens);
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

/// `data: {json}` events from a producer that yields a batch of JSON values per call, `None`
/// when done; `data: [DONE]` closes the stream. Dropping the response (the client left) drops
/// the producer, and with it the request, which the engine then aborts.
pub(super) fn sse_response<S, F, Fut>(producer: S, step: F) -> Response
where
    S: Send + 'static,
    F: FnMut(S) -> Fut + Send + 'static,
    Fut: Future<Output = Option<(Vec<Value>, S)>> + Send + 'static,
{
    let events = futures_util::stream::unfold(Some((producer, step)), |state| async move {
        let (producer, mut step) = state?;
        match step(producer).await {
            Some((values, producer)) => {
                let events: Vec<Result<Event, Infallible>> =
                    values.into_iter().map(|v| Ok(Event::default().data(v.to_string()))).collect();
                Some((events, Some((producer, step))))
            }
            None => Some((vec![Ok(Event::default().data("[DONE]"))], None)),
        }
    })
    .flat_map(futures_util::stream::iter);
    Sse::new(events).into_response()
}
