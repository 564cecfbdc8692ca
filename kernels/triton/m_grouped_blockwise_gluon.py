"""The M-grouped blockwise FP8 GEMM (fwd NT, dgrad NN) in Gluon for Hopper: two cooperative consumers
promoting each 128-K block, the activation scales brought by TMA.

Same problem, tile walk and bits as ``blockwise_gemm.m_grouped_block_scaled_tma_kernel`` under the
blockwise recipe (1 x 128 activation scales, 128 x 128 weight scales)::

    out[offs[g]:offs[g+1]] = sum_k (a[rows, blk_k] @ b[g][:, blk_k]^T) * (sa[rows, k] * sb[g, n // 128, k])

a: [M, K] and b: [G, N, K] (read as one [G*N, K] matrix), both K-contiguous FP8; sa: [M, K // 128]
float32 in block-major storage (``sa[:, k]`` contiguous, ``fine_grained.quantize.quantize_rows``'s
layout); sb: [G, N // 128, K // 128] float32; out: [M, N].

Why a second kernel. Each block's wgmma sum must leave the tensor-core accumulator and be scaled
before the next block's is added (DeepSeek-V3's promotion every 128 of K). In the Triton kernel that
makes every wgmma synchronous: 0.67-0.74x the tensorwise kernel's TFLOPS on the H100. A dense
probe of the promotion loop (``scripts/probe_blockwise_promotion.py``, 32768 x 4096 x 7168, TFLOPS
against the tensorwise Triton kernel of the same call) found three costs and this layout for them:

* the tensor cores idle while a warpgroup scales and adds. Two consumer warpgroups each own 64 rows
  of a 128 x 128 tile and never wait for each other, so one's promotion runs beside the other's
  wgmma (the cooperative layout of CUTLASS's and DeepGEMM's blockwise kernels);
* the activation scales loaded from global memory by the consumers cost about 20% (0.73x), and
  loading them a block ahead did not help. Here the producer's TMA brings block k's 128 row scales
  into the ring slot beside its operands (one box of the flattened block-major scales), and the
  consumers read them from shared memory after the slot's wait: 0.88-0.90x. A TMA box's start
  along a contiguous dimension must be a whole 16 bytes (an unaligned one raised an illegal
  instruction on the H100), and a shared slice's start a whole layout tile, so this holds where a
  tile's scales start on a 16-byte boundary: block-major storage whose column stride is a multiple of
  4 (the host's SCALES_TMA), for groups starting on a multiple of 4 rows (the per-tile
  ``scales_in_ring``: Megatron pads groups to 16 or 32 for FP8). For other tiles the producer copies
  the 128 scales into the slot by cp.async (4-byte copies, any alignment), tracked by the same
  barrier (``cp.async.mbarrier.arrive``), so the consumers always read the ring;
* ptxas before 12.9 does not interleave the promotion's FFMAs with the wgmmas (DeepGEMM's finding;
  a scalar-scale loop ran 0.77x under 12.8, 0.95x under 13.0). Measured both ways: see
  docs/results/h100_fine_grained.md.

The weight block's scale is one scalar per tile and block (a 128 x 128 tile spans one weight block),
loaded a block ahead. A group's rows end anywhere: a consumer whose 64 rows all belong to the group
stores them through a host descriptor over ``out``; the last ones are written from the shared
staging tile by masked stores (``m_grouped_gemm_gluon._store_group_tail``). Rows past a group's end
are computed from the next group's rows and scales and never stored.

Limits (``turbo_moe.fine_grained.triton_gemm.gluon_declined``): sm_90; the blockwise recipe (float32
scales, 128-element blocks); block-major activation scales, 16-byte aligned, fewer than 2**31 of
them; a contiguous 16-byte aligned output with 16-byte rows.
"""

from __future__ import annotations

from . import scheduler as S
from .grouped_gemm_gluon import GLUON_ERROR, gluon

