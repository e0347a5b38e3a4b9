#!/usr/bin/env python3
"""Regenerates gpu/tests/goldens/llamacpp.json: llama.cpp's view of the default model, the
reference lockstep's CPU backend is held to (gpu/tests/llamacpp_goldens.rs).

For each prompt (raw, or wrapped in the model's chat template as rendered by jinja2): llama.cpp's
tokens, the first step's top-5 tokens with their logits, and 32 greedy tokens. The prompt is
evaluated one token at a time (see below).

Run: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
     python3 -m pip install llama-cpp-python==0.3.16 gguf==0.19.0 jinja2 && \
     python3 gpu/tests/goldens/make_llamacpp_goldens.py "$(ci/fetch-default-model.sh)"
(llama-cpp-python builds llama.cpp from source: several minutes on two cores. Build it without
-march=native: on Xeons with AMX a native build crashed on its first decode here.)
"""
import hashlib
import json
import sys

import jinja2
import llama_cpp
import numpy as np
from gguf import GGUFReader

PROMPTS = [
    ("The capital of France is", False),
    ("What is the capital of France?", True),
    ("def fibonacci(n):", False),
    ("Write a haiku about the sea.", True),
    ("In 1969, the first humans", False),
]
GREEDY_TOKENS = 32


def main():
    path = sys.argv[1]
    template = GGUFReader(path).fields["tokenizer.chat_template"].contents()
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=False)
    out = {
        "llama_cpp_python": llama_cpp.__version__,
        "model_sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
        "prompt_eval": "one token at a time",
        "prompts": [],
    }
    for text, chat in PROMPTS:
        rendered = (
            jinja2.Environment().from_string(template).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True, bos_token="", eos_token=""
            )
            if chat
            else text
        )
        tokens = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        llm.reset()
        # One token at a time: that is llama.cpp's decode path, the arithmetic lockstep computes
        # every token with. Its batched prompt path runs other kernels and moves logits by up to
        # 0.3 on these prompts against its own one-token results.
        for token in tokens:
            llm.eval([token])
        logits = np.array(llm.scores[len(tokens) - 1], dtype=np.float32)
        top = np.argsort(-logits, kind="stable")[:5]
        greedy = []
        for _ in range(GREEDY_TOKENS):
            step = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            token = int(np.argmax(step))
            greedy.append(token)
            llm.eval([token])
        out["prompts"].append(
            {
                "text": text,
                "chat": chat,
                "rendered": rendered,
                "tokens": [int(t) for t in tokens],
                "top5": [[int(i), float(logits[i])] for i in top],
                "greedy": greedy,
                "greedy_text": llm.detokenize(greedy).decode("utf-8", "replace"),
            }
        )
    json.dump(out, open("gpu/tests/goldens/llamacpp.json", "w"), indent=1)


if __name__ == "__main__":
    main()
