#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# llama.cpp's decode speed with and without OasisKV, from the same build in one run: llama-bench
# generates --gen tokens after a depth of 8k, 16k and 32k tokens (SmolLM2-135M Q4_1; beyond the
# model's 8k, YaRN extends the context), at 1 and 2 threads, once with the stock KV cache and
# once with OasisKV at a budget of 1024 tokens, each llama-bench call measuring both. Records
# tokens/s and the memory each KV cache holds (llama-bench's kv_bytes: the stock cache's buffer;
# OasisKV's staging pool, summaries and the capacity blocks in use, 0 of them for a file tier),
# writes them with the ratios to a JSON file and prints a table (docs/llama.cpp.md).
#
#   integrations/llama.cpp/bench.sh [--threads "1 2"] [--depths "8192 16384 32768"]
#       [--budget 1024] [--gen 64] [--reps 3] [--capacity host|file:PATH] [--summary int2]
#       [--flash-attn auto] [--out build/llama-oasiskv-bench.json] [--no-build]
#
# --flash-attn is llama-bench's -fa, a comma list of auto, on and off (default auto, what a user
# gets: on for the CPU). With several, each row's speedup is within one setting, and a last
# column gives OasisKV's fastest over the stock cache's fastest at that depth and thread count:
# on the CPU the stock cache decodes at depth faster with flash attention off.
#
# Measure on a quiet machine: the figures mean nothing while other work shares the cores.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
threads="1 2"
depths="8192 16384 32768"
budget=1024
gen=64
reps=3
capacity=host
summary=int2
flash_attn=auto
out="$root/build/llama-oasiskv-bench.json"
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --depths) depths=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --gen) gen=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --capacity) capacity=$2; shift 2 ;;
    --summary) summary=$2; shift 2 ;;
    --flash-attn) flash_attn=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in $threads $depths $budget $gen $reps; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "error: '$v' is not a positive count" >&2; exit 2; }
done
[[ "$flash_attn" =~ ^(auto|on|off)(,(auto|on|off))*$ ]] ||
  { echo "error: --flash-attn takes a comma list of auto, on and off, not '$flash_attn'" >&2; exit 2; }
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -e "$model" ] || { echo "error: $model is missing (run scripts/fetch-models.sh)" >&2; exit 1; }
build_dir="$root/build/llama.cpp-oasiskv"
[ "$build" -eq 0 ] || "$here/build.sh" --build-dir "$build_dir" --targets llama-bench
bench="$build_dir/build/bin/llama-bench"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
train=8192  # SmolLM2-135M's training context
for t in $threads; do
  for d in $depths; do
    # YaRN by the factor that brings the depth back within the training context
    scale=$(( (d + train - 1) / train ))
    rope=()
    [ "$scale" -le 1 ] || rope=(--rope-scale "$scale")
    echo "== $t thread(s), depth $d${rope:+, YaRN x$scale} (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    "$bench" -m "$model" -t "$t" -d "$d" -p 0 -n "$gen" -r "$reps" --oasis-budget "0,$budget" \
      --oasis-capacity "$capacity" --oasis-summary "$summary" -fa "$flash_attn" "${rope[@]}" -o json \
      >"$work/t$t-d$d.json" 2>"$work/t$t-d$d.err" || { cat "$work/t$t-d$d.err" >&2; exit 1; }
  done
done

mkdir -p "$(dirname "$out")"
python3 - "$work" "$out" "$budget" "$capacity" "$summary" <<'EOF'
import glob, json, os, platform, sys
work, out, budget, capacity, summary = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs = []
for f in sorted(glob.glob(os.path.join(work, "*.json"))):
    runs += json.load(open(f))
fa_name = {-1: "auto", 0: "off", 1: "on"}
rows = {}
for r in runs:
    key = (r["n_threads"], r["n_depth"], fa_name.get(r.get("flash_attn", -1), str(r.get("flash_attn"))))
    rows.setdefault(key, {})["oasis" if r["oasis_budget"] > 0 else "stock"] = r
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
result = {
    "what": "llama-bench decode tokens/s after a depth, stock KV cache vs OasisKV, same build",
    "llama_cpp": {"build_number": runs[0]["build_number"], "build_commit": runs[0]["build_commit"]},
    "model": runs[0]["model_filename"].split("/")[-1],
    "oasis": {"budget": budget, "capacity": capacity, "summary": summary},
    "machine": {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release()},
    "rows": [],
}
print(f"{'threads':>7} {'depth':>6} {'fa':>4} {'stock t/s':>10} {'OasisKV t/s':>12} {'speedup':>8} {'stock KV MiB':>13} {'OasisKV MiB':>12}")
for (t, d, fa), pair in sorted(rows.items()):
    s, o = pair.get("stock"), pair.get("oasis")
    row = {"threads": t, "depth": d, "flash_attn": fa, "n_gen": (s or o)["n_gen"],
           "rope_scale": (s or o)["rope_scale"]}
    for name, r in (("stock", s), ("oasis", o)):
        if r:
            row[name] = {"tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"], "kv_bytes": r["kv_bytes"],
                         "samples_ns": r.get("samples_ns")}
    if s and o:
        row["speedup"] = o["avg_ts"] / s["avg_ts"]
    result["rows"].append(row)
    print(f"{t:>7} {d:>6} {fa:>4} {s['avg_ts'] if s else 0:>10.2f} {o['avg_ts'] if o else 0:>12.2f} "
          f"{row.get('speedup', 0):>7.2f}x {(s['kv_bytes'] if s else 0) / 2**20:>13.1f} "
          f"{(o['kv_bytes'] if o else 0) / 2**20:>12.1f}")
# Each side at its fastest flash-attention setting, where several were measured.
best = {}
for (t, d, fa), pair in rows.items():
    for name, r in pair.items():
        b = best.setdefault((t, d), {})
        if name not in b or r["avg_ts"] > b[name]["tokens_per_s"]:
            b[name] = {"tokens_per_s": r["avg_ts"], "flash_attn": fa}
result["fastest"] = []
for (t, d), b in sorted(best.items()):
    if len({fa for (tt, dd, fa) in rows if (tt, dd) == (t, d)}) > 1 and "stock" in b and "oasis" in b:
        f = {"threads": t, "depth": d, "stock": b["stock"], "oasis": b["oasis"],
             "speedup": b["oasis"]["tokens_per_s"] / b["stock"]["tokens_per_s"]}
        result["fastest"].append(f)
        print(f"{t:>7} {d:>6} fastest of each: stock {b['stock']['tokens_per_s']:.2f} (fa {b['stock']['flash_attn']}), "
              f"OasisKV {b['oasis']['tokens_per_s']:.2f} (fa {b['oasis']['flash_attn']}): {f['speedup']:.2f}x")
json.dump(result, open(out, "w"), indent=2)
print(f"== wrote {out}")
EOF
