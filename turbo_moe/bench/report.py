"""Tables (markdown, aligned so they also read well in a terminal), JSON, CSV and the PNG plot."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["kernel_table", "e2e_table", "e2e_hot_path_table", "train_table", "train_rounds_table", "train_targets", "notes",
           "markdown_report", "write_outputs", "plot", "plot_loss_curves"]

CSV_FIELDS = [
    "level", "case", "model", "layer", "num_experts", "tokens_per_expert", "routing", "M", "N", "K",
    "group_sizes_min", "group_sizes_max", "empty_groups", "op", "impl", "status", "ms", "tflops",
    "rel_err", "err_y", "err_dx", "err_dw", "peak_mb", "peak_act_mb", "extra_mb",
    "host_us", "launches", "graph_ms", "mb4_ms", "mb1_ms",  # end-to-end hot path
    "gpu_mb4_ms", "quant_mb4_ms", "gemm_mb4_ms", "quant_share_mb4", "gpu_mb1_ms", "quant_mb1_ms", "quant_share_mb1",
    "config", "round", "experts", "steps", "step_ms", "host_ms", "gpu_ms", "expert_gpu_ms", "expert_share",  # train
    "train_loss", "val_loss", "train_loss_tail", "val_loss_tail", "reason",
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


def _ms(value: Optional[float]) -> str:
    return "" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.2f}")


def _pct(value: Optional[float]) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def _gpu_split(r: dict, label: str) -> str:
    """``GPU ms (quant/gemm/other)`` per micro-batch from the profiled ``gpusplit`` step."""
    total = r.get(f"gpu_{label}_ms")
    if total is None:
        return "n/a" if "gpusplit:" in (r.get("hot_path_notes") or "") else ""
    parts = "/".join(_ms(r.get(f"{k}_{label}_ms")) for k in ("quant", "gemm", "other"))
    return f"{_ms(total)} ({parts})"


def e2e_hot_path_table(records: Sequence[dict]) -> List[str]:
    """Per case and implementation: ms per call, per micro-batch of a 4-micro-batch step (and its
    TFLOPS), per 1-micro-batch step, CUDA-graph replay, host µs to issue a step, GPU launches per
    step, the profiled GPU time per micro-batch split into quantization/GEMM/other kernels and the
    quantization share (4 and 1 micro-batches), peak memory."""
    records = [r for r in records if r["level"] == "e2e" and r["status"] in ("ok", "wrong")]
    if not any(any(r.get(k) is not None for k in ("host_us", "launches", "graph_ms", "mb4_ms", "gpu_mb4_ms"))
               for r in records):
        return []
    peers = {name: {r["case"]: r for r in records if r["impl"] == name} for name in ("bf16", "torchao_fp8")}
    rows = [["case", "impl", "ms", "ms/µb of 4", "TF/µb of 4", "ms/µb of 1", "µb of 4 vs bf16", "µb of 4 vs torchao",
             "graph ms", "eager/graph", "host µs", "launches", "GPU ms/µb of 4 (quant/gemm/other)",
             "quant % µb of 4 / of 1", "peak MB", "peak MB, x and dy activations"]]
    for r in records:
        vs = []
        for name in ("bf16", "torchao_fp8"):
            peer = peers[name].get(r["case"])
            vs.append((peer["mb4_ms"] / r["mb4_ms"]) if peer and peer.get("mb4_ms") and r.get("mb4_ms") else None)
        graph = r.get("graph_ms")
        host = r.get("host_us")
        mb4 = r.get("mb4_ms")
        flops = 6.0 * r["M"] * r["N"] * r["K"] if all(r.get(k) for k in ("M", "N", "K")) else None
        share = ""  # the peers' own quantization kernels (torchao's) are not in QUANT_KERNELS: theirs is "other"
        if r["impl"].startswith("turbo:") and (r.get("quant_share_mb4") is not None or r.get("quant_share_mb1") is not None):
            share = f"{_pct(r.get('quant_share_mb4'))} / {_pct(r.get('quant_share_mb1'))}"
        rows.append([
            r["case"], r["impl"], _ms(r["ms"]), _ms(mb4),
            _fmt_tflops(flops / (mb4 * 1e-3) / 1e12) if flops and mb4 else "", _ms(r.get("mb1_ms")),
            _fmt_ratio(vs[0]), _fmt_ratio(vs[1]),
            _ms(graph) if graph is not None else ("n/a" if "graph:" in (r.get("hot_path_notes") or "") else ""),
            f"{r['ms'] / graph:.2f}" if graph and r.get("ms") else "",
            "" if host is None else f"{host:.0f}" + (" (syncs)" if r.get("host_sync") else ""),
            str(r["launches"]) if r.get("launches") is not None else ("n/a" if "launches:" in (r.get("hot_path_notes") or "") else ""),
            _gpu_split(r, "mb4"), share,
            "" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}",
            "" if r.get("peak_act_mb") is None else f"{r['peak_act_mb']:.0f}",
        ])
    return _align(rows)


def _train_baseline(records: Sequence[dict]) -> Dict[Tuple[str, int], dict]:
    """turbo-bf16's record per (config, round): each variant is compared with the bf16 run of its
    own round (``--train-rounds``), the one nearest it in time."""
    return {(r["config"], r.get("round", 0)): r for r in records if r["impl"] == "turbo-bf16" and r["status"] == "ok"}


def _base_of(base: Dict[Tuple[str, int], dict], r: dict) -> dict:
    return base.get((r["config"], r.get("round", 0)), {})


def _rounds(records: Sequence[dict]) -> int:
    return 1 + max((r.get("round", 0) for r in records), default=0)


def _time_ratio(value, base) -> Optional[float]:
    return value / base if value is not None and base else None


def _loss_ratio(r: dict, b: dict, key: str) -> Optional[float]:
    """r's loss over the same-config bf16 baseline's, minus one, when both ran the same steps."""
    if r.get(key) is None or not b.get(key) or r.get("steps") != b.get("steps"):
        return None
    return r[key] / b[key] - 1


def _loss_delta(r: dict, b: dict, key: str) -> str:
    delta = _loss_ratio(r, b, key)
    return "" if delta is None else f"{100 * delta:+.2f}%"


def train_table(records: Sequence[dict]) -> List[str]:
    """The training-step preset: one row per (config, variant); ratios are time / turbo-bf16's time.
    "GPU / bf16" is the step's GPU busy time against bf16's: the step's own ratio also carries the
    host's idle gaps, which move between runs by more than a kernel change (Megatron's dispatcher
    waits for the token counts every micro-batch)."""
    records = [r for r in records if r["level"] == "train"]
    if not records:
        return []
    base = _train_baseline(records)
    rounds = _rounds(records)
    rows = [["config", "variant", "experts", "steps", "step ms", "step / bf16", "host ms", "GPU ms", "GPU / bf16",
             "GPU idle ms",
             "expert GPU ms", "expert share", "expert / bf16", "launches (experts)", "peak MB", "train loss",
             "held-out loss", "held-out vs bf16", "train vs bf16, last 10%", "held-out vs bf16, last 3"]]
    for r in records:
        if r["status"] != "ok":
            rows.append([r["config"], r["impl"], r.get("experts") or "", "", {"skipped": "skip"}.get(r["status"], r["status"])]
                        + [""] * 15)
            continue
        b = _base_of(base, r)
        val_delta, train_tail_delta, val_tail_delta = (_loss_delta(r, b, key)
                                                       for key in ("val_loss", "train_loss_tail", "val_loss_tail"))
        share = r.get("expert_share")
        rows.append([
            r["config"], r["impl"], r.get("experts") or "", str(r["steps"]), _ms(r.get("step_ms")),
            _fmt_ratio(_time_ratio(r.get("step_ms"), b.get("step_ms"))), _ms(r.get("host_ms")), _ms(r.get("gpu_ms")),
            _fmt_ratio(_time_ratio(r.get("gpu_ms"), b.get("gpu_ms"))),
            _ms(max(r["step_ms"] - r["gpu_ms"], 0.0)) if r.get("step_ms") and r.get("gpu_ms") and r.get("launches") is not None else "",
            _ms(r.get("expert_gpu_ms")), "" if share is None else f"{100 * share:.0f}%",
            _fmt_ratio(_time_ratio(r.get("expert_gpu_ms"), b.get("expert_gpu_ms"))),
            "" if r.get("launches") is None else f"{r['launches']} ({r.get('expert_launches')})",
            "" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}",
            "" if r.get("train_loss") is None else f"{r['train_loss']:.4f}",
            "" if r.get("val_loss") is None else f"{r['val_loss']:.4f}", val_delta, train_tail_delta, val_tail_delta,
        ])
    if rounds > 1:  # a round column after the variant
        for row, value in zip(rows, ["round"] + [str(r.get("round", 0)) for r in records]):
            row.insert(2, value)
    return _align(rows)


def train_rounds_table(records: Sequence[dict]) -> List[str]:
    """With ``--train-rounds`` N > 1: per (config, variant), the median over the rounds of each
    round's ratio to that round's bf16 run, with the smallest and largest. A host-bound step moves
    by more between minutes than a kernel change (the H100 host's bf16 step: 153-180 ms across one
    session's calls); a variant run next to its baseline, round after round, cancels that drift."""
    records = [r for r in records if r["level"] == "train" and r["status"] == "ok"]
    if _rounds(records) < 2:
        return []
    base = _train_baseline(records)
    keys = ("step_ms", "host_ms", "gpu_ms", "expert_gpu_ms")
    ratios: "OrderedDict[Tuple[str, str], Dict[str, List[float]]]" = OrderedDict()
    for r in records:
        per_key = ratios.setdefault((r["config"], r["impl"]), {key: [] for key in keys})
        b = _base_of(base, r)
        for key in keys:
            ratio = _time_ratio(r.get(key), b.get(key))
            if ratio is not None:
                per_key[key].append(ratio)
    rows = [["config", "variant", "rounds", "step / bf16", "host / bf16", "GPU / bf16", "expert / bf16"]]
    for (cfg, impl), per_key in ratios.items():
        cells = []
        for key in keys:
            values = per_key[key]
            cells.append("" if not values else f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})")
        rows.append([cfg, impl, str(max(len(v) for v in per_key.values()))] + cells)
    return _align(rows)


