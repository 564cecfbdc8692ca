"""Host model of the MXFP8 variants (``KernelConfig.mx``; M-grouped fwd/dgrad, K-grouped wgrad): where
each lane finds the e8m0 scale byte it hands to ``v_mfma_scale_f32_16x16x128_f8f6f4``.

Scaled-MFMA semantics relied on (gfx950 / CDNA4, 16x16x128, 8-bit formats): each lane's 32 bytes
of an operand are row ``lane % 16`` and K group ``lane // 16`` (32 elements) of the 16x128 operand
(``host.fragment_row`` / ``host.fragment_k_group``, the layout ``_read_fragment`` reads), and the
lane's scale VGPR holds the e8m0 exponent of exactly those 32 elements: 16 rows x 4 K groups = 64
scales, one per lane. OP_SEL (0..3) picks the byte of the 32-bit scale VGPR; the kernel packs
fragment i's byte at byte :func:`scale_opsel` (i) and uses that op_sel with fragment i. The
first (op_sel, scale) pair goes with the first source operand. Sources: Modular's CDNA4
block-scaled MFMA documentation (docs.modular.com, ``linalg/arch/amd/block_scaled_mma`` and
``mxfp4_matmul_amd``: "lane_row = lane % 16, lane_k_group = lane / 16", byte index selected by
OP_SEL) and LLVM's AMDGPU backend (``llvm.amdgcn.mfma.scale.f32.16x16x128.f8f6f4``; PR 158117
restricts the scale operands to VGPRs because the hardware reads bits [30:23] of an inline or
SGPR constant). Not verified on hardware.

Scale storage (what ``turbo_moe.fine_grained.quantize.quantize_rows`` returns for mxfp8): block
major, so a K group's scales for a run of rows are contiguous::

    a_scale [M, KB]    (strides (1, M)):          byte of (row m, group s)      = s * M + m
    b_scale [G, N, KB] (strides (KB * N, 1, N)):  byte of (g, column c, group s) = (g * KB + s) * N + c

with KB = cdiv(K, 32). The kernel re-bases a descriptor per tile at the tile's first row (a) or
column (b) of its group (64-bit), whose range ends where the operand's scales end (a:
:func:`a_scale_end`, b: expert g's, :func:`b_scale_end`), and loads at lane offset
``scale_lane_offset + scale_block_offset`` (+ ``scale_fragment_offset``, the immediate), soffset 0:
every access is range-checked in full (see :func:`scale_lane_offset` for what is not masked). Pure functions (``+ - * // %``, ``<``, ``&``), called by the kernel on FlyDSL integers.
"""

from __future__ import annotations

from typing import Sequence

from . import host

MX_BLOCK = 32  # elements per e8m0 scale (the MX block): one K group of a fragment lane
GROUPS_PER_BLOCK = host.BLOCK_K // MX_BLOCK  # 4 scale groups per 128-deep K block


def scale_groups(k_len):
    """KB: scale groups along the contraction (cdiv(K, 32))."""
    return (k_len + MX_BLOCK - 1) // MX_BLOCK


def scale_group(k0, lane):
    """The K group (index into KB) of ``lane``'s fragment bytes in the block starting at ``k0``."""
    return k0 // MX_BLOCK + host.fragment_k_group(lane)


