#!/usr/bin/env bash
# The CUDA backend's device check (issue 12), one run on a GPU machine, results in $OUT:
#   - greedy tokens and logits against the CPU backend: the tiny models of every family variant
#     (Hugging Face and GGUF) and, when LOCKSTEP_DEFAULT_MODEL names the default model's GGUF,
#     the llama.cpp golden prompts (gpu/tests/cuda_device.rs states the tolerances);
#   - a request alone equals itself in a batch of 32 mixed rows, bit for bit;
#   - decode tokens/s at batch 1, 32 and 256 on a random 1.24B-parameter Llama against the HBM
#     roofline (the device's peak, from its memory clock and bus width: an H100 SXM's 3.35 TB/s,
#     an H200's 4.8): in f16 (plain, dependent launches, every option), and in Q4_1
#     (dequantized to f32 at load, read in its blocks, every option); and the f16 model at batch 1
#     after a 4,096-token prompt (plain, split attention, every option).
# The checks are gpu/tests/cuda_device.rs (its benchmark is #[ignore]d in plain `cargo test`).
#
# Two ways to get the test binary and the kernels to a machine with no network:
#   ci/device-check.sh --make-kit DIR   (here, with network) builds the release test binary and
#                                       compiles the kernels to cubins (sm_90, sm_100, sm_120) into
#                                       DIR, about 9 MB; carry DIR to the device, then
#   LOCKSTEP_DEVICE_KIT=DIR ci/device-check.sh   runs them on the cubins; the device's NVRTC,
#                                       if it has one, then compiles them for one more run of
#                                       the tiny models.
# Without a kit the script builds on the device (`cargo test --release --offline`: the crates
# must already be in the device's cargo cache) and compiles the kernels with the device's NVRTC.
#   LOCKSTEP_NVRTC_LIB       a folder holding libnvrtc.so.12 or libnvrtc.so (else the toolkit's
#                            or a pip wheel's is looked for)
#   LOCKSTEP_DEFAULT_MODEL   the default model's GGUF (ci/fetch-default-model.sh); optional here
#   LOCKSTEP_BIN             a lockstep binary: generate, serve and split serving on the device
#   OUT                      where results go (default target/device-check)
# The `device` tool carries 64 MiB a call and the default model is 98 MB: carry it in two halves
# (`head -c 52000000` / `tail -c +52000001`), the kit and the first half in one call that copies
# them to /tmp, then at once (the machine stays 30 s) the second half and the binary, joining the
# halves and running with LOCKSTEP_DEVICE_TESTS=default_model. BENCHMARKS.md has the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

# The release test binary's path, built now.
build_test_binary() {
    cargo test --release --locked "$@" -p lockstep-gpu --features cuda --test cuda_device \
        --no-run --message-format=json \
        | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_device" and m.get("executable"):
        print(m["executable"])'
}

if [ "${1:-}" = "--make-kit" ]; then
    mkdir -p "${2:?--make-kit needs a folder}"
    # Absolute: the cubins are written by a test, whose working directory is gpu/.
    kit="$(cd "$2" && pwd)"
    cp "$(build_test_binary)" "$kit/cuda_device"
    # Panics keep their file and line without debug info: 57 MB becomes 8 MB to carry.
    strip --strip-debug "$kit/cuda_device" 2>/dev/null || true
    LOCKSTEP_WRITE_CUBINS="$kit/kernels" ci/nvrtc-kernels.sh >/dev/null
    du -sh "$kit"
    exit 0
fi

OUT="${OUT:-$PWD/target/device-check}"
mkdir -p "$OUT"
export OUT
start=$(date +%s)
log() { printf '== %s (%ss)\n' "$*" "$(( $(date +%s) - start ))" | tee -a "$OUT/device-check.log"; }

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv \
    2>&1 | tee -a "$OUT/device-check.log" || true

# NVRTC: the given folder, the toolkit's, or a pip wheel's (PyTorch brings one). cudarc opens
# libnvrtc.so.12 or, first, an unversioned libnvrtc.so (a toolkit's link to its own version).
nvrtc=""
for dir in "${LOCKSTEP_NVRTC_LIB:-}" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-*/lib64 \
    "$(python3 -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib"))' 2>/dev/null || true)"; do
    if [ -n "$dir" ] && { [ -e "$dir/libnvrtc.so.12" ] || [ -e "$dir/libnvrtc.so" ]; }; then
        nvrtc="$dir"; break
    fi
done
ls -l /usr/local/cuda/lib64/libnvrtc* 2>&1 | tee -a "$OUT/device-check.log" || true
[ -z "$nvrtc" ] || export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The kit's cubins run the checks when there is a kit (what CI compiled is what is checked);
# the device's NVRTC, when there is one too, then compiles them for one more run.
if [ -n "${LOCKSTEP_DEVICE_KIT:-}" ] && [ -d "$LOCKSTEP_DEVICE_KIT/kernels" ]; then
    export LOCKSTEP_CUDA_KERNELS_DIR="$LOCKSTEP_DEVICE_KIT/kernels"
    log "kernels: the kit's cubins${nvrtc:+; NVRTC from $nvrtc after}"
