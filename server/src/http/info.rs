//! The routes that do not generate: models, health, metrics, the OpenAPI document, and the
//! answers for unknown routes and methods.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ApiError;
use super::{AppState, openapi};

pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model_name,
            "object": "model",
            "created": state.config.unix_time_at_start,
            "owned_by": "lockstep",
            "max_model_len": state.config.context_tokens,
        }],
    }))
    .into_response()
}

/// 200 while the engine runs and makes progress; 503 when it has held work for longer than
/// `health_stall_max` without completing a step (a wedge), has stopped, or is draining.
pub(super) async fn health(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.engine.stats();
    let stalled = stats.stalled_for();
    let (status, why) = if stats.stopped() {
        (StatusCode::SERVICE_UNAVAILABLE, "stopped")
    } else if stats.draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if stalled > state.config.health_stall_max {
        (StatusCode::SERVICE_UNAVAILABLE, "stalled")
    } else {
        (StatusCode::OK, "ok")
    };
    let body = json!({
        "status": why,
        "requests_held": stats.requests_held(),
        "stalled_seconds": stalled.as_secs_f64(),
    });
    (status, Json(body)).into_response()
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let content_type = "text/plain; version=0.0.4; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], state.metrics.render()).into_response()
}

pub(super) async fn openapi(State(state): State<Arc<AppState>>) -> Response {
    Json(openapi::document(&state.config)).into_response()
}

pub(super) async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

pub(super) async fn method_not_allowed() -> Response {
    let mut e = ApiError::invalid("method not allowed on this route");
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e.into_response()
}
