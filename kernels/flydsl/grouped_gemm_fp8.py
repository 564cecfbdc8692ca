"""FlyDSL grouped FP8 GEMM kernels for AMD gfx950 (CDNA4): M-grouped (NT forward / NN dgrad) and
K-grouped (variable-K TN wgrad). See ``turbo_moe/backends/base.py`` for the two problems.

Status: compiled for gfx950 and checked on the ISA (tests/test_flydsl_compile.py); never executed
on hardware (none was available while writing it). docs/flydsl.md says what that means.

Structure (both kernels)
------------------------
* Persistent grid: ``grid = min(num_cu, tile bound)`` workgroups walk the tiles in the order of
  ``kernels/tile_scheduler.py`` (the one scheduler of every backend; its pure index functions are
  called here on FlyDSL integers with ``min``/``max`` rebound). Group offsets are read on the device
  with scalar loads, so a launch needs no host sync and is graph-capturable.
* 256 threads = 4 waves in a 2x2 layout; a 128x128 output tile; each wave owns 64x64 = 4x4
  ``v_mfma_f32_16x16x128_f8f6f4`` tiles (K = 128 per instruction; the operand formats go in the
  cbsz/blgp fields, so e5m2 x e4m3 "hybrid" is the same kernel with another format field).
* Main loop, per 128-deep K block, two variants (LDS ping-pong in both):
  - register-staged (K-grouped; M-grouped with unaligned or K % 16 != 0 operands): two blocks in
    flight. Step kb issues the 8 unmasked ``buffer_load_dwordx4`` of block kb+2, reads all 8
    fragments of block kb from LDS, runs its 16 MFMAs, then writes block kb+1 (loaded a step
    ago) into the other buffer with graded ``vmcnt(15..8)`` waits and fences (``lgkmcnt(0)`` +
    ``s_barrier``). Unrolled by two so that the prefetch registers are carried in place. Only
    the last steps of a tile (blocks past the last whole one) use the exact, byte-masked loads;
    the main loop has no byte mask (``_register_step``, shared by both kernels);
  - LDS-DMA (M-grouped, ``lds_dma=True``): ``buffer_load_dwordx4 ... lds`` writes block k+1
    straight into the other buffer while the MFMAs of block k run, then
    ``vmcnt(0) lgkmcnt(0)`` + ``s_barrier`` (DMA writes are counted by vmcnt). Unrolled by two,
    with per-buffer alias scopes so LLVM does not wait for the prefetch before reading; an odd
    last block is followed by a barrier (the next persistent tile's prologue refills its
    buffer: issue 14's race, modelled in ``lds_schedule.py``).
  The fence is what makes the ping-pong safe: the buffer written in step k+1 is the one read in
  step k, and no wave passes the barrier before every wave has finished step k's reads and writes.
  Every MFMA cluster is bracketed by ``s_setprio 1/0`` and followed by 16 wait states of
  ``s_nop`` (``MFMA_HAZARD_WAIT_STATES``), pinned by scheduling barriers, so no later ds_read
  rewrites an MFMA's source registers within the hazard window (checked on the ISA).
* Addressing: every operand is reached through a buffer descriptor re-based per tile to the
  64-bit address of the tile's first byte (scalar 64-bit add); K block k0 is the instruction's
  scalar offset (soffset = k0). ``num_records`` = bytes left in the tensor clamped below the
  masked-lane offset (``host.NREC_CAP`` < ``host.OOB_OFFSET``); the plan checks that lane offset
  + contraction length stays below ``NREC_CAP``, so valid lanes are in range whether or not the
  hardware counts soffset in the range check. Lane offsets stay below 2^31 whatever the tensor
  size (> 2^31 elements, > 4 GB). Bases are pinned with ``readfirstlane`` so descriptors stay in
  SGPRs (no waterfall).
* Ragged edges: rows past a group's end / past N and K bytes past the contraction length are
  zeroed before they reach LDS (register path: the exact loads of the last steps, whose partial
  dword comes from single-byte loads so that no valid byte depends on how a dword straddling
  ``num_records`` is range-checked; DMA path: whole 16-byte chunks sent out of range), so
  garbage never enters an accumulator; stores of rows/columns outside the tile's valid range go
  to ``OOB_OFFSET`` and are dropped by the range check.
* Epilogue: ``acc * a_scale * b_scale`` (tensorwise: two scalars; rowwise: per output row / column)
  converted to the output dtype (bf16 / f16 round-to-nearest-even, or f32) and stored; with
  ``KernelConfig.accumulate`` (K-grouped, f32) the fp32 result is added to out's values.
* K-grouped: a group with no tokens runs zero K blocks and stores exact zeros (accumulate: it
  stores nothing, out[g] is left as it was).
"""

