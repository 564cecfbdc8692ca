"""Blockwise and MXFP8 recipes on the torch backend: quantizer semantics, float64-reference error
bounds derived per recipe, the outlier inputs where fine-grained scales matter, autograd plumbing.

The bound (as tests/fp8_reference.py, with a scale per element's block): round-to-nearest into
FP8 with unit roundoff ``u`` (e4m3 2**-4, e5m2 2**-3) changes ``v`` by at most
``u*|v| + h*s(v)``, where ``s(v)`` is the dequantization scale of v's block and ``h`` half the
format's subnormal spacing (nothing saturates: blockwise scales put the block max on fp8_max,
MXFP8 exponents are chosen so the block max stays <= fp8_max). For ``y = sum_i a_i b_i``::

    |y~ - y| <= sum_i (u_a + u_b + u_a u_b)|a_i||b_i| + d_a,i (1+u_b)|b_i| + (1+u_a)|a_i| d_b,i + d_a,i d_b,i
                + (L + 2*blocks + 2) * 2**-24 * sum_i |a~_i||b~_i|      (fp32: sums, per-block scaling)
                + the output cast's rounding,

with ``d = h * s``. A kernel that drops a scale, uses the wrong block's scale or loses a block
breaks it by orders of magnitude; correct block-scaled arithmetic never exceeds it.
"""

from __future__ import annotations

import pytest
import torch

from turbo_moe import Float8Config
from turbo_moe.autograd import grouped_gemm_fp8, grouped_wgrad_fp8
from turbo_moe.backends.base import BackendUnavailable, GemmKind
from turbo_moe.fine_grained import quantize as Q
from turbo_moe.fine_grained import (BlockScaledProblem, dequantize_scales, quantize_rows, quantize_tokens,
                                    quantize_weight_blocks, reference_block_scaled_gemm, run_block_scaled,
                                    token_slot_mask, token_slots)

from fp8_reference import FP8_HALF_SUBNORMAL, FP8_UNIT_ROUNDOFF, OUT_HALF_ULP

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {"blockwise": Q.BLOCKWISE, "blockwise_pow2": Q.BLOCKWISE._replace(pow2=True), "mxfp8": Q.MXFP8}
CONFIGS = {"blockwise": Float8Config(granularity="blockwise"),
           "blockwise_pow2": Float8Config(granularity="blockwise", power_of_two_scales=True),
           "mxfp8": Float8Config(granularity="mxfp8"),
           "mxfp8_hybrid": Float8Config(granularity="mxfp8", format="hybrid")}


def _offs(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)


# ------------------------------------------------------------------------------------ quantizers

