//! The OpenAPI document of what the server accepts and answers, at `/openapi.json`.

use serde_json::{Value, json};

use super::AppConfig;

pub fn document(config: &AppConfig) -> Value {
    json!({
        "openapi": "3.0.3",
        "info": { "title": "lockstep", "version": env!("CARGO_PKG_VERSION") },
        "x-model": config.model_name,
        "paths": {},
    })
}
