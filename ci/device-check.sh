#!/usr/bin/env bash
# The CUDA backend's device check (issue 12), one run on a GPU machine, results in $OUT:
#   - greedy tokens and logits against the CPU backend: the tiny models of every family variant
#     (Hugging Face and GGUF) and, when LOCKSTEP_DEFAULT_MODEL names the default model's GGUF,
#     the llama.cpp golden prompts (gpu/tests/cuda_device.rs states the tolerances);
#   - a request alone equals itself in a batch of 32 mixed rows, bit for bit;
#   - decode tokens/s at batch 1, 32 and 256 on a random 1.24B-parameter Llama (f16) against the
#     HBM roofline (4.8 TB/s, H200).
# The checks are gpu/tests/cuda_device.rs (its benchmark is #[ignore]d in plain `cargo test`).
#
# Two ways to get the test binary and the kernels to a machine with no network:
#   ci/device-check.sh --make-kit DIR   (here, with network) builds the release test binary and
#                                       compiles the kernels to cubins (sm_90, sm_100, sm_120) into
#                                       DIR, about 9 MB; carry DIR to the device, then
#   LOCKSTEP_DEVICE_KIT=DIR ci/device-check.sh   runs them; the cubins are used when the device
#                                       has no NVRTC.
# Without a kit the script builds on the device (`cargo test --release --offline`: the crates
# must already be in the device's cargo cache) and compiles the kernels with the device's NVRTC.
#   LOCKSTEP_NVRTC_LIB       a folder holding libnvrtc.so.12 (else the system's is looked for)
#   LOCKSTEP_DEFAULT_MODEL   the default model's GGUF (ci/fetch-default-model.sh); optional here
#   OUT                      where results go (default target/device-check)
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
    kit="${2:?--make-kit needs a folder}"
    mkdir -p "$kit"
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

# NVRTC: the given folder, the toolkit's, or a pip wheel's (PyTorch brings one).
nvrtc=""
for dir in "${LOCKSTEP_NVRTC_LIB:-}" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-*/lib64 \
    "$(python3 -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib"))' 2>/dev/null || true)"; do
    if [ -n "$dir" ] && [ -e "$dir/libnvrtc.so.12" ]; then nvrtc="$dir"; break; fi
done
if [ -n "$nvrtc" ]; then
    export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "NVRTC from $nvrtc"
elif [ -n "${LOCKSTEP_DEVICE_KIT:-}" ] && [ -d "$LOCKSTEP_DEVICE_KIT/kernels" ]; then
    export LOCKSTEP_CUDA_KERNELS_DIR="$LOCKSTEP_DEVICE_KIT/kernels"
    log "no NVRTC here: the kit's cubins"
elif ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.12'; then
    log "NVRTC from the loader cache"
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

log "checks"
status=0
LOCKSTEP_REQUIRE_CUDA=1 RUST_BACKTRACE=1 timeout 420 "$binary" --include-ignored --test-threads=1 \
    --nocapture 2>&1 | tee "$OUT/cuda_device.log" || status=$?
log "done, exit $status; results in $OUT/cuda_device.jsonl"
cat "$OUT/cuda_device.jsonl" 2>/dev/null || true
exit "$status"
