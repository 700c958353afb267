#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fills the folder scripts/gpu-check.sh needs on a GPU machine that has the CUDA toolkit, CMake
# and ninja but no Debian -dev packages and no network. Run it here, then carry that one folder
# (default third_party_cache/, ignored by git; about 8 MiB) with the checkout to the GPU run:
#   <cache>/doctest/                 the header-only doctest as a tiny CMake project (doctest::doctest)
#   <cache>/fmt/                     an empty stand-in: the CUDA targets never use fmt
#   <cache>/flashinfer/include/      FlashInfer 0.7.4's headers (scripts/fetch-flashinfer.sh), when
#                                    not there yet and they can be fetched (optional: without them
#                                    gpu-check.sh leaves the FlashInfer test and rows out)
# Usage: scripts/prepare-gpu-check.sh [--cache DIR] [--no-flashinfer]
#   FLASHINFER_SOURCE=<wheel or include folder> uses one at hand instead of downloading.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=third_party_cache
want_flashinfer=1
while [ $# -gt 0 ]; do
  case $1 in
    --cache) cache=$2; shift ;;
    --no-flashinfer) want_flashinfer=0 ;;
    *) echo "prepare-gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
src=/usr/include/doctest/doctest.h
[ -f "$src" ] || { echo "error: $src missing (apt-get install doctest-dev)" >&2; exit 1; }
mkdir -p "$cache/doctest/include/doctest" "$cache/fmt"
cp "$src" "$cache/doctest/include/doctest/doctest.h"
cat >"$cache/doctest/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(doctest_header_only LANGUAGES CXX)
add_library(doctest INTERFACE)
add_library(doctest::doctest ALIAS doctest)
target_include_directories(doctest INTERFACE "${CMAKE_CURRENT_SOURCE_DIR}/include")
CMAKE
cat >"$cache/fmt/CMakeLists.txt" <<'CMAKE'
# Stand-in for fmt on machines without it: defines no target, so fmt-only targets are left out.
CMAKE
if [ "$want_flashinfer" = 1 ] && [ ! -f "$cache/flashinfer/include/flashinfer/attention/decode.cuh" ]; then
  if [ "$cache" = third_party_cache ]; then
    scripts/fetch-flashinfer.sh ${FLASHINFER_SOURCE:+"$FLASHINFER_SOURCE"} ||
      echo "warning: FlashInfer's headers not fetched; gpu-check.sh will leave its rows out" >&2
  else
    echo "warning: FlashInfer's headers go to third_party_cache/ only (scripts/fetch-flashinfer.sh)" >&2
  fi
fi
echo "prepare-gpu-check.sh: $cache ready ($(du -sh "$cache" | cut -f1)); carry that folder"
