//! `POST /v1/chat/completions`: messages through the model's chat template, with tools, and
//! the output read as the model wrote it: a reasoning model's thinking as `reasoning_content`,
//! tool calls parsed out of the rest (whole, or incrementally while streaming).
//!
//! `tool_choice`: `auto` (the default with tools) parses calls; `none` renders the tools but
//! parses nothing; a named function renders only that tool and, for Hermes markup, opens the
//! assistant's turn with the start of a call to it, so the model continues inside the call, and
//! holds the output to that one call by a grammar (`tool_calls::named_call`, every dialect's
//! markup); `required` holds it to one or more calls (`tool_calls::required_calls`). For a
//! reasoning model, a grammar holds what follows its thinking (`reasoning::after_thinking`).

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
use super::generation::{Generation, Next, Piece};
use super::held_grammar::HeldGrammar;
use super::protocol::{ChatRequest, GenerationParams, check_messages};
use super::respond::{
    ChoiceEvents, CompletionTokens, merge_choices, parse_body, sse_events, start_choices, usage,
};
use super::response_format;
use super::{AppState, logprobs};
use crate::reasoning::{
    Opening, ReasoningDelta, ReasoningFormat, ReasoningStream, Thinking, after_thinking,
    join_deltas,
};
use crate::record::{Arrival, RequestInput};
use crate::text::ChatEnd;
use crate::tool_calls::{
    ParsedCall, ToolCallStream, ToolDelta, ToolFormat, ToolSpec, named_call, parse_complete,
    required_calls,
};

/// How the output's tool calls are read.
#[derive(Clone)]
struct Tools {
    format: ToolFormat,
    specs: Vec<ToolSpec>,
    /// Written at the start of the assistant's turn (a forced call's opening).
    prefix: String,
    /// `required`'s or a named function's: the output is calls.
    grammar: Option<HeldGrammar>,
}

pub(super) async fn handle(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = state.config.recorder.as_ref().map(|r| r.arrived(&headers));
    match prepare(&state, body, arrival).await {
        Ok((generations, params, tools, reasoning)) => {
            let id = format!("chatcmpl-{}", generations[0].request_id().0);
            let span = tracing::info_span!("request", id = %id);
            // One `Output` a choice, each reading its own request.
            let outs: Vec<Output> = generations
                .into_iter()
                .enumerate()
                .map(|(index, generation)| Output {
                    state: state.clone(),
                    params: params.clone(),
                    tools: tools.clone(),
                    id: id.clone(),
                    index,
                    generation,
                    started: false,
                    ended: false,
                    calls: 0,
                    tools_stream: None,
                    reasoning,
                    reasoning_stream: None,
                })
                .collect();
            async move { if params.stream { stream(outs) } else { whole(outs).await } }
                .instrument(span)
                .await
        }
        Err(e) => e.into_response(),
    }
}

async fn prepare(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    arrival: Option<Arrival>,
) -> Result<(Vec<Generation>, GenerationParams, Option<Tools>, Option<Reasoning>), ApiError> {
    let request: ChatRequest = parse_body(state, body)?;
    let invalid = |e: ApiError| {
        state.metrics.rejected_invalid.increment(1);
        e
    };
    check_messages(&request.messages).map_err(invalid)?;
    if request.top_logprobs.is_some() && !request.logprobs {
        return Err(invalid(ApiError::invalid_param(
            "top_logprobs",
            "top_logprobs needs logprobs",
        )));
    }
    let mut grammar =
        response_format::grammar(request.response_format.as_ref()).map_err(invalid)?;
    let logprobs = request.logprobs.then(|| request.top_logprobs.unwrap_or(0));
    let mut params = request
        .common
        .validate(&state.config.model_name, logprobs, state.next_seed())
        .map_err(invalid)?;
    let parallel = request.parallel_tool_calls.unwrap_or(true);
    let (rendered_tools, tools) =
        tools(state, request.tools.as_deref(), request.tool_choice.as_ref(), parallel)
            .map_err(invalid)?;
    if let Some(calls) = tools.as_ref().and_then(|t| t.grammar.clone()) {
        if grammar.is_some() {
            return Err(invalid(ApiError::invalid_param(
                "response_format",
                "response_format and a tool_choice of \"required\" or a function both hold the \
                 output to a grammar: give one",
            )));
        }
        grammar = Some(calls);
    }
    let prefix = tools.as_ref().map_or("", |t| t.prefix.as_str());
    let variables = request.chat_template_kwargs.clone().unwrap_or_default();
    let prompt = state
        .codec
        .encode_chat(
            &request.messages,
            rendered_tools.as_deref(),
            &variables,
            ChatEnd::AssistantTurn(prefix),
        )
        .map_err(|e| {
            let param =
                if variables.is_empty() { "messages" } else { "messages or chat_template_kwargs" };
            invalid(ApiError::invalid_param(param, e))
        })?;
    let reasoning = reasoning(state, &prompt.text, prefix, &mut grammar).map_err(invalid)?;
    // Read after the grammar moved: the model thinks whatever the response shows of it.
    let reasoning = reasoning
        .filter(|_| request.separate_reasoning != Some(false))
        .map(|r| Reasoning { include: request.include_reasoning != Some(false), ..r });
    params.spec.grammar = grammar.map(|held| held.grammar);
    let draft = arrival.map(|a| {
        let ChatRequest {
            messages, tools, tool_choice, response_format, chat_template_kwargs, ..
        } = request;
        a.with_input(RequestInput::Chat {
            messages,
            tools,
            tool_choice,
            response_format,
            chat_template_kwargs,
        })
    });
    let generations = start_choices(state, prompt.tokens, &params, draft).await?;
    Ok((generations, params, tools, reasoning))
}

