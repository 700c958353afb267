#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds llama.cpp with OasisKV as its KV cache: downloads the pinned llama.cpp source (the
# vendor/llama.cpp of the llama-cpp-python sdist on PyPI), verifies it, applies the patch set in
# patches/ (no fuzz) and builds llama-cli, llama-server, llama-bench and llama-batched with the
# OasisKV memory type of src/ (docs/llama.cpp.md).
#
#   integrations/llama.cpp/build.sh [--build-dir DIR] [--targets "T..."] [--jobs N]
#
# --build-dir  where the patched source (DIR/src) and the build (DIR/build, binaries in
#              DIR/build/bin) go; default build/llama.cpp-oasiskv in the repository
# --targets    the CMake targets to build (default: llama-cli llama-server llama-bench llama-batched)
# --jobs       parallel compile jobs (default: the number of cores)
#
# The sdist is kept in ${OASISKV_CACHE_DIR:-~/.cache/oasiskv} and reused once verified; to use a
# copy already on this machine instead of downloading, point OASISKV_LLAMA_SDIST at it (it is
# verified all the same). Compiles go through ccache where it is installed (its cache stays in
# ccache's own directory, outside the clone), and a second run rebuilds only what changed: the
# source is unpacked again only when the sdist or a patch changed, and then only the files that
# differ are rewritten.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

# The pinned source: llama-cpp-python 0.3.36 carries llama.cpp build b11312 (commit 0c1e57098).
sdist_version=0.3.36
sdist_name="llama_cpp_python-$sdist_version.tar.gz"
sdist_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
llama_build_number=11312
llama_build_commit=0c1e570

build_dir="$root/build/llama.cpp-oasiskv"
targets="llama-cli llama-server llama-bench llama-batched"
jobs=$(nproc 2>/dev/null || echo 2)
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "error: --jobs takes a positive count, not '$jobs'" >&2; exit 2; }
mkdir -p "$build_dir"
build_dir="$(cd "$build_dir" && pwd)"

verify() { echo "$sdist_sha256  $1" | sha256sum --check --status; }

# -- the sdist, downloaded once into the cache and verified ---------------------------------------
cache="${OASISKV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/oasiskv}"
mkdir -p "$cache"
sdist="$cache/$sdist_name"
if [ -f "$sdist" ] && verify "$sdist"; then
  :
elif [ -n "${OASISKV_LLAMA_SDIST:-}" ]; then
  verify "$OASISKV_LLAMA_SDIST" ||
    { echo "error: OASISKV_LLAMA_SDIST=$OASISKV_LLAMA_SDIST does not have sha256 $sdist_sha256" >&2; exit 1; }
  cp "$OASISKV_LLAMA_SDIST" "$sdist.part" && mv "$sdist.part" "$sdist"
else
  echo "== downloading $sdist_name from PyPI (~75 MB)"
  # The sdist's address, from PyPI's simple index (PEP 503: the page pip itself reads).
  url=$(curl -fsSL --retry 3 "https://pypi.org/simple/llama-cpp-python/" | python3 -c '
import re, sys
m = re.search(r"href=\"([^\"#]*/" + re.escape(sys.argv[1]) + r")[#\"]", sys.stdin.read())
print(m.group(1) if m else "")' "$sdist_name")
  [ -n "$url" ] || { echo "error: PyPI's index lists no $sdist_name" >&2; exit 1; }
  curl -fsSL --retry 3 -o "$sdist.part" "$url"
  verify "$sdist.part" || {
    rm -f "$sdist.part"
    echo "error: $url does not have sha256 $sdist_sha256" >&2
    exit 1
  }
  mv "$sdist.part" "$sdist"
fi

# -- the patched source -------------------------------------------------------------------------
patches=("$here"/patches/*.patch)
stamp="$sdist_sha256 $(cat "${patches[@]}" | sha256sum | cut -d' ' -f1)"
src="$build_dir/src"
if [ "$(cat "$src/.oasiskv-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "== unpacking llama.cpp b$llama_build_number and applying ${#patches[@]} patches"
  tmp=$(mktemp -d "$build_dir/unpack.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  tar -xzf "$sdist" -C "$tmp" --strip-components=3 --exclude='*/vendor/llama.cpp/.git' \
    "llama_cpp_python-$sdist_version/vendor/llama.cpp"
  for p in "${patches[@]}"; do
    patch -d "$tmp" -p1 --fuzz=0 --no-backup-if-mismatch --quiet <"$p" ||
      { echo "error: $(basename "$p") does not apply to llama.cpp b$llama_build_number" >&2; exit 1; }
  done
  if [ -d "$src" ]; then
    # Rewrite only the files whose content changed, so that an unchanged file keeps its time
    # stamp and the build does not redo it.
    (cd "$tmp" && find . -type f -print0) | while IFS= read -r -d '' f; do
      cmp -s "$tmp/$f" "$src/$f" || { mkdir -p "$(dirname "$src/$f")" && cp -p "$tmp/$f" "$src/$f"; }
    done
  else
    mv "$tmp" "$src"
    mkdir -p "$tmp"
  fi
  echo "$stamp" >"$src/.oasiskv-stamp"
fi

# -- configure and build ------------------------------------------------------------------------
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # paths below the clone hashed relative to it: a clone elsewhere hits the same entries
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
fi
# AVX-512 and VNNI on, AMX off (AMX instructions trap on some virtual machines); no tests, no web
# UI (neither built nor downloaded), no HTTPS; the build number and commit of the pinned source.
cmake -S "$src" -B "$build_dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=$llama_build_number \
  -DLLAMA_BUILD_COMMIT=$llama_build_commit -DLLAMA_OASISKV_DIR="$root" "${launcher[@]}" \
  >"$build_dir/configure.log" 2>&1 || { cat "$build_dir/configure.log" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build_dir/build" -j "$jobs" --target $targets
echo "== built: $build_dir/build/bin ($targets)"
