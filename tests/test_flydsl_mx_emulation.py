"""CPU emulation of the FlyDSL MXFP8 variants (``KernelConfig.mx``: M-grouped and the K-grouped wgrad),
built from the index functions the kernels call: the operand loaders into the swizzled LDS tiles (as in
test_flydsl_emulation.py), the fragment reads (``host.fragment_row`` / ``fragment_k_group``), the
scale loads (``mx_host``: re-based descriptor with its range, lane / block / fragment offsets, the
packed byte per fragment = op_sel) and the scaled MFMA's semantics as ``mx_host`` states them
(lane l's scale scales its own 32 K elements of its row), accumulated in fp32 per MFMA and
placed with ``host.acc_row`` / ``acc_col``. Checked against ``reference_block_scaled_gemm``.
Needs torch only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turbo_moe.backends.base import GemmKind
from turbo_moe.fine_grained.gemm import BlockScaledProblem, reference_block_scaled_gemm
from turbo_moe.fine_grained.quantize import MXFP8, num_token_slots, token_slots
from turbo_moe.kernels.flydsl import host, mx_host
from turbo_moe.kernels.flydsl.main_loop import wave_quadrant

from fp8_reference import offsets
from test_flydsl_emulation import _fp8, _gather_block, _store_tile

BM, BN, BK = host.BLOCK_M, host.BLOCK_N, host.BLOCK_K
LANES = torch.arange(host.WAVE_SIZE)


def _scale_words(mem, base, nrec, rows_total, wave_first, k0):
    """[64] int64: each lane's packed scale VGPR for the block at ``k0`` (bytes past ``nrec`` read 0)."""
    voff = mx_host.scale_lane_offset(rows_total, wave_first, LANES) + mx_host.scale_block_offset(rows_total, k0)
    word = torch.zeros(host.WAVE_SIZE, dtype=torch.int64)
    for i in range(4):
        at = voff + mx_host.scale_fragment_offset(i)
        inside = at < nrec
        byte = torch.where(inside, mem[(base + at).clamp(max=mem.numel() - 1)].long() if mem.numel() else 0, 0)
        word |= byte << (8 * mx_host.scale_opsel(i))
    return word


def _slot(block, wave_first, frag, word):
    """The 16x128 MFMA operand (float64, scaled) that fragment ``frag`` of the 64 lanes feeds: lane l
    gives row l % 16, K bytes [32 q, 32 q + 32) and their scale, byte scale_opsel(frag) of its word."""
    out = torch.zeros(16, BK, dtype=torch.float64)
    exponent = (word >> (8 * mx_host.scale_opsel(frag))) & 0xFF
    for lane in range(host.WAVE_SIZE):
        row = host.fragment_row(wave_first, frag, lane)
        q = host.fragment_k_group(lane)
        # e8m0: 255 is NaN (OCP MX), and NaN times zero bytes is NaN: a stray read shows.
        scale = float("nan") if int(exponent[lane]) == 255 else 2.0 ** (int(exponent[lane]) - 127)
        out[lane % 16, q * mx_host.MX_BLOCK:(q + 1) * mx_host.MX_BLOCK] = (
            block[row, q * mx_host.MX_BLOCK:(q + 1) * mx_host.MX_BLOCK] * scale)
    return out


