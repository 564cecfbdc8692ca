"""FlyDSL kernels on a real gfx950 (MI350 / MI355X) vs a float64 reference.

Never run while writing the kernels (no AMD GPU was available): these tests are the first thing
to run on one (docs/flydsl.md). Skipped cleanly without a GPU (conftest) and on any device that is
not a ROCm gfx950 with flydsl installed.
"""

from __future__ import annotations

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.torch_backend import reference_grouped_gemm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from turbo_moe.backends import flydsl_backend

    ok, why = flydsl_backend.BACKEND.is_available()
    if not ok:
        pytest.skip(f"FlyDSL backend unavailable: {why}")
    return flydsl_backend.BACKEND


def _offs(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)


def _fp8(shape, dtype, device):
    return (torch.randn(shape, device=device) * 3).clamp(-200, 200).to(dtype)


def _reference(problem):
    """float64 reference of the problem (base.py semantics)."""
    return reference_grouped_gemm(problem, torch.float64)


def _check(out, ref, out_dtype):
    # The FP8 products are exact in fp32; what remains is fp32 accumulation order and the final
    # rounding to the output dtype.
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[out_dtype]
    if ref.numel() == 0:  # every group empty: nothing to compare, but the shape must be right
        assert out.shape == ref.shape
        return
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


LENS = [[0], [1], [300], [128, 0, 129, 1, 0, 300], [37] * 11, [0, 0, 0, 517]]


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_m_grouped(backend, lens, a_dtype, rowwise, out_dtype):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    m, n, k, g = sum(lens), 200, 272, len(lens)  # N and K not multiples of 128
    a, b = _fp8((m, k), a_dtype, dev), _fp8((g, n, k), torch.float8_e4m3fn, dev)
    sa = torch.rand(m, device=dev) + 0.5 if rowwise else torch.tensor(0.7, device=dev)
    sb = torch.rand(g, n, device=dev) + 0.5 if rowwise else torch.tensor(1.3, device=dev)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, sa, sb, _offs(lens, dev), out_dtype, num_cu=7)
    ok, why = backend.can_handle(problem)
    assert ok, why
    _check(backend.run(problem), _reference(problem), out_dtype)


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("rowwise", [False, True])
def test_k_grouped_with_empty_groups_writing_exact_zeros(backend, lens, rowwise):
    torch.manual_seed(1)
    dev = torch.device("cuda")
    m, n, k, g = sum(lens), 150, 260, len(lens)
    a, b = _fp8((n, m), torch.float8_e5m2, dev), _fp8((k, m), torch.float8_e4m3fn, dev)
    sa = torch.rand(g, n, device=dev) + 0.5 if rowwise else torch.tensor(0.7, device=dev)
    sb = torch.rand(g, k, device=dev) + 0.5 if rowwise else torch.tensor(1.3, device=dev)
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, _offs(lens, dev), torch.bfloat16)
    out = backend.run(problem)
    _check(out, _reference(problem), torch.bfloat16)
    for index, rows in enumerate(lens):
        if rows == 0:
            assert torch.equal(out[index], torch.zeros_like(out[index]))


def test_m_grouped_is_graph_capturable_and_deterministic(backend):
    dev = torch.device("cuda")
    lens = [100, 0, 300]
    a, b = _fp8((400, 256), torch.float8_e4m3fn, dev), _fp8((3, 192, 256), torch.float8_e4m3fn, dev)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, torch.tensor(1.0, device=dev),
                                 torch.tensor(1.0, device=dev), _offs(lens, dev), torch.bfloat16)
    eager = backend.run(problem)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.run(problem)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)  # no atomics: bitwise reproducible


@pytest.mark.slow
def test_m_grouped_operand_past_4gb(backend):
    dev = torch.device("cuda")
    m, k, n = 600_000, 7168, 256  # a = 4.3e9 bytes
    a = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    a[:128].copy_(_fp8((128, k), torch.float8_e4m3fn, dev))
    a[-300:].copy_(_fp8((300, k), torch.float8_e4m3fn, dev))
    b = _fp8((2, n, k), torch.float8_e4m3fn, dev)
    offs = torch.tensor([0, m - 300, m], dtype=torch.int64, device=dev)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, torch.tensor(1.0, device=dev),
                                 torch.tensor(1.0, device=dev), offs, torch.float32)
    out = backend.run(problem)
    ref_tail = a[-300:].double() @ b[1].double().T
    ref_head = a[:128].double() @ b[0].double().T
    torch.testing.assert_close(out[-300:].double(), ref_tail, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(out[:128].double(), ref_head, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("n", [384, 202])  # 202 % 4 != 0: the scalar-store epilogue
@pytest.mark.parametrize("k", [128, 256, 384, 2880, 2882, 130, 4097])
def test_m_grouped_many_tiles_per_workgroup_odd_and_even_k_blocks(backend, k, n):
    # Issue 14: ceil(K/128) odd (384, 2880, 130, 4097) on the LDS-DMA loop raced with the next
    # persistent tile's prologue; num_cu=2 makes every workgroup run many tiles back to back.
    # K % 16 != 0 (2882, 130, 4097) takes the register-staged loop (main loop pairs, then the exact
    # tail; 4097 and 130 also end in a partial dword at the tensor's last byte).
    torch.manual_seed(k)
    dev = torch.device("cuda")
    lens = [300, 1, 0, 257, 129]
    m, g = sum(lens), len(lens)
    a, b = _fp8((m, k), torch.float8_e4m3fn, dev), _fp8((g, n, k), torch.float8_e4m3fn, dev)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, torch.tensor(0.5, device=dev),
                                 torch.tensor(1.5, device=dev), _offs(lens, dev), torch.float32, num_cu=2)
    _check(backend.run(problem), _reference(problem), torch.float32)


@pytest.mark.parametrize("lens", [[0, 1500, 3, 0, 701], [407], [0]])
def test_k_grouped_accumulate_adds_fp32_and_leaves_empty_groups(backend, lens):
    torch.manual_seed(3)
    dev = torch.device("cuda")
    m, n, k, g = sum(lens), 200, 136 if len(lens) > 1 else 130, len(lens)  # 130: scalar-store epilogue
    a, b = _fp8((n, m), torch.float8_e4m3fn, dev), _fp8((k, m), torch.float8_e4m3fn, dev)
    start = torch.randn(g, n, k, device=dev)
    start[..., ::5] = -0.0
    out = start.clone()
    problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, torch.tensor(0.5, device=dev),
                                 torch.tensor(2.0, device=dev), _offs(lens, dev), torch.float32,
                                 num_cu=3, out=out, accumulate=True)
    ok, why = backend.can_handle(problem)
    assert ok, why
    assert backend.run(problem) is out
    ref = _reference(GroupedGemmProblem(GemmKind.K_GROUPED, a, b, problem.a_scale, problem.b_scale,
                                        problem.group_offs, torch.float32))
    _check(out, start.double() + ref, torch.float32)
    for index, rows in enumerate(lens):
        if rows == 0:
            assert torch.equal(out[index], start[index]) and torch.equal(out[index].signbit(), start[index].signbit())


