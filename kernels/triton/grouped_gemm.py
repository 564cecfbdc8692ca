"""Triton FP8 grouped GEMM kernels: M-grouped (fwd NT / dgrad NN) and K-grouped (variable-K wgrad).

Both kernels are persistent: ``P <= num_cu`` programs walk the tiles of the whole problem in the
order of the shared scheduler (``turbo_moe.kernels.tile_scheduler``, jitted in ``.scheduler``).
Group offsets are read on the device only (no host sync: CUDA-graph capturable), there are no
atomics and no split-K (each output element is computed by one program with a fixed
accumulation order: bitwise deterministic), and every address that can pass 2^31 elements is
formed in int64 (row index * row stride, group index * group stride).

Operands take arbitrary strides; the fast layout is contiguous along the contraction dimension
(Hopper's FP8 wgmma reads both operands K-major from shared memory), which the autograd layer
hands in. FP8 pairs: e4m3 x e4m3 and e5m2 x e4m3 (either side), accumulated in fp32, dequantized
in the epilogue by tensorwise (0-dim) or rowwise scales (shapes in ``turbo_moe/backends/base.py``),
stored as the output pointer's dtype (bf16, fp16 or fp32). The K-grouped kernels can instead add
their fp32 result into an fp32 output (``ACCUMULATE``: an fp32 main_grad over micro-batches; an
empty group then leaves its output untouched).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import scheduler as S


@triton.jit
def _persistent_start(size_0, size_1, BLOCK_0: tl.constexpr, BLOCK_1: tl.constexpr):
    """A persistent kernel's prologue: (program id, program count, cdiv(size_0, BLOCK_0),
    cdiv(size_1, BLOCK_1)); the M-grouped kernels pass (N, K), the K-grouped ones (N, K) of out[g]."""
    return tl.program_id(0), tl.num_programs(0), S.cdiv(size_0, BLOCK_0), S.cdiv(size_1, BLOCK_1)


@triton.jit
def _m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M: tl.constexpr, num_n_blocks):
    """The M-grouped kernels' forward-only group cursor (tile_scheduler's module docstring), on
    group 0: (group, group_first_tile, lo, hi, group_tiles), lo/hi the group's first/end row."""
    group = tl.zeros((), dtype=tl.int32)
    group_first_tile = tl.zeros((), dtype=tl.int64)
    lo = tl.load(group_offs_ptr)
    hi = tl.load(group_offs_ptr + min(1, G))
    group_tiles = S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
    return group, group_first_tile, lo, hi, group_tiles


@triton.jit
def _m_grouped_cursor_advance(
    tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M: tl.constexpr, num_n_blocks,
):
    """The cursor moved forward past the groups (empty ones too) that end before ``tile``; past
    the last group it stops with ``group == G``. Each offset is read once per program."""
    while (tile >= group_first_tile + group_tiles) & (group < G):
        group_first_tile += group_tiles
        group += 1
        lo = hi
        hi = tl.load(group_offs_ptr + min(group + 1, G))
        group_tiles = S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
    return group, group_first_tile, lo, hi, group_tiles


@triton.jit
def _m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M: tl.constexpr, num_n_blocks, GROUP_M: tl.constexpr):
    """(rows of the cursor's group, m_block, n_block) of ``tile``, GROUP_M-swizzled in the group."""
    rows = hi - lo
    m_block, n_block = S.swizzle_group_m(tile - group_first_tile, S.cdiv(rows, BLOCK_M), num_n_blocks, GROUP_M)
    return rows, m_block, n_block


@triton.jit
def _k_grouped_tile_blocks(tile, G, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr, BAND_CYCLIC: tl.constexpr):
    """(group, m_block, n_block) of ``tile`` in the K-grouped kernels' tile order."""
    if BAND_CYCLIC:
        group, m_block, n_block = S.k_grouped_band_cyclic(tile, G, num_m_blocks, num_n_blocks, GROUP_M)
    else:
        group, m_block, n_block = S.k_grouped_group_major(tile, G, num_m_blocks, num_n_blocks, GROUP_M)
    return group, m_block, n_block


@triton.jit
def _dequantize(
    acc, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
):
    """acc * a_scale * b_scale in fp32, in that order (the torch reference's order, so integer
    products match it bitwise)."""
    if A_ROWWISE:
        acc = acc * tl.load(a_scale_ptr + a_scale_offsets)[:, None]
    else:
        acc = acc * tl.load(a_scale_ptr)
    if B_ROWWISE:
        acc = acc * tl.load(b_scale_ptr + b_scale_offsets)[None, :]
    else:
        acc = acc * tl.load(b_scale_ptr)
    return acc


