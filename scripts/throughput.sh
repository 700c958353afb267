#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Throughput at equal memory: the same stream of long-prompt requests through the mini-decoder's
# batched engine twice, dense and OasisKV, with the same fast-tier bytes (by default room for 4
# dense sequences of the requests' length). Reports decode tokens/s over all requests, requests
# held at once, time to first token and per-token latency percentiles for each, and the ratio;
# writes them to a JSON and a plot (PNG beside it).
#
#   scripts/throughput.sh [--requests 16] [--prompt-tokens 8064] [--answer-tokens 128]
#                         [--dense-sequences 4] [--budget 1024] [--summary S] [--threads N]
#                         [--out FILE]
#
# The prompts are windows of this repository's docs and headers (SmolLM2-135M, Q4_1). An 8k
# prompt's prefill takes about a minute on one core, so the default run takes a while: most of
# its wall time is prefill, which the decode figures do not count. Needs the release build of
# mini_decoder (built here when missing) and the model (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
requests=16
prompt_tokens=8064
answer_tokens=128
dense_sequences=4
budget=1024
summary=int2
threads=$(nproc 2>/dev/null || echo 1)
out=build/throughput.json
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --prompt-tokens) prompt_tokens=$2; shift 2 ;;
    --answer-tokens) answer_tokens=$2; shift 2 ;;
    --dense-sequences) dense_sequences=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --summary) summary=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$requests" "$prompt_tokens" "$answer_tokens" "$dense_sequences" "$budget" "$threads"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "error: '$v' is not a positive count (see --help)" >&2; exit 2; }
done

source scripts/common.sh
oasiskv_release_mini_decoder  # sets model and bin
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat README.md docs/*.md include/oasiskv/*.hpp include/oasiskv/*/*.hpp >"$work/text"

for mode in dense oasis; do
  echo "== $mode: $requests requests of $prompt_tokens + $answer_tokens tokens, $threads thread(s)" \
    "(load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$bin" --model "$model" --prompt-file "$work/text" --throughput "$requests" \
    --throughput-prompt-tokens "$prompt_tokens" --max-tokens "$answer_tokens" --mode "$mode" \
    --budget "$budget" --summary "$summary" --dense-sequences "$dense_sequences" --threads "$threads" \
    --attention-threads "$threads" >"$work/$mode.json"
done

mkdir -p "$(dirname "$out")"
# The plot wants matplotlib: Debian's python3-matplotlib is in /usr/bin/python3, which need not
# be the python3 first on PATH.
py=python3
if ! python3 -c 'import matplotlib' 2>/dev/null && /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  py=/usr/bin/python3
fi
"$py" - "$work" "$out" "$threads" <<'EOF'
import json, sys
work, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
dense = json.load(open(f"{work}/dense.json"))
oasis = json.load(open(f"{work}/oasis.json"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
result = {"machine": cpu, "threads": threads, "dense": dense, "oasis": oasis,
          "decode_throughput_ratio": oasis["decode_tokens_per_second"] / dense["decode_tokens_per_second"],
          "requests_held_ratio": oasis["peak_active"] / dense["peak_active"]}
json.dump(result, open(out, "w"), indent=2)
print(f"\nfast tier {dense['fast_tier_bytes'] / 2**20:.1f} MiB for both; {threads} thread(s); {cpu}")
print(f"{'':>24} {'dense':>10} {'OasisKV':>10}")
rows = [("requests held at once", "peak_active", "{:.0f}"),
        ("fast MiB a request", "sequence_fast_bytes", "{:.1f}"),
        ("decode tokens/s", "decode_tokens_per_second", "{:.1f}"),
        ("TTFT p50 s", ("first_token_seconds", "p50"), "{:.1f}"),
        ("TTFT p90 s", ("first_token_seconds", "p90"), "{:.1f}"),
        ("token latency p50 ms", ("token_seconds", "p50"), "{:.1f}"),
        ("token latency p99 ms", ("token_seconds", "p99"), "{:.1f}")]
def get(d, k):
    v = d[k[0]][k[1]] if isinstance(k, tuple) else d[k]
    if k == "sequence_fast_bytes":
        v /= 2**20
    if isinstance(k, tuple) and k[0] == "token_seconds":
        v *= 1000
    return v
for name, k, f in rows:
    print(f"{name:>24} {f.format(get(dense, k)):>10} {f.format(get(oasis, k)):>10}")
print(f"OasisKV / dense decode tokens/s: {result['decode_throughput_ratio']:.2f}x "
      f"(requests held: {result['requests_held_ratio']:.2f}x)")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    names = ["dense", "OasisKV"]
    colors = ["#888888", "#2b7bba"]
    axes[0].bar(names, [dense["decode_tokens_per_second"], oasis["decode_tokens_per_second"]], color=colors)
    axes[0].set_title("decode tokens/s (all requests)")
    axes[1].bar(names, [dense["peak_active"], oasis["peak_active"]], color=colors)
    axes[1].set_title("requests held at once")
    for i, (d, c) in enumerate(((dense, colors[0]), (oasis, colors[1]))):
        p = d["token_seconds"]
        axes[2].bar([i - 0.2, i + 0.2], [p["p50"] * 1000, p["p99"] * 1000], width=0.35, color=c)
    axes[2].set_xticks([0, 1], names)
    axes[2].set_title("token latency ms (p50, p99)")
    fig.suptitle(f"Equal fast-tier memory ({dense['fast_tier_bytes'] / 2**20:.0f} MiB): "
                 f"{dense['requests']} requests of {dense['prompt_tokens']}+{dense['answer_tokens']} tokens, "
                 f"SmolLM2-135M, {threads} thread(s)", fontsize=10)
    fig.tight_layout()
    png = out.rsplit(".", 1)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"written: {out}, {png}")
except ImportError:
    print(f"written: {out} (no plot: python3-matplotlib is not installed)")
EOF
