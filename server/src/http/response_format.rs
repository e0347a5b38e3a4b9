//! OpenAI's `response_format`: the grammar a chat completion's output must follow.
//!
//! `{"type": "text"}` (or none) leaves the output free; `{"type": "json_object"}` holds it to
//! one JSON object; `{"type": "json_schema", "json_schema": {"name": …, "schema": {…}}}` to JSON
//! the schema accepts (llguidance's reading of JSON Schema: what it cannot enforce it refuses,
//! so a schema we accept is one the output follows). The caller compiles it (`HeldGrammar::check`,
//! once on the request's path), so that a schema the server cannot use is the client's 400, not a
//! failed step.

use lockstep_core::model::Grammar;
use lockstep_core::wire::GRAMMAR_BYTES_MAX;
use serde_json::Value;

use super::error::ApiError;
use super::held_grammar::HeldGrammar;

/// The grammar `format` asks for, not yet compiled.
pub(super) fn grammar(format: Option<&Value>) -> Result<Option<HeldGrammar>, ApiError> {
    let invalid = |why: String| ApiError::invalid_param("response_format", why);
    let Some(format) = format else { return Ok(None) };
    let grammar = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Grammar::JsonObject,
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| invalid("json_schema.schema is required".into()))?;
            if !schema.is_object() {
                return Err(invalid("json_schema.schema must be a JSON Schema object".into()));
            }
            Grammar::JsonSchema(schema.to_string())
        }
        _ => {
            return Err(invalid(
                "type must be \"text\", \"json_object\" or \"json_schema\"".into(),
            ));
        }
    };
    if grammar.text().len() > GRAMMAR_BYTES_MAX {
        return Err(invalid(format!("the schema is over {GRAMMAR_BYTES_MAX} bytes")));
    }
    Ok(Some(HeldGrammar::new(grammar, "response_format", "the schema".into())))
}
