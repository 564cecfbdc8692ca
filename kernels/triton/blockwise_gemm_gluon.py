"""The blockwise (1x128 token blocks) variable-K wgrad in Gluon for Hopper, loads running ahead across tiles.

Same problem, tile order and bits as ``blockwise_gemm.k_grouped_block_scaled_tma_kernel``:
``out[g] = sum_j a[:, blk_j] @ b[:, blk_j]^T * sa[:, slot_j] * sb[:, slot_j]`` over group g's token
blocks ``blk_j = [lo + 128 j, lo + 128 (j + 1)) ∩ [lo, hi)``, ``slot_j = lo // 128 + g + j``, with
a: [N, M] and b: [K, M] token-major FP8, float32 scales, out: [G, N, K].

Why. The Triton TMA kernel promotes each block's wgmma sum into the fp32 accumulator right after
it, synchronously, and its loads are not pipelined ahead of that: 0.40-0.50x the tensorwise wgrad
on the H100 (docs/results/h100_fine_grained.md). Here, as in ``grouped_gemm_gluon``, a producer
cursor keeps ``STAGES - 1`` TMA loads in flight across blocks and tiles, so a block's operands are
in shared memory when its MMAs start. The block's scales are loaded before its MMAs and the next
load is issued while they run; the promotion still waits for them (a second block accumulator,
to promote one block beside the next one's MMAs, does not fit in the registers at 128 x 128).
H100: 1.08-1.46x the TMA kernel's TFLOPS at DeepSeek-V3 shapes (0.97x at fc2 8 x 4096).

Token walk, the Triton TMA kernel's (hence its bits):

* a group starting on a 16-token boundary: one 128-token box per block at the block's first token,
  straight to the tensor cores; a short last block has the next group's tokens zeroed (in shared
  memory here, in registers there) and still runs all four 32-token slices;
* a group starting off it (TMA coordinates along the contiguous dimension must be 16-byte
  aligned): each block as five 32-token slices from its first token rounded down to 16, the
  tokens outside the block zeroed: here a 128-token box at that token and the first slice of the
  box after it, two ring entries per block.

Each block's slices run into a fresh accumulator (``use_acc=False``), which is then promoted:
``acc += block * (sa[:, None] * sb[None, :])``.

Limits (``turbo_moe.fine_grained.triton_gemm.gluon_declined``): sm_90, blockwise recipes with
float32 scales and 128-token blocks, N a multiple of BLOCK_M (one [G*N, K] store descriptor).
"""

from __future__ import annotations

