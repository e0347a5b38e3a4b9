//! `POST /v1/completions`: a prompt (text or token ids) continued.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use lockstep_core::model::TokenLogprobs;
use serde_json::{Value, json};
use tracing::Instrument;

use super::error::ApiError;
use super::generation::{Finish, Generation, Next, Piece};
use super::protocol::{
    CompletionRequest, GenerationParams, PROMPTS_MAX, Prompt, completion_prompts,
};
use super::respond::{
    ChoiceEvents, CompletionTokens, merge_choices, parse_body, sse_events, start_choices, usage,
};
use super::response_format;
use super::{AppState, logprobs};
use crate::record::{Arrival, RequestInput};

pub(super) async fn handle(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = state.config.recorder.as_ref().map(|r| r.arrived(&headers));
    match prepare(&state, body, arrival).await {
        Ok(prepared) => {
            let id = format!("cmpl-{}", prepared.generations[0].request_id().0);
            let span = tracing::info_span!("request", id = %id);
            respond(state, prepared, id).instrument(span).await
        }
        Err(e) => e.into_response(),
    }
}

async fn prepare(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    arrival: Option<Arrival>,
) -> Result<Prepared, ApiError> {
    let mut request: CompletionRequest = parse_body(state, body)?;
    let invalid = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    if request.suffix.is_some() {
        return Err(invalid(ApiError::invalid_param("suffix", "suffix is not supported")));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(invalid(ApiError::invalid_param("best_of", "only best_of = 1 is supported")));
    }
    // OpenAI's legacy scoring form, as older eval harnesses send it: `echo` with `max_tokens` 0
    // gives the prompt and its log-probabilities and generates nothing. The engine is asked for
    // one token, whose logits the prompt's scoring computes anyway (no decode step), and the
    // choice drops it (`Output::echo_only`).
    let common = &mut request.common;
    let echo_only = request.echo && common.max_completion_tokens.or(common.max_tokens) == Some(0);
    if echo_only {
        (common.max_tokens, common.max_completion_tokens) = (Some(1), None);
    }
    let grammar = response_format::grammar(request.response_format.as_ref()).map_err(invalid)?;
    if let Some(held) = &grammar {
        held.check(state).map_err(invalid)?;
    }
    let mut params = request
        .common
        .validate(&state.config.model_name, request.logprobs, state.next_seed())
        .map_err(invalid)?;
    params.spec.grammar = grammar.map(|held| held.grammar);
    if request.echo {
        // The prompt's tokens are scored with as many alternatives as the output's.
        params.spec.prompt_logprobs = params.spec.logprobs;
    }
    let prompts = completion_prompts(&request.prompt).map_err(invalid)?;
    let completions = prompts.len() * params.choices as usize;
    if prompts.len() > 1 && completions > PROMPTS_MAX {
        return Err(invalid(ApiError::invalid_param(
            "prompt",
            format!(
                "{} prompts × n = {completions} completions; at most {PROMPTS_MAX} a request",
                prompts.len()
            ),
        )));
    }
    // Every prompt encoded before any starts.
    let whole_prompt = (prompts.len() == 1).then(|| request.prompt.clone());
    let mut encoded = Vec::with_capacity(prompts.len());
    let mut echoes = Vec::with_capacity(prompts.len());
    for (prompt, sent) in prompts {
        // `echo` gives the prompt as sent: its text, or its ids' text.
        let (ids, echo) = match prompt {
            Prompt::Ids(ids) => {
                let echo = match request.echo {
                    true => {
                        Some(state.codec.decode(&ids).map_err(|e| invalid(ApiError::invalid(e)))?)
                    }
                    false => None,
                };
                (ids, echo)
            }
            Prompt::Text(text) => {
                let ids = state.codec.encode(&text).map_err(|e| invalid(ApiError::invalid(e)))?;
                (ids, request.echo.then_some(text))
            }
        };
        encoded.push((ids, whole_prompt.clone().unwrap_or(sent)));
        echoes.push(echo);
    }
    let mut generations = Vec::with_capacity(completions);
    let mut prompt_ids = Vec::with_capacity(encoded.len());
    for (i, ((ids, sent), echo)) in encoded.into_iter().zip(echoes).enumerate() {
        // Each prompt is recorded as a request of its own (as sent; a lone prompt exactly as
        // the body had it), the first in the client's session and the others beside it.
        let draft = arrival.as_ref().map(|a| {
            let arrival = if i == 0 { a.clone() } else { a.beside() };
            let response_format = request.response_format.clone();
            arrival.with_input(RequestInput::Completions { prompt: sent, response_format })
        });
        // A later prompt refused (empty, or past the context) drops the generations started,
        // which aborts them: all or none, as for `n`.
        generations.extend(start_choices(state, ids.clone(), &params, draft).await?);
        prompt_ids.push(Prompted { ids, echo });
    }
    Ok(Prepared { generations, params, prompts: prompt_ids, echo_only })
}

