"""The block-scaled dispatch of the FlyDSL MXFP8 variant (``turbo_moe/backends/flydsl_mx.py``,
``select_block_scaled_backend``) on any machine: no device code runs. Availability is simulated by
patching the FlyDSL backend's ``is_available`` and ``on_rocm`` and its ``launch`` with a recorder,
which shows what the launcher would hand the kernel (config, scale addresses and byte counts,
plan); unpatched, this CPU machine has no gfx950 and auto chooses exactly as before."""

from __future__ import annotations

import pytest
import torch

from turbo_moe import Float8Config
from turbo_moe.backends import flydsl_backend, flydsl_mx
from turbo_moe.backends.base import BackendUnavailable, GemmKind
from turbo_moe.fine_grained import quantize as Q
from turbo_moe.fine_grained.autograd import grouped_gemm_fine, quantize_weight_fine
from turbo_moe.fine_grained.gemm import (BlockScaledProblem, _triton_reason, pow2_blockwise_as_mxfp8,
                                         reference_block_scaled_gemm, run_block_scaled, select_block_scaled_backend)
from turbo_moe.kernels.flydsl import host, mx_host

from test_flydsl_dispatch import _fake_rocm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
POW2 = Q.BLOCKWISE._replace(pow2=True)  # UE8M0 blockwise: runs on the MX variant
M, N, K, G = 40, 48, 96, 2  # K: 3 scale groups of 32
OFFS = [0, 15, 40]


def _problem(kind=GemmKind.M_GROUPED, recipe=Q.MXFP8, a_dtype=E4M3, out_dtype=torch.bfloat16, out=None, n=N, k=K,
             accumulate=False):
    offs = torch.tensor(OFFS, dtype=torch.int64)
    if kind is GemmKind.K_GROUPED:
        a, sa = Q.quantize_tokens(torch.randn(M, n), offs, recipe, a_dtype)
        b, sb = Q.quantize_tokens(torch.randn(M, k), offs, recipe, E4M3)
    else:
        a, sa = Q.quantize_rows(torch.randn(M, K), recipe, a_dtype)
        if recipe.e8m0:
            b, sb = Q.quantize_rows(torch.randn(G, n, K), recipe, E4M3)
        else:
            b, _, sb = Q.quantize_weight_blocks(torch.randn(G, n, K), recipe, E4M3, transposed=False)
    problem = BlockScaledProblem(kind, a, b, sa, sb, offs, out_dtype, recipe, num_cu=8, out=out, accumulate=accumulate)
    assert not problem.reason(), problem.reason()
    return problem


@pytest.fixture
def gfx950(monkeypatch):
    """FlyDSL available, CPU tensors taken for ROCm ones, launches recorded instead of run."""
    calls = []
    monkeypatch.setattr(flydsl_backend.BACKEND, "is_available", lambda: (True, ""))
    monkeypatch.setattr(flydsl_backend, "on_rocm", lambda device: True)
    monkeypatch.setattr(flydsl_backend, "_num_cu", lambda index: 8)  # problems without num_cu
    monkeypatch.setattr(flydsl_backend, "launch", lambda *call: calls.append(call))
    return calls


