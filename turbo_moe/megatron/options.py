"""turbo_moe's own settings for Megatron experts and the mapping of Megatron's FP8 recipe onto them.

No megatron-core import here: this module reads Megatron's config by attribute only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from ..config import Float8Config, ScalingGranularity

__all__ = ["TurboMoEOptions", "resolve_fp8_config", "Fp8Setting"]

Fp8Setting = Union[None, str, Float8Config]


@dataclasses.dataclass(frozen=True)
class TurboMoEOptions:
    """turbo_moe's own settings for Megatron experts (Megatron's config carries everything else).

    ``fp8``: ``"megatron"`` (follow ``config.fp8``; off when it is None), ``None`` (high precision),
    ``"e4m3"``, ``"hybrid"`` or a ``Float8Config``. ``granularity``: ``"tensorwise"`` or
    ``"rowwise"`` when ``fp8`` is a format name (``None``: derived from ``config.fp8_recipe`` under
    ``"megatron"``, else tensorwise). ``backend``: ``"auto"``, ``"triton"``, ``"flydsl"``,
    ``"torch"``. ``num_cu``: cap on the SMs/CUs the FP8 kernels occupy. ``cache_fp8_weight``:
    quantize each weight once per optimizer step instead of once per micro-batch (the FP8 copy is
    kept between micro-batches; needs ``invalidate_fp8_weight_cache_on_step(optimizer)``, see
    docs/megatron.md).
    """

    fp8: Fp8Setting = "megatron"
    granularity: Optional[str] = None
    backend: str = "auto"
    num_cu: Optional[int] = None
    cache_fp8_weight: bool = False

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
        if self.num_cu is not None and (isinstance(self.num_cu, bool) or not isinstance(self.num_cu, int) or self.num_cu < 1):
            raise ValueError(f"num_cu must be None or a positive int, got {self.num_cu!r}")
        if not isinstance(self.cache_fp8_weight, bool):
            raise TypeError(f"cache_fp8_weight must be a bool, got {self.cache_fp8_weight!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a string, got {type(self.backend).__name__}")


# Megatron's fp8_recipe -> the closest turbo_moe granularity. turbo_moe scales with the current
# amax (no history), so Megatron's "delayed" recipe maps to current tensorwise scaling; MXFP8 and
# blockwise (1x32 / 128x128 blocks) map to rowwise, the finest granularity turbo_moe has.
_RECIPE_TO_GRANULARITY = {
    "tensorwise": ScalingGranularity.TENSORWISE,
    "delayed": ScalingGranularity.TENSORWISE,
    "mxfp8": ScalingGranularity.ROWWISE,
    "blockwise": ScalingGranularity.ROWWISE,
}


def _enum_value(value):
    return getattr(value, "value", value)


def resolve_fp8_config(options: TurboMoEOptions, config) -> Optional[Float8Config]:
    """The Float8Config turbo_moe's experts run with, or None for the high-precision path."""
    fp8 = options.fp8
    if isinstance(fp8, Float8Config):
        return fp8
    if fp8 is None:
        return None
    margin = 0
    granularity = options.granularity
    if fp8 == "megatron":
        fp8 = _enum_value(getattr(config, "fp8", None))
        if not fp8:
            return None
        margin = int(getattr(config, "fp8_margin", 0) or 0)
        if granularity is None:
            recipe = _enum_value(getattr(config, "fp8_recipe", None)) or "tensorwise"
            if recipe not in _RECIPE_TO_GRANULARITY:
                raise ValueError(
                    f"config.fp8_recipe={recipe!r} has no turbo_moe equivalent; pass fp8='e4m3'/'hybrid' "
                    f"with granularity='tensorwise'/'rowwise' to the turbo_moe spec helper instead"
                )
            granularity = _RECIPE_TO_GRANULARITY[recipe]
    return Float8Config.from_megatron(
        fp8, granularity=granularity or ScalingGranularity.TENSORWISE, margin=margin
    )

