"""The main K loops of the FlyDSL grouped GEMMs (see ``grouped_gemm_fp8``'s docstring): operand
loaders (register-staged with exact tail loads, and LDS-DMA), the shared register-loop steps, LDS
fragment reads, the MFMA block with its hazard drain, and the LDS fences. Straight-line code,
traced as plain Python inside the kernels (the dynamic loops themselves must be written in the
kernel functions, which FlyDSL rewrites)."""

# No "from __future__ import annotations": FlyDSL reads annotations as types.

from . import host, mx_host
from .dsl import _flydsl, _opaque_zero, _raw, _readfirstlane_i32, _rebased_srd, on_dsl


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

    def __init__(self, tensor_addr, extent, tile_base, ld, rows_valid, k_len, scales=None):
        self.k_len = k_len
        self.ld, self.rows_valid = ld, rows_valid
        # MX variant: the operand's e8m0 scale loader (_MxScaleLoader), else None.
        self.scales = scales
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
        if self.scales is not None:
            # MX: not even hoisted out of the loops (its scale VGPRs leave no room for the
            # tail loop's hoisted lane values: one spilled); "& 255" keeps it non-negative.
            tid = (tid + _opaque_zero()) & (host.NUM_THREADS - 1)
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


class _MxScaleLoader:
    """The e8m0 scale bytes of one operand's tile for the scaled MFMA (MX variant): per K block,
    one byte per lane and fragment (``mx_host``: row ``lane % 16`` of the fragment, K group
    ``lane // 16``), global -> VGPR.

    ``scale_addr``: the scale tensor's address; ``end``: where this operand's scales end (bytes,
    ``mx_host.a_scale_end`` / ``b_scale_end``); ``tile_base`` (64-bit): byte offset of the tile's
    (first row, K group 0) (``mx_host.a_scale_tile_base`` / ``b_scale_tile_base``): one
    descriptor per tile, re-based as the operand loaders'. ``rows_total``: the stride between K
    groups (M or N); ``side``: 0 for a, 1 for b."""

    def __init__(self, scale_addr, end, tile_base, rows_total, side):
        self.srd = _rebased_srd(scale_addr, end, tile_base)
        self.rows_total = rows_total
        self.side = side  # 0: a (the wave's tile rows), 1: b (its tile columns), see wave_quadrant

    def load(self, k0):
        """This lane's scale bytes (as i32) of fragments 0..3 for the K block at ``k0`` (to be
        packed by :func:`_pack_scales`)."""
        d = _flydsl()
        fx = d.fx
        # LLVM hoists the lane offset out of the loops (1 VGPR per operand); "& 255" keeps the
        # thread id provably non-negative (// and % stay shifts and masks).
        tid = fx.Int32(fx.thread_idx.x) & (host.NUM_THREADS - 1)
        lane = tid % host.WAVE_SIZE
        wave_row0 = on_dsl(wave_quadrant)(tid // host.WAVE_SIZE)[self.side]
        # The block's part in the lane offset (not soffset): the range check sees all of it.
        voff = mx_host.scale_lane_offset(self.rows_total, wave_row0, lane) + _readfirstlane_i32(
            mx_host.scale_block_offset(self.rows_total, k0))
        zero = _raw(fx.Int32(0))
        # Fragment i's row is 16 i further: a constant, folded into the immediate offset.
        loads = [d.rocdl.raw_ptr_buffer_load(d.T.i8, self.srd, _raw(voff + mx_host.scale_fragment_offset(i)), zero)
                 for i in range(4)]
        return [d.arith.extui(d.T.i32, byte) for byte in loads]  # buffer_load_ubyte zero-extends: free


def _pack_scales(scale_bytes):
    """One VGPR holding the 4 fragments' scale bytes, fragment i's at byte ``mx_host.scale_opsel(i)``
    (the MFMAs' op_sel picks it): 2 VGPRs per block and wave instead of 8, the main loop has
    none to spare."""
    d = _flydsl()
    fx = d.fx
    word = fx.Int32(0)
    for i, byte in enumerate(scale_bytes):
        word = word | (fx.Int32(byte) << (8 * mx_host.scale_opsel(i)))
    return _raw(word)


def _with_scales(loader, regs, k0):
    """MX variant: a block's load registers with the operand's 4 scale bytes of block ``k0``
    appended, carried through the loop with them (one block behind: see :func:`_register_step`);
    ``regs`` as they are otherwise."""
    return regs if loader.scales is None else list(regs) + loader.scales.load(k0)


def _carried_scales(a_regs, b_regs):
    """(a's packed scale VGPR, b's) carried in the load registers (:func:`_with_scales`), or None."""
    if len(a_regs) == host.LOAD_PASSES:
        return None
    return _pack_scales(a_regs[host.LOAD_PASSES:]), _pack_scales(b_regs[host.LOAD_PASSES:])


def wave_quadrant(wave):
    """(first tile row, first tile column) of wave ``wave``'s 64x64 quadrant (4 waves in 2x2)."""
    return (wave // 2) * 64, (wave % 2) * 64


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
    # MX: block 0's scale bytes travel with block 1's registers (_register_step).
    a_next, b_next = _with_scales(a_ld, a_next, 0), _with_scales(b_ld, b_next, 0)
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
    MX variant: block kb's e8m0 scale bytes come with block kb+1's registers (loaded at the end
    of step kb-1, after its ds_writes, where few registers are live) and are packed after step
    1's prefetch (the wait for them, vmcnt(8), leaves it in flight); block kb+1's are loaded
    after step 4 and returned with block kb+2's registers.
    Returns (acc, block kb+2's registers)."""
    if full:
        a_new, b_new = a_ld.load_full(k_ahead), b_ld.load_full(k_ahead)
    if a_ld.scales is not None:
        _flydsl().fx.rocdl.sched_barrier(0)  # the packing's wait stays after the prefetch
    scales = _carried_scales(a_next, b_next)
    acc = _mfma_block(config, cur, wave_row0, cur + host.LDS_TILE_BYTES, wave_col0, acc, scales=scales)
    if not full:
        a_new, b_new = a_ld.load_exact(k_ahead), b_ld.load_exact(k_ahead)
    a_ld.store(nxt, a_next)
    b_ld.store(nxt + host.LDS_TILE_BYTES, b_next)
    k_next = k_ahead - host.BLOCK_K
    a_new, b_new = _with_scales(a_ld, a_new, k_next), _with_scales(b_ld, b_new, k_next)
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

    Lane l holds row ``l % 16`` and K bytes ``[32q, 32q + 32)``, q = l // 16 (``host.fragment_row``,
    ``host.fragment_k_group``; two ds_read_b128 of
    the swizzled chunks 2q, 2q+1). A and B use the same K order, which is all the dot product needs.
    """
    d = _flydsl()
    fx = d.fx
    lane = fx.Int32(fx.thread_idx.x) % host.WAVE_SIZE
    q = host.fragment_k_group(lane)
    row = host.fragment_row(wave_row0, i, lane)
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


def _mfma_block(config, lds_a, wave_row0, lds_b, wave_col0, acc, buffer=None, scales=None):
    """acc += A_block x B_block^T for the wave's 64x64 sub-tile.

    ``scales`` (MX variant): (a's packed scale VGPR, b's) (:func:`_pack_scales`); they go in
    the scale operands of the MFMA, op_sel picking fragment i's byte, each pair with the source
    it scales.

    MFMA-source safety by construction (issue 14: ``v_mfma ... v[244:251]`` was followed at once
    by ``ds_read_b128 v[244:247]``): all 8 fragments (A and B, 8 VGPRs each) are read before the
    first MFMA and stay live to the last, so no ds_read of this block can target a register an
    MFMA of the block still reads, and :func:`_mfma_drain` pads before the next block's reads."""
    d = _flydsl()
    fmt_a = d.ir.Attribute.parse(f"#rocdl<matrix_format {host.FP8_FORMATS[config.a_format]}>")
    fmt_b = d.ir.Attribute.parse(f"#rocdl<matrix_format {host.FP8_FORMATS[config.b_format]}>")
    # Scale operands 0 with opsel 0 select the unscaled v_mfma_f32_16x16x128_f8f6f4; the per-tensor
    # or per-row dequantization scales are applied once in the epilogue instead. MX: the per-lane
    # e8m0 scales of the block (mx_host says which lane scales what).
    zero = _raw(d.fx.Int32(0))

    def opsel(i):
        return mx_host.scale_opsel(i) if scales is not None else 0
    b_frags = [_read_fragment(lds_b, wave_col0, j, buffer) for j in range(4)]
    a_frags = [_read_fragment(lds_a, wave_row0, i, buffer) for i in range(4)]
    a_word, b_word = scales if scales is not None else (zero, zero)
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
            # The first (op_sel, scale) pair scales the first source: b's.
            op = d.rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                d.T.f32x4, b_frags[j], a_frags[i], _raw(acc[i * 4 + j]), fmt_b, fmt_a, opsel(j), b_word, opsel(i), a_word
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
