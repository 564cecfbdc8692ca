"""Current-scaling FP8 quantization, with no host sync.

Every function returns ``(data_fp8, dequant_scale)``: ``data_fp8 * dequant_scale`` approximates the
input. Scales are float32 on the input's device. The quantization scale is ``fp8_max / amax``
(times ``2**-margin``), so the largest magnitude lands on the format's largest finite value and
values saturate instead of overflowing. An all-zero tensor (or slice) gets scale 1.

NaN and Inf: a NaN or Inf in a tensor makes its amax NaN/Inf, hence its scale NaN or 0 and every
element of the quantized tensor NaN; the GEMM output then is NaN. turbo_moe propagates such inputs
loudly rather than clipping them into finite garbage.

Rowwise scales vary along the non-contracted dimension only; the contraction axis is given per
function, and the ``grouped`` variants take one scale per (group, column) over the rows of that
group (the wgrad operands, contracted over tokens).
"""

from __future__ import annotations

import torch

from .config import fp8_max

__all__ = [
    "quantize_tensorwise",
    "quantize_tensorwise_layouts",
    "quantize_rowwise",
    "quantize_columnwise_grouped",
    "row_group_ids",
]


def _quant_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    amax = amax.float()
    scale = fp8_max(fp8_dtype) / amax
    if margin:
        scale = scale * (2.0 ** -margin)
    # amax == 0 -> scale 1 (the data are zeros); amax NaN/Inf propagate (see module doc).
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _cast(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    limit = fp8_max(fp8_dtype)
    return (t.float() * scale).clamp_(-limit, limit).to(fp8_dtype)


def _amax(t: torch.Tensor) -> torch.Tensor:
    # One read, no |t| temporary; NaN propagates.
    return torch.linalg.vector_norm(t, float("inf")) if t.numel() else t.new_zeros(())


def _fused_cast_kernel(t: torch.Tensor):
    """The Triton cast+transpose kernel for GPU tensors, or None (CPU, or no triton)."""
    if not t.is_cuda:
        return None
    try:
        from turbo_moe.kernels.triton.fp8_cast import fp8_cast
    except ImportError:
        return None
    return fp8_cast


def quantize_tensorwise(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """One scale for the whole tensor. Returns (fp8 tensor of t's shape, 0-dim dequant scale)."""
    rows, _, dequant = quantize_tensorwise_layouts(t, fp8_dtype, margin, rows=True, transposed=False)
    return rows, dequant


def quantize_tensorwise_layouts(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, *,
                                rows: bool = True, transposed: bool = False):
    """Tensorwise FP8 copies of ``t`` ([R, C] or [B, R, C]) in the layouts asked for.

    Returns ``(rows_fp8, transposed_fp8, dequant_scale)``: a contiguous copy in t's layout, a
    contiguous copy of its last two dims swapped (``[..., C, R]``), each None unless asked for.
    On a GPU one fused Triton pass writes both; elsewhere torch ops give the same bits.
    """
    scale = _quant_scale(_amax(t), fp8_dtype, margin)
    kernel = _fused_cast_kernel(t)
    if kernel is not None and t.dim() in (2, 3):
        q_rows, q_t = kernel(t, scale, fp8_dtype, fp8_max(fp8_dtype), write_rows=rows, write_transposed=transposed)
    else:
        q = _cast(t, scale, fp8_dtype)
        q_rows = q.contiguous() if rows else None
        q_t = q.transpose(-1, -2).contiguous() if transposed else None
    return q_rows, q_t, scale.reciprocal()


def quantize_rowwise(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """One scale per row, the last dimension being contracted. t: [..., R, C] -> scales [..., R]."""
    amax = t.abs().amax(dim=-1, keepdim=True) if t.shape[-1] else t.new_zeros(t.shape[:-1] + (1,))
    scale = _quant_scale(amax, fp8_dtype, margin)
    return _cast(t, scale, fp8_dtype), scale.reciprocal().squeeze(-1)


def row_group_ids(group_offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of each row, from device offsets, without a host sync."""
    lens = group_offs[1:] - group_offs[:-1]
    groups = torch.arange(lens.shape[0], device=group_offs.device)
    return torch.repeat_interleave(groups, lens, output_size=num_rows)


def quantize_columnwise_grouped(t: torch.Tensor, group_offs: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0):
    """Scales per (group, column) over each group's rows, for operands contracted over tokens.

    t: [M, C] -> (fp8 [M, C], dequant scales [G, C]). Empty groups get scale 1.
    """
    num_groups = group_offs.shape[0] - 1
    ids = row_group_ids(group_offs, t.shape[0])
    amax = torch.zeros(num_groups, t.shape[1], dtype=torch.float32, device=t.device)
    amax.scatter_reduce_(0, ids[:, None].expand(-1, t.shape[1]), t.abs().float(), reduce="amax", include_self=True)
    scale = _quant_scale(amax, fp8_dtype, margin)
    return _cast(t, scale[ids], fp8_dtype), scale.reciprocal()
