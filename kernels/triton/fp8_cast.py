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
