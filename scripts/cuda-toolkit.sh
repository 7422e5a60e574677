#!/usr/bin/env bash
# A CUDA 13 compiler from the Python package registry, for building `--features cuda` on machines
# without a system toolkit (CI). Installs into .cache/cuda-venv once (idempotent), then prints the
# environment to export. Either
#   eval "$(bash scripts/cuda-toolkit.sh)"      # install if needed, export the env
# or
#   source scripts/cuda-toolkit.sh              # same, in the current shell
# Needs python3 with venv and network access to PyPI the first time; nothing after that.
#
# What candle's build needs: `nvcc` on PATH (bindgen_cuda runs it, and parses `nvcc --version`
# for cudarc's version when CUDARC_CUDA_VERSION is not set), CUDA_ROOT/CUDA_PATH pointing at a
# tree with include/ (cuda.h, cuda_fp16.h; cub/thrust under include/cccl, which nvcc adds itself) and CUDA_COMPUTE_CAP so no GPU is
# queried. cudarc 0.19.10 rejects 13.5 (the wheel's own version), hence CUDARC_CUDA_VERSION=13040.
#
# CUDA_WHEEL_VERSION=13.0 (say) installs that release's wheels instead of the newest, into
# .cache/cuda-venv-13.0, and sets CUDARC_CUDA_VERSION to match: binaries meant for a GPU machine
# must be built with a toolkit no newer than its driver's CUDA version, because candle loads its
# kernels as PTX and a driver cannot JIT PTX from a newer toolkit (scripts/gpu-build.sh).

_cuda_toolkit_main() {
    local root venv py site cu
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local want="${CUDA_WHEEL_VERSION:-}" spec=""
    if [ -n "$want" ]; then
        venv="${CUDA_VENV:-$root/.cache/cuda-venv-$want}"
        spec="==$want.*"
    else
        venv="${CUDA_VENV:-$root/.cache/cuda-venv}"
    fi
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" >&2 || return 1
    fi
    py="$venv/bin/python"
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    cu="$site/nvidia/cu13"
    # nvcc's front end (cicc) comes in nvidia-nvvm, which nvcc's wheel pulls in unpinned: pin it
    # too, or a 13.0 ptxas meets PTX from a newer cicc.
    if [ ! -x "$cu/bin/nvcc" ] || [ ! -f "$cu/include/cuda_fp16.h" ] || [ ! -d "$cu/include/cccl/cub" ] \
        || { [ -n "$want" ] && ! "$py" -m pip show nvidia-nvvm 2>/dev/null | grep -q "^Version: $want\."; }; then
        echo "cuda-toolkit: installing the CUDA 13 compiler into $venv (PyPI)" >&2
        "$py" -m pip install --quiet --disable-pip-version-check \
            "nvidia-cuda-nvcc$spec" "nvidia-cuda-runtime$spec" "nvidia-cuda-cccl$spec" \
            "nvidia-cuda-crt$spec" "nvidia-nvvm$spec" >&2 || return 1
    fi
    if [ ! -x "$cu/bin/nvcc" ]; then
        echo "cuda-toolkit: no nvcc under $cu after install" >&2
        return 1
    fi
    # candle-kernels' build (cudaforge) takes the toolkit's libraries from lib64, and links
    # `-lcudart`, which needs the unversioned name the wheel does not ship.
    if [ -d "$cu/lib" ] && [ ! -e "$cu/lib64" ]; then
        ln -s lib "$cu/lib64"
    fi
    if [ -e "$cu/lib/libcudart.so.13" ] && [ ! -e "$cu/lib/libcudart.so" ]; then
        ln -s libcudart.so.13 "$cu/lib/libcudart.so"
    fi
    CUDA_TOOLKIT_ROOT="$cu"
    # cudarc names versions 11040..13040; a pinned 13.x release up to 13.4 is its own, anything
    # newer is built against 13.4's API.
    CUDA_TOOLKIT_CUDARC=13040
    case "$want" in
        13.[0-4]) CUDA_TOOLKIT_CUDARC="130${want#13.}0" ;;
    esac
}

if _cuda_toolkit_main; then
    _cu="$CUDA_TOOLKIT_ROOT"
    _cudarc="$CUDA_TOOLKIT_CUDARC"
    unset CUDA_TOOLKIT_ROOT CUDA_TOOLKIT_CUDARC
    if [ "${BASH_SOURCE[0]}" != "$0" ]; then
        # Sourced: export into the caller's shell.
        export CUDA_ROOT="$_cu" CUDA_PATH="$_cu" CUDA_HOME="$_cu"
        export PATH="$_cu/bin:$PATH"
        export LIBRARY_PATH="$_cu/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
        export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-$_cudarc}"
    else
        echo "export CUDA_ROOT='$_cu' CUDA_PATH='$_cu' CUDA_HOME='$_cu'"
        echo "export PATH='$_cu/bin':\"\$PATH\""
        echo "export LIBRARY_PATH='$_cu/lib'\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
        echo "export CUDA_COMPUTE_CAP=\"\${CUDA_COMPUTE_CAP:-90}\""
        echo "export CUDARC_CUDA_VERSION=\"\${CUDARC_CUDA_VERSION:-$_cudarc}\""
    fi
    unset _cu _cudarc
else
    echo "cuda-toolkit: failed" >&2
    if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 1; else exit 1; fi
fi