@pytest.mark.parametrize("lens", [[1], [300], [128, 0, 129, 1, 0, 300]])
@pytest.mark.parametrize("k", [160, 228, 4096])  # K % 128 != 0, a short last K group (228); dgrad out: K % 4 == 0
def test_mxfp8_forward_and_dgrad_through_the_block_scaled_dispatch(backend, lens, k):
    """The MX variant (backends/flydsl_mx.py) as auto picks it: forward x W^T and dgrad dy W with
    W^T's own scales (quantize_weight_fine), vs reference_block_scaled_gemm in float64."""
    from turbo_moe import Float8Config
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained.autograd import quantize_weight_fine
    from turbo_moe.fine_grained.gemm import BlockScaledProblem, reference_block_scaled_gemm, run_block_scaled
    from turbo_moe.fine_grained.gemm import select_block_scaled_backend

    torch.manual_seed(0)
    dev = torch.device("cuda")
    m, n, g = sum(lens), 200, len(lens)
    w = quantize_weight_fine(torch.randn(g, n, k, device=dev), Float8Config(granularity="mxfp8"))
    x, sx = Q.quantize_rows(torch.randn(m, k, device=dev) * 3, Q.MXFP8, torch.float8_e4m3fn)
    dy, sdy = Q.quantize_rows(torch.randn(m, n, device=dev), Q.MXFP8, torch.float8_e4m3fn)
    offs = _offs(lens, dev)
    for a, b, sa, sb in ((x, w.data, sx, w.scale), (dy, w.data_t, sdy, w.scale_t)):
        problem = BlockScaledProblem(GemmKind.M_GROUPED, a, b, sa, sb, offs, torch.bfloat16, Q.MXFP8, num_cu=7)
        assert select_block_scaled_backend(problem, "auto") == "flydsl"
        _check(run_block_scaled(problem, "flydsl"), reference_block_scaled_gemm(problem, torch.float64), torch.bfloat16)


@pytest.mark.parametrize("lens", [[1], [300], [128, 0, 129, 1, 0, 300], [45, 7, 0, 33]])
def test_mxfp8_wgrad_through_the_block_scaled_dispatch(backend, lens):
    """The K-grouped MX variant as auto picks it: dW[g] = dy_g^T x_g from quantize_tokens'
    operands, into a bf16 out and added into a float32 main_grad (an empty group leaves its slice
    as it was), vs reference_block_scaled_gemm in float64."""
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained.gemm import BlockScaledProblem, reference_block_scaled_gemm, run_block_scaled
    from turbo_moe.fine_grained.gemm import select_block_scaled_backend

    torch.manual_seed(1)
    dev = torch.device("cuda")
    m, n, k, g = sum(lens), 200, 228, len(lens)
    offs = _offs(lens, dev)
    dy_t, sdy = Q.quantize_tokens(torch.randn(m, n, device=dev), offs, Q.MXFP8, torch.float8_e4m3fn)
    x_t, sx = Q.quantize_tokens(torch.randn(m, k, device=dev) * 3, offs, Q.MXFP8, torch.float8_e4m3fn)
    problem = BlockScaledProblem(GemmKind.K_GROUPED, dy_t, x_t, sdy, sx, offs, torch.bfloat16, Q.MXFP8, num_cu=7)
    assert select_block_scaled_backend(problem, "auto") == "flydsl"
    ref = reference_block_scaled_gemm(problem, torch.float64)
    _check(run_block_scaled(problem, "flydsl"), ref, torch.bfloat16)
    start = torch.randn(g, n, k, device=dev)
    main_grad = start.clone()
    problem = BlockScaledProblem(GemmKind.K_GROUPED, dy_t, x_t, sdy, sx, offs, torch.float32, Q.MXFP8, num_cu=7,
                                 out=main_grad, accumulate=True)
    assert run_block_scaled(problem, "flydsl") is main_grad
    _check(main_grad, start.double() + ref, torch.float32)
    for index, rows in enumerate(lens):
        if rows == 0:
            assert torch.equal(main_grad[index], start[index])
