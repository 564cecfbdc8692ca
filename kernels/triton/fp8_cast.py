"""Fused FP8 cast: one read of a high-precision tensor, FP8 writes in both layouts the GEMMs read.

The grouped GEMMs want every operand contiguous along its contraction dimension, so one tensor is
needed twice: row-major (``x`` for the forward, ``dy`` for dgrad) and transposed (``x^T`` and
``dy^T`` for wgrad, ``W^T`` for dgrad). Casting and transposing in one pass reads the source once
instead of three times (cast, read back, transpose).

``out[b, r, c] = fp8(clamp(x[b, r, c] * scale, -max, max))`` and ``out_t[b, c, r]`` the same value;
the multiply is in float32 and the cast rounds to nearest even, bit-for-bit what
``turbo_moe.quantize`` does in torch. NaN propagates (``propagate_nan=ALL``), as torch's clamp does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_cast_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr,
    R, C,
    stride_xb, stride_xr, stride_xc,
    FP8_MAX: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + batch * stride_xb + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask)
    scale = tl.load(scale_ptr)
    q = tl.clamp(x.to(tl.float32) * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if WRITE_ROWS:
        q_rows = q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + batch * R * C + rows[:, None] * C + cols[None, :], q_rows, mask=mask)
    if WRITE_T:
        q_t = tl.trans(q).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_t_ptr + batch * R * C + cols[:, None] * R + rows[None, :], q_t, mask=tl.trans(mask))


def fp8_cast(x, scale, fp8_dtype, fp8_max: float, write_rows: bool = True, write_transposed: bool = False):
    """Cast a 2-D ``[R, C]`` or 3-D ``[B, R, C]`` tensor to FP8 with a 0-dim float32 scale.

    Returns ``(rows, transposed)``: contiguous ``[..., R, C]`` and ``[..., C, R]`` FP8 tensors, each
    None when not asked for.
    """
    import torch

    squeeze = x.dim() == 2
    x3 = x[None] if squeeze else x
    batches, r, c = x3.shape
    rows = torch.empty((batches, r, c), dtype=fp8_dtype, device=x.device) if write_rows else None
    trans = torch.empty((batches, c, r), dtype=fp8_dtype, device=x.device) if write_transposed else None
    if x3.numel():
        block_r, block_c = 64, 64
        grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c), batches)
        fp8_cast_kernel[grid](
            x3, scale, rows if rows is not None else trans, trans if trans is not None else rows,
            r, c, x3.stride(0), x3.stride(1), x3.stride(2),
            FP8_MAX=fp8_max, WRITE_ROWS=write_rows, WRITE_T=write_transposed,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        )
    if squeeze:
        rows = rows[0] if rows is not None else None
        trans = trans[0] if trans is not None else None
    return rows, trans


@triton.jit
def _quant_scales(amax, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr):
    """(quantization scale, dequantization scale) from amax, bit-for-bit turbo_moe.quantize's
    float32 math: ``fp8_max / amax`` is torch's ``amax.reciprocal() * fp8_max`` (two IEEE-rounded
    steps); capped at 2**126 (turbo_moe.quantize.MAX_QUANT_SCALE: a tiny amax must not overflow
    the scale to inf); amax == 0 -> 1; NaN/Inf amax propagate."""
    scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * FP8_MAX
    if MARGIN_FACTOR != 1.0:
        scale = scale * MARGIN_FACTOR
    scale = tl.where(scale > 8.507059173023462e37, 8.507059173023462e37, scale)  # 2**126; NaN > x is false
    scale = tl.where(amax == 0, 1.0, scale)
    return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_rowwise_cast_kernel(
    x_ptr, out_ptr, dequant_ptr,
    R, C, stride_xb, stride_xr, stride_xc,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One scale per row of x [B, R, C] (contracted over C): out [B, R, C], dequant [B, R]."""
    pid_r = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_rows = x_ptr + batch * stride_xb + rows[:, None] * stride_xr
    amax = tl.zeros((BLOCK_R,), tl.float32)
    nan = tl.zeros((BLOCK_R,), tl.int1)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_rows + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        nan = nan | (tl.sum((x != x).to(tl.int32), axis=1) > 0)
    amax = tl.where(nan, float("nan"), amax)  # tl.max drops NaN; torch's amax keeps it
    scale, dequant = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
    tl.store(dequant_ptr + batch * R + rows, dequant, mask=row_ok)
    out_rows = out_ptr + batch * R * C + rows[:, None] * C
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_rows + cols[None, :] * stride_xc, mask=mask).to(tl.float32)
        q = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_rows + cols[None, :], q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def fp8_colwise_grouped_cast_kernel(
    x_ptr, group_offs_ptr, out_t_ptr, dequant_ptr,
    R, C, G, stride_xb, stride_xr, stride_xc,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One scale per (group of rows, column) of x [B, R, C], contracted over rows: the transposed
    FP8 copy out_t [B, C, R] (rows contiguous, as the wgrad / dgrad kernels read) and dequant
    [B, G, C]. Groups are rows offs[g]:offs[g+1], the same for every batch; an empty group gets 1."""
    pid_c = tl.program_id(0)
    group = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    lo = tl.load(group_offs_ptr + group)
    hi = tl.load(group_offs_ptr + group + 1)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    x_base = x_ptr + batch * stride_xb + cols[None, :] * stride_xc
    amax = tl.zeros((BLOCK_C,), tl.float32)
    nan = tl.zeros((BLOCK_C,), tl.int1)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < hi) & col_ok[None, :]
        x = tl.load(x_base + rows[:, None] * stride_xr, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        nan = nan | (tl.sum((x != x).to(tl.int32), axis=0) > 0)
    amax = tl.where(nan, float("nan"), amax)  # tl.max drops NaN; torch's amax keeps it
    scale, dequant = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
    tl.store(dequant_ptr + (batch * G + group) * C + cols, dequant, mask=col_ok)
    out_base = out_t_ptr + batch * R * C + cols[:, None] * R
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < hi) & col_ok[None, :]
        x = tl.load(x_base + rows[:, None] * stride_xr, mask=mask).to(tl.float32)
        q = tl.clamp(x * scale[None, :], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q_t = tl.trans(q).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_base + rows[None, :], q_t, mask=tl.trans(mask))


def _as_3d(x):
    return (x[None], True) if x.dim() == 2 else (x, False)


def fp8_rowwise_cast(x, fp8_dtype, fp8_max: float, margin: int = 0):
    """Per-row FP8 of x [R, C] or [B, R, C]: (fp8 of x's shape, contiguous; dequant [..., R] float32)."""
    import torch

    x3, squeeze = _as_3d(x)
    batches, r, c = x3.shape
    out = torch.empty((batches, r, c), dtype=fp8_dtype, device=x.device)
    dequant = torch.empty((batches, r), dtype=torch.float32, device=x.device)
    if batches * r:
        block_r, block_c = 16, 128
        fp8_rowwise_cast_kernel[(triton.cdiv(r, block_r), batches)](
            x3, out, dequant, r, c, x3.stride(0), x3.stride(1), x3.stride(2),
            FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        )
    return (out[0], dequant[0]) if squeeze else (out, dequant)


def fp8_colwise_grouped_cast(x, group_offs, fp8_dtype, fp8_max: float, margin: int = 0):
    """Per-(group, column) FP8 of x [R, C] (or [B, R, C]), transposed: (out_t [..., C, R], dequant [..., G, C])."""
    import torch

    x3, squeeze = _as_3d(x)
    batches, r, c = x3.shape
    groups = group_offs.shape[0] - 1
    out_t = torch.empty((batches, c, r), dtype=fp8_dtype, device=x.device)
    dequant = torch.empty((batches, groups, c), dtype=torch.float32, device=x.device)
    if batches * groups * c:
        block_r, block_c = 64, 64
        fp8_colwise_grouped_cast_kernel[(triton.cdiv(c, block_c), groups, batches)](
            x3, group_offs, out_t, dequant, r, c, groups, x3.stride(0), x3.stride(1), x3.stride(2),
            FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        )
    return (out_t[0], dequant[0]) if squeeze else (out_t, dequant)