/// How the output's reasoning is read.
#[derive(Clone, Copy, Debug)]
struct Reasoning {
    format: ReasoningFormat,
    opening: Opening,
    /// Whether the response shows it (`include_reasoning`).
    include: bool,
}

/// How a completion of `prompt` reads its reasoning, when the server reads any; and `grammar`
/// moved after the thinking, where the turn may think. Compiles the grammar the request ends
/// up with, once (`held_grammar`).
fn reasoning(
    state: &AppState,
    prompt: &str,
    prefix: &str,
    grammar: &mut Option<HeldGrammar>,
) -> Result<Option<Reasoning>, ApiError> {
    let Some(format) = state.config.reasoning_format else {
        grammar.as_ref().map_or(Ok(()), |held| held.check(state))?;
        return Ok(None);
    };
    // A turn the server opened with a call (Hermes's named tool, on a server without a grammar
    // compiler) has no thinking.
    let opening = if prefix.is_empty() { format.opening(prompt) } else { Opening::Closed };
    let read = |opening| Some(Reasoning { format, opening, include: true });
    let Some(held) = grammar.as_mut() else { return Ok(read(opening)) };
    let thinking = match opening {
        Opening::Closed => None,
        Opening::Inside => Some(Thinking::Must),
        Opening::ByParser if format.starts_inside() => Some(Thinking::Must),
        Opening::ByParser => Some(Thinking::May),
    };
    let after = thinking.and_then(|thinking| after_thinking(format, thinking, &held.grammar));
    let Some(after) = after else {
        // Held from the first token: what the grammar writes is all answer.
        held.check(state)?;
        return Ok(read(Opening::Closed));
    };
    let compiler = state.codec.grammars().map_err(|e| held.invalid(e))?;
    if let Err(e) = compiler.compile(&after) {
        // The grammar as sent names the client's own schema when it is what the compiler refuses.
        held.check(state)?;
        return Err(held.invalid(format!("after the thinking: {e}")));
    }
    held.grammar = after;
    Ok(read(opening))
}

/// The tools a chat request offering `offered` (and choosing none in particular) renders into
/// its prompt, checked as the request's are (`/tokenize`).
pub(super) fn rendered_tools(
    state: &AppState,
    offered: Option<&[Value]>,
) -> Result<Option<Vec<Value>>, ApiError> {
    tools(state, offered, None, true).map(|(rendered, _)| rendered)
}

