"""Blockwise / MXFP8 kernels compiled on a GPU (marked ``gpu``; skipped on the CPU CI).

Run: ``TURBO_MOE_LAUNCH_CHECK=1 python -m pytest -q tests/test_fine_grained_gpu.py``.
"""

import dataclasses

import pytest
import torch

from turbo_moe import Float8Config
from turbo_moe.autograd import grouped_gemm_fp8
from turbo_moe.fine_grained import quantize as Q
from turbo_moe.fine_grained import reference_block_scaled_gemm, triton_gemm

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {"blockwise": Q.BLOCKWISE, "pow2": Q.BLOCKWISE._replace(pow2=True), "mxfp8": Q.MXFP8}


def _cpu(t):
    return t.detach().cpu()


def _on_gpu(problem):
    """``problem`` with its operands, scales and offsets on the GPU (``out`` stays where it is)."""
    return dataclasses.replace(problem, **{f: getattr(problem, f).cuda() for f in
                                           ("a", "b", "a_scale", "b_scale", "group_offs")})


def _gluon_and_tma_outputs(on_gpu, cfg, new_out):
    """The outputs of the Gluon kernel and of the Triton TMA kernel (``cfg`` with gluon on / off) on
    ``on_gpu``, each into ``new_out()`` (NaN-poisoned, or a main_grad to add into), after checking
    that each plan runs the kernel asked for."""
    outs = []
    for gluon in (True, False):
        out = new_out()
        chosen = dataclasses.replace(cfg, gluon=gluon)
        assert triton_gemm.plan(dataclasses.replace(on_gpu, out=out), chosen, out).gluon == gluon
        outs.append(triton_gemm.run(dataclasses.replace(on_gpu, out=out), chosen))
    return outs


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_casts_bitwise_equal_torch_reference_on_random_data(name, fp8):
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(333, 1000, generator=gen) * 10 ** (4 * torch.rand(333, 1, generator=gen))
    x[7, 500] = 1e-30
    q, s = Q.quantize_rows(x.cuda(), recipe, fp8)
    q0, s0 = Q.quantize_rows(x, recipe, fp8)
    assert torch.equal(_cpu(q).view(torch.uint8), q0.view(torch.uint8)) and torch.equal(_cpu(s), s0)
    offs = torch.tensor([0, 5, 5, 300, 333])
    q, s = Q.quantize_tokens(x.cuda(), offs.cuda(), recipe, fp8)
    q0, s0 = Q.quantize_tokens(x, offs, recipe, fp8)
    used = Q.token_slot_mask(offs, 333, recipe.block)
    assert torch.equal(_cpu(q).view(torch.uint8), q0.view(torch.uint8)) and torch.equal(_cpu(s)[:, used], s0[:, used])
    # the aligned token layout (the wgrad's on a GPU): the padding written as zeros over memory the
    # caching allocator hands back full of NaN bytes
    junk = torch.full((1000, Q.aligned_token_columns(333, 4, 16)), 0x7F, dtype=torch.uint8, device="cuda")
    del junk
    q, s, aligned = Q.quantize_tokens_aligned(x.cuda(), offs.cuda(), recipe, fp8)
    q0, s0, aligned0 = Q.quantize_tokens_aligned(x, offs, recipe, fp8)
    end = int(aligned0[-1])
    assert torch.equal(_cpu(aligned), aligned0) and aligned0.tolist() == [0, 16, 16, 320, 368]
    assert torch.equal(_cpu(q)[:, :end].view(torch.uint8), q0[:, :end].view(torch.uint8))
    used = Q.token_slot_mask(aligned0, end, recipe.block)
    assert torch.equal(_cpu(s)[:, :used.numel()][:, used], s0[:, :used.numel()][:, used])
    # a skewed set: the hot group's blocks spread over several programs of the token cast
    # (blockwise_cast._token_splits: 4 here), both layouts
    xs = torch.randn(1500, 200, generator=gen) * 10 ** (4 * torch.rand(1500, 1, generator=gen))
    offs = torch.tensor([0, 1300, 1301, 1301, 1500])
    q, s = Q.quantize_tokens(xs.cuda(), offs.cuda(), recipe, fp8)
    q0, s0 = Q.quantize_tokens(xs, offs, recipe, fp8)
    used = Q.token_slot_mask(offs, 1500, recipe.block)
    assert torch.equal(_cpu(q).view(torch.uint8), q0.view(torch.uint8)) and torch.equal(_cpu(s)[:, used], s0[:, used])
    q, s, aligned = Q.quantize_tokens_aligned(xs.cuda(), offs.cuda(), recipe, fp8)
    q0, s0, aligned0 = Q.quantize_tokens_aligned(xs, offs, recipe, fp8)
    end = int(aligned0[-1])
    assert torch.equal(_cpu(aligned), aligned0)
    assert torch.equal(_cpu(q)[:, :end].view(torch.uint8), q0[:, :end].view(torch.uint8))
    used = Q.token_slot_mask(aligned0, end, recipe.block)
    assert torch.equal(_cpu(s)[:, :used.numel()][:, used], s0[:, :used.numel()][:, used])
    if not recipe.e8m0 and fp8 == E4M3:
        w = torch.randn(3, 300, 260, generator=gen)
        got = Q.quantize_weight_blocks(w.cuda(), recipe, fp8)
        ref = Q.quantize_weight_blocks(w, recipe, fp8)
        for a, b in zip(got, ref):
            assert torch.equal(_cpu(a).view(torch.uint8) if a.dtype == fp8 else _cpu(a), b.view(torch.uint8) if b.dtype == fp8 else b)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("dot_scaled", [False, True])