@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_row_blocks_round_trip_within_fp8_bound(name, fp8):
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=gen) * torch.logspace(-8, 8, 300)  # every block its own magnitude
    q, s = quantize_rows(x, recipe, fp8)
    assert q.shape == x.shape and s.shape == (9, -(-300 // recipe.block)) and s.dtype == recipe.scale_dtype
    assert s.transpose(0, 1).is_contiguous()  # block-major storage (the kernels' load)
    deq = dequantize_scales(s).repeat_interleave(recipe.block, 1)[:, :300]
    err = (q.double() * deq - x.double()).abs()
    assert (err <= FP8_UNIT_ROUNDOFF[fp8] * x.abs() + FP8_HALF_SUBNORMAL[fp8] * deq * 1.0001).all()
    if recipe.e8m0 or recipe.pow2:  # powers of two
        d = dequantize_scales(s)
        assert torch.equal(torch.frexp(d).mantissa, torch.full_like(d, 0.5))


def test_mx_exponent_is_the_smallest_that_does_not_saturate():
    gen = torch.Generator().manual_seed(2)
    amax = torch.cat([torch.rand(2000, generator=gen) * 10.0 ** torch.randint(-30, 30, (2000,), generator=gen),
                      torch.tensor([448.0, 448.0 * 1.0000001, 447.99, 1.75, 1.7500001, 3.5])])
    for fp8, fmax in ((E4M3, 448.0), (E5M2, 57344.0)):
        x = Q.mx_exponent(amax, fp8, 0).double()
        a = amax.double()
        assert (a * 2.0 ** -x <= fmax).all()
        assert (a * 2.0 ** -(x - 1) > fmax).all()
    assert Q.mx_exponent(torch.tensor([448.0]), E4M3, 0).item() == 0
    assert Q.mx_exponent(torch.tensor([449.0]), E4M3, 0).item() == 1
    assert Q.mx_exponent(torch.tensor([448.0]), E4M3, 3).item() == 3  # margin: head-room
    assert Q.mx_exponent(torch.tensor([0.0, 1e-45]), E4M3, 0).tolist() == [0, -126]


def test_nan_block_gets_nan_scale_only_there():
    x = torch.randn(4, 256)
    x[1, 130] = float("nan")
    for recipe in (Q.BLOCKWISE, Q.MXFP8):
        q, s = quantize_rows(x, recipe, E4M3)
        d = dequantize_scales(s)
        bad = torch.isnan(d) | torch.isnan(q.float()).reshape(4, -1, recipe.block).any(-1)
        assert bad[1, 130 // recipe.block] and bad.sum() == 1


def test_weight_blocks_shared_by_w_and_w_transposed():
    w = torch.randn(3, 200, 130) * torch.logspace(-3, 3, 130)
    q, q_t, s = quantize_weight_blocks(w, Q.BLOCKWISE, E4M3)
    assert s.shape == (3, 2, 2) and torch.equal(q_t.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
    blocks = torch.nn.functional.pad(w.abs(), (0, 126, 0, 56)).reshape(3, 2, 128, 2, 128).amax((2, 4))
    assert torch.allclose(s, blocks / 448.0, rtol=1e-6)


@pytest.mark.parametrize("lens", [[5, 0, 37, 300, 0, 128, 1], [0, 0], [129], [256, 127, 1]])
def test_token_slots_never_collide_and_fit(lens):
    for block in (128, 32):
        slots = [s for group in token_slots(_offs(lens), block) for s in group]
        assert len(slots) == len(set(slots)) and all(0 <= s < Q.num_token_slots(sum(lens), len(lens), block) for s in slots)


def test_token_blocks_restart_at_each_group():
    lens = [5, 0, 200, 3]
    x = torch.randn(sum(lens), 20)
    x[5 + 130] *= 1000  # an outlier token in group 2's second block: group 2's first block must not see it
    offs = _offs(lens)
    q_t, s = quantize_tokens(x, offs, Q.BLOCKWISE, E4M3)
    assert q_t.shape == (20, 208) and s.shape == (20, 208 // 128 + 4)
    slots = token_slots(offs, 128)
    assert slots[1] == [] and len(slots[2]) == 2
    first, second = slots[2]
    assert torch.allclose(s[:, first], x[5:133].abs().amax(0) / 448, rtol=1e-6)
    assert torch.allclose(s[:, second], x[133:205].abs().amax(0) / 448, rtol=1e-6)
    assert torch.allclose(s[:, slots[0][0]], x[0:5].abs().amax(0) / 448, rtol=1e-6)
    assert token_slot_mask(offs, 208, 128).sum() == 4


@pytest.mark.parametrize("lens", [[5, 0, 37, 300, 0, 128, 1], [0, 0], [129], [16, 32, 1, 15, 17], [3] * 40])
def test_aligned_token_layout_moves_groups_onto_boundaries_and_keeps_the_wgrad(lens):
    """The layout a GPU's wgrad gets (``quantize_tokens_for_wgrad``): every group from a 16-token
    boundary with zeros after its tokens, the same FP8 values and scales, and so the same wgrad: its
    float64 value over the moved problem equals the one over the tokens where they were."""
    offs = _offs(lens)
    aligned = Q.aligned_token_offsets(offs, 16)
    cols = Q.aligned_token_columns(sum(lens), len(lens), 16)
    assert all(int(v) % 16 == 0 for v in aligned) and int(aligned[-1]) <= cols and cols % 16 == 0
    assert [int(b - a) for a, b in zip(aligned[:-1], aligned[1:])] == [-(-n // 16) * 16 for n in lens]
    gen = torch.Generator().manual_seed(4)
    dy, x = torch.randn(sum(lens), 24, generator=gen), torch.randn(sum(lens), 40, generator=gen)
    for name in ("blockwise", "mxfp8"):
        recipe = RECIPES[name]
        a, sa = quantize_tokens(dy, offs, recipe, E5M2)
        b, sb = quantize_tokens(x, offs, recipe, E4M3)
        a2, sa2, wgrad_offs = Q.quantize_tokens_aligned(dy, offs, recipe, E5M2)
        b2, sb2, again = Q.quantize_tokens_aligned(x, offs, recipe, E4M3, aligned_offs=wgrad_offs)
        assert again is wgrad_offs and torch.equal(wgrad_offs, aligned) and a2.shape == (24, cols)
        for g, (lo, hi) in enumerate(zip(offs.tolist()[:-1], offs.tolist()[1:])):
            start, end = int(aligned[g]), int(aligned[g + 1])
            assert torch.equal(a2[:, start:start + hi - lo].view(torch.uint8), a[:, lo:hi].view(torch.uint8))
            assert not a2[:, start + hi - lo:end].view(torch.uint8).any() and not b2[:, start + hi - lo:end].float().any()
        plain = BlockScaledProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.float32, recipe)
        moved = BlockScaledProblem(GemmKind.K_GROUPED, a2, b2, sa2, sb2, wgrad_offs, torch.float32, recipe)
        assert not moved.reason(), moved.reason()
        assert torch.equal(reference_block_scaled_gemm(moved, torch.float64),
                           reference_block_scaled_gemm(plain, torch.float64))
    # off the GPU the wgrad keeps the tokens where they are
    q, _, used = Q.quantize_tokens_for_wgrad(x, offs, RECIPES["blockwise"], E4M3)
    assert used is offs and q.shape == (40, sum(lens))


def test_aligned_token_cast_without_columns_still_gives_the_offsets(monkeypatch):
    """A wgrad operand with no columns (the cast kernel has nothing to run for): the GPU path's
    offsets come from the torch formula; the kernel wrapper asked for them alone says to pass them."""
    pytest.importorskip("triton")
    from turbo_moe.kernels.triton import blockwise_cast as BC

    monkeypatch.setattr(Q, "_kernels", lambda t: BC)  # the GPU path, on CPU tensors: no launch happens
    offs = _offs([5, 0, 17])
    q, _, aligned = Q.quantize_tokens_aligned(torch.empty(22, 0), offs, Q.BLOCKWISE, E4M3)
    assert q.shape == (0, Q.aligned_token_columns(22, 3, 16)) and aligned.tolist() == [0, 16, 16, 48]
    with pytest.raises(ValueError, match="aligned_offs"):
        BC.block_cast_tokens_aligned(torch.empty(22, 0), offs, Q.BLOCKWISE, E4M3, 448.0, 8, 0, 16, 80)
    _, _, none_yet = Q.quantize_tokens_aligned(torch.empty(0, 8), _offs([0, 0]), Q.BLOCKWISE, E4M3)
    assert none_yet.tolist() == [0, 0, 0]


# ----------------------------------------------------------------------------- error bounds (f64)

def _expand_rows(s, block, cols):
    return dequantize_scales(s).double().repeat_interleave(block, -1)[..., :cols]


def _expand_weight(s, n, k):
    return dequantize_scales(s).double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]


def _expand_tokens(s, offs, block, m):
    out = torch.empty(s.shape[0], m, dtype=torch.float64)
    o = offs.tolist()
    for g, slots in enumerate(token_slots(offs, block)):
        for j, slot in enumerate(slots):
            out[:, o[g] + j * block:min(o[g] + (j + 1) * block, o[g + 1])] = dequantize_scales(s[:, slot:slot + 1]).double()
    return out


def _bound(a, sa, fa, b, sb, fb, length, blocks):
    """Element-wise bound for a @ b.T (a [R, L], b [C, L] float64 unquantized; sa, sb per-element
    dequantization scales)."""
    ua, ub = FP8_UNIT_ROUNDOFF[fa], FP8_UNIT_ROUNDOFF[fb]
    da, db = FP8_HALF_SUBNORMAL[fa] * sa, FP8_HALF_SUBNORMAL[fb] * sb
    aa, ab = a.abs(), b.abs()
    bound = (ua + ub + ua * ub) * aa @ ab.T + (da * (1 + ub)) @ ab.T + (aa * (1 + ua)) @ db.T + da @ db.T
    mag = (aa * (1 + ua) + da) @ (ab * (1 + ub) + db).T
    return bound + (length + 2 * blocks + 2) * 2.0**-24 * 1.2 * mag


def _check(actual, ref, bound, out_dtype, what):
    actual = actual.detach().double()
    assert not torch.isnan(actual).any(), what
    allowed = bound * (1 + OUT_HALF_ULP[out_dtype]) + ref.abs() * OUT_HALF_ULP[out_dtype] * 2
    excess = (actual - ref).abs() - allowed
    assert (excess <= 0).all(), f"{what}: {int((excess > 0).sum())} elements beyond the bound, worst {float(excess.max()):.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("lens", [[37, 0, 150, 1], [200], [0, 0, 9]], ids=["ragged_empty", "one_group", "mostly_empty"])
def test_fwd_dgrad_wgrad_within_recipe_bound(name, lens):
    config = CONFIGS[name]
    recipe = Q.recipe_of(config)
    gen = torch.Generator().manual_seed(3)
    M, K, N, G = sum(lens), 200, 150, len(lens)  # K and N not multiples of 128 (nor 32)
    scale = 10 ** (4 * torch.rand(M, 1, generator=gen))
    x = (torch.randn(M, K, generator=gen) * scale).requires_grad_()
    w = (torch.randn(G, N, K, generator=gen) * 10 ** (2 * torch.rand(G, 1, K, generator=gen))).requires_grad_()
    dy = torch.randn(M, N, generator=gen) * scale
    offs = _offs(lens)
    y = grouped_gemm_fp8(x, w, group_offs=offs, config=config, backend="torch")
    y.backward(dy)
    fwd, grad = config.forward_dtype, config.grad_dtype
    o = offs.tolist()
    B = recipe.block
    # forward
    _, xs = quantize_rows(x.detach(), recipe, fwd)
    if recipe.e8m0:
        ws, wts = (_expand_rows(quantize_rows(t, recipe, fwd)[1], B, t.shape[-1]) for t in (w.detach(), w.detach().transpose(1, 2)))
    else:
        ws = _expand_weight(quantize_weight_blocks(w.detach(), recipe, fwd)[2], N, K)
        wts = ws.transpose(1, 2)
    xs, kb = _expand_rows(xs, B, K), -(-K // B)
    _, dys = quantize_rows(dy, recipe, grad)
    dys = _expand_rows(dys, B, N)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    for g in range(G):
        rows = slice(o[g], o[g + 1])
        if o[g] == o[g + 1]:
            continue
        _check(y[rows], x64[rows] @ w64[g].T, _bound(x64[rows], xs[rows], fwd, w64[g], ws[g], fwd, K, kb), y.dtype,
               f"{name} y group {g}")
        _check(x.grad[rows], dy64[rows] @ w64[g], _bound(dy64[rows], dys[rows], grad, w64[g].T, wts[g], fwd, N, -(-N // B)),
               x.dtype, f"{name} dx group {g}")
    # wgrad: token blocks per group
    dyt = _expand_tokens(quantize_tokens(dy, offs, recipe, grad)[1], offs, B, M)
    xt = _expand_tokens(quantize_tokens(x.detach(), offs, recipe, fwd)[1], offs, B, M)
    for g in range(G):
        rows = slice(o[g], o[g + 1])
        if o[g] == o[g + 1]:
            assert torch.equal(w.grad[g], torch.zeros_like(w.grad[g]))
            continue
        L = o[g + 1] - o[g]
        _check(w.grad[g], dy64[rows].T @ x64[rows],
               _bound(dy64[rows].T, dyt[:, rows], grad, x64[rows].T, xt[:, rows], fwd, L, -(-L // B)), w.dtype,
               f"{name} dW group {g}")


@pytest.mark.parametrize("name", ["blockwise", "mxfp8"])
def test_bound_catches_a_wrong_block_scale(name):
    """The bound is not vacuous: reading the neighbouring K block's scales (blocks of different
    magnitudes) breaks it."""
    recipe = Q.recipe_of(CONFIGS[name])
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 256, generator=gen), torch.randn(1, 30, 256, generator=gen)
    x[:, recipe.block:2 * recipe.block] *= 8
    xq, xs = quantize_rows(x, recipe, E4M3)
    wq, ws = quantize_rows(w, recipe, E4M3) if recipe.e8m0 else quantize_weight_blocks(w, recipe, E4M3)[::2]
    bound = _bound(x.double(), _expand_rows(xs, recipe.block, 256), E4M3, w[0].double(),
                   _expand_rows(ws[0], recipe.block, 256) if recipe.e8m0 else _expand_weight(ws, 30, 256)[0], E4M3,
                   256, 256 // recipe.block)
    ref = x.double() @ w[0].double().T
    offs = _offs([40])
    good = run_block_scaled(BlockScaledProblem(GemmKind.M_GROUPED, xq, wq, xs, ws, offs, torch.float32, recipe))
    _check(good, ref, bound, torch.float32, "unperturbed")
    wrong = xs.clone()
    wrong[:, 1] = xs[:, 0]
    bad = run_block_scaled(BlockScaledProblem(GemmKind.M_GROUPED, xq, wq, wrong, ws, offs, torch.float32, recipe))
    with pytest.raises(AssertionError, match="beyond the bound"):
        _check(bad, ref, bound, torch.float32, "perturbed")


# ------------------------------------------------------------------ where fine-grained scales matter

def _per_row_error(y, ref):
    return float(((y.double() - ref).norm(dim=1) / ref.norm(dim=1)).mean())


def _errors(x, w, lens, config):
    offs = _offs(lens)
    y = grouped_gemm_fp8(x, w, group_offs=offs, config=config, backend="torch")
    o = offs.tolist()
    ref = torch.cat([x.double()[o[g]:o[g + 1]] @ w.double()[g].T for g in range(len(lens))])
    return _per_row_error(y, ref)


ALL = {"tensorwise": Float8Config(), "rowwise": Float8Config(granularity="rowwise"), **CONFIGS}


def _table(kind):
    gen = torch.Generator().manual_seed(4)
    lens, K, N = [96, 0, 160, 256], 512, 384
    M, G = sum(lens), len(lens)
    x = torch.randn(M, K, generator=gen)
    if kind == "token_decades":  # token magnitudes spread over six decades
        x = x * 10 ** (6 * torch.rand(M, 1, generator=gen))
    w = torch.randn(G, N, K, generator=gen) / K**0.5
    return {name: _errors(x, w, lens, cfg) for name, cfg in ALL.items() if name != "mxfp8_hybrid"}


def test_error_table_normal_inputs():
    table = _table("normal")
    print("\nper-row relative error of y, normal inputs:", {k: round(v, 4) for k, v in table.items()})
    for name, err in table.items():
        assert err < 0.05, (name, err)  # e4m3's two operand roundings: ~0.037 for every recipe


def _gradient_errors(config, lens, K=512, N=384):
    """Relative Frobenius errors of (y, dx, dW) against float64, through autograd (torch backend)."""
    gen = torch.Generator().manual_seed(5)
    offs = _offs(lens)
    M, G = sum(lens), len(lens)
    x = torch.randn(M, K, generator=gen).requires_grad_()
    w = (torch.randn(G, N, K, generator=gen) / K**0.5).requires_grad_()
    dy = torch.randn(M, N, generator=gen)
    y = grouped_gemm_fp8(x, w, group_offs=offs, config=config, backend="torch")
    y.backward(dy)
    o = offs.tolist()
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    refs = (torch.cat([x64[o[g]:o[g + 1]] @ w64[g].T for g in range(G)]),
            torch.cat([dy64[o[g]:o[g + 1]] @ w64[g] for g in range(G)]),
            torch.stack([dy64[o[g]:o[g + 1]].T @ x64[o[g]:o[g + 1]] for g in range(G)]))
    return [float((got.detach().double() - ref).norm() / ref.norm()) for got, ref in zip((y, x.grad, w.grad), refs)]


def test_gradient_error_table_normal_inputs():
    """y, dx and dW carry the same error under every recipe on normal inputs (e4m3 and hybrid): a
    fine-grained recipe that read a wrong scale slot in backward (e.g. a ragged group's token
    blocks) would stand out here, where only rounding separates the recipes."""
    lens = [96, 0, 160, 256, 77]  # an empty group and sizes off the 32/128 token blocks
    table = {}
    for fmt in ("e4m3", "hybrid"):
        for gran in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
            table[(fmt, gran)] = _gradient_errors(Float8Config(format=fmt, granularity=gran), lens)
    print("\nrelative error (y, dx, dW), normal inputs:",
          {f"{f}/{g}": [round(e, 4) for e in errs] for (f, g), errs in table.items()})
    for (fmt, gran), errs in table.items():
        base = table[(fmt, "tensorwise")]
        for what, err, ref in zip(("y", "dx", "dW"), errs, base):
            # e4m3 rounds operands to 2**-4 relative (~0.037 here); e5m2 gradients to 2**-3 (~0.059)
            limit = 0.045 if (what == "y" or fmt == "e4m3") else 0.07
            assert err < limit and err < 1.1 * ref, (fmt, gran, what, err, ref)


def test_fine_grained_beat_tensorwise_on_six_decades_of_token_magnitudes():
    table = _table("token_decades")
    print("\nper-row relative error of y, token magnitudes over six decades:", {k: round(v, 4) for k, v in table.items()})
    assert table["tensorwise"] > 0.15  # small tokens fall into e4m3's subnormals under one scale
    for name in ("blockwise", "blockwise_pow2", "mxfp8"):
        assert table[name] < table["tensorwise"] / 4 and table[name] < 0.045, (name, table)


# -------------------------------------------------------------------------------------- plumbing

def test_wgrad_alone_accumulates_into_main_grad_and_leaves_empty_groups():
    gen = torch.Generator().manual_seed(5)
    lens = [40, 0, 70]
    dy, x = torch.randn(110, 24, generator=gen), torch.randn(110, 40, generator=gen)
    main_grad = torch.randn(3, 24, 40, generator=gen)
    main_grad[1, 0, 0] = -0.0
    before = main_grad.clone()
    for name in ("blockwise", "mxfp8"):
        fresh = grouped_wgrad_fp8(dy, x, _offs(lens), config=CONFIGS[name], backend="torch", out_dtype=torch.float32)
        acc = main_grad.clone()
        out = grouped_wgrad_fp8(dy, x, _offs(lens), config=CONFIGS[name], backend="torch", main_grad=acc)
        assert out is acc and torch.equal(acc[1].view(torch.int32), before[1].view(torch.int32))  # -0.0 kept
        assert torch.allclose(acc[[0, 2]], before[[0, 2]] + fresh[[0, 2]], rtol=0, atol=1e-5)


def test_cached_weight_and_trans_b_false():
    from turbo_moe.autograd import grouped_gemm_fp8_with_offs, quantize_weight

    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(50, 64, generator=gen), torch.randn(2, 64, 48, generator=gen)  # [G, K, N]
    offs = _offs([20, 30])
    for name in ("blockwise", "mxfp8"):
        cfg = CONFIGS[name]
        y = grouped_gemm_fp8(x, w, group_offs=offs, trans_b=False, config=cfg, backend="torch")
        cached = quantize_weight(w.transpose(1, 2), cfg)
        y2 = grouped_gemm_fp8_with_offs(x, w, offs, trans_b=False, config=cfg, backend="torch", w_fp8=cached)
        assert torch.equal(y, y2) and y.shape == (50, 48)


def test_forward_region_hands_no_cached_weight_tensor_out():
    """The fine-grained forward region's outputs are its own (a host-plan region may return only
    its allocations or its inputs): with a cached W^T it returns y alone and the Function takes
    W^T from the cache (blockwise's W^T scales are a view of W's, not an input); without the cache
    it returns the W^T it made. Same y and the same W^T tensors either way."""
    from turbo_moe.autograd import quantize_weight
    from turbo_moe.fine_grained import autograd as fine

    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(40, 128, generator=gen), torch.randn(2, 96, 128, generator=gen)
    offs = _offs([15, 25])
    for name in ("blockwise", "mxfp8"):
        cfg = CONFIGS[name]
        cached = quantize_weight(w, cfg)
        y, w_kn, w_kn_scale = fine._forward_tensors(x, None, None, w, cached, offs, cfg, None, "torch",
                                                    torch.float32, True)
        assert w_kn is None and w_kn_scale is None, name
        y_made, made_kn, made_scale = fine._forward_tensors(x, None, None, w, None, offs, cfg, None, "torch",
                                                            torch.float32, True)
        assert torch.equal(y, y_made) and torch.equal(made_kn.view(torch.uint8), cached.data_t.view(torch.uint8))
        assert torch.equal(made_scale.float(), cached.scale_t.float()), name


def test_backend_choice_and_refusals():
    q, s = quantize_rows(torch.randn(8, 64), Q.MXFP8, E4M3)
    wq, ws = quantize_rows(torch.randn(1, 16, 64), Q.MXFP8, E4M3)
    offs = _offs([8])
    problem = BlockScaledProblem(GemmKind.M_GROUPED, q, wq, s, ws, offs, torch.float32, Q.MXFP8)
    assert run_block_scaled(problem).shape == (8, 16)  # auto on a CPU without the interpreter: torch
    with pytest.raises(BackendUnavailable, match="FlyDSL MXFP8 M-grouped variant writes bfloat16"):
        run_block_scaled(problem, "flydsl")
    with pytest.raises(BackendUnavailable, match="triton"):
        run_block_scaled(problem, "triton")
    with pytest.raises(ValueError, match="b_scale must be torch.uint8"):
        run_block_scaled(BlockScaledProblem(GemmKind.M_GROUPED, q, wq, s, ws.float(), offs, torch.float32, Q.MXFP8))
    with pytest.raises(ValueError, match=r"a_scale must have shape \(8, 2\)"):
        run_block_scaled(BlockScaledProblem(GemmKind.M_GROUPED, q, wq, s[:, :1], ws, offs, torch.float32, Q.MXFP8))


def test_meta_device_infers_shapes():
    x = torch.empty(30, 64, device="meta", requires_grad=True)
    w = torch.empty(2, 48, 64, device="meta", requires_grad=True)
    offs = torch.tensor([0, 10, 30], device="meta")
    y = grouped_gemm_fp8(x, w, group_offs=offs, config=CONFIGS["blockwise"])
    assert y.shape == (30, 48) and y.device.type == "meta"


def test_k_grouped_tma_kernel_declines_scale_offsets_past_int32():
    """The K-grouped TMA kernel keeps the scales' row offsets in int32: scale tensors whose rows
    reach 2**31 elements take the pointer kernel, and say so (metadata only: nothing is read)."""
    pytest.importorskip("triton")
    from turbo_moe.fine_grained import triton_gemm

    r = Q.BLOCKWISE
    offs = torch.tensor([0, 64, 128])
    a = torch.zeros(32, 128, dtype=torch.float8_e4m3fn)
    b = torch.zeros(48, 128, dtype=torch.float8_e4m3fn)
    slots = Q.num_token_slots(128, 2, r.block)
    sa, sb = torch.ones(32, slots), torch.ones(48, slots)
    cfg = triton_gemm.BlockKernelConfig(16, 16, r.block)
    problem = BlockScaledProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.float32, r)
    assert not triton_gemm.tma_declined(problem, cfg)
    far = torch.empty_strided((32, slots), (2**26, 1), device="meta")  # row 31 starts past 2**31 elements
    declined = triton_gemm.tma_declined(BlockScaledProblem(GemmKind.K_GROUPED, a, b, far, sb, offs, torch.float32, r),
                                        cfg)
    assert "2**31" in declined
