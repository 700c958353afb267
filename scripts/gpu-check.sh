#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds and runs the CUDA tests and the CUDA benchmark on a machine with a GPU, in one call of at
# most 9 minutes on a fresh H100 or H200 machine (16 cores, driver present, no network), and writes
# to the output folder (the argument, else $OUT if set, else gpu-check-out/):
#   gpu-check.json   every step, every CUDA test and every benchmark figure with pass/fail
#   gpu-check.log    everything, in order
#   ctest-cuda.log   the CUDA tests' output (ctest -L cuda)
#   cuda_bench.json  the benchmark's rows and targets (also inside gpu-check.json)
#
# What must travel with the checkout (it is ignored by git): the folder third_party_cache/,
# filled here beforehand by scripts/prepare-gpu-check.sh:
#   third_party_cache/doctest/              doctest as a tiny CMake project (required)
#   third_party_cache/fmt/                  an empty fmt stand-in (required)
#   third_party_cache/flashinfer/include/   FlashInfer's headers (optional: without them the
#                                           FlashInfer test and benchmark rows are left out)
# e.g. the device tool's `carry: ["third_party_cache"]` (about 8 MiB).
#
# Usage: scripts/gpu-check.sh [--dry-run] [--cache DIR] [--arch NN] [outdir]
#   --dry-run  no GPU needed: checks the carried inputs, configures the same build, lists the
#              targets and tests it would build and run (they must exist), echoes the device-only
#              commands (build, ctest, benchmark) instead of running them, and writes the JSON with
#              "dry_run": true. Runs in CI (tests/CMakeLists.txt: gpu_check_dry_run).
#   --cache    the prepared folder (default third_party_cache)
#   --arch     the CUDA architecture (default: the local GPU's, or 90 without one)
#
# Time: configure (~30 s), then the CUDA tests (ninja, all cores) and the benchmark (nvcc) built
# side by side for the local architecture only, the tests run (ctest --timeout 120, 4 at a time;
# the GPU is shared, no test times anything), then the benchmark alone with what is left of the
# 510-second budget (it rewrites its JSON after each section, so a run cut short keeps what it
# measured). Exit status: 0 when everything built, every CUDA test passed (none skipped) and the
# benchmark ran; the benchmark's targets are reported, not enforced.
# Compiler warnings are not errors here (OASISKV_WERROR=OFF, no -Werror): another compiler on the
# GPU machine must not stop the one run; CI builds with -Werror.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

dry_run=0
cache=third_party_cache
arch=
out=
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    --cache) cache=$2; shift ;;
    --arch) arch=$2; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed 's/^# \{0,1\}//;/^set -uo/d'; exit 0 ;;
    -*) echo "gpu-check.sh: unknown option $1" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
