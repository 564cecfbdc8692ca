"""The one tile scheduler of every turbo_moe kernel backend (Triton, FlyDSL, and the Python model).

Rules for the index functions below (the "pure" part of this module)
--------------------------------------------------------------------
Each index function is a small function of integers written with ``+ - * // %`` and the builtins
``min`` / ``max`` only: no calls to other functions of this module, no value-dependent Python
``if``, no ``abs``/``divmod``/``math``. That is what lets one source serve three worlds:

* plain Python calls them on ``int`` (the model :func:`schedule_m_grouped` /
  :func:`schedule_k_grouped` and the property tests);
* Triton kernels call ``triton.jit`` wrappers of the *same* function objects (see
  ``turbo_moe.kernels.triton.scheduler``). Triton's code generator maps the builtins ``min``/``max``
  to ``tl.minimum``/``tl.maximum`` on scalars (verified on triton 3.6 and 3.9, compiled and under
  ``TRITON_INTERPRET=1``, by ``tests/test_tile_scheduler.py``);
* the FlyDSL backend rebinds ``min``/``max`` to its DSL's integer ops with
  ``types.FunctionType(fn.__code__, {**fn.__globals__, "min": ..., "max": ...})``.

All values are non-negative, so ``//`` and ``%`` mean the same under floor (Python) and truncating
(C, Triton on signed ints) division. Functions may return tuples. Nothing here imports triton.

The two problems (see ``turbo_moe/backends/base.py``)
-----------------------------------------------------
M_GROUPED (fwd NT, dgrad NN): group g owns ``rows_g`` rows of the output, so it has
``cdiv(rows_g, BLOCK_M) * num_n_blocks`` tiles; the tile counts are device data. The persistent
kernel runs ``P`` programs; program ``pid`` takes the global tile ids ``pid, pid + P, ...`` in
group-major order and finds each tile's group with a forward-only cursor over ``group_offs``::

    group, group_first_tile, lo, hi = 0, 0, offs[0], offs[1]
    group_tiles = m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
    tile = pid
    while group < G:
        while tile >= group_first_tile + group_tiles and group < G:   # cursor only moves forward
            group_first_tile += group_tiles; group += 1
            lo = hi; hi = offs[min(group + 1, G)]
            group_tiles = m_grouped_group_tiles(hi - lo, BLOCK_M, num_n_blocks)
        if group < G:
            m_block, n_block = swizzle_group_m(tile - group_first_tile, cdiv(hi - lo, BLOCK_M), ...)
            ... compute rows lo + m_block*BLOCK_M ..., columns n_block*BLOCK_N ...
        tile += P

so a program reads each offset once: O(G + its tiles), not O(G) per tile. The program stops when
the cursor runs past the last group, so the host never needs the tile count; it sizes the grid
with :func:`m_grouped_tile_upper_bound` (``sum_g cdiv(M_g, BM) <= cdiv(M, BM) + G``) and
:func:`persistent_grid_size` (``min(num_cu, bound)``), which needs no device-to-host copy.
Every tile of the M-grouped problems costs the same (the contraction K is fixed), so the
round-robin deal gives every program the same number of tiles, +-1, under any routing skew.

K_GROUPED (wgrad): every group has the same output grid ``num_m_blocks x num_n_blocks`` (the grid
of ``out[g]``), so a tile id maps to (group, m_block, n_block) by arithmetic alone. But a tile of
group g costs ``tokens_g`` (its contraction length), so under skewed routing the heavy group's
tiles cost far more. Two orders:

* :func:`k_grouped_band_cyclic`: band b (GROUP_M rows of output blocks) of group 0, the same band
  of group 1, ..., of group G-1, then band b+1 -- every group stays in flight at every moment, so
  the heavy group's expensive tiles are spread over all programs and over the whole run
  (Primus-Turbo's finding for wgrad under skew, ROCm/Primus-Turbo PR 384);
* :func:`k_grouped_group_major`: all of group 0, then group 1, ...

Which one wins depends on how tiles reach the hardware. With a *static* round-robin deal over
persistent programs (the Triton kernels) both orders give every program the same work (see
:func:`schedule_k_grouped` and the balance tests), and on the H100 group-major measured faster in
every case, skewed too, because concurrent programs then share one group's token chunks in L2
(docs/triton_notes.md); the Triton backend defaults to group-major. Band-cyclic pays off where
tiles are dispatched dynamically in order (a non-persistent grid), as in Primus-Turbo.

Inside a band (or a group) tiles go column by column over the band's GROUP_M rows, so
consecutive tiles share one ``b`` column block (L2 reuse), the usual GROUP_M swizzle.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = [
    "cdiv",
    "m_grouped_group_tiles",
    "m_grouped_tile_upper_bound",
    "persistent_grid_size",
    "swizzle_group_m",
    "k_grouped_total_tiles",
    "k_grouped_band_cyclic",
    "k_grouped_group_major",
    "INDEX_FUNCTIONS",
    "schedule_m_grouped",
    "schedule_k_grouped",
]


# ----------------------------------------------------------------------------------------------
# Pure index functions: arithmetic and min/max only (see the module docstring).
# ----------------------------------------------------------------------------------------------


def cdiv(numerator, denominator):
    """Ceiling division of non-negative integers."""
    return (numerator + denominator - 1) // denominator


def m_grouped_group_tiles(rows, block_m, num_n_blocks):
    """Tiles of one M-grouped group with ``rows`` rows: ``cdiv(rows, block_m) * num_n_blocks``
    (0 for an empty group)."""
    return (rows + block_m - 1) // block_m * num_n_blocks


def m_grouped_tile_upper_bound(total_rows, num_groups, block_m, num_n_blocks):
    """A host-side bound on the M-grouped tile count that needs no group sizes:
    ``sum_g cdiv(M_g, BM) <= sum_g (M_g + BM - 1) // BM <= cdiv(M, BM) + G``."""
    return ((total_rows + block_m - 1) // block_m + num_groups) * num_n_blocks


def persistent_grid_size(tile_upper_bound, num_cu):
    """Programs of a persistent launch: one per SM/CU (``num_cu``), never more than there can be
    tiles, and at least one (a program with no tile exits at once)."""
    return max(min(num_cu, tile_upper_bound), 1)


def swizzle_group_m(local_tile, num_m_blocks, num_n_blocks, group_m):
    """The ``local_tile``-th tile of one ``num_m_blocks x num_n_blocks`` grid -> (m_block, n_block).

    Bands of ``group_m`` block rows; inside a band, column by column (the band's rows vary
    fastest), so a window of consecutive tiles reuses a few ``b`` column blocks and a few ``a``
    row blocks from L2. The last band may have fewer rows. Needs ``local_tile <
    num_m_blocks * num_n_blocks``.
    """
    band_width = group_m * num_n_blocks
    band = local_tile // band_width
    first_m = band * group_m
    band_rows = min(num_m_blocks - first_m, group_m)
    in_band = local_tile % band_width
    return first_m + in_band % band_rows, in_band // band_rows


def k_grouped_total_tiles(num_groups, num_m_blocks, num_n_blocks):
    """Tiles of the K-grouped problem: every group has the same output grid."""
    return num_groups * num_m_blocks * num_n_blocks


def k_grouped_band_cyclic(tile, num_groups, num_m_blocks, num_n_blocks, group_m):
    """K-grouped tile id -> (group, m_block, n_block), band-cyclic order.

    Band b holds block rows ``[b*group_m, min((b+1)*group_m, num_m_blocks))`` of *every* group:
    first those of group 0, then of group 1, ... Full bands hold ``G*group_m*num_n_blocks``
    tiles; the last band may be shorter (``band_rows < group_m`` rows per group), and since it
    starts where a full band would, ``tile // full_band_tiles`` is its index too.
    """
    full_band_tiles = num_groups * group_m * num_n_blocks
    band = tile // full_band_tiles
    first_m = band * group_m
    band_rows = min(num_m_blocks - first_m, group_m)
    in_band = tile - band * full_band_tiles
    group_band_tiles = band_rows * num_n_blocks
    group = in_band // group_band_tiles
    in_group = in_band % group_band_tiles
    return group, first_m + in_group % band_rows, in_group // band_rows


def k_grouped_group_major(tile, num_groups, num_m_blocks, num_n_blocks, group_m):
    """K-grouped tile id -> (group, m_block, n_block), group-major order (all of group 0 first),
    GROUP_M-swizzled inside a group. ``num_groups`` is unused; the signature matches
    :func:`k_grouped_band_cyclic` so the two are interchangeable."""
    group_tiles = num_m_blocks * num_n_blocks
    group = tile // group_tiles
    local_tile = tile % group_tiles
    band_width = group_m * num_n_blocks
    first_m = local_tile // band_width * group_m
    band_rows = min(num_m_blocks - first_m, group_m)
    in_band = local_tile % band_width
    return group, first_m + in_band % band_rows, in_band // band_rows


# Every function above, for backends that wrap them all (triton.jit, FlyDSL's min/max rebinding).
INDEX_FUNCTIONS = (
    cdiv,
    m_grouped_group_tiles,
    m_grouped_tile_upper_bound,
    persistent_grid_size,
    swizzle_group_m,
    k_grouped_total_tiles,
    k_grouped_band_cyclic,
    k_grouped_group_major,
)


# ----------------------------------------------------------------------------------------------
# Pure-Python models of the kernels' persistent loops, built from the functions above.
# ----------------------------------------------------------------------------------------------

Tile = Tuple[int, int, int]  # (group, m_block, n_block)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def schedule_m_grouped(
    group_lens: Sequence[int], n: int, block_m: int, block_n: int, group_m: int, num_cu: int
) -> List[List[Tile]]:
    """The tiles each program of the persistent M-grouped kernel computes, in order.

    Mirrors the kernel loop in the module docstring exactly (same cursor, same functions), with
    the group offsets taken from ``group_lens``.
    """
    _check_positive(n=n, block_m=block_m, block_n=block_n, group_m=group_m, num_cu=num_cu)
    if any((not isinstance(x, int)) or x < 0 for x in group_lens):
        raise ValueError(f"group_lens must be non-negative ints, got {list(group_lens)!r}")
    num_groups = len(group_lens)
    offs = [0]
    for rows in group_lens:
        offs.append(offs[-1] + rows)
    num_n_blocks = cdiv(n, block_n)
    bound = m_grouped_tile_upper_bound(offs[-1], num_groups, block_m, num_n_blocks)
    num_programs = persistent_grid_size(bound, num_cu)
    programs: List[List[Tile]] = []
    for pid in range(num_programs):
        tiles: List[Tile] = []
        group, group_first_tile = 0, 0
        lo, hi = offs[0], offs[min(1, num_groups)]
        group_tiles = m_grouped_group_tiles(hi - lo, block_m, num_n_blocks)
        tile = pid
        while group < num_groups:
            while tile >= group_first_tile + group_tiles and group < num_groups:
                group_first_tile += group_tiles
                group += 1
                lo, hi = hi, offs[min(group + 1, num_groups)]
                group_tiles = m_grouped_group_tiles(hi - lo, block_m, num_n_blocks)
            if group < num_groups:
                m_block, n_block = swizzle_group_m(
                    tile - group_first_tile, cdiv(hi - lo, block_m), num_n_blocks, group_m
                )
                tiles.append((group, m_block, n_block))
            tile += num_programs
        programs.append(tiles)
    return programs


def schedule_k_grouped(
    num_groups: int,
    n: int,
    k: int,
    block_m: int,
    block_n: int,
    group_m: int,
    num_cu: int,
    band_cyclic: bool = True,
) -> List[List[Tile]]:
    """The tiles each program of the persistent K-grouped (wgrad) kernel computes, in order.

    ``out[g]`` is ``[n, k]``; its grid is ``cdiv(n, block_m) x cdiv(k, block_n)`` blocks.
    """
    _check_positive(
        num_groups=num_groups, n=n, k=k, block_m=block_m, block_n=block_n, group_m=group_m, num_cu=num_cu
    )
    num_m_blocks, num_n_blocks = cdiv(n, block_m), cdiv(k, block_n)
    total = k_grouped_total_tiles(num_groups, num_m_blocks, num_n_blocks)
    num_programs = persistent_grid_size(total, num_cu)
    order = k_grouped_band_cyclic if band_cyclic else k_grouped_group_major
    return [
        [order(tile, num_groups, num_m_blocks, num_n_blocks, group_m) for tile in range(pid, total, num_programs)]
        for pid in range(num_programs)
    ]