@pytest.mark.parametrize("lens", [[0, 300, 1, 0, 129, 512], [1000]])
def test_gemms_match_block_scaled_reference(name, dot_scaled, lens, monkeypatch):
    recipe = RECIPES[name]
    if dot_scaled and not recipe.e8m0:
        pytest.skip("dot_scaled is the MXFP8 path")
    monkeypatch.setenv("TURBO_MOE_MX_DOT_SCALED", "1" if dot_scaled else "0")
    from fine_grained_interpreter_cases import _problem

    gen = torch.Generator().manual_seed(1)
    for kind, n, k in (("m", 700, 1000), ("k", 300, 260)):
        problem = _problem(kind, recipe, lens, n, k, E4M3, gen)
        ref, mag = _reference_and_magnitudes(problem)
        on_gpu = _on_gpu(problem)
        cfg = triton_gemm.default_config(on_gpu)
        out = torch.full(problem.out_shape, float("nan"), device="cuda")
        out = triton_gemm.run(dataclasses.replace(on_gpu, out=out), cfg).cpu().double()
        _assert_within_reference_bound(problem, out, ref, mag, k if kind == "m" else max(lens))


def _reference_and_magnitudes(problem):
    ref = reference_block_scaled_gemm(problem, torch.float64)
    mag = reference_block_scaled_gemm(dataclasses.replace(problem, a=problem.a.float().abs(),
                                                          b=problem.b.float().abs()), torch.float64)
    return ref, mag


