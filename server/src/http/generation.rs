//! One request's output as the client sees it: tokens from the engine, detokenized without
//! splitting a character, cut at a stop string (which also aborts the request in the engine, so
//! its pages return at once), within the server's time limit for a request.

use std::sync::Arc;

use lockstep_core::model::TokenLogprobs;
use lockstep_core::sched::{FinishReason, RequestId};
use tokio::time::Instant;

use super::error::ApiError;
use crate::engine::{RequestEvent, RequestStream};
use crate::record::{Recording, TraceFinish};
use crate::text::{Detokenizer, StopMatcher, TextCodec};

/// What a client reads when its request was shed for waiting past the queue's bound: the
/// deployment is overloaded, not broken (the simulator's liveness oracle tells the two apart).
pub const QUEUE_TIMEOUT_MESSAGE: &str = "the request waited too long in the queue";

/// New output: text (possibly empty while a character or a possible stop string is held back),
/// and the tokens it came from.
#[derive(Debug, Default)]
pub struct Piece {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

#[derive(Debug)]
pub enum Next {
    Piece(Piece),
    Done(Result<Finish, ApiError>),
}

pub struct Generation {
    id: RequestId,
    /// `None` once the request ended here (stop string, time limit): dropping it aborted it.
    stream: Option<RequestStream>,
    codec: Arc<dyn TextCodec>,
    detok: Detokenizer,
    stop: StopMatcher,
    deadline: Instant,
    /// Tokens that end the output (the engine finishes the request on them); their text is
    /// left out.
    stop_token_ids: Vec<u32>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// The prompt's tokens' log-probabilities (from the second), as far as they came, when
    /// the request asked for them (`SamplingSpec::prompt_logprobs`): all of them before the
    /// first piece of output.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    done: Option<Result<Finish, ApiError>>,
    /// The request's trace record while it runs (`--record-trace`); dropped unended: `abort`.
    record: Option<Recording>,
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation").field("output_tokens", &self.output_tokens).finish()
    }
}

impl Generation {
    pub fn new(
        stream: RequestStream,
        codec: Arc<dyn TextCodec>,
        stops: &[String],
        prompt_tokens: u32,
        deadline: Instant,
    ) -> Generation {
        Generation {
            id: stream.id(),
            stream: Some(stream),
            codec,
            detok: Detokenizer::new(),
            stop: StopMatcher::new(stops),
            deadline,
            stop_token_ids: Vec::new(),
            prompt_tokens,
            output_tokens: 0,
            prompt_logprobs: Vec::new(),
            done: None,
            record: None,
        }
    }

    /// The request's stop token ids (`stop_token_ids`).
    pub fn with_stop_token_ids(mut self, ids: &[u32]) -> Generation {
        self.stop_token_ids = ids.to_vec();
        self
    }

    /// Records the output into `recording` (none: nothing is recorded).
    pub fn with_recording(mut self, recording: Option<Recording>) -> Generation {
        self.record = recording;
        self
    }

    /// All of the output at once, for a response that is not streamed.
    pub async fn collect(&mut self) -> Result<(Piece, Finish), ApiError> {
        self.collect_with(|_| {}).await
    }

    /// As `collect`, showing `each` every piece as it comes.
    pub async fn collect_with(
        &mut self,
        mut each: impl FnMut(&Piece),
    ) -> Result<(Piece, Finish), ApiError> {
        let mut whole = Piece::default();
        loop {
            match self.next().await {
                Next::Piece(p) => {
                    each(&p);
                    whole.text.push_str(&p.text);
                    whole.tokens.extend(p.tokens);
                    whole.logprobs.extend(p.logprobs);
                }
                Next::Done(finish) => return finish.map(|finish| (whole, finish)),
            }
        }
    }

    /// The engine's id of the request.
    pub fn request_id(&self) -> RequestId {
        self.id
    }