# No "from __future__ import annotations": FlyDSL reads kernel and struct annotations as types.

import functools

from .. import tile_scheduler as sched
from . import host, mx_host
from .dsl import (
    _dsl_max, _dsl_min, _flydsl, _load_group_offset, _make_srd, _opaque_zero, _raw, _readfirstlane_i32,
    _rebased_srd, _scalar_load_i32, on_dsl,
)
from .main_loop import (  # noqa: F401 (MFMA_HAZARD_WAIT_STATES: read by the ISA tests)
    MFMA_HAZARD_WAIT_STATES, _dma_issue, _DmaLoader, _fence_lds, _fence_lds_dma, _mfma_block, _MxScaleLoader,
    _OperandLoader, wave_quadrant, _register_last_step, _register_pair, _register_prologue, _zero_acc,
)

__all__ = ["KernelConfig", "build_m_grouped", "build_k_grouped", "KERNEL_NAMES"]

BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K
TILE_BYTES = host.LDS_TILE_BYTES

# The names the kernels get in the compiled code object (and in FLYDSL_DUMP_DIR/<name>_0/).
KERNEL_NAMES = {"m_grouped": "turbo_moe_m_grouped_fp8", "k_grouped": "turbo_moe_k_grouped_fp8"}


class KernelConfig(tuple):
    """(a_format, b_format, out_dtype, a_rowwise, b_rowwise, accumulate, vec_store, mx): what a compiled
    variant depends on. ``accumulate`` (K-grouped, f32 out): the epilogue adds the fp32 result to
    out's existing values instead of overwriting them. ``mx`` (register-staged main loop): MXFP8,
    the per-32-element e8m0 scales (uint8, ``mx_host`` layouts: block-major along K for the
    M-grouped kernel, slot-major along each group's tokens for the K-grouped one) go into the
    scaled MFMA's scale operands and the epilogue multiplies by nothing (it still accumulates)."""

    def __new__(cls, a_format="e4m3", b_format="e4m3", out_dtype="bf16", a_rowwise=False, b_rowwise=False,
                accumulate=False, vec_store=False, mx=False):
        for name, value in (("a_format", a_format), ("b_format", b_format)):
            if value not in host.FP8_FORMATS:
                raise ValueError(f"{name} must be one of {sorted(host.FP8_FORMATS)}, got {value!r}")
        if out_dtype not in host.OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {host.OUT_DTYPES}, got {out_dtype!r}")
        if accumulate and out_dtype != "f32":
            raise ValueError(f"accumulate needs out_dtype 'f32' (an fp32 out), got {out_dtype!r}")
        if mx and (a_rowwise or b_rowwise):
            raise ValueError("mx (e8m0 block scales in the MFMA) excludes rowwise scales")
        return super().__new__(cls, (a_format, b_format, out_dtype, bool(a_rowwise), bool(b_rowwise),
                                     bool(accumulate), bool(vec_store), bool(mx)))

    a_format = property(lambda self: self[0])
    b_format = property(lambda self: self[1])
    out_dtype = property(lambda self: self[2])
    a_rowwise = property(lambda self: self[3])
    b_rowwise = property(lambda self: self[4])
    accumulate = property(lambda self: self[5])
    # vec_store: the output's column count is a multiple of 4, so each lane's 4 consecutive
    # columns of a row are stored (and, accumulating, loaded) as one 8- or 16-byte access.
    vec_store = property(lambda self: self[6])
    mx = property(lambda self: self[7])

    @property
    def tag(self) -> str:
        scales = "mx" if self.mx else "".join("r" if r else "t" for r in (self.a_rowwise, self.b_rowwise))
        return (f"{self.a_format}x{self.b_format}_{self.out_dtype}_{scales}{'_acc' if self.accumulate else ''}"
                f"{'_v4' if self.vec_store else ''}")


