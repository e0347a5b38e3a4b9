//! The OpenAPI 3.0.3 document of what the server accepts and answers, at `/openapi.json`.
//!
//! Request schemas say what `protocol.rs` and the handlers accept, never more: a body the
//! document calls valid is one the server takes, apart from limits no schema can state (the
//! prompt's length in tokens, which depends on the tokenizer, and text that encodes to no token;
//! token ids within the vocabulary; `stream_options` and `top_logprobs` needing `stream` and
//! `logprobs`; a named `tool_choice` being one of `tools`). Where the server's limit
//! is in bytes and JSON Schema's is in characters, the bound is the one that holds for every
//! character (see `STOP_CHARS_MAX`). Unknown fields are ignored, as OpenAI's server does, so
//! every request object allows additional properties. Responses list every status the handlers
//! can produce; `ci/api-conformance.sh` checks the server against this document with
//! schemathesis.

use serde_json::{Map, Value, json};

use super::AppConfig;
use super::auth::OPEN_PATHS;
use super::protocol::{CHOICES_MAX, PROMPTS_MAX, STOP_BYTES_MAX, STOPS_MAX};
use lockstep_core::model::SamplingSpec;
use lockstep_core::wire::{LOGIT_BIAS_MAX, STOP_TOKENS_MAX};

/// Every route the router serves, as (method, path): the document describes exactly these, and
/// the tests check the router answers each of them and no other method on their paths.
pub const ROUTES: [(&str, &str); 8] = [
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
];

/// A stop string may have `STOP_BYTES_MAX` bytes of UTF-8; JSON Schema counts characters, and
/// one character takes up to 4 bytes. So the document promises a quarter of the bytes in
/// characters: every string it calls valid is one the server takes (longer ASCII strings are
/// taken too).
const STOP_CHARS_MAX: usize = STOP_BYTES_MAX / 4;
const _: () = assert!(STOP_CHARS_MAX * 4 <= STOP_BYTES_MAX && STOP_CHARS_MAX > 0);

pub fn document(config: &AppConfig) -> Value {
    let mut schemas = request_schemas(config);
    schemas.extend(response_schemas());
    let mut document = json!({
        "openapi": "3.0.3",
        "info": {
            "title": "lockstep",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "An OpenAI-compatible API. Unknown request fields are ignored; fields \
                OpenAI defines that lockstep does not implement are refused with a 400 when they \
                ask for something.",
        },
        "x-model": config.model_name,
        "paths": paths(&config.model_name),
        "components": { "schemas": schemas },
    });
    if config.api_key.is_some() {
        require_key(&mut document);
    }
    document
}

/// With `--api-key`: the bearer scheme on every operation but the open paths', each of those
/// others answering 401 without the key.
fn require_key(document: &mut Value) {
    document["components"]["securitySchemes"] =
        json!({ "apiKey": { "type": "http", "scheme": "bearer" } });
    document["security"] = json!([{ "apiKey": [] }]);
    let Some(paths) = document["paths"].as_object_mut() else { return };
    for (path, operations) in paths.iter_mut() {
        let Some(operations) = operations.as_object_mut() else { continue };
        for operation in operations.values_mut() {
            if OPEN_PATHS.contains(&path.as_str()) {
                operation["security"] = json!([]);
            } else {
                let mut unauthorized = error_response(
                    "no `Authorization: Bearer KEY` with the server's API key (code \
                     `invalid_api_key`)",
                    false,
                );
                unauthorized["headers"] = json!({ "WWW-Authenticate": {
                    "description": "the scheme to authenticate with",
                    "required": true,
                    "schema": { "type": "string", "enum": ["Bearer"] },
                }});
                operation["responses"]["401"] = unauthorized;
            }
        }
    }
}

fn paths(model: &str) -> Value {
    let completion = Generate {
        id: "createCompletion",
        summary: "Continues a prompt (text or token ids).",
        request: "CompletionRequest",
        response: "CompletionResponse",
        chunk: "CompletionChunk",
        example: json!({ "model": model, "prompt": "Once upon a time", "max_tokens": 8 }),
    };
    let chat = Generate {
        id: "createChatCompletion",
        summary: "Answers chat messages through the model's chat template, with tools.",
        request: "ChatCompletionRequest",
        response: "ChatCompletionResponse",
        chunk: "ChatCompletionChunk",
        example: json!({
            "model": model,
            "messages": [{ "role": "user", "content": "Hello!" }],
            "max_tokens": 8,
        }),
    };
    json!({
        "/v1/completions": { "post": completion.operation() },
        "/v1/chat/completions": { "post": chat.operation() },
        "/v1/models": { "get": {
            "operationId": "listModels",
            "summary": "The one model this server serves.",
            "responses": { "200": json_response("the model", reference("ModelList")) },
        }},
        "/tokenize": { "post": {
            "operationId": "tokenize",
            "summary": "The tokens a prompt or a chat would be computed from, as the generating \
                        routes encode and render them (vLLM's route).",
            "requestBody": {
                "required": true,
                "content": { "application/json": {
                    "schema": {
                        "oneOf": [
                            reference("TokenizePromptRequest"),
                            reference("TokenizeChatRequest"),
                        ],
                    },
                    "example": { "model": model, "prompt": "Once upon a time" },
                }},
            },
            "responses": {
                "200": json_response("the tokens", reference("TokenizeResponse")),
                "400": error_response(
                    "the body is not JSON of this shape, gives both prompt and messages or \
                     neither, gives a chat's field with a prompt (or add_special_tokens with \
                     messages), or the chat template refuses the messages",
                    false,
                ),
                "404": error_response(
                    "`model` names a model this server does not serve (code `model_not_found`)",
                    false,
                ),
                "413": error_response("the body is larger than the server's limit", false),
            },
        }},
        "/detokenize": { "post": {
            "operationId": "detokenize",
            "summary": "The text of token ids, special tokens left out (vLLM's route).",
            "requestBody": {
                "required": true,
                "content": { "application/json": {
                    "schema": reference("DetokenizeRequest"),
                    "example": { "model": model, "tokens": [1, 2, 3] },
                }},
            },
            "responses": {
                "200": json_response("the text", reference("DetokenizeResponse")),
                "400": error_response(
                    "the body is not JSON of this shape, or a token id is past the vocabulary",
                    false,
                ),
                "404": error_response(
                    "`model` names a model this server does not serve (code `model_not_found`)",
                    false,
                ),
                "413": error_response("the body is larger than the server's limit", false),
            },
        }},
        "/health": { "get": {
            "operationId": "health",
            "summary": "Whether the engine runs and makes progress.",
            "responses": {
                "200": json_response("the engine runs", reference("Health")),
                "503": json_response(
                    "the engine stopped, is draining, or has held work without completing a \
                     step for longer than the stall limit",
                    reference("Health"),
                ),
            },
        }},
        "/metrics": { "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics, text exposition format 0.0.4.",
            "responses": { "200": {
                "description": "the metrics",
                "content": { "text/plain": { "schema": { "type": "string" } } },
            }},
        }},
        "/openapi.json": { "get": {
            "operationId": "openapi",
            "summary": "This document.",
            "responses": { "200": json_response("the document", json!({ "type": "object" })) },
        }},
    })
}

