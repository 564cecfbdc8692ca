"""The M-grouped FP8 GEMM (fwd NT, dgrad NN) in Gluon for Hopper: a warp-specialized ping-pong.

Same problem, tile walk and bits as ``grouped_gemm.m_grouped_gemm_tma_kernel``:
``out[offs[g]:offs[g+1]] = a[offs[g]:offs[g+1]] @ b[g]^T`` dequantized, for every group g, with
a: [M, K] and b: [G, N, K] (read as one [G*N, K] matrix), both K-contiguous FP8, out: [M, N].

Why a second kernel. In the Triton kernel a tile's epilogue (dequantize, convert, store) runs
while no MMA does. At the expert-dominated training shapes (64 experts, 98304 routed rows, K of
1024-4096) that is 7-26% of the GEMM: the same kernel with its store compiled out runs fc1's
forward in 0.71 ms instead of 0.93, fc2's dgrad in 0.37 instead of 0.50
(``scripts/probe_m_grouped_epilogue.py``, H100). Here three partitions share an SM:

* a producer warp walks the program's tiles and TMA-loads their K boxes into a ring of
  ``STAGES`` slots (``ready`` / ``empty`` barriers per slot);
* two consumer warpgroups take the program's tiles in turn (consumer c its tiles c, c + 2, ...),
  each with a BLOCK_M x BLOCK_N accumulator in its registers. A pair of ``turn`` barriers passes
  the ring from one to the other once a consumer has taken its tile's last box, so each one's
  epilogue runs beside the other's MMAs (and the ring's parity-only phases stay unambiguous).

Every tile's K boxes run as one K=BLOCK_K wgmma each, in order, and the epilogue multiplies by a's
scale then b's, as the Triton kernel does: the same bits.

Stores. A tile whose rows all belong to its group goes out through one host descriptor over
``out`` (the copy engine clips columns past N and rows past M). The last tile of a group whose row
count is not a multiple of BLOCK_M would spill into the next group's rows: it is written from its
shared-memory staging tile with masked stores, 16 rows at a time.

Limits (the backend checks them, ``turbo_moe.backends.triton_backend._gluon_reason``): sm_90,
tensorwise or rowwise scales, no promoted accumulation, a contiguous 16-byte aligned output.
"""

from __future__ import annotations

from . import scheduler as S
from .grouped_gemm_gluon import GLUON_ERROR, gluon