def _check_launch(call, problem, m, n, k):
    """The recorded launch is the MX variant with the problem's operands and block-major scales."""
    config, lds_dma, kind, args, device = call
    assert config.mx and (config.a_format, config.b_format, config.out_dtype) == ("e4m3", "e4m3", "bf16")
    assert lds_dma is False and kind is GemmKind.M_GROUPED and device == problem.device
    kb = -(-k // 32)
    assert args[3] == problem.a_scale.data_ptr() and args[4] == problem.b_scale.data_ptr()
    assert args[6:8] == (m * kb, G * n * kb) == (mx_host.a_scale_end(m, k), mx_host.b_scale_end(G - 1, n, k))
    assert problem.a_scale.stride() == (1, m) and problem.b_scale.stride() == (kb * n, 1, n)
    plan = host.plan_m_grouped((m, k), (k, 1), (G, n, k), (n * k, k, 1), "bf16", 8)
    assert args[8:] == plan.scalar_args()
    assert (plan.m, plan.n, plan.k) == (m, n, k)


def test_flydsl_refusal_on_this_machine_is_the_backends_own_reason():
    ok, why = flydsl_backend.BACKEND.is_available()
    assert not ok and why  # a CPU machine: no ROCm gfx950 (or no flydsl)
    problem = _problem()
    assert flydsl_mx.unsupported_reason(problem) == ""  # the problem itself is one FlyDSL takes
    with pytest.raises(BackendUnavailable, match="backend='flydsl' cannot run") as info:
        run_block_scaled(problem, "flydsl")
    assert why in str(info.value)


@pytest.mark.parametrize("make, reason", [
    (lambda: _problem(recipe=Q.BLOCKWISE, n=256), "blockwise with float32 scales runs on triton or torch"),
    (lambda: _problem(GemmKind.K_GROUPED, recipe=Q.BLOCKWISE), "blockwise with float32 scales runs on triton or"),
    (lambda: _problem(recipe=POW2, n=256, a_dtype=E5M2), "a is torch.float8_e5m2; the FlyDSL MXFP8 variants are"),
    (lambda: _problem(a_dtype=E5M2), "a is torch.float8_e5m2; the FlyDSL MXFP8 variants are e4m3 x e4m3"),
    (lambda: _problem(GemmKind.K_GROUPED, a_dtype=E5M2), "a is torch.float8_e5m2; the FlyDSL MXFP8 variants are"),
    (lambda: _problem(out=torch.zeros(M, N, dtype=torch.bfloat16)), "no out / accumulate"),
    (lambda: _problem(out_dtype=torch.float32), "writes bfloat16"),
    (lambda: _problem(GemmKind.K_GROUPED, out_dtype=torch.float32), "writes bfloat16 or adds into a float32 out"),
    (lambda: _problem(n=50), "out has 50 columns"),
    (lambda: _problem(GemmKind.K_GROUPED, k=50), "out has 50 columns"),
])
def test_unsupported_cases_are_refused_with_their_reason_even_on_gfx950(gfx950, make, reason):
    problem = make()
    with pytest.raises(BackendUnavailable, match="backend='flydsl' cannot run") as info:
        select_block_scaled_backend(problem, "flydsl")
    assert reason in str(info.value)
    assert select_block_scaled_backend(problem, "auto") != "flydsl"
    assert not gfx950


def test_supported_forward_picks_flydsl_and_launches_the_mx_variant(gfx950):
    problem = _problem()
    assert select_block_scaled_backend(problem, "auto") == "flydsl"
    assert select_block_scaled_backend(problem, "flydsl") == "flydsl"
    out = run_block_scaled(problem, "flydsl")
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert len(gfx950) == 1
    _check_launch(gfx950[0], problem, M, N, K)
    assert gfx950[0][3][2] == out.data_ptr()


def test_dgrad_operand_from_quantize_weight_fine_has_the_layout_the_kernel_reads(gfx950):
    """dgrad ``dx = dy W``: b = W^T [G, K, N] quantized along N (its own e8m0 scales, block-major)."""
    w = quantize_weight_fine(torch.randn(G, N, K), Float8Config(granularity="mxfp8"))
    mx_host.check_scale_layout("b_scale", tuple(w.scale_t.shape), w.scale_t.stride())
    dy, dy_scale = Q.quantize_rows(torch.randn(M, N), Q.MXFP8, E4M3)
    problem = BlockScaledProblem(GemmKind.M_GROUPED, dy, w.data_t, dy_scale, w.scale_t,
                                 torch.tensor(OFFS), torch.bfloat16, Q.MXFP8, num_cu=8)
    out = run_block_scaled(problem, "flydsl")
    assert out.shape == (M, K)
    _check_launch(gfx950[0], problem, M, K, N)


def _check_wgrad_launch(call, problem, accumulate=False):
    """The recorded launch is the K-grouped MX variant with the problem's token-major operands, its
    slot-major token scales and the tensorwise K-grouped plan."""
    config, lds_dma, kind, args, device = call
    assert config.mx and kind is GemmKind.K_GROUPED and lds_dma is False and device == problem.device
    assert (config.a_format, config.b_format, config.out_dtype, config.accumulate) == (
        "e4m3", "e4m3", "f32" if accumulate else "bf16", accumulate)
    (n, m), (k, _) = problem.a.shape, problem.b.shape
    slots = m // 32 + G
    assert args[:2] == (problem.a.data_ptr(), problem.b.data_ptr())
    assert args[3:5] == (problem.a_scale.data_ptr(), problem.b_scale.data_ptr())
    assert args[6:8] == (n * slots, k * slots)
    assert problem.a_scale.stride() == (1, n) and problem.b_scale.stride() == (1, k)  # slot-major
    plan = host.plan_k_grouped((n, m), (m, 1), (k, m), (m, 1), G, "f32" if accumulate else "bf16", 8)
    assert args[8:] == plan.scalar_args()


def test_supported_wgrad_picks_flydsl_and_launches_the_mx_variant(gfx950):
    problem = _problem(GemmKind.K_GROUPED)
    assert select_block_scaled_backend(problem, "auto") == "flydsl"
    out = run_block_scaled(problem, "flydsl")
    assert out.shape == (G, N, K)
    _check_wgrad_launch(gfx950[0], problem)
    # Into an fp32 main_grad: the accumulating epilogue, out given.
    main_grad = torch.zeros(G, N, K)
    problem = _problem(GemmKind.K_GROUPED, out_dtype=torch.float32, out=main_grad, accumulate=True)
    assert run_block_scaled(problem, "flydsl") is main_grad
    _check_wgrad_launch(gfx950[1], problem, accumulate=True)


def test_training_step_sends_all_three_gemms_to_flydsl(gfx950):
    config = Float8Config(granularity="mxfp8")
    offs = torch.tensor(OFFS)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=torch.bfloat16, requires_grad=True)
    grouped_gemm_fine(x, w, offs, config=config, out_dtype=torch.bfloat16).float().sum().backward()
    (fwd, _, _, fwd_args, _), (dgrad, _, _, dgrad_args, _), (wgrad, _, wgrad_kind, wgrad_args, _) = gfx950
    assert len(gfx950) == 3 and fwd.mx and dgrad.mx and wgrad.mx and wgrad_kind is GemmKind.K_GROUPED
    assert (fwd_args[8:11], dgrad_args[8:11]) == ((M, N, K), (M, K, N))
    assert fwd_args[6:8] == (M * 3, G * N * 3) and dgrad_args[6:8] == (M * 2, G * K * 2)  # cdiv(N, 32) = 2
    slots = M // 32 + G
    assert wgrad_args[6:8] == (N * slots, K * slots) and wgrad_args[8:12] == (N, K, M, G)
    assert w.grad.shape == (G, N, K)  # (the recorded launches computed nothing: shapes only)


