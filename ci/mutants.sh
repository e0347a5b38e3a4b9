#!/usr/bin/env bash
# Mutation testing of core's state machines (cargo-mutants): each mutant is a small change to
# one file (an operator flipped, a guard made true, a body emptied); core's tests must fail on
# it. A mutant that survives is a behaviour no test holds, which is how the proptests' blind
# spots were found (a prefill pool never small enough to preempt, timers fired without asking
# `next_timeout`, freed pages never checked to reach the model). Not part of ci/test.sh: about
# 15 s a mutant on two cores, a thousand mutants in core's state machines.
#
#   ci/mutants.sh core/src/node/decode.rs [more files]   then read mutants.out/missed.txt
#
# Knobs: MUTANTS_JOBS (parallel copies of the tree, default 1), MUTANTS_TIMEOUT (seconds a
# mutant's tests may take; by default twice the unmutated suite's time, at least 20 s: a wedge
# shows as a timeout, which counts as caught, and costs the whole timeout. Of the 266 mutants
# of pd/, node/ and sched/ that failed a test in stops 33 and 34, the slowest failed in 6 s,
# while a quarter of all mutants wedge), PROPTEST_CASES (default 128 here: the proptests run
# once a mutant, in a debug build).
# Survivors to expect: branches that only `planted!` bugs take (`planted!` is false without
# feature `planted-bugs`), and guards whose inputs the harnesses never produce (a message from
# a second router): read each before adding a test for it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '2,19p' "$0"; exit 2; }
if ! command -v cargo-mutants >/dev/null; then
    cargo install cargo-mutants --locked
fi
export PROPTEST_CASES="${PROPTEST_CASES:-128}" CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=0
files=()
for f in "$@"; do files+=(--file "$f"); done
if [ -n "${MUTANTS_TIMEOUT:-}" ]; then
    timeout=(--timeout "$MUTANTS_TIMEOUT")
else
    timeout=(--timeout-multiplier 2 --minimum-test-timeout 20)
fi
exec cargo mutants -p lockstep-core --features testing "${files[@]}" "${timeout[@]}" \
    --jobs "${MUTANTS_JOBS:-1}"
