#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fills third_party_cache/ (ignored by git) with what scripts/gpu-check.sh needs on a GPU machine
# that has the CUDA toolkit, CMake and ninja but no Debian -dev packages and no network:
#   third_party_cache/doctest/  the header-only doctest as a tiny CMake project (doctest::doctest)
#   third_party_cache/fmt/      an empty stand-in: the CUDA targets never use fmt
#   third_party_cache/flashinfer/include/  FlashInfer's headers (scripts/fetch-flashinfer.sh),
#                               when not there yet and they can be fetched (optional: without
#                               them gpu-check.sh leaves the FlashInfer rows out)
# Run it here, then carry third_party_cache with the GPU run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache=third_party_cache
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
if [ ! -f "$cache/flashinfer/include/flashinfer/attention/decode.cuh" ]; then
  scripts/fetch-flashinfer.sh ${FLASHINFER_SOURCE:+"$FLASHINFER_SOURCE"} ||
    echo "warning: FlashInfer's headers not fetched; gpu-check.sh will leave its rows out" >&2
fi
echo "prepare-gpu-check.sh: $cache ready ($(du -sh "$cache" | cut -f1))"
