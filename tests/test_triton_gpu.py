"""Triton backend on a real GPU: large shapes, >4 GB operands (int64 addressing), CUDA graphs.

Every test carries ``@pytest.mark.gpu`` and skips cleanly without a CUDA device of compute
capability >= 8.9 (or a ROCm device the backend accepts).
"""

from __future__ import annotations

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.triton_backend import ACCUMULATE_CANDIDATES  # torch only

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _backend_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    pytest.importorskip("triton")
    from turbo_moe.backends.triton_backend import BACKEND

    ok, why = BACKEND.is_available()
    if not ok:
        pytest.skip(why)
    why = BACKEND._device_reason(torch.device("cuda"))
    if why:
        pytest.skip(why)
    return BACKEND


def _offs(lens, device="cuda"):
    return torch.tensor([0] + list(lens), dtype=torch.int64, device=device).cumsum(0)


def _fp8(shape, dtype, generator=None, device="cuda"):
    return (torch.randn(shape, device=device, generator=generator) * 2).to(dtype)


def _int_fp8(shape, dtype, contraction, generator=None, device="cuda"):
    """Small-integer FP8 values: every product and partial sum is an integer far below 2^12, so
    it is exact in fp32 *and* in Hopper's reduced-precision FP8 tensor-core accumulator. The
    kernel must then equal the fp32 reference bitwise, whatever its summation order."""
    bound = 2 if contraction <= 2048 else 1
    return torch.randint(-bound, bound + 1, shape, device=device, generator=generator).to(dtype)


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


# Real-valued FP8 data: the kernels accumulate like CUTLASS with fast accumulation (Hopper's FP8
# wgmma keeps ~14 mantissa bits between instructions), so they agree with an exact reference to
# about 1e-3 relative (Frobenius), far inside this bound; a wrong row/token/group is O(1).
REAL_DATA_REL_TOL = 5e-3


@pytest.mark.parametrize("data", ["integer", "real"])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_m_grouped_large_ragged(a_dtype, data):
    backend = _backend_or_skip()
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [4096, 0, 1, 777, 3000, 129, 0, 2048]
    M, K, N = sum(lens), 7168 + 48, 4096 + 80
    G = len(lens)
    if data == "integer":
        a, b = _int_fp8((M, K), a_dtype, K, g), _int_fp8((G, N, K), E4M3, K, g)
    else:
        a, b = _fp8((M, K), a_dtype, g), _fp8((G, N, K), E4M3, g)
    a_scale, b_scale = torch.rand(M, device="cuda") + 0.5, torch.rand(G, N, device="cuda") + 0.5
    offs = _offs(lens)
    prob = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, a_scale, b_scale, offs, torch.float32)
    out = backend.run(prob)
    ref = torch.full_like(out, float("nan"))
    for gi, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
        ref[lo:hi] = (a[lo:hi].float() @ b[gi].float().T) * a_scale[lo:hi, None] * b_scale[gi]
    if data == "integer":
        assert torch.equal(out, ref), f"{int((out != ref).sum())} elements differ"
    else:
        assert _rel_err(out, ref) < REAL_DATA_REL_TOL
    assert torch.equal(out, backend.run(prob)), "not bitwise deterministic"


@pytest.mark.parametrize("data", ["integer", "real"])
def test_k_grouped_large_ragged_with_empty_group(data):
    backend = _backend_or_skip()
    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [5000, 0, 1, 4096, 333, 0, 8191, 16, 17]
    M, N, K = sum(lens), 4096 + 16, 2048 + 40
    G = len(lens)
    if data == "integer":
        a, b = _int_fp8((N, M), E5M2, max(lens), g), _int_fp8((K, M), E4M3, max(lens), g)
    else:
        a, b = _fp8((N, M), E5M2, g), _fp8((K, M), E4M3, g)
    a_scale, b_scale = torch.rand(G, N, device="cuda") + 0.5, torch.rand(G, K, device="cuda") + 0.5
    offs = _offs(lens)
    prob = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, a_scale, b_scale, offs, torch.bfloat16)
    out = backend.run(prob)
    for gi, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
        if lo == hi:
            assert torch.equal(out[gi], torch.zeros_like(out[gi])), "empty group must be exactly zero"
            continue
        ref = ((a[:, lo:hi].float() @ b[:, lo:hi].float().T) * a_scale[gi][:, None] * b_scale[gi]).to(torch.bfloat16)
        if data == "integer":
            assert torch.equal(out[gi], ref), f"group {gi}: {int((out[gi] != ref).sum())} elements differ"
        else:
            assert _rel_err(out[gi], ref) < REAL_DATA_REL_TOL, f"group {gi}"
    assert torch.equal(out, backend.run(prob)), "not bitwise deterministic"


