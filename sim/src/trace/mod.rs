//! The simulator's trace model: the requests its clients send, when, and with which prompt
//! (DESIGN.md section 7), and the importers that make one from a file.
//!
//! A trace is a list of `SimRequest`s. Each starts either open loop, at a time from the start
//! of the run (`Start::At`), or closed loop, a think time after an earlier request has ended
//! (`Start::After`), as an agent's next turn waits for the last answer. Prompts are token ids:
//! importers of traces that give only lengths and prefix-block hash ids make them with
//! `lockstep_server::bench_serve::synthesize_prompt`, so equal leading ids give equal leading
//! tokens and a prefix cache sees the sharing the trace recorded.
//!
//! Formats, each read by its own file, chosen by `load` from the file's extension and content:
//!
//! - `native`: `lockstep-trace` v1 (traces/README.md), token ids or hash ids, sessions closed
//!   loop, sub-agents following the request that spawned them;
//! - `mooncake`: Mooncake's JSONL (`timestamp`, `input_length`, `output_length`, `hash_ids` of
//!   512 tokens), open loop;
//! - `azure`: the Azure 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`), open loop, every
//!   prompt unique;
//! - `weka`: WEKA's agentic sessions (one JSON per session, or a directory of them), closed loop
//!   with sub-agents. `weka_sample` turns them into the committed native sample.
//!
//! Every importer hands a list of `Draft`s to `draft::finish`, which alone scales lengths, caps
//! them, keeps whole sessions under `max_requests`, makes the tokens and numbers sessions and
//! turns; `SimTrace::check` then holds for what it returns.

mod azure;
mod check;
mod detect;
mod draft;
mod mooncake;
mod native;
mod weka;
pub mod weka_sample;

use std::time::Duration;

pub use detect::{load, parse};

/// One request the simulated clients send.
#[derive(Clone, Debug, PartialEq)]
pub struct SimRequest {
    /// Its place in the trace (0..), the request's name in every report.
    pub index: usize,
    /// Dense session number (0..), numbered in the order sessions first appear, when the trace
    /// has sessions; turns of a session go out in order.
    pub session: Option<u32>,
    /// Turn within the session, from 1 (1 when no session).
    pub turn: u32,
    pub start: Start,
    /// Prompt token ids, each below the trace's vocab; never empty.
    pub input: Vec<u32>,
    /// At least 1: an importer clamps a recorded 0 up to 1.
    pub max_tokens: u32,
    pub temperature: f32,
    pub seed: u64,
    /// OpenAI's penalties, each within [-2, 2]: a recorded request's, or `--logit-adjustments`'.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's, within (0, 2]; 1: none.
    pub repetition_penalty: f32,
    /// (token, bias), by token: a recorded request's `logit_bias`, or `--logit-adjustments`'.
    pub logit_bias: Vec<(u32, f32)>,
    /// Sent with `response_format` `json_object` (`--logit-adjustments`, one request in five):
    /// the provenance model's synthetic grammar then holds its draws to a mask that follows its
    /// output, which every worker must be handed and follow.
    pub constrained: bool,
    /// Sent as `priority` when not 0: a recorded request's, or `--priorities`'.
    pub priority: i32,
    /// Sent as `logprobs` (that many top alternatives) when set (`--logprobs`): the equal-alone
    /// oracle then holds each token's log-probabilities to the request alone's, bit for bit.
    pub logprobs: Option<u8>,
    /// Sent with `echo` (`--echo`, with `logprobs`): the answer starts with the prompt, and its
    /// log-probabilities with the prompt's tokens' (which a prefill worker scores in P/D).
    pub echo: bool,
}

/// When a request is sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Start {
    /// Open loop: sent at this time from the start of the run.
    At(Duration),
    /// Closed loop: sent `think` after request `previous` (an earlier index) has ended
    /// (completed or failed), as an agent's next turn waits for the last answer. For a later
    /// turn, `previous` is the session's turn before it; for the first turn of a session it is a
    /// request of another session: a sub-agent starts when the request that spawned it ended.
    After { previous: usize, think: Duration },
}

/// A whole trace, checked by `check`.
#[derive(Clone, Debug, PartialEq)]
pub struct SimTrace {
    /// Where it came from (the file's stem, or the name given to `parse`).
    pub name: String,
    /// Every token id is below it.
    pub vocab_size: u32,
    pub requests: Vec<SimRequest>,
}

/// How a trace file becomes requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImportOptions {
    /// Token ids are drawn below this. Native traces use their header's `vocab_size` instead:
    /// their token ids are a real model's.
    pub vocab_size: u32,
    /// Scales every length: prompts, the prefix blocks they are made of (at least 1 token
    /// each, so shared prefixes stay shared and aligned) and outputs. Rounded, at least 1.
    /// A prompt given as token ids is cut to its scaled length, never lengthened.
    pub scale_tokens: f64,
    /// Prompts longer than this (after scaling) are cut from the end, so prefixes stay shared.
    pub max_input: Option<u32>,
    /// Outputs longer than this (after scaling) are cut.
    pub max_output: Option<u32>,
    /// Keeps the first requests, whole sessions at a time: sessions (and requests in no
    /// session) in the order they first appear, as long as the total stays within this; the
    /// first one that does not fit ends the trace. A session is never cut mid-way, and a
    /// sub-agent is kept only with the session that spawned it (that one comes first). Without
    /// sessions (Mooncake, Azure) this is simply the first N requests.
    pub max_requests: Option<usize>,
    /// Seed of the token synthesis from hash ids.
    pub seed: u64,
    /// Gives two requests in three of a trace without penalties some, one in four without a
    /// logit bias one (`draft::penalties`, `draft::logit_bias`), and one in five a grammar
    /// (`SimRequest::constrained`), so that the output-so-far every executor keeps for
    /// penalties and grammars, and the bias and grammar every worker must be handed, meet the
    /// faults.
    pub logit_adjustments: bool,
    /// Gives one request in three of a trace without priorities -1 and another 2
    /// (`draft::priority`), so admission and preemption by priority meet the faults.
    pub priorities: bool,
    /// Has one request in three ask for log-probabilities with 0, 1 or 5 top alternatives
    /// (`draft::logprobs`), so that they travel every path a token does (the prefill worker's
    /// first token, the decode worker's stream, the router) under the faults.
    pub logprobs: bool,
    /// Has one request in four ask for `echo` with log-probabilities (`draft::echo`), so that
    /// scoring a prompt (every position computed, none read from the cache, repeats after a
    /// preemption dropped) meets the faults.
    pub echo: bool,
}

impl Default for ImportOptions {
    fn default() -> ImportOptions {
        ImportOptions {
            vocab_size: 32_000,
            scale_tokens: 1.0,
            max_input: None,
            max_output: None,
            max_requests: None,
            seed: 0,
            logit_adjustments: false,
            priorities: false,
            logprobs: false,
            echo: false,
        }
    }
}
