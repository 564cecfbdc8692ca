"""Current-scaling FP8 quantization, with no host sync.

Every function returns ``(data_fp8, dequant_scale)``: ``data_fp8 * dequant_scale`` approximates the
input. Scales are float32 on the input's device. The quantization scale is ``fp8_max / amax``
(times ``2**-margin``), so the largest magnitude lands on the format's largest finite value and
values saturate instead of overflowing. An all-zero tensor (or slice) gets scale 1.

Tiny inputs: the quantization scale is capped at ``2**126`` (``MAX_QUANT_SCALE``), so that the
dequantization scale ``2**-126`` stays a normal float32 and ``fp8_max / amax`` never overflows to
inf (which zeroed every element) for an amax below ``fp8_max / FLT_MAX`` (~1.3e-36 for e4m3).
Below ``fp8_max * 2**-126`` (~5e-36 for e4m3, ~7e-34 for e5m2) the largest element then lands
under ``fp8_max``: such tensors keep fewer significant bits, down to FP8's subnormals, but every
finite input quantizes to what FP8 can represent at that scale.

Huge inputs: the GEMM epilogue multiplies the float32 accumulator by ``a``'s dequantization scale
first, then by ``b``'s (``b`` is ``W`` or ``x``, always e4m3). The intermediate ``acc * a_scale``
reaches up to ``max|a| * 448 * K`` (``K``: the contraction length), so it can overflow float32
(3.4e38) once ``max|x|`` (forward) or ``max|dy|`` (backward) exceeds about ``7e35 / K``, even when
a tiny ``w`` would bring the true output back into range (``x * 1e36`` with ``w * 1e-36`` gives
inf). Keep activations and gradients below that: rescale them, not only the weight.

NaN and Inf: a NaN or Inf in a tensor (or slice) makes its amax NaN/Inf, hence its scale NaN or 0
and every element of the quantized tensor (or slice) NaN; the GEMM outputs it feeds then are NaN
(tensorwise: all of them; rowwise: one row or column). turbo_moe propagates such inputs
loudly rather than clipping them into finite garbage.

Rowwise scales vary along the non-contracted dimension only: ``quantize_rowwise`` contracts the
last dimension; ``quantize_columnwise`` contracts the rows (per group of rows for the wgrad
operands) and returns the transposed copy the kernels read. On a GPU, Triton kernels
(``kernels/triton/fp8_cast.py``) do each quantization in one launch with the same bits as the
torch ops used elsewhere.
"""

from __future__ import annotations

import torch

from ._triton_kernels import triton_kernels
from .config import fp8_max

__all__ = [
    "quantize_tensorwise",
    "quantize_tensorwise_layouts",
    "quantize_rowwise",
    "quantize_columnwise",
    "quantize_rowwise_layouts",
    "pack_scales",
    "split_packed_scales",
    "row_group_ids",
]


# Cap on the quantization scale: its reciprocal, the dequantization scale, stays a normal float32
# (see the module doc). kernels/triton/fp8_cast.py's _quant_scales applies the same cap.
MAX_QUANT_SCALE = 2.0 ** 126


