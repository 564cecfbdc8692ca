"""The variable-K wgrad (K-grouped FP8 GEMM) in Gluon for Hopper, its load pipeline running ahead across tiles.

Same problem, tile order and bits as ``grouped_gemm.k_grouped_gemm_tma_kernel``:
``out[g] = a[:, tokens of g] @ b[:, tokens of g]^T`` dequantized, for every group g, with
a: [N, M] and b: [K, M] token-major FP8 and out: [G, N, K].

Why a second kernel. At 32-128 experts a wgrad output tile runs only 1-4 K steps of 128 tokens.
Triton's software pipeline fills afresh for every tile of its persistent loop, and its epilogue
runs while no MMA does: about a third of a tile's time, which kept the Triton kernel at
0.86-0.92x CUTLASS FP8 (H100). Triton 3.6 could not be made to overlap them: its automatic warp
specialization gave nothing, and a flattened (tile, chunk) loop whose chunk count comes from data
is left unpipelined (docs/triton_notes.md). Gluon lets the pipeline be written out. One
instruction stream, with a producer cursor that walks this program's (tile, box) sequence
``STAGES - 1`` TMA loads ahead of the MMAs:

* the first loads of a tile are issued while the previous tile's last MMAs and epilogue run;
* the epilogue's TMA store is waited for only when its shared buffer is written again, one tile
  later;
* accumulating into an fp32 main_grad, the old tile is read halfway through the tile's MMAs (at
  most ``OLD_TILE_BOX`` boxes in), when the previous tile's store has drained: read in the
  epilogue, its latency stood between two tiles' MMAs (H100, train preset fc1: 0.93-0.96x the
  time, docs/results/h100_wgrad_old_tile.md).

Token walk, identical to the Triton TMA kernel's so that the two give the same bits. A group's
tokens [lo, hi) are read in 128-token boxes from ``start = lo // 16 * 16`` (TMA coordinates along
the contiguous dimension must be 16-byte aligned). The MMAs run in 32-token slices (the FP8 wgmma's
K) from ``start`` on, stopping at the first slice at or past ``hi``, in the order the Triton kernel's
head, full, narrow and tail chunks run them. A slice that holds tokens of a neighbouring group
(the first one when ``start < lo``, the one across ``hi``) is masked in shared memory first: it is
read into registers, those tokens are set to zero in both operands, and it is written back before
its MMA. That happens in at most two boxes a tile; a box ending past ``hi`` on a slice boundary
only skips its last slices.

Limits (the backend checks them, ``turbo_moe.backends.triton_backend._gluon_reason``): sm_90
(wgmma), N a multiple of BLOCK_M (the output is stored through one [G*N, K] descriptor, which
clips columns past K but not rows past a group's N), tensorwise or rowwise scales, no promoted
accumulation.

Importing this module needs Triton's Gluon API for Hopper (Triton >= 3.5; the names of the TMA
copies changed in 3.7 and both are accepted); without it ``GLUON_ERROR`` says why and the kernel is
absent.
"""

from __future__ import annotations

from . import scheduler as S

GLUON_ERROR = ""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
except ImportError as exc:  # a Triton without Gluon's Hopper API
    gluon = None
    GLUON_ERROR = f"Triton's Gluon API for Hopper does not import: {exc}"

