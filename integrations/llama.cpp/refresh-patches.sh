#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Rewrites patches/ from an edited llama.cpp tree, for the maintainers of the patch set.
#
#   integrations/llama.cpp/refresh-patches.sh SRC
#
# SRC is a llama.cpp tree (build.sh's DIR/src) turned into a git repository whose first commit
# is the pristine source, with the patches' edits in its work tree:
#   cd build/llama.cpp-oasiskv/src && git init -q && git add -A && git commit -qm pristine
#   (then reverse-apply patches/*.patch and commit, or unpack a pristine copy there first)
# Each patch keeps its files; a file no patch names yet goes to the last one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src=${1:?usage: refresh-patches.sh SRC}
base=$(git -C "$src" rev-list --max-parents=0 HEAD)
declare -A owner
for p in "$here"/patches/*.patch; do
  while read -r f; do owner[$f]=$p; done < <(sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$p")
done
mapfile -t changed < <(git -C "$src" diff --name-only "$base")
last=$(ls "$here"/patches/*.patch | tail -n 1)
for p in "$here"/patches/*.patch; do
  files=()
  for f in "${changed[@]}"; do
    if [ "${owner[$f]:-$last}" = "$p" ]; then files+=("$f"); fi
  done
  header=$(sed -n '1,/^diff --git/p' "$p" | sed '$d')
  { printf '%s\n' "$header"; git -C "$src" diff --no-color "$base" -- "${files[@]}"; } >"$p.new"
  mv "$p.new" "$p"
  echo "== $(basename "$p"): ${files[*]}"
done
