"""The Gluon M-grouped ping-pong (fwd / dgrad) on an sm_90 GPU: the Triton TMA kernel's bits.

``kernels/triton/m_grouped_gemm_gluon.py`` runs every tile's K boxes as the Triton kernel does
and dequantizes in the same order, so the two must agree bit for bit on every problem the
ping-pong takes: ragged groups (rows not multiples of the tile, written by masked stores), empty
groups (first, middle, last), one row, many groups, N and K not multiples of the tile, tensorwise
and rowwise scales, e4m3/e5m2 operands, bf16 and fp32 output. Integer-valued FP8 data makes the
float64 reference exact too. Outputs are poisoned with NaN first, so a row the kernel skips shows;
a sentinel row past the output's end shows a store that spills.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.triton_backend import GPU_CANDIDATES, _gluon_reason, candidates_for

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PINGPONG = next(c for c in GPU_CANDIDATES[GemmKind.M_GROUPED] if c.gluon)
TRITON_TILES = next(c for c in GPU_CANDIDATES[GemmKind.M_GROUPED] if not c.gluon)  # 128 x 256, 8 warps
# Ragged: empty groups first, in the middle and last; one row; rows not multiples of 128; a group
# of many tiles. 5193 rows in all.
LENS = [0, 1500, 0, 1, 777, 16, 17, 333, 2049, 43, 128, 0, 312]
EMPTY = (0, 2, 11)


def _backend_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    from turbo_moe.backends.triton_backend import BACKEND

    probe = GroupedGemmProblem(GemmKind.M_GROUPED, torch.empty(16, 128, dtype=E4M3, device="cuda"),
                               torch.empty(1, 128, 128, dtype=E4M3, device="cuda"), torch.ones((), device="cuda"),
                               torch.ones((), device="cuda"), torch.tensor([0, 16], device="cuda"), torch.bfloat16)
    why = _gluon_reason(probe, PINGPONG, None)
    if why:
        pytest.skip(why)
    return BACKEND


def _offs(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64, device="cuda").cumsum(0)


def _operands(lens, N, K, a_dtype, rowwise, seed, integer):
    g = torch.Generator(device="cuda").manual_seed(seed)
    M, G = sum(lens), len(lens)
    if integer:  # every product and partial sum exact in fp32 and in the FP8 accumulator
        a = torch.randint(-2, 3, (M, K), device="cuda", generator=g).to(a_dtype)
        b = torch.randint(-2, 3, (G, N, K), device="cuda", generator=g).to(E4M3)
    else:
        a = (torch.randn(M, K, device="cuda", generator=g) * 2).to(a_dtype)
        b = (torch.randn(G, N, K, device="cuda", generator=g) * 2).to(E4M3)
    if rowwise:
        sa = torch.rand(M, device="cuda", generator=g) + 0.5
        sb = torch.rand(G, N, device="cuda", generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
    return a, b, sa, sb


def _run(backend, problem, config, out):
    plan = backend._make_plan(problem, out, config)
    assert plan.gluon == config.gluon, f"{config}: the plan took the other kernel"
    plan.launch(problem, out)
    return out


def _poisoned(problem, dtype):
    """A NaN output with one sentinel row after it (a store past the last row would change it)."""
    M, N = problem.out_shape
    storage = torch.full((M + 1, N), float("nan"), dtype=dtype, device="cuda")
    storage[M] = 7.0
    return storage, storage[:M]


@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("nk", [(1024, 2048), (264, 208)], ids=["N1024-K2048", "N264-K208"])
def test_pingpong_equals_triton_tma_kernel_bitwise(scales, out_dtype, nk):
    backend = _backend_or_skip()
    N, K = nk
    config = PINGPONG if out_dtype == torch.bfloat16 else dataclasses.replace(PINGPONG, num_stages=3)
    a, b, sa, sb = _operands(LENS, N, K, E5M2, scales == "rowwise", seed=11, integer=False)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, sa, sb, _offs(LENS), out_dtype)
    assert _gluon_reason(problem, config, None) == ""
    storage, out = _poisoned(problem, out_dtype)
    pingpong = _run(backend, problem, config, out)
    _, triton_out = _poisoned(problem, out_dtype)
    triton_tma = _run(backend, problem, TRITON_TILES, triton_out)
    assert not torch.isnan(pingpong).any(), "a row was not written"
    assert bool((storage[-1] == 7.0).all()), "a store went past the output's last row"
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    same = pingpong.view(bits) == triton_tma.view(bits)
    assert bool(same.all()), f"{int((~same).sum())} elements differ from the Triton TMA kernel"
    _, again = _poisoned(problem, out_dtype)
    assert torch.equal(_run(backend, problem, config, again).view(bits), pingpong.view(bits)), "not deterministic"


@pytest.mark.parametrize("groups", [1, 64])
def test_pingpong_integer_data_equals_float64_reference(groups):
    """Exact products: the result is the float64 reference's, row by row, with rowwise scales."""
    backend = _backend_or_skip()
    g = torch.Generator().manual_seed(groups)
    lens = [3000] if groups == 1 else torch.randint(0, 200, (groups,), generator=g).tolist()
    if groups > 1:
        lens[groups // 2] = 0
    N, K = 384, 512
    a, b, sa, sb = _operands(lens, N, K, E4M3, True, seed=5, integer=True)
    offs = _offs(lens)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, sa, sb, offs, torch.float32)
    config = dataclasses.replace(PINGPONG, num_stages=3)
    _, out = _poisoned(problem, torch.float32)
    out = _run(backend, problem, config, out)
    for group, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
        exact = (a[lo:hi].double() @ b[group].double().T).float()  # integers: exact in fp32
        ref = exact * sa[lo:hi][:, None] * sb[group]  # the kernel's fp32 dequantization, in its order
        assert torch.equal(out[lo:hi], ref), f"group {group} ({hi - lo} rows)"


def test_pingpong_is_the_default_and_declines_what_it_cannot_take():
    """The ping-pong is the first M-grouped candidate on sm_90; promoted accumulation and a strided
    output take the Triton kernel instead (with its bits)."""
    backend = _backend_or_skip()
    lens = [300, 0, 212]
    a, b, sa, sb = _operands(lens, 256, 256, E4M3, False, seed=3, integer=False)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, sa, sb, _offs(lens), torch.bfloat16)
    assert candidates_for(problem)[0] == PINGPONG
    promoted = dataclasses.replace(problem, promote_accumulation=True)
    assert "promote" in _gluon_reason(promoted, PINGPONG, None)
    assert all(not c.gluon for c in candidates_for(promoted))
    strided = torch.empty(512, 264, dtype=torch.bfloat16, device="cuda")[:, :256]
    assert "contiguous" in _gluon_reason(problem, PINGPONG, strided)
    plan = backend._make_plan(problem, strided, PINGPONG)
    assert not plan.gluon
    plan.launch(problem, strided)
    reference = backend.run(problem, TRITON_TILES)
    assert torch.equal(strided.view(torch.int16), reference.view(torch.int16))
