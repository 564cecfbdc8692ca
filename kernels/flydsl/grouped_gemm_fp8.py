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
import types

from .. import tile_scheduler as sched
from . import host

__all__ = ["KernelConfig", "build_m_grouped", "build_k_grouped", "KERNEL_NAMES"]

# The names the kernels get in the compiled code object (and in FLYDSL_DUMP_DIR/<name>_0/).
KERNEL_NAMES = {"m_grouped": "turbo_moe_m_grouped_fp8", "k_grouped": "turbo_moe_k_grouped_fp8"}


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


class KernelConfig(tuple):
    """(a_format, b_format, out_dtype, a_rowwise, b_rowwise, accumulate, vec_store): what a compiled variant
    depends on. ``accumulate`` (K-grouped, f32 out): the epilogue adds the fp32 result to out's
    existing values instead of overwriting them."""

    def __new__(cls, a_format="e4m3", b_format="e4m3", out_dtype="bf16", a_rowwise=False, b_rowwise=False,
                accumulate=False, vec_store=False):
        for name, value in (("a_format", a_format), ("b_format", b_format)):
            if value not in host.FP8_FORMATS:
                raise ValueError(f"{name} must be one of {sorted(host.FP8_FORMATS)}, got {value!r}")
        if out_dtype not in host.OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {host.OUT_DTYPES}, got {out_dtype!r}")
        if accumulate and out_dtype != "f32":
            raise ValueError(f"accumulate needs out_dtype 'f32' (an fp32 out), got {out_dtype!r}")
        return super().__new__(cls, (a_format, b_format, out_dtype, bool(a_rowwise), bool(b_rowwise),
                                     bool(accumulate), bool(vec_store)))

    a_format = property(lambda self: self[0])
    b_format = property(lambda self: self[1])
    out_dtype = property(lambda self: self[2])
    a_rowwise = property(lambda self: self[3])
    b_rowwise = property(lambda self: self[4])
    accumulate = property(lambda self: self[5])
    # vec_store: the output's column count is a multiple of 4, so each lane's 4 consecutive
    # columns of a row are stored (and, accumulating, loaded) as one 8- or 16-byte access.
    vec_store = property(lambda self: self[6])

    @property
    def tag(self) -> str:
        scales = "".join("r" if r else "t" for r in (self.a_rowwise, self.b_rowwise))
        return (f"{self.a_format}x{self.b_format}_{self.out_dtype}_{scales}{'_acc' if self.accumulate else ''}"
                f"{'_v4' if self.vec_store else ''}")


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


# ----------------------------------------------------------------------------------------------
# Main-loop pieces (straight-line code, traced as plain Python).
# ----------------------------------------------------------------------------------------------