__all__ = ["GLUON_ERROR"]

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .grouped_gemm_gluon import _ring, _ring_barriers, _tma_load, _tma_store
    from .m_grouped_gemm_gluon import _cursor_advance, _cursor_start, _store_group_tail

    # Triton 3.6 names the cp.async copy async_copy_global_to_shared; 3.7+ async_load.
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def _copy_row_scales(sa_buf, ready, a_scale_ptr, k_block, stride_sak, lo, first_row, rows):
        """A tile's BLOCK_M row scales of block ``k_block`` into its ring slot ``sa_buf`` by cp.async
        (4-byte copies: any alignment), completing on the slot's barrier ``ready``: where the TMA box
        cannot start there (a group starting off a multiple of 4 rows, or a column stride that is not
        a whole 16 bytes). Rows past the group's end read its first row's scale (in bounds; never
        stored). Issued before the slot's expect: each thread's tracking raises the barrier's pending
        count before the expect's arrival could complete the phase."""
        BLOCK_M: gl.constexpr = sa_buf.type.shape[0]
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[BLOCK_M // 32], threads_per_warp=[32],
                                                warps_per_cta=[gl.num_warps()], order=[0])
        tile_rows = first_row + gl.arange(0, BLOCK_M, layout=layout)
        source = a_scale_ptr + k_block.to(gl.int64) * stride_sak + lo + gl.where(tile_rows < rows, tile_rows, 0)
        _cp_async(sa_buf, source)
        async_copy.mbarrier_arrive(ready)

    @gluon.jit
    def _producer(p, GROUP_M: gl.constexpr):
        """The load partition: for every block of every tile of this program, the a and b boxes and
        the block's 128 row scales into a ring slot, once both consumers have released it."""
        (a_desc, b_desc, sa_desc, out_desc, out_ptr, a_bufs, b_bufs, sa_bufs, out_bufs, ready, empty, a_scale_ptr,
         b_scale_ptr, group_offs_ptr, N, K, G, stride_om, stride_sak, stride_sbg, stride_sbn, stride_sbk, SCALES_TMA) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        OPERAND_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        num_programs = gl.num_programs(0)
        num_n_blocks = gl.cdiv(N, BLOCK_N)
        num_k_blocks = gl.cdiv(K, BLOCK_K)
        group, first, lo, hi, tiles = _cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
        tile = first + gl.program_id(0)
        issued = 0
        while group < G:
            group, first, lo, hi, tiles = _cursor_advance(tile, group, first, lo, hi, tiles, group_offs_ptr, G, BLOCK_M,
                                                          num_n_blocks)
            if group < G:
                m_block, n_block = S.swizzle_group_m(tile - first, S.cdiv(hi - lo, BLOCK_M), num_n_blocks, GROUP_M)
                row_a = (lo + m_block * BLOCK_M).to(gl.int32)
                row_b = (group * N + n_block * BLOCK_N).to(gl.int32)
                scales_in_ring = SCALES_TMA & (lo % 4 == 0)  # (_scales_in_ring)
                for k_block in range(num_k_blocks):
                    slot = issued % STAGES
                    # Fresh barriers count as having completed phase 1: the first round does not wait.
                    mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)
                    if scales_in_ring:
                        mbarrier.expect(ready.index(slot), OPERAND_BYTES + sa_desc.block_type.nbytes)
                        # sa[row_a:row_a + BLOCK_M, k_block] (past the last row: zeros, never stored)
                        _tma_load(sa_desc, [k_block * stride_sak + row_a], ready.index(slot), sa_bufs.index(slot))
                    else:
                        _copy_row_scales(sa_bufs.index(slot), ready.index(slot), a_scale_ptr, k_block, stride_sak, lo,
                                         m_block * BLOCK_M, hi - lo)
                        mbarrier.expect(ready.index(slot), OPERAND_BYTES)
                    _tma_load(a_desc, [row_a, k_block * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                    _tma_load(b_desc, [row_b, k_block * BLOCK_K], ready.index(slot), b_bufs.index(slot))
                    issued += 1
            tile += num_programs

    @gluon.jit
    def _consumer(p, HALF: gl.constexpr, GROUP_M: gl.constexpr):
        """A math partition: rows HALF * 64 .. HALF * 64 + 63 of every tile of this program. Each
        block's wgmma into a fresh accumulator, waited for, its slot released (``empty`` counts both
        consumers), then promoted as the Triton kernel does: ``acc += block * (sa * sb)``."""
        (a_desc, b_desc, sa_desc, out_desc, out_ptr, a_bufs, b_bufs, sa_bufs, out_bufs, ready, empty, a_scale_ptr,
         b_scale_ptr, group_offs_ptr, N, K, G, stride_om, stride_sak, stride_sbg, stride_sbn, stride_sbk, SCALES_TMA) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        HALF_M: gl.constexpr = out_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        WARPS: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        scale_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        out_buf = out_bufs.index(HALF)
        num_programs = gl.num_programs(0)
        num_n_blocks = gl.cdiv(N, BLOCK_N)
        num_k_blocks = gl.cdiv(K, BLOCK_K)
        zero = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
        group, first, lo, hi, tiles = _cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
        tile = first + gl.program_id(0)
        consumed = 0
        while group < G:
            group, first, lo, hi, tiles = _cursor_advance(tile, group, first, lo, hi, tiles, group_offs_ptr, G, BLOCK_M,
                                                          num_n_blocks)
            if group < G:
                rows = hi - lo
                m_block, n_block = S.swizzle_group_m(tile - first, S.cdiv(rows, BLOCK_M), num_n_blocks, GROUP_M)
                # the tile's weight scale row: one 128 x 128 block across its columns
                sb_ptr = b_scale_ptr + group.to(gl.int64) * stride_sbg + n_block * stride_sbn
                sb_next = gl.load(sb_ptr)
                acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
                for k_block in range(num_k_blocks):
                    slot = consumed % STAGES
                    mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
                    block = warpgroup_mma(a_bufs.index(slot).slice(HALF * HALF_M, HALF_M, 0),
                                          b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
                    sb = sb_next  # loaded a block ahead, while a wgmma ran
                    sb_next = gl.load(sb_ptr + gl.minimum(k_block + 1, num_k_blocks - 1) * stride_sbk)
                    sa = sa_bufs.index(slot).slice(HALF * HALF_M, HALF_M, 0).load(scale_layout)
                    scale = sa * sb
                    block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                    mbarrier.arrive(empty.index(slot), count=1)  # after the scales' read: the slot holds them
                    acc = acc + block * scale[:, None]
                    consumed += 1
                tma.store_wait(pendings=0)  # this consumer's previous store has read out_buf
                out_buf.store(acc.to(out_desc.dtype))
                fence_async_shared()
                row0 = (lo + m_block * BLOCK_M + HALF * HALF_M).to(gl.int32)
                rows_left = rows - m_block * BLOCK_M - HALF * HALF_M
                col0 = (n_block * BLOCK_N).to(gl.int32)
                if rows_left >= HALF_M:
                    _tma_store(out_desc, [row0, col0], out_buf)
                elif rows_left > 0:  # the group's last rows: the ones after them are the next group's
                    _store_group_tail(out_buf, out_ptr, row0, col0, rows_left, N, stride_om, HALF_M, BLOCK_N, WARPS)
            tile += num_programs
        tma.store_wait(pendings=0)

    # One entry point per half: a worker partition's arguments arrive as run-time values, and the
    # half must be a constant (it slices the shared a box and the scales).
    @gluon.jit
    def _consumer_lo(p, GROUP_M: gl.constexpr):
        _consumer(p, 0, GROUP_M)

    @gluon.jit
    def _consumer_hi(p, GROUP_M: gl.constexpr):
        _consumer(p, 1, GROUP_M)

    @gluon.jit
    def m_grouped_block_scaled_coop_kernel(
        a_desc, b_desc, sa_desc, out_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G, stride_om,
        stride_sak, stride_sbg, stride_sbn, stride_sbk, GROUP_M: gl.constexpr, SCALES_TMA: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """a_desc: a [M, K] with [BLOCK_M, 128] boxes; b_desc: b as one [G*N, K] matrix with
        [BLOCK_N, 128] boxes (BLOCK_N = 128: one weight block; columns past N of a group read the
        next group's rows, never stored); sa_desc: the activation scales' block-major storage as one
        flat float32 vector (element k * stride_sak + m is sa[m, k], at ``a_scale_ptr``) with
        BLOCK_M-element boxes. SCALES_TMA (stride_sak a multiple of 4): the scales of groups starting
        on a multiple of 4 rows come by TMA; without it, and for other groups, by the producer's
        cp.async (``_copy_row_scales``);
        out_desc: out [M, N] with [BLOCK_M / 2, BLOCK_N] boxes. num_warps: one consumer's (4, a
        warpgroup); the kernel runs two consumers and a producer warp."""
        a_bufs = _ring(a_desc, STAGES)
        b_bufs = _ring(b_desc, STAGES)
        sa_bufs = _ring(sa_desc, STAGES)
        out_bufs = _ring(out_desc, 2)  # a staging tile per consumer
        ready, empty = _ring_barriers(STAGES, 2)  # empty: both consumers' halves
        p = (a_desc, b_desc, sa_desc, out_desc, out_ptr, a_bufs, b_bufs, sa_bufs, out_bufs, ready, empty, a_scale_ptr,
             b_scale_ptr, group_offs_ptr, N, K, G, stride_om, stride_sak, stride_sbg, stride_sbn, stride_sbk, SCALES_TMA)
        gl.warp_specialize([(_consumer_lo, (p, GROUP_M)), (_consumer_hi, (p, GROUP_M)), (_producer, (p, GROUP_M))],
                           [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
