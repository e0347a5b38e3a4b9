#!/usr/bin/env python3
"""llama.cpp's side of `cargo bench -p lockstep-gpu --bench decode`: prefill tokens/s of one
64-token prompt and decode tokens/s at batch 1 over 32 tokens, on the same GGUF with the same
thread count. (llama-cpp-python's high-level API runs one sequence, so its batch-32 decode is not
measured here.)

Run: python3 gpu/benches/llamacpp_decode.py "$(ci/fetch-default-model.sh)" THREADS
"""
import sys
import time

import llama_cpp

path, threads = sys.argv[1], int(sys.argv[2])
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
prompt = [100 + (t * 37) % 5000 for t in range(64)]
prefill = decode = 0.0
for _ in range(4):  # a warm-up round, then the best of three, as the Rust side takes
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = max(prefill, len(prompt) / (time.perf_counter() - start))
    start = time.perf_counter()
    for _ in range(32):
        llm.eval([200])  # which token is fed does not change the cost of a step
    decode = max(decode, 32 / (time.perf_counter() - start))
print(f"llama.cpp batch  1: prefill {prefill:8.1f} tokens/s, decode {decode:8.1f} tokens/s ({threads} threads)")
