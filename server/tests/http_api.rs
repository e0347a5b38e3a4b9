//! The HTTP API end to end over real sockets on 127.0.0.1, on the provenance model (a synthetic
//! vocabulary: token n is the word "t<n>"), with every invariant checked after every engine input.

#![allow(clippy::unwrap_used, reason = "test helpers: a failure is the test failing")]

mod common;

use std::time::Duration;

use common::{CONTEXT, FailingExecutor, POISON_SEED, TestServer, sched_config, streamed_text};
use lockstep_core::model::ProvenanceModel;
use lockstep_core::sched::StepMode;
use lockstep_server::client::sse_data;
use lockstep_server::engine::StepCost;
use lockstep_server::node::Drained;
use serde_json::{Value, json};

const MS: Duration = Duration::from_millis(1);

fn slow_steps() -> StepCost {
    StepCost {
        per_step: 2 * MS,
        per_prefill_token: Duration::ZERO,
        per_decode_token: Duration::ZERO,
    }
}

fn completion(prompt: &[u32], max_tokens: u32) -> Value {
    json!({ "model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 })
}

fn text_of(body: &Value) -> String {
    body["choices"][0]["text"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_equals_whole_and_a_crowd_equals_each_alone() {
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let alone = TestServer::provenance(mode, StepCost::ZERO).await;
        let prompts: Vec<Vec<u32>> = (0..12u32)
            .map(|i| (0..3 + i * 5).map(|t| 1 + (i * 37 + t * 11) % 900).collect())
            .collect();
        let mut expected = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let mut body = completion(p, 6 + i as u32 % 5);
            if i % 2 == 1 {
                body["temperature"] = json!(1.0);
                body["seed"] = json!(i);
            }
            // Penalties on a third: their output so far must be the same in the crowd.
            if i % 3 == 2 {
                body["presence_penalty"] = json!(1.5);
                body["frequency_penalty"] = json!(0.75);
            }
            let (status, whole) = alone.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{whole}");
            body["stream"] = json!(true);
            let events = alone.stream("/v1/completions", &body).await;
            assert_eq!(streamed_text(&events), text_of(&whole), "{mode:?}: stream differs");
            body["stream"] = json!(false);
            expected.push((body, text_of(&whole)));
        }
        alone.quiescent().await;

        // All at once, on a node with slow steps so they really share batches.
        let crowd = TestServer::provenance(mode, slow_steps()).await;
        let tasks: Vec<_> = expected
            .iter()
            .map(|(body, _)| crowd.post_in_task("/v1/completions", body.clone()))
            .collect();
        for (task, (_, text)) in tasks.into_iter().zip(&expected) {
            let body: Value = task.await.unwrap();
            assert_eq!(&text_of(&body), text, "{mode:?}: a request differs in a crowd");
        }
        crowd.quiescent().await;
        assert_eq!(crowd.shut_down().await, Drained::Cleanly);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_finish_reasons_logprobs_and_token_ids() {
    let server = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let mut body = completion(&[5, 6, 7], 4);
    body["logprobs"] = json!(2);
    body["return_token_ids"] = json!(true);
    let (status, out) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
    );
    assert_eq!(out["choices"][0]["finish_reason"], "length");
    assert_eq!(out["prompt_token_ids"], json!([5, 6, 7]));
    let ids: Vec<u64> = out["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let words: String = ids.iter().map(|id| format!(" t{id}")).collect();
    assert_eq!(text_of(&out), words, "text is the tokens' words");
    let lp = &out["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|v| v.as_f64().unwrap() <= 0.0));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);

    // Chat: usage arrives last in the stream when asked, with logprobs per token.
    let chat = json!({
        "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 3, "stream": true,
        "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 1,
    });
    let events = server.stream("/v1/chat/completions", &chat).await;
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
    let finish: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("length")]);
    let tokens: usize = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["logprobs"]["content"].as_array().map(Vec::len))
        .sum();
    assert_eq!(tokens, 3, "one logprob entry per token");
}

/// `echo`: each choice's text starts with its prompt's; with `logprobs`, the prompt's tokens come
/// first in the log-probabilities, the first one's null. A prompt token the prompt's start
/// continues with greedily scores exactly what a completion of that start reports for the token
/// it draws (the same logits), across a chunk boundary, after a plain request cached the same
/// prompt (a scored prompt reads no cache), whole and streamed, and for each of several prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_gives_the_prompt_and_its_tokens_log_probabilities() {
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let list = |v: &Value| -> Vec<Value> { v.as_array().unwrap().clone() };
    for mode in [StepMode::Sync, StepMode::Overlap] {
        let server = TestServer::provenance(mode, StepCost::ZERO).await;
        let start = vec![11u32, 42, 7, 300, 5];
        let mut drawing = completion(&start, 20);
        drawing["logprobs"] = json!(3);
        drawing["return_token_ids"] = json!(true);
        let (_, drawn) = server.post("/v1/completions", &drawing).await;
        let continuation = ids(&drawn["choices"][0]["token_ids"]);
        let drawn = &drawn["choices"][0]["logprobs"];
        // 25 tokens: the server's prefill chunks are 16.
        let prompt: Vec<u32> = start.iter().chain(&continuation).copied().collect();
        let (_, plain) = server.post("/v1/completions", &completion(&prompt, 2)).await;

        let mut echo = completion(&prompt, 2);
        echo["echo"] = json!(true);
        echo["logprobs"] = json!(3);
        let (status, out) = server.post("/v1/completions", &echo).await;
        assert_eq!(status, 200, "{out}");
        let words: String = prompt.iter().map(|t| format!(" t{t}")).collect();
        assert_eq!(
            text_of(&out),
            words + &text_of(&plain),
            "{mode:?}: the prompt, then the output"
        );
        let lp = &out["choices"][0]["logprobs"];
        let (scores, tops) = (list(&lp["token_logprobs"]), list(&lp["top_logprobs"]));
        assert_eq!((scores.len(), tops.len(), list(&lp["tokens"]).len()), (27, 27, 27));
        assert_eq!((&scores[0], &tops[0]), (&Value::Null, &Value::Null), "nothing scores token 0");
        for (i, score) in scores.iter().enumerate().take(prompt.len()).skip(1) {
            assert!(score.as_f64().is_some_and(|s| s <= 0.0), "token {i}: {score}");
        }
        assert_eq!(scores[5..25], list(&drawn["token_logprobs"])[..], "{mode:?}: scores");
        assert_eq!(tops[5..25], list(&drawn["top_logprobs"])[..], "{mode:?}: alternatives");
        assert_eq!(
            scores[25..],
            list(&plain_with_logprobs(&server, &prompt).await["token_logprobs"])[..],
            "the output's own, after the prompt's"
        );

        // Streamed: the prompt and its scores ahead of the first token, the rest as they come.
        echo["stream"] = json!(true);
        let events = server.stream("/v1/completions", &echo).await;
        assert_eq!(streamed_text(&events), text_of(&out));
        let streamed: Vec<Value> = events
            .iter()
            .filter_map(|e| e["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned())
            .flatten()
            .collect();
        assert_eq!(streamed, scores, "{mode:?}: streamed scores");

        // Several prompts: each choice echoes its own.
        let other: Vec<u32> = vec![8, 9, 10];
        let mut two = completion(&prompt, 2);
        two["prompt"] = json!([prompt.clone(), other.clone()]);
        two["echo"] = json!(true);
        two["logprobs"] = json!(3);
        let (status, both) = server.post("/v1/completions", &two).await;
        assert_eq!(status, 200, "{both}");
        assert_eq!(both["choices"][0]["text"], out["choices"][0]["text"]);
        assert_eq!(both["choices"][0]["logprobs"], out["choices"][0]["logprobs"]);
        let words: String = other.iter().map(|t| format!(" t{t}")).collect();
        assert!(both["choices"][1]["text"].as_str().unwrap().starts_with(&words), "{both}");
        // Echo without logprobs: the text alone.
        let mut bare = completion(&other, 2);
        bare["echo"] = json!(true);
        let (_, bare) = server.post("/v1/completions", &bare).await;
        assert_eq!(bare["choices"][0]["text"], both["choices"][1]["text"]);
        assert_eq!(bare["choices"][0]["logprobs"], Value::Null);

        // `max_tokens` 0: the prompt and its scores, nothing generated, whole and streamed.
        let mut scored = echo.clone();
        (scored["max_tokens"], scored["stream"]) = (json!(0), json!(false));
        scored["return_token_ids"] = json!(true);
        let (status, only) = server.post("/v1/completions", &scored).await;
        assert_eq!(status, 200, "{only}");
        let words: String = prompt.iter().map(|t| format!(" t{t}")).collect();
        assert_eq!(text_of(&only), words, "{mode:?}: the prompt alone");
        let choice = &only["choices"][0];
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(choice["token_ids"], json!([]));
        assert_eq!(list(&choice["logprobs"]["token_logprobs"])[..], scores[..prompt.len()]);
        assert_eq!(list(&choice["logprobs"]["top_logprobs"])[..], tops[..prompt.len()]);
        assert_eq!(list(&choice["logprobs"]["tokens"]).len(), prompt.len());
        assert_eq!(only["usage"]["completion_tokens"], 0);
        assert_eq!(only["usage"]["prompt_tokens"], prompt.len());
        (scored["stream"], scored["stream_options"]) =
            (json!(true), json!({ "include_usage": true }));
        let events = server.stream("/v1/completions", &scored).await;
        assert_eq!(streamed_text(&events), words);
        let finishes: Vec<&Value> = events
            .iter()
            .filter_map(|e| e["choices"].get(0).map(|c| &c["finish_reason"]))
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes, [&json!("length")]);
        let usage = events.iter().rev().find(|e| e["usage"].is_object()).expect("usage chunk");
        assert_eq!(usage["usage"]["completion_tokens"], 0);
        // Without `echo`, `max_tokens` 0 asks for nothing: refused.
        scored["echo"] = json!(false);
        scored["stream"] = json!(false);
        scored.as_object_mut().unwrap().remove("stream_options");
        let (status, refused) = server.post("/v1/completions", &scored).await;
        assert_eq!(status, 400, "{refused}");
    }
}

/// The log-probabilities of `prompt`'s greedy completion of 2 tokens, 3 alternatives each.
async fn plain_with_logprobs(server: &TestServer, prompt: &[u32]) -> Value {
    let mut body = completion(prompt, 2);
    body["logprobs"] = json!(3);
    let (_, out) = server.post("/v1/completions", &body).await;
    out["choices"][0]["logprobs"].clone()
}

/// Each choice of a request for `n` is its own request with seed `seed + i`: it equals that
/// request for one completion, whole and streamed (its chunks interleaved with the others'), on
/// both endpoints; usage counts the prompt once; and a request for more choices than the queue
/// holds is refused whole, leaving nothing queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_each_equal_a_request_alone_with_its_seed() {
    let server = TestServer::provenance(StepMode::Overlap, slow_steps()).await;
    let chat = |seed: u64, n: u32| {
        json!({"messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 6,
               "temperature": 1.0, "seed": seed, "n": n})
    };
    let mut sampled = completion(&[5, 6, 7], 6);
    sampled["temperature"] = json!(1.0);
    for (path, body) in [("/v1/completions", sampled), ("/v1/chat/completions", chat(40, 1))] {
        let content = |choice: &Value| {
            choice["text"]
                .as_str()
                .or_else(|| choice["message"]["content"].as_str())
                .map(str::to_owned)
        };
        let (mut alone, mut prompt_tokens, mut completion_tokens) = (Vec::new(), 0, 0);
        for i in 0..4u64 {
            let mut one = body.clone();
            one["seed"] = json!(40 + i);
            let (status, out) = server.post(path, &one).await;
            assert_eq!(status, 200, "{out}");
            alone.push(content(&out["choices"][0]).unwrap());
            prompt_tokens = out["usage"]["prompt_tokens"].as_u64().unwrap();
            completion_tokens += out["usage"]["completion_tokens"].as_u64().unwrap();
        }
        assert!(alone.iter().any(|text| text != &alone[0]), "{path}: the seeds draw alike");

        let mut four = body.clone();
        (four["seed"], four["n"]) = (json!(40), json!(4));
        let (status, out) = server.post(path, &four).await;
        assert_eq!(status, 200, "{out}");
        let choices = out["choices"].as_array().unwrap();
        let texts: Vec<String> = choices.iter().map(|c| content(c).unwrap()).collect();
        assert_eq!(texts, alone, "{path}: choice i is the request alone with seed 40 + i");
        let indices: Vec<u64> = choices.iter().map(|c| c["index"].as_u64().unwrap()).collect();
        assert_eq!(indices, [0, 1, 2, 3]);
        assert_eq!(out["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens), "counted once");
        assert_eq!(out["usage"]["completion_tokens"].as_u64(), Some(completion_tokens));

        four["stream"] = json!(true);
        four["stream_options"] = json!({"include_usage": true});
        let events = server.stream(path, &four).await;
        let mut streamed = vec![String::new(); 4];
        let mut finished = [0; 4];
        for event in &events[..events.len() - 1] {
            for choice in event["choices"].as_array().unwrap() {
                let i = choice["index"].as_u64().unwrap() as usize;
                let delta = choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str());
                streamed[i].push_str(delta.unwrap_or_default());
                finished[i] += usize::from(!choice["finish_reason"].is_null());
            }
            assert!(event["usage"].is_null(), "usage only in the last chunk: {event}");
        }
        assert_eq!(streamed, alone, "{path}: streamed choices");
        assert_eq!(finished, [1; 4], "{path}: one finish reason a choice");
        let last = events.last().unwrap();
        assert_eq!(last["choices"].as_array().map(Vec::len), Some(0), "{last}");
        assert_eq!(last["usage"]["completion_tokens"].as_u64(), Some(completion_tokens), "{last}");
    }
    server.quiescent().await;

    // Room for 2 running and 4 waiting: 16 choices cannot all be queued.
    let small = sched_config(StepMode::Sync);
    let small = lockstep_core::sched::SchedConfig { running_max: 2, waiting_max: 4, ..small };
    let server = TestServer::provenance_with(small, slow_steps(), |_| {}).await;
    let (status, out) = server.post("/v1/chat/completions", &chat(1, 16)).await;
    assert_eq!(status, 429, "{out}");
    server.quiescent().await;
    let (status, out) = server.post("/v1/chat/completions", &chat(1, 4)).await;
    assert_eq!((status, out["choices"].as_array().map(Vec::len)), (200, Some(4)), "{out}");
    server.quiescent().await;
}

/// Presence and frequency penalties change long outputs (the provenance model's candidates meet
/// earlier output tokens often enough in 150), and a penalized request's output, which reads
/// its output so far, is the same alone and in a crowd of slow overlapped steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_change_the_output_and_a_penalized_request_equals_itself_alone() {
    let body = |i: u32, presence: f64, frequency: f64| {
        let mut body = completion(&[1 + i, 2 + i * 7, 3 + i * 11], 150);
        body["presence_penalty"] = json!(presence);
        body["frequency_penalty"] = json!(frequency);
        body
    };
    let alone = TestServer::provenance(StepMode::Overlap, StepCost::ZERO).await;
    let penalties = [(-2.0, 0.0), (0.0, -1.5), (1.0, 2.0), (-1.0, 0.5)];
    // The last two also with a repetition penalty (which reads the prompt's tokens too).
    let mut expected = Vec::new();
    for (i, &(presence, frequency)) in (0..).zip(&penalties) {
        let (_, plain) = alone.post("/v1/completions", &body(i, 0.0, 0.0)).await;
        let mut penalized_body = body(i, presence, frequency);
        if i >= 2 {
            penalized_body["repetition_penalty"] = json!(1.4);
        }
        let (status, penalized) = alone.post("/v1/completions", &penalized_body).await;
        assert_eq!(status, 200, "{penalized}");
        if presence < 0.0 || frequency < 0.0 {
            // Rewarding repeats shows within 150 tokens of a 1000-token vocabulary.
            assert_ne!(text_of(&penalized), text_of(&plain), "request {i}: no change");
        }
        expected.push((penalized_body, text_of(&penalized)));
    }
    alone.quiescent().await;
    let crowd = TestServer::provenance(StepMode::Overlap, slow_steps()).await;
    let tasks: Vec<_> =
        expected.iter().map(|(b, _)| crowd.post_in_task("/v1/completions", b.clone())).collect();
    for (task, (_, text)) in tasks.into_iter().zip(&expected) {
        assert_eq!(&text_of(&task.await.unwrap()), text, "a penalized request differs in a crowd");
    }
    crowd.quiescent().await;
}

/// `min_p` (vLLM's) of 1 keeps only the most likely token: a hot sampled request gives the
/// greedy output; a small one leaves sampling sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_min_p_of_one_samples_the_greedy_output() {
    let server = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let greedy = completion(&[3, 1, 4, 1, 5], 12);
    let (_, expected) = server.post("/v1/completions", &greedy).await;
    let mut hot = greedy.clone();
    (hot["temperature"], hot["seed"]) = (json!(2.0), json!(11));
    let (_, sampled) = server.post("/v1/completions", &hot).await;
    assert_ne!(text_of(&sampled), text_of(&expected), "temperature 2 draws otherwise");
    hot["min_p"] = json!(1.0);
    let (status, cut) = server.post("/v1/completions", &hot).await;
    assert_eq!(status, 200, "{cut}");
    assert_eq!(text_of(&cut), text_of(&expected));
    server.quiescent().await;
}