@triton.jit
def _dequantize_and_store(
    acc, out_ptrs, out_mask, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
):
    """Dequantize, cast to the output dtype and store through (masked) pointers."""
    acc = _dequantize(acc, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets, A_ROWWISE, B_ROWWISE)
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_and_add(
    acc, out_ptrs, out_mask, group_has_tokens, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
):
    """out += dequantized acc, in fp32 (out is float32): never rounded narrower, no extra kernel.
    An empty group stores its previous values back (adding +0.0 would turn -0.0 into +0.0)."""
    acc = _dequantize(acc, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets, A_ROWWISE, B_ROWWISE)
    previous = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, tl.where(group_has_tokens, previous + acc, previous), mask=out_mask)


@triton.jit
def _k_grouped_out_pointers(out_ptr, group_row, offs_m, offs_n, N, K, stride_og, stride_on, stride_ok):
    """Pointers to the tile (offs_m, offs_n) of out[group_row] and the mask of its elements inside
    [N, K] (the K-grouped kernels' pointer epilogue)."""
    out_ptrs = (
        out_ptr + group_row * stride_og + offs_m[:, None].to(tl.int64) * stride_on
        + offs_n[None, :].to(tl.int64) * stride_ok
    )
    out_mask = (offs_m < N)[:, None] & (offs_n < K)[None, :]
    return out_ptrs, out_mask


@triton.jit
def _dequantize_and_write(
    acc, out_ptrs, out_mask, group_has_tokens, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """The K-grouped kernels' pointer store: out += (ACCUMULATE) or out = the dequantized tile."""
    if ACCUMULATE:
        _dequantize_and_add(
            acc, out_ptrs, out_mask, group_has_tokens, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets,
            A_ROWWISE, B_ROWWISE,
        )
    else:
        _dequantize_and_store(
            acc, out_ptrs, out_mask, a_scale_ptr, a_scale_offsets, b_scale_ptr, b_scale_offsets, A_ROWWISE, B_ROWWISE,
        )


@triton.jit
def _dot_nt(acc, a, b, K_DOT: tl.constexpr, PROMOTE_ACC: tl.constexpr):
    """acc + a @ b.T, a [BM, K_DOT] and b [BN, K_DOT] contiguous along K.

    On sm_90 Triton accumulates FP8 products in Hopper's reduced-precision tensor-core accumulator
    for the whole contraction unless told otherwise (``max_num_imprecise_acc_default = 2**30``:
    "fast accumulation"). PROMOTE_ACC adds each dot's partial sum into the fp32 accumulator
    (``max_num_imprecise_acc = K_DOT``): promotion every K_DOT (<= 128) products, as DeepSeek-V3
    and Transformer Engine's split accumulator do. Other targets accumulate in fp32 either way.
    """
    if PROMOTE_ACC:
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=K_DOT)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def m_grouped_gemm_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_om, stride_on,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PROMOTE_ACC: tl.constexpr = False,
):
    """out[offs[g]:offs[g+1]] = a[offs[g]:offs[g+1]] @ b[g].T * scales, for every group g.

    a: [M, K], b: [G, N, K], out: [M, N]. The tile walk is the scheduler's forward-only cursor
    over group_offs (see tile_scheduler's module docstring); programs stop past the last group.
    """
    pid, num_programs, num_n_blocks, num_k_blocks = _persistent_start(N, K, BLOCK_N, BLOCK_K)

    group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)

    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)

    while group < G:
        group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks
        )
        if group < G:
            rows, m_block, n_block = _m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks, GROUP_M)
            offs_m = m_block * BLOCK_M + arange_m  # int64: rows of the group
            offs_n = n_block.to(tl.int32) * BLOCK_N + arange_n
            # Clamp out-of-range rows/columns onto valid memory instead of masking the loads
            # (masked rows/columns are never stored): the main loop then needs no masks.
            load_rows = lo + tl.where(offs_m < rows, offs_m, 0)
            load_cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
            a_ptrs = a_ptr + load_rows[:, None] * stride_am + arange_k[None, :] * stride_ak
            b_ptrs = (
                b_ptr + group.to(tl.int64) * stride_bg + load_cols[:, None] * stride_bn
                + arange_k[None, :] * stride_bk
            )
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    k_mask = arange_k < K - k_block * BLOCK_K
                    a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
                acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            out_rows = lo + offs_m
            out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
            out_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
            _dequantize_and_store(
                acc, out_ptrs, out_mask, a_scale_ptr, load_rows, b_scale_ptr,
                group.to(tl.int64) * N + load_cols, A_ROWWISE, B_ROWWISE,
            )
        tile += num_programs


