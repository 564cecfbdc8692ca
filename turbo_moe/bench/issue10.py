"""``python -m turbo_moe.bench --preset issue10``: the measurements issue 10's closing note needs, in
one run of about six minutes on an H100 (docs/benchmarks.md, "--preset issue10").

Part 1, end to end (``--out``/results.*): one grouped linear, fwd+bwd, at the bench shapes (3
models x fc1/fc2 x 8x4096, 32x512, 128x128, balanced routing; issue 10's named shapes first, so a
run cut short by its budget has them), turbo_moe tensorwise and rowwise with and without the
weight cache beside bf16 ``torch._grouped_mm`` and torchao (when installed), every hot-path
measurement (host µs, launches, CUDA graph, 4 and 1 micro-batches, the profiler's quantization
share), shorter do_bench windows than the sweep's. Part 2, the training step (``--out``/train/):
``--preset train``'s two configs and four variants with fewer steps. This module holds the
preset's definitions and the PASS/MISS lines of issue 10's end-to-end targets; cli.py runs it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ISSUE10_SHAPES", "ISSUE10_GRANULARITIES", "ISSUE10_PEERS", "ISSUE10_TRAIN_DEFAULTS",
           "ISSUE10_BUDGET_S", "E2E_BUDGET_SHARE", "issue10_entries", "e2e_targets"]

# (model, layer, experts): issue 10's named shapes first, then the rest of the bench's shapes.
_NAMED = (("deepseek-v3", "fc1", 32), ("qwen3-235b", "fc2", 32), ("deepseek-v3", "fc1", 128),
          ("deepseek-v3", "fc1", 8))
_ALL = tuple((m, layer, e) for e in (8, 32, 128) for m in ("deepseek-v3", "qwen3-235b", "gpt-oss")
             for layer in ("fc1", "fc2"))
ISSUE10_SHAPES = _NAMED + tuple(s for s in _ALL if s not in _NAMED)
# Delayed scaling with the weight cache: the recipe a Megatron run gets from fp8_recipe="delayed".
ISSUE10_GRANULARITIES = ["tensorwise", "tensorwise+wcache", "rowwise", "rowwise+wcache", "tensorwise-delayed+wcache"]
ISSUE10_PEERS = ["bf16", "torchao_fp8"]
# do_bench windows (GPU): the sweep's 25/100 ms would not fit 18 cases x 6 implementations.
ISSUE10_WARMUP_MS, ISSUE10_REP_MS = 10.0, 40.0
# (GPU, CPU) step counts of the training part (train_step.TRAIN_DEFAULTS shortened).
ISSUE10_TRAIN_DEFAULTS = dict(train_steps=(60, 3), timed_steps=(10, 1), warmup_steps=(3, 1), eval_interval=(20, 3),
                              eval_batches=(4, 1), corpus_bytes=(4 << 20, 256 << 10))
ISSUE10_BUDGET_S = 360.0  # default --time-budget of the whole preset on a GPU
E2E_BUDGET_SHARE = 0.6  # the end-to-end part starts no new case after this share of the budget


def issue10_entries(on_gpu: bool) -> List[Tuple[str, str, Tuple[int, int], str]]:
    """``(model, layer, (experts, tokens per expert), routing)`` of the end-to-end part."""
    if not on_gpu:  # the CPU smoke mode: the tiny model at the CPU expert counts
        return [("tiny", layer, ex, "balanced") for ex in ((4, 48), (16, 16)) for layer in ("fc1", "fc2")]
    from .shapes import GPU_EXPERTS

    tokens = dict(GPU_EXPERTS)
    return [(m, layer, (e, tokens[e]), "balanced") for m, layer, e in ISSUE10_SHAPES]


# ------------------------------------------------------------------------------ issue 10's targets


def _granularity(impl: str) -> str:
    return impl.rsplit(":", 1)[-1]


def _shape(r: dict) -> str:
    return f"{r['model']} {r['layer']} {r['num_experts']}x{r['tokens_per_expert']}"


Check = Tuple[str, Callable[[dict], bool], Callable[[dict], Optional[float]], float, bool]


def e2e_targets(records: Sequence[dict]) -> List[str]:
    """PASS/MISS lines for issue 10's end-to-end targets, one per (target, turbo implementation):
    how many shapes pass, and the worst one. Targets measured per micro-batch of a 4-micro-batch
    step use the ``+wcache`` layers (the weight quantized once per optimizer step, as the issue
    states them); host time, launches and memory use the layers without the cache."""
    recs = [r for r in records if r.get("level") == "e2e" and r.get("status") == "ok"]
    peer = {name: {r["case"]: r for r in recs if r["impl"] == name} for name in ISSUE10_PEERS}

    def vs(name: str) -> Callable[[dict], Optional[float]]:
        def ratio(r):
            p = peer[name].get(r["case"])
            return p["mb4_ms"] / r["mb4_ms"] if p and p.get("mb4_ms") and r.get("mb4_ms") else None
        return ratio

    def peak_vs_bf16(key: str) -> Callable[[dict], Optional[float]]:
        def ratio(r):
            p = peer["bf16"].get(r["case"])
            return r[key] / p[key] if p and p.get(key) and r.get(key) else None
        return ratio

    cached = lambda r: "+wcache" in r["impl"]  # noqa: E731
    uncached = lambda r: "+wcache" not in r["impl"]  # noqa: E731
    named = {"deepseek-v3 fc1 32x512": 1.5, "deepseek-v3 fc1 128x128": 1.2, "deepseek-v3 fc1 8x4096": 1.7}
    # (what, which records, value, bound, value must be >= bound)
    checks: List[Check] = [
        (f"µb of 4 >= {b}x bf16 at {s}", lambda r, s=s: cached(r) and _shape(r) == s, vs("bf16"), b, True)
        for s, b in named.items()
    ] + [
        ("µb of 4 >= 1.0x bf16, every shape", cached, vs("bf16"), 1.0, True),
        ("µb of 4 >= 1.5x torchao, every shape", cached, vs("torchao_fp8"), 1.5, True),
        ("quantization <= 15% of the GPU time per µb of 4 at deepseek-v3 fc1 / qwen3-235b fc2 32x512",
         lambda r: cached(r) and _shape(r) in ("deepseek-v3 fc1 32x512", "qwen3-235b fc2 32x512"),
         lambda r: r.get("quant_share_mb4"), 0.15, False),
        ("eager <= 1.1x CUDA graph at >= 16k tokens", lambda r: r["M"] >= 16384,
         lambda r: r["ms"] / r["graph_ms"] if r.get("graph_ms") and r.get("ms") else None, 1.1, False),
        ("host <= 300 µs per fwd+bwd", uncached, lambda r: r.get("host_us"), 300.0, False),
        ("<= 10 launches per fwd+bwd (tensorwise)", lambda r: uncached(r) and _granularity(r["impl"]) == "tensorwise",
         lambda r: r.get("launches"), 10, False),
        # x an activation (as in a model: end_to_end's docstring), then x held by the caller.
        ("peak memory <= bf16's (no weight cache)", uncached, peak_vs_bf16("peak_act_mb"), 1.0, False),
        ("peak memory <= bf16's (no weight cache), x held by the caller", uncached, peak_vs_bf16("peak_mb"), 1.0,
         False),
    ]
    impls = list(dict.fromkeys(r["impl"] for r in recs if r["impl"].startswith("turbo:")))
    lines = []
    for what, select, value, bound, at_least in checks:
        for impl in impls:
            vals = [(r, value(r)) for r in recs if r["impl"] == impl and select(r)]
            vals = [(r, v) for r, v in vals if v is not None]
            if not vals:
                continue
            passed = [v >= bound if at_least else v <= bound for _, v in vals]
            worst_r, worst = (min if at_least else max)(vals, key=lambda rv: rv[1])
            lines.append(f"- {'PASS' if all(passed) else 'MISS'} {impl}: {what}: {sum(passed)}/{len(vals)} shapes; "
                         f"worst {worst:.3g} at {_shape(worst_r)}")
    return lines
