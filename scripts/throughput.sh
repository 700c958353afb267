#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Throughput at equal memory, both modes speculative: the same stream of long-prompt requests
# through the mini-decoder's batched engine twice, dense and OasisKV, with the same fast-tier bytes
# (by default room for 4 dense sequences of the requests' length) and the same drafts (prompt
# lookup by default, each sequence's draft length adapted to its acceptance). Reports decode
# tokens/s over all requests, requests held at once, time to first token and inter-token latency
# percentiles for each, the ratio, and decode throughput against the requests decoding together;
# then the stall probe: a stream decoding while a prompt of the same length is admitted in chunks
# (its worst gap against its median). Writes them to a JSON and a plot (PNG beside it).
#
#   scripts/throughput.sh [--requests 16] [--prompt-tokens 8064] [--answer-tokens 128]
#                         [--dense-sequences 4] [--budget 1024] [--summary S] [--threads N]
#                         [--draft ngram|self|none] [--draft-len 15] [--step-tokens 0]
#                         [--stall-step-tokens 256] [--context N] [--rope-scale X]
#                         [--build-dir DIR] [--out FILE]
#
# --step-tokens 0 (the default) prefills each admitted prompt whole before decoding goes on, so
# the requests held decode together: that is what the throughput compares. The stall probe runs
# OasisKV with --stall-step-tokens (chunked prefill; 0 skips the probe). 16k-token contexts:
# --prompt-tokens 16256 --context 16384 --rope-scale 2.
#
# The prompts are windows of this repository's docs and headers (SmolLM2-135M, Q4_1). An 8k
# prompt's prefill takes about a minute on one core, so the default run takes a while: most of
# its wall time is prefill, which the decode figures do not count. Needs the release build of
# mini_decoder (built here when missing; --build-dir: another configured tree instead) and the
# model (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
requests=16
prompt_tokens=8064
answer_tokens=128
dense_sequences=4
budget=1024
summary=int2
threads=$(nproc 2>/dev/null || echo 1)
draft=ngram
draft_len=15
step_tokens=0
stall_step_tokens=256
context=0
rope_scale=1
build_dir=""
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
    --draft) draft=$2; shift 2 ;;
    --draft-len) draft_len=$2; shift 2 ;;
    --step-tokens) step_tokens=$2; shift 2 ;;
    --stall-step-tokens) stall_step_tokens=$2; shift 2 ;;
    --context) context=$2; shift 2 ;;
    --rope-scale) rope_scale=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$requests" "$prompt_tokens" "$answer_tokens" "$dense_sequences" "$budget" "$threads" \
  "$draft_len"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "error: '$v' is not a positive count (see --help)" >&2; exit 2; }
done
for v in "$step_tokens" "$stall_step_tokens" "$context"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "error: '$v' is not a count (see --help)" >&2; exit 2; }
done
[[ "$draft" =~ ^(ngram|self|none)$ ]] ||
  { echo "error: --draft '$draft' is not ngram, self or none (see --help)" >&2; exit 2; }

source scripts/common.sh
# The plot needs Debian's python3-matplotlib: installed here, before the long runs, where the
# script may (as root); elsewhere the figures are still written and the plot is left out.
if ! python3 -c 'import matplotlib' 2>/dev/null && ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  oasiskv_install_packages python3-matplotlib ||
    echo "warning: without python3-matplotlib the JSON is written without its plot" >&2
fi
if [ -n "$build_dir" ]; then
  [ -f "$build_dir/CMakeCache.txt" ] ||
    { echo "error: --build-dir '$build_dir' is not a configured build tree" >&2; exit 2; }
  model=models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -e "$model" ] || { echo "error: $model is missing (run scripts/fetch-models.sh)" >&2; exit 1; }
  cmake --build "$build_dir" --target mini_decoder
  bin=$build_dir/apps/mini_decoder/mini_decoder
else
  oasiskv_release_mini_decoder  # sets model and bin
  # A release build older than these flags is built again.
  "$bin" --help | grep -q -- --stall-probe || cmake --build --preset release --target mini_decoder
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat README.md docs/*.md include/oasiskv/*.hpp include/oasiskv/*/*.hpp >"$work/text"

common=(--model "$model" --prompt-file "$work/text" --throughput-prompt-tokens "$prompt_tokens"
  --budget "$budget" --summary "$summary" --threads "$threads" --attention-threads "$threads"
  --draft "$draft" --draft-len "$draft_len" --context "$context" --rope-scale "$rope_scale")
for mode in dense oasis; do
  echo "== $mode: $requests requests of $prompt_tokens + $answer_tokens tokens, drafts $draft," \
    "$threads thread(s) (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$bin" "${common[@]}" --throughput "$requests" --max-tokens "$answer_tokens" --mode "$mode" \
    --dense-sequences "$dense_sequences" --step-tokens "$step_tokens" >"$work/$mode.json"
