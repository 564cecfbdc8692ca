"""An emulation of the FlyDSL kernels' data movement on the CPU, built from the host functions the
kernels use (tests/test_flydsl_host.py checks those one by one): the loaders' masked 16-byte loads
into the swizzled LDS tile (register-staged and LDS-DMA), the fragment reads, the re-based
descriptors and the masked stores, run tile by tile in the scheduler's order and checked against
float64 references; with empty groups, ragged sizes, N and K off the tile, and the accumulating
wgrad epilogue. Needs torch only (no flydsl, no GPU)."""

from __future__ import annotations

import pytest
import torch

from turbo_moe.kernels.flydsl import host

from fp8_reference import offsets

BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K


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
    offs = offsets(lens)
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
    offs = offsets(lens)
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


def test_emulated_k_grouped_accumulate_adds_in_fp32_and_leaves_empty_groups_untouched():
    # The accumulating epilogue: out[g] += fp32 result, through the same masked stores; an empty
    # group stores no row at all (host.k_grouped_rows_stored), so even a -0.0 in out[g] survives.
    torch.manual_seed(2)
    lens = [0, 150, 3, 0]
    n, k, m = 130, 129, sum(lens)
    groups = len(lens)
    offs = offsets(lens)
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
