//! `POST /tokenize` and `POST /detokenize`, as vLLM serves them. A prompt's or a chat's tokens
//! are exactly those the generating routes would compute from (clients budget a context by
//! them): a prompt as `/v1/completions` encodes it, messages and tools through the chat template
//! as `/v1/chat/completions` renders them. Nothing reaches the engine.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::AppState;
use super::chat::rendered_tools;
use super::error::ApiError;
use super::protocol::check_messages;
use super::respond::parse_body;
use crate::text::ChatEnd;

#[derive(Debug, Deserialize)]
pub(super) struct TokenizeRequest {
    model: Option<String>,
    /// A completion's prompt, or
    prompt: Option<String>,
    /// a chat's messages (with `tools`, `chat_template_kwargs` and `add_generation_prompt`).
    messages: Option<Vec<Value>>,
    /// The prompt's: whether the tokenizer's BOS is added (default true, as completions add
    /// it). A chat's BOS is the template's, or the tokenizer's where the template writes none,
    /// as for a chat request; the field is refused with messages.
    add_special_tokens: Option<bool>,
    /// Whether the assistant's turn is opened after the messages (default true: the prompt a
    /// chat request is answered from).
    add_generation_prompt: Option<bool>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Option<Map<String, Value>>,
    /// Each token's text too, as the log-probabilities show it.
    #[serde(default)]
    return_token_strs: bool,
}

#[derive(Debug, Deserialize)]
pub(super) struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

pub(super) async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match tokens(&state, body) {
        Ok(tokens) => Json(tokens).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match text(&state, body) {
        Ok(text) => Json(json!({ "prompt": text })).into_response(),
        Err(e) => e.into_response(),
    }
}

fn tokens(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let request: TokenizeRequest = parse_body(state, body)?;
    let invalid = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    check_model(state, request.model.as_deref())?;
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            let chat_only = [
                ("add_generation_prompt", request.add_generation_prompt.is_some()),
                ("tools", request.tools.is_some()),
                ("chat_template_kwargs", request.chat_template_kwargs.is_some()),
            ];
            if let Some((param, _)) = chat_only.into_iter().find(|(_, given)| *given) {
                return Err(invalid(ApiError::invalid_param(param, "applies to messages")));
            }
            let encoded = match request.add_special_tokens.unwrap_or(true) {
                true => state.codec.encode(&prompt),
                false => state.codec.encode_plain(&prompt),
            };
            encoded.map_err(|e| invalid(ApiError::invalid_param("prompt", e)))?
        }
        (None, Some(messages)) => {
            if request.add_special_tokens.is_some() {
                return Err(invalid(ApiError::invalid_param(
                    "add_special_tokens",
                    "applies to prompt: messages are tokenized as /v1/chat/completions \
                     tokenizes them",
                )));
            }
            check_messages(&messages).map_err(invalid)?;
            let tools = rendered_tools(state, request.tools.as_deref()).map_err(invalid)?;
            let variables = request.chat_template_kwargs.unwrap_or_default();
            let end = match request.add_generation_prompt.unwrap_or(true) {
                true => ChatEnd::AssistantTurn(""),
                false => ChatEnd::LastMessage,
            };
            let prompt = state.codec.encode_chat(&messages, tools.as_deref(), &variables, end);
            prompt.map_err(|e| invalid(ApiError::invalid_param("messages", e)))?.tokens
        }
        (Some(_), Some(_)) => {
            return Err(invalid(ApiError::invalid("give prompt or messages, not both")));
        }
        (None, None) => return Err(invalid(ApiError::invalid("give prompt or messages"))),
    };
    let token_strs = request
        .return_token_strs
        .then(|| tokens.iter().map(|&id| state.codec.token_text(id)).collect::<Vec<_>>());
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": state.config.context_tokens,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

fn text(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<String, ApiError> {
    let request: DetokenizeRequest = parse_body(state, body)?;
    check_model(state, request.model.as_deref())?;
    let vocab = state.codec.vocab_size();
    let invalid = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    if let Some(id) = request.tokens.iter().find(|&&id| id >= vocab) {
        return Err(invalid(ApiError::invalid_param(
            "tokens",
            format!("token id {id} is past the vocabulary of {vocab}"),
        )));
    }
    state.codec.decode(&request.tokens).map_err(|e| invalid(ApiError::invalid_param("tokens", e)))
}

/// 404 for a `model` this server does not serve, as the generating routes answer.
fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != state.config.model_name => Err(ApiError::model_not_found(model)),
        _ => Ok(()),
    }
}
