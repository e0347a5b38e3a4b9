//! The request bodies of `/v1/completions` and `/v1/chat/completions`, and their validation into
//! what the engine runs. Every field OpenAI defines that we do not implement is refused with a
//! message when it asks for something (a response format other than text, `tool_choice`
//! "required", `suffix`, `best_of`), never silently ignored; fields that change nothing
//! (`user`, `parallel_tool_calls`) are accepted. Unknown fields are ignored, as OpenAI's own
//! server does.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use lockstep_core::model::SamplingSpec;
use lockstep_core::wire::{LOGIT_BIAS_MAX, STOP_TOKENS_MAX, Sampling};

/// Fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct CommonRequest {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    /// Read as f64 and range-checked before narrowing, so that a value just outside a range is
    /// not rounded into it (2.00000001) nor one inside rounded out of it (top_p 1e-46).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's extension: -1 or 0 keep every token.
    pub top_k: Option<i64>,
    /// vLLM's extension: candidates below this share of the most likely one's probability are
    /// cut; 0 keeps every token.
    pub min_p: Option<f64>,
    /// vLLM's extension: a token of the prompt or the output so far has its logit divided by
    /// this if positive, multiplied if not; 1 is none.
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// vLLM's extension: token ids that end the output; their text is left out, as vLLM
    /// leaves it out by default.
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// vLLM's extension: keep generating past the end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's extension: return the prompt's and the output's token ids.
    #[serde(default)]
    pub return_token_ids: bool,
    /// vLLM's extension, on a server started with `--scheduling-policy priority`: lower is
    /// admitted first (then earlier arrival), and preempted last.
    pub priority: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Value,
    #[serde(flatten)]
    pub common: CommonRequest,
    /// Top alternatives per token, 0 to 20.
    pub logprobs: Option<u8>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    /// As chat's (vLLM takes it here too).
    pub response_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub common: CommonRequest,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u8>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// OpenAI's: `false` holds a `"required"` reply to one call.
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    /// Further variables for the chat template, as vLLM and SGLang take them (Qwen 3's
    /// `enable_thinking`, DeepSeek V3.1's `thinking`).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM's: `false` leaves `reasoning_content` out (the reasoning is still taken out of the
    /// content, and still counted in usage).
    pub include_reasoning: Option<bool>,
    /// SGLang's: `false` reads no reasoning: the thinking stays in the content, markers and all,
    /// as from a server without a reasoning parser.
    pub separate_reasoning: Option<bool>,
}

/// Stop strings, at most this many, each at most `STOP_BYTES_MAX` bytes.
pub const STOPS_MAX: usize = 16;
pub const STOP_BYTES_MAX: usize = 256;
/// Completions a request may ask for (`n`): each takes a place in the engine's queue, so a
/// request for more would be one client's flood.
pub const CHOICES_MAX: u32 = 16;
/// Prompt token ids given directly, at most (the context bounds them further).
pub const PROMPT_IDS_MAX: usize = 1 << 20;

/// What the engine and the output side need, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    pub max_tokens: Option<u32>,
    pub spec: SamplingSpec,
    pub stops: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// The scheduler's order: lower first (`NewRequest::priority`); 0 unless the server
    /// schedules by priority (`respond::start` refuses another).
    pub priority: i32,
    /// How many completions of the prompt (`n`, 1 to `CHOICES_MAX`): each its own request in
    /// the engine (`for_choice`).
    pub choices: u32,
}

impl GenerationParams {
    /// Choice `index`'s parameters: the request's, with the seed moved by `index` (as vLLM
    /// seeds its parallel samples), so the choices of a sampled request differ and each is
    /// exactly what a request for one completion with that seed returns.
    pub fn for_choice(&self, index: u32) -> GenerationParams {
        let mut params = self.clone();
        params.spec.sampling.seed = params.spec.sampling.seed.wrapping_add(u64::from(index));
        params
    }
}

