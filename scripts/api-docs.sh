#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Generates the API reference from the headers' //! comments (docs/Doxyfile) into
# build/api/html/index.html (or the folder given as $1), and fails if Doxygen warns: a broken
# command, an unbalanced tag or a parameter name that does not exist is a defect like any other.
# Installs doxygen when run as root where it is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/common.sh
oasiskv_install_packages doxygen
out=${1:-build/api}
rm -rf "$out"
mkdir -p "$out"
OASISKV_API_OUT=$(cd "$out" && pwd) doxygen docs/Doxyfile
if [ -s "$out/warnings.log" ]; then
  cat "$out/warnings.log" >&2
  echo "error: Doxygen warned $(wc -l <"$out/warnings.log") times (above); fix the //! comments" >&2
  exit 1
fi
echo "API reference: $out/html/index.html"
