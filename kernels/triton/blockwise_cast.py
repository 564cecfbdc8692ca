"""Fused blockwise / MXFP8 quantization: per-block amax, scale and cast in one launch, no host sync.

Bit-for-bit ``turbo_moe.fine_grained.quantize`` (its torch ops define the semantics): blockwise
scales are ``fp8_max / amax`` (``fp8_cast._quant_scales``), optionally floored to a power of two;
MXFP8 exponents come from the amax's float32 bits (``_block_scales`` below). Three kernels:

* ``block_cast_rows_kernel``: 1xB blocks along the last dim of ``x [B, R, C]`` (any strides) ->
  contiguous FP8 and block-major scales (activations, gradients, MXFP8 weights both ways);
* ``block_cast_weight_kernel``: 128x128 blocks of ``w [G, N, K]`` -> FP8 ``[G, N, K]`` and its
  transpose ``[G, K, N]`` from one read (they share the scales);
* ``block_cast_tokens_kernel``: the wgrad operand: ``x [M, C]`` in blocks of B tokens restarting
  at each group's first token -> token-contiguous ``[C, M]`` FP8 and slot-major scales. Offsets
  are read on the device; empty groups write nothing; ragged groups get a short last block.
Each program owns whole blocks, so it finds their amax and casts them: no second pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_cast import _quant_scales, clamp_keep_nan
from .launch import lean


def _cdiv(a: int, b: int) -> int:
    # Host-side grid math in plain Python: triton.cdiv is a constexpr_function in Triton >= 3.5,
    # whose call wrapper costs microseconds, several times per fwd+bwd.
    return -(-a // b)


@triton.jit
def _nan_max(x, axis: tl.constexpr):
    """max over ``axis`` of x (>= 0), NaN if any element is NaN (tl.max drops NaN; torch keeps it)."""
    m = tl.max(x, axis=axis)
    return tl.where(tl.sum((x != x).to(tl.int32), axis=axis) > 0, float("nan"), m)


@triton.jit
def _block_scales(amax, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr,
                  MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr):
    """(float32 quantization scale, stored scale) of blocks with these amaxes; see
    turbo_moe.fine_grained.quantize.block_scales (the same float32 / integer steps)."""
    if E8M0:
        bits = amax.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # mantissa above fp8_max's 1.75
        x = biased - 127 - EMAX + above + MARGIN
        x = tl.minimum(tl.maximum(x, -126), 126)
        x = tl.where(amax == 0, 0, x)
        quant = ((127 - x) << 23).to(tl.float32, bitcast=True)
        nonfinite = biased == 255
        quant = tl.where(nonfinite, float("nan"), quant)
        stored = tl.where(nonfinite, 255, x + 127).to(tl.uint8)
    else:
        quant, stored = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
        if POW2:
            floored = (quant.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            quant = tl.where(quant != quant, quant, floored)
            stored = tl.math.div_rn(tl.full(quant.shape, 1.0, tl.float32), quant)
    return quant, stored


@triton.jit
def _cast(x, quant, FP8_MAX: tl.constexpr, dtype: tl.constexpr):
    return clamp_keep_nan(x * quant, FP8_MAX).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def block_cast_rows_kernel(
    x_ptr, out_ptr, scale_ptr,
    R, C, stride_xb, stride_xr, stride_xc, stride_sb, stride_sr, stride_sk,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (r, kb, b): rows [r*BLOCK_R, ...) of batch b, columns of block kb."""
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = kb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + batch * stride_xb + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    quant, stored = _block_scales(_nan_max(tl.abs(x), 1), FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2)
    tl.store(scale_ptr + batch * stride_sb + rows * stride_sr + kb * stride_sk, stored, mask=rows < R)
    q = _cast(x, quant[:, None], FP8_MAX, out_ptr.dtype.element_ty)
    tl.store(out_ptr + batch * R * C + rows[:, None] * C + cols[None, :], q, mask=mask)