/// The tools to render into the prompt, and how to parse calls out of the output (for
/// `required`, with the grammar of the calls).
fn tools(
    state: &AppState,
    offered: Option<&[Value]>,
    choice: Option<&Value>,
    parallel: bool,
) -> Result<(Option<Vec<Value>>, Option<Tools>), ApiError> {
    let Some(offered) = offered.filter(|t| !t.is_empty()) else {
        return match choice {
            None | Some(Value::Null) => Ok((None, None)),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok((None, None)),
            Some(_) => Err(ApiError::invalid_param("tool_choice", "tool_choice needs tools")),
        };
    };
    let specs = offered.iter().enumerate().map(tool_spec).collect::<Result<Vec<_>, _>>()?;
    let mut required = false;
    let named = match choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "auto" => None,
        Some(Value::String(s)) if s == "none" => return Ok((Some(offered.to_vec()), None)),
        Some(Value::String(s)) if s == "required" => {
            required = true;
            None
        }
        Some(v) => Some(
            v.pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "tool_choice",
                        "tool_choice must be \"none\", \"auto\" or {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?,
        ),
    };
    let Some(format) = state.config.tool_format else {
        return Err(ApiError::invalid_param(
            "tools",
            "this model's chat template shows no tool-call format lockstep can parse \
             (start the server with --tool-call-parser)",
        ));
    };
    let Some(name) = named else {
        let grammar = match required {
            true => Some(calls_grammar(state, format, &specs, parallel)?),
            false => None,
        };
        let tools = Tools { format, specs, prefix: String::new(), grammar };
        return Ok((Some(offered.to_vec()), Some(tools)));
    };
    let at = specs.iter().position(|s| s.name == name).ok_or_else(|| {
        ApiError::invalid_param(
            "tool_choice",
            format!("tool_choice names {name:?}, which is not in tools"),
        )
    })?;
    // Hermes's named call is opened in the prompt, so that even a server without a grammar
    // compiler gets the call. Not where the server reads reasoning and can hold the output to a
    // grammar: there the grammar opens the call after the thinking, and the model thinks first.
    let grammar_after_thinking =
        state.config.reasoning_format.is_some() && state.codec.grammars().is_ok();
    let prefix = match format {
        ToolFormat::Hermes if !grammar_after_thinking => {
            format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", Value::from(name))
        }
        _ => String::new(),
    };
    let specs = vec![specs[at].clone()];
    // Where the markup allows, a grammar holds the output to the one call (its arguments to the
    // tool's schema); a server without a compiler relies on the prefix alone.
    let grammar = match (named_call(format, &specs[0], &prefix), state.codec.grammars()) {
        (Some(grammar), Ok(_)) => {
            Some(HeldGrammar::new(grammar, "tool_choice", format!("{name:?}'s parameters")))
        }
        _ => None,
    };
    Ok((Some(vec![offered[at].clone()]), Some(Tools { format, specs, prefix, grammar })))
}

/// `required`'s grammar (a server without a grammar compiler cannot hold the output to calls).
fn calls_grammar(
    state: &AppState,
    format: ToolFormat,
    specs: &[ToolSpec],
    parallel: bool,
) -> Result<HeldGrammar, ApiError> {
    state
        .codec
        .grammars()
        .map_err(|e| ApiError::invalid_param("tool_choice", format!("\"required\": {e}")))?;
    let grammar = required_calls(format, specs, parallel);
    Ok(HeldGrammar::new(grammar, "tool_choice", "\"required\": the tools' schemas".into()))
}

fn tool_spec((i, tool): (usize, &Value)) -> Result<ToolSpec, ApiError> {
    let bad = |what: &str| ApiError::invalid_param("tools", format!("tools[{i}]: {what}"));
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("type must be \"function\""));
    }
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("function must be an object"))?;
    let name = function.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
    let name = name.ok_or_else(|| bad("function.name must be a non-empty string"))?;
    let description = match function.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(bad("function.description must be a string")),
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(bad("function.parameters must be a JSON schema object")),
    };
    Ok(ToolSpec { name: name.to_owned(), description, parameters })
}

struct Output {
    state: Arc<AppState>,
    params: GenerationParams,
    tools: Option<Tools>,
    id: String,
    /// The choice's index among the request's `n`.
    index: usize,
    generation: Generation,
    /// The first chunk (with the role) is out.
    started: bool,
    ended: bool,
    /// Tool calls started in the stream.
    calls: usize,
    /// Parses calls out of the stream as it goes.
    tools_stream: Option<ToolCallStream>,
    /// Set when the server reads a reasoning format: the response carries `reasoning_content`.
    reasoning: Option<Reasoning>,
    /// Splits the stream's reasoning from its content as it goes.
    reasoning_stream: Option<ReasoningStream>,
}

impl Output {
    /// The choice's tokens; of them, once its stream finished, the reasoning ones.
    fn tokens(&self) -> CompletionTokens {
        CompletionTokens {
            generated: self.generation.output_tokens,
            reasoning: self.reasoning_stream.as_ref().map(ReasoningStream::reasoning_tokens),
        }
    }

    fn call_id(&self, index: usize) -> String {
        format!("call_{}_{index}", self.generation.request_id().0)
    }

