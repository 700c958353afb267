#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds and runs the CUDA tests and the CUDA benchmark on a machine with a GPU, and writes the
# results to a folder (default: $OUT if set, else gpu-check-out/):
#   gpu-check.log           everything, in order
#   ctest-cuda.log          the CUDA tests (ctest -L cuda)
#   cuda_bench.json         the benchmark's measurements (ratios to ceilings measured in the run)
# Needs only the CUDA toolkit, CMake, ninja and g++: doctest comes from third_party_cache/ (run
# scripts/prepare-gpu-check.sh beforehand where doctest-dev is installed, and carry that folder).
# Where third_party_cache/flashinfer/include holds FlashInfer's headers (the same script fetches
# them), cuda::flashinfer_decode's test and benchmark rows are built too (sm_80 and newer).
# Builds for the local GPU's architecture only, to stay well inside 8 minutes on an H200.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
log="$out/gpu-check.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }
status=0

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '.')
arch=${arch:-90}
say "== gpu-check: $(date -u +%FT%TZ), nvcc $("$nvcc" --version | tail -n 1), sm_$arch"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
[ -f third_party_cache/doctest/include/doctest/doctest.h ] ||
  { say "error: third_party_cache/doctest missing: run scripts/prepare-gpu-check.sh and carry it"; exit 1; }

say "== configure"
build=build-gpu-check
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOASISKV_WERROR=ON \
  -DOASISKV_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DOASISKV_CUDA_ARCHITECTURES="$arch" \
  -DOASISKV_BUILD_EXAMPLES=OFF -DOASISKV_BUILD_APPS=OFF -DOASISKV_BUILD_BENCHMARKS=OFF \
  -DOASISKV_INSTALL=OFF \
  -DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=NEVER -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
  -DFETCHCONTENT_SOURCE_DIR_DOCTEST="$PWD/third_party_cache/doctest" \
  -DFETCHCONTENT_SOURCE_DIR_FMT="$PWD/third_party_cache/fmt" >>"$log" 2>&1; then
  say "error: configure failed (see $log)"
  exit 1
fi

say "== build the CUDA tests"
tests=(test_cuda_core test_cuda_copy_engine test_cuda_sparse_decode test_cuda_topk_selector
  test_cuda_device_summary test_cuda_device_qminmax_summary test_cuda_qminmax_math
  test_cuda_kv_cache test_cuda_device_step)
flashinfer=third_party_cache/flashinfer/include
bench_flashinfer=()
if [ -f "$flashinfer/flashinfer/attention/decode.cuh" ] && [ "$arch" -ge 80 ]; then
  tests+=(test_cuda_flashinfer_decode)
  bench_flashinfer=(-isystem "$flashinfer" -DOASISKV_BENCH_FLASHINFER=1)
  say "FlashInfer headers: $flashinfer (test and benchmark rows built)"
else
  say "FlashInfer headers absent (scripts/fetch-flashinfer.sh) or sm_$arch < 80: not built"
fi
if ! ninja -C "$build" -j "$(nproc)" "${tests[@]}" >>"$log" 2>&1; then
  say "error: building the CUDA tests failed (see $log)"
  status=1
fi

say "== run the CUDA tests"
ctest --test-dir "$build" -L cuda --output-on-failure 2>&1 | tee "$out/ctest-cuda.log" >>"$log"
grep -qE '^100% tests passed' "$out/ctest-cuda.log" || status=1
grep -q '(Skipped)' "$out/ctest-cuda.log" && { say "error: CUDA tests skipped on a GPU machine"; status=1; }

say "== build and run the CUDA benchmark"
# Compiled directly with the flags of oasiskv_cuda_target: the bench/ folder needs Google
# Benchmark (for the CPU benchmarks), which GPU machines lack; this one is a plain harness.
bench="$build/cuda_attention_decode_bench"
if "$nvcc" -std=c++20 -O3 -Iinclude --extended-lambda --expt-relaxed-constexpr \
  -Werror=all-warnings -gencode "arch=compute_$arch,code=sm_$arch" "${bench_flashinfer[@]}" \
  bench/cuda_attention_decode.bench.cu -o "$bench" -lpthread >>"$log" 2>&1; then
  timeout 300 "$bench" "$out/cuda_bench.json" 2>&1 | tee -a "$log" || status=1
else
  say "error: building the benchmark failed (see $log)"
  status=1
fi

say "== summary"
tail -n 4 "$out/ctest-cuda.log" 2>/dev/null | tee -a "$log"
grep '"summary"' "$out/cuda_bench.json" 2>/dev/null | tee -a "$log"
say "gpu-check.sh: exit $status; results in $out"
exit "$status"