# issue 10's targets for the FP8 variants, as (what, config or None for every config, key, bound)
_STEP_BOUND = {"expert-dominated": 0.85, "moderate": 1.0}
# Below this many steps the loss gap to bf16 is not judged against 1%: 100-240-step runs moved it by
# 3-6 points between seeds, as bf16's own held-out loss moved by 3.8% (H100); at 1000 steps the
# training loss over the last 100 steps stayed within 1% for tensorwise, rowwise and delayed in
# every run (docs/results/h100_loss_1000.md).
MIN_LOSS_STEPS = 1000


def train_targets(records: Sequence[dict]) -> List[str]:
    """PASS/MISS lines for issue 10's training-step targets (FP8 variants against turbo-bf16)."""
    records = [r for r in records if r["level"] == "train" and r["status"] == "ok"]
    base = _train_baseline(records)
    rounds = _rounds(records)
    lines = []
    for (cfg, round_), b in base.items():
        if round_:  # the config's share once, from its first round
            continue
        share = b.get("expert_share")
        if cfg == "expert-dominated" and share is not None:
            lines.append(f"- {'PASS' if share >= 0.5 else 'MISS'} {cfg}: bf16 experts are {100 * share:.0f}% of the "
                         f"step's GPU time (config wants >= 50%)")
    for r in records:
        b = _base_of(base, r)
        if not b or not r["impl"].startswith("fp8-"):
            continue
        where = f" (round {r.get('round', 0)})" if rounds > 1 else ""
        checks = []
        expert = _time_ratio(r.get("expert_gpu_ms"), b.get("expert_gpu_ms"))
        if expert is not None:
            checks.append((expert <= 0.65, f"expert GPU time {expert:.2f}x bf16 (<= 0.65x)"))
        step = _time_ratio(r.get("step_ms"), b.get("step_ms"))
        if step is not None and r["config"] in _STEP_BOUND:
            checks.append((step <= _STEP_BOUND[r["config"]], f"step {step:.2f}x bf16 (<= {_STEP_BOUND[r['config']]:.2f}x)"))
            busy = _time_ratio(r.get("gpu_ms"), b.get("gpu_ms"))
            if busy is not None:  # context for the step line, not a target of its own
                checks.append((None, f"the step's GPU busy time {busy:.2f}x bf16 (the step ratio adds the host's "
                                     "idle gaps)"))
        # The loss targets read averages (train_step.loss_summary): one held-out point is too noisy
        # for a 1% line. Records from before the averages fall back to the last held-out point.
        loss_checks = (("train_loss_tail", "training loss over the last 10% of steps"),
                       ("val_loss_tail", "held-out loss over the last 3 evaluations"))
        if r.get("val_loss_tail") is None:
            loss_checks = (("val_loss", "held-out loss"),)
        judged = r["steps"] >= MIN_LOSS_STEPS
        for key, what in loss_checks:
            delta = _loss_ratio(r, b, key)
            if delta is not None and judged:
                checks.append((abs(delta) <= 0.01, f"{what} {100 * delta:+.2f}% vs bf16 (within 1%)"))
            elif delta is not None:
                checks.append((None, f"{what} {100 * delta:+.2f}% vs bf16, not judged: {r['steps']} steps, the 1% "
                                     f"line wants >= {MIN_LOSS_STEPS} (docs/results/h100_loss_1000.md)"))
        for ok, text in checks:
            lines.append(f"- {'n/a' if ok is None else 'PASS' if ok else 'MISS'} {r['config']} {r['impl']}{where}: {text}")
    return lines


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
    hot_path: "OrderedDict[str, OrderedDict]" = OrderedDict()  # reason -> impls
    for r in records:
        for reason in filter(None, (r.get("hot_path_notes") or "").split("; ")):
            hot_path.setdefault(reason, OrderedDict())[r["impl"]] = None
    for reason, impls in hot_path.items():
        seen.setdefault(f"- hot path n/a for {', '.join(impls)}: {reason}", None)
    for r in records:
        if r["status"] in ("missing", "error", "skipped"):
            seen.setdefault(f"- {r['impl']} {r['status']}: {r.get('reason', '')}", None)
        elif r["status"] == "ok" and r.get("level") == "train" and r.get("reason"):
            seen.setdefault(f"- {r['case']} {r['impl']}: {r['reason']}", None)
        elif r["status"] == "wrong":
            seen.setdefault(f"- {r['impl']} WRONG on {r['case']} {r['op']}: {r.get('reason', '')}", None)
    return list(seen)


