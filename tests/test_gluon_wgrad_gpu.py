"""The Gluon K-grouped (wgrad) kernel on an sm_90 GPU: the same bits as the Triton TMA kernel.

``kernels/triton/grouped_gemm_gluon.py`` walks a group's tokens in the Triton TMA kernel's
32-token slices, in the same order, so every output element gets the same wgmma sequence: the
two kernels must agree bit for bit on every problem the Gluon kernel takes (ragged groups, groups
starting off 16-token boundaries, empty groups, one token, K and the token count not multiples
of the tile, tensorwise and rowwise scales, e4m3/e5m2 operands, bf16 and fp32 output, an fp32
main_grad accumulated into). Integer-valued FP8 data also makes the float64 reference exact.
Outputs are poisoned with NaN first, so a tile the kernel skips shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.triton_backend import (ACCUMULATE_CANDIDATES, GPU_CANDIDATES, _gluon_reason,  # torch only
                                               candidates_for)

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GLUON_CONFIGS = [c for c in GPU_CANDIDATES[GemmKind.K_GROUPED] if c.gluon]
GLUON_ACCUMULATE_CONFIGS = [c for c in ACCUMULATE_CANDIDATES if c.gluon]
# Ragged: off-16 starts (1, 777, 333...), empty groups (first, middle, last), one token, a group
# shorter than a slice, one spanning many boxes, lengths not multiples of 16/32/128. 4864 tokens in
# all: token-major rows of 16-byte multiples, as TMA loads need.
LENS = [0, 1500, 0, 1, 777, 16, 17, 333, 2049, 43, 128, 0]
EMPTY = (0, 2, 11)
# Megatron's FP8 padding: every boundary on a multiple of 16 tokens, most off 32 and 128 (272 = 2 x
# 128 + 16: the skewed bench shapes' small experts), so that a group's last 32-token slice holds 16
# of the next group's tokens, masked in shared memory; LENS has no such boundary.
ALIGNED_LENS = [272, 256, 0, 48, 16, 288, 400, 128, 2064, 0]


def _backend_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    from turbo_moe.backends.triton_backend import BACKEND

    probe = GroupedGemmProblem(GemmKind.K_GROUPED, torch.empty(128, 16, dtype=E4M3, device="cuda"),
                               torch.empty(128, 16, dtype=E4M3, device="cuda"), torch.ones((), device="cuda"),
                               torch.ones((), device="cuda"), torch.tensor([0, 16], device="cuda"), torch.bfloat16)
    why = _gluon_reason(probe, GLUON_CONFIGS[0], None)
    if why:
        pytest.skip(why)
    return BACKEND


def _offs(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64, device="cuda").cumsum(0)


def _operands(lens, N, K, a_dtype, rowwise, seed, integer):
    g = torch.Generator(device="cuda").manual_seed(seed)
    M, G = sum(lens), len(lens)
    if integer:  # every product and partial sum exact in fp32 and in the FP8 accumulator
        a = torch.randint(-2, 3, (N, M), device="cuda", generator=g).to(a_dtype)
        b = torch.randint(-2, 3, (K, M), device="cuda", generator=g).to(E4M3)
    else:
        a = (torch.randn(N, M, device="cuda", generator=g) * 2).to(a_dtype)
        b = (torch.randn(K, M, device="cuda", generator=g) * 2).to(E4M3)
    if rowwise:
        sa = torch.rand(G, N, device="cuda", generator=g) + 0.5
        sb = torch.rand(G, K, device="cuda", generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
    return a, b, sa, sb


def _run(backend, problem, config, out):
    plan = backend._make_plan(problem, out, config)
    assert plan.gluon == config.gluon, f"{config}: the plan took the other kernel"
    plan.launch(problem, out)
    return out


@pytest.mark.parametrize("config", GLUON_CONFIGS, ids=str)
@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("band_cyclic", [False, True], ids=["group-major", "band-cyclic"])
def test_gluon_wgrad_equals_triton_tma_kernel_bitwise(config, scales, out_dtype, band_cyclic):
    _assert_gluon_equals_triton_tma_kernel(config, scales, out_dtype, band_cyclic, LENS)


@pytest.mark.parametrize("config", GLUON_CONFIGS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gluon_wgrad_on_16_aligned_groups_equals_triton_tma_kernel_bitwise(config, out_dtype):
    _assert_gluon_equals_triton_tma_kernel(config, "tensorwise", out_dtype, False, ALIGNED_LENS)


def _assert_gluon_equals_triton_tma_kernel(config, scales, out_dtype, band_cyclic, lens):
    backend = _backend_or_skip()
    config = dataclasses.replace(config, band_cyclic=band_cyclic)
    N, K = 1024, 2048 + 40  # K: output columns past the last full tile (clipped by the store descriptor)
    a, b, sa, sb = _operands(lens, N, K, E5M2, scales == "rowwise", seed=11, integer=False)
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens), out_dtype)
    why = _gluon_reason(problem, config, None)
    if why:  # 128 x 256 tiles with an fp32 store tile do not fit beside three stages; the ping-pong
        # adds into a float32 output (main_grad) and writes only 16-bit ones
        assert out_dtype == torch.float32 and ("shared memory" in why or (
            config.pingpong and "16-bit outputs only" in why)), why
        pytest.skip(why)
    nan = torch.full(problem.out_shape, float("nan"), dtype=out_dtype, device="cuda")
    gluon = _run(backend, problem, config, nan.clone())
    triton_tma = _run(backend, problem, dataclasses.replace(config, gluon=False), nan.clone())
    assert not torch.isnan(gluon).any(), "a tile was not written"
    same = gluon.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32) == triton_tma.view(
        torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the Triton TMA kernel"
    for g in (g for g, n in enumerate(lens) if n == 0):
        assert torch.equal(gluon[g], torch.zeros_like(gluon[g])), f"empty group {g} must be exactly zero"
    again = _run(backend, problem, config, nan.clone())
    assert torch.equal(again, gluon), "not bitwise deterministic"


@pytest.mark.parametrize("config", [c for c in GLUON_CONFIGS if c.block_n == 128][:1], ids=str)
def test_gluon_wgrad_integer_data_equals_float64_reference(config):
    backend = _backend_or_skip()
    N, K = 256, 384 + 16
    lens = LENS
    a, b, sa, sb = _operands(lens, N, K, E4M3, True, seed=5, integer=True)
    offs = _offs(lens)
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.float32)
    out = _run(backend, problem, config, torch.full(problem.out_shape, float("nan"), device="cuda"))
    for g, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
        exact = (a[:, lo:hi].double() @ b[:, lo:hi].double().T).float()  # integers: exact in fp32
        ref = exact * sa[g][:, None] * sb[g]  # the kernel's fp32 dequantization, in its order
        assert torch.equal(out[g], ref), f"group {g} ({hi - lo} tokens)"


@pytest.mark.parametrize("config", GLUON_ACCUMULATE_CONFIGS, ids=str)
def test_gluon_wgrad_accumulates_into_main_grad(config):
    """out += the fp32 wgrad: the Triton TMA kernel's bits, and empty groups untouched (a -0.0 too)."""
    backend = _backend_or_skip()
    lens = LENS
    N, K = 1024, 2048 + 40
    a, b, sa, sb = _operands(lens, N, K, E5M2, False, seed=7, integer=False)
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens), torch.float32)
    start = torch.randn(problem.out_shape, device="cuda")
    start[2, 0, 0] = -0.0
    results = []
    for gluon in (True, False):
        main_grad = start.clone()
        results.append(_run(backend, dataclasses.replace(problem, out=main_grad, accumulate=True),
                            dataclasses.replace(config, gluon=gluon), main_grad))
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    for g in EMPTY:
        assert torch.equal(results[0][g].view(torch.int32), start[g].view(torch.int32)), f"empty group {g} touched"
    assert torch.signbit(results[0][2, 0, 0])


