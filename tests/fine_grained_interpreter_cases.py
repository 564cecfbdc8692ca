"""Blockwise / MXFP8 Triton kernels under the Triton interpreter (child process, as
tests/triton_interpreter_cases.py explains): ``tests/test_fine_grained_triton.py`` runs
``TRITON_INTERPRET=1 python tests/fine_grained_interpreter_cases.py`` and reads its JSON.

* casts: bit-for-bit the torch reference quantizers. Triton 3.9's interpreter rounds
  float->fp8 wrongly when rounding carries into the exponent (tests/test_fp8_cast.py), so inputs
  are FP8 grid values times a power of two per block with each block's amax pinned to
  ``fp8_max * 2**-e``: scales are exact powers of two and nothing rounds; the compiled GPU test
  (tests/test_fine_grained_gpu.py) uses arbitrary data.
* GEMMs: NaN-poisoned outputs; against the float64 evaluation of the same block-scaled sum,
  ``|out - ref64| <= (B + blocks + 3) * 2**-24 * 1.2 * mag + |ref64| * u_out`` (fp32 sums of
  exact FP8 products, the per-block scaling, the final cast), ``mag`` the same sum over |a|, |b|.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _grid(shape, fp8, gen):
    return (torch.randn(shape, generator=gen) * 50).to(fp8).float().clamp(-torch.finfo(fp8).max / 2, torch.finfo(fp8).max / 2)


def _exact_rows(r, c, block, fp8, gen):
    e = torch.randint(-6, 7, (r, 1), generator=gen).float()
    x = _grid((r, c), fp8, gen) * 2.0 ** e
    for kb in range(0, c, block):
        x[:, kb] = torch.finfo(fp8).max * 2.0 ** e[:, 0]
    return x


def _exact_tokens(lens, recipe, fp8, gen):
    """(x [M, 24], offsets): FP8 grid values times a power of two per column, each token block's
    first token at the column's ``fp8_max * 2**e`` (its amax pinned, so its scale is exact)."""
    from turbo_moe.fine_grained import quantize as Q

    fmax = torch.finfo(fp8).max
    offs = torch.tensor([0] + lens).cumsum(0)
    e = torch.randint(-6, 7, (1, 24), generator=gen).float()
    xt = _grid((sum(lens), 24), fp8, gen) * 2.0 ** e
    for g, slots in enumerate(Q.token_slots(offs, recipe.block)):
        for j in range(len(slots)):
            xt[int(offs[g]) + j * recipe.block] = fmax * 2.0 ** e[0]
    return xt, offs


def case_casts():
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC

    default_flat = BC._TOKEN_FLAT
    gen = torch.Generator().manual_seed(0)
    checked = []
    for recipe in (Q.BLOCKWISE, Q.BLOCKWISE._replace(pow2=True), Q.MXFP8):
        for fp8, emax in ((E4M3, 8), (E5M2, 15)):
            fmax = torch.finfo(fp8).max
            x = _exact_rows(37, 300, recipe.block, fp8, gen)
            for src in (x, x.t().contiguous().t()):  # contiguous and strided sources
                q, s = BC.block_cast_rows(src, recipe, fp8, fmax, emax)
                q0, s0 = Q.quantize_rows(src, recipe, fp8)
                assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0), (recipe, fp8)
            # one program a group, then a skewed set: a long group's blocks over several programs
            # (_token_splits gives 2 for blockwise, 4 for MXFP8's 32-token blocks there)
            for lens in ([5, 0, 140, 1, 64], [700, 3, 0, 260, 130]):
                xt, offs = _exact_tokens(lens, recipe, fp8, gen)
                q0, s0 = Q.quantize_tokens(xt, offs, recipe, fp8)
                used = Q.token_slot_mask(offs, sum(lens), recipe.block)
                for flat in (0, 1, 4):  # the grid of a group's blocks, or of 1 or 4 blocks a program
                    BC._TOKEN_FLAT = flat
                    try:
                        q, s = BC.block_cast_tokens(xt, offs, recipe, fp8, fmax, emax)
                    finally:
                        BC._TOKEN_FLAT = default_flat
                    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s[:, used], s0[:, used]), flat
            assert BC._token_splits(sum(lens), len(lens), recipe.block) == (4 if recipe.e8m0 else 2)
            checked.append(f"{'mx' if recipe.e8m0 else 'pow2' if recipe.pow2 else 'block'}/{fp8}".replace("torch.float8_", ""))
        if not recipe.e8m0:
            e = torch.randint(-6, 7, (3, 1, 1), generator=gen).float()
            w = _grid((3, 200, 130), E4M3, gen) * 2.0 ** e
            w[:, ::128, ::128] = 448.0 * 2.0 ** e
            q, q_t, s = BC.block_cast_weight(w, recipe, E4M3, 448.0, 0, True)
            q0, q0_t, s0 = Q.quantize_weight_blocks(w, recipe, E4M3)
            assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
            assert torch.equal(q_t.view(torch.uint8), q0_t.view(torch.uint8))
    return "bitwise: " + ", ".join(checked) + ", weights"