impl CommonRequest {
    /// Checks everything but the prompt; `seed_if_none` is the server's draw for a request that
    /// gave no seed.
    pub fn validate(
        &self,
        served_model: &str,
        logprobs: Option<u8>,
        seed_if_none: u64,
    ) -> Result<GenerationParams, ApiError> {
        if let Some(model) = &self.model
            && model != served_model
        {
            return Err(ApiError::model_not_found(model));
        }
        let choices = self.n.unwrap_or(1);
        if !(1..=CHOICES_MAX).contains(&choices) {
            return Err(ApiError::invalid_param(
                "n",
                format!("n must be within [1, {CHOICES_MAX}]"),
            ));
        }
        let mut penalties = [0f32; 2];
        for (penalty, (name, value)) in penalties.iter_mut().zip([
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ]) {
            let value = value.unwrap_or(0.0);
            if !(-2.0..=2.0).contains(&value) {
                return Err(ApiError::invalid_param(
                    name,
                    format!("{name} must be within [-2, 2]"),
                ));
            }
            *penalty = value as f32;
        }
        let [presence_penalty, frequency_penalty] = penalties;
        let logit_bias = self.logit_bias.as_ref().map(logit_bias).transpose()?.unwrap_or_default();
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                "temperature must be within [0, 2]",
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", "top_p must be within (0, 1]"));
        }
        // Narrowed only now; a tiny positive top_p stays positive.
        let (temperature, top_p) = (temperature as f32, (top_p as f32).max(f32::MIN_POSITIVE));
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            Some(_) => {
                return Err(ApiError::invalid_param("top_k", "top_k must be -1, 0 or positive"));
            }
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid_param("min_p", "min_p must be within [0, 1]"));
        }
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        if !(repetition_penalty > 0.0 && repetition_penalty <= 2.0) {
            return Err(ApiError::invalid_param(
                "repetition_penalty",
                "repetition_penalty must be within (0, 2]",
            ));
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid_param("max_tokens", "max_tokens must be at least 1"));
        }
        if logprobs.is_some_and(|n| n > SamplingSpec::TOP_LOGPROBS_MAX) {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!("at most {} top log-probabilities", SamplingSpec::TOP_LOGPROBS_MAX),
            ));
        }
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        if stops.len() > STOPS_MAX || stops.iter().any(|s| s.len() > STOP_BYTES_MAX) {
            return Err(ApiError::invalid_param(
                "stop",
                format!("at most {STOPS_MAX} stop strings of at most {STOP_BYTES_MAX} bytes"),
            ));
        }
        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if stop_token_ids.len() > STOP_TOKENS_MAX {
            return Err(ApiError::invalid_param(
                "stop_token_ids",
                format!("at most {STOP_TOKENS_MAX} stop token ids"),
            ));
        }
        let priority = i32::try_from(self.priority.unwrap_or(0)).map_err(|_| {
            ApiError::invalid_param("priority", "priority must be a 32-bit signed integer")
        })?;
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid_param("stream_options", "stream_options needs stream"));
        }
        // OpenAI's seeds are signed 64-bit; any value is a seed, its bits taken as they are.
        let seed = self.seed.map_or(seed_if_none, |s| s as u64);
        Ok(GenerationParams {
            max_tokens,
            spec: SamplingSpec {
                sampling: Sampling {
                    temperature,
                    top_p,
                    top_k,
                    seed,
                    presence_penalty,
                    frequency_penalty,
                    min_p: min_p as f32,
                    repetition_penalty: repetition_penalty as f32,
                },
                logprobs,
                logit_bias,
                // The prompt is encoded after validation: `respond::start` sets these.
                ..SamplingSpec::GREEDY
            },
            stops,
            stop_token_ids,
            ignore_eos: self.ignore_eos,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            return_token_ids: self.return_token_ids,
            priority,
            choices,
        })
    }
}