def test_hybrid_training_step_keeps_the_e5m2_gradient_gemms_off_flydsl(gfx950):
    config = Float8Config(granularity="mxfp8", format="hybrid")
    offs = torch.tensor(OFFS)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=torch.bfloat16, requires_grad=True)
    grouped_gemm_fine(x, w, offs, config=config, out_dtype=torch.bfloat16).float().sum().backward()
    assert len(gfx950) == 1 and gfx950[0][2] is GemmKind.M_GROUPED  # the forward only: dy is e5m2
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_gemm_fine(x2, w2, offs, config=config, backend="torch", out_dtype=torch.bfloat16).float().sum().backward()
    assert torch.equal(w.grad, w2.grad) and torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("name", ["a_scale", "b_scale"])
def test_scale_layout_mismatch_names_the_argument(gfx950, name):
    problem = _problem()
    setattr(problem, name, getattr(problem, name).contiguous())  # row-major, not block-major
    with pytest.raises(ValueError, match=f"{name}: the FlyDSL MXFP8 kernel reads block-major scales"):
        flydsl_mx.plan(problem)
    with pytest.raises(BackendUnavailable, match=f"{name}: the FlyDSL MXFP8 kernel reads block-major"):
        select_block_scaled_backend(problem, "flydsl")
    assert select_block_scaled_backend(problem, "auto") != "flydsl"
    assert not gfx950


def test_auto_on_this_machine_chooses_as_before():
    for problem in (_problem(), _problem(GemmKind.K_GROUPED), _problem(recipe=Q.BLOCKWISE, n=256)):
        assert select_block_scaled_backend(problem, "auto") == ("torch" if _triton_reason(problem) else "triton")


def test_disable_switch_keeps_auto_off_flydsl(monkeypatch):
    if flydsl_backend._flydsl_import_error():
        pytest.skip(flydsl_backend._flydsl_import_error())
    _fake_rocm(monkeypatch, "gfx950")  # the real is_available, on a faked gfx950
    monkeypatch.setattr(flydsl_backend, "on_rocm", lambda device: True)
    problem = _problem()
    assert select_block_scaled_backend(problem, "auto") == "flydsl"
    monkeypatch.setenv("TURBO_MOE_DISABLE_FLYDSL", "1")
    assert select_block_scaled_backend(problem, "auto") == ("torch" if _triton_reason(problem) else "triton")
    with pytest.raises(BackendUnavailable, match="disabled by TURBO_MOE_DISABLE_FLYDSL"):
        select_block_scaled_backend(problem, "flydsl")


