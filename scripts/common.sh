# SPDX-License-Identifier: Apache-2.0
# Shared by scripts/*.sh: install what is missing (Debian), find the CUDA toolkit.

# oasiskv_install_packages PKG...: installs the packages that are not installed yet. As root it
# runs apt-get itself (update once, then install); otherwise it names what to install and stops.
oasiskv_install_packages() {
  local missing=()
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing Debian packages: ${missing[*]}" >&2
    echo "       install them with: sudo apt-get install -y ${missing[*]}" >&2
    return 1
  fi
  echo "== installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

# Sets OASISKV_CUDA_ARGS to the CMake arguments that enable CUDA where nvcc exists.
oasiskv_find_cuda() {
  local nvcc=""
  if command -v nvcc >/dev/null 2>&1; then
    nvcc=$(command -v nvcc)
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    nvcc=/usr/local/cuda/bin/nvcc
  fi
  if [ -n "$nvcc" ]; then
    OASISKV_CUDA_ARGS=(-DOASISKV_ENABLE_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  else
    OASISKV_CUDA_ARGS=(-DOASISKV_ENABLE_CUDA=OFF)
  fi
}

OASISKV_BASE_PACKAGES=(cmake ninja-build g++ git ca-certificates doctest-dev libfmt-dev
  libbenchmark-dev libopenblas-dev clang-format-14 liburing-dev pkg-config
  libcli11-dev unzip libucx-dev ucx-utils
  libcpp-httplib-dev nlohmann-json3-dev curl)

# oasiskv_release_mini_decoder: for the measuring scripts. Sets `model` and `bin` (SmolLM2 and
# the release mini_decoder, built here when missing), fails naming scripts/fetch-models.sh when
# the model is absent. (mini_decoder picks OpenBLAS's kernels itself: apps/mini_decoder/ops/blas.hpp.)
oasiskv_release_mini_decoder() {
  model=models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -e "$model" ] || { echo "error: $model is missing (run scripts/fetch-models.sh)" >&2; exit 1; }
  bin=build/release/apps/mini_decoder/mini_decoder
  if [ ! -x "$bin" ]; then
    cmake --preset release >/dev/null
    cmake --build --preset release --target mini_decoder
  fi
}
