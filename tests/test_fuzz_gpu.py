"""The GPU fuzz of issue 16 (``scripts/gpu_fuzz.py``), one test per case, each in its own process
(a device-side assert kills the CUDA context): CPU offsets with CUDA data, TURBO_MOE_SYNC_CHECKS=1,
bad routing under the asynchronous checks (loud at the next sync; with the asserts off, never a
read or write outside the operands: poisoned guard regions), and CUDA-graph replay with 100
random routings equal to eager bit for bit. ``python scripts/gpu_fuzz.py`` prints the same cases
as a table. On the CPU one guard case runs under the Triton interpreter, to keep the harness honest.
"""

import importlib.util
import os
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_fuzz.py"
_spec = importlib.util.spec_from_file_location("gpu_fuzz", SCRIPT)
gpu_fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_fuzz)

GPU_CASES = gpu_fuzz.all_cases("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name, expected, env", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_fuzz_case(name, expected, env):
    result = gpu_fuzz.run_in_child(name, "cuda", 100, env)
    assert result["ok"], f"{name} (expected: {expected}): {result['detail']}\n{result['stderr']}"


def test_guard_harness_under_the_interpreter():
    """One guard case on the CPU (Triton interpreter): the clamped offsets keep both kernels inside
    NaN-guarded operands and sentinel-guarded outputs, equal to the torch reference."""
    pytest.importorskip("triton")
    result = gpu_fuzz.run_in_child("guard_kernel_offs_past_end", "cpu", 1, {"TRITON_INTERPRET": "1"}, timeout=300)
    assert result["ok"], result["detail"] + "\n" + result["stderr"]
    assert "every sentinel intact" in result["detail"]


def test_routings_cover_every_pattern_and_sum_to_m():
    rng = gpu_fuzz.random.Random(0)
    routings = [gpu_fuzz.random_routing(rng, i, 1024, 8) for i in range(100)]
    assert all(sum(r) == 1024 and min(r) >= 0 and len(r) == 8 for r in routings)
    assert any(r.count(0) >= 1 for r in routings)  # empty experts
    assert any(max(r) == 1024 for r in routings)  # one expert holds every token
    assert any(1 in r for r in routings)  # single-token experts
    assert any(max(r) > 4 * min(x for x in r if x) for r in routings)  # skew
    assert len({tuple(r) for r in routings}) > 50  # mostly distinct


def test_guard_detects_a_write_past_an_output():
    guarded = gpu_fuzz.Guarded("cpu")
    t = guarded.tensor((4, 4), torch.float32)
    t.fill_(1.0)
    assert guarded.intact()
    torch.as_strided(t, (1,), (1,), t.storage_offset() + t.numel()).fill_(0.0)  # one element past the end
    assert not guarded.intact()


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_tiny_magnitudes_and_double_backward_on_gpu(granularity):
    """Issue 16 items 1-2 through the compiled kernels (the fused cast kernels run on GPUs only):
    x at 2**-123 (amax below 448 / FLT_MAX, mostly normal floats) and hybrid dy at 1e-35 give the same
    relative error as unit-scale data, never 0 or NaN; a double backward raises the
    once_differentiable error."""
    import turbo_moe
    from fp8_reference import grouped_matmul_f64, grouped_wgrad_f64

    lens = [300, 0, 517, 64, 1]
    gen = torch.Generator(device="cuda").manual_seed(16)
    m = sum(lens)
    x = torch.randn(m, 256, device="cuda", generator=gen)
    w = torch.randn(len(lens), 384, 256, device="cuda", generator=gen)
    dy = torch.randn(m, 384, device="cuda", generator=gen)
    glens = torch.tensor(lens, device="cuda")
    cfg = turbo_moe.Float8Config(granularity=granularity, format="hybrid")
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()  # noqa: E731
    errors = {}
    # Tiny x (or tiny dy) alone: both tiny would underflow dW in float32 whatever the quantization.
    for name, xs, dys in (("unit", 1.0, 1.0), ("tiny_x", 2.0**-123, 1.0), ("tiny_dy", 1.0, 1e-35)):
        xt = (x * xs).requires_grad_()
        wt = w.clone().requires_grad_()
        y = turbo_moe.grouped_gemm_fp8(xt, wt, glens, config=cfg, backend="triton")
        y.backward(dy * dys)
        x64, dy64, w64 = (x * xs).cpu().double(), (dy * dys).cpu().double(), w.cpu().double()
        dx_ref = torch.cat([dy64[lo:hi] @ w64[g] for g, (lo, hi) in enumerate(zip(offs[:-1], offs[1:]))])
        errors[name] = [rel(y, grouped_matmul_f64(x64, w64, lens)), rel(xt.grad, dx_ref),
                        rel(wt.grad, grouped_wgrad_f64(dy64, x64, lens))]
        assert torch.isfinite(y).all() and torch.isfinite(wt.grad).all() and torch.isfinite(xt.grad).all()
    for name in ("tiny_x", "tiny_dy"):
        for unit, tiny in zip(errors["unit"], errors[name]):
            assert tiny < max(2 * unit, 0.08), errors  # before the scale cap: 1.0 (all zeros)
    xt = x.clone().requires_grad_()
    y = turbo_moe.grouped_gemm_fp8(xt, w, glens, config=cfg, backend="triton")
    (gx,) = torch.autograd.grad(y.square().sum(), xt, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.square().sum().backward()