@triton.jit
def block_cast_weight_kernel(
    w_ptr, out_ptr, out_t_ptr, scale_ptr,
    N, K, stride_wg, stride_wn, stride_wk, stride_sg, stride_sn, stride_sk,
    FP8_MAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr, POW2: tl.constexpr, WRITE_T: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (nb, kb, g): the BLOCK x BLOCK block (nb, kb) of w[g]; writes both layouts."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    group = tl.program_id(2).to(tl.int64)
    rows = nb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = kb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + group * stride_wg + rows[:, None] * stride_wn + cols[None, :] * stride_wk,
                mask=mask, other=0.0).to(tl.float32)
    amax = _nan_max(_nan_max(tl.abs(w), 1), 0)
    quant, stored = _block_scales(amax, FP8_MAX, 0, MARGIN, MARGIN_FACTOR, False, POW2)
    tl.store(scale_ptr + group * stride_sg + nb * stride_sn + kb * stride_sk, stored)
    q = _cast(w, quant, FP8_MAX, out_ptr.dtype.element_ty)
    tl.store(out_ptr + group * N * K + rows[:, None] * K + cols[None, :], q, mask=mask)
    if WRITE_T:  # from its own transposed load of the block (fp8_cast's module docstring)
        mask_t = (cols[:, None] < K) & (rows[None, :] < N)
        w_t = tl.load(w_ptr + group * stride_wg + cols[:, None] * stride_wk + rows[None, :] * stride_wn,
                      mask=mask_t, other=0.0).to(tl.float32)
        tl.store(out_t_ptr + group * N * K + cols[:, None] * N + rows[None, :],
                 _cast(w_t, quant, FP8_MAX, out_t_ptr.dtype.element_ty), mask=mask_t)