class _OperandLoader:
    """Global -> registers -> LDS for one 128-row x 128-byte operand block of one tile.

    ``tensor_addr``/``extent``: the operand's device address and byte span; ``tile_base``: byte
    offset of the tile's (row 0, k 0); ``ld``: bytes between rows; ``rows_valid``: rows of the tile
    inside the problem; ``k_len``: the contraction length.

    Two loads: :meth:`load_full` for a block wholly inside ``k_len`` (the main loop: rows past the
    problem are sent out of range, no byte is masked), :meth:`load_exact` for any block (the
    prologue and the tail: bytes past ``k_len`` are zeroed exactly, see there).
    """

    def __init__(self, tensor_addr, extent, tile_base, ld, rows_valid, k_len):
        self.tensor_addr, self.extent, self.tile_base = tensor_addr, extent, tile_base
        self.k_len = k_len
        self.ld, self.rows_valid = ld, rows_valid
        # One descriptor per tile for the whole blocks: block k0 is reached with the
        # instruction's scalar offset (soffset = k0) instead of a re-based descriptor per block
        # (~15 scalar instructions per operand and block in the loop). Valid lanes stay in range
        # whether or not the hardware counts soffset in the range check (host plans check
        # lane offset + contraction length < NREC_CAP); masked lanes are out of range either way.
        self.tile_srd = _rebased_srd(tensor_addr, extent, tile_base)
        # The main loop's lane offsets, rows past the problem already sent out of range: computed
        # once per tile (4 VGPRs per operand) instead of keeping 4 row-compare masks per operand
        # live in SGPRs across the loop.
        d = _flydsl()
        rows, chunk = self._lane()
        self.full_voffs = [
            d.arith.select(rows[p] < rows_valid, rows[p] * ld + chunk * host.CHUNK_BYTES, d.fx.Int32(host.OOB_OFFSET))
            for p in range(host.LOAD_PASSES)
        ]

    def _lane(self):
        """This thread's rows (one per pass) and chunk. Recomputed at each use: a few VALU ops are
        cheaper than keeping 12 more VGPRs live across the main loop."""
        fx = _flydsl().fx
        tid = fx.Int32(fx.thread_idx.x)
        return [host.loader_row(tid, p) for p in range(host.LOAD_PASSES)], host.loader_chunk(tid)

    def load_full(self, k0):
        """Registers holding block ``k0`` (all 128 bytes inside ``k_len``) of this thread's 4
        chunks; rows outside the problem read as zeros (out-of-range offset)."""
        d = _flydsl()
        soffset = _raw(_readfirstlane_i32(k0))
        # Lane offsets relative to the tile's base stay small (< 128 * ld).
        return [d.rocdl.raw_ptr_buffer_load(d.T.i32x4, self.tile_srd, _raw(voff), soffset) for voff in self.full_voffs]

    def load_exact(self, k0):
        """As :meth:`load_full` for any block: bytes past ``k_len`` are zero, and no valid byte
        depends on how the hardware range-checks a dword that straddles ``num_records``.

        A chunk with ``v`` valid bytes takes its ``v // 4`` whole dwords from the 16-byte load and
        its last ``v % 4`` bytes from single-byte loads (``host.exact_chunk_split``): a dword
        holding the operand's last byte may straddle the end of the tensor (contraction length
        % 4 != 0 at the tensor's last row), and a per-dword range check would drop it whole."""
        d = _flydsl()
        fx = d.fx
        # The tile's descriptor and soffset = k0, as load_full: every valid byte is inside the
        # tensor and every masked one out of range, whatever the range check does with soffset.
        srd, soffset = self.tile_srd, _raw(_readfirstlane_i32(k0))
        rows, chunk = self._lane()
        chunk_bytes = on_dsl(host.chunk_valid_bytes)(self.k_len, k0, chunk)
        out = []
        for p in range(host.LOAD_PASSES):
            valid = d.arith.select(rows[p] < self.rows_valid, chunk_bytes, fx.Int32(0))
            lane_off = rows[p] * self.ld + chunk * host.CHUNK_BYTES
            voff = d.arith.select(valid > 0, lane_off, fx.Int32(host.OOB_OFFSET))
            raw = d.rocdl.raw_ptr_buffer_load(d.T.i32x4, srd, _raw(voff), soffset)
            whole, partial = host.exact_chunk_split(valid)
            tail = fx.Int32(0)
            for b in range(3):
                boff = host.exact_byte_offset(lane_off, whole, partial, b, fx.Int32(host.OOB_OFFSET))
                byte = d.rocdl.raw_ptr_buffer_load(d.T.i8, srd, _raw(boff), soffset)
                tail = tail | (fx.Int32(d.arith.extui(d.T.i32, byte)) << (8 * b))
            words = []
            for w in range(4):
                word = host.exact_dword(fx.Int32(d.vector.extract(raw, [], [w])), tail, w, whole)
                words.append(_raw(fx.Int32(word)))
            out.append(d.vector.from_elements(d.T.i32x4, words))
        return out

    def store(self, lds_tile_addr, regs):
        d = _flydsl()
        rows, chunk = self._lane()
        for p in range(host.LOAD_PASSES):
            addr = lds_tile_addr + host.lds_swizzled_offset(rows[p], chunk)
            ptr = d.llvm.inttoptr(d.ir.Type.parse("!llvm.ptr<3>"), _raw(addr))
            d.llvm.StoreOp(regs[p], ptr, alignment=16)