/// One generating operation: a JSON answer, or server-sent events when `stream` is true, and
/// every error the handlers produce.
struct Generate {
    id: &'static str,
    summary: &'static str,
    request: &'static str,
    response: &'static str,
    chunk: &'static str,
    /// A request the server answers with a 200.
    example: Value,
}

impl Generate {
    fn operation(&self) -> Value {
        let events = format!(
            "When `stream` is true: server-sent events, each `data: <json>` a {} (see \
             components), a last chunk with only `usage` when `stream_options.include_usage`, \
             an Error object if the request fails after the answer began, then `data: [DONE]`.",
            self.chunk
        );
        json!({
            "operationId": self.id,
            "summary": self.summary,
            "requestBody": {
                "required": true,
                "content": { "application/json": {
                    "schema": reference(self.request),
                    "example": self.example,
                }},
            },
            "responses": {
                "200": {
                    "description": "the output",
                    "content": {
                        "application/json": { "schema": reference(self.response) },
                        "text/event-stream": { "schema": event(&events) },
                    },
                },
                "400": error_response(
                    "the body is not JSON of this shape, a value is out of range, the prompt \
                     is empty or does not fit the context, or a field asks for something not \
                     supported",
                    false,
                ),
                "404": error_response(
                    "`model` names a model this server does not serve (code `model_not_found`)",
                    false,
                ),
                "413": error_response("the body is larger than the server's limit", false),
                "429": error_response(
                    "the server is at capacity (code `rate_limit_exceeded`)",
                    true,
                ),
                "500": error_response("the engine failed while computing the request", false),
                "503": error_response(
                    "the server is shutting down, the engine did not answer in time, or the \
                     request waited in the queue or ran past the time limit",
                    true,
                ),
            },
        })
    }
}

/// One server-sent event as OpenAPI 3.0 describes an event stream's schema: the event's fields.
/// Its data is JSON text (3.0 has no keyword to give that text a schema; the chunk schemas are in
/// the components, and `ci/openai_client_test.py` checks streamed chunks against them).
fn event(description: &str) -> Value {
    let mut schema = closed(
        &["data"],
        json!({
            "data": { "type": "string", "pattern": "^(\\[DONE\\]|\\{.*\\})$" },
            "event": { "type": "string", "enum": ["message"] },
        }),
    );
    schema["description"] = Value::from(description);
    schema
}

