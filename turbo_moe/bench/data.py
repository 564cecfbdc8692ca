"""Benchmark inputs and the float32 references that check every timed output.

Inputs are random (never zeros: zeros hide unwritten outputs and can run faster than real data).
References are computed group by group in float32 from the very operands the kernel read, and
compared with a streaming relative Frobenius error, so even a [128, 4096, 7168] wgrad output
needs no float32 copy of its own.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from ..backends.base import GemmKind

__all__ = [
    "random_fp8",
    "random_normal",
    "random_scales",
    "poison_allocator",
    "grouped_reference_error",
    "dequantize_m_operand",
    "dequantize_k_operand",
    "relative_error",
]

# Elements generated per chunk: bounds the float32 scratch of the generators to 1 GiB.
_CHUNK_ELEMENTS = 1 << 28


def _chunks_along_dim0(shape: Sequence[int]):
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, _CHUNK_ELEMENTS // max(row, 1))
    for lo in range(0, shape[0], step):
        yield lo, min(shape[0], lo + step)


def random_normal(shape, dtype, device, generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    for lo, hi in _chunks_along_dim0(shape):
        chunk = torch.randn((hi - lo, *shape[1:]), generator=generator, device=device, dtype=torch.float32)
        out[lo:hi] = chunk.mul_(std).to(dtype)
    return out


def random_fp8(shape, dtype, device, generator: torch.Generator) -> torch.Tensor:
    """FP8 values spread over several binades (N(0, 3^2)), saturated to the format's range."""
    fmax = torch.finfo(dtype).max
    out = torch.empty(shape, dtype=dtype, device=device)
    for lo, hi in _chunks_along_dim0(shape):
        chunk = torch.randn((hi - lo, *shape[1:]), generator=generator, device=device, dtype=torch.float32)
        out[lo:hi] = chunk.mul_(3.0).clamp_(-fmax, fmax).to(dtype)
    return out


def random_scales(shape, device, generator: torch.Generator) -> torch.Tensor:
    """Positive float32 dequantization scales in [0.5, 1.5) / 64."""
    return (torch.rand(shape, generator=generator, device=device, dtype=torch.float32) + 0.5) / 64.0


def poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Fill a block the size of the next output with NaN and free it.

    The caching allocator hands that block to the next allocation of the same size, so an output
    element the kernel fails to write reads back as NaN instead of stale but plausible data.
    """
    if numel == 0:
        return
    torch.empty(numel, dtype=dtype, device=device).fill_(float("nan"))


def _scale_rows(scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return scale if scale.dim() == 0 else scale[lo:hi, None]


def _scale_group(scale: torch.Tensor, g: int) -> torch.Tensor:
    return scale if scale.dim() == 0 else scale[g][:, None]


def grouped_reference_error(
    kind: GemmKind,
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    offs: Sequence[int],
    out: torch.Tensor,
) -> float:
    """‖out − ref‖ / ‖ref‖ over the whole output, ref in float32 from the FP8 operands.

    Semantics are those of ``turbo_moe/backends/base.py``. A non-finite output element gives inf.
    An empty group's K_GROUPED output must be exactly zero: its reference is zero, so any nonzero
    value there adds to the error.
    """
    num = torch.zeros((), dtype=torch.float64, device=out.device)
    den = torch.zeros((), dtype=torch.float64, device=out.device)
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if kind is GemmKind.M_GROUPED:
            if hi == lo:
                continue
            lhs = a[lo:hi].float() * _scale_rows(a_scale, lo, hi)
            rhs = b[g].float() * _scale_group(b_scale, g)
            ref = lhs @ rhs.T
            got = out[lo:hi].float()
        else:
            lhs = a[:, lo:hi].float() * _scale_group(a_scale, g)
            rhs = b[:, lo:hi].float() * _scale_group(b_scale, g)
            ref = lhs @ rhs.T
            got = out[g].float()
        num += (got - ref).double().square().sum()
        den += ref.double().square().sum()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    num_f, den_f = float(num), float(den)
    if den_f == 0.0:
        return 0.0 if num_f == 0.0 else math.inf
    return math.sqrt(num_f / den_f)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(got).all()):
        return math.inf
    den = float(ref.double().square().sum())
    num = float((got.double() - ref.double()).square().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def dequantize_m_operand(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` (rows scaled by a ``[M]`` scale, or one 0-dim scale) in ``dtype``, row chunks at a time."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for lo, hi in _chunks_along_dim0(x.shape):
        out[lo:hi] = (x[lo:hi].float() * _scale_rows(scale, lo, hi)).to(dtype)
    return out


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w[g] * scale[g][:, None]`` for a ``[G, R, C]`` weight, one group at a time."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    for g in range(w.shape[0]):
        out[g] = (w[g].float() * _scale_group(scale, g)).to(dtype)
    return out


def dequantize_k_operand(x: torch.Tensor, scale: torch.Tensor, offs: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A token-contiguous ``[R, M]`` K_GROUPED operand times its per-group ``[G, R]`` scale, in ``dtype``."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            out[:, lo:hi] = (x[:, lo:hi].float() * _scale_group(scale, g)).to(dtype)
    return out


def group_offsets(sizes: Sequence[int]) -> List[int]:
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def maybe_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def optional_float(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)
