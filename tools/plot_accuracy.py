#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of tools/accuracy's JSON: one PNG per metric, budget on the x axis, one line per
predictor (16-token blocks, one selection shared by the KV heads, the aggregation given by
--agg). Needs Debian's python3-matplotlib.

    python3 tools/plot_accuracy.py RESULTS.json --out-dir docs/accuracy [--agg mass] [--block 16]
    python3 tools/plot_accuracy.py RESULTS.json --markdown      # the tables of docs/accuracy.md
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # no display on build machines
import matplotlib.pyplot as plt  # noqa: E402

METRICS = {
    "agree_all": "top-k agreement, all blocks",
    "agree_free": "top-k agreement, blocks not always kept",
    "recall": "attention-mass recall",
    "rel_recall": "recall relative to the oracle's",
    "l2": "relative L2 error of the attention output",
}
# (label, predictor, scoring, style): summary scoring (min/max f16), qminmax (the same bounds in
# int8: quantized_minmax_summary) and int8 / int4 scoring (key copies: int8_key_summary,
# int4_key_summary) are what deploys; exact keys bound them.
LINES = [
    ("lookahead 4 (summary)", "la4", "summary", "-"),
    ("lookahead 2 (summary)", "la2", "summary", "-"),
    ("lookahead 1 (summary)", "la1", "summary", "-"),
    ("previous query (summary)", "prev", "summary", "-"),
    ("lookahead 4 (int8 min/max)", "la4", "qminmax", "-"),
    ("previous query (int8 min/max)", "prev", "qminmax", "-"),
    ("current query / Quest (summary)", "cur", "summary", "-"),
    ("lookahead 4 (int8 keys)", "la4", "int8", "-."),
    ("lookahead 1 (int8 keys)", "la1", "int8", "-."),
    ("previous query (int8 keys)", "prev", "int8", "-."),
    ("current query / Quest (int8 keys)", "cur", "int8", "-."),
    ("lookahead 4 (int4 keys)", "la4", "int4", "-."),
    ("lookahead 4 (exact keys)", "la4", "exact", "--"),
    ("previous query (exact keys)", "prev", "exact", "--"),
    ("recency", "recency", "-", ":"),
    ("random", "random", "-", ":"),
]


def measured(row):
    """A row that holds figures: a configuration evaluated on no sample (e.g. in an end-to-end
    run with evaluation off) is missing, not zero."""
    return row is not None and row.get("samples", 1) > 0


def fmt_row(cells):
    return "| " + " | ".join(cells) + " |"


def markdown(doc, agg, block, gran):
    """The tables of docs/accuracy.md, printed from one or more results files."""
    res = doc["results"]
    budgets = sorted({int(k.split("/")[5]) for k in res if len(k.split("/")) == 6})

    def get(pred, scoring, ag, g, b, budget, metric):
        row = res.get(f"{pred}/{scoring}/{ag}/{g}/b{b}/{budget}")
        return "-" if not measured(row) or metric not in row else f"{row[metric]:.3f}"

    for metric in ["agree_free", "agree_all", "agree_next", "rel_recall", "recall", "l2"]:
        print(f"\n{metric} ({block}-token blocks, {gran}, aggregation {agg}):\n")
        print(fmt_row(["predictor", "scoring"] + [str(b) for b in budgets]))
        print(fmt_row(["---"] * (2 + len(budgets))))
        for label, pred, scoring, _ in LINES:
            ag = "-" if scoring == "-" else agg
            print(fmt_row([label.split(" (")[0], scoring]
                          + [get(pred, scoring, ag, gran, block, b, metric) for b in budgets]))
    for budget in budgets:
        print(f"\nlookahead 4, budget {budget}: aggregation x granularity x block size "
              "(agree_free / rel_recall / l2):\n")
        print(fmt_row(["scoring", "aggregation", "granularity", "16-token blocks",
                       "32-token blocks"]))
        print(fmt_row(["---"] * 5))
        for scoring in ["summary", "qminmax", "int8", "int4", "exact"]:
            for ag in ["max", "mass", "conf"]:
                for g in ["shared", "per_head"]:
                    cells = []
                    for b in [16, 32]:
                        cells.append(" / ".join(get("la4", scoring, ag, g, b, budget, m)
                                                for m in ["agree_free", "rel_recall", "l2"]))
                    print(fmt_row([scoring, ag, g] + cells))
    e2e = {k: v for k, v in res.items() if k.startswith("e2e/")}
    if e2e:
        print("\nend to end:\n")
        print(fmt_row(["run", "agreement (greedy, teacher-forced)", "agreement (held-out)",
                       "perplexity", "ppl / dense"]))
        print(fmt_row(["---"] * 5))
        for k, v in sorted(e2e.items()):
            cells = [f"{v[m]:.4f}" if m in v else "-"
                     for m in ["agreement", "agreement_held_out", "ppl", "ppl_ratio"]]
            print(fmt_row([k[4:]] + cells))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+",
                    help="results files (merged; later ones win, except unmeasured rows)")
    ap.add_argument("--out-dir")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--agg", default="mass")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gran", default="shared")
    a = ap.parse_args()
    doc = None
    for path in a.json:
        d = json.load(open(path))
        if doc is None:
            doc = d
        else:
            doc["results"].update({k: v for k, v in d["results"].items() if measured(v)})
    res = doc["results"]
    if a.markdown:
        markdown(doc, a.agg, a.block, a.gran)
        return
    os.makedirs(a.out_dir, exist_ok=True)
    for metric, title in METRICS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more lines than the default 10 colours
        for label, pred, scoring, style in LINES:
            agg = "-" if scoring == "-" else a.agg
            pts = []
            for key, row in res.items():
                parts = key.split("/")
                if len(parts) != 6 or parts[0] != pred or parts[1] != scoring:
                    continue
                if parts[2] != agg or parts[3] != a.gran or parts[4] != f"b{a.block}":
                    continue
                if not measured(row):
                    continue
                pts.append((int(parts[5]), row[metric]))
            if pts:
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens)")
        ax.set_ylabel(metric)
        ax.set_title(f"{title}\n{doc['model']}, context {doc['context']}, "
                     f"{a.block}-token blocks, {a.gran}, {a.agg}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out_dir, f"{metric}.png"), dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