/// OpenAI's `logit_bias`: token ids (as the object's keys) to a bias within [-100, 100], at most
/// `LOGIT_BIAS_MAX` of them; by token. Whether each id is in the vocabulary is checked with the
/// prompt (`respond::start`).
fn logit_bias(map: &serde_json::Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |why: String| ApiError::invalid_param("logit_bias", why);
    if map.len() > LOGIT_BIAS_MAX {
        return Err(bad(format!("at most {LOGIT_BIAS_MAX} tokens")));
    }
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token = key.parse::<u32>().map_err(|_| bad(format!("{key:?} is not a token id")))?;
        let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b));
        let bias = bias.ok_or_else(|| bad(format!("{key}: a bias must be within [-100, 100]")))?;
        biases.push((token, bias as f32));
    }
    biases.sort_by_key(|&(token, _)| token);
    if let Some(pair) = biases.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(bad(format!("token {} is given twice", pair[0].0)));
    }
    Ok(biases)
}

/// One completion prompt: text, or token ids.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Prompts one completion request may list (OpenAI's list of prompts, as lm-eval-harness sends
/// a batch), and completions (prompts × `n`) a request with several may ask for: each is a
/// place in the engine's queue.
pub const PROMPTS_MAX: usize = 64;

/// `/v1/completions`' `prompt`: text, token ids, or a list of either kind (all text or all id
/// lists), each with its JSON as sent (what a trace records of it). An empty list is one empty
/// prompt, which `respond::start` refuses as such.
pub fn completion_prompts(value: &Value) -> Result<Vec<(Prompt, Value)>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "prompt",
            "prompt must be a string, a list of token ids, or a list of strings or of token-id \
             lists",
        )
    };
    let ids = |items: &[Value]| {
        if items.len() > PROMPT_IDS_MAX {
            return Err(ApiError::invalid_param("prompt", "too many prompt token ids"));
        }
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(bad))
            .collect::<Result<Vec<u32>, ApiError>>()
    };
    let items = match value {
        Value::String(s) => return Ok(vec![(Prompt::Text(s.clone()), value.clone())]),
        Value::Array(items) => items,
        _ => return Err(bad()),
    };
    if items.iter().all(Value::is_number) {
        return Ok(vec![(Prompt::Ids(ids(items)?), value.clone())]);
    }
    if items.len() > PROMPTS_MAX {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("at most {PROMPTS_MAX} prompts a request"),
        ));
    }
    if items.iter().all(Value::is_string) {
        let texts =
            items.iter().map(|v| (Prompt::Text(v.as_str().unwrap_or_default().into()), v.clone()));
        return Ok(texts.collect());
    }
    items
        .iter()
        .map(|v| match v {
            Value::Array(list) if list.iter().all(Value::is_number) => {
                Ok((Prompt::Ids(ids(list)?), v.clone()))
            }
            _ => Err(bad()),
        })
        .collect()
}

/// Checks the shape of chat messages (roles, content as text or text parts, tool calls) so the
/// template sees only what it understands.
pub fn check_messages(messages: &[Value]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must not be empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        let bad =
            |what: &str| ApiError::invalid_param("messages", format!("messages[{i}]: {what}"));
        let Some(object) = m.as_object() else { return Err(bad("must be an object")) };
        match object.get("role").and_then(Value::as_str) {
            Some("system" | "developer" | "user" | "assistant" | "tool") => {}
            Some(other) => return Err(bad(&format!("unknown role {other:?}"))),
            None => return Err(bad("role must be a string")),
        }
        match object.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for part in parts {
                    let text = part.get("type").and_then(Value::as_str) == Some("text")
                        && part.get("text").is_some_and(Value::is_string);
                    if !text {
                        return Err(bad("content parts must be {\"type\": \"text\", \"text\": …}"));
                    }
                }
            }
            Some(_) => return Err(bad("content must be a string, null or a list of text parts")),
        }
        if let Some(calls) = object.get("tool_calls")
            && !calls.is_array()
        {
            return Err(bad("tool_calls must be a list"));
        }
    }
    Ok(())
}