elif [ -n "$nvrtc" ]; then
    log "kernels: NVRTC from $nvrtc"
elif ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.12'; then
    log "kernels: NVRTC from the loader cache"
else
    log "no NVRTC (set LOCKSTEP_NVRTC_LIB or bring a kit with cubins)"; exit 1
fi

if [ -n "${LOCKSTEP_DEVICE_KIT:-}" ]; then
    binary="$LOCKSTEP_DEVICE_KIT/cuda_device"
else
    log "building the release test binary (offline)"
    binary="$(build_test_binary --offline)"
fi
[ -x "$binary" ] || { log "no test binary at $binary"; exit 1; }
if [ -n "${LOCKSTEP_DEFAULT_MODEL:-}" ] && [ ! -f "$LOCKSTEP_DEFAULT_MODEL" ]; then
    log "LOCKSTEP_DEFAULT_MODEL=$LOCKSTEP_DEFAULT_MODEL is not a file: the default model is skipped"
    unset LOCKSTEP_DEFAULT_MODEL
fi
[ -n "${LOCKSTEP_DEFAULT_MODEL:-}" ] || log "no default model: the llama.cpp prompts are skipped"

# Each test in a process of its own: a fault on the device ends its context, and the checks
# after it still run. The first device check that fails is run again under compute-sanitizer's
# memcheck, which names the kernel and address of a bad access.
#   LOCKSTEP_DEVICE_TESTS   only the tests whose names contain this (all by default)
log "checks"
status=0
sanitized=""
tests=$("$binary" --list 2>/dev/null | sed -n 's/: test$//p' | grep -e "${LOCKSTEP_DEVICE_TESTS:-}" || true)
for t in $tests; do
    log "test $t"
    echo "==== $t" >>"$OUT/tests.log"
    rc=0
    # Each check takes seconds; the benchmark a few minutes (two 1.2B models, each uploaded for
    # each batch size, the Q4_1 one twice: as f32 and in blocks).
    case "$t" in *throughput*) limit=420 ;; *) limit=150 ;; esac
    LOCKSTEP_REQUIRE_CUDA=1 RUST_BACKTRACE=1 timeout "$limit" "$binary" --include-ignored --exact "$t" \
        --test-threads=1 --nocapture >"$OUT/test.log" 2>&1 || rc=$?
    cat "$OUT/test.log" >>"$OUT/tests.log"
    if [ "$rc" = 0 ]; then
        log "passed $t"
        continue
    fi
    status=1
    log "FAILED $t (exit $rc)"
    grep -v '^{"check"' "$OUT/test.log" | tail -25
    case "$t" in *throughput*|*harness*|*schedules*|*without_a_driver*) continue ;; esac
    if [ -z "$sanitized" ] && command -v compute-sanitizer >/dev/null; then
        sanitized=1
        log "compute-sanitizer memcheck on $t"
        env -u OUT LOCKSTEP_REQUIRE_CUDA=1 timeout 120 compute-sanitizer --tool memcheck \
            --print-limit 10 "$binary" --include-ignored --exact "$t" --test-threads=1 \
            >"$OUT/sanitizer.log" 2>&1 || true
        grep -E "Invalid|Address|at 0x|by thread|ERROR SUMMARY|Saved host backtrace|in kernel|========= +(Host|Program)" \
            "$OUT/sanitizer.log" | head -30
    fi
done
#   LOCKSTEP_NVRTC_RUN=0, LOCKSTEP_NCU_RUN=0   skip the NVRTC run and the profile below
if [ -n "$nvrtc" ] && [ -n "${LOCKSTEP_CUDA_KERNELS_DIR:-}" ] && [ -z "${LOCKSTEP_DEVICE_TESTS:-}" ] \
    && [ "${LOCKSTEP_NVRTC_RUN:-1}" = 1 ]; then
    t=cuda_greedy_tokens_and_logits_equal_the_cpu_backend_s_on_the_tiny_models
    log "test $t, kernels compiled by the device's NVRTC"
    echo "==== $t (NVRTC)" >>"$OUT/tests.log"
    rc=0
    env -u LOCKSTEP_CUDA_KERNELS_DIR LOCKSTEP_REQUIRE_CUDA=1 RUST_BACKTRACE=1 timeout 150 \
        "$binary" --exact "$t" --test-threads=1 --nocapture >"$OUT/test.log" 2>&1 || rc=$?
    cat "$OUT/test.log" >>"$OUT/tests.log"
    if [ "$rc" = 0 ]; then log "passed $t (NVRTC)"; else status=1; log "FAILED $t (NVRTC, exit $rc)"; grep -v '^{"check"' "$OUT/test.log" | tail -15; fi