out=${out:-${OUT:-gpu-check-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cache=$(cd "$cache" 2>/dev/null && pwd || echo "$cache")
log="$out/gpu-check.log"
: >"$log"
budget=510  # seconds: 9 minutes less a margin for the tool's start and transfers
start=$SECONDS
say() { echo "$@" | tee -a "$log"; }
left() { echo $((budget - (SECONDS - start))); }

# Steps and their outcome, for the JSON.
steps_json=""
status=0
step() {  # step <name> <pass|fail|skipped|dry-run> <seconds> [note]
  local note=${4:-}
  steps_json+="${steps_json:+,}
    {\"name\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"note\": \"${note//\"/\'}\"}"
  [ "$2" = fail ] && status=1
  say "-- $1: $2 (${3}s)${note:+: $note}"
}
# Runs "$@" or, in a dry run, shows it.
run() {
  if [ "$dry_run" = 1 ]; then
    say "[dry-run] $*"
  else
    "$@"
  fi
}

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
gpu=none
driver=none
if [ "$dry_run" = 0 ]; then
  query=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null |
    head -n 1)
  gpu=$(cut -d, -f1 <<<"$query" | sed 's/^ *//;s/ *$//')
  driver=$(cut -d, -f2 <<<"$query" | tr -d ' ')
  arch=${arch:-$(cut -d, -f3 <<<"$query" | tr -d ' .')}
fi
arch=${arch:-90}
nvcc_version=$("$nvcc" --version 2>/dev/null | tail -n 1 || echo "no nvcc")
say "== gpu-check: $(date -u +%FT%TZ), ${gpu:-no GPU}, driver ${driver:-?}, sm_$arch, $nvcc_version$(
  [ "$dry_run" = 1 ] && echo ', dry run')"
[ "$dry_run" = 0 ] && nvidia-smi >>"$log" 2>&1

# 1. What must have travelled with the checkout.
t=$SECONDS
missing=""
[ -f "$cache/doctest/include/doctest/doctest.h" ] || missing+=" $cache/doctest"
[ -f "$cache/fmt/CMakeLists.txt" ] || missing+=" $cache/fmt"
command -v cmake >/dev/null || missing+=" cmake"
command -v ninja >/dev/null || missing+=" ninja"
[ -x "$nvcc" ] || missing+=" nvcc"
flashinfer=$cache/flashinfer/include
bench_flashinfer=()
with_flashinfer=0
if [ -f "$flashinfer/flashinfer/attention/decode.cuh" ] && [ "$arch" -ge 80 ]; then
  with_flashinfer=1
  bench_flashinfer=(-isystem "$flashinfer" -DOASISKV_BENCH_FLASHINFER=1)
fi
if [ -n "$missing" ]; then
  step inputs fail $((SECONDS - t)) "missing:$missing (run scripts/prepare-gpu-check.sh here and carry $cache)"
else
  step inputs pass $((SECONDS - t)) "doctest, fmt stand-in$([ $with_flashinfer = 1 ] && echo ', FlashInfer headers')"
fi

# 2. Configure (also in a dry run: the step most likely to meet a difference of the machine).
build="build-gpu-check"
[ "$dry_run" = 1 ] && build="$out/build"
configured=0
if [ "$status" = 0 ]; then
  t=$SECONDS
  if cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOASISKV_WERROR=OFF \
    -DOASISKV_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DOASISKV_CUDA_ARCHITECTURES="$arch" \
    -DOASISKV_BUILD_EXAMPLES=OFF -DOASISKV_BUILD_APPS=OFF -DOASISKV_BUILD_BENCHMARKS=OFF \
    -DOASISKV_INSTALL=OFF -DOASISKV_FLASHINFER_INCLUDE_DIR="$flashinfer" \
    -DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=NEVER -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
    -DFETCHCONTENT_SOURCE_DIR_DOCTEST="$cache/doctest" \
    -DFETCHCONTENT_SOURCE_DIR_FMT="$cache/fmt" >>"$log" 2>&1; then
    configured=1
    step configure pass $((SECONDS - t))
  else
    step configure fail $((SECONDS - t)) "see gpu-check.log"
  fi
fi

# 3. The CUDA tests' targets (every test labelled cuda) and the benchmark, built side by side.
tests=()
if [ "$configured" = 1 ]; then
  # The binaries of the tests labelled cuda (test_cuda_<name>, run as <name> and <name>_host).
  mapfile -t tests < <(ctest --test-dir "$build" -N -L cuda 2>/dev/null |
    sed -nE 's/^ *Test +#[0-9]+: (test_cuda_[A-Za-z0-9_]+)$/\1/p' | sed 's/_host$//' | sort -u)
  targets=$(ninja -C "$build" -t targets all 2>/dev/null | sed -nE 's/^([A-Za-z0-9_]+): .*/\1/p')
  unknown=""
  for target in "${tests[@]}"; do
    grep -qx "$target" <<<"$targets" || unknown+=" $target"
  done
  if [ "${#tests[@]}" -lt 10 ]; then
    step list-tests fail 0 "ctest -L cuda lists ${#tests[@]} test binaries"
  elif [ -n "$unknown" ]; then
    step list-tests fail 0 "no build target for:$unknown"
  else
    step list-tests pass 0 "${tests[*]}"
  fi
  if [ "$with_flashinfer" = 1 ] && ! printf '%s\n' "${tests[@]}" | grep -qx test_cuda_flashinfer_decode; then
    step list-tests fail 0 "FlashInfer's headers were carried but its test is not configured"
  fi
fi
bench="$build/cuda_attention_decode_bench"
bench_cmd=("$nvcc" -std=c++20 -O3 -Iinclude -Ibench --extended-lambda --expt-relaxed-constexpr
  -gencode "arch=compute_$arch,code=sm_$arch" "${bench_flashinfer[@]}"
  bench/cuda_attention_decode.bench.cu -o "$bench" -lpthread)
built=0
if [ "$status" = 0 ]; then
  t=$SECONDS
  if [ "$dry_run" = 1 ]; then
    run ninja -C "$build" -j "$(nproc)" "${tests[@]}"
    run "${bench_cmd[@]}"
    [ -f bench/cuda_attention_decode.bench.cu ] && [ -f bench/cuda_bench_report.hpp ] ||
      step build fail 0 "the benchmark's sources are missing"
    step build dry-run $((SECONDS - t)) "${#tests[@]} test binaries and the benchmark"
  else
    # The benchmark (one nvcc process) beside the tests (ninja on the other cores).
    ( "${bench_cmd[@]}" >"$out/bench-build.log" 2>&1 ) &
    bench_pid=$!
    ninja -C "$build" -j "$(nproc)" "${tests[@]}" >>"$log" 2>&1
    tests_rc=$?
    wait "$bench_pid"
    bench_rc=$?
    cat "$out/bench-build.log" >>"$log"
    if [ "$tests_rc" = 0 ]; then
      step build-tests pass $((SECONDS - t))
      built=1
    else
      step build-tests fail $((SECONDS - t)) "see gpu-check.log"
    fi
    if [ "$bench_rc" = 0 ]; then
      step build-benchmark pass $((SECONDS - t))
    else
      step build-benchmark fail $((SECONDS - t)) "see bench-build.log"
    fi
  fi
fi

# 4. The CUDA tests: all must pass, none may skip (there is a GPU).
passed=0
failed=0
skipped=0
tests_json=""
if [ "$dry_run" = 1 ] && [ "$configured" = 1 ]; then
  run ctest --test-dir "$build" -L cuda --timeout 120 -j 4 --output-on-failure
  step ctest dry-run 0 "$(ctest --test-dir "$build" -N -L cuda | grep -c 'Test *#') tests listed"
elif [ "$built" = 1 ]; then
  t=$SECONDS
  ctest --test-dir "$build" -L cuda --timeout 120 -j 4 --output-on-failure \
    >"$out/ctest-cuda.log" 2>&1
  ctest_rc=$?
  cat "$out/ctest-cuda.log" >>"$log"
  # "  3/12 Test  #7: test_cuda_core ..........   Passed    0.52 sec" (or ***Failed, ***Skipped,
  # ***Timeout, Not Run, ...).
  while IFS='|' read -r name result secs; do
    case $result in
      Passed) passed=$((passed + 1)) ;;
      Skipped) skipped=$((skipped + 1)) ;;
      *) failed=$((failed + 1)) ;;
    esac
    tests_json+="${tests_json:+,}
    {\"name\": \"$name\", \"result\": \"$result\", \"seconds\": ${secs:-0}}"
  done < <(sed -nE 's/^ *[0-9]+\/[0-9]+ +Test +#[0-9]+: ([A-Za-z0-9_]+) *\.* *\**([A-Za-z][^*]*[^ ]) +([0-9.]+) sec.*/\1|\2|\3/p' \
    "$out/ctest-cuda.log")
  if [ "$ctest_rc" = 0 ] && [ "$failed" = 0 ] && [ "$skipped" = 0 ] && [ "$passed" -gt 0 ]; then
    step ctest pass $((SECONDS - t)) "$passed passed"
  else
    step ctest fail $((SECONDS - t)) "$passed passed, $failed failed, $skipped skipped (ctest exit $ctest_rc)"
  fi
fi

# 5. The benchmark, alone on the GPU, with what is left of the budget.
bench_json="$out/cuda_bench.json"
if [ "$dry_run" = 1 ]; then
  run timeout 240 "$bench" "$bench_json"
  step benchmark dry-run 0
elif [ -x "$bench" ]; then
  t=$SECONDS
  limit=$(($(left) - 15))
  if [ "$limit" -lt 60 ]; then
    step benchmark fail 0 "only ${limit}s left of the budget"
  else
    timeout "$limit" "$bench" "$bench_json" >>"$log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
      step benchmark pass $((SECONDS - t))
    else
      step benchmark fail $((SECONDS - t)) "exit $rc$([ "$rc" = 124 ] && echo ': cut at the budget, partial figures kept')"
    fi
  fi
fi

# 6. The JSON of everything.
json="$out/gpu-check.json"
{
  printf '{\n  "script": "scripts/gpu-check.sh",\n  "dry_run": %s,\n' \
    "$([ "$dry_run" = 1 ] && echo true || echo false)"
  printf '  "date": "%s",\n  "seconds": %d,\n' "$(date -u +%FT%TZ)" $((SECONDS - start))
  printf '  "machine": {"gpu": "%s", "driver": "%s", "arch": "sm_%s", "nvcc": "%s", "cores": %d},\n' \
    "$gpu" "$driver" "$arch" "${nvcc_version//\"/}" "$(nproc)"
  printf '  "flashinfer": %s,\n' "$([ "$with_flashinfer" = 1 ] && echo true || echo false)"
  printf '  "steps": [%s\n  ],\n' "$steps_json"
  printf '  "tests": [%s\n  ],\n' "$tests_json"
  printf '  "tests_passed": %d,\n  "tests_failed": %d,\n  "tests_skipped": %d,\n' \
    "$passed" "$failed" "$skipped"
  printf '  "benchmark": '
  if [ "$dry_run" = 0 ] && [ -s "$bench_json" ]; then
    sed 's/^/  /' "$bench_json" | sed '1s/^  //'
  else
    printf 'null\n'
  fi
  printf '  ,"status": "%s"\n}\n' "$([ "$status" = 0 ] && echo pass || echo fail)"
} >"$json"
say "== gpu-check.sh: $([ "$status" = 0 ] && echo pass || echo FAIL) in $((SECONDS - start))s; results in $out"
exit "$status"
