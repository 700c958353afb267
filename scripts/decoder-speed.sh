#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Decode speed of the mini-decoder on SmolLM2-135M at 4k and 8k context: OasisKV (budget 1024)
# against dense, each pair in one run of the CLI (--compare dense), 1 thread. The prompt is
# this repository's docs and headers cut to ~4k or ~7k tokens, then a question. Both modes
# generate all 160 tokens (--ignore-eos), so their rates cover the same lengths.
#   [DRAFT=ngram|self|none] scripts/decoder-speed.sh [extra mini_decoder flags]
# Needs the release build of mini_decoder (apps/mini_decoder) and the model (scripts/demo.sh makes both).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=build/release/apps/mini_decoder/mini_decoder
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
for f in "$bin" "$model"; do
  [ -e "$f" ] || { echo "error: $f is missing (run scripts/demo.sh first)" >&2; exit 1; }
done
doc=$(mktemp)
all=$(mktemp)
trap 'rm -f "$doc" "$all"' EXIT
# Whole files first: `cat | head -c` would end cat with SIGPIPE, which pipefail makes fatal.
cat README.md docs/architecture.md docs/performance.md docs/predictors.md docs/file_tier.md \
  include/oasiskv/kv_cache.hpp include/oasiskv/scheduler/staging_scheduler.hpp >"$all"
for spec in 4k:13000 8k:21800; do
  head -c "${spec#*:}" "$all" >"$doc"
  printf '\n\nQuestion: list the components of OasisKV that the document above describes, and '\
'explain each one in a sentence.' >>"$doc"
  echo "== ${spec%%:*} context (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$bin" --model "$model" --prompt-file "$doc" --chat --max-tokens 160 --ignore-eos --mode oasis \
    --budget 1024 --draft "${DRAFT:-ngram}" --compare dense --threads 1 --attention-threads 1 --quiet "$@"
done
