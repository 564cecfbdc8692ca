"""FP8 recipe: which formats, which scale granularity, how scales are chosen."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

__all__ = ["Float8Format", "ScalingGranularity", "ScalingStrategy", "Float8Accumulation", "Float8Config", "fp8_max"]


class Float8Format(str, enum.Enum):
    """FP8 formats per tensor role.

    ``E4M3``: e4m3 for activations, weights and gradients.
    ``HYBRID``: e4m3 in the forward pass, e5m2 for gradients (wider range, less precision).
    """

    E4M3 = "e4m3"
    HYBRID = "hybrid"


class ScalingGranularity(str, enum.Enum):
    """How many scales a tensor gets.

    ``TENSORWISE``: one float32 scale per tensor.
    ``ROWWISE``: one scale per row of each GEMM operand along its non-contracted dimension
    (per token for activations/gradients, per output channel for weights). Because a scale must
    not vary along the contraction dimension, each GEMM quantizes its operands along its own
    contraction axis (see ``turbo_moe.quantize``).
    ``BLOCKWISE``: DeepSeek-V3 style: float32 scales per 1x128 tile of activations and gradients
    along the contracted dimension, per 128x128 block of weights (so W and W^T share them).
    ``MXFP8``: OCP MX: one power-of-two (e8m0) scale per 1x32 block along the contracted
    dimension, for every operand. The fine-grained recipes live in ``turbo_moe.fine_grained``.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MXFP8 = "mxfp8"


class ScalingStrategy(str, enum.Enum):
    """Where the scale comes from.

    ``CURRENT``: amax of the tensor being quantized, computed on the device (no host sync).
    ``DELAYED``: for activations and gradients, the newest or largest amax of the last
    ``amax_history_len`` casts of the same tensor role (Transformer Engine's ``DelayedScaling``,
    Megatron's ``fp8_recipe="delayed"``): one pass per cast instead of two; weights keep current
    scaling. Tensorwise only; see ``turbo_moe.delayed_scaling``.
    """

    CURRENT = "current"
    DELAYED = "delayed"


class Float8Accumulation(str, enum.Enum):
    """How the tensorwise/rowwise GEMMs accumulate FP8 products on Hopper (sm_90).

    ``FAST``: the tensor core's accumulator over the whole contraction. Hopper's FP8 MMA keeps
    fewer than fp32's mantissa bits there (DeepSeek-V3 measured about 14); this is CUTLASS's and
    ``torch._scaled_mm``'s ``use_fast_accum=True``, and Triton's default on sm_90.
    ``PROMOTED``: each 128-deep (or shorter) slice of the contraction is summed by the tensor core,
    then added into a true fp32 accumulator, as DeepSeek-V3 does and Transformer Engine does for
    dgrad and wgrad ("split accumulator"). Measured on an H100 (docs/results/h100_accumulation.md):
    the accumulation error of a 7168-deep contraction falls from 1.9e-3 to 1.3e-4 (relative to a
    float64 product of the same FP8 operands; rounding the operands to e4m3 costs a few percent
    per output on random data, tens of times more), and the GEMMs take 1.25-1.35x as long at
    4096 tokens per expert, 1.1x at 128. Hence the default ``FAST``.
    Elsewhere (AMD MFMA, the torch reference) products accumulate in fp32 and both give the same
    result; the blockwise and MXFP8 kernels always promote per scale block.
    """

    FAST = "fast"
    PROMOTED = "promoted"


_FP8_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


# The largest Float8Config.margin: the largest m with 2**m < 448, e4m3's largest value (every recipe
# quantizes x and W to e4m3; e5m2's 57344 would allow 15). The bound keeps both ends working:
# * the largest element of a tensor quantizes to fp8_max * 2**-m >= 448 / 256 = 1.75, a normal e4m3
#   number with its full 3-bit mantissa (at m = 19 it rounds to zero: an all-zero output);
# * the dequantization scale amax * 2**m / fp8_max stays finite float32 for every finite amax,
#   up to FLT_MAX (at m = 9 an amax near FLT_MAX would dequantize to inf; at m >= 150, 2**-m is 0
#   in float32, so the scale is 0 and the output NaN).
MAX_MARGIN = 8

# Delayed scaling: how the history reduces to the scale's amax (Transformer Engine's names), and the
# longest history (TE's default is 1024; the cast kernel's last program rolls it in one vector).
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MAX_AMAX_HISTORY = 4096


