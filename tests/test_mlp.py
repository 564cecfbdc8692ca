"""``GroupedSwiGLUMLPFP8``: the expert MLP module (turbo_moe/mlp.py) on the torch backend.

Per-tensor recipes take the fused path (fc1, then the SwiGLU inside fc2's FP8 quantization, dh
handed to fc1 in FP8); it must give the bits of the same chain built from the public pieces in
float32 (where dh is float32 either way), and agree with float64 to FP8 rounding in bf16. Other
recipes run the unfused chain. Bad input names its argument.
"""

import pytest
import torch

import turbo_moe
from turbo_moe import Float8Config, GroupedSwiGLUMLPFP8
from turbo_moe.autograd import grouped_gemm_fp8
from turbo_moe.swiglu import grouped_gemm_fp8_swiglu, weighted_swiglu

LENS = [9, 0, 14, 5]


def _inputs(hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(LENS)
    x = torch.randn(m, hidden, generator=gen).to(dtype).requires_grad_()
    probs = (torch.rand(m, generator=gen) * 0.9 + 0.1).requires_grad_()
    dy = torch.randn(m, hidden, generator=gen).to(dtype)
    return x, probs, dy, torch.tensor(LENS)


def _grads(y, dy, *tensors):
    y.backward(dy)
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("cache", [True, False])
def test_fused_module_equals_the_chain_of_public_pieces(cache):
    mlp = GroupedSwiGLUMLPFP8(4, 24, 20, backend="torch", cache_fp8_weight=cache)
    assert "fused_swiglu=True" in repr(mlp)
    x, probs, dy, lens = _inputs(24, torch.float32)
    ours = _grads(mlp(x, lens, probs=probs), dy, x, probs, mlp.fc1.weight, mlp.fc2.weight)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    w1, w2 = mlp.fc1.weight.detach().clone().requires_grad_(), mlp.fc2.weight.detach().clone().requires_grad_()
    h = grouped_gemm_fp8(xr, w1, lens, backend="torch")
    offs = torch.tensor([0] + LENS).cumsum(0)
    reference = _grads(grouped_gemm_fp8_swiglu(h, pr, w2, offs, backend="torch"), dy, xr, pr, w1, w2)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


def test_fused_module_matches_float64_in_bf16():
    mlp = GroupedSwiGLUMLPFP8(4, 32, 24, backend="torch", dtype=torch.bfloat16)
    x, probs, dy, lens = _inputs(32, torch.bfloat16, seed=1)
    y = mlp(x, lens, probs=probs.unsqueeze(1))
    ours = _grads(y, dy, x, probs, mlp.fc1.weight, mlp.fc2.weight)
    leaves = [t.detach().double().requires_grad_() for t in (x, probs, mlp.fc1.weight, mlp.fc2.weight)]
    xd, pd, w1, w2 = leaves
    bounds = [0] + torch.tensor(LENS).cumsum(0).tolist()
    out = []
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        g, u = (xd[lo:hi] @ w1[e].T).chunk(2, dim=1)
        out.append((torch.nn.functional.silu(g) * u * pd[lo:hi, None]) @ w2[e].T)
    y64 = torch.cat(out)
    y64.backward(dy.double())

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    # Two chained FP8 GEMMs: four operands rounded to e4m3 (x, W1, the activation, W2), where
    # test_swiglu_fp8 bounds one GEMM (two operands) by 0.06: sqrt(2) times that for y (seen:
    # 0.06-0.067). Gradients: e5m2 (2 mantissa bits) bounded by 0.12 as there (seen: ~0.06).
    assert rel(y.detach(), y64.detach()) < 0.085
    for name, got, ref in zip("x probs w1 w2".split(), ours, [t.grad for t in leaves]):
        assert rel(got, ref) < 0.12, name
    assert torch.count_nonzero(mlp.fc1.weight.grad[1]) == 0 and torch.count_nonzero(mlp.fc2.weight.grad[1]) == 0


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_fine_grained_recipes_fuse_the_activation_without_handoff(granularity):
    """The fine-grained recipes: fc2 takes fc1's output (turbo_moe.fine_grained.swiglu) and y is bit
    for bit the plain chain's (the activation rounded to h's dtype, then grouped_gemm_fp8), as is
    dW2 (from the same token copy); dh comes from the fused backward's float32 math, not autograd
    through weighted_swiglu, so dprobs matches to float32 rounding and x, W1's gradients (dh
    quantized again by fc1) to FP8's."""
    cfg = Float8Config(granularity=granularity)
    mlp = GroupedSwiGLUMLPFP8(4, 24, 20, config=cfg, backend="torch")
    assert "fused_swiglu=True" in repr(mlp)
    x, probs, dy, lens = _inputs(24, torch.float32, seed=2)
    y = mlp(x, lens, probs=probs)
    ours = _grads(y, dy, x, probs, mlp.fc1.weight, mlp.fc2.weight)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    w1, w2 = mlp.fc1.weight.detach().clone().requires_grad_(), mlp.fc2.weight.detach().clone().requires_grad_()
    h = grouped_gemm_fp8(xr, w1, lens, config=cfg, backend="torch")
    y_plain = grouped_gemm_fp8(weighted_swiglu(h, pr).to(h.dtype), w2, lens, config=cfg, backend="torch")
    assert torch.equal(y, y_plain)
    dx, dprobs, dw1, dw2 = ours
    ref_dx, ref_dprobs, ref_dw1, ref_dw2 = _grads(y_plain, dy, xr, pr, w1, w2)
    assert torch.equal(dw2, ref_dw2)
    assert torch.allclose(dprobs, ref_dprobs, rtol=1e-5, atol=1e-6)
    # dh differs from autograd's in float32 ulps (seen: 3e-8 relative in dx, dW1); where one flips
    # an FP8 rounding in fc1's casts, that element moves by one e4m3 step: a few stay < 0.5%
    for got, ref in ((dx, ref_dx), (dw1, ref_dw1)):
        assert float((got - ref).norm() / ref.norm()) < 5e-3


def test_unweighted_and_bad_input():
    mlp = GroupedSwiGLUMLPFP8(4, 24, 20, backend="torch")
    x, _, _, lens = _inputs(24, torch.float32, seed=3)
    ones = torch.ones(x.shape[0])
    assert torch.equal(mlp(x, lens), mlp(x, lens, probs=ones))
    with pytest.raises(ValueError, match="probs must be"):
        mlp(x, lens, probs=ones[:-1])
    with pytest.raises(ValueError, match="probs must be"):
        GroupedSwiGLUMLPFP8(4, 24, 20, config=Float8Config(granularity="rowwise"), backend="torch")(x, lens,
                                                                                                    probs=ones[:-1])
    with pytest.raises(ValueError, match="x"):
        mlp(x[:, :-1], lens)
    with pytest.raises(TypeError, match="x"):  # checked before the unweighted call's ones are made
        mlp(x.tolist(), lens)
    with pytest.raises(ValueError, match="group_lens"):
        mlp(x, torch.tensor([9, 0, 14]))
    assert turbo_moe.GroupedSwiGLUMLPFP8 is GroupedSwiGLUMLPFP8


@pytest.mark.gpu
def test_module_on_gpu_matches_the_chain():
    """On a GPU (Triton): the module's outputs and gradients equal the chain of public pieces run
    on the same weights (the same kernels and FP8 copies; the module's weight cache gives the
    same bits as quantizing in the call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    lens = torch.tensor([700, 0, 1, 2048, 333, 64], device="cuda")
    mlp = GroupedSwiGLUMLPFP8(6, 256, 384, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    m = int(lens.sum())
    x = torch.randn(m, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(m, device="cuda", generator=gen).requires_grad_()
    dy = torch.randn(m, 256, device="cuda", generator=gen).bfloat16()
    ours = _grads(mlp(x, lens, probs=probs), dy, x, probs, mlp.fc1.weight, mlp.fc2.weight)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    w1, w2 = mlp.fc1.weight.detach().clone().requires_grad_(), mlp.fc2.weight.detach().clone().requires_grad_()
    offs = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    h = grouped_gemm_fp8(xr, w1, lens)
    reference = _grads(grouped_gemm_fp8_swiglu(h, pr, w2, offs), dy, xr, pr, w1, w2)
    for name, a, b in zip("x probs w1 w2".split(), ours, reference):
        # the reference quantizes dh from bf16 (no handoff between separate calls): FP8 rounding
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 0.15, name


def test_forward_amax_handoff_is_for_its_h_as_it_was():
    """fc1's epilogue amax reaches fc2's cast only for the same, unchanged ``h``, and only once."""
    from turbo_moe.autograd import QuantizedGradHandoff

    handoff = QuantizedGradHandoff(swiglu_probs=torch.rand(4))
    h, amax = torch.randn(4, 8), torch.tensor([3.0, 1.0])
    handoff.note_forward_amax(h, amax)
    assert handoff.forward_amax(h) is amax
    assert handoff.forward_amax(h) is None  # taken
    handoff.note_forward_amax(h, amax)
    assert handoff.forward_amax(h.clone()) is None  # another tensor
    handoff.note_forward_amax(h, amax)
    h.add_(1.0)
    assert handoff.forward_amax(h) is None  # changed in place since


@pytest.mark.parametrize("granularity,delayed,given", [("tensorwise", False, True), ("rowwise", False, False),
                                                        ("tensorwise", True, False)])
def test_mlp_hands_fc1_amax_to_the_swiglu_cast(monkeypatch, granularity, delayed, given):
    """The MLP gives fc1 the routing weights; a tensorwise current-scaling fc1 whose GEMM reduced the
    SwiGLU amax (faked here: the ping-pong runs on sm_90 only) hands the partials to fc2's cast,
    with the same outputs; rowwise and delayed scaling never ask for them."""
    from turbo_moe import autograd, swiglu

    made, seen = [], []
    real_fc1, real_quantize = autograd._fc1_with_swiglu_amax, swiglu.quantize_weighted_swiglu

    def fake_fc1(x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu, backend, config, probs):
        h, _ = real_fc1(x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu, backend, config, probs)
        made.append(torch.stack([weighted_swiglu(h, probs).abs().max(), torch.tensor(0.0)]))
        return h, made[-1]

    def spy(*args, amax_partials=None, **kwargs):
        seen.append(amax_partials)
        return real_quantize(*args, **kwargs)

    monkeypatch.setattr(autograd, "_fc1_with_swiglu_amax", fake_fc1)
    monkeypatch.setattr(swiglu, "quantize_weighted_swiglu", spy)
    config = Float8Config(granularity=granularity, **({"strategy": "delayed"} if delayed else {}))
    mlp = GroupedSwiGLUMLPFP8(4, 24, 20, backend="torch", config=config)
    x, probs, dy, lens = _inputs(24, torch.float32)
    y = mlp(x, lens, probs=probs)
    monkeypatch.undo()
    plain = GroupedSwiGLUMLPFP8(4, 24, 20, backend="torch", config=config)
    plain.load_state_dict(mlp.state_dict())
    assert torch.equal(y, plain(x, lens, probs=probs))
    if given:
        assert len(made) == 1 and len(seen) == 1 and seen[0] is made[0]
    else:
        assert made == [] and all(s is None for s in seen)
