//! WEKA's agentic coding sessions (kv-cache-tester's trace format,
//! ../shared/traces/weka/UPSTREAM_FORMAT.md): one JSON document per session, its `requests`
//! in order, each with `t` (s from the session's start), `in`, `out`, `hash_ids` of `block_size`
//! (64) tokens, `api_time` and `think_time` (s), or a sub-agent entry (`type: "subagent"`) with
//! requests of its own. Read from one JSON file or a directory of them (`*.json`, in name
//! order); not from the .tar.gz they are shipped in: unpack it first.
//!
//! How it becomes requests (facts checked on the 383 sessions of
//! ../shared/traces/weka/weka_sessions_0001-0399.tar.gz):
//!
//! - Each session and each sub-agent is a session of the trace, its requests its turns in
//!   order, closed loop: a turn goes `After` the turn before it by that turn's `think_time`
//!   (without one: `t` minus the previous turn's `t` and `api_time`, never below 0).
//! - The session's first request goes `At` 0: a file's `t` counts from its own start, and
//!   nothing says when sessions started relative to each other, so all start together.
//! - A sub-agent entry follows the request of its parent that called it, the last one before
//!   the entry (its `t` is when the sub-agent *ended*: `t - duration_ms` is within a second of
//!   that request's end). Its first request goes `After` that one, by its own `think_time`
//!   (0 in every one of these). The parent's next turn waits only for the parent's turn before
//!   it, by the recorded `think_time`, which in the recording covered the sub-agents' run: the
//!   model has one request to wait for, and it is the parent's.
//! - `hash_ids` are scoped to one file (`hash_id_scope: "local"`: sub-agents of a file share
//!   theirs, different files never do), so each is put in its file's namespace. Only full
//!   blocks are hashed (`len(hash_ids) == floor(in / 64)`); the partial last block gets an id
//!   of its own request, shared with nothing.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::draft::{Draft, DraftInput, duration_ms, finish};
use super::{ImportOptions, SimTrace, Start};

/// The tokens of one `hash_ids` block when a session does not say.
const BLOCK_TOKENS_DEFAULT: u32 = 64;
/// A session's own ids must be below this, to fit its namespace (they are counters from 1).
const HASH_ID_LIMIT: u64 = 1 << 40;
/// Bytes of session files read at most, all together.
const SESSION_BYTES_MAX: u64 = 1 << 30;

/// One session file, as far as it matters here.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Session {
    /// The file's `id`, else its name.
    pub id: String,
    pub block_tokens: u32,
    pub entries: Vec<Entry>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Entry {
    Request(Request),
    Subagent { agent_id: String, entries: Vec<Entry> },
}

impl Entry {
    pub(crate) fn is_request(&self) -> bool {
        matches!(self, Entry::Request(_))
    }
}

/// One model call. Other fields are ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub(crate) struct Request {
    /// Seconds from the start of its (sub-)agent.
    pub t: f64,
    /// `"s"`: streamed, `"n"`: not.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(rename = "in")]
    pub input: u32,
    #[serde(rename = "out")]
    pub output: u32,
    pub hash_ids: Vec<u64>,
    /// Seconds the API took, when recorded.
    #[serde(default)]
    pub api_time: Option<f64>,
    /// Seconds from the previous request's end to this one, when recorded.
    #[serde(default)]
    pub think_time: Option<f64>,
    /// Seconds to the first token, when recorded.
    #[serde(default)]
    pub ttft: Option<f64>,
}

#[derive(Deserialize)]
struct SessionFile {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    block_size: Option<u32>,
    requests: Vec<Value>,
}

#[derive(Deserialize)]
struct SubagentEntry {
    #[serde(default)]
    agent_id: Option<String>,
    requests: Vec<Value>,
}

/// Reads one session document; `name` stands in for a missing `id`.
pub(crate) fn read_session(name: &str, text: &str) -> Result<Session, String> {
    let file: SessionFile =
        serde_json::from_str(text).map_err(|e| format!("not a WEKA session: {e}"))?;
    let block_tokens = file.block_size.unwrap_or(BLOCK_TOKENS_DEFAULT);
    if block_tokens == 0 {
        return Err("block_size is 0".into());
    }
    let entries = read_entries(&file.requests, "requests", block_tokens)?;
    Ok(Session { id: file.id.unwrap_or_else(|| name.to_owned()), block_tokens, entries })
}

