//! `--api-key`: clients present the key as `Authorization: Bearer KEY`, OpenAI's scheme (what
//! vLLM's `--api-key` asks too). Every route answers a request without it with a 401, but
//! `/health` and `/metrics` (load balancers and Prometheus scrape them with no key) and
//! `/openapi.json` (it shows the API's shape, not the model's work).

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;

/// Where `serve` and `bench-serve` read the key when not given `--api-key`.
pub const API_KEY_VARIABLE: &str = "LOCKSTEP_API_KEY";

/// Paths served without the key.
pub const OPEN_PATHS: [&str; 3] = ["/health", "/metrics", "/openapi.json"];

/// The key a server asks of its clients. Its `Debug` does not show it: configurations are
/// logged.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key of visible ASCII (what a header carries unchanged), not empty.
    pub fn new(key: &str) -> Result<ApiKey, String> {
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the API key must be visible ASCII characters, at least one".into());
        }
        Ok(ApiKey(key.to_owned()))
    }

    /// The key in `$LOCKSTEP_API_KEY`, if set: what `serve` and `bench-serve` take when not
    /// given `--api-key` (a flag shows in the process list, the environment does not).
    pub fn from_env() -> Result<Option<ApiKey>, String> {
        let Some(key) = std::env::var_os(API_KEY_VARIABLE) else { return Ok(None) };
        let key = key.to_str().ok_or(format!("{API_KEY_VARIABLE}: not UTF-8"))?;
        ApiKey::new(key).map(Some).map_err(|e| format!("{API_KEY_VARIABLE}: {e}"))
    }

    /// The key itself, for a client to send.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `authorization` (the header's value) is `Bearer` and this key. The key's bytes
    /// are compared all the way whatever differs first, so the answer's time does not tell an
    /// attacker how much of a guess was right.
    fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(given) = authorization.and_then(|v| v.as_bytes().strip_prefix(b"Bearer ")) else {
            return false;
        };
        let key = self.0.as_bytes();
        let differing = key.iter().zip(given).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        differing == 0 && given.len() == key.len()
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(hidden)")
    }
}

/// The middleware: a 401 with OpenAI's error for a request to a closed path without the key.
pub(super) async fn require_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = &state.config.api_key else { return next.run(request).await };
    if OPEN_PATHS.contains(&request.uri().path())
        || key.admits(request.headers().get(header::AUTHORIZATION))
    {
        return next.run(request).await;
    }
    state.metrics.rejected_unauthorized.increment(1);
    let mut response = ApiError::unauthorized().into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    debug_assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_of_the_very_key_is_admitted() {
        let key = ApiKey::new("sk-abc123").unwrap();
        let admits = |value: &str| key.admits(Some(&HeaderValue::from_str(value).unwrap()));
        assert!(admits("Bearer sk-abc123"));
        for wrong in [
            "Bearer sk-abc12",
            "Bearer sk-abc1234",
            "Bearer sk-abc124",
            "sk-abc123",
            "Basic sk-abc123",
            "bearer sk-abc123",
            "Bearer  sk-abc123",
            "Bearer ",
        ] {
            assert!(!admits(wrong), "{wrong}");
        }
        assert!(!key.admits(None));
        assert!(ApiKey::new("").is_err() && ApiKey::new("a b").is_err());
        assert_eq!(format!("{key:?}"), "ApiKey(hidden)");
    }
}
