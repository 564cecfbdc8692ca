"""Delayed (amax-history) scaling inside a cast kernel's own launch: no amax pass before the cast.

With current scaling a tensor is read twice (an amax pass, then the cast that needs its result).
Delayed scaling (Transformer Engine's ``DelayedScaling``, Megatron's ``fp8_recipe="delayed"``)
casts with a scale derived from the amaxes of earlier casts of the same tensor role and records
this cast's amax for the next: one read, one launch. The state of one role
(``turbo_moe.delayed_scaling.AmaxHistory``) is two device buffers:

* ``state [2 + H]`` float32: ``state[0]`` the quantization scale the next cast uses;
  ``state[1]`` the running amax of the cast in flight (0 between casts); ``state[2:]`` the amax
  history, most recent first;
* ``ticket [1]`` int32: how many programs of the cast in flight have recorded their amax (0
  between casts).

Every program of a cast kernel reads ``state[0]`` (:func:`delayed_scales`), casts its tile, then
calls :func:`record_amax` with its tile's max ``|x|``: a relaxed atomic max into ``state[1]``,
then an acq_rel atomic increment of the ticket at GPU scope (so a program's scale read and amax
write are ordered before its ticket). The program that draws the last ticket has seen every
program's amax; it alone rolls the history, stores the next scale, and resets ``state[1]`` and
the ticket for the next cast. Nothing writes ``state[0]`` before every program has read it, max
is exact in any order, and the last program's work depends only on the values: deterministic,
no host sync, and graph-capturable (the buffers live on the device; the launch's arguments never
change between replays).

The next scale follows Transformer Engine's rule: ``fp8_max / amax * 2**-margin`` for ``amax`` the
newest history entry (``most_recent``) or the history's max (``max``), with turbo_moe's cap of
``2**126`` (``_quant_scales``); an ``amax`` that is 0, Inf or NaN keeps the previous scale.
``turbo_moe.delayed_scaling`` holds the torch reference of the same steps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_cast import _MAX_GEOMETRIES, _batched, _cdiv, _first_rows, _quant_scales, clamp_keep_nan
from .launch import arg_fact, lean


@triton.jit
def delayed_scales(state_ptr, dequant_ptr, IS_FIRST):
    """(quantization scale, its reciprocal) of the cast in flight, read from the state; the program
    with ``IS_FIRST`` stores the dequantization scale the GEMM reads."""
    scale = tl.load(state_ptr)
    dequant = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if IS_FIRST:
        tl.store(dequant_ptr, dequant)
    return scale, dequant


@triton.jit
def tile_abs_max(v):
    """max |v| over a 2-D tile (masked-out elements loaded as 0), NaN if any element is NaN, in one
    integer max: |v|'s bits order as its values, and a NaN's (sign cleared) sit above +Inf's."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    return tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)


@triton.jit
def tile_abs_max2(u, v):
    """max(|u|, |v|) over two tiles of one shape, NaN-aware (:func:`tile_abs_max`), one reduction."""
    bits = tl.maximum(tl.abs(u).to(tl.int32, bitcast=True), tl.abs(v).to(tl.int32, bitcast=True))
    return tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)