def _store_tile(config, acc, c_addr, c_extent, c_base, ldc, rows_valid, cols_valid, row_scale, col_scale):
    """Scale, convert and store the 128x128 tile. ``row_scale(r)`` / ``col_scale(c)`` give the
    dequantization factor of tile row r / column c (tensorwise: the same scalar); both None for the
    MX variant (its scales were applied inside the MFMAs).

    Lane l holds, per MFMA tile (i, j), row ``host.acc_row`` and the 4 consecutive columns
    ``host.acc_col(.., e)``: with ``config.vec_store`` (column count % 4 == 0, so a group of 4 is
    wholly inside or outside) that is one 8-byte (bf16/f16) or 16-byte (f32) store per (i, j),
    16 per lane; otherwise one store per element, each masked on its own."""
    d = _flydsl()
    fx = d.fx
    out_bytes = host.OUT_BYTES[config.out_dtype]
    srd = _rebased_srd(c_addr, c_extent, c_base)
    # The store offsets do not depend on the tile, so LLVM hoists them out of the persistent loop
    # and keeps ~64 of them live across the K loop (spilling at 256 VGPRs). An opaque zero made
    # here, after the K loop, keeps them in the epilogue.
    tid = fx.Int32(fx.thread_idx.x) + _opaque_zero()
    lane = tid % host.WAVE_SIZE
    wave_row0, wave_col0 = wave_quadrant(tid // host.WAVE_SIZE)
    out_ty = {"bf16": d.T.bf16, "f16": d.T.f16, "f32": d.T.f32}[config.out_dtype]
    oob = fx.Int32(host.OOB_OFFSET)
    zero = _raw(fx.Int32(0))
    scaled = row_scale is not None
    if scaled:
        col_scales = [[col_scale(host.acc_col(wave_col0, j, lane, e)) for e in range(4)] for j in range(4)]
    for i in range(4):
        row = host.acc_row(wave_row0, i, lane)
        if scaled:
            rs = row_scale(row)
        for j in range(4):
            col = host.acc_col(wave_col0, j, lane, 0)
            values = [fx.Float32(d.vector.extract(acc[i * 4 + j], [], [e])) for e in range(4)]
            if scaled:
                values = [v * rs * col_scales[j][e] for e, v in enumerate(values)]
            if config.vec_store:
                offset = d.arith.select((row < rows_valid) & (col < cols_valid), row * ldc + col * out_bytes, oob)
                if config.accumulate:
                    # out += result in fp32 (a masked lane reads 0 and its store is dropped).
                    old = d.rocdl.raw_ptr_buffer_load(d.T.f32x4, srd, _raw(offset), zero)
                    values = [v + fx.Float32(d.vector.extract(old, [], [e])) for e, v in enumerate(values)]
                if config.out_dtype == "f32":
                    data = d.vector.from_elements(d.T.f32x4, [_raw(v) for v in values])
                else:
                    halves = [d.arith.truncf(out_ty, _raw(v)) for v in values]
                    packed = d.vector.from_elements(d.ir.VectorType.get([4], out_ty), halves)
                    data = d.vector.bitcast(d.T.i32x2, packed)
                d.rocdl.raw_ptr_buffer_store(data, srd, _raw(offset), zero)
                continue
            for e in range(4):
                ok = (row < rows_valid) & (col + e < cols_valid)
                offset = d.arith.select(ok, row * ldc + (col + e) * out_bytes, oob)
                value = values[e]
                if config.accumulate:
                    old = d.rocdl.raw_ptr_buffer_load(d.T.f32, srd, _raw(offset), zero)
                    value = fx.Float32(old) + value
                converted = _raw(value) if config.out_dtype == "f32" else d.arith.truncf(out_ty, _raw(value))
                d.rocdl.raw_ptr_buffer_store(converted, srd, _raw(offset), zero)


def _scale_readers(config, sa_addr, sa_numel, sa_row0, sb_addr, sb_numel, sb_col0):
    """(row_scale, col_scale) closures. Tensorwise scales are one scalar load each; rowwise ones are
    read per lane at ``sa_row0 + r`` / ``sb_col0 + c`` (float32 index into the scale tensor).
    (None, None) for the MX variant: nothing to apply in the epilogue."""
    d = _flydsl()
    fx = d.fx
    if config.mx:
        return None, None

    def reader(addr, numel, first, rowwise):
        srd = _make_srd(addr, fx.Int32(numel) * 4)
        if not rowwise:
            value = fx.Float32(d.arith.bitcast(d.T.f32, _raw(_scalar_load_i32(srd, fx.Int32(0)))))
            return lambda _index: value

        def per_index(index):
            offset = (first + index) * 4
            return fx.Float32(d.rocdl.raw_ptr_buffer_load(d.T.f32, srd, _raw(offset), _raw(fx.Int32(0))))

        return per_index

    return (reader(sa_addr, sa_numel, sa_row0, config.a_rowwise), reader(sb_addr, sb_numel, sb_col0, config.b_rowwise))


def _mx_scale_loaders(config, sa_addr, sb_addr, row0, group, col0, m, n, k, wave_row0, wave_col0):
    """(a's, b's) ``_MxScaleLoader`` of an M-grouped tile for the MX variant, (None, None) else.
    Bases and ends in 64 bits (``mx_host``); K groups are ``m`` (a) / ``n`` (b) bytes apart."""
    if not config.mx:
        return None, None
    fx = _flydsl().fx
    g, n64, k64 = fx.Int64(group), fx.Int64(n), fx.Int64(k)
    return (_MxScaleLoader(sa_addr, on_dsl(mx_host.a_scale_end)(fx.Int64(m), k64), on_dsl(mx_host.a_scale_tile_base)(row0), m, 0),
            _MxScaleLoader(sb_addr, on_dsl(mx_host.b_scale_end)(g, n64, k64),
                           on_dsl(mx_host.b_scale_tile_base)(g, n64, k64, fx.Int64(col0)), n, 1))


def _mx_token_scale_loaders(config, sa_addr, sb_addr, lo, group, tokens, row0, col0, n, k):
    """(a's, b's) ``_MxScaleLoader`` of a K-grouped tile for the MX variant, (None, None) else.
    The scales of group ``group``'s token blocks sit in slots ``mx_host.token_first_slot`` on
    (slot-major: one slot is N (a) or K (b) bytes); each descriptor ends at the group's last slot,
    so a K group past the group's tokens reads 0, never the next group's scale (which may be NaN)."""
    if not config.mx:
        return None, None
    fx = _flydsl().fx
    first = fx.Int64(on_dsl(mx_host.token_first_slot)(lo, group))
    t64, n64, k64 = fx.Int64(tokens), fx.Int64(n), fx.Int64(k)
    return (_MxScaleLoader(sa_addr, on_dsl(mx_host.token_scale_end)(first, t64, n64),
                           on_dsl(mx_host.token_scale_tile_base)(first, n64, fx.Int64(row0)), n, 0),
            _MxScaleLoader(sb_addr, on_dsl(mx_host.token_scale_end)(first, t64, k64),
                           on_dsl(mx_host.token_scale_tile_base)(first, k64, fx.Int64(col0)), k, 1))


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------


def _lds_storage():
    fx = _flydsl().fx

    @fx.struct
    class SharedStorage:
        tiles: fx.Array[fx.Int8, host.LDS_BYTES, 16]

    return SharedStorage


# Both kernels: 2 waves per SIMD (VGPR + AGPR <= 256, docs/flydsl.md), 256-thread workgroups.
_KERNEL_ATTRS = {"rocdl.waves_per_eu": 2, "rocdl.flat_work_group_size": "256,256"}


def _workgroup_start(SharedStorage, offs_addr, num_groups):
    """(lds_base, wave_row0, wave_col0, offs_srd): the LDS tiles' base address (readfirstlane: kept
    in an SGPR), this wave's 64x64 quadrant of the 128x128 tile (4 waves in 2x2) and the buffer
    descriptor of group_offs (num_groups + 1 int64 values)."""
    fx = _flydsl().fx
    lds = fx.SharedAllocator().allocate(SharedStorage).peek()
    lds_base = _readfirstlane_i32(fx.Int32(fx.ptrtoint(lds.tiles.ptr)))
    tid = fx.Int32(fx.thread_idx.x)
    wave_row0, wave_col0 = wave_quadrant(tid // host.WAVE_SIZE)
    offs_srd = _make_srd(offs_addr, (num_groups + 1) * 8)
    return lds_base, wave_row0, wave_col0, offs_srd


@functools.lru_cache(maxsize=None)
def build_m_grouped(config: KernelConfig, lds_dma: bool = False):
    """The launcher of the M-grouped kernel for ``config``: ``launch(*addresses, *plan.scalar_args(),
    stream)``; see ``turbo_moe/backends/flydsl_backend.py`` for the call.

    ``lds_dma``: fill LDS with ``buffer_load ... lds`` (no staging registers, no byte masks) instead
    of global -> VGPR -> ``ds_write``; only for K % 16 == 0 with 16-byte aligned rows
    (``host.m_grouped_lds_dma_ok``).

    ``config.mx``: ``sa_addr`` / ``sb_addr`` are the uint8 e8m0 scales in ``mx_host``'s layout and
    ``sa_numel`` / ``sb_numel`` their byte counts; register-staged main loop only."""
    d = _flydsl()
    flyc, fx = d.flyc, d.fx
    const_expr = d.fx.const_expr
    if config.accumulate:
        raise ValueError("accumulate is a K-grouped (wgrad) epilogue only")
    if config.mx and lds_dma:
        raise ValueError("the MX variant has the register-staged main loop only (lds_dma=False)")
    SharedStorage = _lds_storage()
    group_tiles_fn = on_dsl(sched.m_grouped_group_tiles)
    swizzle_fn = on_dsl(sched.swizzle_group_m)
    cdiv_fn = on_dsl(sched.cdiv)

    @flyc.kernel
    def turbo_moe_m_grouped_fp8(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        m: fx.Int32, n: fx.Int32, k: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, stride_bg: fx.Int64, ldc: fx.Int32,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_n_blocks: fx.Int32, tile_bound: fx.Int32, grid: fx.Int32,
    ):
        lds_base, wave_row0, wave_col0, offs_srd = _workgroup_start(SharedStorage, offs_addr, num_groups)
        k_blocks = cdiv_fn(k, BK)

        # Forward-only group cursor of kernels/tile_scheduler.py (schedule_m_grouped is its model).
        group = fx.Int32(0)
        group_first_tile = fx.Int32(0)
        lo = _load_group_offset(offs_srd, fx.Int32(0))
        hi = _load_group_offset(offs_srd, fx.Int32(1))
        group_tiles = group_tiles_fn(hi - lo, BM, num_n_blocks)
        for tile in range(fx.Int32(fx.block_idx.x), tile_bound, grid):
            while tile >= group_first_tile + group_tiles and group < num_groups:
                group_first_tile = group_first_tile + group_tiles
                group = group + 1
                lo = hi
                hi = _load_group_offset(offs_srd, _dsl_min(group + 1, num_groups))
                group_tiles = group_tiles_fn(hi - lo, BM, num_n_blocks)
            if group < num_groups:
                m_block, n_block = swizzle_fn(tile - group_first_tile, cdiv_fn(hi - lo, BM), num_n_blocks, host.GROUP_M)
                row0 = fx.Int64(lo + m_block * BM)
                col0 = n_block * BN
                rows_valid = hi - lo - m_block * BM
                a_base = row0 * fx.Int64(lda)
                b_base = fx.Int64(group) * stride_bg + fx.Int64(col0) * fx.Int64(ldb)
                acc = _zero_acc()
                if const_expr(lds_dma):
                    a_dma = _DmaLoader(a_addr, a_extent, a_base, lda, rows_valid, k)
                    b_dma = _DmaLoader(b_addr, b_extent, b_base, ldb, n - col0, k)
                    # Unrolled by two so each step's buffers are static (alias scopes per buffer).
                    buf0 = lds_base
                    buf1 = lds_base + 2 * TILE_BYTES
                    _dma_issue(a_dma, buf0, fx.Int32(0), 0)
                    _dma_issue(b_dma, buf0 + TILE_BYTES, fx.Int32(0), 0)
                    _fence_lds_dma()
                    for kp in range(fx.Int32(0), k_blocks // 2, fx.Int32(1)):
                        # Step 2kp reads buffer 0 and fills buffer 1 (last read in step 2kp-1,
                        # which every wave has finished: barrier); step 2kp+1 the other way round.
                        _dma_issue(a_dma, buf1, (kp * 2 + 1) * BK, 1)
                        _dma_issue(b_dma, buf1 + TILE_BYTES, (kp * 2 + 1) * BK, 1)
                        acc = _mfma_block(config, buf0, wave_row0, buf0 + TILE_BYTES, wave_col0, acc, 0)
                        _fence_lds_dma()
                        _dma_issue(a_dma, buf0, (kp * 2 + 2) * BK, 0)
                        _dma_issue(b_dma, buf0 + TILE_BYTES, (kp * 2 + 2) * BK, 0)
                        acc = _mfma_block(config, buf1, wave_row0, buf1 + TILE_BYTES, wave_col0, acc, 1)
                        _fence_lds_dma()
                    if k_blocks % 2 == 1:
                        # The odd last block is in buffer 0 (prologue or the last pair's refill).
                        acc = _mfma_block(config, buf0, wave_row0, buf0 + TILE_BYTES, wave_col0, acc, 0)
                        # The next persistent tile's prologue DMAs into buffer 0 at once: no wave
                        # may start it before every wave has read this block (issue 14's race;
                        # lds_schedule.dma_tile_events models this schedule, its tests check it).
                        _fence_lds()
                else:
                    sa_ld, sb_ld = _mx_scale_loaders(config, sa_addr, sb_addr, row0, group, col0, m, n, k, wave_row0,
                                                     wave_col0)
                    a_ld = _OperandLoader(a_addr, a_extent, a_base, lda, rows_valid, k, sa_ld)
                    b_ld = _OperandLoader(b_addr, b_extent, b_base, ldb, n - col0, k, sb_ld)
                    # Pairs of steps while block kb+3 is whole (no byte masks), then the last
                    # steps with exact loads; blocks kb+1 (registers) and kb+2 (loads) in flight.
                    a_next, b_next = _register_prologue(a_ld, b_ld, lds_base)
                    pairs = _dsl_max(k // BK - 2, fx.Int32(0)) // 2
                    for kp in range(fx.Int32(0), pairs, fx.Int32(1)):
                        acc, a_next, b_next = _register_pair(
                            config, a_ld, b_ld, lds_base, kp * 2, a_next, b_next, acc, wave_row0, wave_col0)
                    for kb in range(pairs * 2, k_blocks, fx.Int32(1)):
                        acc, a_next, b_next = _register_last_step(
                            config, a_ld, b_ld, lds_base, kb, a_next, b_next, acc, wave_row0, wave_col0)
                row_scale, col_scale = _scale_readers(
                    config, sa_addr, sa_numel, fx.Int32(row0), sb_addr, sb_numel, group * n + col0
                )
                _store_tile(
                    config, acc, c_addr, c_extent, row0 * fx.Int64(ldc) + fx.Int64(col0 * host.OUT_BYTES[config.out_dtype]),
                    ldc, rows_valid, n - col0, row_scale, col_scale,
                )

    @flyc.jit
    def launch(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        m: fx.Int32, n: fx.Int32, k: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, stride_bg: fx.Int64, ldc: fx.Int32,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_n_blocks: fx.Int32, tile_bound: fx.Int32, grid: fx.Int32,
        stream: fx.Stream,
    ):
        turbo_moe_m_grouped_fp8(
            a_addr, b_addr, c_addr, sa_addr, sb_addr, offs_addr, sa_numel, sb_numel,
            m, n, k, num_groups, lda, ldb, stride_bg, ldc, a_extent, b_extent, c_extent,
            num_n_blocks, tile_bound, grid,
            value_attrs=_KERNEL_ATTRS,
        ).launch(grid=(grid, 1, 1), block=(host.NUM_THREADS, 1, 1), stream=stream)

    return launch


@functools.lru_cache(maxsize=None)
def build_k_grouped(config: KernelConfig, band_cyclic: bool = True):
    """The launcher of the K-grouped (wgrad) kernel for ``config``.

    ``config.mx``: ``sa_addr`` / ``sb_addr`` are the uint8 e8m0 token-block scales, slot-major
    (``mx_host``: ``quantize_tokens``' storage), one descriptor per tile ending at the group's last
    slot; ``sa_numel`` / ``sb_numel`` are not read."""
    d = _flydsl()
    flyc, fx = d.flyc, d.fx
    const_expr = d.fx.const_expr
    SharedStorage = _lds_storage()
    order_fn = on_dsl(sched.k_grouped_band_cyclic if band_cyclic else sched.k_grouped_group_major)
    cdiv_fn = on_dsl(sched.cdiv)

    @flyc.kernel
    def turbo_moe_k_grouped_fp8(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        n: fx.Int32, k: fx.Int32, m: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, ldc: fx.Int32, stride_cg: fx.Int64,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_m_blocks: fx.Int32, num_n_blocks: fx.Int32, total_tiles: fx.Int32, grid: fx.Int32,
    ):
        lds_base, wave_row0, wave_col0, offs_srd = _workgroup_start(SharedStorage, offs_addr, num_groups)
        for tile in range(fx.Int32(fx.block_idx.x), total_tiles, grid):
            group, m_block, n_block = order_fn(tile, num_groups, num_m_blocks, num_n_blocks, host.GROUP_M)
            lo = _load_group_offset(offs_srd, group)
            hi = _load_group_offset(offs_srd, group + 1)
            tokens = hi - lo
            row0 = m_block * BM
            col0 = n_block * BN
            sa_ld, sb_ld = _mx_token_scale_loaders(config, sa_addr, sb_addr, lo, group, tokens, row0, col0, n, k)
            a_ld = _OperandLoader(a_addr, a_extent, fx.Int64(row0) * fx.Int64(lda) + fx.Int64(lo), lda, n - row0, tokens,
                                  sa_ld)
            b_ld = _OperandLoader(b_addr, b_extent, fx.Int64(col0) * fx.Int64(ldb) + fx.Int64(lo), ldb, k - col0, tokens,
                                  sb_ld)
            # An empty group runs no K block: the accumulators stay exactly zero.
            k_blocks = cdiv_fn(tokens, BK)
            acc = _zero_acc()
            a_next, b_next = _register_prologue(a_ld, b_ld, lds_base)
            pairs = _dsl_max(tokens // BK - 2, fx.Int32(0)) // 2
            for kp in range(fx.Int32(0), pairs, fx.Int32(1)):
                acc, a_next, b_next = _register_pair(
                    config, a_ld, b_ld, lds_base, kp * 2, a_next, b_next, acc, wave_row0, wave_col0)
            for kb in range(pairs * 2, k_blocks, fx.Int32(1)):
                acc, a_next, b_next = _register_last_step(
                    config, a_ld, b_ld, lds_base, kb, a_next, b_next, acc, wave_row0, wave_col0)
            row_scale, col_scale = _scale_readers(config, sa_addr, sa_numel, group * n + row0, sb_addr, sb_numel, group * k + col0)
            rows_out = n - row0
            if const_expr(config.accumulate):
                # An empty group leaves out[g] exactly as it was (no store at all, not "+ 0").
                rows_out = on_dsl(host.k_grouped_rows_stored)(rows_out, tokens)
            _store_tile(
                config, acc, c_addr, c_extent,
                fx.Int64(group) * stride_cg + fx.Int64(row0) * fx.Int64(ldc) + fx.Int64(col0 * host.OUT_BYTES[config.out_dtype]),
                ldc, rows_out, k - col0, row_scale, col_scale,
            )

    @flyc.jit
    def launch(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        n: fx.Int32, k: fx.Int32, m: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, ldc: fx.Int32, stride_cg: fx.Int64,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_m_blocks: fx.Int32, num_n_blocks: fx.Int32, total_tiles: fx.Int32, grid: fx.Int32,
        stream: fx.Stream,
    ):
        turbo_moe_k_grouped_fp8(
            a_addr, b_addr, c_addr, sa_addr, sb_addr, offs_addr, sa_numel, sb_numel,
            n, k, m, num_groups, lda, ldb, ldc, stride_cg, a_extent, b_extent, c_extent,
            num_m_blocks, num_n_blocks, total_tiles, grid,
            value_attrs=_KERNEL_ATTRS,
        ).launch(grid=(grid, 1, 1), block=(host.NUM_THREADS, 1, 1), stream=stream)

    return launch
