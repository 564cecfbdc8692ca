"""Rowwise FP8 of a wgrad operand, both layouts in two passes: a stats pass, then one cast.

A rowwise wgrad operand needs two FP8 copies with different scales: row-major scaled per row (over
the columns: the forward / dgrad operand) and token-major scaled per (group, column) over the
group's rows (the wgrad operand). ``fp8_cast``'s one-pass kernels make one copy each and read the
source twice each (an amax loop, then a cast loop): four reads for the pair. Here a stats pass
reads the source once and finds both amaxes, and a cast pass reads it once more and writes both
copies (its transposed loads hit L2): two reads.

The source is a tensor (``SOURCE_TENSOR``: x, dy, W) or, in an expert MLP, a value that exists
only inside the kernels (``swiglu_fp8``'s tile functions, the same math as its tensorwise kernels):

* ``SOURCE_SWIGLU``: ``a = silu(h[:, :F]) * h[:, F:] * probs``, fc2's input, from fc1's output ``h``;
* ``SOURCE_SWIGLU_GRAD``: ``dh`` [M, 2F], fc1's output gradient, from ``h``, ``probs`` and fc2's
  dgrad output ``da``; each tile of ``F``-columns gives the gate half (columns c) and the linear
  half (columns F + c). The stats pass also sums ``dprobs`` per (row, column split), which the cast
  pass adds up in split order (fixed: deterministic).

Neither ``a`` nor ``dh`` is written in high precision: a rowwise MLP quantizes them as the
tensorwise one does (``swiglu_fp8``'s module docstring), with the rowwise scales.

Tiles. The stats pass walks group-aligned row slabs over one column block each, in the M-grouped
problem's group-major order (the shared scheduler's ``m_grouped_group_tiles`` /
``swizzle_group_m``): every row of a slab belongs to one group, so its column maxima go to one
(group, column) slot. A program walks its slab a few rows a step (``SUB_R``), keeping the column
maxima elementwise in registers across the steps, so that they meet the other slabs' once per slab
(the walk of whole tiles across 1024-column splits it replaced reduced them across warps and
issued atomics every column step: ``dh``'s stats 0.77 -> 0.51 ms, H100, 98304 rows, 64 groups,
F = 2048). Each program finds its tile from the offsets loaded as one vector (a cumulative sum of
the groups' tile counts), not by a walk over the groups. The cast pass walks plain row tiles
instead: a tile that starts at a group's first row is not 16-byte aligned in the transposed copy,
whose byte-wise stores ran the cast at half speed (H100); it finds its rows' groups by a binary
search over the offsets. A tile whose rows span groups needs a scale per (column, row) in its
transposed copy: a small third launch writes those tiles (``rowwise_layouts_straddle_kernel``, a
program per group boundary), because the gathered scales' code in the cast kernel cost every tile
registers (H100, 98304 rows, 64 groups: the cast of ``dh`` 1.08 -> 0.88 ms, of ``x`` 0.18 -> 0.15).

Column maxima of one group come from many slabs, and row maxima from every column block: both meet
by ``atomic_max`` on the float bits (|x| is non-negative, so its bits order as its values; a NaN's
bits order above +inf, so NaN wins as torch's amax keeps it): exact in any order, deterministic.
Those buffers start zeroed by :func:`zero_f32_kernel` (a launch, not ``torch.zeros``: a host
plan's zero-filled allocation would stop its replay from freeing as it goes). ``dprobs`` is summed
per column block, and the cast adds the blocks up in order.

H100, 98304 x 1024 / x 4096 bf16, 64 groups (``scripts/probe_rowwise_layouts.py``, the first
version of these passes): stats 0.10 / 0.34 ms, cast 0.18 / 0.74 ms, against 0.37 / 1.41 ms for
the two one-pass kernels (0.80 / 1.52 under skewed routing, where the columnwise kernel's
per-group programs serialize) and 0.24 / 0.98 ms for tensorwise's amax and cast.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import scheduler as S
from .fp8_cast import _batched, _cdiv, _quant_scales, clamp_keep_nan
from .fp8_cast import _first_rows as _first_copy_rows
from .launch import arg_fact, lean
from .swiglu_fp8 import _swiglu_grad_tile, _weighted_swiglu_tile

SOURCE_TENSOR, SOURCE_SWIGLU, SOURCE_SWIGLU_GRAD = 0, 1, 2


@triton.jit
def zero_f32_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=offs < n)


@triton.jit
def _grouped_row_tile(tile, offs_ptr, R, G, num_n_blocks, ONE_GROUP: tl.constexpr, G_PAD: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """(group, first row, end row, m_block, n_block) of an M-grouped tile id, ``group == G`` past
    the last tile. ONE_GROUP: all R rows are group 0 (offsets not read)."""
    if ONE_GROUP:
        group = tl.where(tile < S.m_grouped_group_tiles(R, BLOCK_R, num_n_blocks), 0, G)
        lo = tl.zeros((), tl.int64)
        hi = R.to(tl.int64)
        local = tile
    else:
        g = tl.arange(0, G_PAD)
        lo_v = tl.load(offs_ptr + g, mask=g < G, other=0)
        hi_v = tl.load(offs_ptr + g + 1, mask=g < G, other=0)
        tiles_v = S.m_grouped_group_tiles(hi_v - lo_v, BLOCK_R, num_n_blocks)
        end_v = tl.cumsum(tiles_v, 0)
        group = tl.sum((end_v <= tile).to(tl.int32), 0)
        mine = g == group
        local = tile - tl.sum(tl.where(mine, end_v - tiles_v, 0), 0)
        lo = tl.sum(tl.where(mine, lo_v, 0), 0)
        hi = tl.sum(tl.where(mine, hi_v, 0), 0)
    m_block, n_block = S.swizzle_group_m(local, S.cdiv(hi - lo, BLOCK_R), num_n_blocks, 1)
    return group, lo, hi, m_block, n_block


@triton.jit
def _row_groups(offs_ptr, rows, G, SEARCH_STEPS: tl.constexpr):
    """Group of each row (the largest g < G with offs[g] <= row; rows past the end land in G - 1),
    by a binary search of SEARCH_STEPS = bit_length(G - 1) steps over the offsets."""
    lo = tl.zeros(rows.shape, tl.int32)
    hi = tl.zeros(rows.shape, tl.int32) + (G - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        up = tl.load(offs_ptr + mid) <= rows
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return lo


@triton.jit
def _source_tile(x_ptr, probs_ptr, da_ptr, rows, cols, row_end, C, stride_xr, stride_xc, stride_da,
                 SOURCE: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """float32 ``(half0, half1, dprob)`` of a source tile over rows < row_end and cols < C (the
    source's columns: C, or F for the SwiGLU sources): ``[rows, cols]`` when ROWS_FIRST, else
    ``[cols, rows]`` from transposed loads; masked-out elements 0. ``half1`` and ``dprob`` only
    mean something for SOURCE_SWIGLU_GRAD (dh's linear half, ``da * silu(gate) * linear``)."""
    if SOURCE == 0:
        if ROWS_FIRST:
            mask = (rows[:, None] < row_end) & (cols[None, :] < C)
            v = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        else:
            mask = (cols[:, None] < C) & (rows[None, :] < row_end)
            v = tl.load(x_ptr + cols[:, None] * stride_xc + rows[None, :] * stride_xr, mask=mask, other=0.0)
        v = v.to(tl.float32)
        return v, v, v
    elif SOURCE == 1:
        a = _weighted_swiglu_tile(x_ptr, probs_ptr, rows, cols, row_end, C, stride_xr, ROWS_FIRST)
        return a, a, a
    else:
        return _swiglu_grad_tile(x_ptr, probs_ptr, da_ptr, rows, cols, row_end, C, stride_xr, stride_da, ROWS_FIRST)


@triton.jit
def _bits(v):
    """|v| as int32 bits (orders as the values; NaN above +inf)."""
    return tl.abs(v).to(tl.int32, bitcast=True)


@triton.jit
def rowwise_layouts_stats_kernel(
    x_ptr, probs_ptr, da_ptr, offs_ptr, row_amax_ptr, col_amax_ptr, dprobs_part_ptr,
    R, R_OUT, C, G, num_splits, stride_xb, stride_xr, stride_xc, stride_da,
    SOURCE: tl.constexpr, ONE_GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, SUB_R: tl.constexpr,
):
    """Pass 1 over the source [B, R, C] (C its own columns; the output has 2C for the SwiGLU
    gradient). A tile is (group, slab of BLOCK_R rows of that group, column block of BLOCK_C: a
    "split"); it walks its rows SUB_R at a time, keeps its column maxima elementwise in registers
    across the steps, and folds them into col_amax [B, G, OUT_C] once, by atomic max; each step
    folds its rows' max |v| over the block into row_amax [B, R] by atomic max (both zeroed).
    SOURCE_SWIGLU_GRAD also stores each row's dprobs partial sum over the block to dprobs_part
    [num_splits, R_OUT]. R_OUT >= R: the rows of the buffers (a token bucket's row capacity,
    ``docs/design.md`` "Not yet served"; R otherwise); rows past R are never touched."""
    batch = tl.program_id(1).to(tl.int64)
    group, lo, hi, m_block, split = _grouped_row_tile(tl.program_id(0).to(tl.int64), offs_ptr, R, G, num_splits,
                                                      ONE_GROUP, G_PAD, BLOCK_R)
    if group < G:
        out_c = 2 * C if SOURCE == 2 else C
        x_b = x_ptr + batch * stride_xb
        col_slot = col_amax_ptr.to(tl.pointer_type(tl.int32)) + (batch * G + group) * out_c
        row_slot = row_amax_ptr.to(tl.pointer_type(tl.int32)) + batch * R_OUT
        cols = split * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        acc0 = tl.zeros((SUB_R, BLOCK_C), tl.int32)
        acc1 = tl.zeros((SUB_R, BLOCK_C), tl.int32)
        first = lo + m_block * BLOCK_R
        for r0 in range(0, tl.minimum(BLOCK_R, hi - first), SUB_R):
            rows = first + r0 + tl.arange(0, SUB_R)
            row_ok = rows < hi
            v0, v1, dp = _source_tile(x_b, probs_ptr, da_ptr, rows, cols, hi, C, stride_xr, stride_xc, stride_da,
                                      SOURCE, True)
            bits = _bits(v0)
            acc0 = tl.maximum(acc0, bits)
            row_bits = tl.max(bits, axis=1)
            if SOURCE == 2:
                bits1 = _bits(v1)
                acc1 = tl.maximum(acc1, bits1)
                row_bits = tl.maximum(row_bits, tl.max(bits1, axis=1))
                tl.store(dprobs_part_ptr + split * R_OUT + rows, tl.sum(dp, axis=1), mask=row_ok)
            tl.atomic_max(row_slot + rows, row_bits, mask=row_ok, sem="relaxed")
        tl.atomic_max(col_slot + cols, tl.max(acc0, axis=0), mask=col_ok, sem="relaxed")
        if SOURCE == 2:
            tl.atomic_max(col_slot + C + cols, tl.max(acc1, axis=0), mask=col_ok, sem="relaxed")


@triton.jit
def _store_fp8_scaled(ptrs, v, scale, mask, FP8_MAX: tl.constexpr):
    q = clamp_keep_nan(v * scale, FP8_MAX)
    tl.store(ptrs, q.to(ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _column_scales(col_amax_b, cols, col_ok, row_group, group_lo, out_c, mask_t, UNIFORM: tl.constexpr,
                   FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr):
    """Quantization scales of a transposed tile's columns: one [BLOCK_C, 1] vector when the tile's
    rows are one group (UNIFORM), else one per (column, row) gathered by the rows' groups."""
    if UNIFORM:
        amax = tl.load(col_amax_b + group_lo * out_c + cols, mask=col_ok, other=0.0)
        scale, _ = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
        return scale[:, None]
    else:
        amax = tl.load(col_amax_b + row_group[None, :].to(tl.int64) * out_c + cols[:, None], mask=mask_t, other=0.0)
        scale, _ = _quant_scales(amax, FP8_MAX, MARGIN_FACTOR)
        return scale


@triton.jit
def _cast_transposed(x_b, probs_ptr, da_ptr, out_t_b, col_amax_b, rows, cols, row_ok, col_ok, row_group, group_lo,
                     R, R_OUT, C, stride_xr, stride_xc, stride_da, SOURCE: tl.constexpr, UNIFORM: tl.constexpr,
                     FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr):
    out_c = 2 * C if SOURCE == 2 else C
    mask_t = col_ok[:, None] & row_ok[None, :]
    v0, v1, _ = _source_tile(x_b, probs_ptr, da_ptr, rows, cols, R, C, stride_xr, stride_xc, stride_da, SOURCE, False)
    _store_fp8_scaled(out_t_b + cols[:, None] * R_OUT + rows[None, :], v0,
                      _column_scales(col_amax_b, cols, col_ok, row_group, group_lo, out_c, mask_t, UNIFORM, FP8_MAX,
                                     MARGIN_FACTOR), mask_t, FP8_MAX)
    if SOURCE == 2:
        _store_fp8_scaled(out_t_b + (cols[:, None] + C) * R_OUT + rows[None, :], v1,
                          _column_scales(col_amax_b, cols + C, col_ok, row_group, group_lo, out_c, mask_t, UNIFORM,
                                         FP8_MAX, MARGIN_FACTOR), mask_t, FP8_MAX)


@triton.jit
def rowwise_layouts_cast_kernel(
    x_ptr, probs_ptr, da_ptr, offs_ptr, row_amax_ptr, col_amax_ptr, dprobs_part_ptr,
    out_ptr, out_t_ptr, row_dequant_ptr, col_dequant_ptr, dprobs_ptr,
    R, R_OUT, C, G, num_splits, num_tiles, stride_xb, stride_xr, stride_xc, stride_da,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr,
    SOURCE: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    FINAL_BLOCK: tl.constexpr,
):
    """Pass 2: tile (row block, column block) of the source scales its rows by their amax (row_amax,
    from the stats pass) into out [B, R, OUT_C] and each column by its row's group's amax into
    out_t [B, OUT_C, R]; column block 0 stores the rows' dequantization scales (and dprobs, the
    stats pass's num_splits column-block partials summed in order). Plain row tiles, not
    group-aligned ones (module docstring): a tile inside one group multiplies its transposed copy
    by one scale vector; one that straddles groups leaves that copy to
    rowwise_layouts_straddle_kernel. Programs past ``num_tiles`` store col_dequant [B, G, OUT_C]
    for every group, empty ones too (amax 0: scale 1). Buffers and outputs have R_OUT >= R rows
    (the stats kernel's); rows past R are not written."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    out_c = 2 * C if SOURCE == 2 else C
    if pid >= num_tiles:
        flat = (pid - num_tiles).to(tl.int64) * FINAL_BLOCK + tl.arange(0, FINAL_BLOCK)
        ok = flat < G * out_c
        col_amax = tl.load(col_amax_ptr + batch * G * out_c + flat, mask=ok, other=0.0)
        _col_scale, col_dequant = _quant_scales(col_amax, FP8_MAX, MARGIN_FACTOR)
        tl.store(col_dequant_ptr + batch * G * out_c + flat, col_dequant, mask=ok)
    else:
        num_n_blocks = S.cdiv(C, BLOCK_C)
        m_block = pid // num_n_blocks
        n_block = pid % num_n_blocks
        rows = m_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = n_block.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < R
        col_ok = cols < C
        x_b = x_ptr + batch * stride_xb
        row_amax = tl.load(row_amax_ptr + batch * R_OUT + rows, mask=row_ok, other=0.0)
        row_scale, row_dequant = _quant_scales(row_amax, FP8_MAX, MARGIN_FACTOR)
        if n_block == 0:
            tl.store(row_dequant_ptr + batch * R_OUT + rows, row_dequant, mask=row_ok)
            if SOURCE == 2:
                dprob = tl.zeros((BLOCK_R,), tl.float32)
                for s in range(0, num_splits):
                    dprob += tl.load(dprobs_part_ptr + s * R_OUT + rows, mask=row_ok, other=0.0)
                tl.store(dprobs_ptr + rows, dprob.to(dprobs_ptr.dtype.element_ty), mask=row_ok)
        if WRITE_ROWS:
            mask = row_ok[:, None] & col_ok[None, :]
            v0, v1, _dprob = _source_tile(x_b, probs_ptr, da_ptr, rows, cols, R, C, stride_xr, stride_xc, stride_da,
                                          SOURCE, True)
            out_rows = out_ptr + batch * R_OUT * out_c + rows[:, None] * out_c + cols[None, :]
            _store_fp8_scaled(out_rows, v0, row_scale[:, None], mask, FP8_MAX)
            if SOURCE == 2:
                _store_fp8_scaled(out_rows + C, v1, row_scale[:, None], mask, FP8_MAX)
        if WRITE_T:
            # (one group: no search step, no offset read; group 0 everywhere)
            row_group = _row_groups(offs_ptr, tl.minimum(rows, R - 1), G, SEARCH_STEPS)
            group_lo = tl.min(row_group, axis=0)
            out_t_b = out_t_ptr + batch * R_OUT * out_c
            col_amax_b = col_amax_ptr + batch * G * out_c
            if group_lo == tl.max(row_group, axis=0):  # (a tile across groups: the straddle kernel's)
                _cast_transposed(x_b, probs_ptr, da_ptr, out_t_b, col_amax_b, rows, cols, row_ok, col_ok, row_group,
                                 group_lo, R, R_OUT, C, stride_xr, stride_xc, stride_da, SOURCE, True, FP8_MAX,
                                 MARGIN_FACTOR)


@triton.jit
def rowwise_layouts_straddle_kernel(
    x_ptr, probs_ptr, da_ptr, offs_ptr, col_amax_ptr, out_t_ptr,
    R, R_OUT, C, G, stride_xb, stride_xr, stride_xc, stride_da,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, SOURCE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The transposed copy's row tiles that hold rows of two or more groups, which the cast pass
    leaves out: program (boundary g - 1, column block, batch) writes the cast's row tile holding
    offs[g] (1 <= g < G) with a scale per (column, row), if that boundary falls inside the tile
    (not on its first row, not past R) and no earlier boundary does (offs[g - 1] at or before the
    tile's first row): each such tile once. Kept out of the cast kernel because its gathered
    scales cost every tile registers there (H100: the cast of dh 1.08 -> 0.88 ms without them)."""
    g = tl.program_id(0).to(tl.int64) + 1
    n_block = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    boundary = tl.load(offs_ptr + g)
    first = boundary // BLOCK_R * BLOCK_R
    if (boundary > first) & (boundary < R) & (tl.load(offs_ptr + g - 1) <= first):
        out_c = 2 * C if SOURCE == 2 else C
        rows = first + tl.arange(0, BLOCK_R)
        cols = n_block.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_group = _row_groups(offs_ptr, tl.minimum(rows, R - 1), G, SEARCH_STEPS)
        _cast_transposed(x_ptr + batch * stride_xb, probs_ptr, da_ptr, out_t_ptr + batch * R_OUT * out_c,
                         col_amax_ptr + batch * G * out_c, rows, cols, rows < R, cols < C, row_group, 0, R, R_OUT, C,
                         stride_xr, stride_xc, stride_da, SOURCE, False, FP8_MAX, MARGIN_FACTOR)


# Tiles per source: (rows, columns, warps, rows a step) of the stats pass (a program walks a slab of
# rows of one group over one column block, the given rows a step) and (rows, columns, warps) of the
# cast pass. H100 sweep (scripts/probe_rowwise_layouts.py, 98304 rows, 64 groups; x 1024 columns, a
# and dh from F = 2048; ms): stats of x 0.095, of a 0.303, of dh 0.511 (the whole-tile walk over
# 1024-column splits before: 0.111 / 0.354 / 0.767, with dh's cast 0.023 faster for summing 2
# splits' dprobs instead of 32); casts 32 x 64 on 4 warps 0.18 / 0.62 / 1.07 (up to 0.26 / 0.86 /
# 1.31 with other tiles). With 4096 rows and 16 groups: stats 0.008 / 0.023 / 0.043 (before 0.013 /
# 0.034 / 0.054). Under _MIN_STATS_TILES tiles (few rows), one-step 32-row slabs keep the SMs busy.
# The casts without the tiles across groups (rowwise_layouts_straddle_kernel's): x 0.147 (32 x 64),
# a 0.503 (32 x 128; 32 x 64: 0.548), dh 0.880 (32 x 64; 32 x 128: 0.910), against 0.184 / 0.618 /
# 1.076 with them.
_STATS = {SOURCE_TENSOR: (256, 64, 4, 16), SOURCE_SWIGLU: (512, 128, 4, 32), SOURCE_SWIGLU_GRAD: (512, 64, 4, 32)}
_STATS_FEW_ROWS = (32, 64, 4, 32)
_CAST = {SOURCE_TENSOR: (32, 64, 4), SOURCE_SWIGLU: (32, 128, 4), SOURCE_SWIGLU_GRAD: (32, 64, 4)}
_MIN_STATS_TILES = 512
_FINAL = 1024
MAX_GROUPS = 4096


def _stats_config(source: int, r: int, c: int, groups: int, batches: int):
    """The stats tiles of a source with r rows and c (its own) columns: the source's, or the small
    configuration where the source's would make fewer than _MIN_STATS_TILES tiles (the grid's bound)."""
    config = _STATS[source]
    if (_cdiv(r, config[0]) + groups) * max(_cdiv(c, config[1]), 1) * batches < _MIN_STATS_TILES:
        return _STATS_FEW_ROWS
    return config


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class _Geometry:
    """What a layouts call of one source shape derives before its launches: output shapes, the
    stats buffer's parts, tiles, grids and the constant parts of the launch keys. Cached per
    (source, shapes, strides, dtypes, group count, recipe, flags): a fwd+bwd makes the same few
    calls every step, and deriving this per call cost a rowwise fwd+bwd about 30 us of Python
    (``scripts/host_glue_cpu.py``)."""

    __slots__ = ("r", "c", "out_c", "groups", "one_group", "grad", "rows_shape", "trans_shape", "stats_n", "parts",
                 "row_dequant_shape", "col_dequant_shape", "byte_offsets", "zero_grid", "stats_grid", "cast_grid",
                 "num_splits", "cast_tiles", "args", "stats_key", "cast_key", "stats_meta", "cast_meta", "empty",
                 "strides", "straddle_grid", "straddle_meta", "capacity")

    def __init__(self, source, x, da, groups, one_group, fp8_dtype, fp8_max, margin, write_rows, write_transposed,
                 probs_dtype, dprobs_dtype, capacity):
        batches, r, c_in, stride_b = _batched(x)
        # Every allocation, buffer stride and grid follows the row capacity (>= r): a plan recorded at
        # one row count then fits any count of the bucket. Only masks and group offsets follow r.
        c = c_in if source == SOURCE_TENSOR else c_in // 2  # the source's own columns
        out_c = 2 * c if source == SOURCE_SWIGLU_GRAD else c
        grad = source == SOURCE_SWIGLU_GRAD
        lead = x.shape[:-2]
        self.r, self.c, self.out_c, self.groups, self.one_group, self.grad = r, c, out_c, groups, one_group, grad
        self.capacity = capacity
        self.rows_shape, self.trans_shape = lead + (capacity, out_c), lead + (out_c, capacity)
        stats_r, stats_c, stats_warps, stats_sub = _stats_config(source, capacity, c, 0 if one_group else groups,
                                                                 batches)
        self.num_splits = num_splits = max(_cdiv(c, stats_c), 1)  # the stats pass's column blocks
        # One float32 allocation: the column and the row amaxes (zeroed), the dprobs partials,
        # then the row and column dequantization scales side by side (a rowwise
        # QuantizedGradHandoff hands them on as one tensor).
        col_n, row_n = batches * groups * out_c, batches * capacity  # (group, column) and row entries
        dp_n = num_splits * capacity if grad else 0
        self.stats_n = col_n + row_n + dp_n + row_n + col_n
        scales = col_n + row_n + dp_n
        # (start, end) of: column amaxes, row amaxes, dprobs partials, scales, row scales, column scales
        self.parts = ((0, col_n), (col_n, col_n + row_n), (col_n + row_n, scales), (scales, self.stats_n),
                      (scales, scales + row_n), (scales + row_n, self.stats_n))
        self.byte_offsets = tuple(4 * start for start, _ in self.parts)
        self.row_dequant_shape, self.col_dequant_shape = lead + (capacity,), lead + (groups, out_c)
        self.empty = batches * r * c == 0
        g_pad = 1 if one_group else _next_pow2(groups)
        stride_r = x.stride(-2)
        stride_c = x.stride(-1) if source == SOURCE_TENSOR else 1
        stride_da = da.stride(0) if grad else 0
        self.strides = (stride_b, stride_r, stride_c, stride_da)
        cast_r, cast_c, cast_warps = _CAST[source]
        # The tile bound needs no group sizes: sum_g cdiv(M_g, BR) <= cdiv(R, BR) + G.
        self.zero_grid = (_cdiv(col_n + row_n, _FINAL),)  # the column and the row amaxes
        self.stats_grid = ((_cdiv(capacity, stats_r) + (0 if one_group else groups)) * num_splits, batches)
        self.cast_tiles = cast_tiles = _cdiv(capacity, cast_r) * _cdiv(c, cast_c)
        self.cast_grid = (cast_tiles + _cdiv(groups * out_c, _FINAL), batches)
        self.args = (r, capacity, c, groups, num_splits)
        self.stats_meta = dict(SOURCE=source, ONE_GROUP=one_group, G_PAD=g_pad, BLOCK_R=stats_r, BLOCK_C=stats_c,
                               SUB_R=stats_sub, num_warps=stats_warps)
        self.cast_meta = dict(FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, WRITE_ROWS=write_rows,
                              WRITE_T=write_transposed, SOURCE=source, SEARCH_STEPS=(groups - 1).bit_length(),
                              BLOCK_R=cast_r, BLOCK_C=cast_c, FINAL_BLOCK=_FINAL,
                              num_warps=cast_warps)
        self.stats_key = (source, x.dtype, probs_dtype, da.dtype if grad else x.dtype, one_group, g_pad, arg_fact(r),
                          arg_fact(capacity), c, groups, batches, stride_b, stride_r, stride_c, arg_fact(stride_da),
                          stats_r, stats_c, stats_sub, stats_warps, cast_r, cast_c, cast_warps)
        self.cast_key = self.stats_key + (fp8_dtype, fp8_max, margin, write_rows, write_transposed, num_splits,
                                          arg_fact(cast_tiles), dprobs_dtype)
        # The transposed copy's tiles across groups: a program per group boundary and column block.
        self.straddle_grid = (groups - 1, _cdiv(c, cast_c), batches) if write_transposed and groups > 1 else None
        self.straddle_meta = dict(FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, SOURCE=source,
                                  SEARCH_STEPS=(groups - 1).bit_length(), BLOCK_R=cast_r, BLOCK_C=cast_c,
                                  num_warps=cast_warps)


_GEOMETRY = {}
_MAX_GEOMETRIES = 1024


def _layouts(source, x, probs, da, group_offs, fp8_dtype, fp8_max, margin, write_rows, write_transposed,
             dprobs_dtype=None, row_capacity=None):
    """Both layouts of the source (``x`` [R, C] or [B, R, C]; the SwiGLU sources' ``x`` is ``h``
    [R, 2F]): ``(rows or None, row dequant, transposed or None, column dequant, dprobs or None,
    both dequant scales packed)``. ``row_capacity`` (>= R, a token bucket's): every buffer has that
    many rows and the results are views of their first R (the packed scales: the capacity's row
    scales, then the column scales; ``turbo_moe.quantize.split_packed_scales`` takes the column
    scales from the end)."""
    import torch

    one_group = group_offs is None
    groups = 1 if one_group else group_offs.shape[0] - 1
    if groups > MAX_GROUPS:
        raise ValueError(f"rowwise layouts: group_offs has {groups} groups, more than {MAX_GROUPS}")
    grad = source == SOURCE_SWIGLU_GRAD
    capacity = x.shape[-2] if row_capacity is None else row_capacity
    if capacity < x.shape[-2]:
        raise ValueError(f"row_capacity ({capacity}) must be at least the source's row count ({x.shape[-2]})")
    probs_dtype = probs.dtype if probs is not None else x.dtype
    lookup = (source, x.shape, x.stride(), x.dtype, probs_dtype, da.stride(0) if grad else None,
              da.dtype if grad else None, groups if not one_group else None, fp8_dtype, fp8_max, margin, write_rows,
              write_transposed, dprobs_dtype, capacity)
    geo = _GEOMETRY.get(lookup)
    if geo is None:
        if len(_GEOMETRY) >= _MAX_GEOMETRIES:
            _GEOMETRY.clear()
        geo = _GEOMETRY[lookup] = _Geometry(source, x, da, groups, one_group, fp8_dtype, fp8_max, margin,
                                            write_rows, write_transposed, probs_dtype, dprobs_dtype, capacity)
    device = x.device
    rows = torch.empty(geo.rows_shape, dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty(geo.trans_shape, dtype=fp8_dtype, device=device) if write_transposed else None
    stats = torch.empty((geo.stats_n,), dtype=torch.float32, device=device)
    (_, col_end), (row_amax_lo, row_amax_hi), (dp_lo, dp_hi), (sc_lo, _), (_, row_end), _ = geo.parts
    col_amax = stats[:col_end]
    row_amax = stats[row_amax_lo:row_amax_hi]
    dprobs_part = stats[dp_lo:dp_hi] if grad else stats
    scales = stats[sc_lo:]
    row_dequant = stats[sc_lo:row_end].view(geo.row_dequant_shape)
    col_dequant = stats[row_end:].view(geo.col_dequant_shape)
    dprobs = torch.empty((geo.capacity,), dtype=dprobs_dtype, device=device) if grad else None
    if geo.empty:  # no element: every amax is 0, every scale 1
        scales.fill_(1.0)
        if grad:
            dprobs.zero_()
        return _first_rows(geo, rows, row_dequant, trans, col_dequant, dprobs, scales)
    offs = x if one_group else group_offs
    probs_arg = probs if probs is not None else x
    da_arg = da if grad else x
    sp = stats.data_ptr()
    at = tuple((sp + o) % 16 == 0 for o in geo.byte_offsets)  # col amax, row part, dprobs part, scales...
    aligned = (x.data_ptr() % 16 == 0, probs_arg.data_ptr() % 16 == 0, da_arg.data_ptr() % 16 == 0,
               offs.data_ptr() % 16 == 0, at[0], at[1], at[2] if grad else at[0])
    stride_b, stride_r, stride_c, stride_da = geo.strides
    r, capacity, c, groups, num_splits = geo.args
    _zero.launch_keyed(geo.zero_grid, (arg_fact(geo.parts[1][1]), at[0]), stats, geo.parts[1][1], BLOCK=_FINAL,
                       num_warps=4)
    _stats.launch_keyed(geo.stats_grid, geo.stats_key + aligned,
                        x, probs_arg, da_arg, offs, row_amax, col_amax, dprobs_part, r, capacity, c, groups,
                        num_splits, stride_b, stride_r, stride_c, stride_da, **geo.stats_meta)
    out = rows if rows is not None else (trans if trans is not None else stats)
    dprobs_arg = dprobs if grad else stats
    _cast.launch_keyed(
        geo.cast_grid,
        geo.cast_key + aligned + (out.data_ptr() % 16 == 0, trans is None or trans.data_ptr() % 16 == 0, at[4], at[5],
                                  dprobs_arg.data_ptr() % 16 == 0),
        x, probs_arg, da_arg, offs, row_amax, col_amax, dprobs_part, out, trans if trans is not None else out,
        row_dequant, col_dequant, dprobs_arg, r, capacity, c, groups, num_splits, geo.cast_tiles, stride_b, stride_r,
        stride_c, stride_da, **geo.cast_meta)
    if geo.straddle_grid is not None:
        _straddle.launch_keyed(geo.straddle_grid, geo.cast_key + aligned + (trans.data_ptr() % 16 == 0,),
                               x, probs_arg, da_arg, offs, col_amax, trans, r, capacity, c, groups, stride_b, stride_r,
                               stride_c, stride_da, **geo.straddle_meta)
    return _first_rows(geo, rows, row_dequant, trans, col_dequant, dprobs, scales)


def _first_rows(geo, rows, row_dequant, trans, col_dequant, dprobs, scales):
    """``_layouts``' results, the per-row ones as views of their first R rows where the buffers
    have a larger capacity (the packed scales stay whole: the capacity's row scales first)."""
    r = geo.r
    if geo.capacity == r:
        return rows, row_dequant, trans, col_dequant, dprobs, scales
    rows, trans = _first_copy_rows(rows, trans, r, geo.capacity)
    return rows, row_dequant[..., :r], trans, col_dequant, None if dprobs is None else dprobs[:r], scales


def fp8_rowwise_layouts(x, group_offs, fp8_dtype, fp8_max: float, margin: int = 0, write_rows: bool = True,
                        write_transposed: bool = True, row_capacity=None):
    """Both rowwise layouts of x [R, C] (or [B, R, C]) in two passes (plus the zeroing launch, and
    with groups the launch for the transposed tiles across them):
    ``(rows [..., R, C] or None, row dequant [..., R], transposed [..., C, R] or None, column dequant
    [..., G, C])``, the same bits as ``fp8_cast.fp8_rowwise_cast`` and ``fp8_colwise_grouped_cast``.
    ``group_offs`` [G+1] (None: all rows one group, G = 1); at most ``MAX_GROUPS`` groups.
    ``row_capacity`` (>= R; a token bucket's, ``docs/design.md`` "Not yet served"): the copies and
    row scales are views of the first R rows of buffers with that many rows (the transposed copy's
    row stride is the capacity), with the R-row call's bits."""
    return _layouts(SOURCE_TENSOR, x, None, None, group_offs, fp8_dtype, fp8_max, margin, write_rows,
                    write_transposed, row_capacity=row_capacity)[:4]


def swiglu_rowwise_layouts(h, probs, group_offs, fp8_dtype, fp8_max: float, margin: int = 0, write_rows: bool = True,
                           write_transposed: bool = True, row_capacity=None):
    """Both rowwise layouts of ``a = silu(h[:, :F]) * h[:, F:] * probs`` without materializing it:
    ``(rows [M, F], row dequant [M], transposed [F, M], column dequant [G, F])`` (``h`` [M, 2F] with
    unit column stride; ``probs`` [M] contiguous float). ``row_capacity``: as
    :func:`fp8_rowwise_layouts`'."""
    return _layouts(SOURCE_SWIGLU, h, probs, None, group_offs, fp8_dtype, fp8_max, margin, write_rows,
                    write_transposed, row_capacity=row_capacity)[:4]


def swiglu_backward_rowwise_layouts(h, probs, da, group_offs, fp8_dtype, fp8_max: float, margin: int, dprobs_dtype,
                                    write_rows: bool = True, write_transposed: bool = True, row_capacity=None):
    """Both rowwise layouts of ``dh`` [M, 2F] (the SwiGLU's input gradient, from its float32 values)
    and ``dprobs`` [M] in ``dprobs_dtype``, without materializing ``dh``: ``(rows [M, 2F] or None,
    transposed [2F, M] or None, packed dequantization scales, dprobs)``, the scales packed as one
    float32 tensor (the M row scales, then the G x 2F column scales) for a rowwise
    ``QuantizedGradHandoff`` (``turbo_moe.quantize.split_packed_scales`` views them apart).
    ``row_capacity``: as :func:`fp8_rowwise_layouts`'; the packed scales then hold the capacity's
    row scales (the first M of them this call's)."""
    rows, _, trans, _, dprobs, packed = _layouts(SOURCE_SWIGLU_GRAD, h, probs, da, group_offs, fp8_dtype, fp8_max,
                                                 margin, write_rows, write_transposed, dprobs_dtype,
                                                 row_capacity=row_capacity)
    return rows, trans, packed, dprobs


# Host-lean launchers (kernels/triton/launch.py).
_zero = lean(zero_f32_kernel)
_stats = lean(rowwise_layouts_stats_kernel)
_cast = lean(rowwise_layouts_cast_kernel)
_straddle = lean(rowwise_layouts_straddle_kernel)