/// `stop_token_ids` (vLLM's): the output ends at the first of them, which is in `token_ids`
/// but not in the text, whole or streamed, with finish reason `stop`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_token_ids_end_the_output_without_their_text() {
    let server = TestServer::provenance(StepMode::Overlap, StepCost::ZERO).await;
    let mut body = completion(&[9, 8, 7], 8);
    body["return_token_ids"] = json!(true);
    let (_, full) = server.post("/v1/completions", &body).await;
    let ids: Vec<u64> = full["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // The first token not seen before it: the output stops at its first occurrence.
    let at = (1..ids.len()).find(|&i| !ids[..i].contains(&ids[i])).unwrap();
    body["stop_token_ids"] = json!([ids[at], 999]);
    let (status, stopped) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{stopped}");
    let choice = &stopped["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["token_ids"].as_array().unwrap().len(), at + 1, "{stopped}");
    let words: Vec<String> = ids[..at].iter().map(|t| format!(" t{t}")).collect();
    assert_eq!(text_of(&stopped), words.concat(), "the stop token's text is left out");
    body["stream"] = json!(true);
    let events = server.stream("/v1/completions", &body).await;
    assert_eq!(streamed_text(&events), words.concat());
    server.quiescent().await;
}

/// `logit_bias`: -100 on a greedy choice takes it away, whole and streamed, and a biased
/// request equals itself alone in a crowd (chat too: the keys are the tokenizer's ids).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logit_bias_moves_the_choice_and_holds_in_a_crowd() {
    let server = TestServer::provenance(StepMode::Overlap, slow_steps()).await;
    let mut body = completion(&[4, 5, 6], 6);
    body["return_token_ids"] = json!(true);
    let (_, plain) = server.post("/v1/completions", &body).await;
    let first = plain["choices"][0]["token_ids"][0].as_u64().unwrap();
    body["logit_bias"] = json!({ first.to_string(): -100, "999": 100 });
    let (status, biased) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{biased}");
    let biased_first = biased["choices"][0]["token_ids"][0].as_u64().unwrap();
    assert_ne!(biased_first, first, "the bias took the greedy choice away: {biased}");
    body["stream"] = json!(true);
    assert_eq!(streamed_text(&server.stream("/v1/completions", &body).await), text_of(&biased));
    body["stream"] = json!(false);
    let crowd: Vec<_> = (0..6)
        .map(|i| {
            let other = completion(&[7 + i, 8, 9], 6);
            server.post_in_task("/v1/completions", if i == 3 { body.clone() } else { other })
        })
        .collect();
    for (i, task) in crowd.into_iter().enumerate() {
        let out = task.await.unwrap();
        if i == 3 {
            assert_eq!(text_of(&out), text_of(&biased), "the biased request in a crowd");
        }
    }
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_output_across_tokens_and_free_the_request() {
    let server = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let (_, whole) = server.post("/v1/completions", &completion(&[9, 8, 7], 8)).await;
    let text = text_of(&whole);
    // A stop string spanning the boundary between the second and third tokens.
    let words: Vec<&str> = text.split(' ').filter(|w| !w.is_empty()).collect();
    let stop = format!("{} {}", &words[1][1..], &words[2][..2]);
    let cut = text.find(&stop).unwrap();
    for stream in [false, true] {
        let mut body = completion(&[9, 8, 7], 8);
        body["stop"] = json!([stop.clone(), "never"]);
        body["stream"] = json!(stream);
        let (got, finish) = if stream {
            let events = server.stream("/v1/completions", &body).await;
            let finish = events
                .iter()
                .rev()
                .find_map(|e| e["choices"][0]["finish_reason"].as_str().map(str::to_owned));
            (streamed_text(&events), finish.unwrap())
        } else {
            let (status, out) = server.post("/v1/completions", &body).await;
            assert_eq!(status, 200);
            (text_of(&out), out["choices"][0]["finish_reason"].as_str().unwrap().to_owned())
        };
        assert_eq!(got, text[..cut], "stream {stream}");
        assert_eq!(finish, "stop");
    }
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_4xx_with_an_openai_error_and_nothing_breaks() {
    let server = TestServer::provenance_with(sched_config(StepMode::Sync), StepCost::ZERO, |app| {
        app.body_bytes_max = 4096;
    })
    .await;
    let long: Vec<u32> = (0..CONTEXT).map(|t| t % 900 + 1).collect();
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/completions", "{not json".into(), 400),
        ("/v1/completions", json!({"prompt": "t1", "temperature": "hot"}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "model": "gpt-9"}).to_string(), 404),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "max_tokens": 4_000_000_000u64}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "max_tokens": 0}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "n": 17}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "stop_token_ids": vec![5; 65]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "stop_token_ids": [1000]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "min_p": 1.5}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "repetition_penalty": 0}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "repetition_penalty": 2.5}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "logit_bias": {"t5": 1}}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "logit_bias": {"5": 100.5}}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "logit_bias": {"1000": 1}}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "logit_bias": {"5": 1, "05": 2}}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "logit_bias": (0..301).map(|t| (t.to_string(), json!(1))).collect::<serde_json::Map<_, _>>()}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "n": 0}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "top_p": 0}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [1, 2], "temperature": -1}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [999_999]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": []}).to_string(), 400),
        ("/v1/completions", json!({"prompt": {"a": 1}}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "logprobs": 21}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "stop": vec!["x"; 17]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "presence_penalty": 2.5}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "frequency_penalty": -2.01}).to_string(), 400),
        ("/v1/completions", format!("{{\"prompt\": \"{}\"}}", "t1 ".repeat(2000)), 413),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": 5}]}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": "t1", "temperature": 2.00000001}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [[[1, 2]]]}).to_string(), 400),
        ("/v1/completions", json!({"prompt": [["t1"]]}).to_string(), 400),
        ("/v1/nothing", "{}".into(), 404),
    ];
    for (path, body, expected) in cases {
        let mut c = server.connect().await;
        let response = c.post(path, &body).await.unwrap();
        let status = response.status.as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, expected, "{path} {body:.80}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert!(error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        assert!(error["error"]["type"].is_string(), "{text}");
    }
    let (status, _) = server.get("/v1/completions").await;
    assert_eq!(status, 405);
    let (status, out) = server.post("/v1/completions", &completion(&[1, 2, 3], 2)).await;
    assert_eq!(status, 200, "the server still serves: {out}");
    // Inside the ranges, however close to their ends: accepted.
    for body in [
        json!({"prompt": "t1", "top_p": 1e-46, "max_tokens": 2}),
        json!({"prompt": ["t1 t2"], "temperature": 2.0, "max_tokens": 2}),
        json!({"prompt": [[1, 2]], "max_tokens": 2}),
    ] {
        let (status, out) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{body}: {out}");
    }
    server.quiescent().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_at_ten_times_the_queue_gives_only_200_or_429_and_leaks_nothing() {
    let mut config = sched_config(StepMode::Overlap);
    config.waiting_max = 4;
    config.running_max = 2;
    config.step_tokens_max = 16;
    let server = TestServer::provenance_with(config, slow_steps(), |_| {}).await;
    let tasks: Vec<_> = (0..60u32)
        .map(|i| {
            let addr = server.addr;
            tokio::spawn(async move {
                let io = tokio::net::TcpStream::connect(addr).await.unwrap();
                let mut c = lockstep_server::client::Connection::new(io).await.unwrap();
                let body = completion(&[1 + i, 2, 3], 4).to_string();
                let response = c.post("/v1/completions", &body).await.unwrap();
                let retry = response.headers.get("retry-after").is_some();
                (response.status.as_u16(), retry, response.text().await.unwrap())
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for task in tasks {
        let (status, retry_after, text) = task.await.unwrap();
        match status {
            200 => ok += 1,
            429 => {
                assert!(retry_after, "429 carries Retry-After");
                assert!(text.contains("rate_limit"), "{text}");
                refused += 1;
            }
            other => panic!("status {other}: {text}"),
        }
    }
    // At least the waiting queue's worth is admitted; more only if steps move requests to running
    // while the 60 arrive, which a busy machine may not do before the engine has taken every
    // submission (a fresh-clone CI run sharing its cores served 5).
    assert!(ok >= 4 && refused > 0, "{ok} served, {refused} refused");
    server.quiescent().await;
    let (_, metrics) = server.get("/metrics").await;
    assert!(
        metrics.contains("lockstep:requests_rejected_queue_full_total{model_name=\"test-model\"} ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_clients_leaving_mid_stream_leave_no_page_held() {
    let mut config = sched_config(StepMode::Overlap);
    config.waiting_max = 128;
    let server = TestServer::provenance_with(config, slow_steps(), |_| {}).await;
    let tasks: Vec<_> = (0..100u32)
        .map(|i| {
            let addr = server.addr;
            tokio::spawn(async move {
                let io = tokio::net::TcpStream::connect(addr).await.unwrap();
                let mut c = lockstep_server::client::Connection::new(io).await.unwrap();
                let mut body = completion(&[1 + i % 50, 2, 3, 4, 5], 200);
                body["stream"] = json!(true);
                let mut response = c.post("/v1/completions", &body.to_string()).await.unwrap();
                assert_eq!(response.status.as_u16(), 200);
                // Read a little (or nothing), then hang up.
                for _ in 0..i % 3 {
                    response.frame().await.unwrap();
                }
                drop(response);
                drop(c);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    server.quiescent().await;
    let (_, metrics) = server.get("/metrics").await;
    let aborted = metrics
        .lines()
        .find(|l| l.starts_with("lockstep:client_aborts_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap();
    assert!(aborted >= 90, "{aborted} aborts counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_or_panicking_step_fails_its_request_and_the_engine_serves_on() {
    for panic in [false, true] {
        let config = sched_config(StepMode::Sync);
        let model = ProvenanceModel::new(config.pool, config.running_max, common::VOCAB);
        let server = TestServer::with_executor(
            config,
            FailingExecutor::new(model, panic),
            StepCost::ZERO,
            |_| {},
        )
        .await;
        let (status, _) = server.post("/v1/completions", &completion(&[1, 2], 3)).await;
        assert_eq!(status, 200);
        let mut poisoned = completion(&[4, 5, 6], 3);
        poisoned["seed"] = json!(POISON_SEED);
        let (status, error) = server.post("/v1/completions", &poisoned).await;
        assert_eq!(status, 500, "{error}");
        assert_eq!(error["error"]["type"], "server_error");
        poisoned["stream"] = json!(true);
        let events = server.stream("/v1/completions", &poisoned).await;
        assert!(events.last().unwrap()["error"]["message"].is_string(), "{events:?}");
        for i in 0..4 {
            let (status, out) = server.post("/v1/completions", &completion(&[7 + i, 8], 3)).await;
            assert_eq!(status, 200, "panic {panic}: {out}");
        }
        server.quiescent().await;
        let (status, _) = server.get("/health").await;
        assert_eq!(status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_fails_when_the_engine_holds_work_and_makes_no_progress() {
    let hour = StepCost { per_step: Duration::from_secs(3600), ..StepCost::ZERO };
    let server = TestServer::provenance_with(sched_config(StepMode::Sync), hour, |app| {
        app.health_stall_max = Duration::from_millis(200);
    })
    .await;
    let (status, body) = server.get("/health").await;
    assert_eq!((status, body.contains("\"ok\"")), (200, true), "idle is healthy");
    let addr = server.addr;
    let stuck = tokio::spawn(async move {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut c = lockstep_server::client::Connection::new(io).await.unwrap();
        let _ = c.post("/v1/completions", &completion(&[1, 2], 2).to_string()).await;
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, body) = server.get("/health").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("stalled"), "{body}");
    stuck.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_metrics_and_a_drain_that_finishes_open_requests_and_refuses_new_ones() {
    let server = TestServer::provenance(StepMode::Sync, slow_steps()).await;
    let (status, models) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "test-model");
    let (_, _) = server.post("/v1/completions", &completion(&[3, 4], 5)).await;
    let (_, metrics) = server.get("/metrics").await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:generation_tokens_total{model_name=\"test-model\"} 5",
        "lockstep:steps_total",
    ] {
        assert!(metrics.contains(name), "{name} missing");
    }

    // A long request is open when shutdown starts: it finishes, a new one is refused.
    let addr = server.addr;
    let open = tokio::spawn(async move {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut c = lockstep_server::client::Connection::new(io).await.unwrap();
        let response =
            c.post("/v1/completions", &completion(&[5, 6], 40).to_string()).await.unwrap();
        (response.status.as_u16(), response.json().await.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut late = server.connect().await;
    let state = server.state.clone();
    let drained = tokio::spawn(server.shut_down());
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(state.engine.stats().draining());
    let refused = late.post("/v1/completions", &completion(&[7], 2).to_string()).await;
    if let Ok(response) = refused {
        assert_eq!(response.status.as_u16(), 503, "new work is refused while draining");
    }
    let (status, body) = open.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 40);
    assert_eq!(drained.await.unwrap(), Drained::Cleanly);
}

/// `--api-key`: every route but /health, /metrics and /openapi.json answers a request without
/// the key, or with another, with OpenAI's 401 (and `WWW-Authenticate: Bearer`), before it reads
/// the body; with the key the request is served; the document shows the scheme.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_server_serves_only_the_bearer_of_its_key() {
    let key = "sk-lockstep-test";
    let server = TestServer::provenance_with(sched_config(StepMode::Sync), StepCost::ZERO, |app| {
        app.api_key = Some(lockstep_server::http::ApiKey::new(key).unwrap());
    })
    .await;
    let body = completion(&[3, 4], 2).to_string();
    for (path, method) in [
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/tokenize", "post"),
        ("/nowhere", "get"),
    ] {
        for bearer in [None, Some("sk-other"), Some("sk-lockstep-tes")] {
            let mut c = server.connect().await;
            if let Some(bearer) = bearer {
                c = c.with_api_key(bearer);
            }
            let response = match method {
                "post" => c.post(path, &body).await.unwrap(),
                _ => c.get(path).await.unwrap(),
            };
            assert_eq!(response.status.as_u16(), 401, "{path} with {bearer:?}");
            assert_eq!(response.headers["www-authenticate"], "Bearer");
            let error = response.json().await.unwrap();
            assert_eq!(error["error"]["code"], "invalid_api_key", "{error}");
        }
    }
    let mut c = server.connect().await.with_api_key(key);
    let response = c.post("/v1/completions", &body).await.unwrap();
    assert_eq!(response.status.as_u16(), 200);
    assert_eq!(response.json().await.unwrap()["usage"]["completion_tokens"], 2);
    for path in lockstep_server::http::OPEN_PATHS {
        assert_eq!(server.get(path).await.0, 200, "{path} is open");
    }
    let (_, doc) = server.get("/openapi.json").await;
    let doc: Value = serde_json::from_str(&doc).unwrap();
    assert_eq!(doc["components"]["securitySchemes"]["apiKey"]["scheme"], "bearer");
    assert!(doc["paths"]["/v1/completions"]["post"]["responses"]["401"].is_object());
    assert_eq!(doc["paths"]["/health"]["get"]["security"], json!([]));
    let (_, metrics) = server.get("/metrics").await;
    assert_eq!(common::counter(&metrics, "lockstep:requests_rejected_unauthorized_total"), 15);
}

/// `--scheduling-policy priority`: requests waiting behind a running one are admitted lowest
/// `priority` first, not in arrival order; a server in arrival order (the default) refuses a
/// priority other than 0, and any server one past 32 bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_order_the_waiting_on_a_priority_server_and_are_refused_on_fcfs() {
    let mut config = sched_config(StepMode::Sync);
    config.running_max = 1;
    let steps = StepCost { per_step: 3 * MS, ..StepCost::ZERO };
    let server = TestServer::provenance_with(config.clone(), steps, |app| {
        app.priority_scheduling = true;
    })
    .await;
    let running = server.post_in_task("/v1/completions", completion(&[1, 2], 30));
    tokio::time::sleep(20 * MS).await;
    let finished = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for (i, priority) in [5, 0, -5].into_iter().enumerate() {
        let mut body = completion(&[10 + i as u32, 3], 3);
        body["priority"] = json!(priority);
        let (answer, finished) = (server.post_in_task("/v1/completions", body), finished.clone());
        waiting.push(tokio::spawn(async move {
            let answer = answer.await.unwrap();
            finished.lock().unwrap().push(priority);
            answer
        }));
        tokio::time::sleep(2 * MS).await;
    }
    assert_eq!(running.await.unwrap()["usage"]["completion_tokens"], 30);
    for answer in waiting {
        assert_eq!(answer.await.unwrap()["usage"]["completion_tokens"], 3);
    }
    assert_eq!(*finished.lock().unwrap(), [-5, 0, 5], "admitted by priority, then arrival");

    let fcfs = TestServer::provenance_with(config, StepCost::ZERO, |_| {}).await;
    for (priority, status) in [(json!(0), 200), (json!(5), 400), (json!(1u64 << 40), 400)] {
        let mut body = completion(&[1, 2], 2);
        body["priority"] = priority.clone();
        let (got, answer) = fcfs.post("/v1/completions", &body).await;
        assert_eq!(got, status, "{priority}: {answer}");
        if status == 400 {
            assert_eq!(answer["error"]["param"], "priority", "{answer}");
        }
    }
}

/// A list of prompts (OpenAI's batch, as lm-eval-harness sends one): prompt `p`'s completion `i`
/// is choice `p * n + i`, each what a request for that prompt alone gives it (seed + i); usage
/// counts each prompt once; streamed equals whole; more completions than `PROMPTS_MAX`, or a
/// list mixing text and ids, is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_is_answered_as_choices_each_its_prompt_s_alone() {
    let server = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let prompts = [vec![3u32, 4, 5], vec![9, 8], vec![20, 21, 22, 23]];
    let request = |prompt: Value| {
        json!({"model": "test-model", "prompt": prompt, "max_tokens": 5, "n": 2,
            "temperature": 0.8, "seed": 11, "return_token_ids": true})
    };
    let (status, batch) = server.post("/v1/completions", &request(json!(prompts))).await;
    assert_eq!(status, 200, "{batch}");
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{batch}");
    for (p, prompt) in prompts.iter().enumerate() {
        let (_, alone) = server.post("/v1/completions", &request(json!(prompt))).await;
        assert_eq!(alone["prompt_token_ids"], json!(prompt));
        for i in 0..2 {
            let (choice, alone) = (&choices[p * 2 + i], &alone["choices"][i]);
            assert_eq!(choice["index"], p * 2 + i);
            assert_eq!(
                (&choice["text"], &choice["token_ids"]),
                (&alone["text"], &alone["token_ids"])
            );
            assert_eq!(choice["prompt_token_ids"], json!(prompt));
        }
    }
    assert_eq!(batch["usage"]["prompt_tokens"], 9, "each prompt once");
    assert_eq!(batch["usage"]["completion_tokens"], 30);
    assert!(batch.get("prompt_token_ids").is_none(), "each choice names its own");

    let mut streamed = request(json!(prompts));
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/completions", &streamed).await;
    let mut texts = vec![String::new(); 6];
    for event in &events {
        for choice in event["choices"].as_array().unwrap() {
            texts[choice["index"].as_u64().unwrap() as usize] += choice["text"].as_str().unwrap();
        }
    }
    for (text, choice) in texts.iter().zip(choices) {
        assert_eq!(text, choice["text"].as_str().unwrap());
    }
    assert_eq!(events.last().unwrap()["usage"]["prompt_tokens"], 9);

    let texts: Vec<String> = (0..33).map(|i| format!("t{i}")).collect();
    for bad in [json!(texts), json!(["t1", [1, 2]]), json!([[1, 2], "t1"])] {
        let (status, error) = server.post("/v1/completions", &request(bad.clone())).await;
        assert_eq!((status, &error["error"]["param"]), (400, &json!("prompt")), "{bad}: {error}");
    }
    server.quiescent().await;
}

/// A stream with nothing to say for `sse_keep_alive` says an empty comment, which SSE clients
/// skip: its data are those of a stream without them, and a fast stream has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_between_tokens_keeps_alive_with_comments_clients_skip() {
    let prompt: Vec<u32> = (1..9).collect();
    let mut body = completion(&prompt, 4);
    body["stream"] = json!(true);
    let raw = async |server: &TestServer| {
        let response = server.connect().await.post("/v1/completions", &body.to_string()).await;
        let response = response.unwrap();
        assert_eq!(response.status.as_u16(), 200);
        response.text().await.unwrap()
    };
    let fast = TestServer::provenance(StepMode::Sync, StepCost::ZERO).await;
    let without = raw(&fast).await;
    assert!(!without.lines().any(|l| l.starts_with(':')), "{without}");

    let steps = StepCost { per_step: 60 * MS, ..StepCost::ZERO };
    let config = sched_config(StepMode::Sync);
    let slow = TestServer::provenance_with(config, steps, |app| app.sse_keep_alive = 20 * MS).await;
    let with = raw(&slow).await;
    let comments = with.split("\n\n").filter(|event| *event == ":").count();
    assert!(comments >= 4, "a comment in each 60 ms gap between events: {with}");
    assert_eq!(sse_data(&with), sse_data(&without));
    slow.quiescent().await;
}