@triton.jit
def k_grouped_gemm_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_an, stride_am, stride_bk, stride_bm, stride_og, stride_on, stride_ok,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BAND_CYCLIC: tl.constexpr, ACCUMULATE: tl.constexpr, PROMOTE_ACC: tl.constexpr = False,
):
    """out[g] = a[:, offs[g]:offs[g+1]] @ b[:, offs[g]:offs[g+1]].T * scales, for every group g.

    a: [N, M], b: [K, M], out: [G, N, K]; the contraction runs over the tokens of group g
    (possibly none: then out[g] is written with exact zeros). Output tile (BLOCK_M x BLOCK_N) of
    out[g]; the token loop steps BLOCK_K at a time. With ACCUMULATE (float32 out): out[g] += the
    fp32 result, and an empty group's out[g] is left as it was.
    """
    pid, num_programs, num_m_blocks, num_n_blocks = _persistent_start(N, K, BLOCK_M, BLOCK_N)
    total_tiles = G * num_m_blocks * num_n_blocks

    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)

    for tile in range(pid, total_tiles, num_programs):
        group, m_block, n_block = _k_grouped_tile_blocks(tile, G, num_m_blocks, num_n_blocks, GROUP_M, BAND_CYCLIC)
        lo = tl.load(group_offs_ptr + group)
        hi = tl.load(group_offs_ptr + group + 1)
        offs_m = m_block * BLOCK_M + arange_m
        offs_n = n_block * BLOCK_N + arange_n
        load_rows_a = tl.where(offs_m < N, offs_m, 0).to(tl.int64)
        load_rows_b = tl.where(offs_n < K, offs_n, 0).to(tl.int64)
        a_row_ptrs = a_ptr + load_rows_a[:, None] * stride_an
        b_row_ptrs = b_ptr + load_rows_b[:, None] * stride_bk

        # Token chunks start on BLOCK_K multiples (aligned, vectorizable loads): a masked head
        # chunk [start, start + BLOCK_K) for tokens in [lo, hi), unmasked full chunks, and a
        # masked tail from the last BLOCK_K multiple below hi. Head and tail masks exclude each
        # other's tokens, so no token is counted twice; an empty group masks everything.
        start = lo // BLOCK_K * BLOCK_K
        last_full = hi // BLOCK_K * BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        head_tokens = start + arange_k
        head_mask = (head_tokens >= lo) & (head_tokens < hi)
        a = tl.load(a_row_ptrs + head_tokens[None, :] * stride_am, mask=head_mask[None, :], other=0.0)
        b = tl.load(b_row_ptrs + head_tokens[None, :] * stride_bm, mask=head_mask[None, :], other=0.0)
        acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)

        for chunk in range(start + BLOCK_K, last_full, BLOCK_K):
            tokens = chunk + arange_k
            a = tl.load(a_row_ptrs + tokens[None, :] * stride_am)
            b = tl.load(b_row_ptrs + tokens[None, :] * stride_bm)
            acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)

        tail_tokens = last_full + arange_k
        tail_mask = (tail_tokens >= start + BLOCK_K) & (tail_tokens < hi)
        a = tl.load(a_row_ptrs + tail_tokens[None, :] * stride_am, mask=tail_mask[None, :], other=0.0)
        b = tl.load(b_row_ptrs + tail_tokens[None, :] * stride_bm, mask=tail_mask[None, :], other=0.0)
        acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)

        group_row = group.to(tl.int64)
        out_ptrs, out_mask = _k_grouped_out_pointers(out_ptr, group_row, offs_m, offs_n, N, K, stride_og, stride_on, stride_ok)
        _dequantize_and_write(
            acc, out_ptrs, out_mask, hi > lo, a_scale_ptr, group_row * N + load_rows_a, b_scale_ptr,
            group_row * K + load_rows_b, A_ROWWISE, B_ROWWISE, ACCUMULATE,
        )


