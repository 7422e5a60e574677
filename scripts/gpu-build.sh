#!/usr/bin/env bash
# Builds the GPU check's programs on this machine, for a GPU machine that has no cargo: the
# `--release --features cuda` test binaries (tests/gpu.rs, tests/minilm.rs, the library's unit
# tests), the offload bench and the bandwidth, probe and pipeline examples, stripped and packed
# into .cache/gpu-bin/gpu-bin.tar.xz with a manifest. Carry `.cache/gpu-bin` there; run
# `bash scripts/gpu-check.sh`, which uses them when there is no cargo.
#
#   CUDA_WHEEL_VERSION=13.0 bash scripts/gpu-build.sh     # 13.0: the H200 machine's driver
#
# The toolkit comes from PyPI (scripts/cuda-toolkit.sh) at CUDA_WHEEL_VERSION (default 13.0):
# candle loads its kernels as PTX, which a driver can only JIT when the PTX is no newer than the
# driver's own CUDA version, so build for the oldest driver you will run on. CUDA_COMPUTE_CAP
# defaults to 90 (H100/H200). From clean this compiles candle's kernels with nvcc: ~20 minutes
# on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
export CUDA_WHEEL_VERSION="${CUDA_WHEEL_VERSION:-13.0}"
eval "$(bash scripts/cuda-toolkit.sh)"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
# Its own target folder: the toolkit version is baked into candle's kernels and cudarc.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-cuda-$CUDA_WHEEL_VERSION}"
OUT="$ROOT/.cache/gpu-bin"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
echo "gpu-build: CUDA $CUDA_WHEEL_VERSION (cudarc $CUDARC_CUDA_VERSION), compute $CUDA_COMPUTE_CAP, into $CARGO_TARGET_DIR" >&2

# candle's `cuda` feature makes cudarc link libcuda, libnvrtc, libcublas, libcublasLt and libcurand
# at build time. The PyPI compiler has none of them (and libcuda is the driver's), so link against
# stubs: one shared library per name, with the SONAME the real one has, defining every symbol
# cudarc uses. At run time the GPU machine's own libraries load under those names.
cargo build --release --features cuda --lib
STUBS="$CARGO_TARGET_DIR/cuda-stubs"
mkdir -p "$STUBS"
RLIB="$(ls -t "$CARGO_TARGET_DIR"/release/deps/libcudarc-*.rlib | head -1)"
nm -u --format=just-symbols "$RLIB" 2>/dev/null | grep -E '^(cu|nvrtc)' | sort -u > "$STUBS/symbols"
stub() { # name soname pattern
    grep -P "$3" "$STUBS/symbols" | sed 's/.*/void &(void) {}/' > "$STUBS/$1.c"
    cc -shared -fPIC -o "$STUBS/lib$1.so" -Wl,-soname,"$2" "$STUBS/$1.c"
}
stub cublasLt libcublasLt.so.13 '^cublasLt'
stub cublas libcublas.so.13 '^cublas(?!Lt)'
stub curand libcurand.so.10 '^curand'
stub nvrtc libnvrtc.so.13 '^nvrtc'
stub cuda libcuda.so.1 '^cu[A-Z]'
echo "gpu-build: link stubs for $(wc -l < "$STUBS/symbols") CUDA library symbols in $STUBS" >&2
export LIBRARY_PATH="$STUBS${LIBRARY_PATH:+:$LIBRARY_PATH}"

# cargo names each test and bench executable in its JSON messages; keep the ones we carry.
cargo build --release --features cuda --lib --test gpu --test minilm --bench offload --bench moe --bench lora_stream \
    --example bandwidth --example probe --example pipeline --message-format=json-render-diagnostics \
    > "$STAGE/build.json"
cargo test --release --features cuda --lib --no-run --message-format=json-render-diagnostics \
    >> "$STAGE/build.json"
python3 - "$STAGE/build.json" "$STAGE" <<'PY'
import json, shutil, sys
want = {("test", "gpu"): "gpu-tests", ("test", "minilm"): "minilm-tests",
        ("bench", "offload"): "offload-bench", ("bench", "moe"): "moe-bench",
        ("bench", "lora_stream"): "lora-stream-bench",
        ("example", "bandwidth"): "bandwidth",
        ("example", "probe"): "probe", ("example", "pipeline"): "pipeline"}
found = {}
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    kind = "test" if m["profile"]["test"] and t["kind"] == ["lib"] else t["kind"][0]
    name = "lib-tests" if kind == "test" and t["kind"] == ["lib"] else want.get((kind, t["name"]))
    if name:
        found[name] = m["executable"]
missing = (set(want.values()) | {"lib-tests"}) - set(found)
if missing:
    sys.exit(f"gpu-build: no executable for {sorted(missing)}")
for name, path in found.items():
    shutil.copy(path, f"{sys.argv[2]}/{name}")
PY
strip "$STAGE"/{gpu-tests,minilm-tests,lib-tests,offload-bench,moe-bench,lora-stream-bench,bandwidth,probe,pipeline}
{
    echo "built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (modified)')"
    echo "CUDA $CUDA_WHEEL_VERSION (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')), cudarc $CUDARC_CUDA_VERSION, compute $CUDA_COMPUTE_CAP"
    echo "repo root at build time: $ROOT"
    (cd "$STAGE" && ls -l gpu-tests minilm-tests lib-tests offload-bench moe-bench lora-stream-bench bandwidth probe pipeline)
} > "$STAGE/MANIFEST"
rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$STAGE" -cJf "$OUT/gpu-bin.tar.xz" \
    MANIFEST gpu-tests minilm-tests lib-tests offload-bench moe-bench lora-stream-bench bandwidth probe pipeline
cp "$STAGE/MANIFEST" "$OUT/MANIFEST"
echo "gpu-build: $(du -h "$OUT/gpu-bin.tar.xz" | cut -f1) packed in $OUT (the device tool carries at most 64 MiB)" >&2
cat "$OUT/MANIFEST" >&2