def _assert_within_reference_bound(problem, out, ref, mag, contraction, out_roundoff=2.0**-24):
    """|out - ref64| within fp32 summation of exact FP8 products plus, on Hopper, one scale block of
    the tensor cores' narrower FP8 accumulation; ``out_roundoff``: the output's (bf16: 2**-8)."""
    block = problem.recipe.block
    tol = (128 + contraction // 32 + 3) * 2.0**-24 * 1.2 * mag + ref.abs() * out_roundoff
    if torch.cuda.get_device_capability()[0] == 9:
        # Hopper's FP8 wgmma adds into a narrower accumulator (about 14 mantissa bits, DeepSeek-V3
        # section 3.3.2) and Triton leaves that on for FP8 dots on sm_90; promotion to fp32 happens
        # once per K block, as DeepGEMM does. So each block's partial sum may be off by ~2**-14
        # per addition: at most one block of additions, relative to the magnitudes summed.
        tol = tol + min(block if block > 32 else 128, contraction) * 2.0**-14 * mag
    err = (out - ref).abs()
    assert not torch.isnan(out).any() and (err <= tol).all(), (
        problem.kind, float(err.max()), "worst relative to the summed magnitudes",
        float((err / mag.clamp_min(1e-30)).max()))


@pytest.mark.parametrize("name", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("kind,lens", [("m", [0, 300, 1, 0, 129, 512]), ("m", [1000]),
                                       ("k", [16, 0, 300, 4, 0, 128, 512]), ("k", [1024])])
def test_tma_kernel_bitwise_equal_pointer_kernel(name, kind, lens, monkeypatch):
    """The TMA kernels against the pointer kernels on the same problem and tiles: the same wgmma
    sums and promotions, so the same bits. M-grouped: K = 1040 (a multiple of 16 bytes, not of
    128: the copy engine zero-fills the last block), N = 700 (the next group's rows fill the last
    column tile). K-grouped: 960 tokens, groups starting on 16-token boundaries (full and short
    last blocks: the same bits) and one off it (offset 316: its blocks summed from 32-token boxes,
    another wgmma order, so held to the float64 reference's bound instead). MXFP8 takes the TMA
    kernels only when a config asks (its default is pointers): checked the same way."""
    monkeypatch.setenv("TURBO_MOE_MX_DOT_SCALED", "0")
    from fine_grained_interpreter_cases import _problem

    n, k = (700, 1040) if kind == "m" else (300, 260)
    problem = _problem(kind, RECIPES[name], lens, n, k, E4M3, torch.Generator().manual_seed(3))
    on_gpu = _on_gpu(problem)
    # MXFP8's default: pointers; the Gluon kernel has its own test below.
    cfg = dataclasses.replace(triton_gemm.default_config(on_gpu), tma=True, gluon=False)
    assert not triton_gemm.tma_declined(on_gpu, cfg)
    outs = []
    for tma in (True, False):
        out = torch.full(problem.out_shape, float("nan"), device="cuda")
        outs.append(triton_gemm.run(dataclasses.replace(on_gpu, out=out), dataclasses.replace(cfg, tma=tma)))
    assert not torch.isnan(outs[0]).any()
    offs = problem.group_offs.tolist()
    aligned = [g for g in range(len(lens)) if kind == "m" or offs[g] % 16 == 0]
    assert torch.equal(outs[0][aligned] if kind == "k" else outs[0], outs[1][aligned] if kind == "k" else outs[1])
    if kind == "k":
        ref, mag = _reference_and_magnitudes(problem)
        _assert_within_reference_bound(problem, outs[0].cpu().double(), ref, mag, max(lens))


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_autograd_triton_matches_torch_backend_and_captures(granularity):
    cfg = Float8Config(granularity=granularity)
    gen = torch.Generator().manual_seed(2)
    lens = torch.tensor([300, 0, 700, 24])
    x = torch.randn(1024, 512, generator=gen).cuda().bfloat16().requires_grad_()
    w = (torch.randn(4, 768, 512, generator=gen) / 20).cuda().bfloat16().requires_grad_()
    dy = torch.randn(1024, 768, generator=gen).cuda().bfloat16()
    grads = {}
    for backend in ("triton", "torch"):
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = grouped_gemm_fp8(xx, ww, lens.cuda(), config=cfg, backend=backend)
        y.backward(dy)
        grads[backend] = (y.float(), xx.grad.float(), ww.grad.float())
    for a, b in zip(grads["triton"], grads["torch"]):
        assert ((a - b).norm() / b.norm()) < 1e-2  # same FP8 operands; fp32 sum order and bf16 output differ
    # fwd + bwd under CUDA graph capture (kernels read offsets on the device only)
    xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    offs_dev = lens.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_gemm_fp8(xx, ww, offs_dev, config=cfg, backend="triton").backward(dy)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    xx.grad = ww.grad = None
    with torch.cuda.graph(graph):
        y = grouped_gemm_fp8(xx, ww, offs_dev, config=cfg, backend="triton")
        y.backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y.float(), grads["triton"][0]) and torch.allclose(ww.grad.float(), grads["triton"][2])


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("f", [384, 208])
def test_fused_swiglu_fc2_on_the_gpu(granularity, f):
    """fc2 with the weighted SwiGLU fused into its rows cast (turbo_moe.fine_grained.swiglu) on the
    GPU: ``a`` within an ulp of torch's bf16 rounding of ``weighted_swiglu`` (rarely off: both round
    to nearest even), its rows copy bit for bit ``quantize_rows(a)``, y and dW2 bit for bit
    ``grouped_gemm_fp8`` on that ``a``; dh and dprobs (one backward kernel) within FP8's bounds of
    float64; F = 208: a short last block; ragged groups, empty ones."""
    from turbo_moe.autograd import grouped_wgrad_fp8
    from turbo_moe.swiglu import grouped_gemm_fp8_swiglu, weighted_swiglu

    cfg = Float8Config(granularity=granularity)
    recipe = Q.recipe_of(cfg)
    gen = torch.Generator().manual_seed(5)
    lens = [300, 0, 700, 24, 0]
    m = sum(lens)
    offs = torch.tensor([0] + lens).cumsum(0).cuda()
    h = (torch.randn(m, 2 * f, generator=gen) * 2).cuda().bfloat16()
    p = torch.rand(m, generator=gen).cuda()
    w = (torch.randn(len(lens), 256, f, generator=gen) / f ** 0.5).cuda().bfloat16()
    dy = torch.randn(m, 256, generator=gen).cuda().bfloat16()
    a, a_q, a_s = Q.quantize_swiglu_rows(h, p, recipe, E4M3)
    ref = weighted_swiglu(h, p).to(torch.bfloat16).float()
    err = (a.float() - ref).abs()
    assert (err <= 1.01 * torch.finfo(torch.bfloat16).eps * ref.abs()).all() and (err > 0).float().mean() < 0.02
    q0, s0 = Q.quantize_rows(a, recipe, E4M3)
    assert torch.equal(a_q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(a_s, s0)
    hh, pp, ww = (t.detach().clone().requires_grad_() for t in (h, p, w))
    y = grouped_gemm_fp8_swiglu(hh, pp, ww, offs, config=cfg)
    assert torch.equal(y, grouped_gemm_fp8(a, w, group_offs=offs, config=cfg))
    y.backward(dy)
    assert torch.equal(ww.grad, grouped_wgrad_fp8(dy, a, offs, config=cfg, out_dtype=w.dtype))
    assert all(torch.count_nonzero(ww.grad[e]) == 0 for e, n in enumerate(lens) if n == 0)
    hd, pd, wd = (t.detach().double().requires_grad_() for t in (h, p, w))
    gate, lin = hd[:, :f], hd[:, f:]
    ad = gate * torch.sigmoid(gate) * lin * pd[:, None]
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    torch.cat([ad[lo:hi] @ wd[e].T for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]).backward(dy.double())
    for got, want in ((hh.grad, hd.grad), (pp.grad, pd.grad), (ww.grad, wd.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 0.06  # e4m3 operands, bf16 dh


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_fused_swiglu_dh_rows_handoff_on_the_gpu(granularity):
    """fc2's backward kernel writes dh's rows copy for fc1's dgrad (GradRowsHandoff,
    ``swiglu_backward_block_rows``): dx, dW1 and dW2 bit for bit the run without the handoff (dh
    the same kernel math, the copy ``block_cast_rows(dh)``'s bits). dprobs is each row's float32
    sum in the same order, but the H100 showed it 1 ulp apart on a third of the rows (the two
    kernels compile the float32 products differently; dh, rounded to bf16, hides that): it is
    held to float32 rounding of its magnitude."""
    from turbo_moe.autograd import _grouped_gemm_fp8_resolved
    from turbo_moe.fine_grained.autograd import GradRowsHandoff
    from turbo_moe.swiglu import grouped_gemm_fp8_swiglu

    cfg = Float8Config(granularity=granularity)
    gen = torch.Generator().manual_seed(6)
    lens, k, f, n = [300, 0, 700, 24], 512, 384, 256
    offs = torch.tensor([0] + lens).cumsum(0).cuda()
    x0 = (torch.randn(sum(lens), k, generator=gen) * 2).cuda().bfloat16()
    w10 = (torch.randn(len(lens), 2 * f, k, generator=gen) / k ** 0.5).cuda().bfloat16()
    w20 = (torch.randn(len(lens), n, f, generator=gen) / f ** 0.5).cuda().bfloat16()
    p0 = torch.rand(sum(lens), generator=gen).cuda()
    dy = torch.randn(sum(lens), n, generator=gen).cuda().bfloat16()
    grads = []
    for handoff in (None, GradRowsHandoff()):
        x, w1, w2, p = (t.clone().requires_grad_() for t in (x0, w10, w20, p0))
        h = _grouped_gemm_fp8_resolved(x, w1, offs, config=cfg, grad_handoff=handoff)
        grouped_gemm_fp8_swiglu(h, p, w2, offs, config=cfg, h_grad_handoff=handoff).backward(dy)
        grads.append((x.grad, p.grad, w1.grad, w2.grad))
        assert handoff is None or (handoff.expecting is not None and handoff._held is None)
    for name, a, b in zip(("dx", "dprobs", "dW1", "dW2"), *grads):
        if name == "dprobs":
            assert float((a - b).abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(b.abs().max()), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("cooperative", [True, False], ids=["cooperative", "single-stream"])
@pytest.mark.parametrize("out", ["fp32", "bf16", "main_grad"])
@pytest.mark.parametrize("lens", [[16, 0, 300, 4, 0, 128, 512], [1024], [0, 131, 77, 1, 0, 259, 0, 60, 0]])
def test_gluon_blockwise_wgrad_bitwise_equal_tma_kernel(lens, out, cooperative):
    """The Gluon K-grouped blockwise kernels (sm_90) against the Triton TMA kernel on the same tiles:
    groups on and off 16-token boundaries (off: each block as five 32-token slices, two ring
    entries), short last blocks, empty groups (first, middle, last), one token: the same slices
    and promotions, so the same bits; an fp32 main_grad accumulated into the same way. The
    cooperative kernel (two consumer warpgroups zeroing their halves of a masked box, the scales
    through the ring) writes bf16 or adds into main_grad; a plain float32 output takes the
    single-stream one."""
    from fine_grained_interpreter_cases import _problem

    accumulate = out == "main_grad"
    problem = _problem("k", RECIPES["blockwise"], lens, 256, 264, E5M2, torch.Generator().manual_seed(5),
                       accumulate=accumulate)
    if out == "bf16":
        problem = dataclasses.replace(problem, out_dtype=torch.bfloat16)
    on_gpu = _on_gpu(problem)
    cfg = dataclasses.replace(triton_gemm.default_config(on_gpu), cooperative=cooperative)
    if not cfg.gluon:
        pytest.skip(triton_gemm.gluon_declined(on_gpu, dataclasses.replace(cfg, gluon=True)))
    coop = cooperative and out != "fp32"
    assert bool(triton_gemm.coop_declined(on_gpu, cfg)) != coop, triton_gemm.coop_declined(on_gpu, cfg)
    kernel = triton_gemm.plan(on_gpu, cfg).kernel_name
    assert kernel == ("k_grouped_coop" if coop else "k_grouped_gluon"), kernel
    outs = _gluon_and_tma_outputs(on_gpu, cfg, lambda: problem.out.cuda() if accumulate else torch.full(
        problem.out_shape, float("nan"), device="cuda", dtype=problem.out_dtype))
    assert not torch.isnan(outs[0]).any()
    bits = torch.int16 if out == "bf16" else torch.int32
    same = outs[0].view(bits) == outs[1].view(bits)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the TMA kernel"
    if out == "fp32":
        ref, mag = _reference_and_magnitudes(problem)
        _assert_within_reference_bound(problem, outs[0].cpu().double(), ref, mag, max(lens))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[0, 131, 77, 1, 0, 259, 0, 60, 0], [5, 300, 1000, 3]])
def test_blockwise_wgrad_over_the_aligned_token_layout(lens, out_dtype):
    """Groups off 16-token boundaries as a GPU's autograd hands them to the wgrad
    (``quantize_tokens_for_wgrad``: moved onto boundaries, zeros after each): the default plan
    (the cooperative Gluon kernel for a bf16 dW) within the float64 bound of the same problem,
    every element written over NaN poison, deterministic."""
    from fine_grained_interpreter_cases import _problem

    problem = dataclasses.replace(_problem("k", RECIPES["blockwise"], lens, 256, 264, E5M2,
                                           torch.Generator().manual_seed(6), aligned=True), out_dtype=out_dtype)
    assert all(int(v) % 16 == 0 for v in problem.group_offs)
    on_gpu = _on_gpu(problem)
    cfg = triton_gemm.default_config(on_gpu)
    if cfg.gluon and out_dtype == torch.bfloat16:
        assert triton_gemm.plan(on_gpu, cfg).kernel_name == "k_grouped_coop"
    outs = [triton_gemm.run(dataclasses.replace(on_gpu, out=torch.full(problem.out_shape, float("nan"), device="cuda",
                                                                       dtype=out_dtype)), cfg) for _ in range(2)]
    assert torch.equal(outs[0], outs[1]) and not torch.isnan(outs[0]).any()
    ref, mag = _reference_and_magnitudes(problem)
    got = outs[0].cpu().double()
    _assert_within_reference_bound(problem, got, ref, mag, max(lens),
                                   2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-24)


@pytest.mark.parametrize("a_fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["blockwise", "pow2"])
@pytest.mark.parametrize("lens", [[0, 300, 2, 0, 130, 512], [1000], [0, 300, 1, 0, 129, 512], [64, 0, 65, 191, 0, 1],
                                  [1]])
def test_gluon_blockwise_m_grouped_bitwise_equal_tma_kernel(lens, name, out_dtype, a_fp8):
    """The M-grouped Gluon blockwise kernel (fwd and dgrad on sm_90: two cooperative consumers, the
    row scales brought by TMA) against the Triton TMA kernel on the same problem: the same blocks'
    wgmma sums promoted as ``acc += block * (sa * sb)`` in the same order, so the same bits. Groups
    empty (first, middle, last), of one row, ending inside either consumer's half of a tile, and the
    last rows past a 128-row boundary (the scales' box past the last row reads zeros); the row scales
    by TMA (944 and 1000 rows: a column stride of whole 16 bytes; groups starting on a multiple of 4
    rows) and by the producer's cp.async (groups starting off it; 942, 321 and 1 rows); N = 712 and
    K = 1040, multiples of neither 128 (the next group's weight rows fill the last column tile, the
    copy engine zero-fills the last block); e4m3 or e5m2 activations (the hybrid format's dgrad);
    NaN-poisoned outputs, and the float64 reference's bound."""
    from fine_grained_interpreter_cases import _problem

    problem = _problem("m", RECIPES[name], lens, 712, 1040, a_fp8, torch.Generator().manual_seed(7))
    problem = dataclasses.replace(problem, out_dtype=out_dtype)
    on_gpu = _on_gpu(problem)
    cfg = triton_gemm.default_config(on_gpu)
    if not cfg.gluon:
        pytest.skip(triton_gemm.gluon_declined(on_gpu, dataclasses.replace(cfg, gluon=True)))
    outs = _gluon_and_tma_outputs(on_gpu, cfg, lambda: torch.full(problem.out_shape, float("nan"), device="cuda",
                                                                 dtype=out_dtype))
    assert not torch.isnan(outs[0]).any()
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    same = outs[0].view(bits) == outs[1].view(bits)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the TMA kernel"
    if out_dtype == torch.float32:
        ref, mag = _reference_and_magnitudes(problem)
        _assert_within_reference_bound(problem, outs[0].cpu().double(), ref, mag, 1040)


def test_gluon_blockwise_m_grouped_declines_what_it_cannot_take():
    """Where the M-grouped Gluon kernel cannot run, the plan says why and the TMA kernel runs: the
    activation scales not block-major, an output row not a multiple of 16 bytes."""
    from fine_grained_interpreter_cases import _problem

    problem = _problem("m", RECIPES["blockwise"], [300, 0, 200], 712, 1040, E4M3, torch.Generator().manual_seed(8))
    on_gpu = _on_gpu(problem)
    cfg = dataclasses.replace(triton_gemm.default_config(on_gpu), gluon=True)
    if triton_gemm.gluon_declined(on_gpu, cfg):
        pytest.skip(triton_gemm.gluon_declined(on_gpu, cfg))
    row_major = dataclasses.replace(on_gpu, a_scale=on_gpu.a_scale.contiguous())
    assert "block-major" in triton_gemm.gluon_declined(row_major, cfg)
    odd = torch.empty(500, 712, dtype=torch.bfloat16, device="cuda")[:, :700]
    odd_problem = _problem("m", RECIPES["blockwise"], [300, 0, 200], 700, 1040, E4M3, torch.Generator().manual_seed(8))
    odd_problem = dataclasses.replace(odd_problem, out_dtype=torch.bfloat16)
    odd_gpu = _on_gpu(odd_problem)
    assert "16-byte" in triton_gemm.gluon_declined(odd_gpu, cfg, odd)
    outs = [triton_gemm.run(dataclasses.replace(row_major, out=torch.full(on_gpu.out_shape, float("nan"),
                                                                          device="cuda")), cfg),
            triton_gemm.run(dataclasses.replace(on_gpu, out=torch.full(on_gpu.out_shape, float("nan"), device="cuda")),
                            dataclasses.replace(cfg, gluon=False))]
    assert torch.equal(outs[0], outs[1])