# Module-level calls, not methods: FlyDSL's loop rewriter carries any local whose method is called
# in a dynamic loop body as loop state, and a loader object is not an IR value.
def _register_prologue(a_ld, b_ld, lds_base):
    """Block 0 loaded exactly (either block may be the tail), written to LDS buffer 0 and fenced;
    block 1 loaded exactly into registers and returned (the main loop keeps two blocks in flight:
    one in registers, one in LDS)."""
    a_ld.store(lds_base, a_ld.load_exact(0))
    b_ld.store(lds_base + host.LDS_TILE_BYTES, b_ld.load_exact(0))
    # Block 1's loads after block 0's stores: two blocks of exact loads (byte loads, selects) live
    # at once would cost registers for nothing (this runs once per tile).
    _flydsl().fx.rocdl.sched_barrier(0)
    a_next, b_next = a_ld.load_exact(host.BLOCK_K), b_ld.load_exact(host.BLOCK_K)
    _fence_lds()
    return a_next, b_next


def _register_step(config, a_ld, b_ld, cur, nxt, k_ahead, a_next, b_next, acc, wave_row0, wave_col0, full):
    """One K block of the register-staged main loop, shared by both kernels. On entry LDS buffer
    ``cur`` holds block kb and ``a_next``/``b_next`` hold block kb+1 (loaded one step ago):

    1. ``full`` (block kb+2 lies wholly inside K): issue its 8 unmasked 16-byte loads;
    2. read the fragments of block kb from ``cur`` and run its 16 MFMAs;
    3. not ``full`` (the last steps of a tile): load block kb+2 exactly (byte-masked tail), after
       the MFMAs so that its temporaries never meet the fragments;
    4. write block kb+1 into ``nxt``. Its loads were issued a whole step ago and the 8 loads of
       kb+2 stay in flight: the compiler's waits before these ds_writes are graded
       (vmcnt(15) .. vmcnt(8)), never a drain;
    5. fence: every wave's reads of kb and writes of kb+1 done before anyone goes on.
    Returns (acc, block kb+2's registers)."""
    if full:
        a_new, b_new = a_ld.load_full(k_ahead), b_ld.load_full(k_ahead)
    acc = _mfma_block(config, cur, wave_row0, cur + host.LDS_TILE_BYTES, wave_col0, acc)
    if not full:
        a_new, b_new = a_ld.load_exact(k_ahead), b_ld.load_exact(k_ahead)
    a_ld.store(nxt, a_next)
    b_ld.store(nxt + host.LDS_TILE_BYTES, b_next)
    _fence_lds()
    return acc, a_new, b_new


def _register_pair(config, a_ld, b_ld, lds_base, kb, a_next, b_next, acc, wave_row0, wave_col0):
    """Steps kb (even: reads buffer 0) and kb+1 (reads buffer 1) of the main loop with whole
    blocks. Unrolled by two so that the registers of block kb+3, loaded while block kb+2's are
    still live, land where block kb+1's were (freed by step kb's ds_writes): the loop carries
    them in place, with no copy and no wait at the back edge."""
    buf0, buf1 = lds_base, lds_base + 2 * host.LDS_TILE_BYTES
    acc, a_mid, b_mid = _register_step(config, a_ld, b_ld, buf0, buf1, (kb + 2) * host.BLOCK_K,
                                       a_next, b_next, acc, wave_row0, wave_col0, True)
    return _register_step(config, a_ld, b_ld, buf1, buf0, (kb + 3) * host.BLOCK_K,
                          a_mid, b_mid, acc, wave_row0, wave_col0, True)


def _register_last_step(config, a_ld, b_ld, lds_base, kb, a_next, b_next, acc, wave_row0, wave_col0):
    """Step kb of the last steps of a tile (block kb+2 may be the tail or past K: exact loads)."""
    two_tiles = 2 * host.LDS_TILE_BYTES
    return _register_step(config, a_ld, b_ld, lds_base + (kb % 2) * two_tiles, lds_base + ((kb + 1) % 2) * two_tiles,
                          (kb + 2) * host.BLOCK_K, a_next, b_next, acc, wave_row0, wave_col0, False)


_LDS_SCOPE_DOMAIN = '#llvm.alias_scope_domain<id = "turbo_moe.flydsl.lds">'