fn reference(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn json_response(description: &str, schema: Value) -> Value {
    json!({ "description": description, "content": { "application/json": { "schema": schema } } })
}

/// An error answer; 429 and 503 from the generating routes always say when to retry.
fn error_response(description: &str, retry_after: bool) -> Value {
    let mut response = json_response(description, reference("Error"));
    if retry_after {
        response["headers"] = json!({ "Retry-After": {
            "description": "seconds to wait before retrying",
            "required": true,
            "schema": { "type": "integer", "minimum": 0 },
        }});
    }
    response
}

fn object(required: &[&str], properties: Value) -> Value {
    let mut schema = json!({
        "type": "object",
        "properties": properties,
        "additionalProperties": true,
    });
    // OpenAPI 3.0's `required` must name at least one property.
    if !required.is_empty() {
        schema["required"] = json!(required);
    }
    schema
}

/// `{"type": …}` that may also be null: every `Option` field of `protocol.rs` takes null.
fn nullable(mut schema: Value) -> Value {
    schema["nullable"] = Value::Bool(true);
    schema
}

fn described(mut schema: Value, description: &str) -> Value {
    schema["description"] = Value::from(description);
    schema
}

fn integer(minimum: i64, maximum: i64) -> Value {
    json!({ "type": "integer", "minimum": minimum, "maximum": maximum })
}

fn request_schemas(config: &AppConfig) -> Map<String, Value> {
    let common = common_properties(config);
    let with_common = |mut properties: Value| {
        if let (Some(all), Value::Object(shared)) = (properties.as_object_mut(), &common) {
            all.extend(shared.clone());
        }
        properties
    };
    let mut completion_fields = with_common(completion_properties(config));
    // Completions take 0 too, with `echo`: the prompt scored and nothing generated.
    let max_tokens = &mut completion_fields["max_tokens"];
    max_tokens["minimum"] = Value::from(0);
    max_tokens["description"] = Value::from(
        "output tokens at most; prompt plus output must fit the context (default: all the \
         context leaves); 0 only with `echo`: the prompt and its log-probabilities alone",
    );
    let completion = object(&["prompt"], completion_fields);
    let chat = object(&["messages"], with_common(chat_properties(config)));
    let mut schemas = Map::new();
    schemas.insert("CompletionRequest".into(), completion);
    schemas.insert("ChatCompletionRequest".into(), chat);
    let (tokenize_prompt, tokenize_chat) = tokenize_requests(config);
    schemas.insert("TokenizePromptRequest".into(), tokenize_prompt);
    schemas.insert("TokenizeChatRequest".into(), tokenize_chat);
    schemas.insert(
        "DetokenizeRequest".into(),
        object(
            &["tokens"],
            json!({
                "model": common_properties(config)["model"].clone(),
                "tokens": described(token_ids(), "token ids, each below the vocabulary's size"),
            }),
        ),
    );
    schemas.insert("Message".into(), message());
    schemas.insert("TextPart".into(), text_part());
    schemas.insert("Tool".into(), tool());
    schemas.insert("ToolCall".into(), tool_call());
    schemas
}

/// The fields of `protocol::CommonRequest`.
fn common_properties(config: &AppConfig) -> Value {
    // The prompt has at least one token, so more than `context - 1` output tokens never fit.
    let output_max = i64::from(config.context_tokens.saturating_sub(1).max(1));
    let max_tokens = nullable(json!({
        "type": "integer", "minimum": 1, "maximum": output_max,
        "description": "output tokens at most; prompt plus output must fit the context \
                        (default: all the context leaves)",
    }));
    let stop_string = json!({ "type": "string", "maxLength": STOP_CHARS_MAX });
    let penalty = |what: &str| {
        nullable(json!({
            "type": "number", "minimum": -2, "maximum": 2, "default": 0,
            "description": format!(
                "subtracted from the logit of each token already in the output {what}"
            ),
        }))
    };
    json!({
        "model": nullable(json!({
            "type": "string", "enum": [config.model_name],
            "description": "the served model's name; any other gets a 404",
        })),
        "max_tokens": max_tokens.clone(),
        "max_completion_tokens": max_tokens,
        "temperature": nullable(json!({ "type": "number", "minimum": 0, "maximum": 2 })),
        "top_p": nullable(json!({
            "type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": 1,
        })),
        "top_k": nullable(json!({
            "type": "integer", "format": "int64", "minimum": -1, "maximum": i64::MAX,
            "description": "vLLM's extension: -1 or 0 keep every token",
        })),
        "seed": nullable(json!({
            "type": "integer", "format": "int64", "minimum": i64::MIN, "maximum": i64::MAX,
        })),
        "stop": {
            "oneOf": [
                stop_string,
                { "type": "array", "maxItems": STOPS_MAX, "items": stop_string },
            ],
            "nullable": true,
            "description": format!(
                "at most {STOPS_MAX} strings of at most {STOP_BYTES_MAX} bytes of UTF-8 each \
                 (the schema bounds characters at {STOP_CHARS_MAX}, which holds for any text)"
            ),
        },
        "stop_token_ids": described(
            nullable(json!({
                "type": "array", "maxItems": STOP_TOKENS_MAX,
                "items": { "type": "integer", "minimum": 0 },
            })),
            "vLLM's: token ids that end the output; their text is left out",
        ),
        "n": described(
            nullable(json!({ "type": "integer", "minimum": 1, "maximum": CHOICES_MAX })),
            "completions of the prompt, each its own request (choice i samples with seed + i)",
        ),
        "stream": { "type": "boolean", "default": false },
        "stream_options": described(
            nullable(object(&[], json!({
                "include_usage": { "type": "boolean", "default": false },
            }))),
            "only with `stream`: true",
        ),
        "min_p": described(
            nullable(json!({ "type": "number", "minimum": 0, "maximum": 1, "default": 0 })),
            "vLLM's: candidates below this share of the most likely one's probability are cut",
        ),
        "repetition_penalty": described(
            nullable(json!({
                "type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": 2,
                "default": 1,
            })),
            "vLLM's: the logit of a token of the prompt or the output so far is divided by it if \
             positive, multiplied if not",
        ),
        "presence_penalty": penalty("once"),
        "frequency_penalty": penalty("per occurrence"),
        "logit_bias": nullable(json!({
            "type": "object", "maxProperties": LOGIT_BIAS_MAX,
            "additionalProperties": { "type": "number", "minimum": -100, "maximum": 100 },
            "description": "token ids (decimal keys, each in the vocabulary) to a bias added to \
                            their logits before sampling",
        })),
        "ignore_eos": { "type": "boolean", "default": false },
        "return_token_ids": { "type": "boolean", "default": false },
        "priority": nullable(match config.priority_scheduling {
            true => described(
                integer(i64::from(i32::MIN), i64::from(i32::MAX)),
                "lower is admitted first (then earlier arrival) and preempted last",
            ),
            false => described(
                json!({ "type": "integer", "enum": [0] }),
                "this server takes requests in arrival order (--scheduling-policy fcfs)",
            ),
        }),
    })
}

fn completion_properties(config: &AppConfig) -> Value {
    let ids_max = config.context_tokens.saturating_sub(1).max(1);
    let ids = json!({
        "type": "array", "minItems": 1, "maxItems": ids_max,
        "items": { "type": "integer", "minimum": 0, "maximum": u32::MAX },
        "description": "token ids, each within the model's vocabulary",
    });
    let text = json!({ "type": "string", "minLength": 1 });
    json!({
        "prompt": {
            "oneOf": [
                text,
                ids,
                { "type": "array", "minItems": 1, "maxItems": PROMPTS_MAX, "items": text },
                { "type": "array", "minItems": 1, "maxItems": PROMPTS_MAX, "items": ids },
            ],
            "description": format!(
                "text, token ids, or a list of either kind: each prompt its `n` completions, \
                 choice `p * n + i` being prompt `p`'s `i`-th; with several prompts, {PROMPTS_MAX} \
                 completions at most"
            ),
        },
        "logprobs": nullable(integer(0, i64::from(SamplingSpec::TOP_LOGPROBS_MAX))),
        "echo": {
            "type": "boolean",
            "default": false,
            "description": "the prompt ahead of each choice's text; with `logprobs`, its tokens' \
                            log-probabilities ahead of the output's (the first token's null), as \
                            lm-eval-harness reads them",
        },
        "suffix": { "nullable": true, "enum": [null], "description": "not supported" },
        "best_of": nullable(integer(1, 1)),
    })
}

/// The fields of `protocol::ChatRequest`. Tools are refused when the server parses no tool-call
/// format: then the document allows none, and a `tool_choice` only of "none" or "auto".
fn chat_properties(config: &AppConfig) -> Value {
    let named = object(
        &["type", "function"],
        json!({
            "type": { "type": "string", "enum": ["function"] },
            "function": object(&["name"], json!({ "name": { "type": "string" } })),
        }),
    );
    let choice_words = json!({ "type": "string", "enum": ["none", "auto"] });
    let (tools, tool_choice) = match config.tool_format {
        Some(format) => {
            // "required" is a grammar of calls, written for every markup we parse.
            let words = json!({ "type": "string", "enum": ["none", "auto", "required"] });
            (
                json!({ "type": "array", "items": reference("Tool") }),
                json!({
                    "oneOf": [words, named],
                    "nullable": true,
                    "description": format!(
                        "\"required\" holds the output to calls of `tools` in {} markup by a \
                         grammar; a named function must be one of `tools`",
                        format.name()
                    ),
                }),
            )
        }
        None => (
            json!({
                "type": "array", "maxItems": 0,
                "description": "this model's template shows no tool-call format lockstep \
                                parses (start the server with --tool-call-parser)",
            }),
            nullable(choice_words),
        ),
    };
    json!({
        "messages": { "type": "array", "minItems": 1, "items": reference("Message") },
        "logprobs": { "type": "boolean", "default": false },
        "top_logprobs": nullable(json!({
            "type": "integer", "minimum": 0, "maximum": SamplingSpec::TOP_LOGPROBS_MAX,
            "description": "only with `logprobs`: true",
        })),
        "tools": nullable(tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": {
            "type": "boolean", "nullable": true, "default": true,
            "description": "false holds a \"required\" reply to one call",
        },
        "include_reasoning": {
            "type": "boolean", "nullable": true, "default": true,
            "description": "false leaves reasoning_content out (the reasoning is still not \
                content, and still counted in usage); on a server that reads reasoning",
        },
        "separate_reasoning": {
            "type": "boolean", "nullable": true, "default": true,
            "description": "false keeps a thinking model's reasoning in the content, markers \
                and all, as a server without a reasoning parser returns it",
        },
        "chat_template_kwargs": nullable(json!({
            "type": "object",
            "description": "further variables for the model's chat template (Qwen 3's \
                enable_thinking, DeepSeek V3.1's thinking); not the ones the server sets",
            "properties": lockstep_gpu::chat::RESERVED_VARIABLES
                .iter()
                .map(|name| (name.to_string(), json!({ "not": {} })))
                .collect::<Map<String, Value>>(),
        })),
        "response_format": nullable(json!({
            "type": "object",
            "required": ["type"],
            "description": "json_object and json_schema hold the output to JSON (llguidance \
                over the model's vocabulary); a schema it cannot enforce, or a server whose \
                vocabulary is synthetic, is a 400",
            "properties": {
                "type": { "type": "string", "enum": ["text", "json_object", "json_schema"] },
                "json_schema": object(&["schema"], json!({
                    "name": { "type": "string" },
                    "schema": { "type": "object" },
                    "strict": { "type": "boolean" },
                })),
            },
        })),
    })
}

/// `/tokenize`'s two bodies: a prompt, or a chat (its messages, tools and template variables as
/// a chat request's).
fn tokenize_requests(config: &AppConfig) -> (Value, Value) {
    let model = common_properties(config)["model"].clone();
    let flag = |default: bool, description: &str| {
        json!({ "type": "boolean", "nullable": true, "default": default,
                "description": description })
    };
    let return_token_strs = flag(false, "each token's text too, as the log-probabilities show it");
    let prompt = object(
        &["prompt"],
        json!({
            "model": model,
            "prompt": { "type": "string" },
            "add_special_tokens": flag(true, "the tokenizer's BOS first, as completions have it"),
            "return_token_strs": return_token_strs,
        }),
    );
    let chat_fields = chat_properties(config);
    let chat = object(
        &["messages"],
        json!({
            "model": model,
            "messages": chat_fields["messages"].clone(),
            "tools": chat_fields["tools"].clone(),
            "chat_template_kwargs": chat_fields["chat_template_kwargs"].clone(),
            "add_generation_prompt": flag(true, "the assistant's turn opened after the messages"),
            "return_token_strs": return_token_strs,
        }),
    );
    (prompt, chat)
}

fn message() -> Value {
    object(
        &["role"],
        json!({
            "role": {
                "type": "string",
                "enum": ["system", "developer", "user", "assistant", "tool"],
            },
            "content": {
                "oneOf": [
                    { "type": "string" },
                    { "type": "array", "items": reference("TextPart") },
                ],
                "nullable": true,
            },
            "name": { "type": "string" },
            "tool_calls": { "type": "array", "items": reference("ToolCall") },
            "tool_call_id": { "type": "string" },
        }),
    )
}

fn text_part() -> Value {
    object(
        &["type", "text"],
        json!({
            "type": { "type": "string", "enum": ["text"] },
            "text": { "type": "string" },
        }),
    )
}

fn tool() -> Value {
    object(
        &["type", "function"],
        json!({
            "type": { "type": "string", "enum": ["function"] },
            "function": object(&["name"], json!({
                "name": { "type": "string", "minLength": 1 },
                "description": nullable(json!({ "type": "string" })),
                "parameters": nullable(json!({
                    "type": "object", "description": "a JSON schema of the arguments",
                })),
            })),
        }),
    )
}

fn tool_call() -> Value {
    object(
        &["id", "type", "function"],
        json!({
            "id": { "type": "string" },
            "type": { "type": "string", "enum": ["function"] },
            "function": object(&["name", "arguments"], json!({
                "name": { "type": "string" },
                "arguments": { "type": "string", "description": "JSON text" },
            })),
        }),
    )
}

/// What the server writes; closed where the handlers write a fixed set of fields, so the
/// conformance run catches a stray one.
fn response_schemas() -> Map<String, Value> {
    let mut schemas = Map::new();
    let mut add = |name: &str, schema: Value| {
        schemas.insert(name.to_owned(), schema);
    };
    add("Error", error());
    add(
        "Usage",
        closed(
            &["prompt_tokens", "completion_tokens", "total_tokens"],
            json!({
                "prompt_tokens": { "type": "integer", "minimum": 0 },
                "completion_tokens": { "type": "integer", "minimum": 0 },
                "total_tokens": { "type": "integer", "minimum": 0 },
                "completion_tokens_details": closed(
                    &["reasoning_tokens"],
                    json!({
                        "reasoning_tokens": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Of the completion tokens, those wholly inside a \
                                reasoning model's thinking (its markers not counted); on chat \
                                completions from a server that reads reasoning \
                                (`--reasoning-parser`).",
                        },
                    }),
                ),
            }),
        ),
    );
    add("CompletionResponse", completion_response(false));
    add("CompletionChunk", completion_response(true));
    add("CompletionLogprobs", completion_logprobs());
    add("ChatCompletionResponse", chat_response());
    add("ChatCompletionChunk", chat_chunk());
    add("ChatLogprobs", chat_logprobs());
    add("ModelList", model_list());
    add(
        "TokenizeResponse",
        closed(
            &["count", "max_model_len", "tokens", "token_strs"],
            json!({
                "count": { "type": "integer", "minimum": 0 },
                "max_model_len": { "type": "integer", "minimum": 1 },
                "tokens": token_ids(),
                "token_strs": nullable(json!({ "type": "array", "items": { "type": "string" } })),
            }),
        ),
    );
    add("DetokenizeResponse", closed(&["prompt"], json!({ "prompt": { "type": "string" } })));
    add(
        "Health",
        closed(
            &["status", "requests_held", "stalled_seconds"],
            json!({
                "status": { "type": "string", "enum": ["ok", "stopped", "draining", "stalled"] },
                "requests_held": { "type": "integer", "minimum": 0 },
                "stalled_seconds": { "type": "number", "minimum": 0 },
            }),
        ),
    );
    schemas
}