/// A request's generations started, one a choice, and what their answers need.
struct Prepared {
    generations: Vec<Generation>,
    params: GenerationParams,
    prompts: Vec<Prompted>,
    /// Only the prompts go out (`echo` with `max_tokens` 0).
    echo_only: bool,
}

/// A prompt as its choices answer it: its ids, and its text when the request asked for `echo`.
#[derive(Clone)]
struct Prompted {
    ids: Vec<u32>,
    echo: Option<String>,
}

/// One `Output` a choice, each reading its own request: choice `p * n + i` is prompt `p`'s
/// completion `i`, as OpenAI numbers them.
async fn respond(state: Arc<AppState>, prepared: Prepared, id: String) -> Response {
    let Prepared { generations, params, prompts, echo_only } = prepared;
    let n = params.choices as usize;
    let several = prompts.len() > 1;
    let outs: Vec<Output> = generations
        .into_iter()
        .enumerate()
        .map(|(index, generation)| Output {
            state: state.clone(),
            params: params.clone(),
            prompt: prompts[index / n].ids.clone(),
            echo: prompts[index / n].echo.clone(),
            echo_only,
            several_prompts: several,
            id: id.clone(),
            index,
            generation,
            text_len: 0,
            ended: false,
        })
        .collect();
    if params.stream { stream(outs) } else { whole(outs).await }
}

struct Output {
    state: Arc<AppState>,
    params: GenerationParams,
    /// This choice's prompt.
    prompt: Vec<u32>,
    /// Its text, until the choice's first content goes out ahead of it (`echo`).
    echo: Option<String>,
    /// The choice is its echoed prompt alone: the one token generated is dropped, and the choice
    /// ends at its length (`max_tokens` 0).
    echo_only: bool,
    /// The request listed several prompts: each choice names its prompt's ids
    /// (`return_token_ids`), not the response.
    several_prompts: bool,
    id: String,
    /// The choice's index among the request's prompts × `n`.
    index: usize,
    generation: Generation,
    /// Bytes of text out so far, for log-probability offsets.
    text_len: usize,
    /// The last events are out: the stream ends.
    ended: bool,
}

impl Output {
    /// A completion reads no reasoning: its tokens are all it counts.
    fn tokens(&self) -> CompletionTokens {
        let generated = if self.echo_only { 0 } else { self.generation.output_tokens };
        CompletionTokens { generated, reasoning: None }
    }

    /// What of the generation goes out: nothing of it when only the prompt does.
    fn shown(&self, piece: Piece) -> Piece {
        match self.echo_only {
            true => Piece::default(),
            false => piece,
        }
    }

    /// Why the choice ended: at its length when only the prompt goes out, whatever ended the
    /// token generated (a stop token, say).
    fn finish(&self, finish: Finish) -> Finish {
        if self.echo_only { Finish::Length } else { finish }
    }

