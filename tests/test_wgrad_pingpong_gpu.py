"""The wgrad ping-pong (``grouped_gemm_gluon.k_grouped_gemm_pingpong_kernel``) on an sm_90 GPU:
``main_grad[g] += a[:, tokens of g] @ b[:, tokens of g]^T``, dequantized, into a float32 main_grad,
and ``out[g] = ...`` into a bf16 output, with the bits of the single-stream Gluon wgrad (same token
walk, wgmma sequence and epilogue arithmetic).

Ragged groups (off-16 starts, one token, empty groups first, in the middle and last, a group
spanning many boxes), tensorwise and rowwise scales, both tile orders, a num_cu cap (many tiles a
program, both consumers busy) and a problem with fewer tiles than programs (consumer 1 idle);
empty groups' main_grad untouched, a -0.0 included; integer data against an exact reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.triton_backend import ACCUMULATE_CANDIDATES, GPU_CANDIDATES, _gluon_reason

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PINGPONG = next(c for c in ACCUMULATE_CANDIDATES if c.pingpong)
SINGLE_STREAM = next(c for c in ACCUMULATE_CANDIDATES if c.gluon and not c.pingpong)
# Into bf16: the ping-pong candidate and the single-stream one with the same tiles and ring.
BF16_PINGPONG = next(c for c in GPU_CANDIDATES[GemmKind.K_GROUPED] if c.pingpong)
BF16_SINGLE_STREAM = dataclasses.replace(BF16_PINGPONG, pingpong=False)
LENS = [0, 1500, 0, 1, 777, 16, 17, 333, 2049, 43, 128, 0]
EMPTY = (0, 2, 11)


def _offs(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64, device="cuda").cumsum(0)


def _problem(lens, N, K, rowwise, seed, integer=False, a_dtype=E5M2):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(seed)
    M, G = sum(lens), len(lens)
    if integer:  # every product and partial sum exact in fp32
        a = torch.randint(-2, 3, (N, M), device="cuda", generator=g).to(a_dtype)
        b = torch.randint(-2, 3, (K, M), device="cuda", generator=g).to(E4M3)
    else:
        a = (torch.randn(N, M, device="cuda", generator=g) * 2).to(a_dtype)
        b = (torch.randn(K, M, device="cuda", generator=g) * 2).to(E4M3)
    if rowwise and integer:  # powers of two: the dequantized products exact too (an FMA changes nothing)
        sa = 2.0 ** torch.randint(-2, 3, (G, N), device="cuda", generator=g).float()
        sb = 2.0 ** torch.randint(-2, 3, (G, K), device="cuda", generator=g).float()
    elif rowwise:
        sa = torch.rand(G, N, device="cuda", generator=g) + 0.5
        sb = torch.rand(G, K, device="cuda", generator=g) + 0.5
    elif integer:
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(4.0, device="cuda")
    else:
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens), torch.float32)
    start = torch.randn(problem.out_shape, device="cuda", generator=g)
    why = _gluon_reason(dataclasses.replace(problem, out=start, accumulate=True), PINGPONG, start)
    if why:
        pytest.skip(why)
    return problem, start


def _accumulate(problem, config, start):
    from turbo_moe.backends.triton_backend import BACKEND

    main_grad = start.clone()
    problem = dataclasses.replace(problem, out=main_grad, accumulate=True)
    plan = BACKEND._make_plan(problem, main_grad, config)
    assert plan.gluon and plan.kernel_name == ("k_grouped_gemm_pingpong_kernel" if config.pingpong
                                               else "k_grouped_gemm_gluon_kernel"), plan.kernel_name
    plan.launch(problem, main_grad)
    return main_grad


def _bits(x):
    return x.view(torch.int32)


@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("band_cyclic", [False, True], ids=["group-major", "band-cyclic"])
def test_wgrad_pingpong_equals_single_stream_gluon_bitwise(scales, band_cyclic):
    problem, start = _problem(LENS, 1024, 2048 + 40, scales == "rowwise", seed=7)
    start[2, 0, 0] = -0.0
    pingpong = _accumulate(problem, dataclasses.replace(PINGPONG, band_cyclic=band_cyclic), start)
    single = _accumulate(problem, dataclasses.replace(SINGLE_STREAM, band_cyclic=band_cyclic), start)
    same = _bits(pingpong) == _bits(single)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the single-stream Gluon wgrad"
    for g in EMPTY:
        assert torch.equal(_bits(pingpong[g]), _bits(start[g])), f"empty group {g} touched"
    assert torch.signbit(pingpong[2, 0, 0])
    changed = _bits(pingpong[1]) != _bits(start[1])
    assert bool(changed.float().mean() > 0.99), "a non-empty group's main_grad was not added to"
    again = _accumulate(problem, dataclasses.replace(PINGPONG, band_cyclic=band_cyclic), start)
    assert torch.equal(_bits(again), _bits(pingpong)), "not bitwise deterministic"


def test_wgrad_pingpong_integer_data_equals_exact_reference():
    lens = LENS
    problem, start = _problem(lens, 256, 384 + 16, True, seed=5, integer=True, a_dtype=E4M3)
    start = torch.randint(-64, 65, start.shape, device="cuda").float() / 8  # exact sums too
    out = _accumulate(problem, PINGPONG, start)
    offs = problem.group_offs.tolist()
    a, b, sa, sb = problem.a, problem.b, problem.a_scale, problem.b_scale
    for g, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi == lo:
            assert torch.equal(_bits(out[g]), _bits(start[g])), f"empty group {g} touched"
            continue
        exact = (a[:, lo:hi].double() @ b[:, lo:hi].double().T).float()  # integers: exact in fp32
        # Integers times powers of two, plus eighths: every step exact, so the kernel's order (and any
        # contraction of its multiply-add) cannot show; a wrong token, tile or scale does.
        ref = start[g] + exact * sa[g][:, None] * sb[g]
        assert torch.equal(out[g], ref), f"group {g} ({hi - lo} tokens)"


@pytest.mark.parametrize("lens,num_cu", [([5, 0, 11], None), (LENS, 2), ([4096] * 3, 1)],
                         ids=["fewer-tiles-than-programs", "num_cu-2", "num_cu-1-long-groups"])
def test_wgrad_pingpong_tile_counts(lens, num_cu):
    N, K = (128, 128) if lens[0] == 5 else (512, 640)
    problem, start = _problem(lens, N, K, False, seed=len(lens))
    problem = dataclasses.replace(problem, num_cu=num_cu)
    pingpong = _accumulate(problem, PINGPONG, start)
    single = _accumulate(problem, SINGLE_STREAM, start)
    assert torch.equal(_bits(pingpong), _bits(single))


def _write_bf16(problem, config):
    """The wgrad into a fresh bf16 output poisoned with NaN (every element must be written)."""
    from turbo_moe.backends.triton_backend import BACKEND

    problem = dataclasses.replace(problem, out_dtype=torch.bfloat16)
    why = _gluon_reason(problem, config, None)
    if why:
        pytest.skip(why)
    out = torch.full(problem.out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    problem = dataclasses.replace(problem, out=out)
    plan = BACKEND._make_plan(problem, out, config)
    assert plan.gluon and plan.kernel_name == ("k_grouped_gemm_pingpong_kernel" if config.pingpong
                                               else "k_grouped_gemm_gluon_kernel"), plan.kernel_name
    plan.launch(problem, out)
    return out


@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("band_cyclic", [False, True], ids=["group-major", "band-cyclic"])
def test_bf16_wgrad_pingpong_equals_single_stream_and_float64(scales, band_cyclic):
    """Into bf16: bit for bit the single-stream Gluon wgrad's output with the same tiles; every
    element written (empty groups exactly zero over the NaN poison); within bf16's rounding of a
    float64 reference of the same FP8 operands and scales; deterministic."""
    problem, _ = _problem(LENS, 1024, 2048 + 40, scales == "rowwise", seed=11)
    pingpong = _write_bf16(problem, dataclasses.replace(BF16_PINGPONG, band_cyclic=band_cyclic))
    single = _write_bf16(problem, dataclasses.replace(BF16_SINGLE_STREAM, band_cyclic=band_cyclic))
    assert not bool(pingpong.isnan().any()), "an element left unwritten"
    same = pingpong.view(torch.int16) == single.view(torch.int16)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the single-stream Gluon wgrad"
    offs = problem.group_offs.tolist()
    a, b, sa, sb = problem.a, problem.b, problem.a_scale, problem.b_scale
    for g, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        if hi == lo:
            assert bool((pingpong[g] == 0).all()), f"empty group {g} not zeroed"
            continue
        scale = (sa[g].double()[:, None] if sa.dim() else sa.double()) * (sb[g].double() if sb.dim() else sb.double())
        ref = (a[:, lo:hi].double() @ b[:, lo:hi].double().T) * scale
        magnitude = (a[:, lo:hi].double().abs() @ b[:, lo:hi].double().abs().T) * scale.abs()
        # per element: bf16's rounding (half an ulp, 2**-9 relative; 2**-8 allowed), and Hopper's FP8
        # wgmma accumulating in about 14 mantissa bits (DeepSeek-V3 section 3.3.2; no promotion
        # here): up to 2**-14 of the summed magnitudes at each of the ceil(tokens / 32) wgmma steps
        steps = -(-(hi - lo) // 32) + 1
        excess = (pingpong[g].double() - ref).abs() - (ref.abs() * 2.0 ** -8 + magnitude * steps * 2.0 ** -14)
        assert bool((excess <= 0).all()), (f"group {g} ({hi - lo} tokens): {int((excess > 0).sum())} elements off, "
                                           f"worst by {float(excess.max()):.3g}")
    again = _write_bf16(problem, dataclasses.replace(BF16_PINGPONG, band_cyclic=band_cyclic))
    assert torch.equal(again.view(torch.int16), pingpong.view(torch.int16)), "not bitwise deterministic"


@pytest.mark.parametrize("lens,num_cu", [([5, 0, 11], None), (LENS, 2), ([4096] * 3, 1)],
                         ids=["fewer-tiles-than-programs", "num_cu-2", "num_cu-1-long-groups"])
def test_bf16_wgrad_pingpong_tile_counts(lens, num_cu):
    N, K = (128, 128) if lens[0] == 5 else (512, 640)
    problem, _ = _problem(lens, N, K, False, seed=len(lens) + 1)
    problem = dataclasses.replace(problem, num_cu=num_cu)
    pingpong = _write_bf16(problem, BF16_PINGPONG)
    single = _write_bf16(problem, BF16_SINGLE_STREAM)
    assert torch.equal(pingpong.view(torch.int16), single.view(torch.int16))