fn closed(required: &[&str], properties: Value) -> Value {
    let mut schema = object(required, properties);
    schema["additionalProperties"] = Value::Bool(false);
    schema
}

fn error() -> Value {
    closed(
        &["error"],
        json!({ "error": closed(&["message", "type", "param", "code"], json!({
            "message": { "type": "string" },
            "type": { "type": "string" },
            "param": nullable(json!({ "type": "string" })),
            "code": nullable(json!({ "type": "string" })),
        }))}),
    )
}

fn token_ids() -> Value {
    json!({ "type": "array", "items": { "type": "integer", "minimum": 0 } })
}

/// The answer (a choice each of `n`), or (`chunk`) one streamed event of one choice: then
/// `finish_reason` is null until that choice's last chunk, `usage` is null (with `include_usage`) or absent, and the usage-only chunk has no
/// choices.
fn completion_response(chunk: bool) -> Value {
    let finish = json!({ "type": "string", "enum": ["stop", "length"] });
    let choice = closed(
        &["index", "text", "logprobs", "finish_reason"],
        json!({
            "index": { "type": "integer", "minimum": 0, "maximum": PROMPTS_MAX - 1 },
            "text": { "type": "string" },
            "logprobs": nullable(reference_object("CompletionLogprobs")),
            "finish_reason": if chunk { nullable(finish) } else { finish },
            "token_ids": token_ids(),
            "prompt_token_ids": described(
                token_ids(),
                "with return_token_ids and several prompts: this choice's prompt",
            ),
        }),
    );
    let choices = if chunk {
        json!({ "type": "array", "maxItems": 1, "items": choice })
    } else {
        json!({ "type": "array", "minItems": 1, "maxItems": PROMPTS_MAX, "items": choice })
    };
    let required: &[&str] = if chunk {
        &["id", "object", "created", "model", "choices"]
    } else {
        &["id", "object", "created", "model", "choices", "usage"]
    };
    closed(
        required,
        json!({
            "id": { "type": "string" },
            "object": { "type": "string", "enum": ["text_completion"] },
            "created": { "type": "integer", "minimum": 0 },
            "model": { "type": "string" },
            "choices": choices,
            "usage": if chunk { nullable(reference_object("Usage")) } else { reference("Usage") },
            "prompt_token_ids": token_ids(),
        }),
    )
}