# ----------------------------------------------------------------------------------------------
# Tensor-memory-accelerator (TMA) variants, Hopper and later. The operand descriptors are built on
# the host over the whole operands (passed by value: nothing is written to global memory per tile,
# and a CUDA graph captures them with the launch). The copy engine zero-fills past the ends of a
# tensor; group boundaries inside a tensor are handled as follows:
# * M-grouped: a tile's rows past its group's end load the next group's rows; those output rows
#   are never stored (masked pointer store, or a store descriptor built per tile whose shape ends
#   at the group's last row, so the copy engine clips them).
# * K-grouped: a group's token range [lo, hi) is walked in chunks whose offsets are multiples of
#   16 tokens (descriptor offsets must be 16-byte aligned): full BLOCK_K chunks, then narrow
#   TAIL_K chunks, straight from the copy engine to the tensor cores; only a narrow head chunk
#   (when lo is off a 16-token boundary) and the last < TAIL_K tokens are masked in registers
#   (tokens of the neighbouring groups set to zero in both operands).
# Needs 16-byte aligned bases and row strides (checked by the backend).
# ----------------------------------------------------------------------------------------------


@triton.jit
def m_grouped_gemm_tma_kernel(
    a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_om, stride_on,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA_STORE: tl.constexpr, PROMOTE_ACC: tl.constexpr = False,
):
    """Same problem and tile walk as m_grouped_gemm_kernel. a_desc: a [M, K] (K-major); b_desc:
    b as one [G*N, K] matrix (columns past N of a group read the next group's rows, never
    stored, or zeros past the last group)."""
    pid, num_programs, num_n_blocks, num_k_blocks = _persistent_start(N, K, BLOCK_N, BLOCK_K)

    group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)

    while group < G:
        group, group_first_tile, lo, hi, group_tiles = _m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks
        )
        if group < G:
            rows, m_block, n_block = _m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks, GROUP_M)
            row0 = (lo + m_block * BLOCK_M).to(tl.int32)
            col0 = (group * N + n_block * BLOCK_N).to(tl.int32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                a = a_desc.load([row0, k_block * BLOCK_K])
                b = b_desc.load([col0, k_block * BLOCK_K])
                acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)
            offs_m = m_block * BLOCK_M + arange_m
            offs_n = n_block.to(tl.int32) * BLOCK_N + arange_n
            scale_rows = lo + tl.where(offs_m < rows, offs_m, 0)
            scale_cols = group.to(tl.int64) * N + tl.where(offs_n < N, offs_n, 0)
            if TMA_STORE:
                # The store descriptor ends at the group's last row: the copy engine clips the
                # rows that belong to the next group (and columns past N).
                out_desc = tl.make_tensor_descriptor(
                    out_ptr, shape=[hi.to(tl.int32), N], strides=[stride_om, 1], block_shape=[BLOCK_M, BLOCK_N]
                )
                acc = _dequantize(acc, a_scale_ptr, scale_rows, b_scale_ptr, scale_cols, A_ROWWISE, B_ROWWISE)
                out_desc.store([row0, (n_block * BLOCK_N).to(tl.int32)], acc.to(out_desc.dtype))
            else:
                out_rows = lo + offs_m
                out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
                out_mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
                _dequantize_and_store(
                    acc, out_ptrs, out_mask, a_scale_ptr, scale_rows, b_scale_ptr, scale_cols, A_ROWWISE, B_ROWWISE,
                )
        tile += num_programs


@triton.jit
def _masked_token_chunk_dot(acc, a_desc, b_desc, row_a, row_b, chunk, lo, hi, BLOCK_K: tl.constexpr,
                            PROMOTE_ACC: tl.constexpr):
    """acc += a[:, chunk:chunk+BK] @ b[:, chunk:chunk+BK].T over the tokens in [lo, hi) only."""
    tokens = chunk + tl.arange(0, BLOCK_K)
    valid = (tokens >= lo) & (tokens < hi)
    a = a_desc.load([row_a, chunk])
    b = b_desc.load([row_b, chunk])
    a = tl.where(valid[None, :], a, tl.zeros_like(a))
    b = tl.where(valid[None, :], b, tl.zeros_like(b))
    return _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)