def case_casts_aligned():
    """The aligned token layout (groups off 16-token boundaries, an empty one, a 16-token one)
    bit for bit the torch reference: values, zeroed padding, scales in their slots, offsets."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC

    default_flat = BC._TOKEN_FLAT
    gen = torch.Generator().manual_seed(3)
    checked = []
    for recipe in (Q.BLOCKWISE, Q.MXFP8):
        fmax = torch.finfo(E4M3).max
        lens = [5, 0, 140, 1, 16, 77]
        xt, offs = _exact_tokens(lens, recipe, E4M3, gen)
        cols = Q.aligned_token_columns(sum(lens), len(lens), 16)
        junk = torch.full((24, cols), 0x77, dtype=torch.uint8)  # freed memory the kernel's output may reuse:
        del junk  # the padding must be zeros it writes
        q, s, aligned = BC.block_cast_tokens_aligned(xt, offs, recipe, E4M3, fmax, 8, 0, 16, cols)
        q0, s0, aligned0 = Q.quantize_tokens_aligned(xt, offs, recipe, E4M3)
        assert torch.equal(aligned, aligned0) and aligned.tolist() == [0, 16, 16, 160, 176, 192, 272], aligned.tolist()
        end = int(aligned[-1])
        assert q.shape == q0.shape == (24, cols) and cols % 16 == 0 and cols >= end
        assert torch.equal(q[:, :end].view(torch.uint8), q0[:, :end].view(torch.uint8))
        used = Q.token_slot_mask(aligned, end, recipe.block)
        assert torch.equal(s[:, :used.numel()][:, used], s0[:, :used.numel()][:, used])
        # reused offsets (the second operand of one wgrad): not written, the same layout
        q2, s2, again = BC.block_cast_tokens_aligned(xt, offs, recipe, E4M3, fmax, 8, 0, 16, cols, aligned)
        assert again is aligned and torch.equal(q2[:, :end].view(torch.uint8), q[:, :end].view(torch.uint8))
        # decreasing offsets (never the layer's: checked and clamped) still give offsets within the columns
        bad = torch.tensor([0, 300, 0, 300])
        cols_bad = Q.aligned_token_columns(300, 3, 16)
        for flat in (0, 1, 2):
            BC._TOKEN_FLAT = flat
            try:
                _, _, got = BC.block_cast_tokens_aligned(torch.randn(300, 24, generator=gen), bad, recipe, E4M3, fmax, 8, 0,
                                                         16, cols_bad)
            finally:
                BC._TOKEN_FLAT = default_flat
            assert torch.equal(got, Q.aligned_token_offsets(bad, 16, cols_bad)) and got.tolist() == [0, 304, 304, 352], flat
        # skewed groups, the kernel's split count (up to more programs than blocks) and column
        # tile forced: the same bits
        lens = [700, 3, 0, 260, 130]
        xt, offs = _exact_tokens(lens, recipe, E4M3, gen)
        cols = Q.aligned_token_columns(sum(lens), len(lens), 16)
        q0, s0, aligned0 = Q.quantize_tokens_aligned(xt, offs, recipe, E4M3)
        end = int(aligned0[-1])
        used = Q.token_slot_mask(aligned0, end, recipe.block)
        default_splits, default_tiles = BC._token_splits, BC._TOKEN_TILE
        default_col_tiles, default_trans = BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS
        default_tile = default_tiles[recipe.block]
        try:
            # (splits, tile, flat, column tiles a program, transposed in registers); 16-column tiles
            # over C = 24: a program's second tile half past the columns
            for splits, tile, flat, col_tiles, trans in (
                    (None, default_tile, 0, 1, False), (1, (64, 4), 0, 1, False), (3, (32, 4), 0, 1, False),
                    (64, (128, 4), 0, 1, False), (None, default_tile, 1, 1, False), (None, (64, 4), 1, 1, False),
                    (None, default_tile, 4, 1, False), (None, (128, 4), 8, 1, False), (None, (16, 4), 1, 2, False),
                    (None, (16, 4), 2, 4, True), (None, default_tile, 1, 1, True), (2, default_tile, 0, 1, True),
                    (None, default_tile, 1, 2, True), (None, (64, 2), 1, 1, True)):
                BC._TOKEN_TILE, BC._TOKEN_FLAT = {recipe.block: tile}, flat
                BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS = {recipe.block: col_tiles}, trans
                if splits is not None:
                    BC._token_splits = lambda tokens, groups, block, n=splits: n
                q, s, aligned = BC.block_cast_tokens_aligned(xt, offs, recipe, E4M3, fmax, 8, 0, 16, cols)
                assert torch.equal(aligned, aligned0), (splits, aligned.tolist())
                assert torch.equal(q[:, :end].view(torch.uint8), q0[:, :end].view(torch.uint8)), splits
                assert torch.equal(s[:, :used.numel()][:, used], s0[:, :used.numel()][:, used]), splits
        finally:
            BC._token_splits, BC._TOKEN_TILE, BC._TOKEN_FLAT = default_splits, default_tiles, default_flat
            BC._TOKEN_COL_TILES, BC._TOKEN_TRANS_REGS = default_col_tiles, default_trans
        if not recipe.e8m0:
            # 300 groups, a third of them empty: the flat grid's group search runs over the offsets
            # 128 at a time, so a slot's group and start come from a later vector than its first
            lens = (torch.randint(0, 9, (300,), generator=gen) * (torch.rand(300, generator=gen) > 0.33)).tolist()
            lens[-1] = 200  # a last group of several blocks
            xt, offs = _exact_tokens(lens, recipe, E4M3, gen)
            cols = Q.aligned_token_columns(sum(lens), len(lens), 16)
            q0, s0, aligned0 = Q.quantize_tokens_aligned(xt, offs, recipe, E4M3)
            end = int(aligned0[-1])
            used = Q.token_slot_mask(aligned0, end, recipe.block)
            for flat in (0, 4):
                BC._TOKEN_FLAT = flat
                try:
                    q, s, aligned = BC.block_cast_tokens_aligned(xt, offs, recipe, E4M3, fmax, 8, 0, 16, cols)
                finally:
                    BC._TOKEN_FLAT = default_flat
                assert torch.equal(aligned, aligned0) and torch.equal(q[:, :end].view(torch.uint8), q0[:, :end].view(torch.uint8)), flat
                assert torch.equal(s[:, :used.numel()][:, used], s0[:, :used.numel()][:, used]), flat
        checked.append("mx" if recipe.e8m0 else "block")
    return "bitwise: " + ", ".join(checked) + " (skewed groups, 300 groups, 1-64 programs a group or 1-8 blocks a program, 16-128 columns a tile and 1-4 tiles a program, the transposed tile re-read or from registers)"


def case_swiglu_rows():
    """fc2's fused input cast (``swiglu_block_cast_rows``): ``a`` within an ulp of h's dtype of
    ``weighted_swiglu`` (float32 exp may differ by an ulp from torch's) and its rows copy bit for
    bit ``block_cast_rows`` of that ``a``; F off the block (a short last block), rows off the
    row tile, bf16 and float32 h, a NaN and a zero row kept as the rows cast keeps them."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC
    from turbo_moe.kernels.triton import swiglu_fp8 as SW
    from turbo_moe.swiglu import weighted_swiglu

    gen = torch.Generator().manual_seed(11)
    checked = []
    for recipe in (Q.BLOCKWISE, Q.MXFP8):
        for dtype, f in ((torch.bfloat16, 200), (torch.float32, 96)):
            fmax = torch.finfo(E4M3).max
            h = (torch.randn(45, 2 * f, generator=gen) * 3).to(dtype)
            h[7] = 0.0
            h[9, 3] = float("nan")
            probs = torch.rand(45, generator=gen)
            a, q, s = SW.swiglu_block_cast_rows(h, probs, recipe, E4M3, fmax, 8)
            ref = weighted_swiglu(h, probs).to(dtype)
            assert a.dtype == dtype and a.shape == (45, f) and torch.isnan(a[9, 3]) and torch.equal(a[7], ref[7])
            ok = ~torch.isnan(ref)
            err = (a[ok].float() - ref[ok].float()).abs()
            if dtype == torch.float32:  # four float32 roundings and exp: a few ulps
                assert (err <= 4 * torch.finfo(dtype).eps * ref[ok].abs()).all()
            else:  # an ulp at most: the interpreter's float32 -> bf16 conversion truncates, whatever
                # the rounding asked for (a GPU rounds to nearest even: test_fine_grained_gpu bounds
                # how often it differs from torch there)
                assert (err <= 1.01 * torch.finfo(dtype).eps * ref[ok].float().abs()).all()
            q0, s0 = BC.block_cast_rows(a, recipe, E4M3, fmax, 8)
            assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), (recipe, dtype)
            assert torch.equal(s.reshape(-1).view(torch.uint8), s0.reshape(-1).view(torch.uint8))  # NaN's bits too
            assert torch.isnan(s[9, 0].float()) or recipe.e8m0  # the NaN's block: a NaN scale (e8m0: 0xFF)
            checked.append(f"{'mx' if recipe.e8m0 else 'block'}/{str(dtype).replace('torch.', '')}")
    return "bitwise rows copy of the returned a: " + ", ".join(checked)


