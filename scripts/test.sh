#!/usr/bin/env bash
# The test command: everything the tests need is fetched here, then the whole suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-minilm.sh
cargo test