def _lds_scope_attrs(buffer):
    """(alias_scopes, noalias_scopes) of LDS ping-pong buffer 0 or 1. Tagging the LDS-DMA writes
    and the ds_reads with the buffer they touch lets the waitcnt pass see that reading buffer k%2
    need not wait for the DMA into the other one (else it inserts vmcnt(0) before every read and
    the prefetch no longer overlaps the MFMAs)."""
    d = _flydsl()
    scopes = [
        d.ir.Attribute.parse(f'#llvm.alias_scope<id = "turbo_moe.flydsl.lds.buf{i}", domain = {_LDS_SCOPE_DOMAIN}>')
        for i in range(2)
    ]
    return d.ir.ArrayAttr.get([scopes[buffer]]), d.ir.ArrayAttr.get([scopes[1 - buffer]])


def _read_fragment(lds_tile_addr, wave_row0, i, buffer=None):
    """MFMA operand ``i`` (16 rows x 128 K bytes) of a wave's 64 rows, from an LDS tile.

    Lane l holds row ``l % 16`` and K bytes ``[32q, 32q + 32)``, q = l // 16 (two ds_read_b128 of
    the swizzled chunks 2q, 2q+1). A and B use the same K order, which is all the dot product needs.
    """
    d = _flydsl()
    fx = d.fx
    lane = fx.Int32(fx.thread_idx.x) % host.WAVE_SIZE
    q = lane // 16
    row = wave_row0 + i * 16 + lane % 16
    halves = []
    for h in range(2):
        addr = lds_tile_addr + host.lds_swizzled_offset(row, q * 2 + h)
        ptr = d.llvm.inttoptr(d.ir.Type.parse("!llvm.ptr<3>"), _raw(addr))
        load = d.llvm.LoadOp(d.T.i32x4, ptr, alignment=16)
        if buffer is not None:
            load.attributes["alias_scopes"], load.attributes["noalias_scopes"] = _lds_scope_attrs(buffer)
        halves.append(load.result)
    return d.vector.shuffle(halves[0], halves[1], list(range(8)))


# Wait states between an MFMA and a later instruction that overwrites its A/B source VGPRs.
# v_mfma_f32_16x16x128_f8f6f4 is an 8-pass op on gfx950 (32 cycles: 2 * 16 * 16 * 128 FLOP at the
# 2048 FP8 FLOP/cycle of a SIMD). LLVM pads no wait states for a VALU/LDS write of an MFMA's A/B
# sources (it did not in the issue-14 ISA), while Primus-Turbo reports a gfx950 race in exactly
# that pattern. In the related cases (an XDL op's result or SrcC overwritten or read) the CDNA3
# dependency tables ask for a few more independent instructions than the op has passes; 16 for an
# 8-pass op is a conservative choice, not a number verified on hardware.
MFMA_HAZARD_WAIT_STATES = 16


