#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The mini-decoder side by side with llama.cpp on this machine, in one run: SmolLM2-135M Q4_1,
# decode tokens/s at ~1k, ~4k and ~8k tokens of context (the mini-decoder: 64 tokens after a
# prompt of that many tokens, dense and OasisKV with a 1,024-token budget, --ignore-eos;
# llama-bench: 64 tokens generated after a depth of the same number of tokens) and prefill
# tokens/s of the same prompts (llama-bench: pp of the prompt's length), at each thread count. Writes a JSON
# with every figure, the ratios and llama.cpp's version, and prints a table.
#
#   scripts/llama-compare.sh [--threads "1 2"] [--contexts "1k 4k 8k"] [--summary S]
#                            [--flash-attn auto|on|off] [--out FILE]
#
# --summary picks OasisKV's block summary (mini_decoder --summary: int2, the default, minmax, ...).
# --flash-attn is llama-bench's -fa; auto, its own default and what a user gets, turns flash
# attention on for the CPU, which prefills an 8k prompt about a fifth faster than off.
#
# llama.cpp comes from the source that the llama-cpp-python sdist on PyPI carries
# (vendor/llama.cpp), built once into build/llama.cpp/ with AVX-512 and VNNI on and AMX off
# (AMX instructions trap on some virtual machines): about 10 minutes on 2 cores. Needs the
# release build of mini_decoder (built here when missing) and the model (scripts/demo.sh or
# scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
threads="1 2"
contexts="1k 4k 8k"
out=build/llama-compare.json
summary=int2
flash_attn=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --contexts) contexts=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --summary) summary=$2; shift 2 ;;
    --flash-attn) flash_attn=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$flash_attn" in auto | on | off) ;; *) echo "error: --flash-attn takes auto, on or off, not '$flash_attn'" >&2; exit 2 ;; esac
for c in $contexts; do
  case "$c" in 1k | 4k | 8k) ;; *) echo "error: --contexts takes 1k, 4k and 8k, not '$c'" >&2; exit 2 ;; esac
done
for t in $threads; do
  [[ "$t" =~ ^[1-9][0-9]*$ ]] || { echo "error: --threads takes positive counts, not '$t'" >&2; exit 2; }
done

source scripts/common.sh
oasiskv_release_mini_decoder  # sets model and bin

# -- llama.cpp ----------------------------------------------------------------------------------
llama_root=build/llama.cpp
bench=$(ls "$llama_root"/*/vendor/llama.cpp/build/bin/llama-bench 2>/dev/null | head -n 1 || true)
if [ -z "$bench" ]; then
  echo "== building llama-bench from the llama-cpp-python sdist (about 10 minutes on 2 cores)"
  mkdir -p "$llama_root"
  python3 -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$llama_root"
  sdist=$(ls "$llama_root"/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)
  tar -xzf "$sdist" -C "$llama_root"
  src=$(ls -d "$llama_root"/llama_cpp_python-*/vendor/llama.cpp | sort -V | tail -n 1)
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON >/dev/null
  cmake --build "$src/build" -j "$(nproc)" --target llama-bench >/dev/null
  bench="$src/build/bin/llama-bench"
fi
version=$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$(dirname "$bench")")")")")")

# -- prompts: this repository's docs and headers, cut to ~1k / ~4k / ~8k tokens, then a question
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat README.md docs/architecture.md docs/performance.md docs/predictors.md docs/file_tier.md \
  include/oasiskv/kv_cache.hpp include/oasiskv/scheduler/staging_scheduler.hpp >"$work/all"
declare -A bytes=([1k]=3300 [4k]=13000 [8k]=26000)

for t in $threads; do
  for c in $contexts; do
    echo "== mini-decoder, $c context, $t thread(s) (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    head -c "${bytes[$c]}" "$work/all" >"$work/doc"
    printf '\n\nQuestion: list the components of OasisKV that the document above describes.' >>"$work/doc"
    "$bin" --model "$model" --prompt-file "$work/doc" --chat --max-tokens 64 --ignore-eos \
      --mode oasis --budget 1024 --summary "$summary" --compare dense --threads "$t" \
      --attention-threads "$t" \
      --quiet >"$work/md-$c-$t.txt" 2>&1 || { cat "$work/md-$c-$t.txt" >&2; exit 1; }
    grep -E "prompt tokens|prefill tokens/s|decode tokens/s" "$work/md-$c-$t.txt"
    prompt=$(awk '/prompt tokens/ {print $3}' "$work/md-$c-$t.txt")
    echo "== llama.cpp $version, $c context, $t thread(s)"
    # The same context for both: llama.cpp generates after a depth of the prompt's length.
    "$bench" -m "$model" -p 0 -n 64 -d "$prompt" -t "$t" -fa "$flash_attn" -r 2 -o json \
      >"$work/tg-$c-$t.json"
    "$bench" -m "$model" -p "$prompt" -n 0 -t "$t" -fa "$flash_attn" -r 1 -o json >"$work/pp-$c-$t.json"
  done
done

mkdir -p "$(dirname "$out")"
python3 - "$work" "$out" "$version" "$threads" "$contexts" "$summary" "$flash_attn" <<'EOF'
import json, re, subprocess, sys
work, out, version, threads, contexts, summary, flash_attn = sys.argv[1:8]
def md(c, t):
    rows = {}
    for line in open(f"{work}/md-{c}-{t}.txt"):
        m = re.match(r"\s+(prompt tokens|prefill tokens/s|decode tokens/s)\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))  # (oasis, dense)
    return rows
def llama(kind, c, t):
    return json.load(open(f"{work}/{kind}-{c}-{t}.json"))[0]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
result = {"machine": cpu, "llama_cpp": {"source": version, "flash_attn": flash_attn},
          "oasis_summary": summary, "rows": []}
for t in threads.split():
    for c in contexts.split():
        m, tg, pp = md(c, t), llama("tg", c, t), llama("pp", c, t)
        result["llama_cpp"]["build_commit"] = tg.get("build_commit")
        row = {"context": c, "threads": int(t), "prompt_tokens": int(m["prompt tokens"][1]),
               "llama_depth": tg["n_depth"], "llama_decode": tg["avg_ts"],
               "dense_decode": m["decode tokens/s"][1], "oasis_decode": m["decode tokens/s"][0],
               "llama_prefill": pp["avg_ts"], "dense_prefill": m["prefill tokens/s"][1]}
        row["dense_over_llama_decode"] = row["dense_decode"] / row["llama_decode"]
        row["oasis_over_llama_decode"] = row["oasis_decode"] / row["llama_decode"]
        row["prefill_over_llama"] = row["dense_prefill"] / row["llama_prefill"]
        result["rows"].append(row)
json.dump(result, open(out, "w"), indent=2)
print(f"\nllama.cpp {version} ({result['llama_cpp'].get('build_commit')}, -fa {flash_attn}), {cpu}")
print(f"{'context':>7} {'thr':>3} | {'llama tg':>8} {'dense':>7} {'oasis':>7} | {'dense/ll':>8} {'oasis/ll':>8} | {'llama pp':>8} {'md pp':>7} {'pp ratio':>8}")
for r in result["rows"]:
    print(f"{r['context']:>7} {r['threads']:>3} | {r['llama_decode']:8.1f} {r['dense_decode']:7.1f} {r['oasis_decode']:7.1f} | "
          f"{r['dense_over_llama_decode']:8.2f} {r['oasis_over_llama_decode']:8.2f} | {r['llama_prefill']:8.1f} {r['dense_prefill']:7.1f} {r['prefill_over_llama']:8.2f}")
print(f"\nwritten: {out}")
EOF
