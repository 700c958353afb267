#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Puts FlashInfer's CUDA headers in third_party_cache/flashinfer/include (ignored by git), where
# CMake finds them (OASISKV_FLASHINFER_INCLUDE_DIR) to build cuda::flashinfer_decode's test and
# benchmark rows. They come from the flashinfer-python wheel (header-only CUDA under
# flashinfer/data/include). Usage:
#   scripts/fetch-flashinfer.sh            pip-downloads flashinfer-python $FLASHINFER_VERSION
#   scripts/fetch-flashinfer.sh WHEEL      unpacks a wheel already downloaded
#   scripts/fetch-flashinfer.sh DIR        copies an include folder (holding flashinfer/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
version=${FLASHINFER_VERSION:-0.7.4}
cache=third_party_cache
dest=$cache/flashinfer/include
src=${1:-}
rm -rf "$dest"
mkdir -p "$dest"
if [ -n "$src" ] && [ -d "$src" ]; then
  [ -f "$src/flashinfer/attention/decode.cuh" ] ||
    { echo "error: $src/flashinfer/attention/decode.cuh missing" >&2; exit 1; }
  cp -r "$src/flashinfer" "$dest/"
else
  if [ -z "$src" ]; then
    mkdir -p "$cache/wheels"
    python3 -m pip download --no-deps --only-binary=:all: -d "$cache/wheels" \
      "flashinfer-python==$version"
    src=$(ls "$cache"/wheels/flashinfer_python-"$version"-*.whl | head -n 1)
    downloaded=1
  fi
  python3 - "$src" "$dest" <<'PY'
import sys, zipfile, os
wheel, dest = sys.argv[1], sys.argv[2]
prefix = "flashinfer/data/include/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not names:
        sys.exit(f"error: {wheel} has no {prefix}")
    for n in names:
        out = os.path.join(dest, n[len(prefix):])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(n) as f, open(out, "wb") as g:
            g.write(f.read())
PY
fi
if [ -n "${downloaded:-}" ]; then
  rm -rf "$cache/wheels"  # only the headers travel with the checkout
fi
[ -f "$dest/flashinfer/attention/decode.cuh" ] ||
  { echo "error: no flashinfer/attention/decode.cuh under $dest" >&2; exit 1; }
echo "fetch-flashinfer.sh: $dest ready ($(du -sh "$dest" | cut -f1))"