def _quant_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    amax = amax.float()
    scale = fp8_max(fp8_dtype) / amax
    if margin:
        scale = scale * (2.0 ** -margin)
    # A tiny amax (or a 1/amax that overflowed to inf) -> the cap; NaN stays NaN (clamp keeps it).
    scale = scale.clamp(max=MAX_QUANT_SCALE)
    # amax == 0 -> scale 1 (the data are zeros); amax NaN/Inf propagate (see module doc).
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _cast(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    limit = fp8_max(fp8_dtype)
    return (t.float() * scale).clamp_(-limit, limit).to(fp8_dtype)


def _amax(t: torch.Tensor) -> torch.Tensor:
    # One read, no |t| temporary; NaN propagates.
    return torch.linalg.vector_norm(t, float("inf")) if t.numel() else t.new_zeros(())


def _cast_kernels(t: torch.Tensor):
    """``turbo_moe.kernels.triton.fp8_cast`` for 2-D/3-D GPU tensors, or None (CPU, or no triton)."""
    if not t.is_cuda or t.dim() not in (2, 3):
        return None
    return triton_kernels("fp8_cast")


def quantize_tensorwise(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """One scale for the whole tensor. Returns (fp8 tensor of t's shape, 0-dim dequant scale)."""
    rows, _, dequant = quantize_tensorwise_layouts(t, fp8_dtype, margin, rows=True, transposed=False)
    return rows, dequant


def quantize_tensorwise_layouts(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, *,
                                rows: bool = True, transposed: bool = False, history=None):
    """Tensorwise FP8 copies of ``t`` ([R, C] or [B, R, C]) in the layouts asked for.

    Returns ``(rows_fp8, transposed_fp8, dequant_scale)``: a contiguous copy in t's layout, a
    contiguous copy of its last two dims swapped (``[..., C, R]``), each None unless asked for.
    On a GPU two Triton launches (amax partials, then one cast writing both layouts, the scale
    derived on the device) do it all; elsewhere torch ops give the same bits.
    ``history``: a ``turbo_moe.delayed_scaling.AmaxHistory`` (delayed scaling): the scale comes
    from it and t's amax is recorded in it, in one launch on a GPU.
    """
    if history is not None:
        return history.quantize(t, fp8_dtype, margin, rows=rows, transposed=transposed)
    kernels = _cast_kernels(t)
    if kernels is not None:
        return kernels.fp8_tensorwise_cast(t, fp8_dtype, fp8_max(fp8_dtype), margin, write_rows=rows,
                                           write_transposed=transposed)
    scale = _quant_scale(_amax(t), fp8_dtype, margin)
    q = _cast(t, scale, fp8_dtype)
    q_rows = q.contiguous() if rows else None
    q_t = q.transpose(-1, -2).contiguous() if transposed else None
    return q_rows, q_t, scale.reciprocal()


def quantize_rowwise(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """One scale per row, the last dimension being contracted. t: [..., R, C] -> (fp8, scales [..., R])."""
    kernels = _cast_kernels(t)
    if kernels is not None:
        return kernels.fp8_rowwise_cast(t, fp8_dtype, fp8_max(fp8_dtype), margin)
    amax = t.abs().amax(dim=-1, keepdim=True) if t.shape[-1] else t.new_zeros(t.shape[:-1] + (1,))
    scale = _quant_scale(amax, fp8_dtype, margin)
    return _cast(t, scale, fp8_dtype).contiguous(), scale.reciprocal().squeeze(-1)


def row_group_ids(group_offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each row, from device offsets, without a host sync."""
    lens = group_offs[1:] - group_offs[:-1]
    groups = torch.arange(lens.shape[0], device=group_offs.device)
    return torch.repeat_interleave(groups, lens, output_size=num_rows)


def quantize_columnwise(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, group_offs=None):
    """Scales per column over rows (the rows being contracted), returned transposed.

    * ``t [M, C]`` with ``group_offs [G+1]``: one scale per (group, column) over the group's rows
      (wgrad operands, contracted over each group's tokens) -> (fp8 ``[C, M]``, scales ``[G, C]``);
      an empty group gets scale 1.
    * ``t [B, R, C]`` without offsets: one scale per (batch, column) over all R rows (``W`` for
      dgrad, contracted over N) -> (fp8 ``[B, C, R]``, scales ``[B, C]``).
    """
    single = group_offs is None
    kernels = _cast_kernels(t)
    if kernels is not None:
        q_t, dequant = kernels.fp8_colwise_grouped_cast(t, group_offs, fp8_dtype, fp8_max(fp8_dtype), margin)
        return q_t, (dequant.squeeze(-2) if single else dequant)
    if single:
        group_offs = torch.tensor([0, t.shape[-2]], dtype=torch.int64, device=t.device)
    t3 = t if t.dim() == 3 else t[None]
    num_groups = group_offs.shape[0] - 1
    ids = row_group_ids(group_offs, t3.shape[1])
    amax = torch.zeros(t3.shape[0], num_groups, t3.shape[2], dtype=torch.float32, device=t.device)
    index = ids[None, :, None].expand(t3.shape[0], -1, t3.shape[2])
    amax.scatter_reduce_(1, index, t3.abs().float(), reduce="amax", include_self=True)
    scale = _quant_scale(amax, fp8_dtype, margin)
    q = _cast(t3, scale.gather(1, index), fp8_dtype)
    q_t, dequant = q.transpose(-1, -2).contiguous(), scale.reciprocal()
    if single:
        dequant = dequant.squeeze(-2)
    return (q_t, dequant) if t.dim() == 3 else (q_t[0], dequant[0])


def rowwise_layout_kernels(t: torch.Tensor, group_offs=None):
    """``kernels/triton/rowwise_layouts.py`` where it takes a call on ``t`` (a 2-D/3-D GPU tensor,
    at most its ``MAX_GROUPS`` groups), else None: the torch ops or the one-pass kernels serve."""
    if _cast_kernels(t) is None:
        return None
    kernels = triton_kernels("rowwise_layouts")
    groups = 1 if group_offs is None else group_offs.shape[0] - 1
    return kernels if kernels is not None and groups <= kernels.MAX_GROUPS else None


def quantize_rowwise_layouts(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, group_offs=None):
    """``quantize_rowwise(t)`` and ``quantize_columnwise(t, group_offs=group_offs)`` together:
    ``(rows_fp8, row_dequant, transposed_fp8, column_dequant)``, the same bits.

    On a GPU (``kernels/triton/rowwise_layouts.py``) a stats pass finds the row and the (group,
    column) amaxes in one read of ``t`` and a cast pass writes both copies, where the two one-pass
    kernels read ``t`` twice each. Both copies then exist at once; callers that would rather free
    the row copy before the transposed one is made call the two functions.
    """
    kernels = rowwise_layout_kernels(t, group_offs)
    if kernels is not None:
        rows, row_dequant, q_t, col_dequant = kernels.fp8_rowwise_layouts(t, group_offs, fp8_dtype,
                                                                          fp8_max(fp8_dtype), margin)
        return rows, row_dequant, q_t, (col_dequant.squeeze(-2) if group_offs is None else col_dequant)
    rows, row_dequant = quantize_rowwise(t, fp8_dtype, margin)
    return (rows, row_dequant) + tuple(quantize_columnwise(t, fp8_dtype, margin, group_offs=group_offs))


def pack_scales(row_dequant: torch.Tensor, col_dequant: torch.Tensor) -> torch.Tensor:
    """A rowwise tensor's two dequantization scales as one float32 tensor (the row scales, then the
    column scales): what a rowwise ``QuantizedGradHandoff`` carries where tensorwise carries its
    one scale. The GPU kernels write them so already (``rowwise_layouts``)."""
    return torch.cat((row_dequant.reshape(-1), col_dequant.reshape(-1)))


def split_packed_scales(packed: torch.Tensor, rows: int, cols: int, groups: int):
    """``(row dequant [rows], column dequant [groups, cols])`` as views of :func:`pack_scales`'
    tensor: the first ``rows`` row scales, and the column scales from its end (the row part may hold
    more rows than ``rows``: a token bucket's capacity, ``kernels/triton/rowwise_layouts.py``)."""
    return packed[:rows], packed[packed.numel() - groups * cols:].view(groups, cols)
