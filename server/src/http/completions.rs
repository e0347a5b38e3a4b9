//! `POST /v1/completions`: a prompt (text or token ids) continued.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use lockstep_core::model::TokenLogprobs;
use serde_json::{Value, json};
use tracing::Instrument;

use super::error::ApiError;
use super::generation::{Finish, Generation, Next, Piece};
use super::protocol::{CompletionRequest, GenerationParams, Prompt, completion_prompt};
use super::respond::{parse_body, sse_response, start, usage};
use super::{AppState, logprobs};
use crate::record::{Arrival, RequestInput};

pub(super) async fn handle(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = state.config.recorder.as_ref().map(|r| r.arrived(&headers));
    match prepare(&state, body, arrival).await {
        Ok((generation, params, prompt)) => {
            let id = format!("cmpl-{}", generation.request_id().0);
            let span = tracing::info_span!("request", id = %id);
            respond(state, generation, params, prompt, id).instrument(span).await
        }
        Err(e) => e.into_response(),
    }
}

async fn prepare(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    arrival: Option<Arrival>,
) -> Result<(Generation, GenerationParams, Vec<u32>), ApiError> {
    let request: CompletionRequest = parse_body(state, body)?;
    let invalid = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    if request.echo {
        return Err(invalid(ApiError::invalid_param("echo", "echo is not supported")));
    }
    if request.suffix.is_some() {
        return Err(invalid(ApiError::invalid_param("suffix", "suffix is not supported")));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(invalid(ApiError::invalid_param("best_of", "only best_of = 1 is supported")));
    }
    let params = request
        .common
        .validate(&state.config.model_name, request.logprobs, state.next_seed())
        .map_err(invalid)?;
    let prompt = match completion_prompt(&request.prompt).map_err(invalid)? {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            state.codec.encode(&text).map_err(|e| invalid(ApiError::invalid(e)))?
        }
    };
    let draft = arrival.map(|a| a.with_input(RequestInput::Completions { prompt: request.prompt }));
    let generation = start(state, prompt.clone(), &params, draft).await?;
    Ok((generation, params, prompt))
}

async fn respond(
    state: Arc<AppState>,
    generation: Generation,
    params: GenerationParams,
    prompt: Vec<u32>,
    id: String,
) -> Response {
    let out = Output { state, params, prompt, id, generation, text_len: 0, ended: false };
    if out.params.stream { stream(out) } else { whole(out).await }
}

struct Output {
    state: Arc<AppState>,
    params: GenerationParams,
    prompt: Vec<u32>,
    id: String,
    generation: Generation,
    /// Bytes of text out so far, for log-probability offsets.
    text_len: usize,
    /// The last events are out: the stream ends.
    ended: bool,
}

impl Output {
    fn choice(
        &self,
        text: &str,
        tokens: &[u32],
        lp: &[TokenLogprobs],
        finish: Option<Finish>,
    ) -> Value {
        let logprobs = self.params.spec.logprobs.map(|_| {
            logprobs::completion(self.state.codec.as_ref(), lp, self.text_len - text.len())
        });
        let mut choice = json!({
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::as_str),
        });
        if self.params.return_token_ids {
            choice["token_ids"] = Value::from(tokens.to_vec());
        }
        choice
    }

    fn envelope(&self, choices: Vec<Value>) -> Value {
        let mut body = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.state.created(),
            "model": self.state.config.model_name,
            "choices": choices,
        });
        if self.params.return_token_ids {
            body["prompt_token_ids"] = Value::from(self.prompt.clone());
        }
        body
    }
}

async fn whole(mut out: Output) -> Response {
    let (Piece { text, tokens, logprobs: lps }, finish) = match out.generation.collect().await {
        Ok(whole) => whole,
        Err(e) => return e.into_response(),
    };
    out.text_len = text.len();
    let choice = out.choice(&text, &tokens, &lps, Some(finish));
    let mut body = out.envelope(vec![choice]);
    body["usage"] = usage(&out.generation);
    Json(body).into_response()
}

fn stream(out: Output) -> Response {
    sse_response(out, |mut out| async move {
        if out.ended {
            return None;
        }
        match out.generation.next().await {
            Next::Piece(p)
                if p.text.is_empty() && p.logprobs.is_empty() && !out.params.return_token_ids =>
            {
                Some((vec![], out))
            }
            Next::Piece(p) => {
                out.text_len += p.text.len();
                let choice = out.choice(&p.text, &p.tokens, &p.logprobs, None);
                let mut chunk = out.envelope(vec![choice]);
                if out.params.include_usage {
                    chunk["usage"] = Value::Null;
                }
                Some((vec![chunk], out))
            }
            Next::Done(Ok(finish)) => {
                let choice = out.choice("", &[], &[], Some(finish));
                let mut finished = out.envelope(vec![choice]);
                if out.params.include_usage {
                    finished["usage"] = Value::Null;
                }
                let mut last = vec![finished];
                if out.params.include_usage {
                    let mut chunk = out.envelope(vec![]);
                    chunk["usage"] = usage(&out.generation);
                    last.push(chunk);
                }
                out.ended = true;
                Some((last, out))
            }
            Next::Done(Err(e)) => {
                out.ended = true;
                Some((vec![e.body()], out))
            }
        }
    })
}