def _mfma_drain():
    """``s_nop`` padding of :data:`MFMA_HAZARD_WAIT_STATES` after an MFMA cluster, pinned in place
    with scheduling barriers (nothing may move across it)."""
    d = _flydsl()
    d.fx.rocdl.sched_barrier(0)
    d.rocdl.s_setprio(0)
    for _ in range(MFMA_HAZARD_WAIT_STATES // 8):
        d.rocdl.s_nop(7)  # s_nop N = N + 1 wait states
    d.fx.rocdl.sched_barrier(0)


def _mfma_block(config, lds_a, wave_row0, lds_b, wave_col0, acc, buffer=None):
    """acc += A_block x B_block^T for the wave's 64x64 sub-tile.

    MFMA-source safety by construction (issue 14: ``v_mfma ... v[244:251]`` was followed at once
    by ``ds_read_b128 v[244:247]``): all 8 fragments (A and B, 8 VGPRs each) are read before the
    first MFMA and stay live to the last, so no ds_read of this block can target a register an
    MFMA of the block still reads, and :func:`_mfma_drain` pads before the next block's reads."""
    d = _flydsl()
    fmt_a = d.ir.Attribute.parse(f"#rocdl<matrix_format {host.FP8_FORMATS[config.a_format]}>")
    fmt_b = d.ir.Attribute.parse(f"#rocdl<matrix_format {host.FP8_FORMATS[config.b_format]}>")
    # Scale operands 0 with opsel 0 select the unscaled v_mfma_f32_16x16x128_f8f6f4; the per-tensor
    # or per-row dequantization scales are applied once in the epilogue instead.
    zero = _raw(d.fx.Int32(0))
    b_frags = [_read_fragment(lds_b, wave_col0, j, buffer) for j in range(4)]
    a_frags = [_read_fragment(lds_a, wave_row0, i, buffer) for i in range(4)]
    # Nothing crosses: the reads stay ahead of every MFMA (else the scheduler sinks A's reads
    # between the MFMAs and re-uses a fragment's registers right after its last MFMA).
    d.fx.rocdl.sched_barrier(0)
    # Raised priority while this wave issues its MFMA cluster (the other wave on the SIMD is then
    # in its load / LDS phase); back to 0 in the drain.
    d.rocdl.s_setprio(1)
    out = list(acc)
    for i in range(4):
        for j in range(4):
            # B's fragment in the A slot: the result is (A_i B_j^T)^T, so each lane holds 4
            # consecutive columns of one output row (host.acc_row / acc_col; vector stores).
            op = d.rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                d.T.f32x4, b_frags[j], a_frags[i], _raw(acc[i * 4 + j]), fmt_b, fmt_a, 0, zero, 0, zero
            )
            out[i * 4 + j] = getattr(op, "result", op)
    _mfma_drain()
    return out


def _zero_acc():
    d = _flydsl()
    vec = d.vector.broadcast(d.T.f32x4, _raw(d.fx.Float32(0.0)))
    return [vec for _ in range(16)]


def _fence_lds():
    """Every wave's LDS writes done and visible, and every wave past its reads, before going on."""
    d = _flydsl()
    d.fx.rocdl.s_waitcnt(lgkmcnt=0)
    d.rocdl.s_barrier()


def _fence_lds_dma():
    """As :func:`_fence_lds` when LDS is filled by buffer_load ... lds: those writes are counted by
    vmcnt, not lgkmcnt, so the wait must include vmcnt(0) (Primus-Turbo PR 384's corruption was
    this wait missing before the ping-pong buffer was read)."""
    d = _flydsl()
    d.fx.rocdl.s_waitcnt(vmcnt=0, lgkmcnt=0)
    d.rocdl.s_barrier()


