#!/usr/bin/env bash
# The device check: on a machine with an NVIDIA GPU and no network, build with `--features cuda`,
# run the GPU tests and the library's tests, and print a host→device bandwidth report.
#
#   bash scripts/gpu-check.sh            # log also goes to $OUT/gpu-check.log when OUT is set
#
# Needs, on that machine: cargo (Rust ≥ 1.89), the NVIDIA driver, and a CUDA toolkit — the
# system's (`nvcc` on PATH or /usr/local/cuda), else .cache/cuda-venv from scripts/cuda-toolkit.sh
# carried along. Crates come from .cache/vendor (scripts/vendor.sh, carried along); without it,
# from whatever ~/.cargo already holds. Carry: .cache/vendor.tar.gz, .cache/vendor-config.toml
# (and .cache/cuda-venv only if the machine has no toolkit; it is ~370 MiB). Three cargo invocations: one build, one test run, one
# example run; about 2–4 minutes on 16 cores (mostly candle's CUDA kernels).
#
# Without cargo on the GPU machine: build the programs elsewhere with scripts/gpu-build.sh and
# carry `.cache/gpu-bin`; this script then unpacks and runs them (GPU tests, library tests,
# MiniLM on the GPU when .cache/minilm is there too, bandwidth, the offload bench, the moe bench
# (MOE_DEVICE=probe: issue 36's figures on the GPU, with the tiny experts and with
# MOE_EXPERT_FFN=4096, experts of 1 Mi values a matrix), the lora_stream bench (LORA_DEVICE=probe:
# issue 34's figure) and the pipeline on the GPU) in a minute or two.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu-check.log") 2>&1
fi
START=$SECONDS
step() { echo; echo "== $* ($((SECONDS - START)) s)"; }
fail() { echo "gpu-check: FAILED: $*"; exit 1; }

step "machine"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,compute_cap --format=csv \
        || echo "nvidia-smi failed (the tests will say whether a GPU is usable)"
    DRIVER_CUDA="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)"
    echo "driver supports CUDA ${DRIVER_CUDA:-?}"
else
    echo "no nvidia-smi: the GPU tests will skip if the driver is missing too"
fi
nproc

if ! command -v cargo >/dev/null; then
    [ -f .cache/gpu-bin/gpu-bin.tar.xz ] || fail "no cargo on PATH and no .cache/gpu-bin \
(build it where there is cargo with scripts/gpu-build.sh and carry .cache/gpu-bin)"
    step "prebuilt programs (no cargo here)"
    BIN="${TMPDIR:-/tmp}/residency-gpu-bin"
    rm -rf "$BIN" && mkdir -p "$BIN"
    tar -C "$BIN" -xJf .cache/gpu-bin/gpu-bin.tar.xz || fail "could not unpack .cache/gpu-bin"
    cat "$BIN/MANIFEST"
    # candle's kernels link the CUDA runtime: the system toolkit's, where there is one.
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    export RESIDENCY_ROOT="$ROOT"
    declare -A RC
    run() { local name="$1"; shift; step "$name"; "$@"; RC[$name]=$?; }
    run "GPU tests" "$BIN/gpu-tests" --nocapture --test-threads 4
    run "library tests" "$BIN/lib-tests" --test-threads 8
    if [ -f .cache/minilm/model.safetensors ]; then
        run "MiniLM on the GPU" "$BIN/minilm-tests" --nocapture embeddings_on_the_gpu
    else
        step "MiniLM on the GPU: skipped (no .cache/minilm carried; scripts/fetch-minilm.sh)"
    fi
    run "bandwidth" "$BIN/bandwidth"
    run "offload bench (streamed vs resident on the GPU)" "$BIN/offload-bench" --bench \
        --warm-up-time 1 --measurement-time 2
    run "moe bench on the GPU (issue 36's figures)" env MOE_DEVICE=probe "$BIN/moe-bench" --bench
    run "moe bench on the GPU, experts 4096 wide" env MOE_DEVICE=probe MOE_EXPERT_FFN=4096 \
        "$BIN/moe-bench" --bench
    run "lora_stream bench on the GPU (issue 34's figure)" env LORA_DEVICE=probe "$BIN/lora-stream-bench" --bench
    PIPE="${TMPDIR:-/tmp}/residency-pipeline"
    run "pipeline on the GPU, budget 8 MiB" "$BIN/pipeline" --cache "$PIPE" --vram-budget 8MiB
    step "done"
    ok=0
    for k in "${!RC[@]}"; do
        echo "  $k: $([ "${RC[$k]}" -eq 0 ] && echo ok || echo "FAILED (${RC[$k]})")"
        [ "${RC[$k]}" -eq 0 ] || ok=1
    done
    echo "$((SECONDS - START)) s in all"
    exit $ok
fi
cargo --version

step "CUDA toolkit"
VENV_CU="$(ls -d "$ROOT"/.cache/cuda-venv/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1)"
if command -v nvcc >/dev/null; then
    echo "system nvcc: $(command -v nvcc)"
    export CUDA_ROOT="${CUDA_ROOT:-$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)}"
