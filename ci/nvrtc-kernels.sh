#!/usr/bin/env bash
# Compiles every CUDA kernel of the backend (gpu/src/cuda/kernels) with NVRTC for sm_90 (H100,
# H200), sm_100 (B200) and sm_120 (RTX Blackwell), failing on any error or warning. Needs no GPU
# and no CUDA toolkit: NVRTC comes from the PyPI wheel nvidia-cuda-nvrtc-cu12 (12.8 is the first
# with sm_100 and sm_120; the version cudarc's `cuda-12080` bindings are for), installed into a
# cached venv. cudarc opens libnvrtc.so.12 by name, so the wheel's lib directory goes on
# LD_LIBRARY_PATH (which also finds the libnvrtc-builtins NVRTC itself opens). Then it prints each
# kernel's registers and fails if one keeps values on the stack (cuobjdump, below).
#   LOCKSTEP_CACHE  cache folder (default: $XDG_CACHE_HOME/lockstep or ~/.cache/lockstep)
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_WHEEL="nvidia-cuda-nvrtc-cu12==12.8.93"

venv="${LOCKSTEP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep}/nvrtc-venv"
if ! "$venv/bin/python" -m pip show --quiet nvidia-cuda-nvrtc-cu12 2>/dev/null \
    || [ "$("$venv/bin/python" -m pip show nvidia-cuda-nvrtc-cu12 | sed -n 's/^Version: //p')" != "${NVRTC_WHEEL#*==}" ]; then
    echo "installing $NVRTC_WHEEL into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$NVRTC_WHEEL"
fi
lib="$("$venv/bin/python" -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib"))')"
[ -e "$lib/libnvrtc.so.12" ] || { echo "no libnvrtc.so.12 in $lib" >&2; exit 1; }

export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Here a missing NVRTC is a failure, not a skip.
export LOCKSTEP_REQUIRE_NVRTC=1
# The cubins it compiles are kept for the resource check below.
cubins="$(mktemp -d)"
trap 'rm -rf "$cubins"' EXIT
# Selected from the whole workspace (its features: the server's default `cuda` turns on the gpu
# crate's), so that `cargo test --workspace` builds on what this builds.
LOCKSTEP_WRITE_CUBINS="$cubins" cargo test --locked --workspace --test cuda_nvrtc -- --nocapture

# What each kernel costs in registers, and that none keeps values on the stack: an accumulator
# indexed by a loop variable goes there, and every use becomes a local-memory round trip (it
# happened to the SwiGLU product). Read from the sm_90/100/120 cubins with cuobjdump (PyPI's
# nvidia-cuda-cuobjdump; `-res-usage` reads the cubin's metadata and needs nothing else).
# rope_kv_write and the attention that folds it in may: precise `sincosf` reduces a huge angle
# through a local array.
CUOBJDUMP_WHEEL="nvidia-cuda-cuobjdump==13.5.37"
if ! "$venv/bin/python" -m pip show --quiet nvidia-cuda-cuobjdump 2>/dev/null; then
    echo "installing $CUOBJDUMP_WHEEL into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$CUOBJDUMP_WHEEL"
fi
cuobjdump="$("$venv/bin/python" -c 'import nvidia, os; print(next(os.path.join(p, "cu13", "bin", "cuobjdump") for p in nvidia.__path__ if os.path.exists(os.path.join(p, "cu13", "bin", "cuobjdump"))))')"
for cubin in "$cubins"/*.cubin; do
    sm="${cubin%.cubin}"; sm="${sm##*.}"
    "$cuobjdump" -res-usage "$cubin" | awk -v sm="$sm" '
        /Function/ { name = $2; sub(":", "", name) }
        /REG:/ { for (i = 1; i <= NF; i++) { split($i, kv, ":"); use[kv[1]] = kv[2] }
                 printf "%-7s %-22s registers %3d  stack %2d\n", sm, name, use["REG"], use["STACK"]
                 if ((use["STACK"] > 0 || use["LOCAL"] > 0) && name != "rope_kv_write" \
                     && name !~ /^paged_attention_rope_/) bad = 1 }
        END { exit bad }' || { echo "a kernel keeps values on the stack (above)" >&2; exit 1; }
done