    fn logprobs(&self, lps: &[TokenLogprobs]) -> Value {
        match self.params.spec.logprobs {
            Some(_) => logprobs::chat(self.state.codec.as_ref(), lps),
            None => Value::Null,
        }
    }

    fn envelope(&self, object: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.state.created(),
            "model": self.state.config.model_name,
            "choices": choices,
        })
    }

    fn chunk(&self, delta: Value, lps: &[TokenLogprobs], finish: Option<&str>) -> Value {
        let choice = json!({
            "index": self.index,
            "delta": delta,
            "logprobs": self.logprobs(lps),
            "finish_reason": finish,
        });
        let mut chunk = self.envelope("chat.completion.chunk", vec![choice]);
        if self.params.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

/// Every choice whole; the first to fail answers for all (the others are dropped, which aborts
/// them).
async fn whole(mut outs: Vec<Output>) -> Response {
    let choices = futures_util::future::try_join_all(outs.iter_mut().map(whole_choice));
    let choices = match choices.await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    let completion_tokens = CompletionTokens::sum(outs.iter().map(Output::tokens));
    let mut body = outs[0].envelope("chat.completion", choices);
    body["usage"] = usage(outs[0].generation.prompt_tokens, completion_tokens);
    Json(body).into_response()
}

/// One choice's message, with its tool calls parsed out.
async fn whole_choice(out: &mut Output) -> Result<Value, ApiError> {
    // Read piece by piece as a stream is, so that the reasoning tokens are counted alike.
    out.reasoning_stream = out.reasoning.map(|r| ReasoningStream::new(r.format, r.opening));
    let mut split = Vec::new();
    let reasoning_stream = &mut out.reasoning_stream;
    let (Piece { text, tokens, logprobs: lps }, finish) = out
        .generation
        .collect_with(|piece| {
            if let Some(stream) = reasoning_stream.as_mut() {
                split.extend(stream.push_tokens(&piece.text, piece.tokens.len() as u32));
            }
        })
        .await?;
    let include = out.reasoning.is_some_and(|r| r.include);
    let (reasoning, text) = match out.reasoning_stream.as_mut() {
        Some(stream) => {
            split.extend(stream.finish());
            let (reasoning, content) = join_deltas(split);
            (Some(reasoning), content)
        }
        None => (None, text),
    };
    let (content, calls) = match &out.tools {
        Some(t) => parse_complete(t.format, &format!("{}{text}", t.prefix), &t.specs).await,
        None => (text, Vec::new()),
    };
    let mut message = json!({ "role": "assistant", "content": content });
    if let Some(reasoning) = reasoning {
        message["reasoning_content"] = Some(reasoning).filter(|r| include && !r.is_empty()).into();
    }
    let finish_reason = if calls.is_empty() {
        finish.as_str()
    } else {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = calls
            .iter()
            .enumerate()
            .map(|(i, c)| call_json(&out.call_id(i), c))
            .collect::<Vec<_>>()
            .into();
        "tool_calls"
    };
    let mut choice = json!({
        "index": out.index,
        "message": message,
        "logprobs": out.logprobs(&lps),
        "finish_reason": finish_reason,
    });
    if out.params.return_token_ids {
        choice["token_ids"] = Value::from(tokens);
    }
    out.ended = true;
    Ok(choice)
}

fn call_json(id: &str, call: &ParsedCall) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": { "name": call.name, "arguments": call.arguments },
    })
}

/// The choices' chunks interleaved as they come (`merge_choices`), each chunk one choice's.
fn stream(outs: Vec<Output>) -> Response {
    let usage_chunk = outs[0].params.include_usage.then(|| {
        (outs[0].envelope("chat.completion.chunk", vec![]), outs[0].generation.prompt_tokens)
    });
    let keep_alive = outs[0].state.config.sse_keep_alive;
    let choices = outs.into_iter().map(|out| futures_util::stream::unfold(out, step).boxed());
    sse_events(merge_choices(choices.collect(), usage_chunk), keep_alive)
}