fn read_entries(values: &[Value], path: &str, block_tokens: u32) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::with_capacity(values.len());
    for (i, value) in values.iter().enumerate() {
        let path = format!("{path}[{i}]");
        let entry = if value.get("type").and_then(Value::as_str) == Some("subagent") {
            let sub = SubagentEntry::deserialize(value).map_err(|e| format!("{path}: {e}"))?;
            let agent_id = sub.agent_id.unwrap_or_else(|| format!("agent{i}"));
            let entries = read_entries(&sub.requests, &format!("{path}.requests"), block_tokens)?;
            Entry::Subagent { agent_id, entries }
        } else {
            let request = Request::deserialize(value).map_err(|e| format!("{path}: {e}"))?;
            check_request(&request, block_tokens).map_err(|e| format!("{path}: {e}"))?;
            Entry::Request(request)
        };
        entries.push(entry);
    }
    Ok(entries)
}

fn check_request(request: &Request, block_tokens: u32) -> Result<(), String> {
    if request.input == 0 {
        return Err("in is 0: a prompt has at least 1 token".into());
    }
    let hashed = request.hash_ids.len() as u64 * u64::from(block_tokens);
    if hashed > u64::from(request.input) {
        return Err(format!(
            "{} hash_ids of {block_tokens} tokens are more than in = {}",
            request.hash_ids.len(),
            request.input
        ));
    }
    if let Some(id) = request.hash_ids.iter().find(|&&id| id >= HASH_ID_LIMIT) {
        return Err(format!("hash id {id} is not below {HASH_ID_LIMIT}"));
    }
    for (name, value) in [("t", Some(request.t)), ("api_time", request.api_time)]
        .into_iter()
        .chain([("think_time", request.think_time), ("ttft", request.ttft)])
    {
        if value.is_some_and(|v| v < 0.0) {
            return Err(format!("{name} {value:?} is not a number ≥ 0"));
        }
    }
    Ok(())
}

/// The sessions of `path`: a directory's `*.json` files in name order, or one file.
pub(crate) fn read_sessions(path: &Path) -> Result<Vec<Session>, String> {
    let files = if path.is_dir() { session_files(path)? } else { vec![path.to_path_buf()] };
    let mut bytes = 0;
    let mut sessions = Vec::with_capacity(files.len());
    for file in files {
        bytes += std::fs::metadata(&file).map_err(|e| format!("{}: {e}", file.display()))?.len();
        if bytes > SESSION_BYTES_MAX {
            return Err(format!("{}: more than {SESSION_BYTES_MAX} bytes", path.display()));
        }
        sessions.push(read_session_file(&file)?);
    }
    Ok(sessions)
}

/// The `*.json` files of a directory, in name order; at least one.
pub(crate) fn session_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let listed: Result<Vec<PathBuf>, _> =
        std::fs::read_dir(dir).and_then(|entries| entries.map(|e| e.map(|e| e.path())).collect());
    let mut files = listed.map_err(|e| format!("{}: {e}", dir.display()))?;
    files.retain(|f| f.extension().is_some_and(|x| x == "json") && f.is_file());
    files.sort();
    if files.is_empty() {
        return Err(format!("{}: no *.json session files", dir.display()));
    }
    Ok(files)
}

/// One session file (its name stands in for a missing `id`); an error names it.
pub(crate) fn read_session_file(file: &Path) -> Result<Session, String> {
    let name = file.display();
    let size = std::fs::metadata(file).map_err(|e| format!("{name}: {e}"))?.len();
    if size > SESSION_BYTES_MAX {
        return Err(format!("{name}: {size} bytes, more than {SESSION_BYTES_MAX}"));
    }
    let text = std::fs::read_to_string(file).map_err(|e| format!("{name}: {e}"))?;
    let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    read_session(&stem, &text).map_err(|e| format!("{name}: {e}"))
}

/// One request of the flattened sessions, in order: a session's turn, then its sub-agents'
/// (right after the turn that spawned them), then its next turn.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Turn {
    /// Which session (file) it came from, by its place.
    pub session: usize,
    /// `None`: the session's main agent; else the sub-agent's `agent_id`.
    pub agent: Option<String>,
    /// Numbers the agents (main and sub) in order of first appearance, from 0.
    pub agent_number: u32,
    /// Turn within its agent, from 1.
    pub turn: u32,
    /// The earlier turn it waits for, by index, and how long after that one ends (s).
    pub after: Option<(usize, f64)>,
    pub request: Request,
    /// `request.hash_ids` in the session's namespace, and an id of this turn's own for the
    /// partial last block.
    pub hash_ids: Vec<u64>,
    pub block_tokens: u32,
}

/// The turns of `sessions`, each agent's cut after `turns_max` turns (with what comes after).
pub(crate) fn flatten(sessions: &[Session], turns_max: Option<u32>) -> Vec<Turn> {
    let mut turns = Vec::new();
    let mut agents = 0;
    for (s, session) in sessions.iter().enumerate() {
        let agent = Agent { session: s, name: None, number: agents, spawner: None };
        agents += 1;
        flatten_agent(session, &session.entries, agent, turns_max, &mut agents, &mut turns);
    }
    turns
}

