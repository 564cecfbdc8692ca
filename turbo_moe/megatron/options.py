"""turbo_moe's own settings for Megatron experts and the mapping of Megatron's FP8 recipe onto them.

No megatron-core import here: this module reads Megatron's config by attribute only.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Optional, Union

from ..config import Float8Config, ScalingGranularity, ScalingStrategy

__all__ = ["TurboMoEOptions", "resolve_fp8_config", "resolve_num_cu", "Fp8Setting", "FP8_RECIPES", "RecipeMapping"]

Fp8Setting = Union[None, str, Float8Config]


@dataclasses.dataclass(frozen=True)
class TurboMoEOptions:
    """turbo_moe's own settings for Megatron experts (Megatron's config carries everything else).

    ``fp8``: ``"megatron"`` (follow ``config.fp8``; off when it is None), ``None`` (high precision),
    ``"e4m3"``, ``"hybrid"`` or a ``Float8Config``. ``granularity``: ``"tensorwise"``,
    ``"rowwise"``, ``"blockwise"`` or ``"mxfp8"`` when ``fp8`` is a format name (``None``: derived from ``config.fp8_recipe`` under
    ``"megatron"``, else tensorwise). ``backend``: ``"auto"``, ``"triton"``, ``"flydsl"``,
    ``"torch"``. ``num_cu``: cap on the SMs/CUs the FP8 kernels occupy (an int), None for all, or
    ``"comm"``: chosen by ``turbo_moe.num_cu_for_comm`` from what the expert-parallel all-to-all
    needs (docs/expert_parallel.md).

    ``cache_fp8_weight``: keep each weight's FP8 copies (rows + transposed: 2 bytes per weight
    element, for as long as the layer lives) and quantize once per optimizer step instead of once
    per micro-batch. ``"auto"`` (the default) caches only where a stale copy cannot go unseen:
    (1) Megatron's schedule drives the layer's ``is_first_microbatch`` flag (Transformer Engine's
    contract: refresh at the first micro-batch of each step; needs ``config.fp8`` set, and none of
    it under ``config.disable_parameter_transpose_cache``), (2)
    ``invalidate_fp8_weight_cache_on_step(optimizer)`` is installed, or (3) in a single-process
    run, the weight is not a Megatron-DDP parameter (no ``main_grad``: its in-place updates bump
    its version counter; across processes FSDP2 or ZeRO-style buffers may refill it unseen);
    otherwise it quantizes in every forward. ``True``: always cache (raises for a DDP parameter
    without ``invalidate_fp8_weight_cache_on_step``); ``False``: never. See docs/megatron.md.
    """

    fp8: Fp8Setting = "megatron"
    granularity: Optional[str] = None
    backend: str = "auto"
    num_cu: Union[None, int, str] = None
    cache_fp8_weight: Union[bool, str] = "auto"

    def __post_init__(self) -> None:
        if not (self.fp8 is None or isinstance(self.fp8, (str, Float8Config))):
            raise TypeError(f"fp8 must be None, 'megatron', 'e4m3', 'hybrid' or a Float8Config, got {self.fp8!r}")
        if isinstance(self.fp8, str) and self.fp8 not in ("megatron", "e4m3", "hybrid"):
            raise ValueError(f"fp8={self.fp8!r} is not one of None, 'megatron', 'e4m3', 'hybrid' (or a Float8Config)")
        if self.granularity is not None:
            allowed = [g.value for g in ScalingGranularity]
            if _enum_value(self.granularity) not in allowed:
                raise ValueError(f"granularity={self.granularity!r} is not one of None, {allowed}")
            if isinstance(self.fp8, Float8Config):
                raise ValueError("granularity must be None when fp8 is a Float8Config (set it in the Float8Config)")
        if self.num_cu is not None and self.num_cu != "comm" and (
                isinstance(self.num_cu, bool) or not isinstance(self.num_cu, int) or self.num_cu < 1):
            raise ValueError(f"num_cu must be None, a positive int or 'comm', got {self.num_cu!r}")
        cache = self.cache_fp8_weight
        if not (isinstance(cache, bool) or (isinstance(cache, str) and cache == "auto")):
            raise ValueError(f"cache_fp8_weight must be True, False or 'auto', got {cache!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a string, got {type(self.backend).__name__}")


def resolve_num_cu(num_cu: Union[None, int, str], ep_size: int) -> Optional[int]:
    """``TurboMoEOptions.num_cu`` -> the cap the kernels get. ``"comm"``: ``num_cu_for_comm`` for
    this expert-parallel size on the current GPU (no GPU: None, the torch backend has no grid)."""
    if num_cu != "comm":
        return num_cu
    import torch

    from ..comm_cap import num_cu_for_comm

    if not torch.cuda.is_available():
        return None
    return num_cu_for_comm(ep_size=ep_size)


# Megatron's config.fp8_recipe -> how turbo_moe's experts run it: the one table where recipes plug
# in. A recipe that is not run as Megatron/TE define it is refused with the reason, never
# substituted silently.
@dataclasses.dataclass(frozen=True)
class RecipeMapping:
    granularity: Optional[ScalingGranularity] = None  # the Float8Config granularity it runs as
    refusal: str = ""  # non-empty: why turbo_moe refuses this recipe
    strategy: ScalingStrategy = ScalingStrategy.CURRENT  # where its scales come from
    # Power-of-two block scales unless TE's own switch says float32 (te_block_scales_pow2).
    te_pow2_scales: bool = False

    def __post_init__(self) -> None:
        if (self.granularity is None) == (not self.refusal):
            raise ValueError("a RecipeMapping has either a granularity or a refusal")


_INSTEAD = ("set config.fp8_recipe='tensorwise' (current per-tensor scaling), or pass fp8='e4m3'/'hybrid' "
            "with granularity='tensorwise'/'rowwise' to the turbo_moe spec helper")

FP8_RECIPES = {
    "tensorwise": RecipeMapping(ScalingGranularity.TENSORWISE),
    # TE's DelayedScaling: activations and gradients scaled from per-layer amax histories
    # (config.fp8_amax_history_len / fp8_amax_compute_algo); turbo_moe.delayed_scaling says where
    # it differs (weights current-scaled, histories per rank, not in the checkpoint).
    "delayed": RecipeMapping(ScalingGranularity.TENSORWISE, strategy=ScalingStrategy.DELAYED),
    # DeepSeek-style 1x128 / 128x128 block scales (TE Float8BlockScaling) and OCP MXFP8
    # (1x32 blocks, e8m0 scales; TE MXFP8BlockScaling): turbo_moe.fine_grained.
    "mxfp8": RecipeMapping(ScalingGranularity.MXFP8),
    # Megatron builds TE's Float8BlockScaling(fp8_format=...) for it, whose block scales are powers of
    # two unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: the same here (te_block_scales_pow2).
    "blockwise": RecipeMapping(ScalingGranularity.BLOCKWISE, te_pow2_scales=True),
    "custom": RecipeMapping(refusal="a custom quantizer factory has no turbo_moe equivalent"),
}

_warned: set = set()


def te_block_scales_pow2() -> bool:
    """Whether TE's ``Float8BlockScaling`` recipe, built now, would round its block scales to powers
    of two: its default, which the environment variable ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` turns
    off (TE reads it when its recipe module is imported; here, at each call)."""
    return os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"


def warn_once(key: str, message: str) -> None:
    """A UserWarning the first time ``key`` is seen in this process (each substitution warns once)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _enum_value(value):
    return getattr(value, "value", value)


def _check_megatron_quantization(config, fp8_on: bool) -> None:
    """Megatron quantization settings that ``fp8="megatron"`` cannot honour: refused, or (where
    turbo_moe computes something close) warned about once."""
    if getattr(config, "fp4", None):
        raise ValueError(f"config.fp4={_enum_value(config.fp4)!r}: turbo_moe's experts have no FP4 kernels; "
                         "unset config.fp4 or pass fp8=... explicitly to the turbo_moe spec helper")
    if getattr(config, "quant_recipe", None) is not None:
        raise ValueError("config.quant_recipe (per-module quantization recipes) is not supported by turbo_moe's "
                         "experts; pass fp8=... explicitly to the turbo_moe spec helper")
    for name in ("fp8_quantizer_factory", "fp4_quantizer_factory"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"config.{name} (a custom quantizer) has no turbo_moe equivalent")
    if not fp8_on:
        return
    if getattr(config, "fp8_param", False):
        warn_once("fp8_param", "config.fp8_param=True: turbo_moe's experts keep their weights in params_dtype "
                  "and quantize them to FP8 for each GEMM (once per step where cache_fp8_weight caches)")
    if not getattr(config, "fp8_wgrad", True):
        warn_once("fp8_wgrad", "config.fp8_wgrad=False: turbo_moe's experts compute the weight gradient in FP8 "
                  "too (pass fp8=None for high-precision experts)")


def resolve_fp8_config(options: TurboMoEOptions, config) -> Optional[Float8Config]:
    """The Float8Config turbo_moe's experts run with, or None for the high-precision path.

    ``fp8="megatron"`` follows ``config.fp8`` / ``config.fp8_recipe`` / ``config.fp8_margin`` through
    :data:`FP8_RECIPES`; recipes and settings turbo_moe cannot honour raise ValueError naming them.
    """
    fp8 = options.fp8
    if isinstance(fp8, Float8Config):
        return fp8
    if fp8 is None:
        return None
    margin = 0
    granularity = options.granularity
    recipe_kwargs = {}
    if fp8 == "megatron":
        fp8 = _enum_value(getattr(config, "fp8", None))
        _check_megatron_quantization(config, bool(fp8))
        if not fp8:
            return None
        margin = int(getattr(config, "fp8_margin", 0) or 0)
        if granularity is None:  # an explicit granularity overrides the recipe
            recipe = _enum_value(getattr(config, "fp8_recipe", None)) or "tensorwise"
            mapping = FP8_RECIPES.get(recipe)
            if mapping is None:
                raise ValueError(f"config.fp8_recipe={recipe!r} is not a recipe turbo_moe knows ({sorted(FP8_RECIPES)}); "
                                 f"{_INSTEAD}")
            if mapping.refusal:
                raise ValueError(f"config.fp8_recipe={recipe!r} is not supported by turbo_moe's experts: "
                                 f"{mapping.refusal}. Instead, {_INSTEAD}")
            granularity = mapping.granularity
            if mapping.te_pow2_scales and te_block_scales_pow2():
                recipe_kwargs["power_of_two_scales"] = True
            if mapping.strategy is ScalingStrategy.DELAYED:
                recipe_kwargs.update(strategy=ScalingStrategy.DELAYED,
                                     amax_history_len=int(getattr(config, "fp8_amax_history_len", 1) or 1),
                                     amax_compute_algo=str(getattr(config, "fp8_amax_compute_algo", "most_recent")))
    return Float8Config.from_megatron(
        fp8, granularity=granularity or ScalingGranularity.TENSORWISE, margin=margin, **recipe_kwargs
    )