done
echo '{}' >"$work/stall.json"
if [ "$stall_step_tokens" -gt 0 ]; then
  echo "== stall probe (oasis): a stream decodes while a $prompt_tokens-token prompt is admitted," \
    "$stall_step_tokens tokens a step"
  "$bin" "${common[@]}" --stall-probe --mode oasis --step-tokens "$stall_step_tokens" \
    >"$work/stall.json"
fi

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
stall = json.load(open(f"{work}/stall.json"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
result = {"machine": cpu, "threads": threads, "dense": dense, "oasis": oasis,
          "decode_throughput_ratio": oasis["decode_tokens_per_second"] / dense["decode_tokens_per_second"],
          "requests_held_ratio": oasis["peak_active"] / dense["peak_active"]}
if stall:
    result["stall"] = stall
json.dump(result, open(out, "w"), indent=2)
print(f"\nfast tier {dense['fast_tier_bytes'] / 2**20:.1f} MiB for both; drafts {dense['draft']}; "
      f"{threads} thread(s); {cpu}")
print(f"{'':>26} {'dense':>10} {'OasisKV':>10}")
rows = [("requests held at once", "peak_active", "{:.0f}"),
        ("fast MiB a request", "sequence_fast_bytes", "{:.1f}"),
        ("decode tokens/s", "decode_tokens_per_second", "{:.1f}"),
        ("tokens a sequence-round", "tokens_per_round", "{:.2f}"),
        ("drafts accepted", "acceptance", "{:.1%}"),
        ("TTFT p50 s", ("first_token_seconds", "p50"), "{:.1f}"),
        ("TTFT p90 s", ("first_token_seconds", "p90"), "{:.1f}"),
        ("inter-token p50 ms", ("token_seconds", "p50"), "{:.1f}"),
        ("inter-token p99 ms", ("token_seconds", "p99"), "{:.1f}")]
def get(d, k):
    if k == "tokens_per_round":
        return d["decode_tokens"] / max(1, d["rounds"])
    if k == "acceptance":
        return d["accepted"] / max(1, d["drafted"])
    v = d[k[0]][k[1]] if isinstance(k, tuple) else d[k]
    if k == "sequence_fast_bytes":
        v /= 2**20
    if isinstance(k, tuple) and k[0] == "token_seconds":
        v *= 1000
    return v
for name, k, f in rows:
    print(f"{name:>26} {f.format(get(dense, k)):>10} {f.format(get(oasis, k)):>10}")
print(f"OasisKV / dense decode tokens/s: {result['decode_throughput_ratio']:.2f}x "
      f"(requests held: {result['requests_held_ratio']:.2f}x)")
if stall:
    print(f"stall probe (OasisKV, {stall['step_tokens']}-token steps): a stream's worst gap while a "
          f"{stall['long_prompt_tokens']}-token prompt is admitted is {stall['worst_over_median']:.2f}x "
          f"its median ({stall['worst_gap_seconds']:.3f} s against {stall['median_gap_seconds']:.3f} s)")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    names = ["dense", "OasisKV"]
    colors = ["#888888", "#2b7bba"]
    # Decode throughput against the requests decoding together, from each run's decode steps.
    ax = axes[0]
    for d, c, name in ((dense, colors[0], "dense"), (oasis, colors[1], "OasisKV")):
        pts = [r for r in d["by_decoding"] if r["seconds"] > 0]
        ax.plot([r["sequences"] for r in pts], [r["tokens_per_second"] for r in pts], "o-",
                color=c, label=f"{name} (held at most {d['peak_active']})")
    ax.set_xlim(0, max(dense["peak_active"], oasis["peak_active"]) + 1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("requests decoding together")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode throughput against requests held")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    axes[1].bar(names, [dense["decode_tokens_per_second"], oasis["decode_tokens_per_second"]],
                color=colors)
    axes[1].set_title("decode tokens/s (whole run)")
    for i, (d, c) in enumerate(((dense, colors[0]), (oasis, colors[1]))):
        p = d["token_seconds"]
        axes[2].bar([i - 0.2, i + 0.2], [p["p50"] * 1000, p["p99"] * 1000], width=0.35, color=c)
    axes[2].set_xticks([0, 1], names)
    axes[2].set_title("inter-token ms (p50, p99)")
    fig.suptitle(f"Equal fast-tier memory ({dense['fast_tier_bytes'] / 2**20:.0f} MiB), both "
                 f"speculative ({dense['draft']} drafts): {dense['requests']} requests of "
                 f"{dense['prompt_tokens']}+{dense['answer_tokens']} tokens, SmolLM2-135M, "
                 f"{threads} thread(s)", fontsize=10)
    fig.tight_layout()
    png = out.rsplit(".", 1)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"written: {out}, {png}")
except ImportError:
    print(f"written: {out} (no plot: python3-matplotlib is not installed)")
EOF
