"""Group offsets from routing, checked and clamped on the device in one launch.

``turbo_moe.checks.resolve_group_offs`` turns ``group_lens [G]`` (or ``group_offs [G+1]``) into
the int64 ``[G+1]`` offsets every kernel reads. On a GPU the host must not read the routing (a
sync per call, and no CUDA-graph capture), so this one program does it all: the prefix sum,
the validity checks as device asserts (non-negative sizes, non-decreasing offsets starting at 0,
sizes summing to M; a failure surfaces at the next synchronization, like ``torch._assert_async``),
and the clamp into ``[0, M]`` with a running maximum, so that even invalid routing can never make
a kernel touch memory outside its operands. It replaces ~8 small torch launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import lean

# One program holds all offsets in one block: enough for any MoE layer's experts per rank.
MAX_GROUPS = 8191
# The device asserts are compiled in unless this is False (a test that must watch the clamp alone
# keep kernels in bounds under bad routing turns them off; users never should).
DEVICE_ASSERTS = True


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(debug=True)  # debug: the device asserts below are compiled in
def resolve_group_offs_kernel(src_ptr, offs_ptr, G, M, FROM_LENS: tl.constexpr, BLOCK: tl.constexpr):
    """offs[0..G] from lens[0..G-1] (FROM_LENS) or from offs_in[0..G]; int32 or int64 sources."""
    i = tl.arange(0, BLOCK)
    if FROM_LENS:
        lens = tl.load(src_ptr + i, mask=i < G, other=0).to(tl.int64)
        tl.device_assert(lens >= 0, "turbo_moe: group_lens has a negative entry")
        tl.device_assert(tl.sum(lens, axis=0) == M, "turbo_moe: group_lens does not sum to x.shape[0]")
        ends = tl.cumsum(tl.maximum(lens, 0), axis=0)  # non-negative sizes: non-decreasing ends
        tl.store(offs_ptr + 1 + i, tl.minimum(ends, M), mask=i < G)
        tl.store(offs_ptr + i, tl.zeros_like(ends), mask=i == 0)
    else:
        offs = tl.load(src_ptr + i, mask=i <= G, other=0).to(tl.int64)
        prev = tl.load(src_ptr + i - 1, mask=(i >= 1) & (i <= G), other=0).to(tl.int64)
        tl.device_assert((i == 0) | (i > G) | (offs >= prev), "turbo_moe: group_offs is decreasing")
        tl.device_assert((i != 0) | (offs == 0), "turbo_moe: group_offs[0] != 0")
        tl.device_assert((i != G) | (offs == M), "turbo_moe: group_offs[-1] != x.shape[0]")
        clamped = tl.minimum(tl.maximum(offs, 0), M)
        tl.store(offs_ptr + i, tl.associative_scan(clamped, 0, _max_combine), mask=i <= G)


def resolve_group_offs(src, num_rows: int, from_lens: bool):
    """int64 ``[G+1]`` device offsets from ``group_lens [G]`` or ``group_offs [G+1]`` (one launch)."""
    import torch

    num_groups = src.shape[0] - (0 if from_lens else 1)
    offs = torch.empty(num_groups + 1, dtype=torch.int64, device=src.device)
    block = 1 << num_groups.bit_length()  # next power of two >= num_groups + 1
    _resolve_launcher[(1,)](src, offs, num_groups, num_rows, FROM_LENS=from_lens, BLOCK=block,
                            num_warps=4 if block <= 1024 else 8, debug=DEVICE_ASSERTS)
    return offs


_resolve_launcher = lean(resolve_group_offs_kernel)
