//! What both generation endpoints do alike: read the body, start the request in the engine
//! (mapping every refusal to its status), and write usage and server-sent events.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{BoxStream, SelectAll};
use futures_util::{Stream, StreamExt};
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

/// Queues the request's `params.choices` completions (choice `i` with `params.for_choice(i)`),
/// all or none: when the engine refuses one, those already queued are dropped here, which
/// aborts them. They are queued one after another, so each computes its own prompt unless the
/// prefix cache holds it already.
pub(super) async fn start_choices(
    state: &AppState,
    prompt: Vec<u32>,
    params: &GenerationParams,
    draft: Option<Draft>,
) -> Result<Vec<Generation>, ApiError> {
    let n = params.choices as usize;
    let drafts: Vec<Option<Draft>> = match draft {
        Some(draft) => draft.split(n).into_iter().map(Some).collect(),
        None => (0..n).map(|_| None).collect(),
    };
    let mut generations = Vec::with_capacity(n);
    for (index, draft) in (0u32..).zip(drafts) {
        generations.push(start(state, prompt.clone(), &params.for_choice(index), draft).await?);
    }
    Ok(generations)
}

/// Queues the request; the generation that reads its output.
async fn start(
    state: &AppState,
    prompt: Vec<u32>,
    params: &GenerationParams,
    draft: Option<Draft>,
) -> Result<Generation, ApiError> {
    let refused = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    if params.priority != 0 && !state.config.priority_scheduling {
        return Err(refused(ApiError::invalid_param(
            "priority",
            "this server takes requests in arrival order: a priority other than 0 needs \
             --scheduling-policy priority",
        )));
    }
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
    let vocab = state.codec.vocab_size();
    let biased: Vec<u32> = params.spec.logit_bias.iter().map(|&(token, _)| token).collect();
    for (param, ids) in
        [("prompt", &prompt), ("stop_token_ids", &params.stop_token_ids), ("logit_bias", &biased)]
    {
        if let Some(token) = ids.iter().find(|&&t| t >= vocab) {
            return Err(refused(ApiError::invalid_param(
                param,
                format!("token id {token} is outside the vocabulary of {vocab}"),
            )));
        }
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
    let mut spec = params.spec.clone().with_prompt(&prompt);
    if let Some(top) = spec.prompt_logprobs {
        spec = spec.scoring(&prompt, top);
    }
    let request = NewRequest {
        id: lockstep_core::sched::RequestId(0),
        prompt,
        max_tokens,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: params.ignore_eos,
        priority: params.priority,
        cache_salt: 0,
    };
    let stream = state.engine.submit(request, spec).await.map_err(|e| submit_error(state, e))?;
    let deadline = tokio::time::Instant::now() + state.config.request_time_max;
    let recording =
        draft.zip(input_ids).map(|(d, ids)| d.begin(stream.id().0, ids, params, &state.metrics));
    let generation =
        Generation::new(stream, state.codec.clone(), &params.stops, prompt_tokens, deadline);
    Ok(generation.with_stop_token_ids(&params.stop_token_ids).with_recording(recording))
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

/// What `usage` counts of a response's completions, summed over its choices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct CompletionTokens {
    pub(super) generated: u32,
    /// Of those, the reasoning ones (`reasoning::stream` says which): counted where the server
    /// reads reasoning, and then reported as `completion_tokens_details.reasoning_tokens`.
    pub(super) reasoning: Option<u32>,
}

impl CompletionTokens {
    fn add(self, other: CompletionTokens) -> CompletionTokens {
        let reasoning = match (self.reasoning, other.reasoning) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
        };
        CompletionTokens { generated: self.generated.saturating_add(other.generated), reasoning }
    }

    pub(super) fn sum(all: impl IntoIterator<Item = CompletionTokens>) -> CompletionTokens {
        all.into_iter().fold(CompletionTokens::default(), CompletionTokens::add)
    }
}

/// The prompt counted once, whatever the number of choices; the completions' tokens summed.
pub(super) fn usage(prompt: u32, completion: CompletionTokens) -> Value {
    let generated = completion.generated;
    let mut usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt.saturating_add(generated),
    });
    if let Some(reasoning) = completion.reasoning {
        usage["completion_tokens_details"] = json!({ "reasoning_tokens": reasoning });
    }
    usage
}

/// What one choice's stream of events yields.
pub(super) enum ChoiceEvents {
    /// Chunks of its output.
    More(Vec<Value>),
    /// Its last chunks, and how many tokens it generated.
    Finished(Vec<Value>, CompletionTokens),
    /// An error event: the whole stream ends with it, and the other choices are aborted.
    Failed(Value),
}

/// The choices' events interleaved as they come, then, when every choice has finished and
/// `usage` is given (the chunk to carry it, and the prompt's tokens), the usage chunk.
pub(super) fn merge_choices(
    choices: Vec<BoxStream<'static, ChoiceEvents>>,
    usage_chunk: Option<(Value, u32)>,
) -> impl Stream<Item = Vec<Value>> + Send + 'static {
    struct Merge {
        choices: SelectAll<BoxStream<'static, ChoiceEvents>>,
        unfinished: usize,
        completion_tokens: CompletionTokens,
        usage_chunk: Option<(Value, u32)>,
    }
    let merge = Merge {
        unfinished: choices.len(),
        choices: futures_util::stream::select_all(choices),
        completion_tokens: CompletionTokens::default(),
        usage_chunk,
    };
    futures_util::stream::unfold(Some(merge), |merge| async move {
        let mut merge = merge?;
        match merge.choices.next().await? {
            ChoiceEvents::More(chunks) => Some((chunks, Some(merge))),
            ChoiceEvents::Finished(mut chunks, tokens) => {
                merge.unfinished -= 1;
                merge.completion_tokens = merge.completion_tokens.add(tokens);
                if merge.unfinished == 0
                    && let Some((mut chunk, prompt_tokens)) = merge.usage_chunk.take()
                {
                    chunk["usage"] = usage(prompt_tokens, merge.completion_tokens);
                    chunks.push(chunk);
                }
                Some((chunks, Some(merge)))
            }
            // Dropping the others aborts their requests.
            ChoiceEvents::Failed(error) => Some((vec![error], None)),
        }
    })
}

/// `data: {json}` events, a batch per item of `chunks`; `data: [DONE]` closes the stream. An
/// empty comment goes out whenever nothing else has for `keep_alive`. Dropping the response (the
/// client left) drops `chunks`, and with them the requests, which the engine then aborts.
pub(super) fn sse_events<S>(chunks: S, keep_alive: Duration) -> Response
where
    S: Stream<Item = Vec<Value>> + Send + 'static,
{
    let events = chunks
        .map(|values| {
            values.into_iter().map(|v| Ok::<_, Infallible>(Event::default().data(v.to_string())))
        })
        .flat_map(futures_util::stream::iter)
        .chain(futures_util::stream::once(async { Ok(Event::default().data("[DONE]")) }));
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}