/// A choice's next events.
async fn step(mut out: Output) -> Option<(ChoiceEvents, Output)> {
    if out.ended {
        return None;
    }
    let mut chunks = Vec::new();
    if !out.started {
        out.started = true;
        out.reasoning_stream = out.reasoning.map(|r| ReasoningStream::new(r.format, r.opening));
        if let Some(tools) = out.tools.as_ref() {
            // A forced call's opening is in the prompt: the parser must see it first.
            let prefix = tools.prefix.clone();
            let mut parser = ToolCallStream::new(tools.format, &tools.specs);
            let deltas = parser.push(&prefix).await.into_iter().map(ChatDelta::Tool).collect();
            out.tools_stream = Some(parser);
            chunks.extend(delta_chunks(&mut out, deltas, &[]));
        }
        chunks.insert(0, out.chunk(json!({"role": "assistant", "content": ""}), &[], None));
        return Some((ChoiceEvents::More(chunks), out));
    }
    let events = match out.generation.next().await {
        Next::Piece(p) => {
            let split = match out.reasoning_stream.as_mut() {
                Some(reasoning) => reasoning.push_tokens(&p.text, p.tokens.len() as u32),
                None => vec![ReasoningDelta::Content(p.text)],
            };
            let deltas = content_deltas(&mut out, split, false).await;
            chunks.extend(delta_chunks(&mut out, deltas, &p.logprobs));
            ChoiceEvents::More(chunks)
        }
        Next::Done(Ok(finish)) => {
            let split = out.reasoning_stream.as_mut().map(|r| r.finish()).unwrap_or_default();
            let deltas = content_deltas(&mut out, split, true).await;
            chunks.extend(delta_chunks(&mut out, deltas, &[]));
            let reason = if out.calls > 0 { "tool_calls" } else { finish.as_str() };
            chunks.push(out.chunk(json!({}), &[], Some(reason)));
            out.ended = true;
            ChoiceEvents::Finished(chunks, out.tokens())
        }
        Next::Done(Err(e)) => {
            out.ended = true;
            ChoiceEvents::Failed(e.body())
        }
    };
    Some((events, out))
}

/// What a stream's chunk carries.
enum ChatDelta {
    Reasoning(String),
    Tool(ToolDelta),
}

/// The stream's next deltas: reasoning as it is, content through the tool-call parser when the
/// request has tools (`finish`: the end of the text, which lets go of what the parser holds).
async fn content_deltas(
    out: &mut Output,
    split: Vec<ReasoningDelta>,
    finish: bool,
) -> Vec<ChatDelta> {
    let mut deltas = Vec::new();
    let include = out.reasoning.is_some_and(|r| r.include);
    for delta in split {
        match (delta, out.tools_stream.as_mut()) {
            (ReasoningDelta::Reasoning(text), _) if include => {
                deltas.push(ChatDelta::Reasoning(text));
            }
            (ReasoningDelta::Reasoning(_), _) => {}
            (ReasoningDelta::Content(text), Some(parser)) => {
                deltas.extend(parser.push(&text).await.into_iter().map(ChatDelta::Tool));
            }
            (ReasoningDelta::Content(text), None) => {
                deltas.push(ChatDelta::Tool(ToolDelta::Content(text)));
            }
        }
    }
    if let (true, Some(parser)) = (finish, out.tools_stream.as_mut()) {
        deltas.extend(parser.finish().await.into_iter().map(ChatDelta::Tool));
    }
    deltas
}

/// One chunk per delta; the piece's log-probabilities ride on the first (or on an empty delta
/// when the text is all held back).
fn delta_chunks(out: &mut Output, deltas: Vec<ChatDelta>, lps: &[TokenLogprobs]) -> Vec<Value> {
    let mut chunks = Vec::new();
    let mut lps = Some(lps).filter(|l| !l.is_empty());
    for delta in deltas {
        let body = match delta {
            ChatDelta::Reasoning(text) if text.is_empty() => continue,
            ChatDelta::Reasoning(text) => json!({ "reasoning_content": text }),
            ChatDelta::Tool(ToolDelta::Content(text)) if text.is_empty() => continue,
            ChatDelta::Tool(ToolDelta::Content(text)) => json!({ "content": text }),
            ChatDelta::Tool(ToolDelta::CallStart { index, name }) => {
                out.calls = out.calls.max(index + 1);
                json!({ "tool_calls": [{
                    "index": index,
                    "id": out.call_id(index),
                    "type": "function",
                    "function": { "name": name, "arguments": "" },
                }]})
            }
            ChatDelta::Tool(ToolDelta::CallArguments { index, fragment }) => {
                json!({ "tool_calls": [{
                    "index": index,
                    "function": { "arguments": fragment },
                }]})
            }
        };
        chunks.push(out.chunk(body, lps.take().unwrap_or(&[]), None));
    }
    if let Some(lps) = lps {
        chunks.push(out.chunk(json!({}), lps, None));
    }
    chunks
}
