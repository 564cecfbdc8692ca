"""Tables (markdown, aligned so they also read well in a terminal), JSON, CSV and the PNG plot."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["kernel_table", "e2e_table", "notes", "markdown_report", "write_outputs", "plot"]

CSV_FIELDS = [
    "level", "case", "model", "layer", "num_experts", "tokens_per_expert", "routing", "M", "N", "K",
    "group_sizes_min", "group_sizes_max", "empty_groups", "op", "impl", "status", "ms", "tflops",
    "rel_err", "err_y", "err_dx", "err_dw", "peak_mb", "extra_mb", "reason",
]


def _align(rows: List[List[str]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("| " + " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def _impl_order(records: Sequence[dict]) -> List[str]:
    order: "OrderedDict[str, None]" = OrderedDict()
    for r in records:
        order.setdefault(r["impl"], None)
    return list(order)


def _cell(r: Optional[dict], with_memory: bool = False) -> str:
    if r is None:
        return ""
    status = r["status"]
    if status in ("ok", "wrong"):
        text = _fmt_tflops(r["tflops"])
        if with_memory and r.get("peak_mb") is not None:
            text += f" / {r['peak_mb']:.0f} MB"
        if status == "wrong":
            text += " WRONG"
        return text
    return {"missing": "n/a", "error": "error", "skipped": "skip"}.get(status, status)


def _fmt_tflops(tflops: float) -> str:
    # Whole TFLOPS on a GPU; the CPU smoke mode's tiny numbers keep three significant digits.
    return f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.3g}"


def _ratio(turbo: Optional[dict], peer: Optional[dict]) -> Optional[float]:
    if not turbo or not peer or turbo["status"] != "ok" or peer["status"] != "ok":
        return None
    return peer["ms"] / turbo["ms"]


def _fmt_ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def _geomean(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _primary_turbo(impls: Sequence[str]) -> Optional[str]:
    return next((i for i in impls if i.startswith("turbo:")), None)


def _grouped(records: Sequence[dict]) -> "OrderedDict[Tuple[str, str], Dict[str, dict]]":
    rows: "OrderedDict[Tuple[str, str], Dict[str, dict]]" = OrderedDict()
    for r in records:
        rows.setdefault((r["case"], r["op"]), {})[r["impl"]] = r
    return rows


def kernel_table(records: Sequence[dict]) -> List[str]:
    """TFLOPS per implementation, one row per (case, op); ratios = peer time / turbo time."""
    records = [r for r in records if r["level"] == "kernel"]
    if not records:
        return []
    impls = _impl_order(records)
    turbo = _primary_turbo(impls)
    peers = [i for i in impls if not i.startswith("turbo:")]
    header = ["case", "op"] + [f"{i} TF" for i in impls] + ([f"{turbo} vs {p}" for p in peers] if turbo else [])
    rows = [header]
    ratios: Dict[Tuple[str, str], List[Optional[float]]] = {}
    for (case, op), by_impl in _grouped(records).items():
        row = [case, op] + [_cell(by_impl.get(i)) for i in impls]
        if turbo:
            for p in peers:
                x = _ratio(by_impl.get(turbo), by_impl.get(p))
                ratios.setdefault((op, p), []).append(x)
                row.append(_fmt_ratio(x))
        rows.append(row)
    if turbo and peers:
        for op in sorted({op for op, _ in ratios}, key=lambda o: ("fwd", "dgrad", "wgrad").index(o) if o in ("fwd", "dgrad", "wgrad") else 9):
            rows.append(
                [f"geomean ({op})", op] + [""] * len(impls) + [_fmt_ratio(_geomean(ratios.get((op, p), []))) for p in peers]
            )
    return _align(rows)


def e2e_table(records: Sequence[dict]) -> List[str]:
    """Forward+backward TFLOPS (6·M·N·K / t) and peak memory per implementation."""
    records = [r for r in records if r["level"] == "e2e"]
    if not records:
        return []
    impls = _impl_order(records)
    turbo = _primary_turbo(impls)
    peers = [i for i in impls if not i.startswith("turbo:")]
    header = ["case"] + [f"{i} TF / peak" for i in impls] + ([f"{turbo} vs {p}" for p in peers] if turbo else [])
    rows = [header]
    ratios: Dict[str, List[Optional[float]]] = {}
    for (case, _), by_impl in _grouped(records).items():
        row = [case] + [_cell(by_impl.get(i), with_memory=True) for i in impls]
        if turbo:
            for p in peers:
                x = _ratio(by_impl.get(turbo), by_impl.get(p))
                ratios.setdefault(p, []).append(x)
                row.append(_fmt_ratio(x))
        rows.append(row)
    if turbo and peers:
        rows.append(["geomean"] + [""] * len(impls) + [_fmt_ratio(_geomean(ratios.get(p, []))) for p in peers])
    return _align(rows)


def error_table(records: Sequence[dict]) -> List[str]:
    """Largest relative error against the float32 reference, per implementation and op."""
    worst: "OrderedDict[Tuple[str, str], float]" = OrderedDict()
    for r in records:
        if r["status"] not in ("ok", "wrong"):
            continue
        errs = [r.get(k) for k in ("rel_err", "err_y", "err_dx", "err_dw") if r.get(k) is not None]
        if not errs:
            continue
        key = (r["impl"], r["op"])
        worst[key] = max(worst.get(key, 0.0), max(errs))
    if not worst:
        return []
    rows = [["impl", "op", "max rel err vs fp32 ref"]]
    rows += [[impl, op, f"{err:.2e}"] for (impl, op), err in worst.items()]
    return _align(rows)


def notes(records: Sequence[dict]) -> List[str]:
    """Why an implementation was missing, failed, or gave a wrong answer (each reason once)."""
    seen: "OrderedDict[str, None]" = OrderedDict()
    for r in records:
        if r["status"] in ("missing", "error", "skipped"):
            seen.setdefault(f"- {r['impl']} {r['status']}: {r.get('reason', '')}", None)
        elif r["status"] == "wrong":
            seen.setdefault(f"- {r['impl']} WRONG on {r['case']} {r['op']}: {r.get('reason', '')}", None)
    return list(seen)


def markdown_report(meta: dict, records: Sequence[dict]) -> str:
    lines = ["# turbo_moe benchmark", ""]
    for key in ("device", "torch", "triton", "turbo_moe", "command", "timing", "started", "elapsed_s"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    k = kernel_table(records)
    if k:
        lines += ["", "## Kernel level (FP8 operands prepared outside the timing), TFLOPS = 2·M·N·K / t", ""] + k
    e = e2e_table(records)
    if e:
        lines += ["", "## End to end: forward + backward, quantization included, TFLOPS = 6·M·N·K / t", ""] + e
    err = error_table(records)
    if err:
        lines += ["", "## Accuracy (relative Frobenius error against float32 group-by-group references)", ""] + err
    n = notes(records)
    if n:
        lines += ["", "## Notes", ""] + n
    return "\n".join(lines) + "\n"


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_outputs(out_dir: str, meta: dict, records: Sequence[dict], stem: str = "results") -> Dict[str, str]:
    """``<stem>.json`` (meta + every record), ``<stem>.csv`` and ``<stem>.md``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("json", "csv", "md")}
    tmp = paths["json"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_json_safe({"meta": meta, "records": list(records)}), f, indent=1)
    os.replace(tmp, paths["json"])  # a kill mid-write never leaves a truncated JSON
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow(r)
    with open(paths["md"], "w") as f:
        f.write(markdown_report(meta, records))
    return paths