def scale_block_offset(rows_total, k0):
    """The K block's part of a scale's byte offset (from the tile's first row, K group 0)."""
    return (k0 // MX_BLOCK) * rows_total


def scale_lane_offset(rows_total, wave_row0, lane):
    """``lane``'s part of the byte offset of its scale for fragment 0 of the wave whose 64 rows
    start at ``wave_row0`` (fragment i's is :func:`scale_fragment_offset` further, the block's
    :func:`scale_block_offset`). ``rows_total``: M (a) or N (b), the stride between K groups.

    Nothing is masked per lane: the descriptor ends where the operand's scales end (a: the
    tensor, b: expert g's scales, :func:`b_scale_end`), so a K group past KB (the tail block's
    lanes past K, whose FP8 bytes are zero) reads 0 instead of the next expert's scales (which
    may be 255 = NaN, and NaN x 0 is NaN). Rows past the tile's valid rows read their own row's
    scale (the next expert's rows, or 0 past the end): output row r / column c depends only on
    the scales of a's row r / b's row c, so those reach only outputs the epilogue never stores."""
    return host.fragment_k_group(lane) * rows_total + host.fragment_row(wave_row0, 0, lane)


def scale_fragment_offset(i):
    """Offset of fragment ``i``'s scale from fragment 0's (the instruction's immediate offset)."""
    return host.fragment_row(0, i, 0)


def scale_opsel(i):
    """Byte of the lane's packed scale VGPR that holds fragment ``i``'s scale, and so the op_sel
    of the MFMAs that use fragment ``i`` (the loader packs the 4 fragments' bytes in one VGPR)."""
    return i


def a_scale_tile_base(row0):
    """Byte offset in a_scale of the tile's (first row, group 0)."""
    return row0


def b_scale_tile_base(group, n, k_len, col0):
    """Byte offset in b_scale of expert ``group``'s (column ``col0``, group 0)."""
    return (group * scale_groups(k_len)) * n + col0


def a_scale_end(m, k_len):
    """End (bytes) of a_scale: the extent of its descriptors."""
    return scale_groups(k_len) * m


def b_scale_end(group, n, k_len):
    """End (bytes) of expert ``group``'s scales in b_scale: the extent of its tiles' descriptors."""
    return ((group + 1) * scale_groups(k_len)) * n


# K-grouped (wgrad) operands: a = dy^T [N, M], b = x^T [K, M], contracted over each group's tokens
# in 32-token blocks restarting at the group's first token. Their scales are what
# ``turbo_moe.fine_grained.quantize.quantize_tokens`` stores: slot-major, slot s of row r at byte
# ``s * rows_total + r`` (rows_total: N for a, K for b), group g's j-th block in slot
# ``offs[g] // 32 + g + j`` (``fine_grained.quantize.token_slots``). A tile reads them like the
# M-grouped variant reads K groups (scale_lane_offset / scale_block_offset with the K block's
# offset counted from the group's first token), from a descriptor re-based at the group's first
# slot and ending at its last: K groups past the group's tokens read 0 (their FP8 bytes are zero
# too), never a neighbouring group's scale.


def token_first_slot(lo, group):
    """Slot of the first 32-token block of the group whose tokens start at ``lo``."""
    return lo // MX_BLOCK + group


def token_scale_tile_base(first_slot, rows_total, row0):
    """Byte offset of the tile's (first row ``row0``, the group's first block) scale."""
    return first_slot * rows_total + row0


def token_scale_end(first_slot, tokens, rows_total):
    """End (bytes) of the group's scales: one past its last slot (``cdiv(tokens, 32)`` slots)."""
    return (first_slot + scale_groups(tokens)) * rows_total


def check_scale_layout(name: str, shape: Sequence[int], strides: Sequence[int]) -> None:
    """Reject a stored-scale tensor that is not block-major contiguous (the layout above)."""
    rows, groups = shape[-2], shape[-1]
    want = ((groups * rows,) if len(shape) == 3 else ()) + (1, rows)
    if tuple(strides) != want and rows * groups > 0:
        raise ValueError(f"{name}: the FlyDSL MXFP8 kernel reads block-major scales (strides {want}, as "
                         f"quantize_rows returns them), got strides {tuple(strides)} for shape {tuple(shape)}")
    if groups * rows + host.BLOCK_M >= host.NREC_CAP:
        raise ValueError(f"{name}: {groups * rows} scale bytes per expert exceed the {host.NREC_CAP}-byte range of a "
                         "re-based buffer descriptor")