struct Agent {
    session: usize,
    name: Option<String>,
    number: u32,
    /// The turn that spawned it (a sub-agent).
    spawner: Option<usize>,
}

fn flatten_agent(
    session: &Session,
    entries: &[Entry],
    agent: Agent,
    turns_max: Option<u32>,
    agents: &mut u32,
    turns: &mut Vec<Turn>,
) {
    let mut last: Option<usize> = None;
    let mut turn = 0;
    for entry in entries {
        match entry {
            Entry::Request(request) => {
                if turns_max.is_some_and(|max| turn >= max) {
                    return;
                }
                turn += 1;
                let after = match last {
                    Some(last) => Some((last, think_s(request, &turns[last].request))),
                    None => agent.spawner.map(|s| (s, request.think_time.unwrap_or(0.0))),
                };
                let hash_ids = namespaced(agent.session, turns.len(), request, session);
                turns.push(Turn {
                    session: agent.session,
                    agent: agent.name.clone(),
                    agent_number: agent.number,
                    turn,
                    after,
                    request: request.clone(),
                    hash_ids,
                    block_tokens: session.block_tokens,
                });
                last = Some(turns.len() - 1);
            }
            Entry::Subagent { agent_id, entries } => {
                let sub = Agent {
                    session: agent.session,
                    name: Some(agent_id.clone()),
                    number: *agents,
                    spawner: last,
                };
                *agents += 1;
                flatten_agent(session, entries, sub, turns_max, agents, turns);
            }
        }
    }
}

/// Seconds between the end of `before` and `request`: its `think_time`, else what `t` and
/// `api_time` say, never below 0.
fn think_s(request: &Request, before: &Request) -> f64 {
    let derived = || request.t - before.t - before.api_time.unwrap_or(0.0);
    request.think_time.unwrap_or_else(derived).max(0.0)
}

/// The request's ids in the session's namespace, then the partial last block's id, which is
/// the turn's own (the top bit marks it: shared ids never have it).
fn namespaced(session: usize, turn_index: usize, request: &Request, s: &Session) -> Vec<u64> {
    let namespace = (session as u64 + 1) << 40;
    let mut ids: Vec<u64> = request.hash_ids.iter().map(|id| namespace | id).collect();
    if request.hash_ids.len() as u64 * u64::from(s.block_tokens) < u64::from(request.input) {
        ids.push(1 << 63 | turn_index as u64);
    }
    ids
}

/// A trace of one session document.
pub(crate) fn parse(name: &str, text: &str, options: &ImportOptions) -> Result<SimTrace, String> {
    let session = read_session(name, text)?;
    import(name, &[session], options)
}

/// A trace of a directory of session documents, or of one.
pub(crate) fn load(name: &str, path: &Path, options: &ImportOptions) -> Result<SimTrace, String> {
    import(name, &read_sessions(path)?, options)
}