def plot(path: str, records: Sequence[dict], title: str = "turbo_moe") -> Optional[str]:
    """Grouped bar charts of TFLOPS: one panel per kernel op plus one for end to end.

    Returns None on success, or why no plot was written (matplotlib missing, nothing measured).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable: {type(exc).__name__}: {exc}"
    panels = []
    for level, op in [("kernel", "fwd"), ("kernel", "dgrad"), ("kernel", "wgrad"), ("e2e", "fwd+bwd")]:
        recs = [r for r in records if r["level"] == level and r["op"] == op and r["status"] in ("ok", "wrong")]
        if recs:
            panels.append((level, op, recs))
    if not panels:
        return "no measured results to plot"
    num_cases = max(len({r["case"] for r in recs}) for _, _, recs in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(10.0, 0.55 * num_cases + 3), 3.6 * len(panels)), squeeze=False)
    for ax, (level, op, recs) in zip(axes[:, 0], panels):
        cases = list(OrderedDict((r["case"], None) for r in recs))
        impls = _impl_order(recs)
        width = 0.8 / len(impls)
        by_key = {(r["case"], r["impl"]): r for r in recs}
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, case in enumerate(cases):
                r = by_key.get((case, impl))
                if r is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["tflops"])
            ax.bar(xs, ys, width=width, label=impl)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"{title}: {'kernel ' + op if level == 'kernel' else 'end to end (fwd+bwd)'}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=min(len(impls), 5))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