elif [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "system toolkit: /usr/local/cuda"
    export CUDA_ROOT=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
elif [ -n "$VENV_CU" ] && [ -x "$VENV_CU/bin/nvcc" ]; then
    echo "toolkit from the carried .cache/cuda-venv: $VENV_CU"
    [ -e "$VENV_CU/lib64" ] || ln -s lib "$VENV_CU/lib64" 2>/dev/null || true
    [ -e "$VENV_CU/lib/libcudart.so" ] || ln -s libcudart.so.13 "$VENV_CU/lib/libcudart.so" 2>/dev/null || true
    export CUDA_ROOT="$VENV_CU" PATH="$VENV_CU/bin:$PATH"
else
    fail "no CUDA toolkit: no nvcc on PATH, none under /usr/local/cuda, and no .cache/cuda-venv \
(run scripts/cuda-toolkit.sh where there is network and carry .cache/cuda-venv along)"
fi
export CUDA_PATH="${CUDA_PATH:-$CUDA_ROOT}"
# candle-kernels links libcudart (-lcudart) without saying where it is: tell the linker and the
# test binaries.
export LIBRARY_PATH="$CUDA_ROOT/lib64:$CUDA_ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$CUDA_ROOT/lib64:$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvcc --version | tail -2
NVCC_VER="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
read -r NV_MAJ NV_MIN <<<"$NVCC_VER"
# cudarc 0.19.10 knows CUDA 11.4 to 13.4; a newer nvcc is built against 13.4's API.
if [ -z "${CUDARC_CUDA_VERSION:-}" ] && { [ "$NV_MAJ" -gt 13 ] || { [ "$NV_MAJ" -eq 13 ] && [ "$NV_MIN" -gt 4 ]; }; }; then
    export CUDARC_CUDA_VERSION=13040
fi
if [ -z "${CUDA_COMPUTE_CAP:-}" ] && command -v nvidia-smi >/dev/null; then
    CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
    [ -n "$CC" ] && export CUDA_COMPUTE_CAP="$CC"
fi
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
echo "CUDA_ROOT=$CUDA_ROOT CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-from nvcc}"
if [ -n "${DRIVER_CUDA:-}" ] && [ "${DRIVER_CUDA%%.*}" -lt "$NV_MAJ" ]; then
    echo "warning: the driver supports CUDA $DRIVER_CUDA but nvcc is $NV_MAJ.$NV_MIN; candle's PTX may not load"
fi

step "crates"
CFG=()
if [ ! -d .cache/vendor ] && [ -f .cache/vendor.tar.gz ]; then
    echo "unpacking .cache/vendor.tar.gz"
    tar -C .cache -xzf .cache/vendor.tar.gz || fail "could not unpack .cache/vendor.tar.gz"
fi
if [ -d .cache/vendor ] && [ -f .cache/vendor-config.toml ]; then
    # Point the replacement at this checkout's vendor folder, wherever the tree now lives.
    sed "s#^directory = .*#directory = \"$ROOT/.cache/vendor\"#" .cache/vendor-config.toml \
        > "${TMPDIR:-/tmp}/residency-vendor.toml"
    CFG=(--config "${TMPDIR:-/tmp}/residency-vendor.toml")
    echo "vendored crates: .cache/vendor ($(ls .cache/vendor | wc -l) crates)"
else
    echo "no .cache/vendor (scripts/vendor.sh): using the crates already in ~/.cargo"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-cuda}"
export CARGO_TERM_COLOR=never
# candle-kernels compiles its quantized-matmul kernels one nvcc per thread; use every core.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
CARGO=(cargo --offline "${CFG[@]}")

step "build (--release --features cuda: library, tests, examples)"
"${CARGO[@]}" build --release --features cuda --lib --tests --examples \
    || fail "the cuda build failed (offline: a missing crate means .cache/vendor was not carried)"

step "tests: GPU tests and library tests"
"${CARGO[@]}" test --release --features cuda --lib --test gpu -- --nocapture --test-threads 4
TESTS=$?

step "bandwidth"
"${CARGO[@]}" run --release --features cuda --example bandwidth
BW=$?

step "moe bench on the GPU (issue 36's figures)"
MOE_DEVICE=probe "${CARGO[@]}" bench --features cuda --bench moe
MOE=$?
step "moe bench on the GPU, experts 4096 wide"
MOE_DEVICE=probe MOE_EXPERT_FFN=4096 "${CARGO[@]}" bench --features cuda --bench moe || MOE=$?

step "lora_stream bench on the GPU (issue 34's figure)"
LORA_DEVICE=probe "${CARGO[@]}" bench --features cuda --bench lora_stream
LORA=$?

step "done"
echo "tests: $([ $TESTS -eq 0 ] && echo passed || echo FAILED), bandwidth: $([ $BW -eq 0 ] && echo ok || echo FAILED), moe bench: $([ $MOE -eq 0 ] && echo ok || echo FAILED), lora_stream bench: $([ $LORA -eq 0 ] && echo ok || echo FAILED), $((SECONDS - START)) s in all"
[ $TESTS -eq 0 ] && [ $BW -eq 0 ] && [ $MOE -eq 0 ] && [ $LORA -eq 0 ]