__all__ = ["GLUON_ERROR"]

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    from .grouped_gemm_gluon import _pingpong_barriers, _take_turn, _tma_load, _tma_store

    # Rows a masked store of a group's last tile writes at once (from the shared staging tile).
    _STORE_ROWS = gl.constexpr(16)

    @gluon.jit
    def _cursor_start(group_offs_ptr, G, BLOCK_M: gl.constexpr, num_n_blocks):
        """The forward-only group cursor of the Triton kernels (tile_scheduler's module docstring),
        on group 0: (group, group_first_tile, lo, hi, group_tiles)."""
        lo = gl.load(group_offs_ptr)
        hi = gl.load(group_offs_ptr + gl.minimum(G, 1))
        return 0, lo * 0, lo, hi, S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)

    @gluon.jit
    def _cursor_advance(tile, group, first, lo, hi, tiles, group_offs_ptr, G, BLOCK_M: gl.constexpr, num_n_blocks):
        """The cursor moved past the groups (empty ones too) that end before ``tile``; past the last
        group it stops with ``group == G``."""
        while (tile >= first + tiles) & (group < G):
            first += tiles
            group += 1
            lo = hi
            hi = gl.load(group_offs_ptr + gl.minimum(group + 1, G))
            tiles = S.m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
        return group, first, lo, hi, tiles

    @gluon.jit
    def _num_n_blocks(N, BOX_N: gl.constexpr, SWIGLU: gl.constexpr):
        """Column blocks of a group: of N, or with SWIGLU of the F = N / 2 gate columns (a tile holds
        BOX_N gate columns and the BOX_N linear ones F further)."""
        if SWIGLU:
            return gl.cdiv(N // 2, BOX_N)
        else:
            return gl.cdiv(N, BOX_N)

    # The SWIGLU amax epilogue reads the staged tile in chunks of _AMAX_ROWS rows x BOX_N column pairs.
    _AMAX_ROWS = gl.constexpr(32)

    @gluon.constexpr_function
    def _amax_layout(num_warps):
        """The register layout of an amax chunk: 8 consecutive bf16 (16 bytes) a thread, a warp's 8
        threads over a row's 64 columns (128 bytes), its 4 thread rows and the warps down the rows."""
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[num_warps, 1],
                                order=[1, 0])

    @gluon.jit
    def _swiglu_probs_chunk(probs_ptr, first_row, rows_left, chunk: gl.constexpr, num_warps: gl.constexpr):
        """The routing weights of the tile's rows [chunk * _AMAX_ROWS, (chunk + 1) * _AMAX_ROWS)
        (float32, 0 past the group's rows), in the amax chunk's row layout."""
        rows = chunk * _AMAX_ROWS + gl.arange(0, _AMAX_ROWS, layout=gl.SliceLayout(1, _amax_layout(num_warps)))
        return gl.load(probs_ptr + first_row + rows, mask=rows < rows_left, other=0.0).to(gl.float32)

    @gluon.jit
    def _swiglu_chunk_amax(out_buf, p, rows_left, cols_left, running, chunk: gl.constexpr, BOX_N: gl.constexpr,
                           num_warps: gl.constexpr):
        """max(running, |a|'s bits) element by element over the staged tile's chunk ``chunk``, with
        ``a = silu(gate) * linear * p`` from its bf16 values as
        ``swiglu_fp8.swiglu_amax_partials_kernel`` computes it (the same float32 operations, in its
        order), 0 past ``rows_left`` rows and ``cols_left`` column pairs. |a|'s bits as int32: NaN's
        sit above Inf's, so a NaN survives the max. The running maximum stays a register tile (one
        cross-warp reduction a program, not one a chunk)."""
        layout: gl.constexpr = _amax_layout(num_warps)
        rows = chunk * _AMAX_ROWS + gl.arange(0, _AMAX_ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BOX_N, layout=gl.SliceLayout(0, layout))
        gate = out_buf.slice(0, BOX_N, 1).slice(chunk * _AMAX_ROWS, _AMAX_ROWS, 0).load(layout).to(gl.float32)
        linear = out_buf.slice(BOX_N, BOX_N, 1).slice(chunk * _AMAX_ROWS, _AMAX_ROWS, 0).load(layout).to(gl.float32)
        a = gate * (1 / (1 + gl.exp(-gate))) * linear * p[:, None]  # tl.sigmoid's definition, inlined
        a = gl.where((rows < rows_left)[:, None] & (cols < cols_left)[None, :], a, 0.0)
        return gl.maximum(running, gl.abs(a).to(gl.int32, bitcast=True))

    @gluon.jit
    def _producer(p, CONSUMER: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr,
                  GROUP_M: gl.constexpr):
        """The load partition: every box of every tile of this program into the ring, in order."""
        (a_desc, b_desc, out_desc, out_ptr, a_bufs, b_bufs, out_bufs, ready, empty, turn, a_scale_ptr, b_scale_ptr,
         group_offs_ptr, N, K, G, stride_om, probs_ptr, amax_ptr, amax_slots) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BOX_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        # Read off the ring's shape: a worker partition's arguments arrive as run-time values.
        SWIGLU: gl.constexpr = b_bufs.type.shape[1] != BOX_N
        num_programs = gl.num_programs(0)
        num_n_blocks = _num_n_blocks(N, BOX_N, SWIGLU)
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
                row_b = (group * N + n_block * BOX_N).to(gl.int32)  # SWIGLU: the gate rows of W
                for k_block in range(num_k_blocks):
                    slot = issued % STAGES
                    # Fresh barriers count as having completed phase 1: the first round does not wait.
                    mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)
                    if SWIGLU:  # the gate box, then the linear box F rows further, in one slot
                        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
                        _tma_load(a_desc, [row_a, k_block * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                        _tma_load(b_desc, [row_b, k_block * BLOCK_K], ready.index(slot),
                                  b_bufs.index(slot).slice(0, BOX_N, 0))
                        _tma_load(b_desc, [row_b + N // 2, k_block * BLOCK_K], ready.index(slot),
                                  b_bufs.index(slot).slice(BOX_N, BOX_N, 0))
                    else:
                        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                        _tma_load(a_desc, [row_a, k_block * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                        _tma_load(b_desc, [row_b, k_block * BLOCK_K], ready.index(slot), b_bufs.index(slot))
                    issued += 1
            tile += num_programs

    @gluon.jit
    def _dequantize(acc, a_scale_ptr, b_scale_ptr, group, lo, rows, m_block, n_block, N, layout: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr):
        """acc * a_scale * b_scale in fp32, in that order (grouped_gemm._dequantize's, bit for bit);
        rows past the group's end and columns past N read the first row's / column's scale."""
        # Tensorwise scales are read as vectors too (every lane the one scale: the same products).
        # A scalar load here failed Triton 3.6's lowering inside a warp-specialized partition.
        offs_m = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_n = n_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if A_ROWWISE:
            a_index = lo + gl.where(offs_m < rows, offs_m, 0)
        else:
            a_index = offs_m * 0
        acc = acc * gl.load(a_scale_ptr + a_index)[:, None]
        if B_ROWWISE:
            b_index = group.to(gl.int64) * N + gl.where(offs_n < N, offs_n, 0)
        else:
            b_index = offs_n * 0
        acc = acc * gl.load(b_scale_ptr + b_index)[None, :]
        return acc

    @gluon.jit
    def _store_group_tail(out_buf, out_ptr, row0, col0, rows_left, N, stride_om, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """The staged tile's first ``rows_left`` rows (and columns < N) to out[row0:, col0:], through
        masked stores: the rows after them belong to the next group."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                warps_per_cta=[num_warps, 1], order=[1, 0])
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        for chunk in gl.static_range(BLOCK_M // _STORE_ROWS):
            rows = chunk * _STORE_ROWS + gl.arange(0, _STORE_ROWS, layout=gl.SliceLayout(1, layout))
            values = out_buf.slice(chunk * _STORE_ROWS, _STORE_ROWS, 0).load(layout)
            ptrs = out_ptr + (row0 + rows).to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(ptrs, values, mask=(rows < rows_left)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _consumer(p, CONSUMER: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr,
                  GROUP_M: gl.constexpr):
        """An MMA partition: the program's tiles CONSUMER, CONSUMER + 2, ...; MMAs from the ring,
        then the epilogue through this consumer's own staging tile."""
        (a_desc, b_desc, out_desc, out_ptr, a_bufs, b_bufs, out_bufs, ready, empty, turn, a_scale_ptr, b_scale_ptr,
         group_offs_ptr, N, K, G, stride_om, probs_ptr, amax_ptr, amax_slots) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BOX_N: gl.constexpr = b_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]  # BOX_N, or with SWIGLU a gate and a linear box
        SWIGLU: gl.constexpr = BLOCK_N != BOX_N  # read off the ring's shape (see _producer)
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        WARPS: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        out_buf = out_bufs.index(CONSUMER)
        num_programs = gl.num_programs(0)
        num_n_blocks = _num_n_blocks(N, BOX_N, SWIGLU)
        num_k_blocks = gl.cdiv(K, BLOCK_K)
        group, first, lo, hi, tiles = _cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
        tile = first + gl.program_id(0) + CONSUMER * num_programs
        consumed = CONSUMER * num_k_blocks  # boxes of this program's earlier tiles
        turns = 0
        # SWIGLU: this consumer's running max of |a|'s bits, element by element
        amax_bits = gl.zeros([_AMAX_ROWS, BOX_N], gl.int32, layout=_amax_layout(WARPS))
        while group < G:
            group, first, lo, hi, tiles = _cursor_advance(tile, group, first, lo, hi, tiles, group_offs_ptr, G, BLOCK_M,
                                                          num_n_blocks)
            if group < G:
                rows = hi - lo
                m_block, n_block = S.swizzle_group_m(tile - first, S.cdiv(rows, BLOCK_M), num_n_blocks, GROUP_M)
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
                if SWIGLU:
                    # The tile's routing weights, loaded before its MMAs: issued at the epilogue,
                    # their latency sat in it (H100: +0.07 ms on the training fc1).
                    gl.static_assert(BLOCK_M == 4 * _AMAX_ROWS)
                    probs_first = lo + m_block * BLOCK_M
                    probs_left = rows - m_block * BLOCK_M
                    p0 = _swiglu_probs_chunk(probs_ptr, probs_first, probs_left, 0, WARPS)
                    p1 = _swiglu_probs_chunk(probs_ptr, probs_first, probs_left, 1, WARPS)
                    p2 = _swiglu_probs_chunk(probs_ptr, probs_first, probs_left, 2, WARPS)
                    p3 = _swiglu_probs_chunk(probs_ptr, probs_first, probs_left, 3, WARPS)
                turns = _take_turn(turn, CONSUMER, turns)  # our turn at the ring (_take_turn says why)
                for k_block in range(num_k_blocks):
                    slot = consumed % STAGES
                    mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
                    acc = warpgroup_mma_init(acc)
                    acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                    # One wgmma group in flight: the previous box's are done, so its slot is free.
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), count=1, pred=k_block > 0)
                    consumed += 1
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)  # the other consumer's turn
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), count=1)
                consumed += num_k_blocks  # the other consumer's tile
                acc = _dequantize(acc, a_scale_ptr, b_scale_ptr, group, lo, rows, m_block, n_block, N, mma_layout,
                                  BLOCK_M, BLOCK_N, A_ROWWISE, B_ROWWISE)
                tma.store_wait(pendings=0)  # this consumer's previous store has read out_buf
                out_buf.store(acc.to(out_desc.dtype))
                fence_async_shared()
                row0 = (lo + m_block * BLOCK_M).to(gl.int32)
                rows_left = rows - m_block * BLOCK_M
                if SWIGLU:  # gate columns [col0, col0 + BOX_N) and the linear ones F further
                    F = N // 2
                    col0 = (n_block * BOX_N).to(gl.int32)
                    gate_buf = out_buf.slice(0, BOX_N, 1)
                    linear_buf = out_buf.slice(BOX_N, BOX_N, 1)
                    if rows_left >= BLOCK_M:
                        _tma_store(out_desc, [row0, col0], gate_buf)
                        _tma_store(out_desc, [row0, col0 + F], linear_buf)
                    else:
                        _store_group_tail(gate_buf, out_ptr, row0, col0, rows_left, F, stride_om, BLOCK_M, BOX_N,
                                          WARPS)
                        _store_group_tail(linear_buf, out_ptr, row0, col0 + F, rows_left, N, stride_om, BLOCK_M,
                                          BOX_N, WARPS)
                    amax_bits = _swiglu_chunk_amax(out_buf, p0, rows_left, F - col0, amax_bits, 0, BOX_N, WARPS)
                    amax_bits = _swiglu_chunk_amax(out_buf, p1, rows_left, F - col0, amax_bits, 1, BOX_N, WARPS)
                    amax_bits = _swiglu_chunk_amax(out_buf, p2, rows_left, F - col0, amax_bits, 2, BOX_N, WARPS)
                    amax_bits = _swiglu_chunk_amax(out_buf, p3, rows_left, F - col0, amax_bits, 3, BOX_N, WARPS)
                else:
                    col0 = (n_block * BLOCK_N).to(gl.int32)
                    if rows_left >= BLOCK_M:
                        _tma_store(out_desc, [row0, col0], out_buf)
                    else:
                        _store_group_tail(out_buf, out_ptr, row0, col0, rows_left, N, stride_om, BLOCK_M, BLOCK_N,
                                          WARPS)
            tile += 2 * num_programs
        if SWIGLU:
            # The SwiGLU cast reduces all ``amax_slots`` partials (fp8_cast's contract): this
            # consumer's maximum in slot 2 * pid + CONSUMER, zeros in the slots no program owns.
            amax = gl.max(gl.max(amax_bits, axis=1), axis=0).to(gl.float32, bitcast=True)
            own = gl.program_id(0) * 2 + CONSUMER
            for slot in range(own, amax_slots, 2 * num_programs):
                gl.store(amax_ptr + slot, gl.where(slot == own, amax, 0.0))
        tma.store_wait(pendings=0)

    @gluon.jit
    def m_grouped_gemm_pingpong_kernel(
        a_desc, b_desc, out_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G, stride_om, probs_ptr,
        amax_ptr, amax_slots, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SWIGLU: gl.constexpr, num_warps: gl.constexpr,
    ):
        """a_desc: a [M, K] with [BLOCK_M, BLOCK_K] boxes; b_desc: b as one [G*N, K] matrix with
        [BLOCK_N, BLOCK_K] boxes (columns past N of a group read the next group's rows: never
        stored); out_desc: out [M, N] with [BLOCK_M, BLOCK_N] boxes. num_warps: one consumer's
        (4: a warpgroup); the kernel runs two consumers and a producer warp.

        SWIGLU (an expert MLP's fc1, N = 2F, tensorwise): b_desc's boxes are [BOX_N, BLOCK_K] and
        out_desc's [BLOCK_M, BOX_N]; a tile holds BOX_N gate columns and the BOX_N linear ones F
        further, and the kernel also writes ``amax_slots`` float32 partials to ``amax_ptr`` whose
        maximum is max |silu(gate) * linear * probs| over all rows (``probs_ptr``: [M]); the grid
        has at most ``amax_slots / 2`` programs. Without SWIGLU, probs_ptr and amax_ptr are unused."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        # SWIGLU: a tile's b is its gate box and its linear box, its output both halves side by side.
        WIDEN: gl.constexpr = 1 + SWIGLU
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, WIDEN * b_desc.block_type.shape[0],
                                                          b_desc.block_type.shape[1]], b_desc.layout)
        out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, out_desc.block_type.shape[0],
                                                              WIDEN * out_desc.block_type.shape[1]], out_desc.layout)
        ready, empty, turn = _pingpong_barriers(STAGES)
        # p: what every partition reads; then the consumer's index and the flags. The default
        # partition (consumer 0) gets them as constexprs; a worker partition's arguments arrive as
        # run-time values, so consumer 1 branches on them at run time (the same results).
        p = (a_desc, b_desc, out_desc, out_ptr, a_bufs, b_bufs, out_bufs, ready, empty, turn, a_scale_ptr, b_scale_ptr,
             group_offs_ptr, N, K, G, stride_om, probs_ptr, amax_ptr, amax_slots)
        flags = (A_ROWWISE, B_ROWWISE, GROUP_M)
        gl.warp_specialize([(_consumer, (p, 0) + flags), (_consumer, (p, 1) + flags), (_producer, (p, 0) + flags)],
                           [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
