#!/usr/bin/env python3
"""Regenerates the goldens gpu/tests/quantized_goldens.rs holds the CPU backend's quantized products
to: what llama.cpp computes on the tiny quantized Llamas our own code generates (gpu/tests/quantized):
the logits at every position of a fixed token sequence, evaluated one token at a time (llama.cpp's
decode path), and 8 greedy tokens after it.

Run: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
     python3 -m pip install llama-cpp-python==0.3.16 numpy && \
     cargo run -p lockstep-gpu --example write_quantized_model -- /tmp/kquant.gguf && \
     python3 gpu/tests/goldens/make_quantized_goldens.py /tmp/kquant.gguf gpu/tests/goldens/llamacpp_kquant.json && \
     cargo run -p lockstep-gpu --example write_quantized_model -- /tmp/legacy.gguf legacy && \
     python3 gpu/tests/goldens/make_quantized_goldens.py /tmp/legacy.gguf gpu/tests/goldens/llamacpp_legacy.json && \
     cargo run -p lockstep-gpu --example write_quantized_model -- /tmp/q5_k_m.gguf q5_k_m && \
     python3 gpu/tests/goldens/make_quantized_goldens.py /tmp/q5_k_m.gguf gpu/tests/goldens/llamacpp_q5_k_m.json
(An AVX2 build is the reference: llama.cpp repacks Q4_0 and Q4_K matrices for AVX2, and lockstep
computes what that build computes.)
"""
import json
import sys

import llama_cpp
import numpy as np

TOKENS = [1, 300, 72, 101, 108, 108, 111, 259, 387, 45, 300, 2, 150]
GREEDY = 8


def fnv1a64(data):
    """The file's fingerprint, as the test computes it."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def main():
    path = sys.argv[1]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, n_batch=64, logits_all=True, verbose=False)
    for token in TOKENS:
        llm.eval([token])
    logits = [[float(x) for x in np.array(llm.scores[i], dtype=np.float32)] for i in range(len(TOKENS))]
    greedy = []
    for _ in range(GREEDY):
        token = int(np.argmax(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
        greedy.append(token)
        llm.eval([token])
    out = {
        "llama_cpp_python": llama_cpp.__version__,
        "model_fnv1a64": fnv1a64(open(path, "rb").read()),
        "prompt_eval": "one token at a time",
        "tokens": TOKENS,
        "logits": logits,
        "greedy": greedy,
    }
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
