#!/usr/bin/env bash
# Vendors every crate the lock file names into .cache/vendor, for builds on machines without
# network (scripts/gpu-check.sh on the GPU machine). Writes the source replacement cargo needs to
# .cache/vendor-config.toml, which gpu-check.sh passes with `--config`; normal builds never read
# it (no .cargo/config.toml is written). The tree is ~270 MiB (two thirds of it Windows import
# libraries cargo still wants present), so it is also packed into .cache/vendor.tar.gz (~30 MiB);
# carry `.cache/vendor.tar.gz` and `.cache/vendor-config.toml` to the GPU machine, where
# gpu-check.sh unpacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
# `cargo vendor` prints the [source] snippet; its path is relative to the repository root, which
# is where gpu-check.sh runs cargo from (it rewrites the path to an absolute one before use).
cargo vendor --locked --versioned-dirs .cache/vendor > .cache/vendor-config.toml
echo "vendored $(ls .cache/vendor | wc -l) crates, $(du -sh .cache/vendor | cut -f1) in .cache/vendor" >&2
tar -C .cache -czf .cache/vendor.tar.gz vendor
echo "packed: .cache/vendor.tar.gz ($(du -h .cache/vendor.tar.gz | cut -f1)); config: .cache/vendor-config.toml" >&2
