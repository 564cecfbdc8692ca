"""CPU tests of the host side of the FlyDSL kernels: launch plans, the scheduler calls, the int64
re-base and record counts (operands past 2^31 elements and 4 GB), and the lane -> (row, chunk),
LDS and accumulator maps. An emulation of the kernels' data movement built from these functions
is in test_flydsl_emulation.py, the backend's availability and can_handle reasons in
test_flydsl_dispatch.py. Needs torch only (no flydsl, no GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from turbo_moe.kernels import tile_scheduler as sched
from turbo_moe.kernels.flydsl import host

from fp8_reference import offsets

BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K


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
    offs = offsets([m // groups] * groups)
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
    offs = offsets(lens)
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