class _DmaLoader:
    """Global -> LDS directly (``buffer_load_dwordx4 ... lds``) for one operand block, no registers.

    Lane l of wave w in pass p writes LDS bytes ``[p*4096 + w*1024 + 16*l, +16)`` of the tile, i.e.
    row ``host.loader_row``, slot ``host.loader_chunk``, unswizzled; the swizzle is applied on the
    global side instead: slot s of row r holds K chunk ``s ^ (r % 8)``, which is exactly where
    ``host.lds_swizzled_offset`` (and so :func:`_read_fragment`) looks for it.
    Needs whole 16-byte chunks: K % 16 == 0 and 16-byte aligned rows (the backend checks).
    """

    def __init__(self, tensor_addr, extent, tile_base, ld, rows_valid, k_len):
        self.tensor_addr, self.extent, self.tile_base = tensor_addr, extent, tile_base
        self.ld, self.rows_valid, self.k_len = ld, rows_valid, k_len
        # One descriptor per tile, K block k0 through soffset (see _OperandLoader.__init__).
        self.tile_srd = _rebased_srd(tensor_addr, extent, tile_base)

    def issue(self, lds_tile_addr, k0, buffer):
        d = _flydsl()
        alias, noalias = _lds_scope_attrs(buffer)
        fx = d.fx
        srd = self.tile_srd
        soffset = _raw(_readfirstlane_i32(k0))
        tid = fx.Int32(fx.thread_idx.x)
        wave = _readfirstlane_i32(tid // host.WAVE_SIZE)
        slot = host.loader_chunk(tid)
        for p in range(host.LOAD_PASSES):
            row = host.loader_row(tid, p)
            chunk = host.dma_source_chunk(row, slot)
            valid = (row < self.rows_valid) & (on_dsl(host.chunk_valid_bytes)(self.k_len, k0, chunk) > 0)
            voff = d.arith.select(valid, row * self.ld + chunk * host.CHUNK_BYTES, fx.Int32(host.OOB_OFFSET))
            # The LDS destination is wave-uniform (it goes to M0); each lane lands 16 bytes further.
            lds_addr = _readfirstlane_i32(lds_tile_addr + p * (host.NUM_THREADS * host.CHUNK_BYTES) + wave * 1024)
            lds_ptr = d.llvm.inttoptr(d.ir.Type.parse("!llvm.ptr<3>"), _raw(lds_addr))
            d.rocdl.raw_ptr_buffer_load_lds(
                srd, lds_ptr, _raw(fx.Int32(host.CHUNK_BYTES)), _raw(voff), soffset, _raw(fx.Int32(0)),
                aux=d.ir.IntegerAttr.get(d.T.i32, 0), alias_scopes=alias, noalias_scopes=noalias,
            )


def _dma_issue(loader, lds_tile_addr, k0, buffer):
    loader.issue(lds_tile_addr, k0, buffer)


def _store_tile(config, acc, c_addr, c_extent, c_base, ldc, rows_valid, cols_valid, row_scale, col_scale):
    """Scale, convert and store the 128x128 tile. ``row_scale(r)`` / ``col_scale(c)`` give the
    dequantization factor of tile row r / column c (tensorwise: the same scalar).

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
    wave = tid // host.WAVE_SIZE
    lane = tid % host.WAVE_SIZE
    wave_row0 = (wave // 2) * 64
    wave_col0 = (wave % 2) * 64
    out_ty = {"bf16": d.T.bf16, "f16": d.T.f16, "f32": d.T.f32}[config.out_dtype]
    oob = fx.Int32(host.OOB_OFFSET)
    zero = _raw(fx.Int32(0))
    col_scales = [[col_scale(host.acc_col(wave_col0, j, lane, e)) for e in range(4)] for j in range(4)]
    for i in range(4):
        row = host.acc_row(wave_row0, i, lane)
        rs = row_scale(row)
        for j in range(4):
            col = host.acc_col(wave_col0, j, lane, 0)
            values = [fx.Float32(d.vector.extract(acc[i * 4 + j], [], [e])) * rs * col_scales[j][e] for e in range(4)]
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


def _opaque_zero():
    """A 0 the compiler cannot see through (so nothing derived from it is hoisted above here)."""
    d = _flydsl()
    return d.fx.Int32(d.llvm.inline_asm(d.T.i32, [], "s_mov_b32 $0, 0", "=s", has_side_effects=True))


def _scale_readers(config, sa_addr, sa_numel, sa_row0, sb_addr, sb_numel, sb_col0):
    """(row_scale, col_scale) closures. Tensorwise scales are one scalar load each; rowwise ones are
    read per lane at ``sa_row0 + r`` / ``sb_col0 + c`` (float32 index into the scale tensor)."""
    d = _flydsl()
    fx = d.fx

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


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------


def _lds_storage():
    fx = _flydsl().fx

    @fx.struct
    class SharedStorage:
        tiles: fx.Array[fx.Int8, host.LDS_BYTES, 16]

    return SharedStorage


@functools.lru_cache(maxsize=None)
def build_m_grouped(config: KernelConfig, lds_dma: bool = False):
    """The launcher of the M-grouped kernel for ``config``: ``launch(*addresses, *plan.scalar_args(),
    stream)``; see ``turbo_moe/backends/flydsl_backend.py`` for the call.

    ``lds_dma``: fill LDS with ``buffer_load ... lds`` (no staging registers, no byte masks) instead
    of global -> VGPR -> ``ds_write``; only for K % 16 == 0 with 16-byte aligned rows
    (``host.m_grouped_lds_dma_ok``)."""
    d = _flydsl()
    flyc, fx = d.flyc, d.fx
    const_expr = d.fx.const_expr
    if config.accumulate:
        raise ValueError("accumulate is a K-grouped (wgrad) epilogue only")
    SharedStorage = _lds_storage()
    group_tiles_fn = on_dsl(sched.m_grouped_group_tiles)
    swizzle_fn = on_dsl(sched.swizzle_group_m)
    cdiv_fn = on_dsl(sched.cdiv)
    BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K
    TILE_BYTES = host.LDS_TILE_BYTES

    @flyc.kernel
    def turbo_moe_m_grouped_fp8(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        m: fx.Int32, n: fx.Int32, k: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, stride_bg: fx.Int64, ldc: fx.Int32,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_n_blocks: fx.Int32, tile_bound: fx.Int32, grid: fx.Int32,
    ):
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = _readfirstlane_i32(fx.Int32(fx.ptrtoint(lds.tiles.ptr)))
        tid = fx.Int32(fx.thread_idx.x)
        wave = tid // host.WAVE_SIZE
        wave_row0 = (wave // 2) * 64
        wave_col0 = (wave % 2) * 64
        offs_srd = _make_srd(offs_addr, (num_groups + 1) * 8)
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
                    a_ld = _OperandLoader(a_addr, a_extent, a_base, lda, rows_valid, k)
                    b_ld = _OperandLoader(b_addr, b_extent, b_base, ldb, n - col0, k)
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
            value_attrs={"rocdl.waves_per_eu": 2, "rocdl.flat_work_group_size": "256,256"},
        ).launch(grid=(grid, 1, 1), block=(host.NUM_THREADS, 1, 1), stream=stream)

    return launch


@functools.lru_cache(maxsize=None)
def build_k_grouped(config: KernelConfig, band_cyclic: bool = True):
    """The launcher of the K-grouped (wgrad) kernel for ``config``."""
    d = _flydsl()
    flyc, fx = d.flyc, d.fx
    const_expr = d.fx.const_expr
    SharedStorage = _lds_storage()
    order_fn = on_dsl(sched.k_grouped_band_cyclic if band_cyclic else sched.k_grouped_group_major)
    cdiv_fn = on_dsl(sched.cdiv)
    BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K
    TILE_BYTES = host.LDS_TILE_BYTES

    @flyc.kernel
    def turbo_moe_k_grouped_fp8(
        a_addr: fx.Int64, b_addr: fx.Int64, c_addr: fx.Int64, sa_addr: fx.Int64, sb_addr: fx.Int64,
        offs_addr: fx.Int64, sa_numel: fx.Int32, sb_numel: fx.Int32,
        n: fx.Int32, k: fx.Int32, m: fx.Int32, num_groups: fx.Int32,
        lda: fx.Int32, ldb: fx.Int32, ldc: fx.Int32, stride_cg: fx.Int64,
        a_extent: fx.Int64, b_extent: fx.Int64, c_extent: fx.Int64,
        num_m_blocks: fx.Int32, num_n_blocks: fx.Int32, total_tiles: fx.Int32, grid: fx.Int32,
    ):
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = _readfirstlane_i32(fx.Int32(fx.ptrtoint(lds.tiles.ptr)))
        tid = fx.Int32(fx.thread_idx.x)
        wave = tid // host.WAVE_SIZE
        wave_row0 = (wave // 2) * 64
        wave_col0 = (wave % 2) * 64
        offs_srd = _make_srd(offs_addr, (num_groups + 1) * 8)
        for tile in range(fx.Int32(fx.block_idx.x), total_tiles, grid):
            group, m_block, n_block = order_fn(tile, num_groups, num_m_blocks, num_n_blocks, host.GROUP_M)
            lo = _load_group_offset(offs_srd, group)
            hi = _load_group_offset(offs_srd, group + 1)
            tokens = hi - lo
            row0 = m_block * BM
            col0 = n_block * BN
            a_ld = _OperandLoader(a_addr, a_extent, fx.Int64(row0) * fx.Int64(lda) + fx.Int64(lo), lda, n - row0, tokens)
            b_ld = _OperandLoader(b_addr, b_extent, fx.Int64(col0) * fx.Int64(ldb) + fx.Int64(lo), ldb, k - col0, tokens)
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
            value_attrs={"rocdl.waves_per_eu": 2, "rocdl.flat_work_group_size": "256,256"},
        ).launch(grid=(grid, 1, 1), block=(host.NUM_THREADS, 1, 1), stream=stream)

    return launch