    /// The next piece of output, or how it ended. After `Done`, `Done` again.
    pub async fn next(&mut self) -> Next {
        if let Some(done) = &self.done {
            return Next::Done(done.clone());
        }
        let Some(stream) = self.stream.as_mut() else {
            self.record_end(TraceFinish::Stop);
            return self.end(Ok(Finish::Stop));
        };
        let event = loop {
            match tokio::time::timeout_at(self.deadline, stream.next()).await {
                Ok(Some(RequestEvent::PromptLogprobs { logprobs })) => {
                    self.prompt_logprobs.extend(logprobs);
                }
                Ok(event) => break event,
                Err(_) => {
                    self.stream = None; // Aborts it.
                    self.record_end(TraceFinish::Timeout);
                    return self
                        .end(Err(ApiError::unavailable("the request ran past the time limit", 1)));
                }
            }
        };
        match event {
            Some(RequestEvent::Token { token, logprobs }) => self.token(token, logprobs),
            // Taken by the loop above; were one to come here, it is kept all the same.
            Some(RequestEvent::PromptLogprobs { logprobs }) => {
                self.prompt_logprobs.extend(logprobs);
                Next::Piece(Piece::default())
            }
            Some(RequestEvent::Finished { reason, .. }) => {
                self.stream = None;
                let finish = match reason {
                    FinishReason::EndOfSequence(_) | FinishReason::StopToken(_) => Ok(Finish::Stop),
                    FinishReason::Length | FinishReason::ContextLength => Ok(Finish::Length),
                    FinishReason::QueueTimeout => {
                        Err(ApiError::unavailable(QUEUE_TIMEOUT_MESSAGE, 1))
                    }
                    FinishReason::Aborted => {
                        Err(ApiError::unavailable("the request was aborted", 1))
                    }
                    FinishReason::StepFailed => {
                        Err(ApiError::internal("the engine failed while computing this request"))
                    }
                };
                self.flush(finish, TraceFinish::from_reason(reason))
            }
            None => {
                self.stream = None;
                self.record_end(TraceFinish::Error);
                self.end(Err(ApiError::unavailable("the engine stopped", 1)))
            }
        }
    }

    fn token(&mut self, token: u32, logprobs: Option<TokenLogprobs>) -> Next {
        self.output_tokens += 1;
        if let Some(record) = self.record.as_mut() {
            record.token(token);
        }
        // A stop token ends the output here (the engine's `Finished` follows): its text is not
        // output, as EOS's is not.
        let pushed = match self.stop_token_ids.contains(&token) {
            true => Ok(String::new()),
            false => self.detok.push(self.codec.as_ref(), token),
        };
        let text = match pushed {
            Ok(text) => text,
            Err(e) => {
                self.stream = None;
                self.record_end(TraceFinish::Error);
                return self.end(Err(ApiError::internal(format!("detokenizing: {e}"))));
            }
        };
        let text = self.stop.push(&text);
        let piece = Piece { text, tokens: vec![token], logprobs: logprobs.into_iter().collect() };
        if self.stop.stopped() {
            // The stop string ends it here: dropping the stream aborts it in the engine.
            self.stream = None;
            self.done = Some(Ok(Finish::Stop));
            self.record_end(TraceFinish::Stop);
        }
        Next::Piece(piece)
    }

    /// The text still held back goes out before the end.
    fn flush(&mut self, finish: Result<Finish, ApiError>, label: TraceFinish) -> Next {
        let tail = self.detok.finish(self.codec.as_ref()).unwrap_or_default();
        let mut text = self.stop.push(&tail);
        if !self.stop.stopped() {
            text.push_str(&self.stop.finish());
        }
        let finish = if self.stop.stopped() { Ok(Finish::Stop) } else { finish };
        self.record_end(if self.stop.stopped() { TraceFinish::Stop } else { label });
        self.done = Some(finish);
        if text.is_empty() {
            self.next_done()
        } else {
            Next::Piece(Piece { text, ..Piece::default() })
        }
    }

    fn next_done(&self) -> Next {
        Next::Done(self.done.clone().expect("set before"))
    }

    /// The outcome is known: the record goes to the trace.
    fn record_end(&mut self, finish: TraceFinish) {
        if let Some(record) = self.record.take() {
            record.finish(finish);
        }
    }

    fn end(&mut self, finish: Result<Finish, ApiError>) -> Next {
        self.done = Some(finish);
        self.next_done()
    }
}