@triton.jit
def record_amax(state_ptr, ticket_ptr, amax, num_programs, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr,
                HISTORY: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Record this program's ``amax``; the last of ``num_programs`` rolls the history and stores the
    next scale (module docstring)."""
    # The max may be relaxed: the ticket's acq_rel increment orders it (and the scale read) before
    # the ticket, and the last program's acquiring increment sees every earlier release. Relaxed
    # took 8-12% off the casts on the H200 (docs/results/h200_delayed_scaling.md).
    tl.atomic_max(state_ptr + 1, amax, sem="relaxed")
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if done == num_programs - 1:
        # Every program's amax (an atomic read: max with 0 changes nothing), then reset for the next
        # cast; plain stores suffice from here on: every other program is done with the state.
        newest = tl.atomic_max(state_ptr + 1, 0.0)
        tl.store(state_ptr + 1, 0.0)
        idx = tl.arange(0, BLOCK_H)
        older = tl.load(state_ptr + 1 + idx, mask=(idx >= 1) & (idx < HISTORY), other=0.0)  # history[i - 1]
        history = tl.where(idx == 0, newest, older)
        tl.debug_barrier()  # every thread's read of the old history before any write of the new
        tl.store(state_ptr + 2 + idx, history, mask=idx < HISTORY)
        if MOST_RECENT:
            amax_h = newest
        else:
            amax_h = tl.max(history, axis=0)
            amax_h = tl.where(tl.sum((history != history).to(tl.int32), axis=0) > 0, float("nan"), amax_h)
        fresh, _ = _quant_scales(amax_h, FP8_MAX, MARGIN_FACTOR)
        usable = (amax_h > 0) & (amax_h < float("inf"))  # false for NaN as well
        tl.store(state_ptr, tl.where(usable, fresh, tl.load(state_ptr)))
        tl.store(ticket_ptr, 0)


def history_block(history_len: int) -> int:
    """The power-of-two vector the last program rolls the history in (plain Python: Triton's
    ``next_power_of_2`` costs microseconds per call on the host path)."""
    return 1 << (max(history_len, 1) - 1).bit_length()


@triton.jit
def fp8_cast_delayed_kernel(
    x_ptr, state_ptr, ticket_ptr, num_programs, out_ptr, out_t_ptr, dequant_ptr,
    R, C, stride_xb, stride_xr, stride_xc, R_OUT,
    FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, HISTORY: tl.constexpr, MOST_RECENT: tl.constexpr,
    WRITE_ROWS: tl.constexpr, WRITE_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    TILES_C: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``fp8_cast.fp8_cast_kernel`` with the scale from the amax history instead of an amax pass:
    the row-major and/or transposed copy of x [B, R, C], each from its own load (``fp8_cast``'s
    module docstring), over TILES_C adjacent column tiles, and their amax recorded for the next
    cast (one record per program: fewer atomics). The copies have R_OUT >= R rows (a token bucket's
    row capacity; rows past R are not written)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    scale, _ = delayed_scales(state_ptr, dequant_ptr, (pid_r == 0) & (pid_c == 0) & (batch == 0))
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    x_tile = x_ptr + batch * stride_xb
    amax = 0.0
    for t in tl.static_range(TILES_C):
        cols = (pid_c.to(tl.int64) * TILES_C + t) * BLOCK_C + tl.arange(0, BLOCK_C)
        if WRITE_ROWS:
            mask = (rows[:, None] < R) & (cols[None, :] < C)
            x = tl.load(x_tile + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
            x = x.to(tl.float32)
            amax = tl.maximum(amax, tile_abs_max(x), propagate_nan=tl.PropagateNan.ALL)
            q = clamp_keep_nan(x * scale, FP8_MAX).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(out_ptr + batch * R_OUT * C + rows[:, None] * C + cols[None, :], q, mask=mask)
        if WRITE_T:
            mask_t = (cols[:, None] < C) & (rows[None, :] < R)
            x_t = tl.load(x_tile + cols[:, None] * stride_xc + rows[None, :] * stride_xr, mask=mask_t, other=0.0)
            x_t = x_t.to(tl.float32)
            if not WRITE_ROWS:
                amax = tl.maximum(amax, tile_abs_max(x_t), propagate_nan=tl.PropagateNan.ALL)
            q_t = clamp_keep_nan(x_t * scale, FP8_MAX).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(out_t_ptr + batch * R_OUT * C + cols[:, None] * R_OUT + rows[None, :], q_t, mask=mask_t)
    record_amax(state_ptr, ticket_ptr, amax, num_programs, FP8_MAX, MARGIN_FACTOR, HISTORY, MOST_RECENT, BLOCK_H)


# The tile of fp8_cast's tensorwise cast (64 x 64): the same loads, one pass instead of two; each
# program walks two adjacent column tiles, halving the amax records: 0.148 -> 0.130 ms for x
# [98304, 1024] (rows + transposed) on the H200, where one 128 x 128 tile (8 warps) took 0.137 and
# four 64 x 64 tiles 0.134 (docs/results/h200_delayed_scaling.md).
_CAST_BLOCK = 64
_CAST_TILES_C = 2


class _DelayedGeometry:
    """What a delayed cast of one source shape derives before its launch: the output shapes, the
    grid and the constant part of the launch key. Cached per (shape, dtypes, recipe, flags), as
    ``fp8_cast._TensorwiseGeometry``: a fwd+bwd casts the same few shapes every step."""

    __slots__ = ("rows_shape", "trans_shape", "numel", "grid", "num_programs", "r", "c", "stride_b", "key",
                 "constexprs", "capacity")

    def __init__(self, x, fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed,
                 capacity):
        batches, r, c, stride_b = _batched(x)
        self.rows_shape, self.trans_shape = x.shape[:-2] + (capacity, c), x.shape[:-2] + (c, capacity)
        self.numel = batches * r * c
        self.r, self.c, self.stride_b, self.capacity = r, c, stride_b, capacity
        self.grid = (_cdiv(capacity, _CAST_BLOCK), _cdiv(c, _CAST_BLOCK * _CAST_TILES_C), batches)
        self.num_programs = self.grid[0] * self.grid[1] * self.grid[2]
        # Row counts that follow the token count enter as their facts: a new token count is no new key.
        self.key = (x.dtype, fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed,
                    arg_fact(self.num_programs), arg_fact(r), arg_fact(capacity), c, batches, stride_b)
        self.constexprs = dict(
            FP8_MAX=fp8_max, MARGIN_FACTOR=2.0 ** -margin, HISTORY=history_len, MOST_RECENT=most_recent,
            WRITE_ROWS=write_rows, WRITE_T=write_transposed, BLOCK_R=_CAST_BLOCK, BLOCK_C=_CAST_BLOCK,
            TILES_C=_CAST_TILES_C, BLOCK_H=history_block(history_len), num_warps=4)


_DELAYED_GEOMETRY = {}  # bounded by fp8_cast's _MAX_GEOMETRIES, as its own cache


def fp8_tensorwise_cast_delayed(x, state, ticket, history_len: int, most_recent: bool, fp8_dtype, fp8_max: float,
                                margin: int = 0, write_rows: bool = True, write_transposed: bool = False,
                                row_capacity=None):
    """Tensorwise FP8 of ``x`` (``[R, C]`` or ``[B, R, C]``) scaled from the amax history in
    ``state`` / ``ticket`` (module docstring), in one launch that also records x's amax. Returns
    ``(rows, transposed, dequant)`` as ``fp8_cast.fp8_tensorwise_cast`` does (``row_capacity``
    too); an empty ``x`` launches nothing and records nothing."""
    import torch

    x = x if x.stride(-1) == 1 else x.contiguous()
    capacity = x.shape[-2] if row_capacity is None else row_capacity
    if capacity < x.shape[-2]:
        raise ValueError(f"row_capacity ({capacity}) must be at least x's row count ({x.shape[-2]})")
    lookup = (x.shape, x.dtype, fp8_dtype, fp8_max, margin, history_len, most_recent, write_rows, write_transposed,
              capacity)
    geo = _DELAYED_GEOMETRY.get(lookup)
    if geo is None:
        if len(_DELAYED_GEOMETRY) >= _MAX_GEOMETRIES:
            _DELAYED_GEOMETRY.clear()
        geo = _DELAYED_GEOMETRY[lookup] = _DelayedGeometry(x, fp8_dtype, fp8_max, margin, history_len, most_recent,
                                                           write_rows, write_transposed, capacity)
    device = x.device
    rows = torch.empty(geo.rows_shape, dtype=fp8_dtype, device=device) if write_rows else None
    trans = torch.empty(geo.trans_shape, dtype=fp8_dtype, device=device) if write_transposed else None
    out = rows if rows is not None else trans
    if geo.numel == 0 or out is None:
        return _first_rows(rows, trans, geo.r, geo.capacity) + (torch.ones((), dtype=torch.float32, device=device),)
    dequant = torch.empty((), dtype=torch.float32, device=device)
    stride_r = x.stride(-2)
    key = geo.key + (arg_fact(stride_r), x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
                     trans is None or trans.data_ptr() % 16 == 0)
    _cast_delayed.launch_keyed(
        geo.grid, key, x, state, ticket, geo.num_programs, out, trans if trans is not None else out, dequant,
        geo.r, geo.c, geo.stride_b, stride_r, 1, geo.capacity, **geo.constexprs)
    return _first_rows(rows, trans, geo.r, geo.capacity) + (dequant,)


_cast_delayed = lean(fp8_cast_delayed_kernel)