@pytest.mark.parametrize("epilogue", ["tma", "pointers"])
@pytest.mark.parametrize("candidate", range(len(ACCUMULATE_CANDIDATES)))
def test_k_grouped_accumulates_into_main_grad(candidate, epilogue):
    """out += the fp32 wgrad (an fp32 main_grad) with each accumulate candidate, through the TMA
    read-modify-write (fp32 rows of 16-byte multiples) and the pointer epilogue (rows of 4112 + 4
    bytes): bitwise equal to the same kernel's fp32 result added by torch, ragged groups starting
    off 16-token boundaries, empty groups untouched (the sign of a -0.0 included)."""
    import dataclasses

    backend = _backend_or_skip()
    g = torch.Generator(device="cuda").manual_seed(7)
    lens = [1500, 0, 1, 777, 16, 0, 2049, 41]  # 4384 tokens: token-major rows of 16-byte multiples (TMA loads)
    M, N = sum(lens), 1024 + 16
    K = 2048 + 40 if epilogue == "tma" else 1028 + 1
    G = len(lens)
    a, b = _fp8((N, M), E5M2, g), _fp8((K, M), E4M3, g)
    a_scale, b_scale = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
    offs = _offs(lens)
    start = torch.randn(G, N, K, device="cuda", generator=g)
    start[1, 0, 0] = -0.0
    config = ACCUMULATE_CANDIDATES[candidate]
    prob = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, a_scale, b_scale, offs, torch.float32)
    expected = start + backend.run(prob, config)
    main_grad = start.clone()
    accumulating = dataclasses.replace(prob, out=main_grad, accumulate=True)
    plan = backend._make_plan(accumulating, main_grad, config)
    assert plan.use_tma and plan.tma_store == (epilogue == "tma"), plan
    assert backend.run(accumulating, config) is main_grad
    assert torch.equal(main_grad, expected), f"{int((main_grad != expected).sum())} elements differ"
    for empty in (1, 5):
        assert torch.equal(main_grad[empty].view(torch.int32), start[empty].view(torch.int32)), f"group {empty}"
    assert torch.signbit(main_grad[1, 0, 0])


