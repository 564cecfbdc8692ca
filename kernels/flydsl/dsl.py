"""Helpers for writing the FlyDSL kernels of this package: the lazy flydsl import, integers,
``readfirstlane``-pinned scalars, buffer descriptors (the int64 re-base of ``host``) and scalar
loads. Straight-line code traced as plain Python inside the kernels."""

# No "from __future__ import annotations": FlyDSL reads annotations as types.

import functools
import types

from . import host


@functools.lru_cache(maxsize=None)
def _flydsl():
    """Import flydsl lazily: turbo_moe must import with torch alone."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import llvm, rocdl, vector
    from flydsl.expr import arith
    from flydsl.expr.typing import T

    return types.SimpleNamespace(flyc=flyc, fx=fx, ir=ir, llvm=llvm, rocdl=rocdl, vector=vector, arith=arith, T=T)


# ----------------------------------------------------------------------------------------------
# Integer helpers on FlyDSL values.
# ----------------------------------------------------------------------------------------------


def _int_type(value):
    """The FlyDSL integer class of a DSL value (Int32 or Int64), None for a Python int."""
    d = _flydsl()
    if isinstance(value, int):
        return None
    for cls in (d.fx.Int64, d.fx.Int32):
        if isinstance(value, cls):
            return cls
    width = d.ir.IntegerType(_raw(value).type).width
    return d.fx.Int64 if width == 64 else d.fx.Int32


def _select_int(take_a, a, b):
    d = _flydsl()
    cls = _int_type(a) or _int_type(b)
    if cls is None:
        raise TypeError("min/max of two Python ints should not reach the DSL path")
    a, b = cls(a), cls(b)
    return cls(d.arith.select(take_a(a, b), a, b))


def _dsl_min(a, b):
    return _select_int(lambda x, y: x < y, a, b)


def _dsl_max(a, b):
    return _select_int(lambda x, y: x > y, a, b)


@functools.lru_cache(maxsize=None)
def on_dsl(fn):
    """The pure index function ``fn`` with builtin min/max rebound to DSL selects (same code object)."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, "min": _dsl_min, "max": _dsl_max}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _raw(v):
    return _flydsl().fx.as_ir_value(v)


def _i32(v):
    return _flydsl().fx.Int32(v)


def _i64(v):
    return _flydsl().fx.Int64(v)


def _readfirstlane_i32(v):
    d = _flydsl()
    return d.fx.Int32(d.rocdl.readfirstlane(d.T.i32, _raw(d.fx.Int32(v))))


def _readfirstlane_i64(v):
    """Pin a 64-bit value into SGPRs (two readfirstlanes). The compiler cannot always prove that a
    value derived from loads of the group offsets is uniform; without this the descriptor would
    live in VGPRs and every buffer access would be wrapped in a waterfall loop."""
    d = _flydsl()
    v = d.fx.Int64(v)
    lo = _readfirstlane_i32(d.fx.Int32(v))
    hi = _readfirstlane_i32(d.fx.Int32(v >> 32))
    return (d.fx.Int64(hi) << 32) | (d.fx.Int64(lo) & 0xFFFFFFFF)


# CDNA buffer descriptor word 3: DATA_FORMAT=7 (32-bit), NUM_FORMAT=4; raw (stride 0) addressing,
# range-checked against num_records.
_SRD_FLAGS_CDNA = (7 << 12) | (4 << 15)


def _make_srd(addr_i64, nrec):
    """Buffer descriptor at byte address ``addr_i64`` covering ``nrec`` bytes (both pinned scalar)."""
    d = _flydsl()
    base = _readfirstlane_i64(addr_i64)
    nrec32 = _readfirstlane_i32(d.fx.Int32(nrec))
    ptr = d.llvm.inttoptr(d.ir.Type.parse("!llvm.ptr<1>"), _raw(base))
    return d.rocdl.make_buffer_rsrc(
        d.ir.Type.parse("!llvm.ptr<8>"), ptr, _raw(d.fx.Int16(0)), _raw(d.fx.Int64(nrec32) & 0xFFFFFFFF),
        _raw(d.fx.Int32(_SRD_FLAGS_CDNA)),
    )


def _rebased_srd(tensor_addr, extent, base_bytes):
    """Descriptor re-based to ``tensor_addr + base_bytes`` (64-bit), num_records per host.rebased_nrec."""
    nrec = on_dsl(host.rebased_nrec)(extent, base_bytes)
    return _make_srd(tensor_addr + base_bytes, nrec)


def _scalar_load_i32(srd, byte_offset):
    d = _flydsl()
    return d.fx.Int32(d.rocdl.ptr_s_buffer_load(d.T.i32, srd, _raw(_readfirstlane_i32(byte_offset))))


def _load_group_offset(offs_srd, index):
    """``group_offs[index]`` (int64 on the device). Offsets are < 2^31 (the plan checks M), so the
    low dword is the value; a scalar load keeps it in an SGPR."""
    return _scalar_load_i32(offs_srd, index * 8)


def _opaque_zero():
    """A 0 the compiler cannot see through (so nothing derived from it is hoisted above here)."""
    d = _flydsl()
    return d.fx.Int32(d.llvm.inline_asm(d.T.i32, [], "s_mov_b32 $0, 0", "=s", has_side_effects=True))