def markdown_report(meta: dict, records: Sequence[dict]) -> str:
    lines = ["# turbo_moe benchmark", ""]
    for key in ("device", "torch", "triton", "ptxas", "turbo_moe", "command", "timing", "started", "elapsed_s"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    k = kernel_table(records)
    if k:
        lines += ["", "## Kernel level (FP8 operands prepared outside the timing), TFLOPS = 2·M·N·K / t", ""] + k
    e = e2e_table(records)
    if e:
        lines += ["", "## End to end: forward + backward, quantization included, TFLOPS = 6·M·N·K / t", ""] + e
    h = e2e_hot_path_table(records)
    if h:
        lines += ["", "## End to end: hot path (ms per fwd+bwd; µb = micro-batch, the weight changing once per "
                  "optimizer step; host µs to issue one fwd+bwd; GPU launches per fwd+bwd; GPU ms per µb from one "
                  "profiled optimizer step, split into quantization/GEMM/other kernels)", ""] + h
    if (meta.get("args") or {}).get("preset") == "issue10":
        from .issue10 import e2e_targets

        targets = e2e_targets(records)
        if targets:
            lines += ["", "### Issue 10 targets (end to end)", ""] + targets
    t = train_table(records)
    if t:
        for key in ("corpus", "configs"):
            if key in meta:
                value = meta[key]
                lines.append(f"- {key}: " + ("; ".join(f"{k}: {v}" for k, v in value.items()) if isinstance(value, dict) else value))
        lines += ["", "## Training step (Megatron-core MoE GPT; ratios are time / turbo-bf16's time)", ""] + t
        rounds = train_rounds_table(records)
        if rounds:
            lines += ["", "### Over the rounds (median of each round's ratio to its own bf16 run; range)", ""] + rounds
        targets = train_targets(records)
        if targets:
            lines += ["", "### Issue 10 targets", ""] + targets
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


def plot_loss_curves(path: str, records: Sequence[dict], title: str = "turbo_moe") -> Optional[str]:
    """Training loss (10-step moving average) and held-out loss per variant, one panel per config.

    Returns None on success, or why no plot was written.
    """
    # the first round's curves (later rounds train the same steps from the same state)
    recs = [r for r in records if r["level"] == "train" and r["status"] == "ok" and r.get("loss_curve")
            and not r.get("round", 0)]
    if not recs:
        return "no loss curve to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable: {type(exc).__name__}: {exc}"
    configs = list(OrderedDict((r["config"], None) for r in recs))
    fig, axes = plt.subplots(1, len(configs), figsize=(7.0 * len(configs), 4.5), squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        for j, r in enumerate(x for x in recs if x["config"] == cfg):
            curve = r["loss_curve"]
            window = min(10, len(curve))
            smooth = [sum(curve[max(0, i - window + 1):i + 1]) / len(curve[max(0, i - window + 1):i + 1])
                      for i in range(len(curve))]
            color = f"C{j}"
            ax.plot(range(1, len(curve) + 1), smooth, color=color, lw=1.2, label=f"{r['impl']} (train)")
            if r.get("val_curve"):
                xs, ys = zip(*r["val_curve"])
                ax.plot(xs, ys, "o--", color=color, ms=4, lw=0.8, label=f"{r['impl']} held-out {ys[-1]:.3f}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats per byte)")
        ax.set_title(f"{title}: {cfg}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