/// A nullable reference: OpenAPI 3.0 ignores siblings of `$ref`, so it goes inside `allOf`.
fn reference_object(name: &str) -> Value {
    json!({ "type": "object", "allOf": [reference(name)] })
}

fn completion_logprobs() -> Value {
    let list = |items: Value| json!({ "type": "array", "items": items });
    closed(
        &["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        json!({
            "tokens": list(json!({ "type": "string" })),
            // Null for an echoed prompt's first token, which nothing scores.
            "token_logprobs": list(nullable(json!({ "type": "number", "maximum": 0 }))),
            "top_logprobs": list(nullable(json!({
                "type": "object",
                "additionalProperties": { "type": "number", "maximum": 0 },
            }))),
            "text_offset": list(json!({ "type": "integer", "minimum": 0 })),
        }),
    )
}

fn chat_response() -> Value {
    let message = closed(
        &["role", "content"],
        json!({
            "role": { "type": "string", "enum": ["assistant"] },
            "content": nullable(json!({ "type": "string" })),
            "reasoning_content": nullable(json!({
                "type": "string",
                "description": "a reasoning model's thinking (servers that read reasoning only)",
            })),
            "tool_calls": { "type": "array", "items": reference("ToolCall") },
        }),
    );
    let choice = closed(
        &["index", "message", "logprobs", "finish_reason"],
        json!({
            "index": { "type": "integer", "minimum": 0, "maximum": CHOICES_MAX - 1 },
            "message": message,
            "logprobs": nullable(reference_object("ChatLogprobs")),
            "finish_reason": { "type": "string", "enum": ["stop", "length", "tool_calls"] },
            "token_ids": token_ids(),
        }),
    );
    closed(
        &["id", "object", "created", "model", "choices", "usage"],
        json!({
            "id": { "type": "string" },
            "object": { "type": "string", "enum": ["chat.completion"] },
            "created": { "type": "integer", "minimum": 0 },
            "model": { "type": "string" },
            "choices": { "type": "array", "minItems": 1, "maxItems": CHOICES_MAX, "items": choice },
            "usage": reference("Usage"),
        }),
    )
}

