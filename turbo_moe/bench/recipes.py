"""The FP8 recipes the benchmark's labels name: a scaling granularity (``tensorwise``, ``rowwise``,
``blockwise``, ``mxfp8``: current scaling) or ``tensorwise-delayed`` (delayed scaling, Megatron's
``fp8_recipe="delayed"``: per-tensor scales from an amax history, ``turbo_moe.delayed_scaling``)."""

from __future__ import annotations

__all__ = ["DELAYED", "DELAYED_HISTORY_LEN", "DELAYED_COMPUTE_ALGO", "RECIPES", "bench_float8_config"]

DELAYED = "tensorwise-delayed"
# The delayed recipe's history (Transformer Engine's DelayedScaling names): 16 casts, reduced by max.
DELAYED_HISTORY_LEN, DELAYED_COMPUTE_ALGO = 16, "max"
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", DELAYED)


def bench_float8_config(fmt: str, recipe: str):
    """The ``Float8Config`` of ``recipe`` (one of :data:`RECIPES`) in format ``fmt`` (e4m3 / hybrid)."""
    from turbo_moe import Float8Config

    if recipe == DELAYED:
        return Float8Config(format=fmt, strategy="delayed", amax_history_len=DELAYED_HISTORY_LEN,
                            amax_compute_algo=DELAYED_COMPUTE_ALGO)
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    return Float8Config(format=fmt, granularity=recipe)