from .grouped_gemm_gluon import GLUON_ERROR, gluon  # noqa: F401 (GLUON_ERROR: why the kernel is absent)

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .grouped_gemm_gluon import (_allocate, _cta_barrier, _group_tile, _load_slot, _program_tiles, _release,
                                     _store_tile, _zero_other_groups)

    @gluon.jit
    def _block_tile_of(i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr, GROUP_M: gl.constexpr,
                       BAND_CYCLIC: gl.constexpr):
        """This program's i-th tile: (group, first row of a, first row of b, lo, hi, blocks, ring
        entries per block: 1 for a group starting on a 16-token boundary, else 2)."""
        group, m_block, n_block, lo, hi = _group_tile(i, pid, num_programs, G, num_m_blocks, num_n_blocks,
                                                      group_offs_ptr, GROUP_M, BAND_CYCLIC)
        blocks = gl.where(hi > lo, (hi - lo + SCALE_BLOCK - 1) // SCALE_BLOCK, 0)
        per_block = gl.where(lo % 16 == 0, 1, 2)
        return group, m_block * BLOCK_M, n_block * BLOCK_N, lo, hi, blocks, per_block

    @gluon.jit
    def _produce_block(a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a,
                       p_row_b, my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SCALE_BLOCK: gl.constexpr,
                       GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr, STAGES: gl.constexpr):
        """Issue the producer cursor's next ring entry (tile p_i, entry p_k), if any, into slot
        ``issued % STAGES``; returns the advanced cursor and load count."""
        while (p_k == p_entries) & (p_i < my_tiles):
            p_i += 1
            p_k = 0
            if p_i < my_tiles:
                _, p_row_a, p_row_b, p_lo, _, blocks, p_per = _block_tile_of(
                    p_i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N,
                    SCALE_BLOCK, GROUP_M, BAND_CYCLIC)
                p_entries = blocks * p_per
        if p_i < my_tiles:
            block_token = p_lo + gl.where(p_per == 1, p_k, p_k // 2) * SCALE_BLOCK
            # Aligned: the block's first token. Off 16: that token rounded down to 16, then the box after it.
            token = gl.where(p_per == 1, block_token, block_token // 16 * 16 + (p_k % 2) * SCALE_BLOCK)
            _load_slot(a_desc, b_desc, a_bufs, b_bufs, ready, issued % STAGES, p_row_a, p_row_b, token)
            p_k += 1
            issued += 1
        return issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a, p_row_b

    @gluon.jit
    def k_grouped_block_scaled_gluon_kernel(
        a_desc, b_desc, out_desc, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G,
        stride_san, stride_sas, stride_sbk, stride_sbs,
        GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """a_desc: a [N, M] with [BLOCK_M, 128] boxes; b_desc: b [K, M] with [BLOCK_N, 128] boxes;
        out_desc: out as one [G*N, K] matrix with [BLOCK_M, BLOCK_N] boxes (N a multiple of
        BLOCK_M); a_scale [N, slots] and b_scale [K, slots] float32 by their strides. ACCUMULATE
        (float32 out): out[g] += the result, an empty group's tiles neither read nor written."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        SCALE_BLOCK: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        SLICE_K: gl.constexpr = 32  # the FP8 wgmma's K: the Triton kernel's narrow boxes
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        mask_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                                     warps_per_cta=[num_warps, 1], order=[1, 0])
        a_bufs, b_bufs, ready, out_buf, out_ready = _allocate(a_desc, b_desc, out_desc, STAGES)
        out_loads = pid * 0
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))

        issued = pid * 0
        p_i = pid * 0 - 1
        p_k = pid * 0
        p_entries = pid * 0
        p_per = pid * 0 + 1
        p_lo = pid * 0
        p_row_a = pid * 0
        p_row_b = pid * 0
        for _ in gl.static_range(STAGES - 1):
            issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a, p_row_b = _produce_block(
                a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a, p_row_b,
                my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N,
                SCALE_BLOCK, GROUP_M, BAND_CYCLIC, STAGES)

        consumed = pid * 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, hi, blocks, per_block = _block_tile_of(
                i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N, SCALE_BLOCK,
                GROUP_M, BAND_CYCLIC)
            # The scales' row offsets (int32, as the Triton kernel keeps them) beside int64 slot offsets.
            sa_offs = (row_a + rows) * stride_san
            sb_offs = gl.where(row_b + cols < K, row_b + cols, 0) * stride_sbk
            first_slot = lo // SCALE_BLOCK + group
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            for j in range(blocks):
                t0 = lo + j * SCALE_BLOCK
                t1 = gl.minimum(t0 + SCALE_BLOCK, hi)
                # The block's scales first: their loads' latency then hides behind its MMAs.
                scale_slot = (first_slot + j).to(gl.int64)
                sa = gl.load(a_scale_ptr + scale_slot * stride_sas + sa_offs)
                sb = gl.load(b_scale_ptr + scale_slot * stride_sbs + sb_offs)
                slot = consumed % STAGES
                mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
                a_buf = a_bufs.index(slot)
                b_buf = b_bufs.index(slot)
                zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
                if per_block == 1:
                    if t1 - t0 < SCALE_BLOCK:  # a short last block: the next group's tokens zeroed
                        _zero_other_groups(a_buf, t0, t0, t1, SCALE_BLOCK, mask_layout)
                        _zero_other_groups(b_buf, t0, t0, t1, SCALE_BLOCK, mask_layout)
                        fence_async_shared()
                        _cta_barrier()
                    block = warpgroup_mma(a_buf, b_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
                    consumed += 1
                else:
                    start = t0 // 16 * 16
                    next_slot = consumed + 1
                    mbarrier.wait(ready.index(next_slot % STAGES), (next_slot // STAGES) & 1)
                    a_next = a_bufs.index(next_slot % STAGES)
                    b_next = b_bufs.index(next_slot % STAGES)
                    _zero_other_groups(a_buf, start, t0, t1, SCALE_BLOCK, mask_layout)
                    _zero_other_groups(b_buf, start, t0, t1, SCALE_BLOCK, mask_layout)
                    _zero_other_groups(a_next.slice(0, SLICE_K, 1), start + SCALE_BLOCK, t0, t1, SLICE_K, mask_layout)
                    _zero_other_groups(b_next.slice(0, SLICE_K, 1), start + SCALE_BLOCK, t0, t1, SLICE_K, mask_layout)
                    fence_async_shared()
                    _cta_barrier()
                    block = warpgroup_mma(a_buf, b_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
                    block = warpgroup_mma(a_next.slice(0, SLICE_K, 1), b_next.slice(0, SLICE_K, 1).permute((1, 0)),
                                          block, is_async=True)
                    consumed += 2
                # While this block's MMAs run: the next load, into the slot of the previous block's
                # last entry (its MMAs are done). A second one would take this block's first slot.
                issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a, p_row_b = _produce_block(
                    a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a,
                    p_row_b, my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M,
                    BLOCK_N, SCALE_BLOCK, GROUP_M, BAND_CYCLIC, STAGES)
                block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                if per_block == 2:
                    issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a, p_row_b = _produce_block(
                        a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_k, p_lo, p_entries, p_per, p_row_a,
                        p_row_b, my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M,
                        BLOCK_N, SCALE_BLOCK, GROUP_M, BAND_CYCLIC, STAGES)
                acc += block * (sa[:, None] * sb[None, :])
            out_loads = _store_tile(acc, out_desc, out_buf, out_ready, out_loads, group * N + row_a, row_b, hi > lo,
                                    mma_layout, ACCUMULATE, False)
        _release(ready, out_ready, STAGES)