@pytest.mark.parametrize("kind", [GemmKind.M_GROUPED, GemmKind.K_GROUPED])
def test_pow2_blockwise_as_mxfp8_is_the_same_gemm_in_the_mx_layouts(kind):
    """Power-of-two blockwise scales become e8m0 bytes per 32 elements, in the layouts the MX variant
    reads; the float64 reference of both problems is the same, bit for bit (exact FP8 products,
    power-of-two scales). Ragged groups, an empty one, K and token counts not multiples of 128."""
    gen = torch.Generator().manual_seed(5)
    lens = [5, 0, 150, 33, 0, 129]
    offs = torch.tensor([0] + lens).cumsum(0)
    m = sum(lens)
    spread = 10 ** (4 * torch.rand(m, 1, generator=gen) - 2)
    if kind is GemmKind.M_GROUPED:
        a, sa = Q.quantize_rows(torch.randn(m, 300, generator=gen) * spread, POW2, E4M3)
        b, _, sb = Q.quantize_weight_blocks(torch.randn(6, 200, 300, generator=gen), POW2, E4M3, transposed=False)
    else:
        a, sa = Q.quantize_tokens(torch.randn(m, 40, generator=gen) * spread, offs, POW2, E4M3)
        b, sb = Q.quantize_tokens(torch.randn(m, 44, generator=gen), offs, POW2, E4M3)
    problem = BlockScaledProblem(kind, a, b, sa, sb, offs, torch.float32, POW2)
    mx = pow2_blockwise_as_mxfp8(problem)
    assert mx.recipe == Q.MXFP8 and not mx.reason() and mx.a is a and mx.b is b
    for name in ("a_scale", "b_scale"):
        t = getattr(mx, name)
        assert t.dtype == torch.uint8
        if kind is GemmKind.M_GROUPED:
            mx_host.check_scale_layout(name, tuple(t.shape), t.stride())
        else:
            assert t.stride() == (1, t.shape[0])  # slot-major, as quantize_tokens stores MXFP8's
    assert torch.equal(reference_block_scaled_gemm(mx, torch.float64), reference_block_scaled_gemm(problem, torch.float64))
    # The allocation-only form (the plan's checks) has the same shapes and strides.
    bare = pow2_blockwise_as_mxfp8(problem, compute=False)
    assert [(t.shape, t.stride()) for t in (bare.a_scale, bare.b_scale)] == [
        (t.shape, t.stride()) for t in (mx.a_scale, mx.b_scale)]


def test_pow2_blockwise_as_mxfp8_refuses_other_recipes():
    with pytest.raises(ValueError, match="takes blockwise power-of-two problems"):
        pow2_blockwise_as_mxfp8(_problem(recipe=Q.BLOCKWISE, n=256))
    with pytest.raises(ValueError, match="takes blockwise power-of-two problems"):
        pow2_blockwise_as_mxfp8(_problem())


def test_pow2_blockwise_training_step_sends_all_three_gemms_to_the_mx_variant(gfx950):
    """UE8M0 blockwise (power_of_two_scales=True) on a gfx950: fwd, dgrad and wgrad launch the MX
    variant with the expanded scales' byte counts; float32-scale blockwise stays off FlyDSL."""
    offs = torch.tensor(OFFS)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=torch.bfloat16, requires_grad=True)
    config = Float8Config(granularity="blockwise", power_of_two_scales=True)
    grouped_gemm_fine(x, w, offs, config=config, out_dtype=torch.bfloat16).float().sum().backward()
    (fwd, _, _, fwd_args, _), (dgrad, _, _, dgrad_args, _), (wgrad, _, wgrad_kind, wgrad_args, _) = gfx950
    assert len(gfx950) == 3 and fwd.mx and dgrad.mx and wgrad.mx and wgrad_kind is GemmKind.K_GROUPED
    assert (fwd_args[8:11], dgrad_args[8:11]) == ((M, N, K), (M, K, N))
    assert fwd_args[6:8] == (M * 3, G * N * 3) and dgrad_args[6:8] == (M * 2, G * K * 2)  # per 32 elements
    slots = M // 32 + G
    assert wgrad_args[6:8] == (N * slots, K * slots)
    gfx950.clear()
    x.grad = w.grad = None
    grouped_gemm_fine(x, w, offs, config=Float8Config(granularity="blockwise"), out_dtype=torch.bfloat16).float().sum()
    assert not gfx950
