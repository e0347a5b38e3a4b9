#!/usr/bin/env python3
"""Regenerates gpu/tests/goldens/chat_tools.json: OpenAI chat requests with tools rendered through
Qwen 2.5's chat template (qwen2_5_chat_template.jinja) by Hugging Face transformers, the reference
gpu/tests/chat_tools.rs holds lockstep_gpu::chat::render_json to.

Each case keeps the request as a client sends it (a call's arguments a JSON string, content a
string, null or text parts). Before rendering, the script does what vLLM does to such a request
for a template that reads strings: text parts joined with newlines, arguments parsed with
json.loads. Keys are sorted in the stored requests: `tool | tojson` writes keys in the order it
is given them, and lockstep's tests read the requests with serde_json, which keeps the order only
with its `preserve_order` feature.

Run: python3 -m pip install transformers==4.57.1 jinja2 && \
     python3 gpu/tests/goldens/make_chat_tools_goldens.py
"""
import copy
import json
import os

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = "qwen2_5_chat_template.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later, in °C or °F: 'quoted'",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "e.g. Zürich"},
                "days": {"type": "integer", "minimum": 1, "maximum": 1e16},
                "threshold": {"type": "number", "default": 0.5, "multipleOf": 1e-05},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"days\": 2}"}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}

CASES = [
    ("tools, no system message", [{"role": "user", "content": "Weather in Zürich?"}], [WEATHER, TIME], True),
    (
        "tools with a system message",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        [WEATHER],
        True,
    ),
    (
        "a tool round trip",
        [
            {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "and time?"}]},
            {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        ],
        [WEATHER, TIME],
        True,
    ),
    (
        "content before a call, no generation prompt",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
        ],
        [WEATHER],
        False,
    ),
    ("no tools", [{"role": "user", "content": "Hi"}], None, True),
]


def sorted_keys(value):
    return json.loads(json.dumps(value, sort_keys=True))


def as_vllm_gives_it(messages):
    """vLLM's preprocessing of a request for a template that reads strings."""
    out = copy.deepcopy(messages)
    for message in out:
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def main():
    with open(os.path.join(HERE, TEMPLATE)) as f:
        template = f.read()
    cases = []
    for name, messages, tools, add_generation_prompt in CASES:
        messages, tools = sorted_keys(messages), sorted_keys(tools)
        rendered, _ = render_jinja_template(
            conversations=[as_vllm_gives_it(messages)],
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="<|im_end|>",
        )
        cases.append(
            {
                "name": name,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "rendered": rendered[0],
            }
        )
    out = {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "template": TEMPLATE, "cases": cases}
    with open(os.path.join(HERE, "chat_tools.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
