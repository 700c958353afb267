#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/gpu-check.sh --dry-run, as CI can run it: prepares the carried folder into a scratch
# directory (doctest and the fmt stand-in; FlashInfer's headers are not fetched), runs the dry
# run (its configure is real, the device-only steps are echoed), and checks its JSON: every step
# passed or was a dry run, and the steps are the ones a GPU run takes.
# Usage: gpu_check_dry_run.sh <source dir> <scratch dir>
set -euo pipefail
src=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
"$src/scripts/prepare-gpu-check.sh" --cache "$work/cache" --no-flashinfer
"$src/scripts/gpu-check.sh" --dry-run --cache "$work/cache" "$work/out"
json=$work/out/gpu-check.json
python3 - "$json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["dry_run"] is True, d["dry_run"]
assert d["status"] == "pass", d["steps"]
steps = [(s["name"], s["status"]) for s in d["steps"]]
want = [("inputs", "pass"), ("configure", "pass"), ("list-tests", "pass"), ("build", "dry-run"),
        ("ctest", "dry-run"), ("benchmark", "dry-run")]
assert steps == want, steps
listed = d["steps"][2]["note"].split()
for t in ("test_cuda_core", "test_cuda_sparse_decode", "test_cuda_topk_selector",
          "test_cuda_host_plans", "test_cuda_device_step"):
    assert t in listed, (t, listed)
assert d["benchmark"] is None
print("gpu-check dry run:", ", ".join(f"{n} {s}" for n, s in steps))
PY
