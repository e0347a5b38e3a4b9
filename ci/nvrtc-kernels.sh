#!/usr/bin/env bash
# Compiles every CUDA kernel of the backend (gpu/src/cuda/kernels) with NVRTC for sm_90 (H100,
# H200), sm_100 (B200) and sm_120 (RTX Blackwell), failing on any error or warning. Needs no GPU
# and no CUDA toolkit: NVRTC comes from the PyPI wheel nvidia-cuda-nvrtc-cu12 (12.8 is the first
# with sm_100 and sm_120; the version cudarc's `cuda-12080` bindings are for), installed into a
# cached venv. cudarc opens libnvrtc.so.12 by name, so the wheel's lib directory goes on
# LD_LIBRARY_PATH (which also finds the libnvrtc-builtins NVRTC itself opens).
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
cargo test --locked -p lockstep-gpu --features cuda --test cuda_nvrtc -- --nocapture
