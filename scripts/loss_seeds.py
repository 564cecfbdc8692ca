"""Loss over seeds: each FP8 recipe's gap to bf16, per seed and averaged.

One 1000-step run moves by more than 1% between seeds (bf16's own training loss over its last 100
steps spans 1.243-1.284 over seeds 0-4, docs/results/h100_loss_1000.md), so "within 1% of bf16"
is a statement about the mean gap over seeds, with its standard error beside it. Each run is one
``python -m turbo_moe.bench --preset train --train-configs moderate --variants V --seed S
--train-steps 1000 --eval-interval 100 --no-profile --out DIR``; this script reads their
``DIR/results.json`` files.

    python scripts/loss_seeds.py res/*/results.json [--summary docs/results/h100_loss_seeds.csv]
        [--write-summary CSV] [--plot PNG]

Per run it takes the bench's own loss fields (``train_step.loss_summary``): the training loss over
the last 10% of the steps, the held-out loss at the last evaluation, and the mean of the last three
evaluations. ``--summary`` adds rows of earlier runs whose JSON is not at hand (a run's row in the
JSON wins). The gap of a variant's run is taken against the bf16 run of the same seed and format
(bf16 ignores the FP8 format, so any bf16 run of that seed serves).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics

METRICS = ("train_last10pct", "held_out_last", "held_out_last3")
BF16 = "turbo-bf16"


def _runs_from_json(paths):
    from turbo_moe.bench.train_step import loss_summary

    rows, curves = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        args = data["meta"]["args"]
        fmt, seed = args.get("train_format") or args["format"], int(args["seed"])
        for rec in data["records"]:
            if rec.get("level") != "train" or rec.get("status") != "ok" or not rec.get("loss_curve"):
                continue
            s = loss_summary(rec["loss_curve"], rec["val_curve"])
            key = (rec["impl"], fmt, seed)
            rows[key] = dict(zip(METRICS, (s["train_loss_tail"], s["val_loss"], s["val_loss_tail"])),
                             source=f"{data['meta'].get('started', '')[:10]} {os.path.basename(os.path.dirname(path))}")
            curves[key] = rec["loss_curve"]
    return rows, curves


def _runs_from_csv(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows[(r["variant"], r["format"], int(r["seed"]))] = dict(
                {m: float(r[m]) for m in METRICS}, source=r["source"])
    return rows


def _bf16(rows, seed):
    for (variant, _, s), row in rows.items():
        if variant == BF16 and s == seed:
            return row
    return None


def gaps(rows):
    """{(variant, format): {metric: [(seed, gap %), ...]}} against the same seed's bf16 run."""
    out = {}
    for (variant, fmt, seed), row in sorted(rows.items()):
        base = _bf16(rows, seed)
        if variant == BF16 or base is None:
            continue
        per = out.setdefault((variant, fmt), {m: [] for m in METRICS})
        for m in METRICS:
            per[m].append((seed, 100.0 * (row[m] / base[m] - 1.0)))
    return out


def report(rows) -> str:
    lines = ["| variant | format | metric | seeds | gap to bf16 per seed | mean | standard error |",
             "|---|---|---|---|---|---|---|"]
    for (variant, fmt), per in gaps(rows).items():
        for m in METRICS:
            vals = [g for _, g in per[m]]
            se = statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else float("nan")
            lines.append(f"| {variant} | {fmt} | {m} | {','.join(str(s) for s, _ in per[m])} | "
                         + " ".join(f"{g:+.2f}%" for g in vals) + f" | **{statistics.mean(vals):+.2f}%** | {se:.2f} |")
    return "\n".join(lines)


def plot(path, curves, window=100):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(c):
        return [sum(c[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(c))]

    variants = sorted({(v, f) for v, f, _ in curves if v != BF16})
    fig, axes = plt.subplots(1, max(1, len(variants)), figsize=(5 * max(1, len(variants)), 3.6), squeeze=False)
    for ax, (variant, fmt) in zip(axes[0], variants):
        for (v, f, seed), c in sorted(curves.items()):
            base = next((b for (bv, _, bs), b in curves.items() if bv == BF16 and bs == seed), None)
            if (v, f) != (variant, fmt) or base is None:
                continue
            ratio = [100.0 * (a / b - 1.0) for a, b in zip(smooth(c), smooth(base))]
            ax.plot(range(1, len(ratio) + 1), ratio, label=f"seed {seed}")
        ax.axhline(0, color="k", lw=0.8)
        for y in (-1, 1):
            ax.axhline(y, color="gray", lw=0.6, ls="--")
        ax.set_ylim(-6, 6)
        ax.set_title(f"{variant} ({fmt}) vs bf16")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss gap, %, {window}-step mean")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", help="the runs' results.json files")
    p.add_argument("--summary", help="a CSV of earlier runs (written by --write-summary)")
    p.add_argument("--write-summary", help="write every run's row, merged, to this CSV")
    p.add_argument("--plot", help="training-loss gap curves of the JSON runs, one panel a variant")
    args = p.parse_args(argv)
    rows = _runs_from_csv(args.summary) if args.summary else {}
    json_rows, curves = _runs_from_json(args.results)
    rows.update(json_rows)
    if not rows:
        p.error("no runs: give results.json files or --summary")
    print(report(rows))
    if args.write_summary:
        with open(args.write_summary, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["variant", "format", "seed", *METRICS, "source"])
            for (variant, fmt, seed), row in sorted(rows.items()):
                w.writerow([variant, fmt, seed, *(f"{row[m]:.4f}" for m in METRICS), row["source"]])
    if args.plot:
        plot(args.plot, curves)


if __name__ == "__main__":
    main()
