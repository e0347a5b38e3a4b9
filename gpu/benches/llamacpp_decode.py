#!/usr/bin/env python3
"""llama.cpp's side of `cargo bench -p lockstep-gpu --bench decode`, on the same GGUF with the same
thread count and the same work: at batch 1, one 64-token prompt then 32 decoded tokens; at batch
32, 32 different 64-token prompts prefilled in one batch then 32 decode steps of 32 sequences
(llama.cpp's batch API, one KV sequence per prompt); at a long context, one 2,000-token prompt
then 32 decoded tokens. Best of three rounds after a warm-up, as the Rust side takes.

Run: python3 gpu/benches/llamacpp_decode.py "$(ci/fetch-default-model.sh)" THREADS
"""
import sys
import time

import llama_cpp

PROMPT = 64
LONG_PROMPT = 2000
DECODE = 32
ROUNDS = 4  # a warm-up, then the best of three


def prompt(seq, length):
    # The prompts of gpu/benches/decode.rs.
    return [100 + (t * 37 + seq * 101) % 5000 for t in range(length)]


def run(ctx, batch, sequences, length):
    """One round: (prefill tokens/s, decode tokens/s)."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

    def fill(entries):
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    entries = [(tok, pos, s, pos == length - 1) for s in range(sequences) for pos, tok in enumerate(prompt(s, length))]
    start = time.perf_counter()
    fill(entries)
    prefill = len(entries) / (time.perf_counter() - start)
    start = time.perf_counter()
    for step in range(DECODE):
        # Which token is fed does not change the cost of a step.
        fill([(200, length + step, s, True) for s in range(sequences)])
    decode = DECODE * sequences / (time.perf_counter() - start)
    return prefill, decode


def main():
    path, threads = sys.argv[1], int(sys.argv[2])
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    for case, sequences, length in (("batch  1", 1, PROMPT), ("batch 32", 32, PROMPT), ("long    ", 1, LONG_PROMPT)):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = sequences * (length + DECODE + 32)
        params.n_batch = sequences * length
        params.n_ubatch = min(512, sequences * length)
        params.n_seq_max = sequences
        params.n_threads = threads
        params.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(model, params)
        batch = llama_cpp.llama_batch_init(sequences * length, 0, 1)
        best = (0.0, 0.0)
        for _ in range(ROUNDS):
            prefill, decode = run(ctx, batch, sequences, length)
            best = (max(best[0], prefill), max(best[1], decode))
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        print(
            f"llama.cpp {case}: prefill {best[0]:8.1f} tokens/s, decode {best[1]:8.1f} tokens/s ({threads} threads)",
            flush=True,
        )


if __name__ == "__main__":
    main()