if gluon is not None:
    # Triton 3.5/3.6 name the TMA copies async_copy_*; 3.7+ async_load / async_store.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A CTA-wide barrier: gl.thread_barrier up to 3.6, gl.barrier later.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _program_tiles(N, K, G, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """This program's share of the persistent K-grouped grid, which deals the G x (N / BLOCK_M) x
        (K / BLOCK_N) output tiles round-robin (tile = pid + i * num_programs): (pid, num_programs,
        num_m_blocks, num_n_blocks, my_tiles)."""
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_m_blocks = gl.cdiv(N, BLOCK_M)
        num_n_blocks = gl.cdiv(K, BLOCK_N)
        return pid, num_programs, num_m_blocks, num_n_blocks, gl.cdiv(G * num_m_blocks * num_n_blocks - pid,
                                                                      num_programs)

    @gluon.jit
    def _group_tile(i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, GROUP_M: gl.constexpr,
                    BAND_CYCLIC: gl.constexpr):
        """This program's i-th tile in the shared scheduler's K-grouped order: (group, m_block,
        n_block, the group's first token lo, its end hi)."""
        tile = pid + i * num_programs
        if BAND_CYCLIC:
            group, m_block, n_block = S.k_grouped_band_cyclic(tile, G, num_m_blocks, num_n_blocks, GROUP_M)
        else:
            group, m_block, n_block = S.k_grouped_group_major(tile, G, num_m_blocks, num_n_blocks, GROUP_M)
        lo = gl.load(group_offs_ptr + group).to(gl.int32)
        hi = gl.load(group_offs_ptr + group + 1).to(gl.int32)
        return group, m_block, n_block, lo, hi

    @gluon.jit
    def _load_slot(a_desc, b_desc, a_bufs, b_bufs, ready, slot, row_a, row_b, token):
        """Both operands' boxes at ``token`` into ring slot ``slot``, completing on its barrier."""
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [row_a, token], ready.index(slot), a_bufs.index(slot))
        _tma_load(b_desc, [row_b, token], ready.index(slot), b_bufs.index(slot))

    @gluon.jit
    def _tile_of(i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        """This program's i-th tile: (group, first row of a, first row of b, lo, hi, first box's
        token, boxes). An empty group (or one whose offsets are out of order) has no boxes."""
        group, m_block, n_block, lo, hi = _group_tile(i, pid, num_programs, G, num_m_blocks, num_n_blocks,
                                                      group_offs_ptr, GROUP_M, BAND_CYCLIC)
        start = lo // 16 * 16
        boxes = gl.where(hi > lo, (hi - start + BLOCK_K - 1) // BLOCK_K, 0)
        return group, m_block * BLOCK_M, n_block * BLOCK_N, lo, hi, start, boxes

    @gluon.jit
    def _produce(a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b,
                 my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                 BAND_CYCLIC: gl.constexpr, STAGES: gl.constexpr):
        """Issue the producer cursor's next (tile, box) load, if any, into ring slot
        ``issued % STAGES``; returns the advanced cursor and load count."""
        # Past finished tiles, and tiles without boxes (empty groups).
        while (p_box == p_boxes) & (p_i < my_tiles):
            p_i += 1
            p_box = 0
            if p_i < my_tiles:
                _, p_row_a, p_row_b, _, _, p_start, p_boxes = _tile_of(
                    p_i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N,
                    BLOCK_K, GROUP_M, BAND_CYCLIC)
        if p_i < my_tiles:
            _load_slot(a_desc, b_desc, a_bufs, b_bufs, ready, issued % STAGES, p_row_a, p_row_b,
                       p_start + p_box * BLOCK_K)
            p_box += 1
            issued += 1
        return issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b

    @gluon.jit
    def _zero_other_groups(buf, first_token, lo, hi, WIDTH: gl.constexpr, layout: gl.constexpr):
        """Set the tokens of ``buf`` (WIDTH tokens from first_token) outside [lo, hi) to zero, in
        shared memory."""
        tile = buf.load(layout)
        tokens = first_token + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        inside = (tokens >= lo) & (tokens < hi)
        buf.store(gl.where(inside[None, :], tile, gl.zeros_like(tile)))

    @gluon.jit
    def _box_mma(acc, a_buf, b_buf, box_token, lo, hi, BLOCK_K: gl.constexpr, mask_layout: gl.constexpr):
        """Issue one box's wgmmas into ``acc`` (async): the whole box as one K=BLOCK_K wgmma, or for
        a box with a neighbouring group's tokens (at most two a tile) only the 32-token slices before
        hi, a slice that holds other tokens (the first one when start < lo, the one across hi) set
        to zero in both operands first. The barrier after the masking stores is a CTA-wide one in the
        single-stream kernel and the warpgroup's own (a named barrier) inside a ping-pong partition."""
        SLICE_K: gl.constexpr = 32  # the FP8 wgmma's K: the Triton kernel's narrow-chunk width
        SLICES: gl.constexpr = BLOCK_K // SLICE_K
        acc = warpgroup_mma_init(acc)
        if (box_token < lo) | (box_token + BLOCK_K > hi):
            straddles = (hi - box_token) % SLICE_K != 0
            if (box_token < lo) | (straddles & (box_token + BLOCK_K > hi)):
                for j in gl.static_range(SLICES):
                    first = box_token + j * SLICE_K
                    if (first < lo) | ((first < hi) & (first + SLICE_K > hi)):
                        _zero_other_groups(a_buf.slice(j * SLICE_K, SLICE_K, 1), first, lo, hi, SLICE_K, mask_layout)
                        _zero_other_groups(b_buf.slice(j * SLICE_K, SLICE_K, 1), first, lo, hi, SLICE_K, mask_layout)
                fence_async_shared()  # the stores, before the tensor cores read them
                _cta_barrier()
            for j in gl.static_range(SLICES):
                if box_token + j * SLICE_K < hi:
                    acc = warpgroup_mma(a_buf.slice(j * SLICE_K, SLICE_K, 1),
                                        b_buf.slice(j * SLICE_K, SLICE_K, 1).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _consume_box(acc, a_bufs, b_bufs, ready, consumed, box_token, lo, hi, mask_layout: gl.constexpr):
        """The ring's ``consumed``-th box (its slot's load waited for), its wgmmas issued into ``acc``
        (:func:`_box_mma`; async: the caller waits)."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        slot = consumed % STAGES
        mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
        return _box_mma(acc, a_bufs.index(slot), b_bufs.index(slot), box_token, lo, hi, BLOCK_K, mask_layout)

    @gluon.jit
    def _dequantize(acc, a_scale_ptr, b_scale_ptr, group, row_a, row_b, N, K, mma_layout: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr):
        """acc * a_scale * b_scale in fp32, in that order (grouped_gemm._dequantize's, bit for bit)."""
        group_row = group.to(gl.int64)
        if A_ROWWISE:
            rows = row_a + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
            acc = acc * gl.load(a_scale_ptr + group_row * N + rows)[:, None]
        else:
            acc = acc * gl.load(a_scale_ptr)
        if B_ROWWISE:
            cols = row_b + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            acc = acc * gl.load(b_scale_ptr + group_row * K + gl.where(cols < K, cols, 0))[None, :]
        else:
            acc = acc * gl.load(b_scale_ptr)
        return acc

    @gluon.jit
    def _allocate(a_desc, b_desc, out_desc, STAGES: gl.constexpr):
        """Shared memory of a Gluon wgrad: the operands' ring of STAGES boxes with a barrier a slot,
        the output tile, and the barrier of the output tile's reads (ACCUMULATE)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        out_buf = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        out_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(out_ready, count=1)
        return a_bufs, b_bufs, ready, out_buf, out_ready

    @gluon.jit
    def _load_old_tile(out_desc, out_buf, out_ready, out_row, row_b):
        """ACCUMULATE: the output tile's old values into out_buf, completing on out_ready, once the
        previous tile's store has read out_buf."""
        tma.store_wait(pendings=0)  # the previous tile's store has read out_buf
        mbarrier.expect(out_ready, out_desc.block_type.nbytes)
        _tma_load(out_desc, [out_row, row_b], out_ready, out_buf)

    @gluon.jit
    def _store_tile(tile, out_desc, out_buf, out_ready, out_loads, out_row, row_b, has_tokens,
                    mma_layout: gl.constexpr, ACCUMULATE: gl.constexpr, OLD_LOADED: gl.constexpr):
        """The finished float32 tile to out[out_row:, row_b:] through the copy engine (which clips
        columns past K); ACCUMULATE: added to what is there (read here, or already on its way when
        OLD_LOADED: :func:`_load_old_tile` issued during the tile's MMAs), and a tile without
        tokens neither read nor written (adding +0.0 would turn -0.0 into +0.0). The store is
        waited for only when out_buf is written again, one tile later. Returns the count of
        out_ready's loads."""
        if ACCUMULATE:
            if has_tokens:
                if not OLD_LOADED:
                    _load_old_tile(out_desc, out_buf, out_ready, out_row, row_b)
                mbarrier.wait(out_ready, out_loads & 1)
                out_loads += 1
                previous = out_buf.load(mma_layout)
                _cta_barrier()  # every thread has read out_buf before any writes it
                out_buf.store(previous + tile)
                fence_async_shared()
                _tma_store(out_desc, [out_row, row_b], out_buf)
        else:
            tma.store_wait(pendings=0)  # the previous tile's store has read out_buf
            out_buf.store(tile.to(out_desc.dtype))
            fence_async_shared()
            _tma_store(out_desc, [out_row, row_b], out_buf)
        return out_loads

    @gluon.jit
    def _release(ready, out_ready, STAGES: gl.constexpr):
        """The kernel's end: its last store read, its barriers invalidated."""
        tma.store_wait(pendings=0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(out_ready)

    @gluon.jit
    def k_grouped_gemm_gluon_kernel(
        a_desc, b_desc, out_desc, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G,
        A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr,
        ACCUMULATE: gl.constexpr, OLD_TILE_BOX: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        """a_desc: a [N, M] with [BLOCK_M, BLOCK_K] boxes; b_desc: b [K, M] with [BLOCK_N, BLOCK_K]
        boxes; out_desc: out as one [G*N, K] matrix with [BLOCK_M, BLOCK_N] boxes (N a multiple of
        BLOCK_M). ACCUMULATE (float32 out): out[g] += the result; an empty group's tiles are
        neither read nor written (adding +0.0 would turn -0.0 into +0.0). The old tile is read
        while the tile's later MMAs run, after box min(boxes // 2, OLD_TILE_BOX) is issued (the
        previous tile's store must have read out_buf by then), or in the epilogue when
        OLD_TILE_BOX < 0."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        # A [rows, 32] FP8 slice in registers: 16 contiguous tokens a thread.
        mask_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[16, 2],
                                                     warps_per_cta=[num_warps, 1], order=[1, 0])
        a_bufs, b_bufs, ready, out_buf, out_ready = _allocate(a_desc, b_desc, out_desc, STAGES)
        out_loads = pid * 0

        # The producer cursor starts past a virtual tile -1 without boxes.
        issued = pid * 0
        p_i = pid * 0 - 1
        p_box = pid * 0
        p_boxes = pid * 0
        p_start = pid * 0
        p_row_a = pid * 0
        p_row_b = pid * 0
        for _ in gl.static_range(STAGES - 1):
            issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b = _produce(
                a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b,
                my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N,
                BLOCK_K, GROUP_M, BAND_CYCLIC, STAGES)

        consumed = pid * 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, hi, start, boxes = _tile_of(
                i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, BAND_CYCLIC)
            out_row = group * N + row_a
            old_at = gl.where(boxes // 2 < OLD_TILE_BOX, boxes // 2, OLD_TILE_BOX)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            for box in range(boxes):
                acc = _consume_box(acc, a_bufs, b_bufs, ready, consumed, start + box * BLOCK_K, lo, hi, mask_layout)
                if ACCUMULATE:
                    if OLD_TILE_BOX >= 0:
                        if box == old_at:  # issued beside the tile's remaining MMAs
                            _load_old_tile(out_desc, out_buf, out_ready, out_row, row_b)
                # One wgmma group in flight: the previous box's are done, so its slot may be reloaded.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                consumed += 1
                issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b = _produce(
                    a_desc, b_desc, a_bufs, b_bufs, ready, issued, p_i, p_box, p_start, p_boxes, p_row_a, p_row_b,
                    my_tiles, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N,
                    BLOCK_K, GROUP_M, BAND_CYCLIC, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = _dequantize(acc, a_scale_ptr, b_scale_ptr, group, row_a, row_b, N, K, mma_layout, BLOCK_M, BLOCK_N,
                              A_ROWWISE, B_ROWWISE)
            out_loads = _store_tile(acc, out_desc, out_buf, out_ready, out_loads, out_row, row_b, hi > lo,
                                    mma_layout, ACCUMULATE, OLD_TILE_BOX >= 0)
        _release(ready, out_ready, STAGES)


    # ---------------------------------------------------------------- the accumulating ping-pong

    @gluon.jit
    def _ring(desc, STAGES: gl.constexpr):
        """A ring of STAGES of ``desc``'s boxes in shared memory."""
        return gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """A warp-specialized ring's barriers, initialized: per slot a ``ready`` one (the producer's
        loads) and an ``empty`` one counting every consumer's release (the cooperative kernels of
        blockwise_gemm_gluon and m_grouped_blockwise_gluon)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        return ready, empty

    @gluon.jit
    def _pingpong_barriers(STAGES: gl.constexpr):
        """A ping-pong's barriers, initialized (in both ping-pongs: this module's and
        m_grouped_gemm_gluon's): a ``ready`` and an ``empty`` one per ring slot, a ``turn`` one per
        consumer (:func:`_take_turn`)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
        return ready, empty, turn

    @gluon.jit
    def _take_turn(turn, CONSUMER, turns):
        """A ping-pong consumer's wait for its turn at the ring (its ``turns``-th), in both ping-pongs
        (this module's and m_grouped_gemm_gluon's); returns ``turns + 1``. The other consumer passes
        the turn once it has waited for all the boxes of its tile: a slot's ready barrier tells
        phases apart by parity only, so a consumer waiting for a box a whole ring cycle (or more)
        ahead of the other one's would take that one's box. Consumer 0's first wait is on the fresh
        barrier's completed phase, so it starts at once."""
        mbarrier.wait(turn.index(CONSUMER), (turns & 1) ^ (1 - CONSUMER))
        return turns + 1

    # The wgrad as a warp-specialized ping-pong, like m_grouped_gemm_gluon's: a producer warp walks
    # the program's (tile, box) sequence into a ring of STAGES slots; two consumer warpgroups take
    # the program's tiles in turn (consumer c its tiles c, c + 2, ...), so that one's epilogue runs
    # beside the other's MMAs. The epilogue follows the output's dtype (a constexpr inside the worker
    # partitions, whose flag arguments arrive as run-time values): a float32 output is a main_grad
    # added into (out[g] += the result), a 16-bit one is stored (out[g] = the result).
    #
    # Into an fp32 main_grad: in the single-stream kernel above the read-modify-write (about as many
    # bytes as the operands at training-step group sizes) ran while no MMA did (its read now starts
    # mid-tile, under the MMAs; its add and store still run between tiles). Same token walk, MMAs and epilogue
    # arithmetic as the kernel above: the same bits. Measured against the single-stream kernel with
    # its read in the epilogue (H100, scripts/probe_wgrad_pingpong.py,
    # docs/results/h100_wgrad_pingpong.md): 0.95x its time at DeepSeek-V3's
    # fc1 (32 x 512 tokens, K 7168), but 1.04x / 1.15x at the train preset's fc1 / fc2, whose
    # main_grad traffic makes them DRAM-bound: overlapping it with MMAs does not shorten them, and
    # its two 64 KB float32 staging tiles leave room for three ring stages, not four. A tuning
    # candidate, not the default.
    #
    # Into a bf16 output (a wgrad without main_grad): two 32 KB staging tiles beside four ring
    # stages. Where groups are short (512 tokens: four boxes a tile), the single-stream kernel's
    # epilogue (convert, stage, store) is a large share of each tile; here it runs beside the
    # other consumer's MMAs.

    @gluon.jit
    def _pingpong_producer(p, CONSUMER: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr,
                           GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        """The load partition: every box of every tile of this program into the ring, in order."""
        (a_desc, b_desc, out_desc, a_bufs, b_bufs, out_bufs, ready, empty, turn, loaded, a_scale_ptr, b_scale_ptr,
         group_offs_ptr, N, K, G) = p
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)
        issued = 0
        for i in range(my_tiles):
            _, row_a, row_b, _, _, start, boxes = _tile_of(i, pid, num_programs, G, num_m_blocks, num_n_blocks,
                                                           group_offs_ptr, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                                           BAND_CYCLIC)
            for box in range(boxes):
                slot = issued % STAGES
                # Fresh barriers count as having completed phase 1: the first round does not wait.
                mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)
                _load_slot(a_desc, b_desc, a_bufs, b_bufs, ready, slot, row_a, row_b, start + box * BLOCK_K)
                issued += 1

    @gluon.jit
    def _pingpong_dequantize(acc, a_scale_ptr, b_scale_ptr, group, row_a, row_b, N, K, mma_layout: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, A_ROWWISE: gl.constexpr,
                             B_ROWWISE: gl.constexpr):
        """:func:`_dequantize`'s products. Each scale is one vector load whose offsets the flags choose
        (a tensorwise scale: every lane the one address, the same products). Consumer 1 gets the
        flags at run time; with a load in each branch, Triton 3.6's lowering failed on the untaken
        rowwise one (its axis analysis), as it did on a scalar load inside a partition."""
        group_row = group.to(gl.int64)
        rows = row_a + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = row_b + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        if A_ROWWISE:
            a_index = group_row * N + rows
        else:
            a_index = (rows * 0).to(gl.int64)
        if B_ROWWISE:
            b_index = group_row * K + gl.where(cols < K, cols, 0)
        else:
            b_index = (cols * 0).to(gl.int64)
        acc = acc * gl.load(a_scale_ptr + a_index)[:, None]
        return acc * gl.load(b_scale_ptr + b_index)[None, :]

    @gluon.jit
    def _pingpong_consumer(p, CONSUMER: gl.constexpr, A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr,
                           GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr):
        """An MMA partition: the program's tiles CONSUMER, CONSUMER + 2, ...; into a float32 output the
        old tile read into this consumer's staging tile while its MMAs run, then added to and written
        back; into a 16-bit one the tile stored through the staging tile (an empty group's zeros too)."""
        (a_desc, b_desc, out_desc, a_bufs, b_bufs, out_bufs, ready, empty, turn, loaded, a_scale_ptr, b_scale_ptr,
         group_offs_ptr, N, K, G) = p
        ACCUMULATE: gl.constexpr = out_desc.dtype == gl.float32
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        WARPS: gl.constexpr = gl.num_warps()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        mask_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[16, 2],
                                                     warps_per_cta=[WARPS, 1], order=[1, 0])
        out_buf = out_bufs.index(CONSUMER)
        out_loaded = loaded.index(CONSUMER)
        pid, num_programs, num_m_blocks, num_n_blocks, my_tiles = _program_tiles(N, K, G, BLOCK_M, BLOCK_N)
        consumed = 0  # boxes of this program's earlier tiles, both consumers'
        turns = 0
        out_loads = 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, hi, start, boxes = _tile_of(
                i, pid, num_programs, G, num_m_blocks, num_n_blocks, group_offs_ptr, BLOCK_M, BLOCK_N, BLOCK_K,
                GROUP_M, BAND_CYCLIC)
            if i % 2 == CONSUMER:
                out_row = group * N + row_a
                if ACCUMULATE:
                    if boxes > 0:  # a tile without tokens is neither read nor written (+0.0 would turn -0.0)
                        _load_old_tile(out_desc, out_buf, out_loaded, out_row, row_b)
                acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
                turns = _take_turn(turn, CONSUMER, turns)
                for box in range(boxes):
                    acc = _consume_box(acc, a_bufs, b_bufs, ready, consumed, start + box * BLOCK_K, lo, hi,
                                       mask_layout)
                    # One wgmma group in flight: the previous box's are done, so its slot is free.
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), count=1, pred=box > 0)
                    consumed += 1
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)  # the other consumer's turn
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if boxes > 0:
                    mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), count=1)
                acc = _pingpong_dequantize(acc, a_scale_ptr, b_scale_ptr, group, row_a, row_b, N, K, mma_layout,
                                           BLOCK_M, BLOCK_N, A_ROWWISE, B_ROWWISE)
                # The single-stream kernel's epilogue (its barriers the warpgroup's own here); a 16-bit
                # output gets every tile, an empty group's zeros too.
                out_loads = _store_tile(acc, out_desc, out_buf, out_loaded, out_loads, out_row, row_b, boxes > 0,
                                        mma_layout, ACCUMULATE, True)
            else:
                consumed += boxes  # the other consumer's tile
        tma.store_wait(pendings=0)

    @gluon.jit
    def k_grouped_gemm_pingpong_kernel(
        a_desc, b_desc, out_desc, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G,
        A_ROWWISE: gl.constexpr, B_ROWWISE: gl.constexpr, GROUP_M: gl.constexpr, BAND_CYCLIC: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """``k_grouped_gemm_gluon_kernel`` as a warp-specialized ping-pong: num_warps (4) for each of
        two consumer warpgroups, a producer warp besides; registers by setmaxnreg, CONSUMER_REGS and
        PRODUCER_REGS a thread. A float32 out is accumulated into (its ACCUMULATE: out[g] += the
        result, an empty group's tiles neither read nor written); a bf16 / fp16 one is written."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
        ready, empty, turn = _pingpong_barriers(STAGES)
        loaded = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a consumer's old tile
        for c in gl.static_range(2):
            mbarrier.init(loaded.index(c), count=1)
        # A worker partition's arguments arrive as run-time values (m_grouped_gemm_gluon's kernel):
        # consumer 1 and the producer branch on the flags at run time, with the same results.
        p = (a_desc, b_desc, out_desc, a_bufs, b_bufs, out_bufs, ready, empty, turn, loaded, a_scale_ptr, b_scale_ptr,
             group_offs_ptr, N, K, G)
        flags = (A_ROWWISE, B_ROWWISE, GROUP_M, BAND_CYCLIC)
        gl.warp_specialize([(_pingpong_consumer, (p, 0) + flags), (_pingpong_consumer, (p, 1) + flags),
                            (_pingpong_producer, (p, 0) + flags)], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])


def shared_layout(block_shape, dtype):
    """The NVMMA shared-memory layout the kernel's descriptors take for a block of torch ``dtype``
    (what ``TensorDescriptor.from_tensor`` callers pass: the widest swizzle the block allows)."""
    import torch

    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
                torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)