@pytest.mark.parametrize("config", GLUON_ACCUMULATE_CONFIGS[:1], ids=str)
def test_gluon_wgrad_accumulation_keeps_subnormals(config):
    """out += dW adds subnormals as IEEE fp32 does: a flush to zero (an ftz add, or the copy
    engine's reduce-add if the epilogue ever used it) would change main_grad where the wgrad adds
    0 to a subnormal. Columns of b set to zero make those dW columns exactly +0."""
    backend = _backend_or_skip()
    lens = LENS
    N, K = 256, 384 + 16
    a, b, sa, sb = _operands(lens, N, K, E4M3, False, seed=3, integer=False)
    zero_cols = [0, 5, 129, 390]
    b[zero_cols] = 0
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens), torch.float32)
    start = torch.randn(problem.out_shape, device="cuda")
    tiny = torch.finfo(torch.float32).tiny
    start[:, :, zero_cols] = torch.rand(len(lens), N, len(zero_cols), device="cuda") * tiny * 0.9  # subnormal
    start[:, 1::2, zero_cols] *= -1
    assert bool((start[:, :, zero_cols].abs() < tiny).all()) and bool((start[:, :, zero_cols] != 0).any())
    main_grad = start.clone()
    _run(backend, dataclasses.replace(problem, out=main_grad, accumulate=True), config, main_grad)
    kept = main_grad[:, :, zero_cols].view(torch.int32) == start[:, :, zero_cols].view(torch.int32)
    assert bool(kept.all()), f"{int((~kept).sum())} subnormal main_grad values changed by adding +0"
    reference = start.clone()
    _run(backend, dataclasses.replace(problem, out=reference, accumulate=True),
         dataclasses.replace(config, gluon=False), reference)
    assert torch.equal(main_grad.view(torch.int32), reference.view(torch.int32))


def test_gluon_is_the_default_wgrad_and_declines_what_it_cannot_take():
    """The default K-grouped plan on sm_90 is the Gluon kernel; N off BLOCK_M, promoted
    accumulation and a strided output take the Triton TMA kernel (and give its bits)."""
    backend = _backend_or_skip()
    lens = [300, 0, 212]
    a, b, sa, sb = _operands(lens, 256, 256, E4M3, False, seed=3, integer=False)
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens), torch.bfloat16)
    first = GPU_CANDIDATES[GemmKind.K_GROUPED][0]
    assert first.gluon and backend._make_plan(problem, torch.empty(problem.out_shape, dtype=torch.bfloat16,
                                                                     device="cuda"), first).gluon
    odd_n = GroupedGemmProblem(GemmKind.K_GROUPED, a[:200], b, sa, sb, _offs(lens), torch.bfloat16)
    assert "multiple" in _gluon_reason(odd_n, first, None)
    assert not backend._make_plan(odd_n, torch.empty(odd_n.out_shape, dtype=torch.bfloat16, device="cuda"),
                                  first).gluon
    promoted = dataclasses.replace(problem, promote_accumulation=True)
    assert "promote" in _gluon_reason(promoted, first, None)
    assert all(not c.gluon for c in candidates_for(promoted))
