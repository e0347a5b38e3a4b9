#!/usr/bin/env python3
"""Regenerates gpu/tests/goldens/hf_tiny.json: what Hugging Face transformers computes on the tiny
models our own code generates (gpu/tests/tiny), the reference gpu/tests/hf_tiny_models.rs holds the
safetensors path to: logits at every position of a fixed token sequence, 8 greedy tokens, and the
tokenizer's and chat template's output.

Run: python3 -m pip install torch transformers && \
     cargo run -p lockstep-gpu --example write_tiny_models -- /tmp/tiny && \
     python3 gpu/tests/goldens/make_hf_tiny_goldens.py /tmp/tiny
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

TOKENS = [104, 101, 108, 108, 111, 258, 32, 116, 104, 101, 259, 42]
TEXT = "hello there, the tiny test!"
GREEDY = 8


def main():
    root = sys.argv[1]
    torch.manual_seed(0)
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "tokens": TOKENS, "models": {}}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        # Eager attention in float32: the plainest arithmetic transformers has.
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0]
            greedy = model.generate(
                torch.tensor([TOKENS]), max_new_tokens=GREEDY, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(TOKENS):]
        tokenizer = AutoTokenizer.from_pretrained(path)
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
        )
        out["models"][name] = {
            "logits": [[round(float(v), 6) for v in row] for row in logits],
            "greedy": [int(t) for t in greedy],
            "encoded": tokenizer.encode(TEXT, add_special_tokens=True),
            "chat": chat,
        }
    json.dump(out, open("gpu/tests/goldens/hf_tiny.json", "w"), indent=0)


if __name__ == "__main__":
    main()