@triton.jit
def k_grouped_gemm_tma_kernel(
    a_desc, b_desc, a_tail_desc, b_tail_desc, out_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr,
    N, K, G,
    stride_og, stride_on, stride_ok,
    A_ROWWISE: tl.constexpr, B_ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BAND_CYCLIC: tl.constexpr, TMA_STORE: tl.constexpr, TAIL_K: tl.constexpr, ACCUMULATE: tl.constexpr,
    PROMOTE_ACC: tl.constexpr = False,
):
    """Same problem and tile order as k_grouped_gemm_kernel. a_desc: a [N, M], b_desc: b [K, M]
    (token-major) with BLOCK_K-token boxes; a_tail_desc / b_tail_desc: the same operands with
    TAIL_K-token boxes; out_desc: out [G, N, K] with block [1, BLOCK_M, BLOCK_N] (used if
    TMA_STORE, the copy engine clips rows past N and columns past K of each group). ACCUMULATE
    (float32 out): out[g] += the fp32 result; empty groups left untouched. With TMA_STORE the
    read-modify-write goes through out_desc both ways: no per-element pointers in registers (a
    128 x 128 fp32 tile's 64-bit pointers are 128 registers a thread with 8 warps), and the
    store is asynchronous."""
    pid, num_programs, num_m_blocks, num_n_blocks = _persistent_start(N, K, BLOCK_M, BLOCK_N)
    total_tiles = G * num_m_blocks * num_n_blocks
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)

    for tile in range(pid, total_tiles, num_programs):
        group, m_block, n_block = _k_grouped_tile_blocks(tile, G, num_m_blocks, num_n_blocks, GROUP_M, BAND_CYCLIC)
        lo = tl.load(group_offs_ptr + group).to(tl.int32)
        hi = tl.load(group_offs_ptr + group + 1).to(tl.int32)
        row_a = m_block * BLOCK_M
        row_b = n_block * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Token walk (descriptor offsets must be 16-token aligned): a narrow masked head chunk
        # at lo rounded down to 16 when lo is off a 16-token boundary; then full BLOCK_K chunks;
        # then narrow TAIL_K chunks; then one narrow masked chunk for the last < TAIL_K tokens.
        # Only the two masked chunks go through registers (tokens of neighbouring groups zeroed
        # in both operands); every other chunk goes from the copy engine to the tensor cores.
        start = lo // 16 * 16
        if (start < lo) & (hi > lo):
            acc = _masked_token_chunk_dot(acc, a_tail_desc, b_tail_desc, row_a, row_b, start, lo, hi, TAIL_K, PROMOTE_ACC)
        first = tl.where(start < lo, start + TAIL_K, lo)
        num_full = tl.maximum(hi - first, 0) // BLOCK_K
        for i in range(0, num_full):
            chunk = first + i * BLOCK_K
            a = a_desc.load([row_a, chunk])
            b = b_desc.load([row_b, chunk])
            acc = _dot_nt(acc, a, b, BLOCK_K, PROMOTE_ACC)
        tail = first + num_full * BLOCK_K
        num_narrow = tl.maximum(hi - tail, 0) // TAIL_K
        # Two stages: at most BLOCK_K / TAIL_K - 1 chunks. Unpipelined, groups of a few dozen
        # tokens ran ~15% slower; pipelined as deep as the main loop, the main loop lost ~5%
        # (H100, docs/triton_notes.md).
        for j in tl.range(0, num_narrow, num_stages=2):
            chunk = tail + j * TAIL_K
            a = a_tail_desc.load([row_a, chunk])
            b = b_tail_desc.load([row_b, chunk])
            acc = _dot_nt(acc, a, b, TAIL_K, PROMOTE_ACC)
        rest = tail + num_narrow * TAIL_K
        if rest < hi:
            acc = _masked_token_chunk_dot(acc, a_tail_desc, b_tail_desc, row_a, row_b, rest, lo, hi, TAIL_K, PROMOTE_ACC)
        offs_m = row_a + arange_m
        offs_n = row_b + arange_n
        group_row = group.to(tl.int64)
        scale_rows = group_row * N + tl.where(offs_m < N, offs_m, 0)
        scale_cols = group_row * K + tl.where(offs_n < K, offs_n, 0)
        if TMA_STORE and ACCUMULATE:
            # An empty group's tile is neither read nor written (adding +0.0 would turn -0.0
            # into +0.0); the copy engine clips rows past N and columns past K both ways.
            if hi > lo:
                acc = _dequantize(acc, a_scale_ptr, scale_rows, b_scale_ptr, scale_cols, A_ROWWISE, B_ROWWISE)
                previous = out_desc.load([group, row_a, row_b]).reshape(BLOCK_M, BLOCK_N)
                out_desc.store([group, row_a, row_b], (previous + acc).reshape(1, BLOCK_M, BLOCK_N))
        elif TMA_STORE:
            acc = _dequantize(acc, a_scale_ptr, scale_rows, b_scale_ptr, scale_cols, A_ROWWISE, B_ROWWISE)
            out_desc.store([group, row_a, row_b], acc.to(out_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            out_ptrs, out_mask = _k_grouped_out_pointers(out_ptr, group_row, offs_m, offs_n, N, K, stride_og, stride_on, stride_ok)
            _dequantize_and_write(
                acc, out_ptrs, out_mask, hi > lo, a_scale_ptr, scale_rows, b_scale_ptr, scale_cols,
                A_ROWWISE, B_ROWWISE, ACCUMULATE,
            )