def _mx_block(acc, ab, bb, k0, a_scales, b_scales):
    """acc (fp32, [BM, BN]) += one 128-deep K block of the tile: the 4 waves' 4x4 scaled MFMAs.
    ``ab`` / ``bb``: the operands' [BM, BK] / [BN, BK] blocks (float64 of the FP8 bytes);
    ``a_scales`` / ``b_scales``: (scale memory, descriptor base, its range, rows between K groups)."""
    for wave in range(host.NUM_THREADS // host.WAVE_SIZE):
        wave_row0, wave_col0 = wave_quadrant(wave)
        a_word = _scale_words(*a_scales[:3], a_scales[3], wave_row0, k0)
        b_word = _scale_words(*b_scales[:3], b_scales[3], wave_col0, k0)
        for i in range(4):
            a_slot = _slot(ab, wave_row0, i, a_word)
            for j in range(4):
                # B's fragment in the MFMA's A slot: d[m_, n_] = sum_k b_slot[m_] a_slot[n_].
                d = _slot(bb, wave_col0, j, b_word) @ a_slot.T
                for e in range(4):
                    rows = host.acc_row(wave_row0, i, LANES)
                    cols = host.acc_col(wave_col0, j, LANES, e)
                    vals = d[4 * (LANES // 16) + e, LANES % 16]
                    acc[rows, cols] = (acc[rows, cols].double() + vals).float()


def _emulate(a, a_scale, b, b_scale, offs, n, k):
    m = a.shape[0]
    plan = host.plan_m_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), "f32", 3)
    a_mem, b_mem = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    # Block-major storage of the stored scales (what quantize_rows returns; the layout mx_host reads).
    sa_mem = a_scale.transpose(0, 1).contiguous().flatten()
    sb_mem = b_scale.transpose(1, 2).contiguous().flatten()
    out_mem = torch.full((m * n,), float("nan"), dtype=torch.float64)
    for pid in range(plan.grid):
        for tile in host.m_grouped_kernel_tiles(plan, offs, pid):
            g, mb, nb = tile
            row0, col0 = offs[g] + mb * BM, nb * BN
            sa_base, sb_base = mx_host.a_scale_tile_base(row0), mx_host.b_scale_tile_base(g, n, k, col0)
            sa_nrec = host.rebased_nrec(mx_host.a_scale_end(m, k), sa_base)
            sb_nrec = host.rebased_nrec(mx_host.b_scale_end(g, n, k), sb_base)
            acc = torch.zeros(BM, BN, dtype=torch.float32)
            for k0 in range(0, k, BK):
                bases = host.m_grouped_tile_bases(plan, offs, tile, k0)
                ab = _gather_block(a_mem, bases["a"][0], bases["a"][1], plan.lda, bases["a"][2], k, k0)
                bb = _gather_block(b_mem, bases["b"][0], bases["b"][1], plan.ldb, bases["b"][2], k, k0)
                _mx_block(acc, ab.view(a.dtype).double(), bb.view(b.dtype).double(), k0,
                          (sa_mem, sa_base, sa_nrec, m), (sb_mem, sb_base, sb_nrec, n))
            c_base, c_nrec, _ = host.m_grouped_tile_bases(plan, offs, tile, 0)["c"]
            _store_tile(out_mem, acc.double(), c_base, c_nrec, plan.ldc, 4, offs[g + 1] - row0, n - col0)
    return out_mem.view(m, n)


@pytest.mark.parametrize("k", [160, 128 + 96 + 5, 32])
def test_emulated_mx_m_grouped_matches_the_reference(k):
    torch.manual_seed(k)
    lens = [0, 131, 1, 0, 70]
    m, n = sum(lens), 150
    groups = len(lens)
    offs = offsets(lens)
    a = _fp8(torch.randn(m, k) * 4, torch.float8_e4m3fn)
    b = _fp8(torch.randn(groups, n, k) * 4, torch.float8_e4m3fn)
    kb = mx_host.scale_groups(k)
    # Random e8m0 exponents, never 0 (2^-127) nor 255 (NaN); a moderate range keeps fp32 normal.
    a_scale = torch.randint(117, 138, (m, kb), dtype=torch.uint8)
    b_scale = torch.randint(117, 138, (groups, n, kb), dtype=torch.uint8)
    out = _emulate(a, a_scale, b, b_scale, offs, n, k)

    def problem(a_, b_):
        return BlockScaledProblem(GemmKind.M_GROUPED, a_, b_, a_scale, b_scale, torch.tensor(offs, dtype=torch.int64),
                                  torch.float32, MXFP8)

    ref = reference_block_scaled_gemm(problem(a, b), torch.float32).double()
    mag = reference_block_scaled_gemm(problem(a.double().abs(), b.double().abs()), torch.float64)
    # Both sides sum in fp32 and differ only in order: the reference sums each 32-block's products
    # (exact in fp32: 4-bit significands, power-of-two scales) in fp32, then the KB blocks; the
    # emulation adds each 128-deep MFMA (exact here, float64) to an fp32 accumulator. Each side's
    # error is at most gamma_n * sum|a b sa sb| with n <= 32 + KB + K/128 + 1 additions.
    n_add = 32 + kb + -(-k // BK) + 1
    bound = 2 * n_add * 2.0 ** -24 * mag + 1e-30
    err = (out - ref).abs()
    assert torch.all(err <= bound), float((err / bound).max())
    assert not torch.isnan(out).any()  # every row stored (the empty groups own none)
    print(f"K={k}: max |emulation - reference| = {float(err.max()):.3e}, max error / bound = "
          f"{float((err / bound).max()):.3e}, max relative to magnitude = {float((err / mag.clamp(min=1e-30)).max()):.3e}")


def test_scale_layout_check():
    mx_host.check_scale_layout("a_scale", (200, 5), (1, 200))
    mx_host.check_scale_layout("b_scale", (3, 150, 5), (750, 1, 150))
    with pytest.raises(ValueError, match="block-major"):
        mx_host.check_scale_layout("a_scale", (200, 5), (5, 1))


def _emulate_k_grouped(a, a_scale, b, b_scale, offs):
    """The K-grouped MX kernel (wgrad): a [N, M], b [K, M] token-major, scales slot-major
    ([rows, slots] views of [slots, rows] storage, what quantize_tokens returns)."""
    (n, m), (k, _) = a.shape, b.shape
    groups = len(offs) - 1
    plan = host.plan_k_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), groups, "f32", 3)
    a_mem, b_mem = a.view(torch.uint8).flatten(), b.view(torch.uint8).flatten()
    sa_mem = a_scale.transpose(0, 1).contiguous().flatten()  # slot s of row r at s * n + r
    sb_mem = b_scale.transpose(0, 1).contiguous().flatten()
    out_mem = torch.full((groups * n * k,), float("nan"), dtype=torch.float64)
    for pid in range(plan.grid):
        for tile in host.k_grouped_kernel_tiles(plan, pid):
            g, mb, nb = tile
            lo, tokens = offs[g], offs[g + 1] - offs[g]
            row0, col0 = mb * BM, nb * BN
            first = mx_host.token_first_slot(lo, g)
            sa_base, sb_base = mx_host.token_scale_tile_base(first, n, row0), mx_host.token_scale_tile_base(first, k, col0)
            sa_nrec = host.rebased_nrec(mx_host.token_scale_end(first, tokens, n), sa_base)
            sb_nrec = host.rebased_nrec(mx_host.token_scale_end(first, tokens, k), sb_base)
            acc = torch.zeros(BM, BN, dtype=torch.float32)
            for k0 in range(0, tokens, BK):  # cdiv(tokens, BK) blocks: none for an empty group
                bases = host.k_grouped_tile_bases(plan, offs, tile, k0)
                ab = _gather_block(a_mem, bases["a"][0], bases["a"][1], plan.lda, bases["a"][2], tokens, k0)
                bb = _gather_block(b_mem, bases["b"][0], bases["b"][1], plan.ldb, bases["b"][2], tokens, k0)
                _mx_block(acc, ab.view(a.dtype).double(), bb.view(b.dtype).double(), k0,
                          (sa_mem, sa_base, sa_nrec, n), (sb_mem, sb_base, sb_nrec, k))
            c_base, c_nrec, _ = host.k_grouped_tile_bases(plan, offs, tile, 0)["c"]
            _store_tile(out_mem, acc.double(), c_base, c_nrec, plan.ldc, 4, n - row0, k - col0)
    return out_mem.view(groups, n, k)