fi
# Where a batch-1 decode step's time goes, kernel by kernel: Nsight Compute over one decode
# step's launches (after the prefill's and four decode steps'), with the clocks left alone.
if command -v ncu >/dev/null && [ -z "${LOCKSTEP_DEVICE_TESTS:-}" ] && [ "${LOCKSTEP_NCU_RUN:-1}" = 1 ]; then
    log "ncu: one batch-1 decode step"
    env -u OUT LOCKSTEP_BENCH_BATCHES=1 LOCKSTEP_BENCH_WEIGHTS=f16 timeout 180 ncu --clock-control none \
        --launch-skip "${LOCKSTEP_NCU_SKIP:-660}" --launch-count "${LOCKSTEP_NCU_COUNT:-132}" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        --csv --page raw "$binary" --include-ignored --exact decode_throughput_against_the_hbm_roofline \
        >"$OUT/ncu.csv" 2>"$OUT/ncu.err" || log "ncu failed: $(tail -3 "$OUT/ncu.err")"
    python3 ci/ncu-summary.py "$OUT/ncu.csv" || true
fi
# The binaries on the device, with the default model: `lockstep generate --device cuda` beside
# `--device cpu`; `lockstep serve --device cuda` answering a completion; and the same completion
# from a prefill and a decode worker, both on the device, behind a router (KV pages leave and
# enter device memory through `PageStore`), which must equal the single server's, greedy.
#   LOCKSTEP_BIN    a lockstep binary (feature `cuda`, the default) to run them with
if [ -n "${LOCKSTEP_BIN:-}" ] && [ -n "${LOCKSTEP_DEFAULT_MODEL:-}" ]; then
    model="$LOCKSTEP_DEFAULT_MODEL"
    prompt="The three primary colors are"
    # The last one with every launch option (`--cuda-launch all`), which must not change a bit:
    # its text must be the plain CUDA run's.
    for device in cpu cuda "cuda --cuda-launch all"; do
        log "lockstep generate --device $device"
        # shellcheck disable=SC2086 # the device words
        timeout 90 "$LOCKSTEP_BIN" generate --model "$model" --device $device --max-tokens 24 \
            --prompt "$prompt" >"$OUT/generate.txt" 2>"$OUT/generate.err" \
            || { status=1; log "generate failed"; tail -4 "$OUT/generate.err"; }
        tail -4 "$OUT/generate.txt" | tee -a "$OUT/device-check.log"
        # The text alone (stdout) is compared; stderr may carry timings.
        case "$device" in
            cuda) cp "$OUT/generate.txt" "$OUT/generate-cuda.txt" ;;
            cuda\ *) cmp -s "$OUT/generate.txt" "$OUT/generate-cuda.txt" \
                || { status=1; log "FAILED: --cuda-launch all changed the text"; } ;;
        esac
    done
    rm -f "$OUT/generate-cuda.txt" "$OUT/generate.err"
    up() { for _ in $(seq 1 120); do curl -sf "127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
    complete() {
        curl -s -m 60 "127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
            -d "{\"prompt\": \"$prompt\", \"max_tokens\": 24, \"temperature\": 0}" \
            | python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["text"])'
    }
    B="$LOCKSTEP_BIN"
    "$B" serve --model "$model" --device cuda --port 8100 >"$OUT/serve.log" 2>&1 &
    single=""
    if up 8100; then single="$(complete 8100)"; fi
    kill %1 2>/dev/null || true
    log "serve --device cuda: ${single:-NO ANSWER}"
    "$B" serve --model "$model" --device cuda --role decode --worker-id 2 --port 8202 --peer-port 9202 >>"$OUT/serve.log" 2>&1 &
    "$B" serve --model "$model" --device cuda --role prefill --worker-id 1 --port 8201 --peer-port 9201 \
        --decode 2@127.0.0.1:9202 >>"$OUT/serve.log" 2>&1 &
    "$B" serve --model "$model" --role router --worker-id 0 --port 8200 --prefill 1@127.0.0.1:9201 \
        --decode 2@127.0.0.1:9202 >>"$OUT/serve.log" 2>&1 &
    split=""
    if up 8201 && up 8202 && up 8200; then sleep 1; split="$(complete 8200)"; fi
    kill %2 %3 %4 2>/dev/null || true
    rm -f "$OUT/generate.txt"
    log "prefill + decode workers on cuda: ${split:-NO ANSWER}"
    if [ -z "$single" ] || [ "$single" != "$split" ]; then status=1; log "FAILED: the split deployment's answer differs"; tail -20 "$OUT/serve.log"; fi
fi
rm -f "$OUT/test.log"
log "done, exit $status; results in $OUT/cuda_device.jsonl"
cat "$OUT/cuda_device.jsonl" 2>/dev/null || true
exit "$status"