@dataclass(frozen=True)
class Float8Config:
    """The FP8 recipe for one grouped GEMM (forward and backward).

    ``format``: ``"e4m3"`` or ``"hybrid"``; ``granularity``: ``"tensorwise"`` or ``"rowwise"``;
    ``strategy``: ``"current"`` or ``"delayed"`` (tensorwise only: the scale of an activation or
    gradient from the amax history of its tensor role, ``amax_history_len`` entries long, reduced
    by ``amax_compute_algo``: ``"max"`` or ``"most_recent"``, as Transformer Engine's
    ``DelayedScaling``). ``margin`` (an int in ``[0, 8]``) shrinks the scale by ``2**margin`` to
    leave head-room, as Transformer Engine's recipe does.
    ``granularity`` may also be ``"blockwise"`` or ``"mxfp8"`` (see ScalingGranularity).
    ``power_of_two_scales`` (blockwise only): round every quantization scale down to a power of
    two (DeepSeek-V3, TE's ``Float8BlockScaling(power_2_scale=True)``), so that scaling is exact;
    MXFP8 scales are powers of two by definition.
    ``accumulation``: ``"fast"`` (default) or ``"promoted"``, see ``Float8Accumulation``.
    """

    format: Float8Format = Float8Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    strategy: ScalingStrategy = ScalingStrategy.CURRENT
    margin: int = 0
    amax_history_len: int = field(default=1)
    amax_compute_algo: str = "max"
    power_of_two_scales: bool = False
    accumulation: Float8Accumulation = Float8Accumulation.FAST

    def __post_init__(self) -> None:
        for name, enum_type in (
            ("format", Float8Format),
            ("granularity", ScalingGranularity),
            ("strategy", ScalingStrategy),
            ("accumulation", Float8Accumulation),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum_type(value))
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in enum_type)
                raise ValueError(f"Float8Config.{name}={value!r} is not one of {allowed}") from None
        if self.strategy is ScalingStrategy.DELAYED and self.granularity is not ScalingGranularity.TENSORWISE:
            raise ValueError(
                f"Float8Config.strategy='delayed' scales per tensor (one amax history per tensor role); "
                f"granularity={self.granularity.value!r} takes its scales from the current tensor: use "
                "granularity='tensorwise' or strategy='current'"
            )
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"Float8Config.amax_compute_algo must be one of {', '.join(map(repr, AMAX_COMPUTE_ALGOS))}, "
                             f"got {self.amax_compute_algo!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= MAX_MARGIN:
            raise ValueError(f"Float8Config.margin must be an int in [0, {MAX_MARGIN}], got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY:
            raise ValueError(f"Float8Config.amax_history_len must be an int in [1, {MAX_AMAX_HISTORY}], "
                             f"got {self.amax_history_len!r}")
        if not isinstance(self.power_of_two_scales, bool):
            raise TypeError(f"Float8Config.power_of_two_scales must be a bool, got {self.power_of_two_scales!r}")
        if self.power_of_two_scales and self.granularity is not ScalingGranularity.BLOCKWISE:
            raise ValueError(
                f"Float8Config.power_of_two_scales=True is for granularity='blockwise' (mxfp8 scales are powers "
                f"of two already), got granularity={self.granularity.value!r}"
            )

    @property
    def fine_grained(self) -> bool:
        """Whether the recipe is blockwise or MXFP8 (run by ``turbo_moe.fine_grained``)."""
        return self.granularity in (ScalingGranularity.BLOCKWISE, ScalingGranularity.MXFP8)

    @property
    def delayed(self) -> bool:
        """Whether activations and gradients take their scales from an amax history."""
        return self.strategy is ScalingStrategy.DELAYED

    @property
    def promotes_accumulation(self) -> bool:
        """Whether the GEMMs add partial sums into fp32 every K block (``accumulation="promoted"``)."""
        return self.accumulation is Float8Accumulation.PROMOTED

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of activations and weights."""
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """FP8 dtype of output gradients."""
        return torch.float8_e5m2 if self.format is Float8Format.HYBRID else torch.float8_e4m3fn

    @classmethod
    def from_megatron(cls, fp8: str, **kwargs) -> "Float8Config":
        """Map Megatron's ``config.fp8`` names (``"e4m3"``, ``"hybrid"``) onto a Float8Config."""
        try:
            fmt = Float8Format(fp8)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in Float8Format)
            raise ValueError(f"from_megatron(fp8={fp8!r}): Megatron's config.fp8 must be one of {allowed}") from None
        return cls(format=fmt, **kwargs)
