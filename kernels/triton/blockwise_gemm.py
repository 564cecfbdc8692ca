"""Block-scaled FP8 grouped GEMMs (blockwise 1x128 / 128x128, MXFP8 1x32 e8m0): M-grouped (fwd NT,
dgrad NN) and K-grouped (variable-K wgrad). Semantics: ``turbo_moe/fine_grained/gemm.py``.

The scales vary along the contraction, so they cannot wait for the epilogue. Two main loops:

* promotion (``USE_DOT_SCALED=False``; blockwise everywhere, MXFP8 on Hopper): one scale block per
  K step (``BLOCK_K == SCALE_BLOCK``); each step's FP8 dot runs into a fresh fp32 tensor-core
  accumulator that is then promoted into the main fp32 accumulator with both scales,
  ``acc += dot(a, b^T) * (sa[:, None] * sb[None, :])`` -- DeepGEMM's scheme, every 128 of K for
  blockwise. It also bounds how long Hopper's FP8 wgmma accumulates on its own (its internal
  accumulation keeps fewer than 32 bits: DeepSeek-V3 section 3.3.2 promotes every 128 for that
  reason). MXFP8 promotes every 32 of K on Hopper: one k32 FP8 wgmma per promotion.
* ``tl.dot_scaled`` (``USE_DOT_SCALED=True``, MXFP8 only): the hardware applies the e8m0 scales
  (sm_100 ``tcgen05.mma...block_scale``, gfx950 scaled MFMA). On sm_90 Triton lowers it by
  upcasting both operands to bf16, multiplying in the scales and running a bf16 wgmma (half the
  FP8 rate), so the backend uses the promotion loop there instead.

Loads: ``m_grouped_block_scaled_tma_kernel`` and ``k_grouped_block_scaled_tma_kernel`` take the
promotion loop's operands through TMA descriptors (Hopper+; ``turbo_moe.fine_grained.triton_gemm
.tma_declined`` says when not), the other kernels through pointers. The promotion's synchronous
wgmma leaves no slack for the loads: through pointers fwd/dgrad ran at 0.27-0.47x the tensorwise
kernels and wgrad at 0.14-0.23x, through TMA at 0.67-0.79x and 0.40-0.50x (H100,
docs/results/h100_fine_grained.md). On sm_90 the K-grouped blockwise wgrad is the Gluon kernel of
``blockwise_gemm_gluon`` (loads ahead across blocks and tiles, the same bits).

Tile walk: the shared scheduler (``tile_scheduler`` via ``.scheduler``) and the M-grouped cursor
of ``grouped_gemm`` -- one scheduler for every kernel. Offsets are read on the device only
(capturable), no atomics, no split-K: deterministic. K-grouped: group g's token blocks start at
its first token (``offs[g] + j * SCALE_BLOCK``) and block j's scales sit in slot
``offs[g] // SCALE_BLOCK + g + j``; loads are masked to the group's tokens, so ragged groups and
groups whose token count is not a multiple of the block need no padding (the TMA kernel: see its
docstring for groups that start off a 16-token boundary).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import scheduler as S
from .grouped_gemm import (_k_grouped_tile_blocks, _m_grouped_cursor_advance, _m_grouped_cursor_start,
                           _m_grouped_tile_blocks, _persistent_start)


@triton.jit
def _decode_scale(stored, E8M0: tl.constexpr):
    """float32 dequantization factors: e8m0 ``2**(e - 127)`` (255 -> NaN), or the float32 itself."""
    scale = stored
    if E8M0:
        e = stored.to(tl.int32)
        scale = tl.where(e == 255, float("nan"), (e << 23).to(tl.float32, bitcast=True))
    return scale


@triton.jit
def _scaled_step(acc, a, b_t, sa_ptrs, sb_ptrs, sa_mask, sb_mask, E8M0: tl.constexpr, USE_DOT_SCALED: tl.constexpr,
                 A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr):
    """One K step: acc += a @ b_t with the step's block scales (see the module docstring).
    Promotion: sa_ptrs [BM], sb_ptrs [BN] (one scale block per step). dot_scaled: sa_ptrs
    [BM, KS], sb_ptrs [BN, KS] (KS = BLOCK_K / 32 blocks per step)."""
    if USE_DOT_SCALED:
        sa = tl.load(sa_ptrs, mask=sa_mask, other=127)
        sb = tl.load(sb_ptrs, mask=sb_mask, other=127)
        acc = tl.dot_scaled(a, sa, A_FORMAT, b_t, sb, B_FORMAT, acc)
    else:
        sa = _decode_scale(tl.load(sa_ptrs), E8M0)
        sb = _decode_scale(tl.load(sb_ptrs), E8M0)
        acc += tl.dot(a, b_t) * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def m_grouped_block_scaled_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_om, stride_on,
    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
    SCALE_BLOCK: tl.constexpr, B_ROW_BLOCK: tl.constexpr, E8M0: tl.constexpr, USE_DOT_SCALED: tl.constexpr,
    A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
):
    """out[offs[g]:offs[g+1]] = sum_kb a[rows, kb] @ b[g][:, kb].T * sa[rows, kb] * sb[g, cols // B_ROW_BLOCK, kb].

    a [M, K], b [G, N, K], a_scale [M, cdiv(K, SCALE_BLOCK)], b_scale [G, cdiv(N, B_ROW_BLOCK),
    cdiv(K, SCALE_BLOCK)] (any strides). Promotion: BLOCK_K == SCALE_BLOCK; dot_scaled: BLOCK_K a
    multiple of SCALE_BLOCK == 32 and B_ROW_BLOCK == 1."""
    KS: tl.constexpr = BLOCK_K // SCALE_BLOCK
    tl.static_assert(USE_DOT_SCALED or KS == 1, "the promotion loop takes one scale block per K step")
    tl.static_assert(not USE_DOT_SCALED or (E8M0 and B_ROW_BLOCK == 1), "dot_scaled is for MXFP8 operands")
    pid, num_programs, num_n_blocks, num_k_blocks = _persistent_start(N, K, BLOCK_N, BLOCK_K)
    num_scale_blocks = S.cdiv(K, SCALE_BLOCK)
    group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)
    arange_s = tl.arange(0, KS)
    while group < G:
        group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks
        )
        if group < G:
            rows, m_block, n_block = _m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks, GROUP_M)
            offs_m = m_block * BLOCK_M + arange_m
            offs_n = n_block.to(tl.int32) * BLOCK_N + arange_n
            # Out-of-range rows/columns load valid memory (never stored): no masks in the main loop.
            load_rows = lo + tl.where(offs_m < rows, offs_m, 0)
            load_cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
            group64 = group.to(tl.int64)
            a_ptrs = a_ptr + load_rows[:, None] * stride_am + arange_k[None, :] * stride_ak
            b_ptrs = b_ptr + group64 * stride_bg + load_cols[:, None] * stride_bn + arange_k[None, :] * stride_bk
            sa_rows = a_scale_ptr + load_rows * stride_sam
            sb_rows = b_scale_ptr + group64 * stride_sbg + (load_cols // B_ROW_BLOCK) * stride_sbn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    k_mask = arange_k < K - k_block * BLOCK_K
                    a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
                if USE_DOT_SCALED:
                    blocks = k_block * KS + arange_s
                    ok = (blocks < num_scale_blocks)[None, :]
                    acc = _scaled_step(acc, a, tl.trans(b), sa_rows[:, None] + blocks[None, :] * stride_sak,
                                       sb_rows[:, None] + blocks[None, :] * stride_sbk, ok, ok,
                                       E8M0, USE_DOT_SCALED, A_FORMAT, B_FORMAT)
                else:
                    acc = _scaled_step(acc, a, tl.trans(b), sa_rows + k_block * stride_sak,
                                       sb_rows + k_block * stride_sbk, None, None,
                                       E8M0, USE_DOT_SCALED, A_FORMAT, B_FORMAT)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            out_ptrs = out_ptr + (lo + offs_m)[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
            out_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        tile += num_programs


@triton.jit
def m_grouped_block_scaled_tma_kernel(
    a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_om, stride_on,
    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
    B_ROW_BLOCK: tl.constexpr, E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """m_grouped_block_scaled_kernel's problem, tile walk and promotion loop (``BLOCK_K ==
    SCALE_BLOCK``) with the operands loaded through TMA descriptors, Hopper and later: a_desc a
    [M, K] with [BLOCK_M, BLOCK_K] boxes, b_desc b as one [G*N, K] matrix with [BLOCK_N, BLOCK_K]
    boxes (grouped_gemm's m_grouped_gemm_tma_kernel layout: rows past a group's end, and columns
    past N, load the next group's rows and are never stored). The copy engine zero-fills past K,
    so a partial last K block needs no mask.

    Why a second kernel: the promotion makes every K step's wgmma synchronous (its result is
    scaled at once), so the loads must cost the step nothing. With pointer loads (cp.async, the
    addresses in registers) this loop ran at 0.27x the tensorwise kernel's TFLOPS on the H100;
    with TMA, at 0.72x on the same problem (docs/results/h100_fine_grained.md).
    When one weight scale block spans the tile's columns (``B_ROW_BLOCK % BLOCK_N == 0``,
    blockwise), each K step loads one scalar weight scale instead of a column vector."""
    pid, num_programs, num_n_blocks, num_k_blocks = _persistent_start(N, K, BLOCK_N, BLOCK_K)
    group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    ONE_B_SCALE: tl.constexpr = B_ROW_BLOCK % BLOCK_N == 0
    while group < G:
        group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks
        )
        if group < G:
            rows, m_block, n_block = _m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks, GROUP_M)
            row0 = (lo + m_block * BLOCK_M).to(tl.int32)
            col0 = (group * N + n_block * BLOCK_N).to(tl.int32)
            offs_m = m_block * BLOCK_M + arange_m
            offs_n = n_block.to(tl.int32) * BLOCK_N + arange_n
            load_rows = lo + tl.where(offs_m < rows, offs_m, 0)
            group64 = group.to(tl.int64)
            sa_ptrs = a_scale_ptr + load_rows * stride_sam
            if ONE_B_SCALE:
                sb_ptrs = b_scale_ptr + group64 * stride_sbg + (n_block * BLOCK_N // B_ROW_BLOCK) * stride_sbn
            else:
                load_cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
                sb_ptrs = b_scale_ptr + group64 * stride_sbg + (load_cols // B_ROW_BLOCK) * stride_sbn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                a = a_desc.load([row0, k_block * BLOCK_K])
                b = b_desc.load([col0, k_block * BLOCK_K])
                sa = _decode_scale(tl.load(sa_ptrs + k_block * stride_sak), E8M0)
                sb = _decode_scale(tl.load(sb_ptrs + k_block * stride_sbk), E8M0)
                if ONE_B_SCALE:
                    acc += tl.dot(a, tl.trans(b)) * (sa * sb)[:, None]
                else:
                    acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            out_ptrs = out_ptr + (lo + offs_m)[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
            out_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        tile += num_programs


@triton.jit
def _k_grouped_tile_start(tile, group_offs_ptr, G, num_m_blocks, num_n_blocks, arange_m, arange_n,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                          BAND_CYCLIC: tl.constexpr):
    """(group, m_block, n_block, lo, hi, output rows, output columns) of a K-grouped ``tile``: the
    shared scheduler's order, the group's token range [lo, hi) read on the device (``arange_m``,
    ``arange_n``: the tile's row / column ranges, made once outside the tile loop)."""
    group, m_block, n_block = _k_grouped_tile_blocks(tile, G, num_m_blocks, num_n_blocks, GROUP_M, BAND_CYCLIC)
    lo = tl.load(group_offs_ptr + group)
    hi = tl.load(group_offs_ptr + group + 1)
    return group, m_block, n_block, lo, hi, m_block * BLOCK_M + arange_m, n_block * BLOCK_N + arange_n


@triton.jit
def _k_grouped_pointer_walk(acc, a_row_ptrs, b_row_ptrs, sa_rows, sb_rows, lo, hi, first_slot, stride_am, stride_bm,
                            stride_sas, stride_sbs, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                            USE_DOT_SCALED: tl.constexpr, A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """acc += group [lo, hi)'s token blocks through pointer loads, masked to the group's tokens
    (k_grouped_block_scaled_kernel's contraction; any alignment of lo)."""
    KS: tl.constexpr = BLOCK_K // SCALE_BLOCK
    arange_k = tl.arange(0, BLOCK_K)
    last_slot = first_slot + S.cdiv(hi - lo, SCALE_BLOCK)  # one past the group's last
    for t0 in range(lo, hi, BLOCK_K):
        tokens = t0 + arange_k
        valid = (tokens < hi)[None, :]
        a = tl.load(a_row_ptrs + tokens[None, :] * stride_am, mask=valid, other=0.0)
        b = tl.load(b_row_ptrs + tokens[None, :] * stride_bm, mask=valid, other=0.0)
        slot = first_slot + (t0 - lo) // SCALE_BLOCK
        if USE_DOT_SCALED:
            slots = slot + tl.arange(0, KS)
            ok = (slots < last_slot)[None, :]
            acc = _scaled_step(acc, a, tl.trans(b), sa_rows[:, None] + slots[None, :] * stride_sas,
                               sb_rows[:, None] + slots[None, :] * stride_sbs, ok, ok,
                               E8M0, USE_DOT_SCALED, A_FORMAT, B_FORMAT)
        else:
            acc = _scaled_step(acc, a, tl.trans(b), sa_rows + slot * stride_sas, sb_rows + slot * stride_sbs,
                               None, None, E8M0, USE_DOT_SCALED, A_FORMAT, B_FORMAT)
    return acc


@triton.jit
def _k_grouped_store(acc, out_ptr, group, offs_m, offs_n, lo, hi, N, K, stride_og, stride_on, stride_ok,
                     ACCUMULATE: tl.constexpr):
    """out[g] tile = acc (ACCUMULATE: out[g] tile += acc, an empty group's tile left as it was)."""
    out_ptrs = (out_ptr + group.to(tl.int64) * stride_og + offs_m[:, None].to(tl.int64) * stride_on
                + offs_n[None, :].to(tl.int64) * stride_ok)
    out_mask = (offs_m < N)[:, None] & (offs_n < K)[None, :]
    if ACCUMULATE:
        previous = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, tl.where(hi > lo, previous + acc, previous), mask=out_mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def k_grouped_block_scaled_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_an, stride_am, stride_bk, stride_bm, stride_og, stride_on, stride_ok,
    stride_san, stride_sas, stride_sbk, stride_sbs,
    SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, USE_DOT_SCALED: tl.constexpr,
    A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BAND_CYCLIC: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """out[g] = sum_j a[:, blk_j] @ b[:, blk_j].T * sa[:, slot_j] * sb[:, slot_j] over group g's
    token blocks blk_j = [offs[g] + j*SB, ...) ∩ [offs[g], offs[g+1]), slot_j = offs[g] // SB + g + j.

    a [N, M], b [K, M] (token-major), a_scale [N, M // SB + G], b_scale [K, M // SB + G]; out [G, N, K].
    An empty group writes zeros (ACCUMULATE: leaves out[g] as it was)."""
    KS: tl.constexpr = BLOCK_K // SCALE_BLOCK
    tl.static_assert(USE_DOT_SCALED or KS == 1, "the promotion loop takes one scale block per K step")
    pid, num_programs, num_m_blocks, num_n_blocks = _persistent_start(N, K, BLOCK_M, BLOCK_N)
    total_tiles = G * num_m_blocks * num_n_blocks
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    for tile in range(pid, total_tiles, num_programs):
        group, m_block, n_block, lo, hi, offs_m, offs_n = _k_grouped_tile_start(
            tile, group_offs_ptr, G, num_m_blocks, num_n_blocks, arange_m, arange_n, BLOCK_M, BLOCK_N, GROUP_M,
            BAND_CYCLIC)
        load_rows_a = tl.where(offs_m < N, offs_m, 0).to(tl.int64)
        load_rows_b = tl.where(offs_n < K, offs_n, 0).to(tl.int64)
        acc = _k_grouped_pointer_walk(
            tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptr + load_rows_a[:, None] * stride_an,
            b_ptr + load_rows_b[:, None] * stride_bk, a_scale_ptr + load_rows_a * stride_san,
            b_scale_ptr + load_rows_b * stride_sbk, lo, hi, lo // SCALE_BLOCK + group, stride_am, stride_bm,
            stride_sas, stride_sbs, SCALE_BLOCK, E8M0, USE_DOT_SCALED, A_FORMAT, B_FORMAT, BLOCK_K)
        _k_grouped_store(acc, out_ptr, group, offs_m, offs_n, lo, hi, N, K, stride_og, stride_on, stride_ok,
                         ACCUMULATE)


@triton.jit
def k_grouped_block_scaled_tma_kernel(
    a_desc, b_desc, a_narrow_desc, b_narrow_desc, out_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_og, stride_on, stride_ok,
    stride_san, stride_sas, stride_sbk, stride_sbs,
    SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, NARROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BAND_CYCLIC: tl.constexpr, ACCUMULATE: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """k_grouped_block_scaled_kernel's problem, tile order and promotion loop, with a group's token
    blocks loaded through TMA descriptors (a_desc: a [N, M] with [BLOCK_M, SCALE_BLOCK] boxes,
    b_desc: b [K, M] with [BLOCK_N, SCALE_BLOCK] boxes; unit stride along M, 16-byte aligned
    rows). A group that starts on a 16-token boundary (a box's offset must be 16-byte aligned, and
    the scale blocks start at the group's first token) takes full blocks straight from the copy
    engine, and its short last block with the next group's tokens zeroed in registers. A group
    that starts off it takes each block as NARROW-token boxes (a_narrow_desc / b_narrow_desc: the
    same operands with [BLOCK_M, NARROW] / [BLOCK_N, NARROW] boxes), masked in registers: 1/4
    more MMA work. Routers that pad each expert's tokens to a multiple of 16 for FP8 (Megatron's
    ``moe_router_padding_for_fp8``) give only aligned groups.

    TMA_STORE: the tile leaves through out_desc (out [G, N, K] with [1, BLOCK_M, BLOCK_N] boxes;
    the copy engine clips rows past N and columns past K), and ACCUMULATE's read-modify-write
    comes back through it too (grouped_gemm's k_grouped_gemm_tma_kernel: a 128 x 128 fp32 tile's
    64-bit pointers alone are 128 registers a thread)."""
    pid, num_programs, num_m_blocks, num_n_blocks = _persistent_start(N, K, BLOCK_M, BLOCK_N)
    total_tiles = G * num_m_blocks * num_n_blocks
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, SCALE_BLOCK)
    for tile in range(pid, total_tiles, num_programs):
        group, m_block, n_block, lo, hi, offs_m, offs_n = _k_grouped_tile_start(
            tile, group_offs_ptr, G, num_m_blocks, num_n_blocks, arange_m, arange_n, BLOCK_M, BLOCK_N, GROUP_M,
            BAND_CYCLIC)
        # The scales' row offsets as int32 vectors beside scalar int64 slot offsets (the host keeps
        # N * stride_san and K * stride_sbk below 2**31): as 64-bit pointer vectors the column
        # scales' alone took 64 registers a thread in the wgmma layout, and the loop spilled 472
        # bytes (60 this way; Triton 3.6's ptxas for sm_90a, 128 x 128 tiles, 8 warps).
        sa_offs = tl.where(offs_m < N, offs_m, 0) * stride_san
        sb_offs = tl.where(offs_n < K, offs_n, 0) * stride_sbk
        first_slot = lo // SCALE_BLOCK + group
        row_a = (m_block * BLOCK_M).to(tl.int32)
        row_b = (n_block * BLOCK_N).to(tl.int32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if lo % 16 == 0:
            num_full = (hi - lo) // SCALE_BLOCK
            for j in range(num_full):
                t0 = (lo + j * SCALE_BLOCK).to(tl.int32)
                a = a_desc.load([row_a, t0])
                b = b_desc.load([row_b, t0])
                slot = (first_slot + j).to(tl.int64)
                sa = _decode_scale(tl.load(a_scale_ptr + slot * stride_sas + sa_offs), E8M0)
                sb = _decode_scale(tl.load(b_scale_ptr + slot * stride_sbs + sb_offs), E8M0)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            t0 = lo + num_full * SCALE_BLOCK
            if t0 < hi:
                valid = (t0 + arange_k < hi)[None, :]
                a = a_desc.load([row_a, t0.to(tl.int32)])
                b = b_desc.load([row_b, t0.to(tl.int32)])
                a = tl.where(valid, a, tl.zeros_like(a))
                b = tl.where(valid, b, tl.zeros_like(b))
                slot = (first_slot + num_full).to(tl.int64)
                sa = _decode_scale(tl.load(a_scale_ptr + slot * stride_sas + sa_offs), E8M0)
                sb = _decode_scale(tl.load(b_scale_ptr + slot * stride_sbs + sb_offs), E8M0)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:
            # Off a 16-token boundary, no box can start at a block's first token: block [t0, t1)
            # is covered by NARROW-token boxes from t0 rounded down to 16 (SCALE_BLOCK + 16 tokens
            # reach past t0 + SCALE_BLOCK), each masked to the block in registers and summed into
            # the block's own accumulator before its promotion. One narrow box more than the
            # block needs (1/4 more MMA work for 128-token blocks), and no pointers: a pointer walk
            # here cost the aligned path 44% (its 64-bit pointer tiles spill registers).
            for j in range(S.cdiv(hi - lo, SCALE_BLOCK)):
                t0 = lo + j * SCALE_BLOCK
                t1 = tl.minimum(t0 + SCALE_BLOCK, hi)
                start = (t0 // 16 * 16).to(tl.int32)
                block = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for c in tl.static_range(0, SCALE_BLOCK + 16, NARROW):
                    tokens = start + c + tl.arange(0, NARROW)
                    valid = ((tokens >= t0) & (tokens < t1))[None, :]
                    a = a_narrow_desc.load([row_a, start + c])
                    b = b_narrow_desc.load([row_b, start + c])
                    a = tl.where(valid, a, tl.zeros_like(a))
                    b = tl.where(valid, b, tl.zeros_like(b))
                    block = tl.dot(a, tl.trans(b), block)
                slot = (first_slot + j).to(tl.int64)
                sa = _decode_scale(tl.load(a_scale_ptr + slot * stride_sas + sa_offs), E8M0)
                sb = _decode_scale(tl.load(b_scale_ptr + slot * stride_sbs + sb_offs), E8M0)
                acc += block * (sa[:, None] * sb[None, :])
        if TMA_STORE:
            group32 = group.to(tl.int32)
            if ACCUMULATE:
                if hi > lo:  # an empty group's tile is neither read nor written
                    previous = out_desc.load([group32, row_a, row_b]).reshape(BLOCK_M, BLOCK_N)
                    out_desc.store([group32, row_a, row_b], (previous + acc).reshape(1, BLOCK_M, BLOCK_N))
            else:
                out_desc.store([group32, row_a, row_b], acc.to(out_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            _k_grouped_store(acc, out_ptr, group, offs_m, offs_n, lo, hi, N, K, stride_og, stride_on, stride_ok,
                             ACCUMULATE)
