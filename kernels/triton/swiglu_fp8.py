"""The routing-weighted SwiGLU between an expert's fc1 and fc2, fused with fc2's FP8 quantization.

``a[r, f] = silu(h[r, f]) * h[r, F + f] * probs[r]`` for fc1's output ``h [M, 2F]`` (gate half,
then linear half, as Megatron's ``weighted_bias_swiglu_impl``) and the routing weights
``probs [M]``. In an FP8 expert MLP ``a`` exists only to be quantized for fc2 (row-major for the
forward, token-major for wgrad), so these kernels never write it in high precision:

* forward, tensorwise (two launches): :func:`swiglu_amax_partials_kernel` computes ``a`` from
  ``h`` and reduces ``max|a|`` per program; :func:`swiglu_fp8_cast_kernel` computes ``a`` again,
  reduces the partials to the scale on the device and writes both FP8 layouts. Against the
  activation kernel, an amax pass and a cast pass over a bf16 ``a``, this reads ``h`` twice and
  writes no ``a`` (10 instead of 12+ bytes per element of ``a``, and 2 launches instead of the
  activation's several plus 2).
* backward (one launch): :func:`swiglu_backward_kernel` turns ``da`` (fc2's dgrad output) into
  ``dh [M, 2F]`` and ``dprobs [M]``, each program owning whole rows, so the row sums behind
  ``dprobs`` are ordered (deterministic) and need no atomics.
* backward straight to FP8 (two launches), when fc1's backward takes its output gradient in FP8
  (``turbo_moe.autograd.QuantizedGradHandoff``): :func:`swiglu_backward_amax_kernel` writes
  ``dprobs`` and reduces ``max|dh|`` per program without writing ``dh``;
  :func:`swiglu_backward_fp8_cast_kernel` computes ``dh`` again from ``h``, ``da`` and ``probs``
  and writes its tensorwise FP8 layouts (rows for fc1's dgrad, token-major for its wgrad). Against
  the backward kernel followed by fc1's amax and cast passes over a bf16 ``dh``, this reads
  ``h`` and ``da`` twice and never writes or reads ``dh`` in bf16 (12 instead of 18 bytes per
  element of ``da``, 2 launches instead of 4 with the scale's). ``dh`` is quantized from its
  float32 values (one rounding, not bf16 then FP8).

* forward, the fine-grained recipes (one launch): :func:`swiglu_block_cast_rows_kernel` computes
  ``a``, writes it in h's dtype and casts those rounded values in 1xB blocks
  (``blockwise_cast``'s scales and cast), the rows copy fc2's forward GEMM reads; the wgrad's token
  copy is cast from the stored ``a`` (``blockwise_cast.block_cast_tokens_kernel``: it needs each
  group's column block maxima first). The backward is :func:`swiglu_backward_kernel`'s.

All arithmetic is float32 from the stored inputs (Megatron's own fusion rounds ``silu(gate) *
linear`` to bf16 before weighting it; here only FP8 rounds ``a``). The scale math and the cast
(round to nearest even, NaN kept) are ``fp8_cast``'s, so the quantization is the one
``turbo_moe.quantize`` applies to any tensor; only the activation's float32 values may differ
from torch's by an ulp (exp). Every transposed FP8 copy comes from its own transposed loads of
``h`` (``fp8_cast``'s module docstring: a Hopper miscompilation of dual row/transposed stores).
Offsets are int64: ``M * 2F`` may pass 2**31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .amax_history import delayed_scales, history_block, record_amax, tile_abs_max, tile_abs_max2
from .fp8_cast import (MAX_PARTIALS, _amax_from_partials, _cdiv, _first_rows, _quant_scales, abs_max_keep_nan,
                       clamp_keep_nan)
from .blockwise_cast import _block_scales, _check_fp8_max, _nan_max
from .blockwise_cast import _cast as _block_cast
from .launch import arg_fact, lean


@triton.jit
def _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, ROWS_FIRST: tl.constexpr):
    """float32 ``a`` of a tile: ``[rows, cols]`` when ROWS_FIRST, else ``[cols, rows]`` (the
    transposed tile, from transposed loads). Masked-out elements are 0."""
    if ROWS_FIRST:
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        offs = rows[:, None] * stride_h + cols[None, :]
        p = tl.load(probs_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[:, None]
    else:
        mask = (cols[:, None] < F) & (rows[None, :] < R)
        offs = cols[:, None] + rows[None, :] * stride_h
        p = tl.load(probs_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[None, :]
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    linear = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    return gate * tl.sigmoid(gate) * linear * p


@triton.jit
def _store_amax_partial(partials_ptr, pid, acc):
    """partials[pid] = max of the running |x| tile ``acc``, NaN if any element is NaN (tl.max alone
    would drop it)."""
    amax = tl.max(tl.max(acc, axis=1), axis=0)
    has_nan = tl.sum(tl.sum((acc != acc).to(tl.int32), axis=1), axis=0) > 0
    tl.store(partials_ptr + pid, tl.where(has_nan, float("nan"), amax))


@triton.jit
def _cast_tile_start(partials_ptr, num_partials, dequant_ptr, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """A tensorwise cast program's start: (quantization scale, its tile's rows, columns), int64;
    the scale comes from the amax partials on the device, and program (0, 0) stores the
    dequantization scale (``fp8_cast_kernel``'s contract)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    amax = _amax_from_partials(partials_ptr, num_partials, BLOCK_P)
    scale, dequant = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(dequant_ptr, dequant)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    return scale, rows, cols


@triton.jit
def _store_fp8(ptrs, x, scale, mask, FP8_MAX: tl.constexpr):
    """Store ``x * scale`` as FP8 (clamped, NaN kept, round to nearest even)."""
    q = clamp_keep_nan(x * scale, FP8_MAX).to(ptrs.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(ptrs, q, mask=mask)


@triton.jit
def swiglu_amax_partials_kernel(h_ptr, probs_ptr, partials_ptr, R, F, stride_h, rows_per_program,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program p writes max |a| over rows [p * rows_per_program, (p + 1) * rows_per_program) to
    partials[p] (NaN if any is NaN); every program writes its slot (no zero-fill launch)."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, R)
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r0 in range(0, rows_per_program, BLOCK_R):
        rows = first + r0 + tl.arange(0, BLOCK_R)
        for c0 in range(0, F, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            a = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, last, F, stride_h, True)
            acc = abs_max_keep_nan(acc, a)
    _store_amax_partial(partials_ptr, pid, acc)


@triton.jit
def swiglu_fp8_cast_kernel(
    h_ptr, probs_ptr, partials_ptr, num_partials, out_ptr, out_t_ptr, dequant_ptr,
    R, F, stride_h, R_OUT,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Tensorwise FP8 of ``a``: ``out [R_OUT, F]`` and/or ``out_t [F, R_OUT]`` (R_OUT >= R, a token
    bucket's row capacity: rows past R are not written); program (0, 0) stores the dequantization
    scale (``fp8_cast_kernel``'s contract, with ``a`` computed from ``h``)."""
    scale, rows, cols = _cast_tile_start(partials_ptr, num_partials, dequant_ptr, FP8_MAX, MARGIN_FACTOR,
                                         BLOCK_R, BLOCK_C, BLOCK_P)
    if WRITE_ROWS:
        a = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, True)
        _store_fp8(out_ptr + rows[:, None] * F + cols[None, :], a, scale, (rows[:, None] < R) & (cols[None, :] < F),
                   FP8_MAX)
    if WRITE_T:
        a_t = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, False)
        _store_fp8(out_t_ptr + cols[:, None] * R_OUT + rows[None, :], a_t, scale,
                   (cols[:, None] < F) & (rows[None, :] < R), FP8_MAX)


@triton.jit
def swiglu_backward_kernel(h_ptr, probs_ptr, da_ptr, dh_ptr, dprobs_ptr, R, F, stride_h, stride_da,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dh = [da * p * linear * s * (1 + gate * (1 - s)), da * p * silu(gate)]`` (s = sigmoid(gate))
    and ``dprobs[r] = sum_f da * silu(gate) * linear``, float32 inside; each program owns BLOCK_R
    whole rows and sums them in a fixed order."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    dp = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, F, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (cols[None, :] < F)
        offs = rows[:, None] * stride_h + cols[None, :]
        gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        linear = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        silu = gate * s
        dap = da * p
        dgate = dap * linear * s * (1.0 + gate * (1.0 - s))
        dlinear = dap * silu
        dp += tl.sum(da * silu * linear, axis=1)
        out = dh_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(out, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(out + F, dlinear.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dprobs_ptr + rows, dp.to(dprobs_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h, stride_da, ROWS_FIRST: tl.constexpr):
    """float32 ``(dgate, dlinear, da * silu(gate) * linear)`` of a tile (``swiglu_backward_kernel``'s
    math): ``[rows, cols]`` when ROWS_FIRST, else ``[cols, rows]`` from transposed loads. Masked-out
    elements are 0."""
    if ROWS_FIRST:
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        offs = rows[:, None] * stride_h + cols[None, :]
        offs_da = rows[:, None] * stride_da + cols[None, :]
        p = tl.load(probs_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[:, None]
    else:
        mask = (cols[:, None] < F) & (rows[None, :] < R)
        offs = cols[:, None] + rows[None, :] * stride_h
        offs_da = cols[:, None] + rows[None, :] * stride_da
        p = tl.load(probs_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[None, :]
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    linear = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + offs_da, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    silu = gate * s
    dap = da * p
    return dap * linear * s * (1.0 + gate * (1.0 - s)), dap * silu, da * silu * linear


@triton.jit
def swiglu_backward_amax_kernel(h_ptr, probs_ptr, da_ptr, dprobs_ptr, partials_ptr, R, F, stride_h, stride_da,
                                rows_per_program, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dprobs`` (each row summed in a fixed order by the program owning it) and, in partials[p],
    max |dh| over program p's rows [p * rows_per_program, (p + 1) * rows_per_program), NaN if any
    is NaN; ``dh`` itself is not written."""
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, R)
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r0 in range(0, rows_per_program, BLOCK_R):
        rows = first + r0 + tl.arange(0, BLOCK_R)
        dp = tl.zeros((BLOCK_R,), tl.float32)
        for c0 in range(0, F, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            dgate, dlinear, dprob = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, last, F, stride_h,
                                                      stride_da, True)
            acc = abs_max_keep_nan(abs_max_keep_nan(acc, dgate), dlinear)
            dp += tl.sum(dprob, axis=1)
        tl.store(dprobs_ptr + rows, dp.to(dprobs_ptr.dtype.element_ty), mask=rows < last)
    _store_amax_partial(partials_ptr, pid, acc)


@triton.jit
def swiglu_backward_fp8_cast_kernel(
    h_ptr, probs_ptr, da_ptr, partials_ptr, num_partials, out_ptr, out_t_ptr, dequant_ptr,
    R, F, stride_h, stride_da, R_OUT,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Tensorwise FP8 of ``dh``: ``out [R_OUT, 2F]`` and/or ``out_t [2F, R_OUT]`` (columns [0, F) the
    gate half, [F, 2F) the linear half; R_OUT >= R as in :func:`swiglu_fp8_cast_kernel`); program
    (0, 0) stores the dequantization scale."""
    scale, rows, cols = _cast_tile_start(partials_ptr, num_partials, dequant_ptr, FP8_MAX, MARGIN_FACTOR,
                                         BLOCK_R, BLOCK_C, BLOCK_P)
    if WRITE_ROWS:
        dgate, dlinear, _ = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h, stride_da, True)
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        ptrs = out_ptr + rows[:, None] * (2 * F) + cols[None, :]
        _store_fp8(ptrs, dgate, scale, mask, FP8_MAX)
        _store_fp8(ptrs + F, dlinear, scale, mask, FP8_MAX)
    if WRITE_T:
        dgate_t, dlinear_t, _ = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h, stride_da,
                                                  False)
        mask_t = (cols[:, None] < F) & (rows[None, :] < R)
        ptrs_t = out_t_ptr + cols[:, None] * R_OUT + rows[None, :]
        _store_fp8(ptrs_t, dgate_t, scale, mask_t, FP8_MAX)
        _store_fp8(ptrs_t + F * R_OUT, dlinear_t, scale, mask_t, FP8_MAX)


@triton.jit
def _delayed_tile_start(state_ptr, dequant_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """:func:`_cast_tile_start` under delayed scaling: the scale read from the amax history
    (``amax_history.delayed_scales``), program (0, 0) storing the dequantization scale."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    scale, _ = delayed_scales(state_ptr, dequant_ptr, (pid_r == 0) & (pid_c == 0))
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    return scale, rows, cols


@triton.jit
def swiglu_fp8_cast_delayed_kernel(
    h_ptr, probs_ptr, state_ptr, ticket_ptr, num_programs, out_ptr, out_t_ptr, dequant_ptr,
    R, F, stride_h, R_OUT,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, HISTORY: tl.constexpr, MOST_RECENT: tl.constexpr,
    WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`swiglu_fp8_cast_kernel` under delayed scaling (``amax_history``): the scale from the
    history, no amax pass; the tile's max |a| recorded for the next cast. Outputs of R_OUT
    rows, as there."""
    scale, rows, cols = _delayed_tile_start(state_ptr, dequant_ptr, BLOCK_R, BLOCK_C)
    if WRITE_ROWS:
        a = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, True)
        amax = tile_abs_max(a)
        _store_fp8(out_ptr + rows[:, None] * F + cols[None, :], a, scale, (rows[:, None] < R) & (cols[None, :] < F),
                   FP8_MAX)
    if WRITE_T:
        a_t = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, False)
        if not WRITE_ROWS:
            amax = tile_abs_max(a_t)
        _store_fp8(out_t_ptr + cols[:, None] * R_OUT + rows[None, :], a_t, scale,
                   (cols[:, None] < F) & (rows[None, :] < R), FP8_MAX)
    record_amax(state_ptr, ticket_ptr, amax, num_programs, FP8_MAX, MARGIN_FACTOR, HISTORY, MOST_RECENT, BLOCK_H)


@triton.jit
def swiglu_backward_fp8_delayed_kernel(
    h_ptr, probs_ptr, da_ptr, dprobs_part_ptr, state_ptr, ticket_ptr, num_programs, out_ptr, out_t_ptr, dequant_ptr,
    R, F, stride_h, stride_da, R_OUT,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, HISTORY: tl.constexpr, MOST_RECENT: tl.constexpr,
    WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``dh``'s FP8 layouts under delayed scaling, in :func:`swiglu_backward_fp8_cast_kernel`'s
    tiles: with the scale known up front, the pass that current scaling spends on ``max|dh|`` and
    ``dprobs`` goes. ``dprobs`` comes out as per-tile partial row sums,
    ``dprobs_part[pid_c, r]``, which :func:`swiglu_dprobs_sum_kernel` adds in column order
    (deterministic; a program walking whole rows instead measured 2x slower: too few loads in
    flight). Outputs of R_OUT rows, as :func:`swiglu_backward_fp8_cast_kernel`'s."""
    scale, rows, cols = _delayed_tile_start(state_ptr, dequant_ptr, BLOCK_R, BLOCK_C)
    if WRITE_ROWS:
        dgate, dlinear, dprob = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h, stride_da, True)
        mask = (rows[:, None] < R) & (cols[None, :] < F)
        ptrs = out_ptr + rows[:, None] * (2 * F) + cols[None, :]
        _store_fp8(ptrs, dgate, scale, mask, FP8_MAX)
        _store_fp8(ptrs + F, dlinear, scale, mask, FP8_MAX)
        # the partial stored here, not after the transposed tile: holding it across that tile took
        # 0.72 -> 0.81 ms at M = 98304, F = 2048 (8 warps, H200)
        tl.store(dprobs_part_ptr + tl.program_id(1).to(tl.int64) * R + rows, tl.sum(dprob, axis=1), mask=rows < R)
        amax = tile_abs_max2(dgate, dlinear)
    if WRITE_T:
        dgate_t, dlinear_t, dprob_t = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h,
                                                        stride_da, False)
        mask_t = (cols[:, None] < F) & (rows[None, :] < R)
        ptrs_t = out_t_ptr + cols[:, None] * R_OUT + rows[None, :]
        _store_fp8(ptrs_t, dgate_t, scale, mask_t, FP8_MAX)
        _store_fp8(ptrs_t + F * R_OUT, dlinear_t, scale, mask_t, FP8_MAX)
        if not WRITE_ROWS:
            tl.store(dprobs_part_ptr + tl.program_id(1).to(tl.int64) * R + rows, tl.sum(dprob_t, axis=0),
                     mask=rows < R)
            amax = tile_abs_max2(dgate_t, dlinear_t)
    record_amax(state_ptr, ticket_ptr, amax, num_programs, FP8_MAX, MARGIN_FACTOR, HISTORY, MOST_RECENT, BLOCK_H)


@triton.jit
def swiglu_dprobs_sum_kernel(part_ptr, dprobs_ptr, R, num_parts, BLOCK: tl.constexpr):
    """``dprobs[r] = sum_c part[c, r]`` over the column tiles in order (fixed: deterministic)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < R
    acc = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, num_parts):
        acc += tl.load(part_ptr + c * R + rows, mask=ok, other=0.0)
    tl.store(dprobs_ptr + rows, acc.to(dprobs_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_block_cast_rows_kernel(
    h_ptr, probs_ptr, a_ptr, out_ptr, scale_ptr,
    R, F, stride_h, stride_sr, stride_sk,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (r, kb): ``a = silu(gate) * linear * probs`` (float32, in ``_weighted_swiglu_tile``'s order)
    for rows [r*BLOCK_R, ...) and the columns of block kb, from ``h = [gate | linear]`` ([R, 2F],
    unit column stride); stores ``a`` rounded to a's dtype, then casts those rounded values as
    ``blockwise_cast.block_cast_rows_kernel`` casts a stored ``a``: the rows copy is that of the ``a`` returned."""
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = kb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    a = _weighted_swiglu_tile(h_ptr, probs_ptr, rows, cols, R, F, stride_h, True)
    if a_ptr.dtype.element_ty != tl.float32:
        a = a.to(a_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch's .to() rounds
    tl.store(a_ptr + rows[:, None] * F + cols[None, :], a, mask=mask)
    x = a.to(tl.float32)
    quant, stored = _block_scales(_nan_max(tl.abs(x), 1), FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2)
    tl.store(scale_ptr + rows * stride_sr + kb * stride_sk, stored, mask=rows < R)
    q = _block_cast(x, quant[:, None], FP8_MAX, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * F + cols[None, :], q, mask=mask)


@triton.jit
def _store_block_rows(x_lp, out_ptr, scale_ptr, rows, cols, row_ok, col_ok, c0, first_block, width, stride_sr,
                      stride_sk, F, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr,
                      MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The 1xBLOCK rows copy of ``x_lp`` ([BLOCK_R, BLOCK_C] in the stored dtype, columns ``c0 +``
    of one half of a ``width``-wide tensor): cast from those rounded values as
    ``blockwise_cast.block_cast_rows_kernel`` casts a stored tensor; scales in blocks
    ``first_block + j`` (those inside the half's F columns)."""
    x3 = tl.reshape(x_lp.to(tl.float32), (BLOCK_R, BLOCK_C // BLOCK, BLOCK))
    quant, stored = _block_scales(_nan_max(tl.abs(x3), 2), FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2)
    q = tl.reshape(_block_cast(x3, quant[:, :, None], FP8_MAX, out_ptr.dtype.element_ty), (BLOCK_R, BLOCK_C))
    tl.store(out_ptr + rows[:, None] * width + cols[None, :], q, mask=row_ok[:, None] & col_ok[None, :])
    j = tl.arange(0, BLOCK_C // BLOCK)
    block_ok = c0 + j * BLOCK < F
    tl.store(scale_ptr + rows[:, None] * stride_sr + (first_block + j)[None, :] * stride_sk, stored,
             mask=row_ok[:, None] & block_ok[None, :])


@triton.jit
def swiglu_backward_block_rows_kernel(
    h_ptr, probs_ptr, da_ptr, dh_ptr, dprobs_ptr, q_ptr, scale_ptr, R, F, stride_h, stride_da, stride_sr, stride_sk,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr,
    POW2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``swiglu_backward_kernel``'s ``dh`` and ``dprobs`` (the same tiles and summation order), and
    ``dh``'s 1xBLOCK rows copy, the fine-grained recipes' dgrad operand for fc1, from the stored
    (rounded) ``dh``: F a multiple of BLOCK, so that no block straddles the gate and linear halves.
    On the H100 ``dh`` is bit for bit the other kernel's; ``dprobs`` (float32, no rounding to hide
    a last-bit difference in the products' code) was 1 ulp apart on about a third of the rows."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    dp = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, F, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < F
        dgate, dlinear, terms = _swiglu_grad_tile(h_ptr, probs_ptr, da_ptr, rows, cols, R, F, stride_h, stride_da, True)
        dp += tl.sum(terms, axis=1)
        mask = row_ok[:, None] & col_ok[None, :]
        dgate = dgate.to(dh_ptr.dtype.element_ty)
        dlinear = dlinear.to(dh_ptr.dtype.element_ty)
        out = dh_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(out, dgate, mask=mask)
        tl.store(out + F, dlinear, mask=mask)
        _store_block_rows(dgate, q_ptr, scale_ptr, rows, cols, row_ok, col_ok, c0, c0 // BLOCK, 2 * F, stride_sr,
                          stride_sk, F, FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2, BLOCK, BLOCK_R, BLOCK_C)
        _store_block_rows(dlinear, q_ptr + F, scale_ptr, rows, cols, row_ok, col_ok, c0, (F + c0) // BLOCK, 2 * F,
                          stride_sr, stride_sk, F, FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2, BLOCK, BLOCK_R,
                          BLOCK_C)
    tl.store(dprobs_ptr + rows, dp.to(dprobs_ptr.dtype.element_ty), mask=row_ok)


# Tiles: the amax and backward passes walk whole rows. The casts take 32 rows x 128 columns of `a`
# (or of each half of `dh`) per program: 11-12% faster than fp8_cast's 64 x 64 for both casts at
# M = 98304, F = 2048 on the H100 (0.48 / 0.77 ms against 0.54 / 0.88 forward / backward; 16-256
# rows x 32-256 columns and 2-8 warps swept, docs/results/h100_train_step_handoff.md).
_CAST_BLOCK_R, _CAST_BLOCK_C = 32, 128
_AMAX_BLOCK_R, _AMAX_BLOCK_C = 16, 128
_BWD_BLOCK_R, _BWD_BLOCK_C = 8, 128
# The FP8 backward's amax pass does the most math per byte (sigmoid, five products, the row sums):
# 8 warps took it from 0.54 to 0.42 ms (2.9 TB/s) at M = 98304, F = 2048 on the H100, where the
# other tiles/warps swept (16-64 rows x 64-256 columns, 4-8 warps) did no better; the forward
# passes and the casts were best as they are.
_BWD_AMAX_WARPS = 8


def _amax_partition(rows: int):
    """(programs, rows per program) of the amax pass: at most MAX_PARTIALS programs (the cast
    reduces every partial in one block), each a multiple of its row tile."""
    num = min(MAX_PARTIALS, _cdiv(rows, _AMAX_BLOCK_R))
    per = _cdiv(_cdiv(rows, num), _AMAX_BLOCK_R) * _AMAX_BLOCK_R
    return _cdiv(rows, per), per


def _partials_buffer(rows: int, device):
    """(programs, rows per program, buffer, dequant) of an amax pass over ``rows`` rows: one float32
    slot per program's partial, then the scale the cast pass stores (``dequant``, a 0-dim view)."""
    import torch

    num_partials, per = _amax_partition(rows)
    stats = torch.empty((num_partials + 1,), dtype=torch.float32, device=device)
    return num_partials, per, stats, stats[-1]


def _cast_key(fp8_dtype, fp8_max, margin, write_rows, write_transposed, num_partials, out, trans, dequant) -> tuple:
    """The cast launches' key facts beyond their inputs': recipe, layouts, partial count, alignments."""
    return (fp8_dtype, fp8_max, margin, write_rows, write_transposed, arg_fact(num_partials), out.data_ptr() % 16 == 0,
            trans is None or trans.data_ptr() % 16 == 0, dequant.data_ptr() % 16 == 0)


def _row_capacity(r: int, row_capacity) -> int:
    if row_capacity is None:
        return r
    if row_capacity < r:
        raise ValueError(f"row_capacity ({row_capacity}) must be at least h's row count ({r})")
    return row_capacity


def swiglu_fp8_tensorwise(h, probs, fp8_dtype, fp8_max: float, margin: int = 0, write_rows: bool = True,
                          write_transposed: bool = False, row_capacity=None, amax_partials=None):
    """Tensorwise FP8 of ``a = silu(h[:, :F]) * h[:, F:] * probs`` without materializing ``a``.

    ``h``: ``[M, 2F]`` with unit column stride (any row stride); ``probs``: ``[M]`` contiguous.
    Returns ``(rows [M, F] or None, transposed [F, M] or None, dequant)`` as
    ``fp8_cast.fp8_tensorwise_cast`` does for a materialized ``a``, with its ``row_capacity``
    (the copies views of capacity-row buffers; amax partition and grid the capacity's).
    ``amax_partials``: float32 ``[<= MAX_PARTIALS]`` whose maximum is ``max |a|``, already reduced
    (by fc1's epilogue, ``m_grouped_gemm_gluon``'s SWIGLU tiles): then only the cast pass runs.
    """
    import torch

    r, two_f = h.shape
    f = two_f // 2
    cap = _row_capacity(r, row_capacity)
    device = h.device
    rows = torch.empty((cap, f), dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty((f, cap), dtype=fp8_dtype, device=device) if write_transposed else None
    if r * f == 0:
        return _first_rows(rows, trans, r, cap) + (torch.ones((), dtype=torch.float32, device=device),)
    stride_h = h.stride(0)
    facts = (h.dtype, probs.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), arg_fact(cap))
    if amax_partials is None:
        num_partials, per, stats, dequant = _partials_buffer(cap, device)
        aligned = (h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, stats.data_ptr() % 16 == 0)
        _amax.launch_keyed((num_partials,), facts + aligned + (arg_fact(per),), h, probs, stats, r, f, stride_h, per,
                           BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C, num_warps=4)
    else:
        stats, num_partials = amax_partials, amax_partials.numel()
        dequant = torch.empty((), dtype=torch.float32, device=device)
        aligned = (h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, stats.data_ptr() % 16 == 0)
    out = rows if rows is not None else trans
    _cast.launch_keyed(
        (_cdiv(cap, _CAST_BLOCK_R), _cdiv(f, _CAST_BLOCK_C)),
        facts + aligned + _cast_key(fp8_dtype, fp8_max, margin, write_rows, write_transposed, num_partials, out, trans,
                                    dequant),
        h, probs, stats, num_partials, out, trans if trans is not None else out, dequant, r, f, stride_h, cap,
        FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, WRITE_ROWS=write_rows, WRITE_T=write_transposed,
        BLOCK_R=_CAST_BLOCK_R, BLOCK_C=_CAST_BLOCK_C, BLOCK_P=MAX_PARTIALS, num_warps=4,
    )
    return _first_rows(rows, trans, r, cap) + (dequant,)


def swiglu_backward(h, probs, da, dprobs_dtype):
    """``(dh [M, 2F] in h's dtype, dprobs [M] in dprobs_dtype)`` from ``da [M, F]`` (unit column
    strides; ``probs [M]`` contiguous)."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    dh = torch.empty((r, two_f), dtype=h.dtype, device=h.device)
    dprobs = torch.empty((r,), dtype=dprobs_dtype, device=h.device)
    if r == 0:
        return dh, dprobs
    if f == 0:
        return dh, dprobs.zero_()
    stride_h, stride_da = h.stride(0), da.stride(0)
    key = (h.dtype, probs.dtype, da.dtype, dprobs_dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h),
           arg_fact(stride_da), h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, da.data_ptr() % 16 == 0,
           dh.data_ptr() % 16 == 0, dprobs.data_ptr() % 16 == 0)
    _backward.launch_keyed((_cdiv(r, _BWD_BLOCK_R),), key, h, probs, da, dh, dprobs, r, f, stride_h, stride_da,
                           BLOCK_R=_BWD_BLOCK_R, BLOCK_C=_BWD_BLOCK_C, num_warps=4)
    return dh, dprobs


def swiglu_backward_fp8_tensorwise(h, probs, da, fp8_dtype, fp8_max: float, margin: int, dprobs_dtype,
                                   write_rows: bool = True, write_transposed: bool = False, row_capacity=None):
    """``(rows [M, 2F] or None, transposed [2F, M] or None, dequant, dprobs [M])``: the tensorwise
    FP8 layouts of ``dh`` (as ``fp8_cast.fp8_tensorwise_cast`` would make them from a float32
    ``dh``) and ``dprobs``, from ``da [M, F]`` without materializing ``dh`` (unit column strides;
    ``probs [M]`` contiguous). ``row_capacity``: as :func:`swiglu_fp8_tensorwise`'s (``dprobs``
    keeps M rows)."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    cap = _row_capacity(r, row_capacity)
    device = h.device
    rows = torch.empty((cap, two_f), dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty((two_f, cap), dtype=fp8_dtype, device=device) if write_transposed else None
    dprobs = torch.empty((r,), dtype=dprobs_dtype, device=device)
    if r * f == 0:
        return _first_rows(rows, trans, r, cap) + (torch.ones((), dtype=torch.float32, device=device), dprobs.zero_())
    num_partials, per, stats, dequant = _partials_buffer(cap, device)
    stride_h, stride_da = h.stride(0), da.stride(0)
    aligned = (h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, da.data_ptr() % 16 == 0,
               stats.data_ptr() % 16 == 0)
    facts = (h.dtype, probs.dtype, da.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), arg_fact(stride_da),
             arg_fact(cap))
    _backward_amax.launch_keyed(
        (num_partials,), facts + aligned + (dprobs_dtype, dprobs.data_ptr() % 16 == 0, arg_fact(per)),
        h, probs, da, dprobs, stats, r, f, stride_h, stride_da, per,
        BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C, num_warps=_BWD_AMAX_WARPS)
    out = rows if rows is not None else trans
    if out is None:  # dprobs only
        return rows, trans, torch.ones((), dtype=torch.float32, device=device), dprobs
    _backward_cast.launch_keyed(
        (_cdiv(cap, _CAST_BLOCK_R), _cdiv(f, _CAST_BLOCK_C)),
        facts + aligned + _cast_key(fp8_dtype, fp8_max, margin, write_rows, write_transposed, num_partials, out, trans,
                                    dequant),
        h, probs, da, stats, num_partials, out, trans if trans is not None else out, dequant, r, f, stride_h,
        stride_da, cap, FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, WRITE_ROWS=write_rows, WRITE_T=write_transposed,
        BLOCK_R=_CAST_BLOCK_R, BLOCK_C=_CAST_BLOCK_C, BLOCK_P=MAX_PARTIALS, num_warps=4,
    )
    return _first_rows(rows, trans, r, cap) + (dequant, dprobs)


# -- delayed scaling (amax_history): one pass each, the scale from the history ----------------------
# Rows per program of the dprobs sum.
_DPROBS_BLOCK = 1024
# The delayed dh kernel computes the whole backward tile and its amax and dprobs partial beside
# the casts: 8 warps (fewer registers per thread, more loads in flight) took it from 0.79 to 0.72
# ms at M = 98304, F = 2048 on the H200, where 4 warps suit the current cast pass (0.69 / 0.67 ms);
# two column tiles per program or split row/transposed programs were slower (1.2-2.2 ms).
_BWD_DELAYED_WARPS = 8


def _delayed_key(fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed, num_programs,
                 out, trans) -> tuple:
    return (fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed, arg_fact(num_programs),
            out.data_ptr() % 16 == 0, trans is None or trans.data_ptr() % 16 == 0)


def swiglu_fp8_delayed(h, probs, state, ticket, history_len: int, most_recent: bool, fp8_dtype, fp8_max: float,
                       margin: int = 0, write_rows: bool = True, write_transposed: bool = False, row_capacity=None):
    """:func:`swiglu_fp8_tensorwise` scaled from the amax history ``state`` / ``ticket``
    (``amax_history``), in one launch that records ``max|a|``; nothing is recorded for an empty
    ``a``. ``row_capacity``: as :func:`swiglu_fp8_tensorwise`'s."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    cap = _row_capacity(r, row_capacity)
    device = h.device
    rows = torch.empty((cap, f), dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty((f, cap), dtype=fp8_dtype, device=device) if write_transposed else None
    dequant = torch.empty((), dtype=torch.float32, device=device)
    out = rows if rows is not None else trans
    if r * f == 0 or out is None:
        return _first_rows(rows, trans, r, cap) + (dequant.fill_(1.0),)
    grid = (_cdiv(cap, _CAST_BLOCK_R), _cdiv(f, _CAST_BLOCK_C))
    num_programs = grid[0] * grid[1]
    stride_h = h.stride(0)
    key = (h.dtype, probs.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), arg_fact(cap), h.data_ptr() % 16 == 0,
           probs.data_ptr() % 16 == 0) + _delayed_key(fp8_dtype, fp8_max, margin, history_len, most_recent,
                                                       write_rows, write_transposed, num_programs, out, trans)
    _cast_delayed.launch_keyed(
        grid, key, h, probs, state, ticket, num_programs, out, trans if trans is not None else out, dequant,
        r, f, stride_h, cap, FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, HISTORY=history_len,
        MOST_RECENT=most_recent,
        WRITE_ROWS=write_rows, WRITE_T=write_transposed, BLOCK_R=_CAST_BLOCK_R, BLOCK_C=_CAST_BLOCK_C,
        BLOCK_H=history_block(history_len), num_warps=4,
    )
    return _first_rows(rows, trans, r, cap) + (dequant,)


def swiglu_backward_fp8_delayed(h, probs, da, state, ticket, history_len: int, most_recent: bool, fp8_dtype,
                                fp8_max: float, margin: int, dprobs_dtype, write_rows: bool = True,
                                write_transposed: bool = False, row_capacity=None):
    """:func:`swiglu_backward_fp8_tensorwise` scaled from the amax history ``state`` / ``ticket``:
    ``(rows, transposed, dequant, dprobs)``; one pass over ``h`` and ``da`` that records
    ``max|dh|``, then a small launch adding ``dprobs``' per-tile partials. ``row_capacity``: as
    :func:`swiglu_fp8_tensorwise`'s (``dprobs`` keeps M rows)."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    cap = _row_capacity(r, row_capacity)
    device = h.device
    rows = torch.empty((cap, two_f), dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty((two_f, cap), dtype=fp8_dtype, device=device) if write_transposed else None
    out = rows if rows is not None else trans
    if r * f == 0 or out is None:  # nothing to cast: dprobs alone, from the backward kernel
        dprobs = swiglu_backward(h, probs, da, dprobs_dtype)[1] if r * f else \
            torch.zeros((r,), dtype=dprobs_dtype, device=device)
        return _first_rows(rows, trans, r, cap) + (torch.ones((), dtype=torch.float32, device=device), dprobs)
    grid = (_cdiv(cap, _CAST_BLOCK_R), _cdiv(f, _CAST_BLOCK_C))
    num_programs = grid[0] * grid[1]
    # dprobs' partials and the dequantization scale share one allocation (the scale last)
    stats = torch.empty((grid[1] * r + 1,), dtype=torch.float32, device=device)
    part, dequant = stats[:-1], stats[-1]
    dprobs = torch.empty((r,), dtype=dprobs_dtype, device=device)
    stride_h, stride_da = h.stride(0), da.stride(0)
    key = (h.dtype, probs.dtype, da.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), arg_fact(stride_da),
           arg_fact(cap), h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, da.data_ptr() % 16 == 0,
           stats.data_ptr() % 16 == 0, dequant.data_ptr() % 16 == 0) + _delayed_key(
        fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed, num_programs, out, trans)
    _backward_delayed.launch_keyed(
        grid, key, h, probs, da, part, state, ticket, num_programs, out, trans if trans is not None else out, dequant,
        r, f, stride_h, stride_da, cap,
        FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, HISTORY=history_len, MOST_RECENT=most_recent,
        WRITE_ROWS=write_rows, WRITE_T=write_transposed, BLOCK_R=_CAST_BLOCK_R, BLOCK_C=_CAST_BLOCK_C,
        BLOCK_H=history_block(history_len), num_warps=_BWD_DELAYED_WARPS,
    )
    _dprobs_sum.launch_keyed(
        (_cdiv(r, _DPROBS_BLOCK),), (dprobs_dtype, arg_fact(r), arg_fact(grid[1]), stats.data_ptr() % 16 == 0,
                                     dprobs.data_ptr() % 16 == 0),
        part, dprobs, r, grid[1], BLOCK=_DPROBS_BLOCK, num_warps=4)
    return _first_rows(rows, trans, r, cap) + (dequant, dprobs)


def swiglu_amax(h, probs):
    """0-dim float32 ``max|a|`` (NaN if any is NaN): the amax pass alone (a delayed history's seed)."""
    r, two_f = h.shape
    f = two_f // 2
    if r * f == 0:
        import torch
        return torch.zeros((), dtype=torch.float32, device=h.device)
    num_partials, per, stats, _ = _partials_buffer(r, h.device)
    stride_h = h.stride(0)
    key = (h.dtype, probs.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), h.data_ptr() % 16 == 0,
           probs.data_ptr() % 16 == 0, stats.data_ptr() % 16 == 0, arg_fact(per))
    _amax.launch_keyed((num_partials,), key, h, probs, stats, r, f, stride_h, per,
                       BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C, num_warps=4)
    return stats[:num_partials].max()  # torch's max keeps NaN


def swiglu_amax_partials(h, probs):
    """float32 ``[programs]`` whose maximum is ``max|a|``: the amax pass alone, its partials for
    :func:`swiglu_fp8_tensorwise`'s ``amax_partials`` (where fc1's GEMM did not reduce them)."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    if r * f == 0:
        return torch.zeros((1,), dtype=torch.float32, device=h.device)
    num_partials, per = _amax_partition(r)
    stats = torch.empty((num_partials,), dtype=torch.float32, device=h.device)
    stride_h = h.stride(0)
    key = (h.dtype, probs.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), h.data_ptr() % 16 == 0,
           probs.data_ptr() % 16 == 0, stats.data_ptr() % 16 == 0, arg_fact(per))
    _amax.launch_keyed((num_partials,), key, h, probs, stats, r, f, stride_h, per,
                       BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C, num_warps=4)
    return stats


def swiglu_backward_dh_amax(h, probs, da):
    """0-dim float32 ``max|dh|`` (NaN if any is NaN): the backward amax pass alone (a seed)."""
    import torch

    r, two_f = h.shape
    f = two_f // 2
    if r * f == 0:
        return torch.zeros((), dtype=torch.float32, device=h.device)
    num_partials, per, stats, _ = _partials_buffer(r, h.device)
    dprobs = torch.empty((r,), dtype=torch.float32, device=h.device)
    stride_h, stride_da = h.stride(0), da.stride(0)
    key = (h.dtype, probs.dtype, da.dtype, arg_fact(r), arg_fact(f), arg_fact(stride_h), arg_fact(stride_da),
           h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0, da.data_ptr() % 16 == 0, stats.data_ptr() % 16 == 0,
           torch.float32, True, arg_fact(per))
    _backward_amax.launch_keyed((num_partials,), key, h, probs, da, dprobs, stats, r, f, stride_h, stride_da, per,
                                BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C, num_warps=_BWD_AMAX_WARPS)
    return stats[:num_partials].max()


def swiglu_block_cast_rows(h, probs, recipe, fp8_dtype, fp8_max: float, emax: int, margin: int = 0):
    """``turbo_moe.fine_grained.quantize.quantize_swiglu_rows`` on the device: one launch,
    ``(a [M, F] in h's dtype, FP8 rows copy of a, its scales)``."""
    import torch

    _check_fp8_max(fp8_max, emax)
    r, f = h.shape[0], h.shape[1] // 2
    nb = _cdiv(f, recipe.block)
    a = torch.empty((r, f), dtype=h.dtype, device=h.device)
    out = torch.empty((r, f), dtype=fp8_dtype, device=h.device)
    storage = torch.empty((nb, r), dtype=recipe.scale_dtype, device=h.device)
    scale = storage.T  # [R, nb] view of block-major storage, as block_cast_rows returns
    if r * nb:
        block_r = 32 if recipe.block == 128 else 128
        key = (h.dtype, probs.dtype, r, f, h.stride(0), fp8_dtype, recipe, margin, h.data_ptr() % 16 == 0,
               probs.data_ptr() % 16 == 0, a.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
               storage.data_ptr() % 16 == 0)
        _block_rows.launch_keyed(
            (_cdiv(r, block_r), nb), key,
            h, probs, a, out, scale, r, f, h.stride(0), scale.stride(0), scale.stride(1),
            FP8_MAX=fp8_max, EMAX=emax, MARGIN=margin, MARGIN_FACTOR=2.0 ** -margin, E8M0=recipe.e8m0,
            POW2=recipe.pow2, BLOCK=recipe.block, BLOCK_R=block_r, num_warps=4,
        )
    return a, out, scale


def swiglu_backward_block_rows(h, probs, da, dprobs_dtype, recipe, fp8_dtype, fp8_max: float, emax: int,
                               margin: int = 0):
    """``swiglu_backward``'s ``(dh, dprobs)`` and ``dh``'s rows copy in 1xB blocks (B =
    ``recipe.block``, which must divide F): ``(dh, dprobs, fp8 [M, 2F], scales [M, 2F / B] as a view
    of block-major storage)``, the copy bit for bit ``block_cast_rows(dh)``. One launch."""
    import torch

    _check_fp8_max(fp8_max, emax)
    r, two_f = h.shape
    f = two_f // 2
    if f % recipe.block:
        raise ValueError(f"swiglu_backward_block_rows needs F (h.shape[1] / 2 = {f}) a multiple of the recipe's "
                         f"block ({recipe.block})")
    dh = torch.empty((r, two_f), dtype=h.dtype, device=h.device)
    dprobs = torch.empty((r,), dtype=dprobs_dtype, device=h.device)
    q = torch.empty((r, two_f), dtype=fp8_dtype, device=h.device)
    storage = torch.empty((two_f // recipe.block, r), dtype=recipe.scale_dtype, device=h.device)
    scale = storage.T
    if r == 0:
        return dh, dprobs, q, scale
    if f == 0:
        return dh, dprobs.zero_(), q, scale
    stride_h, stride_da = h.stride(0), da.stride(0)
    key = (h.dtype, probs.dtype, da.dtype, dprobs_dtype, fp8_dtype, recipe, margin, arg_fact(r), arg_fact(f),
           arg_fact(stride_h), arg_fact(stride_da), h.data_ptr() % 16 == 0, probs.data_ptr() % 16 == 0,
           da.data_ptr() % 16 == 0, dh.data_ptr() % 16 == 0, dprobs.data_ptr() % 16 == 0, q.data_ptr() % 16 == 0,
           storage.data_ptr() % 16 == 0)
    _backward_rows.launch_keyed((_cdiv(r, _BWD_BLOCK_R),), key, h, probs, da, dh, dprobs, q, scale, r, f, stride_h,
                                stride_da, scale.stride(0), scale.stride(1), FP8_MAX=fp8_max, EMAX=emax, MARGIN=margin,
                                MARGIN_FACTOR=2.0 ** -margin, E8M0=recipe.e8m0, POW2=recipe.pow2, BLOCK=recipe.block,
                                BLOCK_R=_BWD_BLOCK_R, BLOCK_C=_BWD_BLOCK_C, num_warps=4)
    return dh, dprobs, q, scale


# Host-lean launchers of the kernels above (kernels/triton/launch.py).
(_amax, _cast, _backward, _backward_amax, _backward_cast, _cast_delayed, _backward_delayed, _dprobs_sum, _block_rows,
 _backward_rows) = (
    lean(k) for k in (swiglu_amax_partials_kernel, swiglu_fp8_cast_kernel, swiglu_backward_kernel,
                      swiglu_backward_amax_kernel, swiglu_backward_fp8_cast_kernel, swiglu_fp8_cast_delayed_kernel,
                      swiglu_backward_fp8_delayed_kernel, swiglu_dprobs_sum_kernel, swiglu_block_cast_rows_kernel,
                      swiglu_backward_block_rows_kernel))
