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
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .grouped_gemm_gluon import (_allocate, _cta_barrier, _group_tile, _load_slot, _program_tiles, _release, _ring,
                                     _ring_barriers, _store_tile, _tma_load, _zero_other_groups)

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

    # ------------------------------------------------------------------------------------------------
    # The cooperative variant: a producer warp and two consumer warpgroups (warp-specialized), each
    # consumer 64 rows of a 128 x 128 tile, the block's row and column scales brought into the ring by
    # the producer's TMA. The M-grouped kernel's layout (m_grouped_blockwise_gluon: 0.73x -> 0.83-0.95x
    # tensorwise on the H100) on the wgrad's token walk.

    @gluon.jit
    def _coop_producer(p, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        """The load partition: every ring entry of every tile of this program (one a block on a
        16-token boundary, else two: ``_produce_block``'s walk), and with a block's first entry its
        128 row scales (a's) and 128 column scales (b's), once both consumers released the slot."""
        (a_desc, b_desc, sa_desc, sb_desc, out_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, out_bufs, ready, empty,
         masked, out_ready, group_offs_ptr, N, K, G, stride_sas, stride_sbs) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        SCALE_BLOCK: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        OPERAND_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        SCALE_BYTES: gl.constexpr = sa_desc.block_type.nbytes + sb_desc.block_type.nbytes
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)
        issued = 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, hi, blocks, per_block = _block_tile_of(
                i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N, SCALE_BLOCK,
                GROUP_M, BAND_CYCLIC)
            first_slot = lo // SCALE_BLOCK + group
            for entry in range(blocks * per_block):
                slot = issued % STAGES
                # Fresh barriers count as having completed phase 1: the first round does not wait.
                mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)
                j = gl.where(per_block == 1, entry, entry // 2)
                block_token = lo + j * SCALE_BLOCK
                # Aligned: the block's first token. Off 16: that token rounded down to 16, then the box after it.
                token = gl.where(per_block == 1, block_token, block_token // 16 * 16 + (entry % 2) * SCALE_BLOCK)
                if (per_block == 1) | (entry % 2 == 0):  # a block's first entry carries its scales
                    mbarrier.expect(ready.index(slot), OPERAND_BYTES + SCALE_BYTES)
                    scale_slot = first_slot + j
                    _tma_load(sa_desc, [scale_slot * stride_sas + row_a], ready.index(slot), sa_bufs.index(slot))
                    _tma_load(sb_desc, [scale_slot * stride_sbs + row_b], ready.index(slot), sb_bufs.index(slot))
                else:
                    mbarrier.expect(ready.index(slot), OPERAND_BYTES)
                _tma_load(a_desc, [row_a, token], ready.index(slot), a_bufs.index(slot))
                _tma_load(b_desc, [row_b, token], ready.index(slot), b_bufs.index(slot))
                issued += 1

    @gluon.jit
    def _zero_halves(a_buf, b_buf, HALF: gl.constexpr, first_token, lo, hi, WIDTH: gl.constexpr,
                     layout: gl.constexpr):
        """This consumer's share of a box's masking: the tokens outside [lo, hi) zeroed in its own 64
        rows of a and in half of b's rows (the other consumer zeroes the other half)."""
        HALF_M: gl.constexpr = a_buf.type.shape[0] // 2
        HALF_N: gl.constexpr = b_buf.type.shape[0] // 2
        _zero_other_groups(a_buf.slice(HALF * HALF_M, HALF_M, 0), first_token, lo, hi, WIDTH, layout)
        _zero_other_groups(b_buf.slice(HALF * HALF_N, HALF_N, 0), first_token, lo, hi, WIDTH, layout)

    @gluon.jit
    def _both_masked(masked, count):
        """Both consumers have zeroed their halves of the slots a masked block reads (``masked``
        counts one arrival from each), and their stores are visible to the tensor cores."""
        fence_async_shared()
        mbarrier.arrive(masked, count=1)
        mbarrier.wait(masked, count & 1)
        fence_async_shared()  # the other consumer's stores, before this one's wgmmas read them
        return count + 1

    @gluon.jit
    def _coop_consumer(p, HALF: gl.constexpr, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        """A math partition: rows HALF * 64 .. HALF * 64 + 63 of every tile of this program. Each block
        as the single-stream kernel runs it (its wgmmas into a fresh accumulator; a short or
        off-16 block's other tokens zeroed first, in shared memory, this consumer's halves), waited
        for, its slots released (``empty`` counts both consumers), and promoted by the scales from the
        ring: ``acc += block * (sa[:, None] * sb[None, :])``, the Triton kernel's formula."""
        (a_desc, b_desc, sa_desc, sb_desc, out_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, out_bufs, ready, empty,
         masked, out_ready, group_offs_ptr, N, K, G, stride_sas, stride_sbs) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        SCALE_BLOCK: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF_M: gl.constexpr = out_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        # Read off the output's dtype (a worker partition's flags arrive as run-time values): the host
        # passes a float32 output only to add into (triton_gemm.coop_declined).
        ACCUMULATE: gl.constexpr = out_desc.dtype == gl.float32
        SLICE_K: gl.constexpr = 32  # the FP8 wgmma's K: the Triton kernel's narrow boxes
        WARPS: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        mask_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                                     warps_per_cta=[WARPS, 1], order=[1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        out_buf = out_bufs.index(HALF)
        out_ready_half = out_ready.index(HALF)
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)
        zero = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
        consumed = 0
        masked_count = 0
        out_loads = 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, hi, blocks, per_block = _block_tile_of(
                i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N, SCALE_BLOCK,
                GROUP_M, BAND_CYCLIC)
            acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
            for j in range(blocks):
                t0 = lo + j * SCALE_BLOCK
                t1 = gl.minimum(t0 + SCALE_BLOCK, hi)
                slot = consumed % STAGES
                mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
                a_buf = a_bufs.index(slot)
                b_buf = b_bufs.index(slot)
                next_slot = (consumed + 1) % STAGES  # an off-16 block's second entry
                if per_block == 1:
                    if t1 - t0 < SCALE_BLOCK:  # a short last block: the next group's tokens zeroed
                        _zero_halves(a_buf, b_buf, HALF, t0, t0, t1, SCALE_BLOCK, mask_layout)
                        masked_count = _both_masked(masked, masked_count)
                    block = warpgroup_mma(a_buf.slice(HALF * HALF_M, HALF_M, 0), b_buf.permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                else:
                    start = t0 // 16 * 16
                    mbarrier.wait(ready.index(next_slot), ((consumed + 1) // STAGES) & 1)
                    a_next = a_bufs.index(next_slot)
                    b_next = b_bufs.index(next_slot)
                    _zero_halves(a_buf, b_buf, HALF, start, t0, t1, SCALE_BLOCK, mask_layout)
                    _zero_halves(a_next.slice(0, SLICE_K, 1), b_next.slice(0, SLICE_K, 1), HALF, start + SCALE_BLOCK,
                                 t0, t1, SLICE_K, mask_layout)
                    masked_count = _both_masked(masked, masked_count)
                    block = warpgroup_mma(a_buf.slice(HALF * HALF_M, HALF_M, 0), b_buf.permute((1, 0)), zero,
                                          use_acc=False, is_async=True)
                    block = warpgroup_mma(a_next.slice(HALF * HALF_M, HALF_M, 0).slice(0, SLICE_K, 1),
                                          b_next.slice(0, SLICE_K, 1).permute((1, 0)), block, is_async=True)
                # The block's scales, from its first entry's slot, while its wgmmas run.
                sa = sa_bufs.index(slot).slice(HALF * HALF_M, HALF_M, 0).load(row_layout)
                sb = sb_bufs.index(slot).load(col_layout)
                block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                mbarrier.arrive(empty.index(slot), count=1)  # after the scales' reads: the slot holds them
                if per_block == 2:
                    mbarrier.arrive(empty.index(next_slot), count=1)
                consumed += per_block
                acc += block * (sa[:, None] * sb[None, :])
            out_loads = _store_tile(acc, out_desc, out_buf, out_ready_half, out_loads,
                                    group * N + row_a + HALF * HALF_M, row_b, hi > lo, mma_layout, ACCUMULATE, False)
        tma.store_wait(pendings=0)

    # One entry point per half: a worker partition's arguments arrive as run-time values, and the
    # half must be a constant (it slices the shared boxes and scales).
    @gluon.jit
    def _coop_consumer_lo(p, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        _coop_consumer(p, 0, GROUP_M, BAND_CYCLIC)

    @gluon.jit
    def _coop_consumer_hi(p, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        _coop_consumer(p, 1, GROUP_M, BAND_CYCLIC)

    @gluon.jit
    def k_grouped_block_scaled_coop_kernel(
        a_desc, b_desc, sa_desc, sb_desc, out_desc, group_offs_ptr, N, K, G, stride_sas, stride_sbs,
        GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """``k_grouped_block_scaled_gluon_kernel``'s problem, tile order, token walk and bits, warp-
        specialized and cooperative. a_desc: a [N, M] with [128, 128] boxes; b_desc: b [K, M] with
        [128, 128] boxes; sa_desc / sb_desc: the scales' slot-major storage as flat float32 vectors
        (slot s's scale of a's row n at s * stride_sas + n; of b's row k at s * stride_sbs + k) with
        128-element boxes (N, K and both strides multiples of 4: every box on a 16-byte boundary);
        out_desc: out as one [G*N, K] matrix with [64, 128] boxes (N a multiple of 128), float32 to
        add into (``main_grad``: an empty group's tiles neither read nor written) or 16-bit.
        num_warps: one consumer's (4)."""
        a_bufs = _ring(a_desc, STAGES)
        b_bufs = _ring(b_desc, STAGES)
        sa_bufs = _ring(sa_desc, STAGES)
        sb_bufs = _ring(sb_desc, STAGES)
        out_bufs = _ring(out_desc, 2)  # a staging tile per consumer
        ready, empty = _ring_barriers(STAGES, 2)
        masked = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(masked, count=2)
        out_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(out_ready.index(c), count=1)
        p = (a_desc, b_desc, sa_desc, sb_desc, out_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, out_bufs, ready, empty,
             masked, out_ready, group_offs_ptr, N, K, G, stride_sas, stride_sbs)
        gl.warp_specialize([(_coop_consumer_lo, (p, GROUP_M, BAND_CYCLIC)), (_coop_consumer_hi, (p, GROUP_M, BAND_CYCLIC)),
                            (_coop_producer, (p, GROUP_M, BAND_CYCLIC))], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
