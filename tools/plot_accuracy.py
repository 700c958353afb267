#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of tools/accuracy's JSON: one PNG per metric, budget on the x axis, one line per
predictor (16-token blocks, one selection shared by the KV heads, the aggregation given by
--agg). Needs Debian's python3-matplotlib.

    python3 tools/plot_accuracy.py RESULTS.json --out-dir docs/accuracy [--agg mass] [--block 16]
    python3 tools/plot_accuracy.py RESULTS.json --markdown      # every figure, as tables
    python3 tools/plot_accuracy.py NEEDLE.json... [--out-dir D]  # --task needle (merged) / agree
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
    """Every figure of one or more results files as tables (docs/accuracy.md, command P)."""
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


def plot_needle(doc, out_dir):
    """--task needle: success rate by depth, one line per configuration, one PNG per context
    (needle-<context>.png); prints the per-context table."""
    by = {}  # context -> config -> depth -> [successes]
    for case in doc["cases"]:
        for cfg, ans in case["answers"].items():
            d = by.setdefault(case["context"], {}).setdefault(cfg, {})
            d.setdefault(case["depth"], []).append(1.0 if ans["success"] else 0.0)
    print(fmt_row(["context", "configuration", "success", "lost (dense ok)", "answers = dense"]))
    print(fmt_row(["---"] * 5))
    for key, row in sorted(doc["results"].items()):
        _, ctx, cfg = key.split("/", 2)
        print(fmt_row([ctx, cfg, f"{row['success']:.3f}", f"{row.get('lost', 0):.0f}",
                       f"{row.get('match_dense', 1):.3f}"]))
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    for ctx, cfgs in sorted(by.items()):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, (cfg, depths) in enumerate(sorted(cfgs.items())):
            xs = sorted(depths)
            ys = [sum(depths[x]) / len(depths[x]) for x in xs]
            ax.plot(xs, ys, "-" if cfg == "dense" else "--", marker="o", label=cfg,
                    alpha=0.8, markersize=7 - i)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("success rate")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"needle retrieval, {doc['model']}, context {ctx}, "
                     f"{doc['haystack']} haystack", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"needle-{ctx}.png"), dpi=110)
        plt.close(fig)


def merge_needle(doc, paths):
    """Adds the configurations of further --task needle files to `doc`: their result rows, and
    each case's answers joined to the case of the same context, depth and key (a run's dense
    answers are the same in every file of one build; later files win)."""
    cases = {(c["context"], c["depth"], c["key"]): c for c in doc["cases"]}
    for path in paths:
        d = json.load(open(path))
        if d.get("task") != "needle":
            raise SystemExit(f"{path}: not a --task needle file; needle files merge only "
                             "with each other")
        doc["results"].update(d["results"])
        for c in d["cases"]:
            k = (c["context"], c["depth"], c["key"])
            if k in cases:
                cases[k]["answers"].update(c["answers"])
            else:
                cases[k] = c
                doc["cases"].append(c)
    return doc


def plot_agree(doc, out_dir):
    """--task agree: tokens before the first divergence from dense and the share of identical
    continuations per configuration (noise baselines first); agree.png and the table."""
    rows = sorted(doc["results"].items(), key=lambda kv: (not kv[0].startswith("agree/noise"),
                                                          kv[0]))
    print(fmt_row(["configuration", "mean tokens before divergence", "identical", "min"]))
    print(fmt_row(["---"] * 4))
    for key, row in rows:
        print(fmt_row([key[len("agree/"):], f"{row['mean_prefix']:.2f} / {doc['decode']}",
                       f"{row['identical']:.3f}", f"{row['min_prefix']:.0f}"]))
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = [k[len("agree/"):] for k, _ in rows]
    ax.barh(names, [r["mean_prefix"] for _, r in rows],
            color=["grey" if n.startswith("noise") else "tab:blue" for n in names])
    ax.set_xlim(0, doc["decode"])
    ax.set_xlabel(f"mean tokens before the first divergence from dense (of {doc['decode']})")
    ax.set_title(f"free-running agreement, {doc['model']}, context {doc['context']}, "
                 f"{doc['prompts']} prompts", fontsize=9)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "agree.png"), dpi=110)
    plt.close(fig)


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
    first = json.load(open(a.json[0]))
    if first.get("task") == "needle":  # accuracy --task needle: files merged case by case
        plot_needle(merge_needle(first, a.json[1:]), a.out_dir)
        return
    if first.get("task") == "agree":  # accuracy --task agree: one file
        plot_agree(first, a.out_dir)
        return
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
