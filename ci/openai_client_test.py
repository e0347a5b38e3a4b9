"""The unchanged `openai` Python client against a running lockstep server.

Run by ci/api-conformance.sh, once against `--executor provenance` (synthetic vocabulary: token n
is the word " t<n>", no end-of-sequence token, so outputs run to max_tokens) and once against the
real default model. Prints `PASS <check>` or `FAIL <check>: <why>` per check; the shell counts
them. Exits non-zero if any check failed.

    python ci/openai_client_test.py --base-url http://127.0.0.1:PORT --mode provenance|model

Tool calls are not checked here: the provenance model cannot produce them; the Rust tests cover
them with a scripted executor.
"""

import argparse
import json
import sys
import traceback
import urllib.request

import jsonschema_rs
import openai
import openapi_spec_validator

TIMEOUT_S = 60
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


# --- the document's schemas, for what schemathesis cannot see inside streamed events ---------


def to_json_schema(node):
    """OpenAPI 3.0 schema to JSON Schema draft 4, as schemathesis reads it: `nullable` becomes
    a union with null (siblings of `$ref` do not occur in the document)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


class Schemas:
    def __init__(self, base_url):
        with urllib.request.urlopen(f"{base_url}/openapi.json", timeout=TIMEOUT_S) as r:
            self.doc = json.load(r)
        self.components = to_json_schema(self.doc["components"])
        self.validators = {}

    def validate(self, name, value):
        if name not in self.validators:
            root = {"$ref": f"#/components/schemas/{name}", "components": self.components}
            self.validators[name] = jsonschema_rs.Draft4Validator(root)
        errors = [str(e) for e in self.validators[name].iter_errors(value)]
        expect(not errors, f"{name} violates the document: {errors[:3]} in {value}")


def raw_events(base_url, path, body):
    """POSTs a streaming request and returns each event's data, `[DONE]` checked last."""
    request = urllib.request.Request(
        f"{base_url}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
        expect(r.headers.get_content_type() == "text/event-stream", r.headers["content-type"])
        text = r.read().decode()
    data = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    expect(data and data[-1] == "[DONE]", f"the stream does not end with [DONE]: {data[-2:]}")
    return [json.loads(d) for d in data[:-1]]


class Session:
    """The client, the server's document, and the model's name once `models.list` gave it."""

    def __init__(self, client, base_url):
        self.client = client
        self.base_url = base_url
        self.model = None
        self.schemas = Schemas(base_url)

    def chat(self, **kw):
        return self.client.chat.completions.create(model=self.model, **kw)

    def complete(self, **kw):
        return self.client.completions.create(model=self.model, **kw)


# --- provenance: deterministic, synthetic vocabulary -----------------------------------------


USER = [{"role": "user", "content": "t1 t2 t3 t4"}]


def document_is_valid_openapi(t):
    expect(t.schemas.doc["openapi"] == "3.0.3", t.schemas.doc["openapi"])
    openapi_spec_validator.validate(t.schemas.doc)


check(document_is_valid_openapi)


@check
def models_list(t):
    models = t.client.models.list().data
    expect(len(models) == 1, f"{len(models)} models")
    t.model = models[0].id
    expect(t.model == "provenance", t.model)
    expect(models[0].object == "model", models[0].object)


@check
def chat_whole(t):
    r = t.chat(messages=USER, max_tokens=8, temperature=0)
    choice = r.choices[0]
    expect(r.object == "chat.completion", r.object)
    expect(choice.message.role == "assistant", choice.message.role)
    expect(choice.finish_reason == "length", choice.finish_reason)
    words = choice.message.content.split()
    expect(len(words) == 8 and all(w.startswith("t") for w in words), choice.message.content)
    expect(r.usage.completion_tokens == 8, r.usage)
    expect(r.usage.total_tokens == r.usage.prompt_tokens + 8, r.usage)


@check
def chat_stream_equals_whole(t):
    whole = t.chat(messages=USER, max_tokens=12, temperature=0).choices[0]
    stream = t.chat(messages=USER, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    expect(chunks[0].choices[0].delta.role == "assistant", chunks[0])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    expect(finishes[-1] == "length" and not any(finishes[:-1]), finishes)
    expect(text == whole.message.content, f"stream {text!r} != whole {whole.message.content!r}")


@check
def chat_seeded_sampling_repeats(t):
    kw = dict(messages=USER, max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    first, second = t.chat(**kw), t.chat(**kw)
    expect(first.choices[0].message.content == second.choices[0].message.content, "seed ignored")


@check
def chat_n_choices_are_the_seeds_alone(t):
    kw = dict(messages=USER, max_tokens=8, temperature=1.0, seed=7)
    alone = [t.chat(**{**kw, "seed": 7 + i}).choices[0].message.content for i in range(3)]
    r = t.chat(n=3, **kw)
    expect([c.index for c in r.choices] == [0, 1, 2], r.choices)
    expect([c.message.content for c in r.choices] == alone, f"{r.choices} != {alone}")
    streamed = ["", "", ""]
    for chunk in t.chat(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    expect(streamed == alone, f"streamed {streamed} != {alone}")


@check
def chat_penalties_and_logit_bias_are_taken(t):
    r = t.chat(messages=USER, max_tokens=8, temperature=0, presence_penalty=1.5,
               frequency_penalty=-0.5, logit_bias={"5": -100, "7": 3},
               extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "stop_token_ids": [999]})
    expect(r.choices[0].finish_reason == "length", r.choices[0])


@check
def completions_token_ids(t):
    r = t.complete(prompt=[1, 2, 3], max_tokens=5, temperature=0,
                   extra_body={"return_token_ids": True})
    choice = r.choices[0]
    expect(r.object == "text_completion", r.object)
    expect(r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 5, r.usage)
    expect(choice.finish_reason == "length", choice.finish_reason)
    ids = choice.model_extra.get("token_ids")
    expect(ids is not None and len(ids) == 5, ids)
    expect(choice.text == "".join(f" t{i}" for i in ids), f"{choice.text!r} vs {ids}")
    expect(r.model_extra.get("prompt_token_ids") == [1, 2, 3], r.model_extra)


@check
def completions_text_and_list_prompts_agree(t):
    texts = {
        t.complete(prompt=p, max_tokens=4, temperature=0).choices[0].text
        for p in ("t1 t2 t3", ["t1 t2 t3"], [1, 2, 3], [[1, 2, 3]])
    }
    expect(len(texts) == 1, texts)


@check
def completions_stop_string(t):
    text = t.complete(prompt=[7, 8], max_tokens=6, temperature=0).choices[0].text
    words = text.split()
    stop = f" {words[3]}"
    r = t.complete(prompt=[7, 8], max_tokens=6, temperature=0, stop=[stop])
    expect(r.choices[0].text == text[: text.index(stop)], f"{r.choices[0].text!r} of {text!r}")
    expect(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)


@check
def chat_stream_include_usage(t):
    chunks = list(t.chat(messages=USER, max_tokens=6, stream=True,
                         stream_options={"include_usage": True}))
    last = chunks[-1]
    expect(last.choices == [] and last.usage is not None, last)
    expect(last.usage.completion_tokens == 6, last.usage)
    expect(all(c.usage is None for c in chunks[:-1]), "usage before the last chunk")


@check
def completions_stream_include_usage(t):
    chunks = list(t.complete(prompt=[5, 6], max_tokens=6, stream=True,
                             stream_options={"include_usage": True}))
    last = chunks[-1]
    expect(last.choices == [] and last.usage is not None, last)
    expect(last.usage.prompt_tokens == 2 and last.usage.completion_tokens == 6, last.usage)
    expect(chunks[-2].choices[0].finish_reason == "length", chunks[-2])


@check
def chat_logprobs(t):
    r = t.chat(messages=USER, max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    expect(len(content) == 4, content)
    expect("".join(c.token for c in content) == r.choices[0].message.content, content)
    for c in content:
        expect(c.logprob <= 0 and len(c.top_logprobs) == 3, c)
        expect(bytes(c.bytes).decode() == c.token, c)
        tops = [a.logprob for a in c.top_logprobs]
        expect(tops == sorted(tops, reverse=True) and c.logprob <= tops[0], tops)


@check
def completions_logprobs(t):
    r = t.complete(prompt=[1, 2], max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    expect(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4, lp)
    expect("".join(lp.tokens) == r.choices[0].text, lp.tokens)
    offsets = [sum(len(tok) for tok in lp.tokens[:i]) for i in range(4)]
    expect(lp.text_offset == offsets, (lp.text_offset, offsets))
    expect(all(1 <= len(top) <= 2 for top in lp.top_logprobs), lp.top_logprobs)


@check
def bad_temperature_is_bad_request(t):
    try:
        t.chat(messages=USER, max_tokens=2, temperature=3)
    except openai.BadRequestError as e:
        expect(e.status_code == 400, e.status_code)
        expect(e.body.get("param") == "temperature", e.body)
        return
    raise AssertionError("temperature 3 was accepted")


@check
def unknown_model_is_not_found(t):
    try:
        t.client.chat.completions.create(model="no-such-model", messages=USER, max_tokens=2)
    except openai.NotFoundError as e:
        expect(e.body.get("code") == "model_not_found", e.body)
        return
    raise AssertionError("an unknown model was served")


@check
def streamed_chat_chunks_match_the_document(t):
    body = {"model": t.model, "messages": USER, "max_tokens": 5, "stream": True,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    for chunk in raw_events(t.base_url, "/v1/chat/completions", body):
        t.schemas.validate("ChatCompletionChunk", chunk)


@check
def streamed_completion_chunks_match_the_document(t):
    body = {"model": t.model, "prompt": [3, 4], "max_tokens": 5, "stream": True, "logprobs": 2,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    for chunk in raw_events(t.base_url, "/v1/completions", body):
        t.schemas.validate("CompletionChunk", chunk)
    body.update(stream_options=None, logprobs=None, return_token_ids=False, stop=["t"])
    for chunk in raw_events(t.base_url, "/v1/completions", body):
        t.schemas.validate("CompletionChunk", chunk)


# --- the real default model ------------------------------------------------------------------


MODEL_CHECKS = []


def model_check(fn):
    MODEL_CHECKS.append(fn)
    return fn


model_check(document_is_valid_openapi)


@model_check
def model_is_listed(t):
    models = t.client.models.list().data
    expect(len(models) == 1, models)
    t.model = models[0].id


@model_check
def model_chat_stream_equals_whole(t):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    kw = dict(messages=messages, max_tokens=16, temperature=0)
    whole = t.chat(**kw).choices[0]
    chunks = list(t.chat(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expect(whole.message.content.strip(), f"empty answer {whole.message.content!r}")
    expect(text == whole.message.content, f"stream {text!r} != whole {whole.message.content!r}")
    expect(finish == [whole.finish_reason], (finish, whole.finish_reason))
    print(f"  model answered: {text!r} ({whole.finish_reason})")
    # Greedy SmolLM2-135M-Instruct knows this one: a wrong template or broken numerics do not.
    expect("Paris" in text, f"no Paris in {text!r}")


@model_check
def model_json_schema_response_format(t):
    # The client's structured-output form: the reply parses, and follows the schema.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    for stream in (False, True):
        kw = dict(messages=messages, max_tokens=48, temperature=0, response_format=fmt)
        if stream:
            chunks = list(t.chat(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = t.chat(**kw).choices[0].message.content
        value = json.loads(text)
        expect(set(value) == {"city", "country"}, f"not the schema's keys: {text!r}")
        expect(all(isinstance(v, str) for v in value.values()), f"not strings: {text!r}")
    print(f"  held to the schema: {text!r}")



TOOL_CHECKS = []

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@TOOL_CHECKS.append
def tool_call_whole(t):
    # The scripted server's model always answers with a Hermes call to get_weather.
    reply = t.client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], max_tokens=200)
    choice = reply.choices[0]
    expect(choice.finish_reason == "tool_calls", choice.finish_reason)
    calls = choice.message.tool_calls
    expect(calls and len(calls) == 1, calls)
    expect(calls[0].type == "function" and calls[0].id, calls[0])
    expect(calls[0].function.name == "get_weather", calls[0].function)
    args = json.loads(calls[0].function.arguments)
    expect(args == {"city": "Paris", "unit": "celsius"}, args)
    expect("<tool_call>" not in (choice.message.content or ""), choice.message.content)


@TOOL_CHECKS.append
def tool_call_streamed(t):
    stream = t.client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], max_tokens=200, stream=True)
    name, arguments, finish, content = None, "", None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            expect(call.index == 0, call)
            if call.function and call.function.name:
                name = call.function.name
            if call.function and call.function.arguments:
                arguments += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    expect(name == "get_weather", name)
    expect(json.loads(arguments) == {"city": "Paris", "unit": "celsius"}, arguments)
    expect(finish == "tool_calls", finish)
    expect("<tool_call>" not in content, content)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--mode", choices=["provenance", "model", "tools"], required=True)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S)
    t = Session(client, args.base_url)
    failed = 0
    checks = {"provenance": CHECKS, "model": MODEL_CHECKS, "tools": TOOL_CHECKS}[args.mode]
    for fn in checks:
        name = f"{args.mode}: {fn.__name__}"
        try:
            fn(t)
            print(f"PASS {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
