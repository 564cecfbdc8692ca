"""Probe behind docs/results/h100_fine_grained.md: how fast can a blockwise (1x128 activation,
128x128 weight scales) FP8 promotion loop run on Hopper, in Triton and in Gluon?

    python scripts/probe_blockwise_promotion.py        (needs an sm_90 GPU; Triton 3.6's Gluon API)

One dense 32768 x 4096 x 7168 GEMM (plain tile grid, TMA loads, 128 x 128 x 128 tiles, 8 warps):

* Triton: tensorwise with fast accumulation (the ceiling), Triton's own promotion
  (``max_num_imprecise_acc=128``, no scales), and the blockwise loop the library runs
  (``acc += dot(a, b^T) * scales``: Triton makes that dot synchronous);
* Gluon: the same loop with explicit wgmmas -- synchronous (``OVERLAP=0``) and with two
  accumulators in turn, so block k's wgmma runs while block k-1's result is promoted
  (``warpgroup_mma_wait(num_outstanding=1)``). One accumulator carried across iterations
  (``prev = cur``) made ptxas serialize the wgmmas (warning C7514: an in-flight accumulator
  copied); the pair-unrolled loop never copies one.

* Gluon, warp-specialized (``gl_ws_blockwise_kernel``, ``gl.warp_specialize``): persistent, a
  one-warp TMA partition filling the ring and the 8-warp math partition releasing each slot on an
  mbarrier, with one block accumulator or two in turn.
* Gluon, two independent pipelines in one program (``gl_two_pipe_blockwise_kernel``): each a
  producer warp with its own ring and a one-warpgroup math partition on 64 x 128 tiles (two block
  accumulators), taking the program's tiles in turn; one's promotions beside the other's wgmmas.

Then the library's own M-grouped blockwise problem at the bench's DeepSeek-V3 expert shapes:
``triton_gemm.run`` (the TMA promotion loop) against ``gl_grouped_blockwise_kernel`` (the
overlapped loop, one tile per program, tiles found with the shared scheduler's functions).

Not a library path (yet): Gluon is experimental API whose spelling changes between Triton
releases, and it has no interpreter for the CPU CI. Prints TFLOPS and the relative error against
a float32 evaluation of the same block-scaled sum (dense) or against the library's output
(grouped).
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor as TritonDescriptor

from turbo_moe.kernels.triton import scheduler as S

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as exc:  # a Triton without Gluon's Hopper API
    gluon = None
    _GLUON_ERROR = exc


@triton.jit
def triton_probe_kernel(a_desc, b_desc, out_ptr, sa_ptr, sb_ptr, M, N, K, stride_om,
                 MODE: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """MODE 0: tensorwise (fast accumulation); 1: Triton's own promotion (max_num_imprecise_acc);
    2: the blockwise promotion loop of kernels/triton/blockwise_gemm.py (one weight scale block
    spans the tile's columns)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsz = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    kb = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, kb, num_stages=STAGES, warp_specialize=WS):
        a = a_desc.load([row0, k * BLOCK_K])
        b = b_desc.load([col0, k * BLOCK_K])
        if MODE == 0:
            acc = tl.dot(a, b.T, acc)
        elif MODE == 1:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            sa = tl.load(sa_ptr + k * M + rows)
            sb = tl.load(sb_ptr + (col0 // 128) * kb + k)
            acc += tl.dot(a, b.T) * (sa * sb)[:, None]
    offs_n = col0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(tl.bfloat16))



if gluon is not None:

    @gluon.jit
    def _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, blk, kb, off_m, off_n, STAGES: gl.constexpr, BLOCK_K: gl.constexpr,
                    nbytes: gl.constexpr):
        if blk < kb:
            st = blk % STAGES
            mbarrier.expect(bars.index(st), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, blk * BLOCK_K], bars.index(st), a_bufs.index(st))
            tma.async_copy_global_to_shared(b_desc, [off_n, blk * BLOCK_K], bars.index(st), b_bufs.index(st))


    @gluon.jit
    def _issue_block(a_bufs, b_bufs, bars, k, zero, sa_rows, stride_sak, sb_base, stride_sbk, STAGES: gl.constexpr):
        """Block k's wgmma (in flight on return) and its rows' scales times the weight block's."""
        st = k % STAGES
        mbarrier.wait(bars.index(st), (k // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        scale = gl.load(sa_rows + k * stride_sak) * gl.load(sb_base + k * stride_sbk)
        return acc, scale


    @gluon.jit
    def _overlapped_blocks(a_desc, b_desc, a_bufs, b_bufs, bars, kb, off_m, off_n, zero, acc, sa_rows, stride_sak,
                           sb_base, stride_sbk, STAGES: gl.constexpr, BLOCK_K: gl.constexpr, nbytes: gl.constexpr):
        """acc + the promoted blocks of one tile (kb >= 1): two accumulators in turn, x and y, so
        that no in-flight accumulator is ever copied; block k's wgmma runs while block k-1's result
        is promoted. The ring's barriers start fresh (phase 0) for each call."""
        for i in gl.static_range(STAGES - 1):
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, i, kb, off_m, off_n, STAGES, BLOCK_K, nbytes)
        x, x_scale = _issue_block(a_bufs, b_bufs, bars, 0, zero, sa_rows, stride_sak, sb_base, stride_sbk, STAGES)
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, STAGES - 1, kb, off_m, off_n, STAGES, BLOCK_K, nbytes)
        for k in range(1, kb - 1, 2):
            y, y_scale = _issue_block(a_bufs, b_bufs, bars, k, zero, sa_rows, stride_sak, sb_base, stride_sbk, STAGES)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
            acc += done * gl.expand_dims(x_scale, 1)
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, k + STAGES - 1, kb, off_m, off_n, STAGES, BLOCK_K, nbytes)
            x, x_scale = _issue_block(a_bufs, b_bufs, bars, k + 1, zero, sa_rows, stride_sak, sb_base, stride_sbk,
                                      STAGES)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(y,))
            acc += done * gl.expand_dims(y_scale, 1)
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, k + STAGES, kb, off_m, off_n, STAGES, BLOCK_K, nbytes)
        if kb % 2 == 0:  # one block left after the pairs
            y, y_scale = _issue_block(a_bufs, b_bufs, bars, kb - 1, zero, sa_rows, stride_sak, sb_base, stride_sbk,
                                      STAGES)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
            acc += done * gl.expand_dims(x_scale, 1)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(y,))
            acc += done * gl.expand_dims(y_scale, 1)
        else:
            done = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
            acc += done * gl.expand_dims(x_scale, 1)
        return acc



    @gluon.jit
    def gl_blockwise_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                            STAGES: gl.constexpr, OVERLAP: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        group_id = pid // width
        first_m = group_id * GROUP_M
        gsz = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsz
        pid_n = (pid % width) // gsz
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        kb = gl.cdiv(K, BLOCK_K)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        rows = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
        zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
        sb_row = sb_ptr + (off_n // 128) * kb
        if OVERLAP:
            acc = _overlapped_blocks(a_desc, b_desc, a_bufs, b_bufs, bars, kb, off_m, off_n, zero, acc, sa_ptr + rows,
                                     M, sb_row, 1, STAGES, BLOCK_K, nbytes)
        else:
            for i in gl.static_range(STAGES - 1):
                _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, i, kb, off_m, off_n, STAGES, BLOCK_K, nbytes)
            for k in range(kb):
                st = k % STAGES
                mbarrier.wait(bars.index(st), (k // STAGES) & 1)
                cur = warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
                scale = gl.load(sa_ptr + k * M + rows) * gl.load(sb_row + k)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
                acc += done * gl.expand_dims(scale, 1)
                nxt = k + STAGES - 1
                if nxt < kb:
                    ns = nxt % STAGES
                    mbarrier.expect(bars.index(ns), nbytes)
                    tma.async_copy_global_to_shared(a_desc, [off_m, nxt * BLOCK_K], bars.index(ns), a_bufs.index(ns))
                    tma.async_copy_global_to_shared(b_desc, [off_n, nxt * BLOCK_K], bars.index(ns), b_bufs.index(ns))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)



    @gluon.jit
    def gl_grouped_blockwise_kernel(a_desc, b_desc, out_ptr, sa_ptr, sb_ptr, offs_ptr, N, K, G, stride_om,
                                    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
                                    STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        """The library's M-grouped blockwise problem (``fine_grained.gemm``, weights [G, N, K] seen as
        one [G*N, K] matrix, 128x128 weight blocks) with the overlapped promotion: one tile per
        program, found with the shared scheduler's functions from the tile id (a cursor from
        group 0), rows past the group's end loaded but never stored."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        tile = gl.program_id(0).to(gl.int64)
        num_n_blocks = S.cdiv(N, BLOCK_N)
        group = gl.program_id(0) * 0
        first = tile * 0
        lo = gl.load(offs_ptr)
        hi = gl.load(offs_ptr + 1)
        tiles = S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
        while (tile >= first + tiles) & (group < G):
            first += tiles
            group += 1
            lo = hi
            hi = gl.load(offs_ptr + gl.minimum(group + 1, G))
            tiles = S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
        if group < G:
            rows_in_group = hi - lo
            m_block, n_block = S.swizzle_group_m(tile - first, S.cdiv(rows_in_group, BLOCK_M), num_n_blocks, GROUP_M)
            off_m = (lo + m_block * BLOCK_M).to(gl.int32)
            off_n = (group * N + n_block * BLOCK_N).to(gl.int32)
            mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                 instr_shape=[16, BLOCK_N, 32])
            row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
            col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
            a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
            b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
            offs_m = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
            load_rows = lo + gl.where(offs_m < rows_in_group, offs_m, 0)
            sb_base = (sb_ptr + group.to(gl.int64) * stride_sbg
                       + ((n_block * BLOCK_N) // 128).to(gl.int64) * stride_sbn)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            acc = _overlapped_blocks(a_desc, b_desc, a_bufs, b_bufs, bars, S.cdiv(K, BLOCK_K), off_m, off_n, zero, acc,
                                     sa_ptr + load_rows * stride_sam, stride_sak, sb_base, stride_sbk, STAGES,
                                     BLOCK_K, nbytes)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))
            offs_n = n_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            ptrs = (out_ptr + gl.expand_dims(lo + offs_m, 1) * stride_om + gl.expand_dims(offs_n, 0))
            mask = gl.expand_dims(offs_m < rows_in_group, 1) & gl.expand_dims(offs_n < N, 0)
            gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


    @gluon.jit
    def _ws_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, tile0, tile_step):
        """The one-warp load partition: every (tile, block) of its tiles (tile0, tile0 + tile_step,
        ...) into the ring, a slot reloaded once the math partition has released it on ``empty``."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        kb = gl.cdiv(K, BLOCK_K)
        n = 0
        for tile in range(tile0, num_pid_m * num_pid_n, tile_step):
            pid_m, pid_n = S.swizzle_group_m(tile, num_pid_m, num_pid_n, GROUP_M)
            for k in range(kb):
                s = n % STAGES
                mbarrier.wait(empty.index(s), ((n // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                n += 1


    @gluon.jit
    def _coop_scales_producer(a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, ready, empty, M, N, K,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, tile0, tile_step, sbc_desc,
                              BOXES: gl.constexpr):
        """``_ws_producer`` that also loads block k's 128 row scales (``sa_desc``: the [K // BLOCK_K, M]
        scales flattened, BLOCK_M-float boxes) into the slot's first ``sa_bufs`` entry, on the same
        barrier; with BOXES = 2 also its 128 column scales (``sbc_desc``: [K // BLOCK_K, N] flattened)
        into the second: the wgrad's per-block outer product of scales."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        kb = gl.cdiv(K, BLOCK_K)
        n = 0
        for tile in range(tile0, num_pid_m * num_pid_n, tile_step):
            pid_m, pid_n = S.swizzle_group_m(tile, num_pid_m, num_pid_n, GROUP_M)
            for k in range(kb):
                s = n % STAGES
                mbarrier.wait(empty.index(s), ((n // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                + BOXES * sa_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                tma.async_copy_global_to_shared(sa_desc, [k * M + pid_m * BLOCK_M], ready.index(s),
                                                sa_bufs.index(s * BOXES))
                if BOXES == 2:
                    tma.async_copy_global_to_shared(sbc_desc, [k * N + pid_n * BLOCK_N], ready.index(s),
                                                    sa_bufs.index(s * BOXES + 1))
                n += 1


    @gluon.jit
    def _ws_block(a_bufs, b_bufs, ready, n, zero, sa_rows, sb_row, k, M, STAGES: gl.constexpr):
        """Ring entry n (block k of the tile): its wgmma in flight on return, and its scales."""
        s = n % STAGES
        mbarrier.wait(ready.index(s), (n // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        return acc, gl.load(sa_rows + k * M) * gl.load(sb_row + k)


    @gluon.jit
    def _ws_promote(acc, done, scale, empty, n, STAGES: gl.constexpr):
        """Release ring entry n (its wgmma is done) and promote its block into acc."""
        mbarrier.arrive(empty.index(n % STAGES), count=1)
        return acc + done * gl.expand_dims(scale, 1)


    @gluon.jit
    def _ws_math(a_bufs, b_bufs, ready, empty, c_desc, c_smem, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr, TWO_ACC: gl.constexpr, num_warps: gl.constexpr, tile0, tile_step):
        """The math partition (num_warps warps, 16 rows of the tile each): per tile (tile0, tile0 +
        tile_step, ...), every block's wgmma and promotion -- with TWO_ACC, two block accumulators
        in turn as in ``_overlapped_blocks`` -- then the epilogue's TMA store, waited for one tile
        later."""
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = 128
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        kb = gl.cdiv(K, BLOCK_K)
        zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
        n = 0
        for tile in range(tile0, num_pid_m * num_pid_n, tile_step):
            pid_m, pid_n = S.swizzle_group_m(tile, num_pid_m, num_pid_n, GROUP_M)
            sa_rows = sa_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
            sb_row = sb_ptr + (pid_n * BLOCK_N // 128) * kb
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            if TWO_ACC:
                x, x_scale = _ws_block(a_bufs, b_bufs, ready, n, zero, sa_rows, sb_row, 0, M, STAGES)
                for k in range(1, kb - 1, 2):
                    y, y_scale = _ws_block(a_bufs, b_bufs, ready, n + k, zero, sa_rows, sb_row, k, M, STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(x,)), x_scale, empty, n + k - 1,
                                      STAGES)
                    x, x_scale = _ws_block(a_bufs, b_bufs, ready, n + k + 1, zero, sa_rows, sb_row, k + 1, M, STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(y,)), y_scale, empty, n + k,
                                      STAGES)
                if kb % 2 == 0:
                    y, y_scale = _ws_block(a_bufs, b_bufs, ready, n + kb - 1, zero, sa_rows, sb_row, kb - 1, M, STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(x,)), x_scale, empty, n + kb - 2,
                                      STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(y,)), y_scale, empty, n + kb - 1,
                                      STAGES)
                else:
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(x,)), x_scale, empty, n + kb - 1,
                                      STAGES)
            else:
                for k in range(kb):
                    cur, scale = _ws_block(a_bufs, b_bufs, ready, n + k, zero, sa_rows, sb_row, k, M, STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(cur,)), scale, empty, n + k,
                                      STAGES)
            n += kb
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
        tma.store_wait(pendings=0)


    @gluon.jit
    def gl_ws_blockwise_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                               STAGES: gl.constexpr, TWO_ACC: gl.constexpr, num_warps: gl.constexpr):
        """The dense blockwise problem, persistent and warp-specialized (``gl.warp_specialize``): a
        one-warp TMA partition fills the ring while the math partition (num_warps warps) runs the
        wgmmas and promotions, each slot released on its own mbarrier (no CTA-wide barrier
        between loads and MMAs)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        pid, programs = gl.program_id(0), gl.num_programs(0)
        gl.warp_specialize([
            (_ws_math, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, sa_ptr, sb_ptr, M, N, K, GROUP_M, STAGES,
                        TWO_ACC, num_warps, pid, programs)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, STAGES, pid, programs)),
        ], [1], [40])


    @gluon.jit
    def gl_two_pipe_blockwise_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                                     STAGES: gl.constexpr, num_warps: gl.constexpr):
        """Two independent pipelines in one persistent program: each a one-warp TMA partition with
        its own ring and a one-warpgroup math partition (64-row tiles, so that two block
        accumulators fit beside the main one), the pipelines taking this program's tiles in turn.
        Neither waits for the other: one's promotions and epilogue run beside the other's wgmmas,
        where the warp-specialized kernel's two warpgroups, sharing one tile, move in step."""
        a0 = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b0 = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        a1 = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b1 = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready0.index(s), count=1)
            mbarrier.init(empty0.index(s), count=1)
            mbarrier.init(ready1.index(s), count=1)
            mbarrier.init(empty1.index(s), count=1)
        c0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        pid, programs = gl.program_id(0), gl.num_programs(0)
        gl.warp_specialize([
            (_ws_math, (a0, b0, ready0, empty0, c_desc, c0, sa_ptr, sb_ptr, M, N, K, GROUP_M, STAGES, True,
                        num_warps, pid, 2 * programs)),
            (_ws_math, (a1, b1, ready1, empty1, c_desc, c1, sa_ptr, sb_ptr, M, N, K, GROUP_M, STAGES, True,
                        num_warps, pid + programs, 2 * programs)),
            (_ws_producer, (a_desc, b_desc, a0, b0, ready0, empty0, M, N, K, GROUP_M, STAGES, pid, 2 * programs)),
            (_ws_producer, (a_desc, b_desc, a1, b1, ready1, empty1, M, N, K, GROUP_M, STAGES, pid + programs,
                            2 * programs)),
        ], [num_warps, 1, 1], [224, 40, 40])


    @gluon.jit
    def _coop_block(a_bufs, b_bufs, ready, n, zero, sa_rows, sb_row, k, M, STAGES: gl.constexpr, HALF: gl.constexpr,
                    USE_ACC: gl.constexpr = False):
        """Ring entry n (block k of the tile), rows HALF * 64.. of its a box: the wgmma in flight on
        return, and the block's scales."""
        s = n % STAGES
        mbarrier.wait(ready.index(s), (n // STAGES) & 1)
        rows: gl.constexpr = zero.shape[0]
        acc = warpgroup_mma(a_bufs.index(s).slice(HALF * rows, rows, 0), b_bufs.index(s).permute((1, 0)), zero,
                            use_acc=USE_ACC, is_async=True)
        return acc, gl.load(sa_rows + k * M) * gl.load(sb_row + k)


    @gluon.jit
    def _coop_math(a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, HALF: gl.constexpr, TWO_ACC: gl.constexpr, NO_SCALE: gl.constexpr,
                   PREFETCH: gl.constexpr, PROMOTE_MODE: gl.constexpr, tile0, tile_step, sa_bufs,
                   SA_SMEM: gl.constexpr):
        """One consumer warpgroup of the cooperative kernel: rows HALF * 64 .. HALF * 64 + 63 of every
        128-row tile of this program, each block's wgmma into a fresh accumulator, waited for, its
        ring slot released (``empty`` counts both consumers' arrivals) and promoted; then its half of
        the tile stored. The two consumers do not wait for each other: one's promotion runs beside
        the other's wgmmas."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = 2 * HALF_M
        BLOCK_K: gl.constexpr = 128
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        kb = gl.cdiv(K, BLOCK_K)
        zero = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
        c_smem = c_smems.index(HALF)
        n = 0
        for tile in range(tile0, num_pid_m * num_pid_n, tile_step):
            pid_m, pid_n = S.swizzle_group_m(tile, num_pid_m, num_pid_n, GROUP_M)
            sa_rows = sa_ptr + pid_m * BLOCK_M + HALF * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, mma_layout))
            sb_row = sb_ptr + (pid_n * BLOCK_N // 128) * kb
            acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
            if TWO_ACC:  # block k's wgmma in flight while block k-1 is promoted (pair-unrolled: no
                # accumulator is copied while its wgmma runs, which made ptxas serialize them)
                x, x_scale = _coop_block(a_bufs, b_bufs, ready, n, zero, sa_rows, sb_row, 0, M, STAGES, HALF)
                for k in range(1, kb - 1, 2):
                    y, y_scale = _coop_block(a_bufs, b_bufs, ready, n + k, zero, sa_rows, sb_row, k, M, STAGES, HALF)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(x,)), x_scale, empty, n + k - 1,
                                      STAGES)
                    x, x_scale = _coop_block(a_bufs, b_bufs, ready, n + k + 1, zero, sa_rows, sb_row, k + 1, M, STAGES,
                                             HALF)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(y,)), y_scale, empty, n + k,
                                      STAGES)
                if kb % 2 == 0:
                    y, y_scale = _coop_block(a_bufs, b_bufs, ready, n + kb - 1, zero, sa_rows, sb_row, kb - 1, M, STAGES,
                                             HALF)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=1, deps=(x,)), x_scale, empty, n + kb - 2,
                                      STAGES)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(y,)), y_scale, empty, n + kb - 1,
                                      STAGES)
                else:
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(x,)), x_scale, empty, n + kb - 1,
                                      STAGES)
            elif NO_SCALE:  # timing only: the same loop without promotion (acc carried in the wgmma)
                for k in range(kb):
                    acc, _ = _coop_block(a_bufs, b_bufs, ready, n + k, acc, sa_rows, sb_row, k, M, STAGES, HALF, True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index((n + k) % STAGES), count=1)
            elif PROMOTE_MODE > 0:  # timing only: 1 adds each block unscaled, 2 keeps only the last block
                for k in range(kb):
                    s = (n + k) % STAGES
                    mbarrier.wait(ready.index(s), ((n + k) // STAGES) & 1)
                    block = warpgroup_mma(a_bufs.index(s).slice(HALF * HALF_M, HALF_M, 0), b_bufs.index(s).permute((1, 0)),
                                          zero, use_acc=False, is_async=True)
                    block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                    mbarrier.arrive(empty.index(s), count=1)
                    if PROMOTE_MODE == 1:
                        acc = acc + block
                    elif PROMOTE_MODE == 3:  # a scale per block, no load: a run-time scalar
                        acc = acc + block * (k + 1).to(gl.float32)
                    elif PROMOTE_MODE == 4:  # the rows' scales loaded, the weight block's not
                        acc = acc + block * gl.expand_dims(gl.load(sa_rows + k * M), 1)
                    elif PROMOTE_MODE == 5:  # the weight block's scale loaded, the rows' not
                        acc = acc + block * gl.load(sb_row + k)
                    else:
                        acc = block
            elif SA_SMEM == 2:  # the wgrad's promotion: row and column scales from the ring, their outer product
                row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
                col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
                for k in range(kb):
                    s = (n + k) % STAGES
                    mbarrier.wait(ready.index(s), ((n + k) // STAGES) & 1)
                    block = warpgroup_mma(a_bufs.index(s).slice(HALF * HALF_M, HALF_M, 0),
                                          b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                    rows_scale = sa_bufs.index(2 * s).slice(HALF * HALF_M, HALF_M, 0).load(row_layout)
                    cols_scale = sa_bufs.index(2 * s + 1).load(col_layout)
                    block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                    mbarrier.arrive(empty.index(s), count=1)  # after the scales' reads: the slot holds them
                    acc = acc + block * (gl.expand_dims(rows_scale, 1) * gl.expand_dims(cols_scale, 0))
            elif SA_SMEM:  # the rows' scales from the ring (the producer's TMA put them beside the block)
                sa_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
                sb_next = gl.load(sb_row)
                for k in range(kb):
                    s = (n + k) % STAGES
                    mbarrier.wait(ready.index(s), ((n + k) // STAGES) & 1)
                    block = warpgroup_mma(a_bufs.index(s).slice(HALF * HALF_M, HALF_M, 0),
                                          b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                    sb_k = sb_next  # the weight block's scale, loaded a block ahead
                    sb_next = gl.load(sb_row + gl.minimum(k + 1, kb - 1))
                    scale = sa_bufs.index(s).slice(HALF * HALF_M, HALF_M, 0).load(sa_layout) * sb_k
                    block = warpgroup_mma_wait(num_outstanding=0, deps=(block,))
                    mbarrier.arrive(empty.index(s), count=1)  # after the scale read: the slot holds it
                    acc = acc + block * gl.expand_dims(scale, 1)
            elif PREFETCH:  # the next block's scales loaded while this block's wgmma runs
                scale = gl.load(sa_rows) * gl.load(sb_row)
                for k in range(kb):
                    block, _ = _coop_block(a_bufs, b_bufs, ready, n + k, zero, sa_rows, sb_row, k, M, STAGES, HALF)
                    k_next = gl.minimum(k + 1, kb - 1)
                    scale_next = gl.load(sa_rows + k_next * M) * gl.load(sb_row + k_next)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(block,)), scale, empty, n + k,
                                      STAGES)
                    scale = scale_next
            else:
                for k in range(kb):
                    block, scale = _coop_block(a_bufs, b_bufs, ready, n + k, zero, sa_rows, sb_row, k, M, STAGES, HALF)
                    acc = _ws_promote(acc, warpgroup_mma_wait(num_outstanding=0, deps=(block,)), scale, empty, n + k,
                                      STAGES)
            n += kb
            tma.store_wait(pendings=0)  # this consumer's previous store has read its c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M + HALF * HALF_M, pid_n * BLOCK_N], c_smem)
        tma.store_wait(pendings=0)


    # One entry point per half: a worker partition's arguments arrive as run-time values, and the
    # half must be a constant (it slices the shared a box), so each partition binds its own.
    @gluon.jit
    def _coop_math_lo(a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, TWO_ACC: gl.constexpr, NO_SCALE: gl.constexpr, PREFETCH: gl.constexpr,
                      PROMOTE_MODE: gl.constexpr, tile0, tile_step, sa_bufs, SA_SMEM: gl.constexpr):
        _coop_math(a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M, STAGES, 0,
                   TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, tile0, tile_step, sa_bufs, SA_SMEM)


    @gluon.jit
    def _coop_math_hi(a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, TWO_ACC: gl.constexpr, NO_SCALE: gl.constexpr, PREFETCH: gl.constexpr,
                      PROMOTE_MODE: gl.constexpr, tile0, tile_step, sa_bufs, SA_SMEM: gl.constexpr):
        _coop_math(a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M, STAGES, 1,
                   TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, tile0, tile_step, sa_bufs, SA_SMEM)


    @gluon.jit
    def gl_coop_blockwise_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K, GROUP_M: gl.constexpr,
                                 STAGES: gl.constexpr, TWO_ACC: gl.constexpr, NO_SCALE: gl.constexpr,
                                 PREFETCH: gl.constexpr, PROMOTE_MODE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr, sa_desc=None,
                                 SA_SMEM: gl.constexpr = 0, sbc_desc=None):
        """The dense blockwise problem, persistent, with two *independent* consumer warpgroups
        cooperating on each 128 x 128 tile (64 rows each) over one producer ring, as CUTLASS's
        cooperative kernels split a tile. Unlike ``gl_ws_blockwise_kernel``, whose 8-warp math
        partition is one instruction stream (its slot releases synchronize both warpgroups, so both
        promote while the tensor cores idle), each consumer here waits only for its own wgmmas and
        releases its half of a slot on its own (``empty`` counts two arrivals). SA_SMEM: ``sa_desc``
        (the activation scales as one flat float32 vector, [K // 128 * M], BLOCK_M-float boxes) has the
        producer put each block's 128 row scales into the ring beside its operands, where the
        consumers read them after the slot's wait (DeepGEMM's and CUTLASS's staging). SA_SMEM = 2:
        the wgrad's promotion on the same problem shape, ``sbc_desc`` ([K // 128, N] flattened)
        bringing a per-column scale per block too, and the block scaled by the outer product of the
        two (``blockwise_gemm``'s K-grouped formula)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        c_smems = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        pid, programs = gl.program_id(0), gl.num_programs(0)
        if SA_SMEM:  # (a JIT function cannot be held in a variable: one warp_specialize per producer)
            sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [STAGES * SA_SMEM] + sa_desc.block_type.shape,
                                                sa_desc.layout)
            gl.warp_specialize([
                (_coop_math_lo, (a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M,
                                 STAGES, TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, pid, programs, sa_bufs, SA_SMEM)),
                (_coop_math_hi, (a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M,
                                 STAGES, TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, pid, programs, sa_bufs, SA_SMEM)),
                (_coop_scales_producer, (a_desc, b_desc, sa_desc, a_bufs, b_bufs, sa_bufs, ready, empty, M, N, K,
                                         GROUP_M, STAGES, pid, programs, sbc_desc if SA_SMEM == 2 else sa_desc,
                                         SA_SMEM)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_coop_math_lo, (a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M,
                                 STAGES, TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, pid, programs, a_bufs, 0)),
                (_coop_math_hi, (a_bufs, b_bufs, ready, empty, c_desc, c_smems, sa_ptr, sb_ptr, M, N, K, GROUP_M,
                                 STAGES, TWO_ACC, NO_SCALE, PREFETCH, PROMOTE_MODE, pid, programs, a_bufs, 0)),
                (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, STAGES, pid,
                                programs)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _operands(M, N, K, bk):
    """Random e4m3 operands, 1 x bk activation scales [K // bk, M] (block-major), 128 x bk weight
    scales [N // 128, K // bk], and a bf16 output."""
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(K // bk, M, device="cuda") + 0.5
    sb = torch.rand(N // 128, K // bk, device="cuda") + 0.5
    return a, b, sa, sb, torch.empty(M, N, device="cuda", dtype=torch.bfloat16)


def _measure(label, launch, operands, bk, blockwise):
    """Time ``launch`` (do_bench median) and, for blockwise variants, the relative error of the
    first 1024 rows against a float32 evaluation of the same block-scaled sum."""
    a, b, sa, sb, out = operands
    (M, K), N = a.shape, b.shape[0]
    launch()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(launch, warmup=50, rep=200)
    err = ""
    if blockwise:
        af = a.float().view(M, K // bk, bk) * sa.T[:, :, None]
        bf = b.float().view(N // 128, 128, K // bk, bk) * sb[:, None, :, None]
        ref = af.reshape(M, K)[:1024] @ bf.reshape(N, K).T
        err = f" relerr {((out[:1024].float() - ref).norm() / ref.norm()).item():.2e}"
    print(f"{label} M={M} N={N} K={K}: {ms:.3f} ms {2 * M * N * K / ms / 1e9:.0f} TFLOPS{err}", flush=True)


def run_triton(M, N, K, mode, ws, stages, bm=128, bn=128, bk=128, warps=8):
    operands = a, b, sa, sb, out = _operands(M, N, K, bk)
    ad = TritonDescriptor.from_tensor(a, [bm, bk])
    bd = TritonDescriptor.from_tensor(b, [bn, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    launch = lambda: triton_probe_kernel[grid](  # noqa: E731
        ad, bd, out, sa, sb, M, N, K, out.stride(0), MODE=mode, WS=ws, STAGES=stages,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps)
    _measure(f"triton mode={mode} ws={ws} stages={stages} w={warps}", launch, operands, bk, mode >= 2)


def _gluon_descriptors(a, b, out, bm, bn, bk):
    """Gluon host descriptors of the dense problem's operands and output, [bm, bk] / [bn, bk] /
    [bm, bn] boxes with the widest swizzle each allows."""
    layout = gl.NVMMASharedLayout.get_default_for
    return (TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, bk], layout([bm, bk], gl.float8e4nv)),
            TensorDescriptor(b, list(b.shape), list(b.stride()), [bn, bk], layout([bn, bk], gl.float8e4nv)),
            TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, bn], layout([bm, bn], gl.bfloat16)))


def run_gluon(M, N, K, stages, overlap, warps=8, bm=128, bn=128, bk=128):
    operands = a, b, sa, sb, out = _operands(M, N, K, bk)
    ad, bd, cd = _gluon_descriptors(a, b, out, bm, bn, bk)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    launch = lambda: gl_blockwise_kernel[grid](  # noqa: E731
        ad, bd, cd, sa, sb, M, N, K, STAGES=stages, OVERLAP=overlap, GROUP_M=8, num_warps=warps)
    _measure(f"gluon stages={stages} overlap={overlap} w={warps}", launch, operands, bk, True)


def run_gluon_ws(M, N, K, stages, two_acc, warps=8, bm=128, bn=128, bk=128):
    """The warp-specialized kernel, one program per SM (persistent), output NaN-poisoned first."""
    operands = a, b, sa, sb, out = _operands(M, N, K, bk)
    out.fill_(float("nan"))
    ad, bd, cd = _gluon_descriptors(a, b, out, bm, bn, bk)
    grid = (min(triton.cdiv(M, bm) * triton.cdiv(N, bn), torch.cuda.get_device_properties(0).multi_processor_count),)
    launch = lambda: gl_ws_blockwise_kernel[grid](  # noqa: E731
        ad, bd, cd, sa, sb, M, N, K, GROUP_M=8, STAGES=stages, TWO_ACC=two_acc, num_warps=warps)
    _measure(f"gluon warp-specialized stages={stages} two_acc={two_acc} w={warps}", launch, operands, bk, True)
    if torch.isnan(out).any():
        print("   NaN left in the output: a tile was not written")


def run_gluon_two_pipe(M, N, K, stages, bm=64, bn=128, bk=128):
    """``gl_two_pipe_blockwise_kernel``: one persistent program per SM, two pipelines of 64 x 128
    tiles, output NaN-poisoned first."""
    operands = a, b, sa, sb, out = _operands(M, N, K, bk)
    out.fill_(float("nan"))
    ad, bd, cd = _gluon_descriptors(a, b, out, bm, bn, bk)
    grid = (min(triton.cdiv(M, bm) * triton.cdiv(N, bn), torch.cuda.get_device_properties(0).multi_processor_count),)
    launch = lambda: gl_two_pipe_blockwise_kernel[grid](  # noqa: E731
        ad, bd, cd, sa, sb, M, N, K, GROUP_M=8, STAGES=stages, num_warps=4, maxnreg=168)
    _measure(f"gluon two pipelines stages={stages} 64x128 tiles", launch, operands, bk, True)
    if torch.isnan(out).any():
        print("   NaN left in the output: a tile was not written")


def run_gluon_coop(M, N, K, stages, two_acc=False, no_scale=False, prefetch=False, promote_mode=0, bk=128,
                   sa_smem=0):
    """``gl_coop_blockwise_kernel``: one persistent program per SM, output NaN-poisoned first.
    ``sa_smem`` 2: the wgrad's outer-product promotion, with per-column scales ``sbc`` [K // bk, N]
    (its error against a float32 evaluation of that sum)."""
    operands = a, b, sa, sb, out = _operands(M, N, K, bk)
    out.fill_(float("nan"))
    layout = gl.NVMMASharedLayout.get_default_for
    ad = TensorDescriptor(a, list(a.shape), list(a.stride()), [128, bk], layout([128, bk], gl.float8e4nv))
    bd = TensorDescriptor(b, list(b.shape), list(b.stride()), [128, bk], layout([128, bk], gl.float8e4nv))
    cd = TensorDescriptor(out, list(out.shape), list(out.stride()), [64, 128], layout([64, 128], gl.bfloat16))
    grid = (min(triton.cdiv(M, 128) * triton.cdiv(N, 128), torch.cuda.get_device_properties(0).multi_processor_count),)
    sad = sbcd = None
    flat_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    if sa_smem:  # the scales flattened: block k's rows m0.. are floats k * M + m0 ..
        flat = sa.view(-1)
        sad = TensorDescriptor(flat, [flat.numel()], [1], [128], flat_layout)
    if sa_smem == 2:
        sbc = torch.rand(K // bk, N, device="cuda") + 0.5
        sbcd = TensorDescriptor(sbc.view(-1), [sbc.numel()], [1], [128], flat_layout)
    launch = lambda: gl_coop_blockwise_kernel[grid](  # noqa: E731
        ad, bd, cd, sa, sb, M, N, K, GROUP_M=8, STAGES=stages, TWO_ACC=two_acc, NO_SCALE=no_scale, PREFETCH=prefetch,
        PROMOTE_MODE=promote_mode, CONSUMER_REGS=232, PRODUCER_REGS=40, num_warps=4, maxnreg=168, sa_desc=sad,
        SA_SMEM=sa_smem, sbc_desc=sbcd)
    _measure(f"gluon cooperative stages={stages} two_acc={two_acc} no_scale={no_scale} prefetch={prefetch} "
             f"promote_mode={promote_mode} sa_smem={sa_smem} (two independent 64-row consumers)", launch, operands, bk,
             not no_scale and promote_mode == 0 and sa_smem != 2)
    if sa_smem == 2:  # the outer-product sum, against float32
        af = a.float().view(M, K // bk, bk) * sa.T[:, :, None]
        bf = b.float().view(N, K // bk, bk) * sbc.T[:, :, None]
        ref = af.reshape(M, K)[:1024] @ bf.reshape(N, K).T
        print(f"   outer-product relerr {((out[:1024].float() - ref).norm() / ref.norm()).item():.2e}")
    if torch.isnan(out).any():
        print("   NaN left in the output: a tile was not written")


def run_grouped(G, T, K, N, stages=4, warps=8):
    """The library's blockwise forward problem (its own quantization of random x and W, G experts of
    T tokens) through ``triton_gemm.run`` (the TMA promotion loop) and through
    ``gl_grouped_blockwise_kernel``: both timed, and the Gluon output's relative difference from
    the library's (the same promoted sums in another wgmma order: ~1e-3 at most, bf16 rounding)."""
    from turbo_moe.backends.base import GemmKind
    from turbo_moe.fine_grained import BlockScaledProblem
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained import triton_gemm

    torch.manual_seed(0)
    M, bk, bm, bn = G * T, 128, 128, 128
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    a, sa = Q.quantize_rows(x, Q.BLOCKWISE, torch.float8_e4m3fn)
    b, _, sb = Q.quantize_weight_blocks(w, Q.BLOCKWISE, torch.float8_e4m3fn, transposed=False)
    offs = torch.arange(0, M + 1, T, device="cuda", dtype=torch.int64)
    problem = BlockScaledProblem(GemmKind.M_GROUPED, a, b, sa, sb, offs, torch.bfloat16, Q.BLOCKWISE)
    flops = 2 * M * N * K
    library = lambda: triton_gemm.run(problem)  # noqa: E731
    ref = library()
    ms = triton.testing.do_bench(library, warmup=50, rep=200)
    print(f"library TMA loop G={G} T={T} K={K} N={N}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOPS", flush=True)
    layout = gl.NVMMASharedLayout.get_default_for
    ad = TensorDescriptor(a, [M, K], [a.stride(0), 1], [bm, bk], layout([bm, bk], gl.float8e4nv))
    bd = TensorDescriptor(b, [G * N, K], [b.stride(1), 1], [bn, bk], layout([bn, bk], gl.float8e4nv))
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    tiles = sum(-(-T // bm) * -(-N // bn) for _ in range(G))
    gluon_run = lambda: gl_grouped_blockwise_kernel[(tiles,)](  # noqa: E731
        ad, bd, out, sa, sb, offs, N, K, G, out.stride(0), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        sb.stride(2), STAGES=stages, GROUP_M=8, num_warps=warps)
    gluon_run()
    torch.cuda.synchronize()
    diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ms = triton.testing.do_bench(gluon_run, warmup=50, rep=200)
    print(f"gluon grouped stages={stages} G={G} T={T} K={K} N={N}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOPS "
          f"rel. diff from the library {diff:.2e} NaN {bool(torch.isnan(out).any())}", flush=True)


def main() -> int:
    M, N, K = 32768, 4096, 7168
    if "--smem-scales" in sys.argv:  # the cooperative kernel's row scales from global memory or from the ring, and
        # the wgrad's row-and-column promotion (sa_smem 2) on the same shape
        run_triton(M, N, K, 0, False, 4)
        for stages, sa_smem, mode in ((5, 0, 0), (5, 1, 0), (4, 1, 0), (5, 0, 3), (4, 2, 0), (5, 2, 0)):
            try:
                run_gluon_coop(M, N, K, stages, promote_mode=mode, sa_smem=sa_smem)
            except Exception as exc:
                print(f"gluon cooperative stages={stages} sa_smem={sa_smem}: fails {type(exc).__name__}: {str(exc)[:300]}")
        return 0
    if "--coop" in sys.argv:  # the cooperative kernel beside the ceiling and the library's loop only
        run_triton(M, N, K, 0, False, 4)
        run_triton(M, N, K, 2, False, 4)
        for stages, two_acc, no_scale, prefetch, mode in ((5, False, False, False, 0), (5, False, False, True, 0),
                                                          (4, False, False, True, 0), (5, True, False, False, 0),
                                                          (5, False, False, False, 3)):
            try:
                run_gluon_coop(M, N, K, stages, two_acc, no_scale, prefetch, mode)
            except Exception as exc:
                print(f"gluon cooperative stages={stages} two_acc={two_acc}: fails {type(exc).__name__}: {str(exc)[:300]}")
        return 0
    for mode, ws, stages in ((0, False, 4), (1, False, 4), (2, False, 4), (2, False, 3), (2, True, 3)):
        try:
            run_triton(M, N, K, mode, ws, stages)
        except Exception as exc:  # warp_specialize needs a Triton that has it
            print(f"triton mode={mode} ws={ws} stages={stages}: fails {type(exc).__name__}: {str(exc)[:300]}")
    if gluon is None:
        print(f"no Gluon: {_GLUON_ERROR}")
        return 0
    for stages, overlap in ((4, False), (3, True), (4, True), (5, True)):
        try:
            run_gluon(M, N, K, stages, overlap)
        except Exception as exc:  # Gluon's API moves between Triton releases
            print(f"gluon stages={stages} overlap={overlap}: fails {type(exc).__name__}: {str(exc)[:300]}")
    for stages, two_acc in ((4, True), (5, True), (4, False)):
        try:
            run_gluon_ws(M, N, K, stages, two_acc)
        except Exception as exc:  # gl.warp_specialize's spelling moves between Triton releases
            print(f"gluon warp-specialized stages={stages} two_acc={two_acc}: fails {type(exc).__name__}: "
                  f"{str(exc)[:300]}")
    for stages in (4, 3):
        try:
            run_gluon_two_pipe(M, N, K, stages)
        except Exception as exc:
            print(f"gluon two pipelines stages={stages}: fails {type(exc).__name__}: {str(exc)[:300]}")
    for shape in ((8, 4096, 7168, 4096), (32, 512, 7168, 4096)):  # the bench's DeepSeek-V3 expert shapes
        try:
            run_grouped(*shape)
        except Exception as exc:
            print(f"gluon grouped {shape}: fails {type(exc).__name__}: {str(exc)[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