    /// The choice's next content: `text` and the tokens it came from, after the echoed prompt
    /// if it has not gone out yet.
    fn choice(
        &mut self,
        text: &str,
        tokens: &[u32],
        lp: &[TokenLogprobs],
        finish: Option<Finish>,
    ) -> Value {
        let codec = self.state.codec.as_ref();
        let (text, logprobs) = match self.echo.take() {
            Some(prompt) => {
                let logprobs = self.params.spec.logprobs.map(|_| {
                    let scores = &self.generation.prompt_logprobs;
                    logprobs::completion_echoed(codec, &self.prompt, scores, lp, prompt.len())
                });
                (prompt + text, logprobs)
            }
            None => {
                let logprobs = self
                    .params
                    .spec
                    .logprobs
                    .map(|_| logprobs::completion(codec, lp, self.text_len));
                (text.to_owned(), logprobs)
            }
        };
        self.text_len += text.len();
        let mut choice = json!({
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::as_str),
        });
        if self.params.return_token_ids {
            choice["token_ids"] = Value::from(tokens.to_vec());
            if self.several_prompts {
                choice["prompt_token_ids"] = Value::from(self.prompt.clone());
            }
        }
        choice
    }

    /// Prompt tokens the request's usage counts for this choice: its prompt's, once a prompt.
    fn prompt_tokens(&self) -> u32 {
        let first_of_its_prompt = self.index.is_multiple_of(self.params.choices as usize);
        if first_of_its_prompt { self.generation.prompt_tokens } else { 0 }
    }

    fn envelope(&self, choices: Vec<Value>) -> Value {
        let mut body = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.state.created(),
            "model": self.state.config.model_name,
            "choices": choices,
        });
        if self.params.return_token_ids && !self.several_prompts {
            body["prompt_token_ids"] = Value::from(self.prompt.clone());
        }
        body
    }
}

/// Every choice whole; the first to fail answers for all (the others are dropped, which aborts
/// them).
async fn whole(mut outs: Vec<Output>) -> Response {
    let collected =
        futures_util::future::try_join_all(outs.iter_mut().map(|out| out.generation.collect()));
    let results = match collected.await {
        Ok(results) => results,
        Err(e) => return e.into_response(),
    };
    let mut choices = Vec::with_capacity(outs.len());
    for (out, (piece, finish)) in outs.iter_mut().zip(results) {
        let (Piece { text, tokens, logprobs: lps }, finish) =
            (out.shown(piece), out.finish(finish));
        choices.push(out.choice(&text, &tokens, &lps, Some(finish)));
    }
    let completion_tokens = CompletionTokens::sum(outs.iter().map(Output::tokens));
    let prompt_tokens = outs.iter().map(Output::prompt_tokens).sum();
    let mut body = outs[0].envelope(choices);
    body["usage"] = usage(prompt_tokens, completion_tokens);
    Json(body).into_response()
}

/// The choices' chunks interleaved as they come (`merge_choices`), each chunk one choice's.
fn stream(outs: Vec<Output>) -> Response {
    let prompt_tokens = outs.iter().map(Output::prompt_tokens).sum();
    let usage_chunk =
        outs[0].params.include_usage.then(|| (outs[0].envelope(vec![]), prompt_tokens));
    let keep_alive = outs[0].state.config.sse_keep_alive;
    let choices = outs.into_iter().map(|out| futures_util::stream::unfold(out, step).boxed());
    sse_events(merge_choices(choices.collect(), usage_chunk), keep_alive)
}

/// A choice's next events.
async fn step(mut out: Output) -> Option<(ChoiceEvents, Output)> {
    if out.ended {
        return None;
    }
    let next = match out.generation.next().await {
        Next::Piece(p) => Next::Piece(out.shown(p)),
        Next::Done(Ok(finish)) => Next::Done(Ok(out.finish(finish))),
        failed => failed,
    };
    let events = match next {
        Next::Piece(p)
            if p.text.is_empty()
                && p.logprobs.is_empty()
                && !out.params.return_token_ids
                && out.echo.is_none() =>
        {
            ChoiceEvents::More(vec![])
        }
        Next::Piece(p) => {
            let choice = out.choice(&p.text, &p.tokens, &p.logprobs, None);
            let mut chunk = out.envelope(vec![choice]);
            if out.params.include_usage {
                chunk["usage"] = Value::Null;
            }
            ChoiceEvents::More(vec![chunk])
        }
        Next::Done(Ok(finish)) => {
            let choice = out.choice("", &[], &[], Some(finish));
            let mut finished = out.envelope(vec![choice]);
            if out.params.include_usage {
                finished["usage"] = Value::Null;
            }
            out.ended = true;
            ChoiceEvents::Finished(vec![finished], out.tokens())
        }
        Next::Done(Err(e)) => {
            out.ended = true;
            ChoiceEvents::Failed(e.body())
        }
    };
    Some((events, out))
}
