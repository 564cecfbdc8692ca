"""The weighted SwiGLU fused into fc2's FP8 quantization (turbo_moe.swiglu, kernels/triton/swiglu_fp8.py).

* The kernels (interpreted on the CPU, compiled on a GPU) against float64 math: the scale, both FP8
  layouts (the transposed copy bit-identical to the rows copy), ``dh`` and ``dprobs``. The
  activation is transcendental, so the FP8 values are checked against round-to-nearest error
  bounds, not bits (test_fp8_cast checks the cast's bits); under the interpreter, values its
  float->fp8 conversion rounds one binade low (test_fp8_cast's docstring) are left out.
* The autograd Function against ``grouped_gemm_fp8`` on the materialized float32 activation (the
  same FP8 operands, so the same bits) and against a float64 reference of the whole chain.
* Bad input names its argument.
"""

import textwrap

import pytest
import torch

from interpreter_child import assert_prints_ok, run_on_gpu
from turbo_moe import Float8Config
from turbo_moe.autograd import grouped_gemm_fp8_with_offs, grouped_wgrad_fp8
from turbo_moe.config import ScalingGranularity
from turbo_moe.swiglu import fuses_swiglu, grouped_gemm_fp8_swiglu, weighted_swiglu

KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.swiglu_fp8 import swiglu_fp8_tensorwise, swiglu_backward
    from turbo_moe.config import fp8_max
    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    FP8_BITS = {torch.float8_e4m3fn: (3, -9), torch.float8_e5m2: (2, -16)}  # mantissa bits, log2 of the smallest subnormal

    def reference(h, p):
        g, u = h.double().chunk(2, dim=1)
        return torch.nn.functional.silu(g) * u * p.double()[:, None]

    # (rows, F): ragged sizes off every tile (64-square cast tiles, 16 x 128 amax tiles, 8 x 128
    # backward tiles), one element, no rows, and enough rows for several amax programs.
    cases = [((37, 70), torch.float32), ((130, 80), torch.bfloat16), ((1, 1), torch.float16), ((0, 5), torch.bfloat16),
             ((300, 96), torch.bfloat16), ((65, 129), torch.float32), ((2100, 24), torch.bfloat16)]
    for (m, f), dtype in cases:
        wide = torch.randn(m, 2 * f + 6, generator=gen) * 3
        h = wide[:, 3:3 + 2 * f].to(dtype).to(device)  # a row stride that is not 2F: a column slice
        if dtype != torch.float32:
            h = wide.to(dtype).to(device)[:, 3:3 + 2 * f]
        p = torch.rand(m, generator=gen).to(device)
        a = reference(h.cpu(), p.cpu())
        amax = a.abs().max().item() if a.numel() else 0.0
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            mbits, sub = FP8_BITS[fp8]
            rows, trans, dequant = swiglu_fp8_tensorwise(h, p, fp8, fp8_max(fp8), 0, True, True)
            assert rows.shape == (m, f) and trans.shape == (f, m) and rows.is_contiguous() and trans.is_contiguous()
            if not a.numel():
                assert dequant.item() == 1.0
                continue
            want = amax / fp8_max(fp8)
            assert abs(dequant.item() - want) <= 1e-5 * want, (m, f, dtype, fp8, dequant.item(), want)
            assert torch.equal(trans.cpu().view(torch.uint8), rows.cpu().t().contiguous().view(torch.uint8))
            deq = rows.cpu().double() * dequant.item()
            # round to nearest: half an FP8 ulp of |a|, or half the smallest subnormal step
            bound = torch.maximum(a.abs() * 2.0 ** -(mbits + 1), torch.full_like(a, 2.0 ** (sub - 1) * dequant.item()))
            err = (deq - a).abs()
            ok = err <= bound * 1.0001 + 1e-30
            if EXACT:  # the interpreter's float->fp8 conversion (module docstring of test_fp8_cast): values
                # that round up onto a power of two come out one binade low, and subnormals are
                # truncated (off by up to one step); torch's conversion is right
                scaled = (a / dequant.item()).float()
                up = scaled.clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8).double()
                carry = (up.abs() > scaled.abs()) & (torch.frexp(up)[0].abs() == 0.5)
                ok = ok | carry | (err <= 2.0 ** sub * dequant.item() * 1.0001)
            assert ok.all(), (m, f, dtype, fp8, (err / bound).max().item())
            only_t = swiglu_fp8_tensorwise(h, p, fp8, fp8_max(fp8), 0, False, True)
            assert only_t[0] is None and torch.equal(only_t[1].cpu().view(torch.uint8), trans.cpu().view(torch.uint8))
        # backward: dh in h's dtype, dprobs in float32 summed per row
        da = (torch.randn(m, f, generator=gen)).to(dtype).to(device)
        dh, dp = swiglu_backward(h, p, da, torch.float32)
        hd = h.cpu().double().requires_grad_()
        pd = p.cpu().double().requires_grad_()
        g, u = hd.chunk(2, dim=1)
        (torch.nn.functional.silu(g) * u * pd[:, None]).backward(da.cpu().double())
        eps = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
        if EXACT and dtype != torch.float32:
            eps *= 2  # the interpreter truncates float32 -> bf16/fp16 (one ulp); the GPU rounds to nearest
        assert dh.dtype == dtype and dh.shape == (m, 2 * f)
        assert torch.allclose(dh.cpu().double(), hd.grad, rtol=eps, atol=1e-6 * (hd.grad.abs().amax().item() if m else 0) + 1e-30), (m, f, dtype)
        scale = (da.cpu().double().abs() * g.detach().abs() * u.detach().abs()).sum(1) + 1e-30
        assert ((dp.cpu().double() - pd.grad).abs() <= 1e-5 * scale).all(), (m, f, dtype)
    if not EXACT:  # a NaN anywhere makes every element NaN (tensorwise), as turbo_moe.quantize does
        h = torch.randn(300, 64, device=device)
        h[250, 3] = float("nan")
        rows, trans, dequant = swiglu_fp8_tensorwise(h, torch.rand(300, device=device), torch.float8_e4m3fn, 448.0, 0, True, True)
        assert torch.isnan(dequant) and torch.isnan(rows.float()).all() and torch.isnan(trans.float()).all()
    print("ok")
    """
)


def test_swiglu_kernels_in_interpreter():
    assert_prints_ok(KERNEL_CHECK.replace("DEVICE", "'cpu'").replace("EXACT", "True"))


@pytest.mark.gpu
def test_swiglu_kernels_on_gpu():
    run_on_gpu(KERNEL_CHECK.replace("DEVICE", "'cuda'").replace("EXACT", "False"), "swiglu_check")


def _problem(lens, f, n, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(lens)
    h = (torch.randn(m, 2 * f, generator=gen) * 2).to(dtype).to(device)
    p = torch.rand(m, 1, generator=gen).to(device)
    w = (torch.randn(len(lens), n, f, generator=gen) / f ** 0.5).to(dtype).to(device)
    offs = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64, device=device)
    dy = torch.randn(m, n, generator=gen).to(dtype).to(device)
    return h, p, w, offs, dy


def _float64_grads(h, p, w, offs, dy):
    hd, pd, wd = (t.detach().double().requires_grad_() for t in (h, p, w))
    g, u = hd.chunk(2, dim=1)
    a = torch.nn.functional.silu(g) * u * pd
    bounds = offs.tolist()
    y = torch.cat([a[lo:hi] @ wd[e].T for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])
    y.backward(dy.double())
    return y.detach(), hd.grad, pd.grad, wd.grad


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ragged, an empty group first and in the middle, one group, many groups, sizes off every tile
CASES = [([10, 0, 23, 17], 24, 40), ([0, 37], 70, 33), ([64], 128, 96), ([3] * 16 + [0, 5], 16, 24)]


@pytest.mark.parametrize("lens,f,n", CASES)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fused_matches_unfused_bits_and_float64(lens, f, n, fmt):
    cfg = Float8Config(format=fmt)
    h, p, w, offs, dy = _problem(lens, f, n)
    h.requires_grad_(), p.requires_grad_(), w.requires_grad_()
    y = grouped_gemm_fp8_swiglu(h, p, w, offs, config=cfg)
    assert y.dtype == h.dtype and y.shape == (sum(lens), n)
    # the same FP8 operands as grouped_gemm_fp8 on the float32 activation: the same bits
    a = weighted_swiglu(h.detach(), p.detach().reshape(-1))
    assert torch.equal(y, grouped_gemm_fp8_with_offs(a, w.detach(), offs, config=cfg, out_dtype=h.dtype))
    y.backward(dy)
    assert torch.equal(w.grad, grouped_wgrad_fp8(dy, a, offs, config=cfg, out_dtype=w.dtype))
    assert p.grad.shape == p.shape and h.grad.shape == h.shape
    y64, dh64, dp64, dw64 = _float64_grads(h, p, w, offs, dy)
    # FP8: e4m3 keeps 3 mantissa bits (~3% relative per element), e5m2 (hybrid's grads) 2
    tol = 0.06 if fmt == "e4m3" else 0.12
    assert _rel(y, y64) < 0.06
    assert _rel(h.grad, dh64) < tol and _rel(p.grad, dp64) < tol and _rel(w.grad, dw64) < tol
    empty = [e for e, n_e in enumerate(lens) if n_e == 0]
    for e in empty:
        assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e]))


def test_fused_only_what_is_asked():
    cfg = Float8Config()
    h, p, w, offs, dy = _problem([5, 7], 16, 8)
    w.requires_grad_()
    y = grouped_gemm_fp8_swiglu(h, p, w, offs, config=cfg)
    y.backward(dy)  # h and probs need no gradient: only dW
    assert w.grad is not None and h.grad is None and p.grad is None
    h.requires_grad_()
    w.grad = None
    w.requires_grad_(False)
    grouped_gemm_fp8_swiglu(h, p, w, offs, config=cfg).backward(dy)
    assert h.grad is not None and w.grad is None


def test_fused_recipe_and_bad_input_errors():
    h, p, w, offs, _ = _problem([5, 7], 16, 8)
    assert fuses_swiglu(Float8Config()) and not fuses_swiglu(Float8Config(granularity=ScalingGranularity.ROWWISE))
    assert not fuses_swiglu(None)
    with pytest.raises(ValueError, match="tensorwise"):
        grouped_gemm_fp8_swiglu(h, p, w, offs, config=Float8Config(granularity=ScalingGranularity.ROWWISE))
    with pytest.raises(ValueError, match="h must be 2-D"):
        grouped_gemm_fp8_swiglu(h[:, :-1], p, w, offs)
    with pytest.raises(ValueError, match="w must be"):
        grouped_gemm_fp8_swiglu(h, p, w[:, :, :-1], offs)
    with pytest.raises(ValueError, match="probs must be"):
        grouped_gemm_fp8_swiglu(h, p[:-1], w, offs)
    with pytest.raises(TypeError, match="probs must be a floating-point"):
        grouped_gemm_fp8_swiglu(h, torch.ones(12, dtype=torch.int64), w, offs)
    with pytest.raises(TypeError, match="h and w must be"):
        grouped_gemm_fp8_swiglu(h.to(torch.int32), p, w, offs)
    with pytest.raises(ValueError, match="group_offs"):
        grouped_gemm_fp8_swiglu(h, p, w, torch.tensor([0, 7, 5]))
