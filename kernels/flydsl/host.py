"""Host side of the FlyDSL grouped FP8 GEMMs: tiling constants, argument packing, grids, and the
int64 re-base arithmetic the kernels use.

Nothing here imports flydsl or torch, so every function runs (and is tested) on any machine.

Addressing scheme (the reason this module exists)
-------------------------------------------------
A gfx9 buffer resource descriptor (SRD) holds a 48-bit base address and a 32-bit ``num_records``
(byte range); the per-lane ``voffset`` is 32 bits. One SRD spanning a whole operand therefore
cannot reach past 4 GB, and an ``int32`` element offset breaks at 2^31 elements. The kernels
instead *re-base*: for every tile (and every K block) they compute the 64-bit byte address of the
tile's first element in scalar registers (``s_add_u32``/``s_addc_u32``), build a fresh SRD there,
and keep the per-lane offsets small (``< BLOCK rows * row stride``). ``num_records`` of a re-based
SRD is the number of bytes left in the tensor after that base, clamped to :data:`NREC_CAP`, so
the hardware range check still zero-fills loads and drops stores past the tensor's end.

Masked lanes use the offset :data:`OOB_OFFSET`. The cap matters: Primus-Turbo PR 384 clamped
``num_records`` to ``0xFFFFFFFF``, so the masked offset ``0x7FFFFFFF`` was *in* range and a masked
store landed 2 GB past the tile. Here ``NREC_CAP < OOB_OFFSET`` always, so a masked lane is out
of range whatever the tensor size; in exchange every valid in-tile offset must stay below
``NREC_CAP`` (:func:`check_in_tile_span` rejects shapes where it would not).

The small pure functions (``+ - * // %``, ``^`` and builtin ``min``/``max`` only) are called by the
kernels on FlyDSL integers too (``min``/``max`` rebound, as for ``kernels/tile_scheduler.py``), so
the Python model tested here and the device arithmetic are one source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .. import tile_scheduler as sched

__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "GROUP_M",
    "NUM_THREADS",
    "CHUNK_BYTES",
    "NREC_CAP",
    "OOB_OFFSET",
    "SUPPORTED_ARCHS",
    "FP8_FORMATS",
    "OUT_DTYPES",
    "rebased_nrec",
    "chunk_valid_bytes",
    "dword_valid_bytes",
    "dword_byte_mask",
    "lds_swizzled_offset",
    "loader_row",
    "loader_chunk",
    "check_in_tile_span",
    "extent_bytes",
    "MGroupedLaunch",
    "KGroupedLaunch",
    "plan_m_grouped",
    "plan_k_grouped",
    "m_grouped_tile_bases",
    "k_grouped_tile_bases",
    "masked_offset",
]

# Output tile of one workgroup and the contraction step. Four waves in a 2x2 layout each own a
# 64x64 sub-tile = 4x4 MFMA 16x16x128 tiles.
BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 128
GROUP_M = 8
NUM_THREADS = 256
WAVE_SIZE = 64
# Each lane moves 16 bytes per load (buffer_load_dwordx4); a 128-byte K row is 8 chunks.
CHUNK_BYTES = 16
CHUNKS_PER_ROW = BLOCK_K // CHUNK_BYTES
ROWS_PER_PASS = NUM_THREADS // CHUNKS_PER_ROW  # 32 rows per load pass of the whole workgroup
LOAD_PASSES = BLOCK_M // ROWS_PER_PASS  # 4 passes per 128-row operand tile
LDS_TILE_BYTES = BLOCK_M * BLOCK_K  # 16 KiB per operand tile (fp8 = 1 byte)
LDS_BYTES = 2 * 2 * LDS_TILE_BYTES  # A and B, ping-pong: 64 KiB

# num_records of a re-based descriptor never exceeds NREC_CAP, and masked lanes use OOB_OFFSET,
# which is >= NREC_CAP + 16: a masked access of any width is out of range (see module docstring).
NREC_CAP = 0x7FFFFFF0
OOB_OFFSET = 0x7FFFFFFF

# gfx950 (CDNA4, MI350/MI355X) has the FP8 MFMA v_mfma_*_f8f6f4 with K=128 per instruction.
# gfx942 (CDNA3, MI300) has only the K=32 fp8 MFMAs with different operand layouts, so this kernel
# does not target it: the backend and the compile helper refuse it by name.
SUPPORTED_ARCHS = ("gfx950",)
# Operand formats -> the MFMA's cbsz/blgp matrix-format field.
FP8_FORMATS = {"e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}
OUT_DTYPES = ("bf16", "f16", "f32")
OUT_BYTES = {"bf16": 2, "f16": 2, "f32": 4}


# ----------------------------------------------------------------------------------------------
# Pure functions shared with the kernels (arithmetic, ^ and min/max only).
# ----------------------------------------------------------------------------------------------


def rebased_nrec(extent, base):
    """num_records of an SRD re-based to byte ``base`` of a tensor whose bytes are ``[0, extent)``:
    what is left after ``base``, clamped to ``[0, NREC_CAP]``."""
    return max(min(extent - base, NREC_CAP), 0)


def chunk_valid_bytes(k_len, k0, chunk):
    """Bytes of the 16-byte chunk ``chunk`` of the K block starting at ``k0`` that lie inside the
    contraction length ``k_len`` (0..16)."""
    return max(min(k_len - k0 - chunk * CHUNK_BYTES, CHUNK_BYTES), 0)


def exact_chunk_split(valid_bytes):
    """(whole dwords, bytes of the partial dword) of a chunk with ``valid_bytes`` valid bytes: the
    exact (tail) loader takes the whole dwords from its 16-byte load and the partial dword's bytes
    from single-byte loads, so no valid byte sits in a dword that straddles ``num_records``."""
    return valid_bytes // 4, valid_bytes % 4


def fragment_row(wave_row0, i, lane):
    """Tile row of MFMA operand fragment ``i`` (16 rows x 128 K bytes of a wave's 64 rows) that
    ``lane`` holds: lane l holds row ``l % 16`` of the fragment ..."""
    return wave_row0 + i * 16 + lane % 16


def fragment_k_group(lane):
    """... and K bytes ``[32 q, 32 q + 32)`` of the block, q = ``lane // 16`` (0..3): the 32-wide
    K group whose e8m0 scale the lane supplies to the scaled MFMA (``mx_host``)."""
    return lane // 16


def acc_row(wave_row0, i, lane):
    """Tile row of the accumulators of MFMA tile (i, j) held by ``lane``. The kernels compute
    C^T = B A^T (B's fragment in the MFMA's A slot), so a lane holds 4 consecutive *columns* of
    one row: ``acc_col(.., e)`` for e = 0..3. That makes each (i, j) one 8- or 16-byte store."""
    return wave_row0 + i * 16 + lane % 16


def acc_col(wave_col0, j, lane, e):
    """Tile column of accumulator element ``e`` (0..3) of MFMA tile (i, j) held by ``lane``."""
    return wave_col0 + j * 16 + (lane // 16) * 4 + e


def lt_mask(a, b):
    """-1 (all bits) if a < b else 0, for |a - b| < 2^31: lane arithmetic instead of a compare, so
    the exact loader's 11 per-pass decisions cost VALU ops, not SGPR-pair lane masks (which
    spilled SGPRs in the tail loop)."""
    return (a - b) >> 31


def exact_dword(raw_word, tail_word, dword, whole):
    """Dword ``dword`` of an exactly loaded chunk: the 16-byte load's word for the ``whole``
    complete dwords, the byte-assembled ``tail_word`` for the partial one, 0 past it."""
    below = lt_mask(dword, whole)
    at = lt_mask(dword, whole + 1) & ~below
    return (raw_word & below) | (tail_word & at)


def exact_byte_offset(lane_offset, whole, partial, byte, oob):
    """Offset of byte ``byte`` (0..2) of the partial dword, or ``oob`` where it is not a valid
    byte (the single-byte load then reads 0)."""
    keep = lt_mask(byte, partial)
    return ((lane_offset + whole * 4 + byte) & keep) | (oob & ~keep)


def k_grouped_rows_stored(rows, tokens):
    """Rows of a K-grouped tile the accumulating epilogue stores: none for an empty group, so its
    out[g] stays exactly as it was (``x + 0.0`` would turn a -0.0 into +0.0), else ``rows``."""
    return rows * min(tokens, 1)


def dword_valid_bytes(chunk_bytes, dword):
    """Valid bytes (0..4) of dword ``dword`` (0..3) of a chunk with ``chunk_bytes`` valid bytes."""
    return max(min(chunk_bytes - dword * 4, 4), 0)


def lds_swizzled_offset(row, chunk):
    """Byte offset in a 128x128-byte LDS tile of the 16-byte ``chunk`` of ``row``.

    The chunk index is XOR-ed with ``row % 8``: the 16 lanes of an MFMA operand read (16 rows, one
    chunk column) then hit 8 different 16-byte bank groups instead of one.
    """
    return row * BLOCK_K + (chunk ^ (row % 8)) * CHUNK_BYTES


def dma_source_chunk(row, slot):
    """K chunk that the LDS-DMA loader puts in 16-byte slot ``slot`` of ``row``: LDS-DMA writes
    lane l at slot l % 8 unswizzled, so the swizzle moves to the global side (XOR is its own
    inverse, so reading chunk c at ``lds_swizzled_offset(row, c)`` finds it)."""
    return slot ^ (row % 8)


def loader_row(thread, load_pass):
    """Tile row that ``thread`` loads in pass ``load_pass`` (rows 0..127 over 4 passes)."""
    return load_pass * ROWS_PER_PASS + thread // CHUNKS_PER_ROW


def loader_chunk(thread):
    """16-byte chunk (0..7) of its row that ``thread`` loads."""
    return thread % CHUNKS_PER_ROW


# ----------------------------------------------------------------------------------------------
# Python-only helpers (value-dependent branches).
# ----------------------------------------------------------------------------------------------


def dword_byte_mask(valid_bytes: int) -> int:
    """AND-mask keeping the low ``valid_bytes`` bytes of a little-endian dword."""
    return 0xFFFFFFFF if valid_bytes >= 4 else (1 << (8 * valid_bytes)) - 1


def masked_offset(offset: int, valid: bool) -> int:
    return offset if valid else OOB_OFFSET


def extent_bytes(shape: Sequence[int], strides: Sequence[int], elem_bytes: int) -> int:
    """Bytes from a tensor's first element to one past its last (its span in memory)."""
    if any(s == 0 for s in shape):
        return 0
    return (sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * elem_bytes


def check_in_tile_span(name: str, row_stride_bytes: int, rows: int, span_bytes: int) -> None:
    """Reject an operand whose in-tile offsets could reach NREC_CAP (the 32-bit voffset budget)."""
    worst = (rows - 1) * row_stride_bytes + span_bytes
    if worst >= NREC_CAP:
        raise ValueError(
            f"{name}: a {rows}-row tile spans {worst} bytes (row stride {row_stride_bytes} bytes), "
            f"over the {NREC_CAP}-byte in-tile range of a re-based buffer descriptor"
        )


# The kernels' parameters, in order: device addresses, scale sizes, then the plan's integers (the
# kernel signatures use these exact names; tests/test_flydsl_compile.py checks it).
ADDRESS_ARGS = ("a_addr", "b_addr", "c_addr", "sa_addr", "sb_addr", "offs_addr", "sa_numel", "sb_numel")
M_GROUPED_SCALAR_ARGS = (
    "m", "n", "k", "num_groups", "lda", "ldb", "stride_bg", "ldc",
    "a_extent", "b_extent", "c_extent", "num_n_blocks", "tile_bound", "grid",
)
K_GROUPED_SCALAR_ARGS = (
    "n", "k", "m", "num_groups", "lda", "ldb", "ldc", "stride_cg",
    "a_extent", "b_extent", "c_extent", "num_m_blocks", "num_n_blocks", "total_tiles", "grid",
)


@dataclass(frozen=True)
class MGroupedLaunch:
    """Everything the M-grouped kernel is launched with, besides the device addresses."""

    m: int
    n: int
    k: int
    num_groups: int
    lda: int  # bytes between rows of a [M, K]
    ldb: int  # bytes between rows of b[g] [N, K]
    stride_bg: int  # bytes between b[g] and b[g+1]
    ldc: int  # bytes between rows of out [M, N]
    a_extent: int
    b_extent: int
    c_extent: int
    out_bytes: int
    num_n_blocks: int
    tile_bound: int
    grid: int

    def scalar_args(self) -> Tuple[int, ...]:
        """The integer kernel arguments, in the kernel's order (after the addresses)."""
        return tuple(getattr(self, name) for name in M_GROUPED_SCALAR_ARGS)


@dataclass(frozen=True)
class KGroupedLaunch:
    n: int  # rows of out[g] (= rows of a)
    k: int  # columns of out[g] (= rows of b)
    m: int  # tokens
    num_groups: int
    lda: int  # bytes between rows of a [N, M]
    ldb: int  # bytes between rows of b [K, M]
    ldc: int  # bytes between rows of out[g] [N, K]
    stride_cg: int  # bytes between out[g] and out[g+1]
    a_extent: int
    b_extent: int
    c_extent: int
    out_bytes: int
    num_m_blocks: int
    num_n_blocks: int
    total_tiles: int
    grid: int

    def scalar_args(self) -> Tuple[int, ...]:
        """The integer kernel arguments, in the kernel's order (after the addresses)."""
        return tuple(getattr(self, name) for name in K_GROUPED_SCALAR_ARGS)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def plan_m_grouped(
    a_shape: Sequence[int], a_strides: Sequence[int],
    b_shape: Sequence[int], b_strides: Sequence[int],
    out_dtype: str, num_cu: int,
) -> MGroupedLaunch:
    """Launch plan of ``out[M, N] = a[M, K] @ b[G, N, K]^T`` (fp8 operands, strides in elements).

    The contraction dimension must be contiguous (the loader reads 16-byte runs along K).
    """
    if out_dtype not in OUT_BYTES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    _positive("num_cu", num_cu)
    m, k = a_shape
    g, n, kb = b_shape
    if kb != k:
        raise ValueError(f"b: contraction size {kb} != a's {k}")
    if a_strides[1] != 1 or b_strides[2] != 1:
        raise ValueError("a and b must be contiguous along the contraction dimension K")
    out_bytes = OUT_BYTES[out_dtype]
    lda, ldb, stride_bg = a_strides[0], b_strides[1], b_strides[0]
    ldc = n * out_bytes  # the backend allocates out contiguous
    # The main loops reach K block k0 of a tile as lane offset + k0 (the instruction's scalar
    # offset): the span of a tile row is the whole contraction length.
    check_in_tile_span("a", lda, BLOCK_M, max(k, BLOCK_K))
    check_in_tile_span("b", ldb, BLOCK_N, max(k, BLOCK_K))
    check_in_tile_span("out", ldc, BLOCK_M, BLOCK_N * out_bytes)
    num_n_blocks = sched.cdiv(n, BLOCK_N)
    bound = sched.m_grouped_tile_upper_bound(m, g, BLOCK_M, num_n_blocks)
    return MGroupedLaunch(
        m=m, n=n, k=k, num_groups=g, lda=lda, ldb=ldb, stride_bg=stride_bg, ldc=ldc,
        a_extent=extent_bytes(a_shape, a_strides, 1),
        b_extent=extent_bytes(b_shape, b_strides, 1),
        c_extent=m * n * out_bytes,
        out_bytes=out_bytes,
        num_n_blocks=num_n_blocks,
        tile_bound=bound,
        grid=sched.persistent_grid_size(bound, num_cu),
    )


def plan_k_grouped(
    a_shape: Sequence[int], a_strides: Sequence[int],
    b_shape: Sequence[int], b_strides: Sequence[int],
    num_groups: int, out_dtype: str, num_cu: int,
) -> KGroupedLaunch:
    """Launch plan of ``out[g] = a[:, tokens of g] @ b[:, tokens of g]^T`` (a [N, M], b [K, M])."""
    if out_dtype not in OUT_BYTES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    _positive("num_cu", num_cu)
    _positive("num_groups", num_groups)
    n, m = a_shape
    k, mb = b_shape
    if mb != m:
        raise ValueError(f"b: token count {mb} != a's {m}")
    if a_strides[1] != 1 or b_strides[1] != 1:
        raise ValueError("a and b must be contiguous along the token (contraction) dimension")
    out_bytes = OUT_BYTES[out_dtype]
    lda, ldb = a_strides[0], b_strides[0]
    ldc = k * out_bytes
    check_in_tile_span("a", lda, BLOCK_M, max(m, BLOCK_K))  # a group's tokens are at most m
    check_in_tile_span("b", ldb, BLOCK_N, max(m, BLOCK_K))
    check_in_tile_span("out", ldc, BLOCK_M, BLOCK_N * out_bytes)
    num_m_blocks, num_n_blocks = sched.cdiv(n, BLOCK_M), sched.cdiv(k, BLOCK_N)
    total = sched.k_grouped_total_tiles(num_groups, num_m_blocks, num_n_blocks)
    return KGroupedLaunch(
        n=n, k=k, m=m, num_groups=num_groups, lda=lda, ldb=ldb, ldc=ldc, stride_cg=n * ldc,
        a_extent=extent_bytes(a_shape, a_strides, 1),
        b_extent=extent_bytes(b_shape, b_strides, 1),
        c_extent=num_groups * n * k * out_bytes,
        out_bytes=out_bytes,
        num_m_blocks=num_m_blocks, num_n_blocks=num_n_blocks,
        total_tiles=total,
        grid=sched.persistent_grid_size(total, num_cu),
    )


# ----------------------------------------------------------------------------------------------
# Python model of the per-tile re-base the kernels do (what the host tests check).
# ----------------------------------------------------------------------------------------------


def m_grouped_lds_dma_ok(k: int, a_addr: int, lda: int, b_addr: int, ldb: int, stride_bg: int) -> bool:
    """Whether the M-grouped kernel may fill LDS with buffer_load ... lds: every 16-byte chunk it
    moves must lie wholly inside or wholly outside K (it masks whole chunks, no bytes), and
    start 16-byte aligned."""
    return k % CHUNK_BYTES == 0 and all(x % CHUNK_BYTES == 0 for x in (a_addr, lda, b_addr, ldb, stride_bg))


def m_grouped_tile_bases(plan: MGroupedLaunch, offs: Sequence[int], tile: Tuple[int, int, int], k0: int
                         ) -> Dict[str, Tuple[int, int, int]]:
    """For an M-grouped tile (group, m_block, n_block) and K block start ``k0``: per operand,
    (re-based byte base, num_records, valid rows/cols), exactly as the kernel computes them."""
    g, mb, nb = tile
    lo, hi = offs[g], offs[g + 1]
    row0 = lo + mb * BLOCK_M
    col0 = nb * BLOCK_N
    a_base = row0 * plan.lda + k0
    b_base = g * plan.stride_bg + col0 * plan.ldb + k0
    c_base = row0 * plan.ldc + col0 * plan.out_bytes
    return {
        "a": (a_base, rebased_nrec(plan.a_extent, a_base), min(hi - row0, BLOCK_M)),
        "b": (b_base, rebased_nrec(plan.b_extent, b_base), min(plan.n - col0, BLOCK_N)),
        "c": (c_base, rebased_nrec(plan.c_extent, c_base), min(plan.n - col0, BLOCK_N)),
    }


def k_grouped_tile_bases(plan: KGroupedLaunch, offs: Sequence[int], tile: Tuple[int, int, int], k0: int
                         ) -> Dict[str, Tuple[int, int, int]]:
    """K-grouped counterpart of :func:`m_grouped_tile_bases` (``k0`` counts tokens of the group)."""
    g, mb, nb = tile
    lo = offs[g]
    row0 = mb * BLOCK_M
    col0 = nb * BLOCK_N
    a_base = row0 * plan.lda + lo + k0
    b_base = col0 * plan.ldb + lo + k0
    c_base = g * plan.stride_cg + row0 * plan.ldc + col0 * plan.out_bytes
    return {
        "a": (a_base, rebased_nrec(plan.a_extent, a_base), min(plan.n - row0, BLOCK_M)),
        "b": (b_base, rebased_nrec(plan.b_extent, b_base), min(plan.k - col0, BLOCK_N)),
        "c": (c_base, rebased_nrec(plan.c_extent, c_base), min(plan.k - col0, BLOCK_N)),
    }


def all_tiles(programs: List[List[Tuple[int, int, int]]]) -> List[Tuple[int, int, int]]:
    return [t for tiles in programs for t in tiles]


def m_grouped_kernel_tiles(plan: MGroupedLaunch, offs: Sequence[int], pid: int) -> List[Tuple[int, int, int]]:
    """The tiles program ``pid`` of the M-grouped kernel computes, in order: a line-by-line Python
    copy of the kernel's loop, which is written as ``for tile in range(pid, tile_bound, grid)``
    around the scheduler's forward-only group cursor (a bounded loop is what FlyDSL lowers to
    scf.for; tiles past the last group fall through the ``group < G`` test). The tests check it
    against ``tile_scheduler.schedule_m_grouped``, the model every backend shares."""
    g_count = plan.num_groups
    group, group_first_tile = 0, 0
    lo, hi = offs[0], offs[1]
    group_tiles = sched.m_grouped_group_tiles(hi - lo, BLOCK_M, plan.num_n_blocks)
    tiles = []
    for tile in range(pid, plan.tile_bound, plan.grid):
        while tile >= group_first_tile + group_tiles and group < g_count:
            group_first_tile += group_tiles
            group += 1
            lo = hi
            hi = offs[min(group + 1, g_count)]
            group_tiles = sched.m_grouped_group_tiles(hi - lo, BLOCK_M, plan.num_n_blocks)
        if group < g_count:
            m_block, n_block = sched.swizzle_group_m(
                tile - group_first_tile, sched.cdiv(hi - lo, BLOCK_M), plan.num_n_blocks, GROUP_M
            )
            tiles.append((group, m_block, n_block))
    return tiles


def k_grouped_kernel_tiles(plan: KGroupedLaunch, pid: int, band_cyclic: bool = True) -> List[Tuple[int, int, int]]:
    """The tiles program ``pid`` of the K-grouped kernel computes (its loop, in Python)."""
    order = sched.k_grouped_band_cyclic if band_cyclic else sched.k_grouped_group_major
    return [
        order(tile, plan.num_groups, plan.num_m_blocks, plan.num_n_blocks, GROUP_M)
        for tile in range(pid, plan.total_tiles, plan.grid)
    ]
