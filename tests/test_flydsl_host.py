"""CPU tests of everything around the FlyDSL kernels: launch plans, the scheduler calls, the int64
re-base and record counts (operands past 2^31 elements and 4 GB), the lane -> (row, chunk) and LDS
maps, and an emulation of the kernels' data movement built from those same functions, checked
against a float64 reference. Needs torch only (no flydsl, no GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from turbo_moe.kernels import tile_scheduler as sched
from turbo_moe.kernels.flydsl import host

BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K


def _offsets(lens):
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return offs


# ----------------------------------------------------------------------------------------------
# Re-base arithmetic and record counts.
# ----------------------------------------------------------------------------------------------


def test_masked_offset_is_out_of_range_for_every_record_count():
    # The Primus-Turbo PR 384 bug: num_records clamped to 0xFFFFFFFF made the masked offset
    # 0x7FFFFFFF *valid*, so a masked store landed 2 GB past the tile. Here no re-based
    # descriptor can have num_records above NREC_CAP, and a masked access of any width (up to
    # 16 bytes) starting at OOB_OFFSET ends past it.
    for extent in (0, 1, 2**31 - 1, 2**31, 2**32, 2**32 + 7, 5 * 2**32, 2**40):
        for base in (0, 1, 2**31 - 17, 2**32 - 1, 2**32):
            nrec = host.rebased_nrec(extent, base)
            assert 0 <= nrec <= host.NREC_CAP
            assert nrec == max(0, min(extent - base, host.NREC_CAP))
            for width in (1, 2, 4, 16):
                assert host.OOB_OFFSET + width > nrec
    assert host.OOB_OFFSET >= host.NREC_CAP + 15  # even a 1-byte masked access is out of range


def test_check_in_tile_span_rejects_tiles_over_the_32_bit_lane_budget():
    host.check_in_tile_span("a", 2**20, BM, BK)  # 128 MiB tile: fine
    with pytest.raises(ValueError, match="a: a 128-row tile spans"):
        host.check_in_tile_span("a", 2**25, BM, BK)  # 4 GiB tile: lane offsets would overflow


@pytest.mark.parametrize(
    "m, k, n, groups",
    [
        (600_000, 7168, 4096, 8),  # a = 4.3e9 bytes (> 2^32), b = 235 MB
        (3_000_000, 1024, 2048, 4),  # a = 3.07e9 elements (> 2^31)
    ],
)
def test_m_grouped_rebase_reaches_every_byte_of_operands_past_4gb(m, k, n, groups):
    random.seed(m)
    cuts = sorted(random.sample(range(1, m), groups - 1))
    offs = [0] + cuts + [m]
    plan = host.plan_m_grouped((m, k), (k, 1), (groups, n, k), (n * k, k, 1), "bf16", 304)
    assert plan.a_extent == m * k and plan.a_extent > 2**31
    last_group = groups - 1
    rows = offs[-1] - offs[-2]
    # The last tile of the last group (largest addresses), at the last K block.
    tile = (last_group, sched.cdiv(rows, BM) - 1, sched.cdiv(n, BN) - 1)
    k0 = (sched.cdiv(k, BK) - 1) * BK
    bases = host.m_grouped_tile_bases(plan, offs, tile, k0)
    a_base, a_nrec, a_rows = bases["a"]
    row0 = offs[last_group] + tile[1] * BM
    assert a_base == row0 * k + k0 > 2**31  # past int32: the 64-bit base s_add_u32/s_addc_u32 compute
    for r in range(a_rows):
        for chunk in range(host.CHUNKS_PER_ROW):
            valid = host.chunk_valid_bytes(k, k0, chunk)
            if valid == 0:
                continue
            lane_offset = r * plan.lda + chunk * host.CHUNK_BYTES
            assert lane_offset < 2**31  # fits the 32-bit voffset
            # The element the lane reads is exactly a[row0 + r, k0 + 16 * chunk] ...
            assert a_base + lane_offset == (row0 + r) * k + k0 + chunk * host.CHUNK_BYTES
            # ... and its valid bytes are inside the descriptor's range.
            assert lane_offset + valid <= a_nrec
    # The output tile is re-based the same way; its masked lanes stay out of range.
    c_base, c_nrec, _ = bases["c"]
    assert c_base == row0 * plan.ldc + tile[2] * BN * 2
    assert host.OOB_OFFSET + 2 > c_nrec


def test_k_grouped_rebase_with_many_tokens():
    # wgrad: a = dy^T [N, M] with M = 2^22 tokens -> 2^22 * 4096 = 1.7e10 bytes.
    n, k, m, groups = 4096, 2048, 2**22, 16
    offs = _offsets([m // groups] * groups)
    plan = host.plan_k_grouped((n, m), (m, 1), (k, m), (m, 1), groups, "bf16", 304)
    tile = (groups - 1, plan.num_m_blocks - 1, plan.num_n_blocks - 1)
    k0 = BK * 5
    a_base, a_nrec, a_rows = host.k_grouped_tile_bases(plan, offs, tile, k0)["a"]
    assert a_base == tile[1] * BM * m + offs[groups - 1] + k0 > 2**33
    assert (a_rows - 1) * plan.lda + BK <= a_nrec
    with pytest.raises(ValueError, match="a: a 128-row tile spans"):
        # 2^25 tokens: 128 rows of dy^T span 4 GiB, beyond what 32-bit lane offsets reach.
        host.plan_k_grouped((n, 2**25), (2**25, 1), (k, 2**25), (2**25, 1), groups, "bf16", 304)


# ----------------------------------------------------------------------------------------------
# Plans, grids and the scheduler.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_cu", [1, 7, 304])
@pytest.mark.parametrize(
    "lens",
    [[0], [5], [0, 0, 3], [128, 0, 129, 1, 0, 300], [37] * 9, [1000, 1, 0, 0, 250]],
)
def test_m_grouped_kernel_loop_matches_the_shared_scheduler(lens, num_cu):
    n, k = 300, 200
    m = sum(lens)
    offs = _offsets(lens)
    plan = host.plan_m_grouped((m, k), (k, 1), (len(lens), n, k), (n * k, k, 1), "bf16", num_cu)
    expected = sched.schedule_m_grouped(lens, n, BM, BN, host.GROUP_M, num_cu)
    assert plan.grid == len(expected)
    assert [host.m_grouped_kernel_tiles(plan, offs, pid) for pid in range(plan.grid)] == expected
    # Every tile exactly once.
    all_tiles = [t for tiles in expected for t in tiles]
    want = {(g, mb, nb) for g, rows in enumerate(lens) for mb in range(sched.cdiv(rows, BM))
            for nb in range(sched.cdiv(n, BN))}
    assert sorted(all_tiles) == sorted(want)


@pytest.mark.parametrize("band_cyclic", [True, False])
@pytest.mark.parametrize("num_cu, groups", [(1, 1), (5, 3), (304, 8)])
def test_k_grouped_kernel_loop_matches_the_shared_scheduler(num_cu, groups, band_cyclic):
    n, k, m = 300, 260, 500
    plan = host.plan_k_grouped((n, m), (m, 1), (k, m), (m, 1), groups, "bf16", num_cu)
    expected = sched.schedule_k_grouped(groups, n, k, BM, BN, host.GROUP_M, num_cu, band_cyclic)
    assert plan.grid == len(expected) <= num_cu
    assert [host.k_grouped_kernel_tiles(plan, pid, band_cyclic) for pid in range(plan.grid)] == expected


def test_plan_argument_packing_and_errors():
    plan = host.plan_m_grouped((1000, 1000), (1000, 1), (4, 600, 1000), (600_000, 1000, 1), "bf16", 304)
    args = plan.scalar_args()
    assert args[:8] == (1000, 600, 1000, 4, 1000, 1000, 600_000, 1200)
    assert args[-3:] == (plan.num_n_blocks, plan.tile_bound, plan.grid)
    assert plan.tile_bound == (sched.cdiv(1000, BM) + 4) * sched.cdiv(600, BN)
    assert plan.grid == min(304, plan.tile_bound)
    with pytest.raises(ValueError, match="contiguous along the contraction"):
        host.plan_m_grouped((10, 64), (1, 10), (1, 8, 64), (512, 64, 1), "bf16", 4)
    with pytest.raises(ValueError, match="out_dtype"):
        host.plan_m_grouped((10, 64), (64, 1), (1, 8, 64), (512, 64, 1), "fp8", 4)
    with pytest.raises(ValueError, match="num_cu"):
        host.plan_m_grouped((10, 64), (64, 1), (1, 8, 64), (512, 64, 1), "bf16", 0)
    with pytest.raises(ValueError, match="contraction size"):
        host.plan_m_grouped((10, 64), (64, 1), (1, 8, 32), (256, 32, 1), "bf16", 4)
    with pytest.raises(ValueError, match="token count"):
        host.plan_k_grouped((8, 10), (10, 1), (6, 11), (11, 1), 2, "bf16", 4)


# ----------------------------------------------------------------------------------------------
# Lane maps.
# ----------------------------------------------------------------------------------------------


def test_loaders_cover_each_tile_chunk_once_and_lds_swizzle_is_a_bijection():
    seen = sorted((host.loader_row(t, p), host.loader_chunk(t))
                  for t in range(host.NUM_THREADS) for p in range(host.LOAD_PASSES))
    assert seen == [(r, c) for r in range(BM) for c in range(host.CHUNKS_PER_ROW)]
    offsets = sorted(host.lds_swizzled_offset(r, c) for r in range(BM) for c in range(host.CHUNKS_PER_ROW))
    assert offsets == list(range(0, host.LDS_TILE_BYTES, host.CHUNK_BYTES))


def test_lds_dma_layout_is_what_the_fragment_reads_expect():
    # LDS-DMA: lane l of wave w, pass p writes tile bytes p*4096 + w*1024 + 16*l (fixed by the
    # hardware); it loads global chunk dma_source_chunk(row, slot) of its row, and the MFMA
    # operand reads look for chunk c of row r at lds_swizzled_offset(r, c).
    for thread in range(host.NUM_THREADS):
        wave, lane = divmod(thread, host.WAVE_SIZE)
        for p in range(host.LOAD_PASSES):
            lds_byte = p * host.NUM_THREADS * host.CHUNK_BYTES + wave * 1024 + lane * host.CHUNK_BYTES
            row, slot = host.loader_row(thread, p), host.loader_chunk(thread)
            assert lds_byte == row * BK + slot * host.CHUNK_BYTES
            assert host.lds_swizzled_offset(row, host.dma_source_chunk(row, slot)) == lds_byte


@pytest.mark.parametrize("k, aligned, ok", [(4096, True, True), (4104, True, False), (4096, False, False)])
def test_lds_dma_only_for_whole_aligned_chunks(k, aligned, ok):
    addr = 0x1000 if aligned else 0x1008
    assert host.m_grouped_lds_dma_ok(k, addr, k, 0x2000, k, 8 * k) == ok


def test_mfma_operand_reads_see_whole_rows_in_k_order():
    # The 16 lanes of one MFMA row group read 16 rows; lane l, half h reads chunk 2*(l//16)+h.
    # Through the swizzle they must get the bytes the loader stored for (row, that chunk).
    for row in range(BM):
        for lane in range(host.WAVE_SIZE):
            q = lane // 16
            for h in range(2):
                chunk = 2 * q + h
                assert host.lds_swizzled_offset(row, chunk) // host.CHUNK_BYTES == row * 8 + (chunk ^ (row % 8))
    # 16 lanes reading the same chunk column of 16 consecutive rows hit 8 distinct 16-byte slots
    # of a 128-byte row (bank spread), not one.
    slots = {host.lds_swizzled_offset(r, 0) % BK for r in range(16)}
    assert len(slots) == 8


def test_chunk_and_dword_masks_zero_exactly_the_bytes_past_k():
    for k_len in (0, 1, 15, 16, 17, 37, 127, 128, 129, 300):
        for k0 in range(0, 384, BK):
            kept = []
            for chunk in range(host.CHUNKS_PER_ROW):
                valid = host.chunk_valid_bytes(k_len, k0, chunk)
                for dword in range(4):
                    mask = host.dword_byte_mask(host.dword_valid_bytes(valid, dword))
                    for byte in range(4):
                        if (mask >> (8 * byte)) & 0xFF:
                            kept.append(k0 + chunk * 16 + dword * 4 + byte)
            assert kept == [x for x in range(k0, k0 + BK) if x < k_len]


# ----------------------------------------------------------------------------------------------
# Emulation: the kernels' loads, masks, re-bases and stores, on CPU, vs float64.
# ----------------------------------------------------------------------------------------------


def _lane_load(mem, base, nrec, offset):
    """16 bytes of a buffer_load_dwordx4 at ``base + offset``: bytes past ``nrec`` read as zero."""
    out = torch.zeros(host.CHUNK_BYTES, dtype=torch.uint8)
    count = max(0, min(nrec - offset, host.CHUNK_BYTES))
    out[:count] = mem[base + offset: base + offset + count]
    return out


def _fill_lds(mem, base, nrec, ld, rows_valid, k_len, k0, lds_dma):
    """The LDS operand tile (16 KiB, swizzled) after the 256 threads' loads of block ``k0``:
    the register-staged loader (byte masks, ds_write at the swizzled slot) or the LDS-DMA loader
    (whole-chunk masks, hardware-fixed slot, swizzle on the global side)."""
    lds = torch.zeros(host.LDS_TILE_BYTES, dtype=torch.uint8)
    for thread in range(host.NUM_THREADS):
        for p in range(host.LOAD_PASSES):
            row = host.loader_row(thread, p)
            if lds_dma:
                slot = host.loader_chunk(thread)
                chunk = host.dma_source_chunk(row, slot)
                ok = row < rows_valid and host.chunk_valid_bytes(k_len, k0, chunk) > 0
                data = _lane_load(mem, base, nrec, host.masked_offset(row * ld + chunk * 16, ok))
                wave, lane = divmod(thread, host.WAVE_SIZE)
                at = p * host.NUM_THREADS * 16 + wave * 1024 + lane * 16  # M0 + 16 * lane
            else:
                chunk = host.loader_chunk(thread)
                valid = host.chunk_valid_bytes(k_len, k0, chunk) if row < rows_valid else 0
                data = _lane_load(mem, base, nrec, host.masked_offset(row * ld + chunk * 16, valid > 0))
                for dword in range(4):
                    kept = host.dword_valid_bytes(valid, dword)
                    assert host.dword_byte_mask(kept) == (1 << (8 * kept)) - 1
                    data[dword * 4 + kept: dword * 4 + 4] = 0
                at = host.lds_swizzled_offset(row, chunk)
            lds[at: at + 16] = data
    return lds


def _read_lds(lds):
    """The [128, 128] operand block as the MFMA fragment reads see it (chunk c of row r at
    lds_swizzled_offset(r, c))."""
    block = torch.zeros(BM, BK, dtype=torch.uint8)
    for r in range(BM):
        for c in range(host.CHUNKS_PER_ROW):
            at = host.lds_swizzled_offset(r, c)
            block[r, c * 16: c * 16 + 16] = lds[at: at + 16]
    return block


def _gather_block(mem, base, nrec, ld, rows_valid, k_len, k0, lds_dma=False):
    return _read_lds(_fill_lds(mem, base, nrec, ld, rows_valid, k_len, k0, lds_dma))


def _store_tile(out_mem: torch.Tensor, values: torch.Tensor, base: int, nrec: int, ldc: int, out_bytes: int,
                rows_valid: int, cols_valid: int):
    for r in range(BM):
        for c in range(BN):
            offset = host.masked_offset(r * ldc + c * out_bytes, r < rows_valid and c < cols_valid)
            if offset + out_bytes > nrec:  # the range check drops it (masked lanes always land here)
                continue
            out_mem[(base + offset) // out_bytes] = values[r, c]


def _fp8(x: torch.Tensor, dtype):
    return x.clamp(-200, 200).to(dtype)


@pytest.mark.parametrize(
    "a_dtype, k, lds_dma",
    [(torch.float8_e4m3fn, 200, False), (torch.float8_e5m2, 200, False), (torch.float8_e4m3fn, 208, True)],
)
def test_emulated_m_grouped_matches_float64(a_dtype, k, lds_dma):
    torch.manual_seed(0)
    lens = [0, 131, 1, 0, 70]
    m, n = sum(lens), 150  # N and K not multiples of 128
    offs = _offsets(lens)
    a = _fp8(torch.randn(m, k) * 4, a_dtype)
    b = _fp8(torch.randn(len(lens), n, k) * 4, torch.float8_e4m3fn)
    a_scale, b_scale = torch.rand(m) + 0.5, torch.rand(len(lens), n) + 0.5
    plan = host.plan_m_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), "f32", 3)
    a_mem, b_mem = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    out_mem = torch.full((m * n,), float("nan"), dtype=torch.float64)  # poison
    for pid in range(plan.grid):
        for tile in host.m_grouped_kernel_tiles(plan, offs, pid):
            g, mb, nb = tile
            acc = torch.zeros(BM, BN, dtype=torch.float64)
            for k0 in range(0, k, BK):
                bases = host.m_grouped_tile_bases(plan, offs, tile, k0)
                ab = _gather_block(a_mem, bases["a"][0], bases["a"][1], plan.lda, bases["a"][2], k, k0, lds_dma)
                bb = _gather_block(b_mem, bases["b"][0], bases["b"][1], plan.ldb, bases["b"][2], k, k0, lds_dma)
                acc += ab.view(a_dtype).double() @ bb.view(torch.float8_e4m3fn).double().T
            row0 = offs[g] + mb * BM
            rows = torch.arange(BM) + row0
            cols = torch.arange(BN) + nb * BN
            sa = torch.where(rows < m, a_scale[rows.clamp(max=m - 1)], 0).double()
            sb = torch.where(cols < n, b_scale[g][cols.clamp(max=n - 1)], 0).double()
            c_base, c_nrec, _ = host.m_grouped_tile_bases(plan, offs, tile, 0)["c"]
            _store_tile(out_mem, acc * sa[:, None] * sb[None, :], c_base, c_nrec, plan.ldc, 4,
                        offs[g + 1] - row0, n - nb * BN)
    ref = torch.zeros(m, n, dtype=torch.float64)
    for g in range(len(lens)):
        lo, hi = offs[g], offs[g + 1]
        ref[lo:hi] = (a[lo:hi].double() @ b[g].double().T) * a_scale[lo:hi, None].double() * b_scale[g].double()
    torch.testing.assert_close(out_mem.view(m, n), ref, rtol=1e-12, atol=1e-9)


def test_emulated_k_grouped_matches_float64_with_empty_groups():
    torch.manual_seed(1)
    lens = [37, 0, 200, 1, 0]
    n, k, m = 140, 130, sum(lens)
    groups = len(lens)
    offs = _offsets(lens)
    a = _fp8(torch.randn(n, m) * 4, torch.float8_e4m3fn)  # dy^T, token-contiguous
    b = _fp8(torch.randn(k, m) * 4, torch.float8_e4m3fn)  # x^T
    plan = host.plan_k_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), groups, "f32", 4)
    a_mem, b_mem = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    out_mem = torch.full((groups * n * k,), float("nan"), dtype=torch.float64)
    for pid in range(plan.grid):
        for tile in host.k_grouped_kernel_tiles(plan, pid):
            g, mb, nb = tile
            tokens = offs[g + 1] - offs[g]
            acc = torch.zeros(BM, BN, dtype=torch.float64)
            for k0 in range(0, tokens, BK):  # cdiv(tokens, BK) blocks: none for an empty group
                bases = host.k_grouped_tile_bases(plan, offs, tile, k0)
                ab = _gather_block(a_mem, bases["a"][0], bases["a"][1], plan.lda, bases["a"][2], tokens, k0)
                bb = _gather_block(b_mem, bases["b"][0], bases["b"][1], plan.ldb, bases["b"][2], tokens, k0)
                acc += ab.view(torch.float8_e4m3fn).double() @ bb.view(torch.float8_e4m3fn).double().T
            c_base, c_nrec, _ = host.k_grouped_tile_bases(plan, offs, tile, 0)["c"]
            _store_tile(out_mem, acc * 0.5, c_base, c_nrec, plan.ldc, 4, n - mb * BM, k - nb * BN)
    out = out_mem.view(groups, n, k)
    for g in range(groups):
        lo, hi = offs[g], offs[g + 1]
        ref = (a[:, lo:hi].double() @ b[:, lo:hi].double().T) * 0.5
        torch.testing.assert_close(out[g], ref, rtol=1e-12, atol=1e-9)
        if lo == hi:
            assert torch.equal(out[g], torch.zeros(n, k, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Dispatch: availability and can_handle reasons (no device needed).
# ----------------------------------------------------------------------------------------------


def _problem(a_dtype=torch.float8_e4m3fn, a_scale=None, b_scale=None, out_dtype=torch.bfloat16, offs_dtype=torch.int64,
             transpose_a=False):
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    a = torch.randn(10, 64).to(a_dtype)
    if transpose_a:
        a = torch.randn(64, 10).to(a_dtype).T
    b = torch.randn(2, 48, 64).to(torch.float8_e4m3fn)
    return GroupedGemmProblem(
        GemmKind.M_GROUPED, a, b,
        torch.tensor(1.0) if a_scale is None else a_scale, torch.tensor(1.0) if b_scale is None else b_scale,
        torch.tensor([0, 4, 10], dtype=offs_dtype), out_dtype,
    )


def _fake_rocm(monkeypatch, arch):
    import types as _types

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: _types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-",
                                                             multi_processor_count=256))


def test_backend_is_unavailable_without_a_rocm_gfx950_device_and_says_why(monkeypatch):
    from turbo_moe.backends import flydsl_backend

    backend = flydsl_backend.BACKEND
    ok, why = backend.is_available()
    if not (torch.version.hip and torch.cuda.is_available()):
        assert not ok and why  # here: no flydsl, or no ROCm device
    _fake_rocm(monkeypatch, "gfx942")
    ok, why = backend.is_available()
    if not flydsl_backend._flydsl_import_error():
        assert not ok and "gfx942" in why and "gfx950" in why
    _fake_rocm(monkeypatch, "gfx950")
    ok, why = backend.is_available()
    assert ok == (not flydsl_backend._flydsl_import_error()), why


def test_backend_opt_out(monkeypatch):
    from turbo_moe.backends import flydsl_backend

    monkeypatch.setenv("TURBO_MOE_DISABLE_FLYDSL", "1")
    _fake_rocm(monkeypatch, "gfx950")
    assert flydsl_backend.BACKEND.is_available() == (False, "disabled by TURBO_MOE_DISABLE_FLYDSL")


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({}, "not a ROCm GPU"),
        ({"a_dtype": torch.float8_e4m3fnuz}, "a is torch.float8_e4m3fnuz"),
        ({"a_scale": torch.ones(7)}, "a_scale has shape (7,)"),
        ({"b_scale": torch.ones(2, 47)}, "b_scale has shape (2, 47)"),
        ({"a_scale": torch.ones(10, dtype=torch.float64)}, "a_scale must be a contiguous float32"),
        ({"out_dtype": torch.int32}, "out_dtype torch.int32"),
        ({"offs_dtype": torch.int32}, "group_offs must be a 1-D int64"),
        ({"transpose_a": True}, "contiguous along the contraction"),
        ({"a_scale": torch.ones(10), "b_scale": torch.ones(2, 48)}, "not a ROCm GPU"),  # rowwise is fine
    ],
)
def test_backend_can_handle_reasons(kwargs, reason):
    from turbo_moe.backends import flydsl_backend

    ok, why = flydsl_backend.BACKEND.can_handle(_problem(**kwargs))
    assert not ok and reason in why, why


def test_auto_dispatch_passes_over_flydsl_with_its_reason_on_cpu():
    from turbo_moe.backends import recent_dispatches, select_backend

    chosen = select_backend(_problem(), "auto")
    assert chosen.name != "flydsl"
    record = recent_dispatches()[-1]
    assert dict(record.passed_over)["flydsl"]


# ----------------------------------------------------------------------------------------------
# out / accumulate (GroupedGemmProblem.out, .accumulate).
# ----------------------------------------------------------------------------------------------


def test_emulated_k_grouped_accumulate_adds_in_fp32_and_leaves_empty_groups_untouched():
    # The accumulating epilogue: out[g] += fp32 result, through the same masked stores; an empty
    # group stores no row at all (host.k_grouped_rows_stored), so even a -0.0 in out[g] survives.
    torch.manual_seed(2)
    lens = [0, 150, 3, 0]
    n, k, m = 130, 129, sum(lens)
    groups = len(lens)
    offs = _offsets(lens)
    a = _fp8(torch.randn(n, m) * 4, torch.float8_e4m3fn)
    b = _fp8(torch.randn(k, m) * 4, torch.float8_e4m3fn)
    plan = host.plan_k_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), groups, "f32", 3)
    a_mem, b_mem = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    before = torch.randn(groups * n * k, dtype=torch.float64)
    before[:: 7] = -0.0
    out_mem = before.clone()
    for pid in range(plan.grid):
        for tile in host.k_grouped_kernel_tiles(plan, pid):
            g, mb, nb = tile
            tokens = offs[g + 1] - offs[g]
            acc = torch.zeros(BM, BN, dtype=torch.float64)
            for k0 in range(0, tokens, BK):
                bases = host.k_grouped_tile_bases(plan, offs, tile, k0)
                ab = _gather_block(a_mem, bases["a"][0], bases["a"][1], plan.lda, bases["a"][2], tokens, k0)
                bb = _gather_block(b_mem, bases["b"][0], bases["b"][1], plan.ldb, bases["b"][2], tokens, k0)
                acc += ab.view(torch.float8_e4m3fn).double() @ bb.view(torch.float8_e4m3fn).double().T
            c_base, c_nrec, _ = host.k_grouped_tile_bases(plan, offs, tile, 0)["c"]
            rows = host.k_grouped_rows_stored(n - mb * BM, tokens)
            current = torch.zeros(BM, BN, dtype=torch.float64)
            for r in range(min(BM, max(rows, 0))):
                for c in range(min(BN, k - nb * BN)):
                    current[r, c] = out_mem[(c_base + r * plan.ldc + c * 4) // 4]
            _store_tile(out_mem, current + acc * 0.25, c_base, c_nrec, plan.ldc, 4, rows, k - nb * BN)
    out, start = out_mem.view(groups, n, k), before.view(groups, n, k)
    for g in range(groups):
        lo, hi = offs[g], offs[g + 1]
        if lo == hi:
            assert torch.equal(out[g], start[g]) and torch.equal(out[g].signbit(), start[g].signbit())
        else:
            ref = start[g] + (a[:, lo:hi].double() @ b[:, lo:hi].double().T) * 0.25
            torch.testing.assert_close(out[g], ref, rtol=1e-12, atol=1e-9)


def _k_problem(out=None, accumulate=False, out_dtype=torch.float32):
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    a = torch.randn(48, 10).to(torch.float8_e4m3fn)
    b = torch.randn(32, 10).to(torch.float8_e4m3fn)
    return GroupedGemmProblem(GemmKind.K_GROUPED, a, b, torch.tensor(1.0), torch.tensor(1.0),
                              torch.tensor([0, 4, 10], dtype=torch.int64), out_dtype, out=out, accumulate=accumulate)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: _k_problem(torch.zeros(2, 48, 32), True), "not a ROCm GPU"),  # valid: reaches the device check
        (lambda: _k_problem(torch.zeros(2, 48, 32)), "not a ROCm GPU"),
        (lambda: _k_problem(None, True), "accumulate needs out"),
        (lambda: _k_problem(torch.zeros(2, 48, 32, dtype=torch.bfloat16), True, torch.bfloat16), "accumulate needs a float32"),
        (lambda: _k_problem(torch.zeros(2, 32, 48)), "out has shape (2, 32, 48), expected (2, 48, 32)"),
        (lambda: _k_problem(torch.zeros(2, 48, 32, dtype=torch.float16)), "out is torch.float16"),
        (lambda: _k_problem(torch.zeros(2, 32, 48).transpose(1, 2)), "contiguous"),
        (lambda: _problem_with_out(accumulate=True), "K_GROUPED (wgrad) problems only"),
    ],
)
def test_backend_checks_out_and_accumulate(make, reason):
    from turbo_moe.backends import flydsl_backend

    ok, why = flydsl_backend.BACKEND.can_handle(make())
    assert not ok and reason in why, why


def _problem_with_out(accumulate):
    problem = _problem(out_dtype=torch.float32)
    problem.out, problem.accumulate = torch.zeros(10, 48), accumulate
    return problem



def test_accumulator_lane_map_covers_the_tile_and_matches_the_swapped_mfma():
    # The kernels issue MFMA(A slot = B's fragment j, B slot = A's fragment i). The 16x16 result
    # layout of v_mfma_f32_16x16x128: lane l, element e holds D[4*(l//16)+e][l%16] with
    # D = (A slot) (B slot)^T. So D = B_j A_i^T = (A_i B_j^T)^T, and lane l element e is
    # C[i*16 + l%16][j*16 + 4*(l//16) + e]: what host.acc_row / acc_col say.
    torch.manual_seed(5)
    a_tile, b_tile = torch.randn(BM, 32, dtype=torch.float64), torch.randn(BN, 32, dtype=torch.float64)
    c = a_tile @ b_tile.T
    seen = torch.zeros(BM, BN, dtype=torch.int64)
    for wave in range(host.NUM_THREADS // host.WAVE_SIZE):
        wave_row0, wave_col0 = (wave // 2) * 64, (wave % 2) * 64
        for i in range(4):
            for j in range(4):
                frag_a = a_tile[wave_row0 + i * 16: wave_row0 + i * 16 + 16]
                frag_b = b_tile[wave_col0 + j * 16: wave_col0 + j * 16 + 16]
                d = frag_b @ frag_a.T  # the MFMA's result with the swapped slots
                for lane in range(host.WAVE_SIZE):
                    row = host.acc_row(wave_row0, i, lane)
                    cols = [host.acc_col(wave_col0, j, lane, e) for e in range(4)]
                    assert cols == list(range(cols[0], cols[0] + 4)) and cols[0] % 4 == 0
                    for e in range(4):
                        assert abs(d[4 * (lane // 16) + e, lane % 16] - c[row, cols[e]]) < 1e-12
                        seen[row, cols[e]] += 1
    assert torch.equal(seen, torch.ones_like(seen))