def case_swiglu_backward_rows():
    """The SwiGLU backward with dh's rows copy (``swiglu_backward_block_rows``): dh and dprobs bit
    for bit ``swiglu_backward``'s (the same tiles and sums), the copy bit for bit
    ``block_cast_rows(dh)``; F a multiple of the block but not of the 128-column tile (MXFP8: a
    chunk's last blocks outside F), rows off the row tile, a NaN row; F off the block refused."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.kernels.triton import blockwise_cast as BC
    from turbo_moe.kernels.triton import swiglu_fp8 as SW

    gen = torch.Generator().manual_seed(12)
    checked = []
    for recipe, f in ((Q.BLOCKWISE, 256), (Q.MXFP8, 96), (Q.BLOCKWISE._replace(pow2=True), 128)):
        fmax = torch.finfo(E4M3).max
        h = (torch.randn(21, 2 * f, generator=gen) * 3).bfloat16()
        da = torch.randn(21, f, generator=gen).bfloat16()
        da[4, 7] = float("nan")
        probs = torch.rand(21, generator=gen)
        dh, dprobs, q, s = SW.swiglu_backward_block_rows(h, probs, da, torch.float32, recipe, E4M3, fmax, 8)
        dh0, dprobs0 = SW.swiglu_backward(h, probs, da, torch.float32)
        assert torch.equal(dh.view(torch.int16), dh0.view(torch.int16)) and torch.equal(dprobs.isnan(), dprobs0.isnan())
        assert torch.equal(dprobs.nan_to_num(0.0), dprobs0.nan_to_num(0.0))
        q0, s0 = BC.block_cast_rows(dh, recipe, E4M3, fmax, 8)
        assert q.shape == q0.shape and s.shape == s0.shape, (q.shape, s.shape, s0.shape)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), recipe
        assert torch.equal(s.reshape(-1).view(torch.uint8), s0.reshape(-1).view(torch.uint8)), recipe
        checked.append(f"{'mx' if recipe.e8m0 else 'pow2' if recipe.pow2 else 'block'}/F={f}")
    try:
        SW.swiglu_backward_block_rows(torch.zeros(4, 2 * 100).bfloat16(), torch.ones(4), torch.zeros(4, 100).bfloat16(),
                                      torch.float32, Q.BLOCKWISE, E4M3, torch.finfo(E4M3).max, 8)
    except ValueError as e:
        assert "multiple of the recipe's block" in str(e)
    else:
        raise AssertionError("F = 100 under blockwise was not refused")
    return "bitwise dh, dprobs and rows copy: " + ", ".join(checked)


def _problem(kind, recipe, lens, n, k, a_fp8, gen, accumulate=False, aligned=False):
    from turbo_moe.backends.base import GemmKind
    from turbo_moe.fine_grained import BlockScaledProblem
    from turbo_moe.fine_grained import quantize as Q

    offs = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    m = sum(lens)
    mags = lambda rows: 10 ** (3 * torch.rand(rows, 1, generator=gen))  # noqa: E731
    if kind == "m":
        a, sa = Q.quantize_rows(torch.randn(m, k, generator=gen) * mags(m), recipe, a_fp8)
        w = torch.randn(len(lens), n, k, generator=gen)
        b, sb = Q.quantize_rows(w, recipe, E4M3) if recipe.e8m0 else Q.quantize_weight_blocks(w, recipe, E4M3)[::2]
        return BlockScaledProblem(GemmKind.M_GROUPED, a, b, sa, sb, offs, torch.float32, recipe)
    x_a, x_b = torch.randn(m, n, generator=gen) * mags(m), torch.randn(m, k, generator=gen)
    if aligned:  # the layout a GPU's wgrad gets (quantize_tokens_for_wgrad): groups on 16-token boundaries
        a, sa, wgrad_offs = Q.quantize_tokens_aligned(x_a, offs, recipe, a_fp8)
        b, sb, _ = Q.quantize_tokens_aligned(x_b, offs, recipe, E4M3, aligned_offs=wgrad_offs)
        offs = wgrad_offs
    else:
        a, sa = Q.quantize_tokens(x_a, offs, recipe, a_fp8)
        b, sb = Q.quantize_tokens(x_b, offs, recipe, E4M3)
    out = torch.randn(len(lens), n, k, generator=gen) if accumulate else None
    return BlockScaledProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.float32, recipe, out=out,
                              accumulate=accumulate)


def case_gemm(kind, recipe_name, lens, n, k, a_fp8=E4M3, accumulate=False, dot_scaled=False, tma=None, seed=None,
              planned=False, aligned=False):
    """``tma``: None takes the default config's path; True / False require the TMA / pointer
    kernel to be the one that runs (``triton_gemm.tma_declined``). ``planned``: no config given,
    so ``run`` takes (and caches) the launch plan of the problem's signature; ``seed`` varies the
    data of one shape."""
    import dataclasses

    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained import reference_block_scaled_gemm, triton_gemm

    recipe = {"blockwise": Q.BLOCKWISE, "pow2": Q.BLOCKWISE._replace(pow2=True), "mxfp8": Q.MXFP8}[recipe_name]
    gen = torch.Generator().manual_seed(len(lens) * 7 + n if seed is None else seed)
    problem = _problem(kind, recipe, lens, n, k, a_fp8, gen, accumulate, aligned)
    assert not problem.reason(), problem.reason()
    before = problem.out.clone() if accumulate else None
    config = (None if planned else
              triton_gemm.BlockKernelConfig(16, 16, 64 if dot_scaled else recipe.block, group_m=2, tma=tma is not False))
    declined = triton_gemm.tma_declined(problem, config)
    if tma is not None:
        assert (not declined) == tma, f"TMA kernel wanted={tma}, declined: {declined!r}"
    if accumulate:
        out = triton_gemm.run(problem, config)
    else:
        poisoned = torch.full(problem.out_shape, float("nan"))
        out = triton_gemm.run(dataclasses.replace(problem, out=poisoned), config)
    ref = reference_block_scaled_gemm(problem, torch.float64)
    mag = reference_block_scaled_gemm(dataclasses.replace(problem, a=problem.a.float().abs(), b=problem.b.float().abs()),
                                      torch.float64)
    if aligned:  # the layout holds the same problem: the same float64 value as the tokens where they are
        gen = torch.Generator().manual_seed(len(lens) * 7 + n if seed is None else seed)
        plain = _problem(kind, recipe, lens, n, k, a_fp8, gen, accumulate)
        assert torch.equal(reference_block_scaled_gemm(plain, torch.float64), ref)
    contraction = k if kind == "m" else max(lens + [1])
    blocks = -(-contraction // recipe.block)
    tol = (recipe.block + blocks + 3) * 2.0**-24 * 1.2 * mag + ref.abs() * 2.0**-24
    offs = problem.group_offs.tolist()
    if accumulate:
        for g in range(len(lens)):
            assert offs[g] < offs[g + 1] or torch.equal(out[g], before[g]), f"empty group {g} changed"
            ref[g] += before[g].double()
            tol[g] += before[g].double().abs() * 2.0**-24
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} elements never written"
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"{int((err > tol).sum())} beyond the fp32 bound, worst excess {float((err - tol).max()):.3g}"
    if kind == "k" and not accumulate:
        for g in range(len(lens)):
            if offs[g] == offs[g + 1]:
                assert torch.equal(out[g], torch.zeros_like(out[g])), f"empty group {g} not zero"
    path = "tma" if not declined else "pointers"
    if not err.numel():
        return f"{path}: empty output"
    return f"{path}: max err {float(err.max()):.3g} (max tol {float(tol.max()):.3g})"


CASES = {
    "casts_bitwise": case_casts,
    "casts_aligned_token_layout": case_casts_aligned,
    "casts_swiglu_rows": case_swiglu_rows,
    "casts_swiglu_backward_rows": case_swiglu_backward_rows,
    # The wgrad over the aligned token layout (groups off 16 tokens moved onto boundaries, zeros
    # between): the TMA kernel's aligned walk against the float64 reference of that problem.
    "k_blockwise_aligned_layout": lambda: case_gemm("k", "blockwise", [5, 0, 140, 1, 16, 77], 40, 48, tma=True,
                                                   aligned=True),
    "m_blockwise_ragged_empty": lambda: case_gemm("m", "blockwise", [5, 0, 37, 16, 0, 1], 45, 200),
    "m_blockwise_pow2_one_group": lambda: case_gemm("m", "pow2", [50], 130, 256),
    "m_blockwise_e5m2_a": lambda: case_gemm("m", "blockwise", [9, 23, 0, 31], 40, 150, a_fp8=E5M2),
    "m_blockwise_all_empty": lambda: case_gemm("m", "blockwise", [0, 0, 0], 16, 128),
    # The TMA kernel: K a multiple of 16 bytes but not of the block (the copy engine zero-fills
    # the last block), N not a multiple of the tile (the next group's weight rows, never stored).
    "m_blockwise_tma_ragged_empty": lambda: case_gemm("m", "blockwise", [5, 0, 37, 16, 0, 1], 45, 208, tma=True),
    "m_blockwise_pointers_forced": lambda: case_gemm("m", "pow2", [9, 0, 23], 45, 256, tma=False),
    "m_mxfp8_tma_column_scales": lambda: case_gemm("m", "mxfp8", [5, 0, 37, 16], 45, 112, tma=True),
    "m_mxfp8_ragged_promotion": lambda: case_gemm("m", "mxfp8", [5, 0, 37, 16], 45, 100),
    "m_mxfp8_dot_scaled": lambda: case_gemm("m", "mxfp8", [5, 0, 37, 16], 45, 100, dot_scaled=True),
    "k_blockwise_ragged_empty": lambda: case_gemm("k", "blockwise", [5, 0, 150, 33, 0, 129], 40, 45, tma=False),
    # The TMA kernel (M = 528, a multiple of 16): groups starting on and off 16-token boundaries
    # (offsets 0, 16, 16, 176, 309, 309, 437), full and short last blocks, an empty group; fp32
    # outputs whose rows are 16-byte multiples leave through the store descriptor (accumulate:
    # read back through it).
    "k_blockwise_tma_mixed_alignment": lambda: case_gemm("k", "blockwise", [16, 0, 160, 133, 0, 128, 91], 40, 48,
                                                          tma=True),
    "k_blockwise_tma_accumulate": lambda: case_gemm("k", "blockwise", [48, 0, 300, 100], 24, 20, accumulate=True,
                                                     tma=True),
    "k_blockwise_accumulate": lambda: case_gemm("k", "blockwise", [5, 0, 150, 33], 24, 20, accumulate=True),
    # Cached launch plans (no config: run plans once per signature): the same shapes with new data,
    # operands and outputs at new addresses, each against its own reference.
    "planned_launches_reused": lambda: "; ".join(
        case_gemm(kind, "blockwise", lens, 40, k, tma=True, seed=seed, planned=True, accumulate=acc)
        for kind, lens, k, acc in (("m", [5, 0, 37, 16], 208, False), ("k", [16, 0, 160, 133, 11], 48, False),
                                   ("k", [48, 0, 300, 100], 20, True))
        for seed in (1, 2)),
    "k_mxfp8_ragged_e5m2": lambda: case_gemm("k", "mxfp8", [5, 0, 70, 33], 40, 45, a_fp8=E5M2),
    # MXFP8's default is the pointer kernel; a config asking for TMA gets the K-grouped TMA kernel
    # with e8m0 scales (32-token blocks: two narrow boxes per off-boundary block).
    "k_mxfp8_tma_on_request": lambda: case_gemm("k", "mxfp8", [16, 0, 70, 41, 1], 40, 48, tma=True),
    "k_mxfp8_dot_scaled": lambda: case_gemm("k", "mxfp8", [5, 0, 70, 33], 40, 45, dot_scaled=True),
    "k_all_empty_zero": lambda: case_gemm("k", "mxfp8", [0, 0], 20, 20),
}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    wanted = set(sys.argv[1:])
    results = {}
    for name, fn in CASES.items():
        if wanted and name not in wanted:
            continue
        try:
            results[name] = {"ok": True, "detail": fn()}
        except Exception:
            results[name] = {"ok": False, "detail": traceback.format_exc()[-2000:]}
    print("RESULTS_JSON " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