/// One streamed chat event: the first delta has the role, tool calls come as fragments with
/// their index, and the usage-only chunk (with `include_usage`) has no choices.
fn chat_chunk() -> Value {
    let call = object(
        &["index"],
        json!({
            "index": { "type": "integer", "minimum": 0 },
            "id": { "type": "string" },
            "type": { "type": "string", "enum": ["function"] },
            "function": object(&[], json!({
                "name": { "type": "string" },
                "arguments": { "type": "string" },
            })),
        }),
    );
    let delta = closed(
        &[],
        json!({
            "role": { "type": "string", "enum": ["assistant"] },
            "content": { "type": "string" },
            "reasoning_content": { "type": "string" },
            "tool_calls": { "type": "array", "items": call },
        }),
    );
    let choice = closed(
        &["index", "delta", "logprobs", "finish_reason"],
        json!({
            "index": { "type": "integer", "minimum": 0, "maximum": CHOICES_MAX - 1 },
            "delta": delta,
            "logprobs": nullable(reference_object("ChatLogprobs")),
            "finish_reason": nullable(json!({
                "type": "string", "enum": ["stop", "length", "tool_calls"],
            })),
        }),
    );
    closed(
        &["id", "object", "created", "model", "choices"],
        json!({
            "id": { "type": "string" },
            "object": { "type": "string", "enum": ["chat.completion.chunk"] },
            "created": { "type": "integer", "minimum": 0 },
            "model": { "type": "string" },
            "choices": { "type": "array", "maxItems": 1, "items": choice },
            "usage": nullable(reference_object("Usage")),
        }),
    )
}

/// Chat log-probabilities: per output token, its own and the most likely alternatives'.
fn chat_logprobs() -> Value {
    let mut entry = logprob_entry();
    entry["properties"]["top_logprobs"] = json!({ "type": "array", "items": logprob_entry() });
    entry["required"] = json!(["token", "logprob", "bytes", "top_logprobs"]);
    closed(&["content"], json!({ "content": { "type": "array", "items": entry } }))
}

fn logprob_entry() -> Value {
    closed(
        &["token", "logprob", "bytes"],
        json!({
            "token": { "type": "string" },
            "logprob": { "type": "number", "maximum": 0 },
            "bytes": { "type": "array", "items": { "type": "integer", "minimum": 0, "maximum": 255 } },
        }),
    )
}