@triton.jit
def _aligned_group_start(group_offs_ptr, group, TOKEN_ALIGN: tl.constexpr):
    """Column of group ``group``'s first token in an aligned token layout: the token counts of the
    groups before it, each rounded up to TOKEN_ALIGN (a prefix sum over at most G offsets, read by
    every program of the group: no second launch, no host sync)."""
    padded = tl.zeros([128], dtype=tl.int64)
    for h0 in range(0, group, 128):
        h = h0 + tl.arange(0, 128)
        here = h < group
        n = tl.load(group_offs_ptr + h + 1, mask=here, other=0) - tl.load(group_offs_ptr + h, mask=here, other=0)
        padded += (tl.maximum(n, 0) + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN
    return tl.sum(padded, axis=0)


@triton.jit
def _slot_groups(group_offs_ptr, G, slots_v, BLOCK: tl.constexpr, TOKEN_ALIGN: tl.constexpr):
    """For a vector of scale slots: (the count of groups whose slots begin at or before each, and
    TOKEN_ALIGN > 1: the aligned first column of the last such group). Group g's slots begin at
    ``start_g // BLOCK + g``, strictly increasing in g for valid offsets, so a slot belongs to
    group count - 1 (-1 at most for invalid offsets), and as the aligned starts never decrease
    whatever the offsets, that group's start is the largest start among them. One pass over the
    offsets, as vectors of 128, for all the slots at once."""
    count = tl.zeros(slots_v.shape, tl.int32)
    start_v = tl.zeros(slots_v.shape, tl.int64)
    carry = tl.full((), 0, tl.int64)  # int64 from the start: the loop adds int64 sums to it
    for h0 in range(0, G, 128):
        h = h0 + tl.arange(0, 128)
        here = h < G
        lo_h = tl.load(group_offs_ptr + h, mask=here, other=0).to(tl.int64)
        if TOKEN_ALIGN > 1:
            hi_h = tl.load(group_offs_ptr + h + 1, mask=here, other=0).to(tl.int64)
            padded = (tl.maximum(hi_h - lo_h, 0) + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN
            start_h = carry + tl.cumsum(padded, 0) - padded
            carry += tl.sum(padded, 0)
        else:
            start_h = lo_h
        begun = here[:, None] & ((start_h // BLOCK + h)[:, None] <= slots_v[None, :])
        count += tl.sum(begun.to(tl.int32), 0)
        if TOKEN_ALIGN > 1:
            start_v = tl.maximum(start_v, tl.max(tl.where(begun, start_h[:, None], 0), 0))
    return count, start_v


@triton.jit
def _cast_token_block(x_ptr, out_t_ptr, scale_ptr, t0, lo, hi, start, end, slot, slots, col0, C,
                      stride_xm, stride_xc, stride_ss, stride_sc, cols_t,
                      FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr,
                      E8M0: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                      TOKEN_ALIGN: tl.constexpr, WIDE: tl.constexpr, TRANS_REGS: tl.constexpr = False):
    """Tokens [t0, t0 + BLOCK) of the group [lo, hi), columns [col0, col0 + BLOCK_C): their scales
    into ``slot``, their FP8 values transposed into columns from ``start + t0 - lo`` (below ``end``).
    Addresses are a block's int64 base plus offsets within the block, int32 unless WIDE (the host's
    choice: a block's offsets past 2**31), which halves the registers the two tiles' addresses take.
    TRANS_REGS: the cast transposes the loaded tile (``tl.trans``, through shared memory) instead of
    reading the block again in the transposed order (the same values: masked elements are 0 both ways)."""
    if WIDE:
        r = tl.arange(0, BLOCK).to(tl.int64)
        c = tl.arange(0, BLOCK_C).to(tl.int64)
    else:
        r = tl.arange(0, BLOCK)
        c = tl.arange(0, BLOCK_C)
    t0 = tl.cast(t0, tl.int64)  # a Python int under the interpreter's range()
    x_blk = x_ptr + t0 * stride_xm + col0 * stride_xc
    row_ok = r < hi - t0
    col_ok = c < C - col0
    x = tl.load(x_blk + r[:, None] * stride_xm + c[None, :] * stride_xc, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    quant, stored = _block_scales(_nan_max(tl.abs(x.to(tl.float32)), 0), FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2)
    # in bounds whatever the offsets, as the offsets the kernel writes (the slot test broadcast to a
    # vector: the interpreter takes no scalar mask)
    slot_ok = (c * 0 + slot) < slots
    tl.store(scale_ptr + slot * stride_ss + col0 * stride_sc + c * stride_sc, stored, mask=col_ok & slot_ok)
    # the cast reads the block again, transposed (fp8_cast's module docstring; here casting the
    # first load through transposed store addresses measured 1-4% slower, H100)
    if TRANS_REGS:
        x_t = tl.trans(x)
    else:
        x_t = tl.load(x_blk + r[None, :] * stride_xm + c[:, None] * stride_xc, mask=col_ok[:, None] & row_ok[None, :],
                      other=0.0)
    q_t = _cast(x_t.to(tl.float32), quant[:, None], FP8_MAX, out_t_ptr.dtype.element_ty)
    # aligned: the group's padding (tokens past hi) written as the zeros x_t holds there
    dest0 = start + (t0 - lo)
    room = tl.minimum(end, cols_t) - dest0
    if TOKEN_ALIGN % 16 == 0:
        # dest0, end and cols_t are multiples of 16 here (whatever the offsets): said so, the
        # stores become 16-byte vectors instead of single bytes (Triton cannot know a runtime
        # scalar's divisibility, nor a mask's constancy along the tokens)
        dest0 = dest0 // 16 * 16
        keep = col_ok[:, None] & ((r // 16)[None, :] < room // 16)
    else:
        keep = col_ok[:, None] & (r[None, :] < room)
    tl.store(out_t_ptr + col0 * cols_t + dest0 + c[:, None] * cols_t + r[None, :], q_t, mask=keep)


@triton.jit
def _group_end(start, lo, hi, TOKEN_ALIGN: tl.constexpr):
    return start + (tl.maximum(hi - lo, 0) + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN


@triton.jit
def block_cast_tokens_kernel(
    x_ptr, group_offs_ptr, out_t_ptr, scale_ptr, aligned_offs_ptr,
    M, C, G, stride_xm, stride_xc, stride_ss, stride_sc, cols_t, slots,
    FP8_MAX: tl.constexpr, EMAX: tl.constexpr, MARGIN: tl.constexpr, MARGIN_FACTOR: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, TOKEN_ALIGN: tl.constexpr, WRITE_OFFS: tl.constexpr,
    FLAT: tl.constexpr = 0, WIDE: tl.constexpr = True, COL_TILES: tl.constexpr = 1, TRANS_REGS: tl.constexpr = False,
):
    """Program (c, g, k) of a (C / BLOCK_C, G, S) grid: columns [c*BLOCK_C, ...) of group g's
    token blocks k, k + S, k + 2S, ... (block j: BLOCK tokens from the group's token j*BLOCK).
    S splits a group's blocks over programs, so that one long group (a skewed router) is not one
    program's serial loop while the rest of the GPU idles; S is the host's choice
    (``_token_splits``), the bits do not depend on it. FLAT > 0 (a power of two): a
    (slots / FLAT, C / BLOCK_C) grid instead, program (p, c) casting the blocks whose scales go in
    slots [p * FLAT, (p + 1) * FLAT), each finding its group from the offsets (``_slot_groups``):
    every program has at most FLAT blocks whatever the routing.
    COL_TILES (FLAT only): each program casts COL_TILES column tiles of BLOCK_C (its search for the
    groups done once for all of them).

    TOKEN_ALIGN 1: token t at column t of ``out_t`` ([C, cols_t]), block j's scales in slot
    offs[g] // BLOCK + g + j. TOKEN_ALIGN > 1: group g starts at column ``start =
    _aligned_group_start`` and runs to ``end = start + round_up(len, TOKEN_ALIGN)``, the columns
    past its tokens written as zeros, its scales in slot start // BLOCK + g + j; with WRITE_OFFS
    program (0, g, 0) (FLAT: the program (p, 0) whose slots hold g) stores ``aligned_offs[g + 1] =
    min(end, cols_t)`` (and group 0's the 0 first): every group's, whatever the offsets."""
    if FLAT > 0:
        pid_c = tl.program_id(1)
        col0 = pid_c.to(tl.int64) * (BLOCK_C * COL_TILES)
        slot0 = tl.program_id(0).to(tl.int64) * FLAT
        if WRITE_OFFS:
            if pid_c == 0:
                for g in range(slot0, tl.minimum(slot0 + FLAT, G)):
                    g_start = _aligned_group_start(group_offs_ptr, g, TOKEN_ALIGN)
                    g_end = _group_end(g_start, tl.load(group_offs_ptr + g), tl.load(group_offs_ptr + g + 1), TOKEN_ALIGN)
                    tl.store(aligned_offs_ptr + g + 1, tl.minimum(g_end, cols_t))
                    if g == 0:
                        tl.store(aligned_offs_ptr, g_start)
        js = tl.arange(0, FLAT)
        count, start_v = _slot_groups(group_offs_ptr, G, slot0 + js, BLOCK, TOKEN_ALIGN)
        for j in tl.static_range(FLAT):
            picked = js == j
            slot = slot0 + j
            group = tl.maximum(tl.sum(tl.where(picked, count, 0), 0) - 1, 0)
            lo = tl.load(group_offs_ptr + group)
            hi = tl.load(group_offs_ptr + group + 1)
            if TOKEN_ALIGN > 1:
                start = tl.sum(tl.where(picked, start_v, 0), 0)
                end = _group_end(start, lo, hi, TOKEN_ALIGN)
            else:
                start = lo
                end = hi
            pid_k = slot - (start // BLOCK + group)
            first = lo + pid_k * BLOCK
            if (pid_k >= 0) & (first < hi):  # none in a group's unused last slot, or for invalid offsets
                for ct in tl.static_range(COL_TILES):
                    _cast_token_block(x_ptr, out_t_ptr, scale_ptr, first, lo, hi, start, end, slot, slots,
                                      col0 + ct * BLOCK_C, C, stride_xm, stride_xc, stride_ss, stride_sc, cols_t,
                                      FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2, BLOCK, BLOCK_C, TOKEN_ALIGN,
                                      WIDE, TRANS_REGS)
    else:
        pid_c = tl.program_id(0)
        group = tl.program_id(1)
        pid_k = tl.program_id(2)
        col0 = pid_c.to(tl.int64) * BLOCK_C
        lo = tl.load(group_offs_ptr + group)
        hi = tl.load(group_offs_ptr + group + 1)
        if TOKEN_ALIGN > 1:
            start = _aligned_group_start(group_offs_ptr, group, TOKEN_ALIGN)
            end = _group_end(start, lo, hi, TOKEN_ALIGN)
            if WRITE_OFFS:
                if (pid_c == 0) & (pid_k == 0):  # within the columns whatever the offsets (the layer's are checked and clamped)
                    tl.store(aligned_offs_ptr + group + 1, tl.minimum(end, cols_t))
                    if group == 0:
                        tl.store(aligned_offs_ptr, start)
        else:
            start = lo
            end = hi
        slot = start // BLOCK + group + pid_k
        step = BLOCK * tl.num_programs(2)
        for t0 in range(lo + pid_k * BLOCK, hi, step):
            _cast_token_block(x_ptr, out_t_ptr, scale_ptr, t0, lo, hi, start, end, slot, slots, col0, C,
                              stride_xm, stride_xc, stride_ss, stride_sc, cols_t,
                              FP8_MAX, EMAX, MARGIN, MARGIN_FACTOR, E8M0, POW2, BLOCK, BLOCK_C, TOKEN_ALIGN, WIDE,
                              TRANS_REGS)
            slot += step // BLOCK


def _check_fp8_max(fp8_max: float, emax: int) -> None:
    # The e8m0 exponent test (mantissa > 1.75) holds for formats whose max is 1.75 * 2**emax.
    assert fp8_max == 1.75 * 2.0 ** emax, (fp8_max, emax)


def block_cast_rows(x, recipe, fp8_dtype, fp8_max: float, emax: int, margin: int = 0):
    """``turbo_moe.fine_grained.quantize.quantize_rows`` on the device: one launch."""
    import torch

    _check_fp8_max(fp8_max, emax)
    x3, squeeze = (x[None], True) if x.dim() == 2 else (x, False)
    batches, r, c = x3.shape
    nb = _cdiv(c, recipe.block)
    out = torch.empty((batches, r, c), dtype=fp8_dtype, device=x.device)
    storage = torch.empty((batches, nb, r), dtype=recipe.scale_dtype, device=x.device)
    scale = storage.transpose(1, 2)  # [B, R, nb] view of block-major storage
    if batches * r * nb:
        block_r = 32 if recipe.block == 128 else 128
        strides = x3.stride()
        key = (x.dtype, batches, r, c, strides, fp8_dtype, recipe, margin, x.data_ptr() % 16 == 0,
               out.data_ptr() % 16 == 0, scale.data_ptr() % 16 == 0)
        _lean["block_cast_rows_kernel"].launch_keyed(
            (_cdiv(r, block_r), nb, batches), key,
            x3, out, scale, r, c, strides[0], strides[1], strides[2], scale.stride(0), scale.stride(1),
            scale.stride(2), FP8_MAX=fp8_max, EMAX=emax, MARGIN=margin, MARGIN_FACTOR=2.0 ** -margin, E8M0=recipe.e8m0, POW2=recipe.pow2,
            BLOCK=recipe.block, BLOCK_R=block_r, num_warps=4,
        )
    return (out[0], scale[0]) if squeeze else (out, scale)


def block_cast_weight(w, recipe, fp8_dtype, fp8_max: float, margin: int = 0, transposed: bool = True):
    """``turbo_moe.fine_grained.quantize.quantize_weight_blocks`` on the device: one launch."""
    import torch

    g, n, k = w.shape
    b = recipe.block
    out = torch.empty((g, n, k), dtype=fp8_dtype, device=w.device)
    out_t = torch.empty((g, k, n), dtype=fp8_dtype, device=w.device) if transposed else None
    scale = torch.empty((g, _cdiv(n, b), _cdiv(k, b)), dtype=torch.float32, device=w.device)
    if scale.numel():
        strides = w.stride()
        key = (w.dtype, g, n, k, strides, fp8_dtype, recipe, margin, transposed, w.data_ptr() % 16 == 0,
               out.data_ptr() % 16 == 0, out_t is None or out_t.data_ptr() % 16 == 0, scale.data_ptr() % 16 == 0)
        _lean["block_cast_weight_kernel"].launch_keyed(
            (scale.shape[1], scale.shape[2], g), key,
            w, out, out_t if transposed else out, scale, n, k, strides[0], strides[1], strides[2],
            scale.stride(0), scale.stride(1), scale.stride(2), FP8_MAX=fp8_max, MARGIN=margin, MARGIN_FACTOR=2.0 ** -margin, POW2=recipe.pow2,
            WRITE_T=transposed, BLOCK=b, num_warps=8,
        )
    return out, out_t, scale


def block_cast_tokens(x, group_offs, recipe, fp8_dtype, fp8_max: float, emax: int, margin: int = 0):
    """``turbo_moe.fine_grained.quantize.quantize_tokens`` on the device: one launch."""
    out_t, scale, _ = _cast_tokens(x, group_offs, recipe, fp8_dtype, fp8_max, emax, margin, 1, x.shape[0], None)
    return out_t, scale


def block_cast_tokens_aligned(x, group_offs, recipe, fp8_dtype, fp8_max: float, emax: int, margin: int,
                              token_align: int, columns: int, aligned_offs=None):
    """``turbo_moe.fine_grained.quantize.quantize_tokens_aligned`` on the device: one launch, into
    ``[C, columns]`` (room for every group rounded up to ``token_align``). ``aligned_offs``: the
    offsets an earlier call over the same ``group_offs`` returned (not written again), or None for
    a new tensor."""
    return _cast_tokens(x, group_offs, recipe, fp8_dtype, fp8_max, emax, margin, token_align, columns, aligned_offs)


# block_cast_tokens_kernel's tile per token block (128: blockwise, 32: MXFP8): (BLOCK_C, num_warps),
# the column tiles a flat-grid program casts (its group search done once for all of them), and
# whether the transposed tile comes from registers (tl.trans, through shared memory) instead of a
# second, transposed read of the block. scripts/probe_token_cast.py, H100, 2026-11-27, ms at
# 64 x 1536 tokens C 1024 / C 4096 / 32 x 512 tokens C 7168, balanced (Zipf alike, same bits):
# - blockwise: (32, 4), 1 tile, read twice (the default until then) 0.199 / 0.767 / ~0.22;
#   (64, 4) from registers 0.178 / 0.683 / 0.213; two such tiles a program 0.159 / 0.605 / 0.189;
#   (64, 2) 0.167 / 0.615 / 0.204; (128, 4) 0.193; 8 warps 1.3-2x slower;
#   four tiles of (64, 4) 0.197, of (64, 2) 0.536;
# - MXFP8: (32, 4) read twice (the default until then) 0.488 / 1.946 / -; (64, 4) 0.34-0.36 /
#   1.23-1.41 / 0.37-0.42 every way; (64, 2) from registers
#   0.187 / 0.721 / 0.219 (32-token blocks: 4 warps on a 32 x 64 tile idle half their lanes), two
#   such tiles a program 0.159 / 0.607 / 0.185, four 0.161, (128, 2) 0.171.
# The rows cast of the same tensors: 0.113 / 0.441 ms.
_TOKEN_TILE = {128: (64, 4), 32: (64, 2)}
_TOKEN_COL_TILES = {128: 2, 32: 2}
_TOKEN_TRANS_REGS = True
# ptxas's register cap for that tile on NVIDIA (None: its own choice). The blockwise tile's
# specialization without WRITE_OFFS (the wgrad's casts of dy, given x's aligned offsets) took 206
# registers where the one writing them took 167 (sm_90 ptxas), and lost the new tile's gain:
# probe --given-offsets, ms at C 1024 / 4096: 0.198 / 0.761 uncapped (the old tile: 0.198 / 0.763),
# 0.168 / 0.640 at 168 (0.159 / 0.603 writing the offsets either way); 128 and 96 slower.
# MXFP8's (64, 2) tile is fastest uncapped (or at 96): 0.157-0.161 / 0.602-0.615 both ways.
_TOKEN_MAXNREG = {128: 168, 32: None}
# 0: the split grid; n > 0 (a power of two): a grid of n scale slots a program (the kernel's FLAT).
# scripts/probe_token_cast.py, H100, 64 x 1536 tokens, C 1024, ms balanced / Zipf / one hot expert:
# the split grid 0.175 / 0.342 / 0.444 (as it was, int64 addresses; 0.240 / 0.358 / 0.449 through
# _cast_token_block's int32 ones), one slot a program 0.207 / 0.214 / 0.218, 0.199 / 0.206 / 0.208
# with the vector stores (2, 4 and 8 slots slower, 64 columns slower); the same at C 2048-7168:
# routing no longer moves its time.
_TOKEN_FLAT = 1


def _token_splits(tokens: int, groups: int, block: int) -> int:
    """Programs per (column block, group) of ``block_cast_tokens_kernel``: the balanced share of
    ``block``-token blocks a group would have, a power of two, at most 4. Under skew a long group's
    blocks spread over that many programs (the short groups' extra programs find no block and
    exit): H100, Zipf routing, 64 x 1536 tokens, C 1024: 0.63 ms with one program a group, 0.35
    with 4; balanced routing loses 0-12% to the extra programs (scripts/probe_token_cast.py)."""
    share = _cdiv(tokens, block * groups)
    return min(4, 1 << (share - 1).bit_length())


def _cast_tokens(x, group_offs, recipe, fp8_dtype, fp8_max, emax, margin, token_align, cols_t, aligned_offs):
    import torch

    _check_fp8_max(fp8_max, emax)
    m, c = x.shape
    groups = group_offs.shape[0] - 1
    slots = cols_t // recipe.block + groups
    out_t = torch.empty((c, cols_t), dtype=fp8_dtype, device=x.device)
    storage = torch.empty((slots, c), dtype=recipe.scale_dtype, device=x.device)
    write_offs = token_align > 1 and aligned_offs is None
    launch = groups * c and m
    if write_offs:
        if not launch and m:
            raise ValueError("x has no columns to cast: pass aligned_offs (the kernel writes them as it casts)")
        aligned_offs = torch.empty_like(group_offs) if launch else torch.zeros_like(group_offs)  # no tokens: 0s
    if launch:
        block_c, warps = _TOKEN_TILE[recipe.block]
        splits = _token_splits(m, groups, recipe.block)
        strides = x.stride()
        # int32 offsets within a block (the kernel's WIDE off) where its largest fits
        wide = max((recipe.block - 1) * strides[0] + (block_c - 1) * strides[1], (block_c - 1) * cols_t + recipe.block,
                   (block_c - 1) * storage.stride(1)) >= 2**31
        col_tiles = int(_TOKEN_COL_TILES[recipe.block]) if _TOKEN_FLAT else 1
        maxnreg = _TOKEN_MAXNREG.get(recipe.block) if torch.version.hip is None else None
        options = {} if maxnreg is None else {"maxnreg": int(maxnreg)}
        key = (x.dtype, m, c, strides, group_offs.dtype, groups, fp8_dtype, recipe, margin, token_align, write_offs, block_c, warps, int(_TOKEN_FLAT), wide,
               col_tiles, bool(_TOKEN_TRANS_REGS), maxnreg,
               x.data_ptr() % 16 == 0, group_offs.data_ptr() % 16 == 0, out_t.data_ptr() % 16 == 0,
               storage.data_ptr() % 16 == 0, aligned_offs is not None and aligned_offs.data_ptr() % 16 == 0)
        grid = (_cdiv(slots, int(_TOKEN_FLAT)), _cdiv(c, block_c * col_tiles), 1) if _TOKEN_FLAT else \
            (_cdiv(c, block_c), groups, splits)
        _lean["block_cast_tokens_kernel"].launch_keyed(
            grid, key,
            x, group_offs, out_t, storage, aligned_offs if write_offs else group_offs, m, c, groups, strides[0], strides[1],
            storage.stride(0), storage.stride(1), cols_t, slots,
            FP8_MAX=fp8_max, EMAX=emax, MARGIN=margin, MARGIN_FACTOR=2.0 ** -margin, E8M0=recipe.e8m0, POW2=recipe.pow2,
            BLOCK=recipe.block, BLOCK_C=block_c, TOKEN_ALIGN=token_align, WRITE_OFFS=write_offs, FLAT=int(_TOKEN_FLAT), WIDE=wide, COL_TILES=col_tiles, TRANS_REGS=bool(_TOKEN_TRANS_REGS), num_warps=warps,
            **options,
        )
    return out_t, storage.T, aligned_offs


_lean = {name: lean(globals()[name]) for name in (
    "block_cast_rows_kernel", "block_cast_weight_kernel", "block_cast_tokens_kernel")}
