#!/usr/bin/env bash
# Installs what is missing (Debian, as root), builds the examples optimised, and runs the demo:
# one decode-attention step assembled from OasisKV policies, sparse over staged blocks vs dense.
# Arguments are passed to the example: [context_tokens=32768] [budget_tokens=2048].
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh

oasiskv_install_packages cmake ninja-build g++
cmake --preset release -DOASISKV_BUILD_TESTS=OFF -DOASISKV_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build --preset release --target assemble_step -j "$(nproc 2>/dev/null || echo 2)"
if [ $# -eq 0 ]; then
  set -- 32768 2048
fi
exec build/release/examples/assemble_step "$@"