fn model_list() -> Value {
    let model = closed(
        &["id", "object", "created", "owned_by", "max_model_len"],
        json!({
            "id": { "type": "string" },
            "object": { "type": "string", "enum": ["model"] },
            "created": { "type": "integer", "minimum": 0 },
            "owned_by": { "type": "string" },
            "max_model_len": { "type": "integer", "minimum": 1 },
        }),
    );
    closed(
        &["object", "data"],
        json!({
            "object": { "type": "string", "enum": ["list"] },
            "data": { "type": "array", "minItems": 1, "maxItems": 1, "items": model },
        }),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    use hyper::Method;
    use lockstep_core::kv::PoolConfig;
    use lockstep_core::model::ProvenanceModel;
    use lockstep_core::sched::{SchedConfig, StepMode};
    use serde_json::{Value, json};

    use super::super::protocol::{CommonRequest, Stop};
    use super::*;
    use crate::client::Connection;
    use crate::engine::{EngineConfig, InlineRunner, StepCost};
    use crate::text::SyntheticCodec;

    const CONTEXT: u32 = 256;

    fn config() -> AppConfig {
        AppConfig::new("test-model", CONTEXT)
    }

    /// Every `$ref` resolves, every `required` names a property, and no JSON Schema keyword of
    /// OpenAPI 3.1 (type lists, `const`, numeric exclusive bounds) slipped into a 3.0 document.
    fn check_schema_tree(doc: &Value, at: &str, value: &Value, errors: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    let here = format!("{at}/{key}");
                    let ok = match (key.as_str(), v) {
                        ("$ref", Value::String(r)) => {
                            r.strip_prefix('#').and_then(|p| doc.pointer(p)).is_some()
                        }
                        ("type", Value::String(t)) => {
                            ["object", "array", "string", "integer", "number", "boolean"]
                                .contains(&t.as_str())
                        }
                        ("type", Value::Array(_)) => false,
                        ("const" | "prefixItems" | "$defs", _) => false,
                        ("exclusiveMinimum" | "exclusiveMaximum" | "nullable", v) => v.is_boolean(),
                        ("required", Value::Array(names)) if map.contains_key("properties") => {
                            !names.is_empty()
                                && names.iter().all(|n| {
                                    n.as_str().is_some_and(|n| map["properties"].get(n).is_some())
                                })
                        }
                        _ => true,
                    };
                    if !ok {
                        errors.push(here.clone());
                    }
                    check_schema_tree(doc, &here, v, errors);
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    check_schema_tree(doc, &format!("{at}/{i}"), v, errors);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_document_is_an_openapi_3_0_object_with_exactly_the_routes() {
        let doc = document(&config());
        assert_eq!(doc["openapi"], "3.0.3");
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
        let paths = doc["paths"].as_object().expect("paths is an object");
        let mut listed = BTreeSet::new();
        for (path, item) in paths {
            assert!(path.starts_with('/'), "{path}");
            for (method, operation) in item.as_object().expect("a path item is an object") {
                listed.insert((method.clone(), path.clone()));
                assert!(operation["operationId"].is_string(), "{method} {path}: operationId");
                let responses = operation["responses"].as_object().expect("responses");
                assert!(!responses.is_empty(), "{method} {path}: no responses");
                for (status, response) in responses {
                    let code: u16 = status.parse().expect("a status code");
                    assert!((100..600).contains(&code), "{method} {path}: {status}");
                    assert!(response["description"].is_string(), "{method} {path} {status}");
                }
            }
        }
        let routes: BTreeSet<_> =
            ROUTES.iter().map(|&(m, p)| (m.to_owned(), p.to_owned())).collect();
        assert_eq!(listed, routes);
        let mut errors = Vec::new();
        check_schema_tree(&doc, "#", &doc, &mut errors);
        assert!(errors.is_empty(), "not OpenAPI 3.0 here: {errors:?}");
    }

    #[test]
    fn the_schema_check_fires() {
        let doc = json!({ "a": { "$ref": "#/nowhere" }, "b": { "type": ["string", "null"] },
            "c": { "exclusiveMinimum": 0 }, "d": { "required": ["x"], "properties": {} },
            "e": { "required": [], "properties": {} } });
        let mut errors = Vec::new();
        check_schema_tree(&doc, "#", &doc, &mut errors);
        let expected =
            ["#/a/$ref", "#/b/type", "#/c/exclusiveMinimum", "#/d/required", "#/e/required"];
        assert_eq!(errors, expected);
    }

    /// The document's bounds are the server's: its extremes are accepted, one step past refused.
    #[test]
    fn the_documented_bounds_are_the_servers() {
        let doc = document(&config());
        let p = &doc["components"]["schemas"]["CompletionRequest"]["properties"];
        // Chat's bound for `max_tokens`: completions take 0 with `echo` (tested over HTTP).
        let chat = &doc["components"]["schemas"]["ChatCompletionRequest"]["properties"];
        assert_eq!(p["max_tokens"]["minimum"], 0);
        let at = |field: &str, bound: &str| p[field][bound].as_f64().expect("a bound");
        let stop_chars = p["stop"]["oneOf"][0]["maxLength"].as_u64().expect("maxLength");
        let stops = p["stop"]["oneOf"][1]["maxItems"].as_u64().expect("maxItems");
        let stop_ids = p["stop_token_ids"]["maxItems"].as_u64().expect("maxItems") as usize;
        // The widest characters UTF-8 has, as many as the document allows.
        let widest = "😀".repeat(usize::try_from(stop_chars).expect("small"));
        let valid = CommonRequest {
            temperature: Some(at("temperature", "maximum")),
            top_p: Some(at("top_p", "maximum")),
            top_k: Some(at("top_k", "minimum") as i64),
            max_tokens: Some(at("max_tokens", "maximum") as u32),
            n: Some(at("n", "maximum") as u32),
            presence_penalty: Some(at("presence_penalty", "maximum")),
            min_p: Some(at("min_p", "maximum")),
            repetition_penalty: Some(at("repetition_penalty", "maximum")),
            stop_token_ids: Some(vec![1; stop_ids]),
            frequency_penalty: Some(at("frequency_penalty", "minimum")),
            seed: Some(i64::MIN),
            stop: Some(Stop::Many(vec![widest.clone(); stops as usize])),
            ..CommonRequest::default()
        };
        let logprobs = at("logprobs", "maximum") as u8;
        assert!(valid.validate("test-model", Some(logprobs), 0).is_ok());
        assert!(valid.validate("test-model", Some(logprobs + 1), 0).is_err());
        let refused = [
            CommonRequest {
                temperature: Some(at("temperature", "maximum") + 0.01),
                ..Default::default()
            },
            CommonRequest {
                temperature: Some(at("temperature", "minimum") - 0.01),
                ..Default::default()
            },
            CommonRequest { top_p: Some(at("top_p", "minimum")), ..Default::default() },
            CommonRequest { top_k: Some(at("top_k", "minimum") as i64 - 1), ..Default::default() },
            CommonRequest {
                max_tokens: Some(
                    chat["max_tokens"]["minimum"].as_u64().expect("a bound") as u32 - 1,
                ),
                ..Default::default()
            },
            CommonRequest { n: Some(at("n", "maximum") as u32 + 1), ..Default::default() },
            CommonRequest { n: Some(at("n", "minimum") as u32 - 1), ..Default::default() },
            CommonRequest { stop_token_ids: Some(vec![1; stop_ids + 1]), ..Default::default() },
            CommonRequest { min_p: Some(at("min_p", "maximum") + 0.01), ..Default::default() },
            CommonRequest { min_p: Some(at("min_p", "minimum") - 0.01), ..Default::default() },
            CommonRequest {
                repetition_penalty: Some(at("repetition_penalty", "minimum")),
                ..Default::default()
            },
            CommonRequest {
                repetition_penalty: Some(at("repetition_penalty", "maximum") + 0.01),
                ..Default::default()
            },
            CommonRequest {
                presence_penalty: Some(at("presence_penalty", "maximum") + 0.01),
                ..Default::default()
            },
            CommonRequest {
                frequency_penalty: Some(at("frequency_penalty", "minimum") - 0.01),
                ..Default::default()
            },
            CommonRequest {
                stop: Some(Stop::Many(vec![String::new(); stops as usize + 1])),
                ..Default::default()
            },
            CommonRequest { stop: Some(Stop::One(format!("{widest}a"))), ..Default::default() },
        ];
        for (i, request) in refused.iter().enumerate() {
            assert!(request.validate("test-model", None, 0).is_err(), "refused[{i}] was accepted");
        }
    }

    #[test]
    fn tools_are_documented_only_where_the_server_parses_calls() {
        let chat = |config: &AppConfig| {
            document(config)["components"]["schemas"]["ChatCompletionRequest"]["properties"].clone()
        };
        let without = chat(&config());
        assert_eq!(without["tools"]["maxItems"], 0);
        assert_eq!(without["tool_choice"]["enum"], json!(["none", "auto"]));
        let mut parsing = config();
        parsing.tool_format = Some(crate::tool_calls::ToolFormat::Hermes);
        let with = chat(&parsing);
        assert_eq!(with["tools"]["items"]["$ref"], "#/components/schemas/Tool");
        assert!(with["tools"].get("maxItems").is_none());
        assert_eq!(with["tool_choice"]["oneOf"].as_array().map(Vec::len), Some(2));
    }

    fn sched() -> SchedConfig {
        SchedConfig {
            pool: PoolConfig { pages_total: 64, page_tokens: 4, pins_max: 0 },
            mode: StepMode::Sync,
            waiting_max: 8,
            running_max: 4,
            step_tokens_max: 64,
            prefill_chunk_tokens_max: 16,
            scored_tokens_max: 16,
            request_tokens_max: CONTEXT,
            capture_sizes: vec![1, 2, 4],
            eos_token_ids: vec![],
            queue_wait_max: Duration::from_secs(10),
            prefix_cache: true,
        }
    }

    /// The router answers every listed route, and only the listed method on each path: a route
    /// added to the router without the document (on a listed path) or listed without a handler
    /// fails here. The document's example requests are answered with a 200.
    #[tokio::test]
    async fn the_router_serves_exactly_the_listed_methods_and_the_document() {
        let sched = sched();
        let model = ProvenanceModel::new(sched.pool, sched.running_max, 1000);
        let runner = InlineRunner::new(model, StepCost::ZERO);
        let codec = Arc::new(SyntheticCodec::new(1000));
        let node = crate::node::start(EngineConfig::new(sched), runner, codec, config())
            .expect("the node starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("bound");
        let served = tokio::spawn(async move {
            let _ = node.serve(listener, std::future::pending(), Duration::from_secs(1)).await;
        });
        let request = |method: Method, path: &'static str, body: Option<String>| async move {
            let io = tokio::net::TcpStream::connect(addr).await.expect("connects");
            let mut c = Connection::new(io).await.expect("handshake");
            let response = c.request(method, path, body.as_deref()).await.expect("answered");
            (response.status.as_u16(), response.text().await.expect("a body"))
        };
        let doc = document(&config());
        for (method, path) in ROUTES {
            let (listed, other) = match method {
                "get" => (Method::GET, Method::POST),
                _ => (Method::POST, Method::GET),
            };
            let operation = &doc["paths"][path][method];
            if method == "post" {
                // `{}` lacks the required prompt or messages: a 400 from the handler, not a miss.
                let (status, _) = request(listed.clone(), path, Some("{}".into())).await;
                assert_eq!(status, 400, "{method} {path} {{}}");
                let example = &operation["requestBody"]["content"]["application/json"]["example"];
                let (status, body) = request(listed, path, Some(example.to_string())).await;
                assert_eq!(status, 200, "{method} {path} example: {body}");
            } else {
                assert_eq!(request(listed, path, None).await.0, 200, "{method} {path}");
            }
            assert_eq!(request(other, path, None).await.0, 405, "{path}");
            assert_eq!(request(Method::DELETE, path, None).await.0, 405, "{path}");
        }
        let (_, served_doc) = request(Method::GET, "/openapi.json", None).await;
        let served_doc: Value = serde_json::from_str(&served_doc).expect("JSON");
        assert_eq!(served_doc, doc);
        served.abort();
    }
}