def test_emulated_mx_k_grouped_matches_the_reference_and_reads_no_other_groups_scales():
    """Groups with no tokens, fewer than 32, a ragged tail, several K blocks, a first token off the
    32-token grid; N and K off the tile. Every scale slot no group owns holds 255 (NaN), and so do
    all of group 2's (its dW is NaN, as in the reference): a tile whose descriptor reached past its
    group's last slot would read a NaN scale for its zeroed tail bytes and put NaN into its dW."""
    torch.manual_seed(3)
    lens = [0, 45, 7, 300, 0, 33]
    offs = offsets(lens)
    m, n, k, groups = sum(lens), 140, 150, len(lens)
    a = _fp8(torch.randn(n, m) * 4, torch.float8_e4m3fn)  # dy^T
    b = _fp8(torch.randn(k, m) * 4, torch.float8_e4m3fn)  # x^T
    slots = num_token_slots(m, groups, mx_host.MX_BLOCK)
    owned = [slot for group in token_slots(offs, mx_host.MX_BLOCK) for slot in group]
    assert len(owned) < slots  # there are unowned slots to poison
    stored_a = torch.full((slots, n), 255, dtype=torch.uint8)
    stored_b = torch.full((slots, k), 255, dtype=torch.uint8)
    stored_a[owned] = torch.randint(117, 138, (len(owned), n), dtype=torch.uint8)
    stored_b[owned] = torch.randint(117, 138, (len(owned), k), dtype=torch.uint8)
    nan_group = 2  # right after group 1 (45 tokens: its last K block reads 2 K groups past its tokens)
    stored_a[token_slots(offs, mx_host.MX_BLOCK)[nan_group]] = 255
    a_scale, b_scale = stored_a.T, stored_b.T  # what quantize_tokens returns: [rows, slots] views
    out = _emulate_k_grouped(a, a_scale, b, b_scale, offs)

    def problem(a_, b_):
        return BlockScaledProblem(GemmKind.K_GROUPED, a_, b_, a_scale, b_scale, torch.tensor(offs, dtype=torch.int64),
                                  torch.float32, MXFP8)

    ref = reference_block_scaled_gemm(problem(a, b), torch.float32).double()
    mag = reference_block_scaled_gemm(problem(a.double().abs(), b.double().abs()), torch.float64)
    assert torch.isnan(ref[nan_group]).all() and torch.isnan(out[nan_group]).all()
    for g, tokens in enumerate(lens):
        if g == nan_group:
            continue
        assert not torch.isnan(out[g]).any(), g  # no poisoned slot read; every (n, k) stored
        if tokens == 0:
            assert torch.equal(out[g], torch.zeros(n, k, dtype=torch.float64))
        # As the M-grouped test: fp32 sums on both sides, differing in order only.
        kb = mx_host.scale_groups(tokens)
        n_add = 32 + kb + -(-tokens // BK) + 1
        bound = 2 * n_add * 2.0 ** -24 * mag[g] + 1e-30
        err = (out[g] - ref[g]).abs()
        assert torch.all(err <= bound), (g, float((err / bound).max()))


@pytest.mark.parametrize("kind", ["m", "k"])
def test_emulated_mx_variant_runs_power_of_two_blockwise(kind):
    """UE8M0 blockwise on the MX variant (``pow2_blockwise_as_mxfp8``, what ``flydsl_mx.run`` hands
    the kernel): the emulated kernel on the converted scales against the blockwise problem's own
    reference, within the fp32 summation-order bound of the MX tests above."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained.gemm import pow2_blockwise_as_mxfp8

    pow2 = Q.BLOCKWISE._replace(pow2=True)
    torch.manual_seed(11)
    lens = [0, 131, 1, 0, 70] if kind == "m" else [0, 45, 7, 300, 0, 33]
    offs = offsets(lens)
    offs_t = torch.tensor(offs, dtype=torch.int64)
    m, n, k, groups = sum(lens), 140, 160, len(lens)
    spread = 10 ** (3 * torch.rand(m, 1) - 1)
    if kind == "m":
        a, sa = Q.quantize_rows(torch.randn(m, k) * spread, pow2, torch.float8_e4m3fn)
        b, _, sb = Q.quantize_weight_blocks(torch.randn(groups, n, k), pow2, torch.float8_e4m3fn, transposed=False)
        problem = BlockScaledProblem(GemmKind.M_GROUPED, a, b, sa, sb, offs_t, torch.float32, pow2)
        mx = pow2_blockwise_as_mxfp8(problem)
        out = _emulate(a, mx.a_scale, b, mx.b_scale, offs, n, k)
        contraction = k
    else:
        a, sa = Q.quantize_tokens(torch.randn(m, n) * spread, offs_t, pow2, torch.float8_e4m3fn)
        b, sb = Q.quantize_tokens(torch.randn(m, k), offs_t, pow2, torch.float8_e4m3fn)
        problem = BlockScaledProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs_t, torch.float32, pow2)
        mx = pow2_blockwise_as_mxfp8(problem)
        out = _emulate_k_grouped(a, mx.a_scale, b, mx.b_scale, offs)
        contraction = max(lens)
    ref = reference_block_scaled_gemm(problem, torch.float32).double()
    absolute = dataclasses.replace(problem, a=problem.a.double().abs(), b=problem.b.double().abs())
    mag = reference_block_scaled_gemm(absolute, torch.float64)
    kb = mx_host.scale_groups(contraction)
    n_add = 128 + kb + -(-contraction // BK) + 1  # the reference sums 128-deep blocks in fp32
    bound = 2 * n_add * 2.0 ** -24 * mag + 1e-30
    assert not torch.isnan(out).any()
    err = (out - ref).abs()
    assert torch.all(err <= bound), float((err / bound).max())