def _config(kind, tma):
    import dataclasses

    from turbo_moe.backends.triton_backend import GPU_CANDIDATES

    return dataclasses.replace(GPU_CANDIDATES[kind][0], tma=tma)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_m_grouped_operand_and_output_past_4gb(tma):
    """a has > 2^32 bytes (fp8) and out > 2^31 elements: rows past the 32-bit boundary must be
    addressed in int64. Checked on sampled rows in every group, the last rows included."""
    backend = _backend_or_skip()
    free, _ = torch.cuda.mem_get_info()
    K, N = 8192, 4096
    M = 557_056  # a: 4.56e9 bytes; out: 2.28e9 elements (bf16, 4.56 GB)
    if free < 12 * 2**30:
        pytest.skip(f"needs ~12 GiB free, have {free / 2**30:.1f}")
    g = torch.Generator(device="cuda").manual_seed(3)
    lens = [100_000, 162_144, 1, 0, M - 262_145]  # a group starts right past 2^31 elements of a
    a = torch.empty((M, K), dtype=E4M3, device="cuda")
    for start in range(0, M, 65536):  # fill in chunks (randn of the whole would need 18 GB)
        stop = min(start + 65536, M)
        a[start:stop] = _int_fp8((stop - start, K), E4M3, K, g)
    b = _int_fp8((len(lens), N, K), E4M3, K, g)
    offs = _offs(lens)
    one = torch.ones((), device="cuda")
    out = backend.run(
        GroupedGemmProblem(GemmKind.M_GROUPED, a, b, one, one, offs, torch.bfloat16), config=_config(GemmKind.M_GROUPED, tma)
    )
    assert out.numel() > 2**31 and a.numel() > 2**32
    ends = offs.tolist()
    for gi in range(len(lens)):
        lo, hi = ends[gi], ends[gi + 1]
        if lo == hi:
            continue
        rows = torch.unique(torch.tensor([lo, hi - 1, (lo + hi) // 2] + torch.randint(lo, hi, (5,), generator=torch.Generator().manual_seed(gi)).tolist()))
        ref = (a[rows.cuda()].float() @ b[gi].float().T).to(torch.bfloat16)
        assert torch.equal(out[rows.cuda()], ref), f"group {gi} (rows {lo}..{hi}) differs"


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_k_grouped_operand_past_4gb(tma):
    """wgrad with a = dy^T [N, M] of > 2^32 bytes: token offsets * row stride pass 2^31."""
    backend = _backend_or_skip()
    free, _ = torch.cuda.mem_get_info()
    if free < 10 * 2**30:
        pytest.skip(f"needs ~10 GiB free, have {free / 2**30:.1f}")
    N, K, M = 4096, 256, 1_100_000
    g = torch.Generator(device="cuda").manual_seed(4)
    a = torch.empty((N, M), dtype=E4M3, device="cuda")
    for start in range(0, N, 512):
        a[start : start + 512] = _int_fp8((512, M), E4M3, M, g)
    b = _int_fp8((K, M), E4M3, M, g)
    lens = [600_000, 0, 499_999, 1]
    offs = _offs(lens)
    one = torch.ones((), device="cuda")
    out = backend.run(
        GroupedGemmProblem(GemmKind.K_GROUPED, a, b, one, one, offs, torch.float32), config=_config(GemmKind.K_GROUPED, tma)
    )
    ends = offs.tolist()
    for gi in range(len(lens)):
        lo, hi = ends[gi], ends[gi + 1]
        rows = torch.tensor([0, 1, N // 2, N - 1], device="cuda")
        if lo == hi:
            assert torch.equal(out[gi], torch.zeros_like(out[gi]))
            continue
        ref = a[rows, lo:hi].float() @ b[:, lo:hi].float().T
        assert torch.equal(out[gi, rows], ref), f"group {gi} (tokens {lo}..{hi}) differs"


@pytest.mark.parametrize("kind", [GemmKind.M_GROUPED, GemmKind.K_GROUPED])
def test_cuda_graph_capture_replays_new_offsets(kind):
    """Capture one launch; replay it with several new group_offs (same total): equal to eager."""
    backend = _backend_or_skip()
    g = torch.Generator(device="cuda").manual_seed(5)
    G, M, N, K = 6, 3000, 384, 512
    if kind is GemmKind.M_GROUPED:
        a, b = _fp8((M, K), E4M3, g), _fp8((G, N, K), E4M3, g)
    else:
        a, b = _fp8((N, M), E5M2, g), _fp8((K, M), E4M3, g)
    scale_a, scale_b = torch.tensor(0.5, device="cuda"), torch.tensor(3.0, device="cuda")
    offs = _offs([M // G] * (G - 1) + [M - (M // G) * (G - 1)])
    prob = GroupedGemmProblem(kind, a, b, scale_a, scale_b, offs, torch.bfloat16)
    backend.run(prob)  # eager first: tunes and compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.run(prob)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = backend.run(prob)
    cuts = [[0, 0, 1, 2999, 0, 0], [1500, 1500, 0, 0, 0, 0], [0] * 5 + [M], [17, 400, 0, 983, 1000, 600]]
    for lens in cuts:
        assert sum(lens) == M
        offs.copy_(_offs(lens))
        captured_out.fill_(float("nan"))
        graph.replay()
        eager = backend.run(prob)
        assert torch.equal(captured_out, eager), f"replay differs for {lens}"


def test_autograd_forward_backward_in_cuda_graph():
    """Once the lead's autograd exists: fwd+bwd of turbo_moe.grouped_gemm_fp8 captured in a
    graph, replayed with new group sizes, equal to eager."""
    backend = _backend_or_skip()  # noqa: F841
    import turbo_moe

    fn = getattr(turbo_moe, "grouped_gemm_fp8", None)
    if fn is None:
        pytest.skip("turbo_moe.grouped_gemm_fp8 is not there yet")
    g = torch.Generator(device="cuda").manual_seed(6)
    G, M, K, N = 4, 1024, 256, 384
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(G, N, K, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([256, 0, 512, 256], device="cuda", dtype=torch.int64)

    def step():
        y = fn(x, w, lens, backend="triton")
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        return y, dx, dw

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for new in ([0, 0, 1024, 0], [100, 200, 300, 424], [256, 0, 512, 256]):
        lens.copy_(torch.tensor(new))
        graph.replay()
        eager = step()
        for got, want in zip(outs, eager):
            assert torch.equal(got, want), f"graph replay differs from eager for group_lens={new}"


@pytest.mark.parametrize("kind", ["m_grouped", "k_grouped"])
def test_promoted_accumulation_is_closer_to_float64_at_long_contractions(kind):
    """Float8Config(accumulation="promoted") on Hopper: each 128-deep dot's partial sum is added
    into fp32, where "fast" keeps the whole contraction (16384 here) in the tensor core's narrower
    accumulator. Against a float64 reference of the same FP8 operands, promoted must be closer."""
    backend = _backend_or_skip()
    g = torch.Generator(device="cuda").manual_seed(7)
    if kind == "m_grouped":
        lens, K, N = [512, 0, 1536], 16384, 1024
        M, G = sum(lens), len(lens)
        a, b = _fp8((M, K), E4M3, g), _fp8((G, N, K), E4M3, g)
        scales = (torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda"))
        gemm = GemmKind.M_GROUPED
    else:
        lens, N, K = [16384, 0, 3000], 512, 768
        M, G = sum(lens), len(lens)
        a, b = _fp8((N, M), E5M2, g), _fp8((K, M), E4M3, g)
        scales = (torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda"))
        gemm = GemmKind.K_GROUPED
    offs = _offs(lens)
    errors = {}
    for promote in (False, True):
        prob = GroupedGemmProblem(gemm, a, b, *scales, offs, torch.float32, promote_accumulation=promote)
        out = backend.run(prob)
        err = []
        for gi, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
            if lo == hi:
                continue
            if kind == "m_grouped":
                ref, got = (a[lo:hi].double() @ b[gi].double().T) * 0.125, out[lo:hi]
            else:
                ref, got = (a[:, lo:hi].double() @ b[:, lo:hi].double().T) * 0.125, out[gi]
            err.append(_rel_err(got, ref))
        errors[promote] = max(err)
    assert errors[True] < REAL_DATA_REL_TOL
    assert errors[True] < errors[False], f"promoted {errors[True]:.3e} vs fast {errors[False]:.3e}"