fn import(name: &str, sessions: &[Session], options: &ImportOptions) -> Result<SimTrace, String> {
    let drafts = flatten(sessions, None)
        .into_iter()
        .map(|turn| Draft {
            session: Some(turn.agent_number),
            start: match turn.after {
                None => Start::At(std::time::Duration::ZERO),
                Some((previous, think_s)) => {
                    Start::After { previous, think: duration_ms(think_s * 1000.0) }
                }
            },
            input: DraftInput::Blocks {
                hash_ids: turn.hash_ids,
                tokens: turn.request.input,
                block_tokens: turn.block_tokens,
            },
            output_tokens: turn.request.output,
            temperature: 0.0,
            seed: None,
            penalties: super::draft::NO_PENALTIES,
            logit_bias: Vec::new(),
            constrained: false,
            priority: 0,
            logprobs: None,
            echo: false,
        })
        .collect();
    finish(name, options.vocab_size, drafts, options)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;

    /// A session of three main-agent requests, a sub-agent spawned by the first; blocks of 4
    /// tokens. The sub-agent's ids (1, 2) are the main agent's too: one file, one id space.
    pub(crate) const SESSION: &str = r#"{"id":"s1","block_size":4,"hash_id_scope":"local","requests":[
        {"t":0.0,"type":"n","in":9,"out":3,"hash_ids":[1,2],"api_time":2.0,"think_time":0.0},
        {"t":9.0,"type":"subagent","agent_id":"agent_001","duration_ms":4000,"requests":[
            {"t":0.0,"type":"s","in":8,"out":1,"hash_ids":[1,2],"api_time":1.0,"think_time":0.5},
            {"t":2.0,"type":"s","in":13,"out":0,"hash_ids":[1,2,5],"api_time":1.0}
        ]},
        {"t":10.0,"type":"n","in":12,"out":2,"hash_ids":[1,2,3],"api_time":1.5,"think_time":7.0},
        {"t":20.0,"type":"n","in":12,"out":2,"hash_ids":[1,2,4],"think_time":3.0}
    ]}"#;

    fn import_one(text: &str) -> Result<SimTrace, String> {
        parse("w", text, &ImportOptions::default())
    }

    #[test]
    fn turns_go_closed_loop_and_sub_agents_follow_their_spawner() {
        let trace = import_one(SESSION).unwrap();
        let starts: Vec<_> = trace.requests.iter().map(|r| (r.session, r.turn, r.start)).collect();
        let after = |previous, ms| Start::After { previous, think: Duration::from_millis(ms) };
        assert_eq!(
            starts,
            [
                (Some(0), 1, Start::At(Duration::ZERO)),
                (Some(1), 1, after(0, 500)),
                // No think_time: t 2 - (t 0 + api_time 1).
                (Some(1), 2, after(1, 1000)),
                (Some(0), 2, after(0, 7000)),
                (Some(0), 3, after(3, 3000)),
            ]
        );
        let input: Vec<&[u32]> = trace.requests.iter().map(|r| &r.input[..]).collect();
        assert_eq!(input[0][..8], input[1][..8], "ids 1, 2, shared with the sub-agent");
        assert_eq!(input[3][..8], input[4][..8]);
        assert_ne!(input[3][8..], input[4][8..], "id 3 against id 4");
        let max_tokens: Vec<u32> = trace.requests.iter().map(|r| r.max_tokens).collect();
        assert_eq!(max_tokens, [3, 1, 1, 2, 2], "an output of 0 is clamped to 1");
    }

    #[test]
    fn the_partial_last_block_is_the_requests_own() {
        let trace = import_one(&SESSION.replace(
            r#""in":12,"out":2,"hash_ids":[1,2,4]"#,
            r#""in":15,"out":2,"hash_ids":[1,2,3]"#,
        ))
        .unwrap();
        let (a, b) = (&trace.requests[3].input, &trace.requests[4].input);
        assert_eq!((a.len(), b.len()), (12, 15));
        assert_eq!(a[..], b[..12], "ids 1, 2, 3 and no partial block in the first");
        let both = SESSION
            .replace(
                r#""in":12,"out":2,"hash_ids":[1,2,4]"#,
                r#""in":15,"out":2,"hash_ids":[1,2,3]"#,
            )
            .replace(
                r#""in":12,"out":2,"hash_ids":[1,2,3]"#,
                r#""in":15,"out":2,"hash_ids":[1,2,3]"#,
            );
        let other = import_one(&both).unwrap();
        let (c, d) = (&other.requests[3].input, &other.requests[4].input);
        assert_eq!(c[..12], d[..12]);
        assert_ne!(c[12..], d[12..], "two partial blocks after the same ids: not shared");
    }

    #[test]
    fn sessions_never_share_ids() {
        let one = read_session("a", SESSION).unwrap();
        let trace = import("w", &[one.clone(), one], &ImportOptions::default()).unwrap();
        assert_eq!(trace.requests.len(), 10);
        let (a, b) = (&trace.requests[0], &trace.requests[5]);
        assert_eq!((a.session, b.session), (Some(0), Some(2)), "the sub-agent is session 1");
        assert_eq!(b.start, Start::At(Duration::ZERO), "every session starts at 0");
        assert_ne!(a.input[..4], b.input[..4], "same ids, different files");
    }

    #[test]
    fn bad_sessions_name_the_request() {
        let cases = [
            (
                SESSION.replace(
                    r#""in":12,"out":2,"hash_ids":[1,2,3]"#,
                    r#""out":2,"hash_ids":[1,2,3]"#,
                ),
                "requests[2]: missing field `in`",
            ),
            (
                SESSION.replace(r#""in":8,"out":1"#, r#""in":8,"out":-1"#),
                "requests[1].requests[0]: invalid value",
            ),
            (SESSION.replace(r#""in":9,"#, r#""in":7,"#), "requests[0]: 2 hash_ids of 4 tokens"),
            (SESSION.replace(r#""in":9,"#, r#""in":0,"#), "requests[0]: in is 0"),
            (
                SESSION.replace(r#""think_time":3.0"#, r#""think_time":-3.0"#),
                "requests[3]: think_time",
            ),
            (SESSION.replace(r#""requests":["#, r#""requests":{"#), "not a WEKA session"),
        ];
        for (text, expected) in cases {
            let e = import_one(&text).unwrap_err();
            assert!(e.contains(expected), "{expected:?}: {e}");
        }
    }
}
