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
from turbo_moe.swiglu import fuses_swiglu, grouped_gemm_fp8_swiglu, swiglu_gemm_supports, weighted_swiglu

KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.swiglu_fp8 import swiglu_fp8_tensorwise, swiglu_backward, swiglu_backward_fp8_tensorwise
    from turbo_moe.config import fp8_max
    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    FP8_BITS = {torch.float8_e4m3fn: (3, -9), torch.float8_e5m2: (2, -16)}  # mantissa bits, log2 of the smallest subnormal

    def reference(h, p):
        g, u = h.double().chunk(2, dim=1)
        return torch.nn.functional.silu(g) * u * p.double()[:, None]

    def check_fp8_layouts(rows, trans, dequant, ref, amax, fp8, label):
        # Tensorwise FP8 of the float64 ref: the scale from its amax, the transposed copy
        # bit-identical to the rows copy, every element rounded to nearest.
        mbits, sub = FP8_BITS[fp8]
        want = amax / fp8_max(fp8)
        assert abs(dequant.item() - want) <= 1e-5 * want, (label, dequant.item(), want)
        assert torch.equal(trans.cpu().view(torch.uint8), rows.cpu().t().contiguous().view(torch.uint8)), label
        deq = rows.cpu().double() * dequant.item()
        # round to nearest: half an FP8 ulp of |ref|, or half the smallest subnormal step
        bound = torch.maximum(ref.abs() * 2.0 ** -(mbits + 1), torch.full_like(ref, 2.0 ** (sub - 1) * dequant.item()))
        err = (deq - ref).abs()
        ok = err <= bound * 1.0001 + 1e-30
        if EXACT:  # the interpreter's float->fp8 conversion (module docstring of test_fp8_cast): values
            # that round up onto a power of two come out one binade low, and subnormals are
            # truncated (off by up to one step); torch's conversion is right
            scaled = (ref / dequant.item()).float()
            up = scaled.clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8).double()
            carry = (up.abs() > scaled.abs()) & (torch.frexp(up)[0].abs() == 0.5)
            ok = ok | carry | (err <= 2.0 ** sub * dequant.item() * 1.0001)
        assert ok.all(), (label, (err / bound).max().item())

    # (rows, F): ragged sizes off every tile (32 x 128 cast tiles, 16 x 128 amax tiles, 8 x 128
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
            rows, trans, dequant = swiglu_fp8_tensorwise(h, p, fp8, fp8_max(fp8), 0, True, True)
            assert rows.shape == (m, f) and trans.shape == (f, m) and rows.is_contiguous() and trans.is_contiguous()
            if not a.numel():
                assert dequant.item() == 1.0
                continue
            check_fp8_layouts(rows, trans, dequant, a, amax, fp8, (m, f, dtype, fp8, "a"))
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
        # backward straight to FP8 (the grad handoff): dh's tensorwise layouts from its float32
        # values, never written in h's dtype; dprobs as above
        dh64 = hd.grad
        amax_dh = dh64.abs().max().item() if dh64.numel() else 0.0
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            rows, trans, dequant, dp8 = swiglu_backward_fp8_tensorwise(h, p, da, fp8, fp8_max(fp8), 0, torch.float32,
                                                                       True, True)
            assert rows.shape == (m, 2 * f) and trans.shape == (2 * f, m) and dp8.shape == (m,)
            assert ((dp8.cpu().double() - pd.grad).abs() <= 1e-5 * scale).all(), (m, f, dtype, "fp8 dprobs")
            if not dh64.numel():
                assert dequant.item() == 1.0
                continue
            check_fp8_layouts(rows, trans, dequant, dh64, amax_dh, fp8, (m, f, dtype, fp8, "dh"))
            only_t = swiglu_backward_fp8_tensorwise(h, p, da, fp8, fp8_max(fp8), 0, torch.float32, False, True)
            assert only_t[0] is None and torch.equal(only_t[1].cpu().view(torch.uint8), trans.cpu().view(torch.uint8))
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


ROWWISE_KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.rowwise_layouts import swiglu_rowwise_layouts, swiglu_backward_rowwise_layouts
    from turbo_moe.quantize import split_packed_scales
    from turbo_moe.config import fp8_max
    device = DEVICE
    gen = torch.Generator().manual_seed(4)
    FP8_BITS = {torch.float8_e4m3fn: (3, -9), torch.float8_e5m2: (2, -16)}

    def check(q, dequant, ref, fp8, label):
        # every element within round-to-nearest of ref at its own scale (dequant broadcast to q)
        mbits, sub = FP8_BITS[fp8]
        deq = q.cpu().double() * dequant
        bound = torch.maximum(ref.abs() * 2.0 ** -(mbits + 1), 2.0 ** (sub - 1) * dequant)
        err = (deq - ref).abs()
        ok = err <= bound * 1.0001 + 1e-30
        if EXACT:  # the interpreter's float->fp8 conversion (KERNEL_CHECK): one binade low on a carry
            scaled = (ref / dequant).float()
            up = scaled.clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8).double()
            carry = (up.abs() > scaled.abs()) & (torch.frexp(up)[0].abs() == 0.5)
            ok = ok | carry | (err <= 2.0 ** sub * dequant * 1.0001)
        assert ok.all(), (label, (err / bound).max().item())

    def check_layouts(rows, row_dq, trans, col_dq, ref, lens, fp8, label):
        m, c = ref.shape
        fmax = fp8_max(fp8)
        amax_r = ref.abs().amax(1)
        want_r = torch.where(amax_r > 0, amax_r / fmax, torch.ones_like(amax_r))
        assert torch.allclose(row_dq.cpu().double(), want_r, rtol=1e-5), label
        check(rows, row_dq.cpu().double()[:, None], ref, fp8, label + ("rows",))
        lo = 0
        for g, n in enumerate(lens):
            part = ref[lo:lo + n]
            amax_c = part.abs().amax(0) if n else torch.zeros(c, dtype=torch.float64)
            want_c = torch.where(amax_c > 0, amax_c / fmax, torch.ones_like(amax_c))
            assert torch.allclose(col_dq[g].cpu().double(), want_c, rtol=1e-5), label + (g,)
            if n:
                check(trans[:, lo:lo + n].t(), col_dq[g].cpu().double()[None, :], part, fp8, label + ("columns", g))
            lo += n

    # groups: ragged, empty ones, one group over every row; sizes off the 32 x 64 cast tiles and the
    # 256-row stats tiles; F past one 1024-column split (two stats splits, dprobs summed over them)
    for lens, f, dtype in (([10, 0, 23, 40, 0], 24, torch.bfloat16), ([300], 40, torch.float32),
                           ([5, 1, 0, 70], 1100, torch.bfloat16)):
        m = sum(lens)
        offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
        h = (torch.randn(m, 2 * f, generator=gen) * 2).to(dtype).to(device)
        p = torch.rand(m, generator=gen).to(device)
        da = torch.randn(m, f, generator=gen).to(dtype).to(device)
        hd = h.cpu().double().requires_grad_()
        pd = p.cpu().double().requires_grad_()
        g_, u_ = hd.chunk(2, dim=1)
        a = torch.nn.functional.silu(g_) * u_ * pd[:, None]
        a.backward(da.cpu().double())
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            rows, row_dq, trans, col_dq = swiglu_rowwise_layouts(h, p, offs, fp8, fp8_max(fp8))
            assert rows.shape == (m, f) and trans.shape == (f, m) and col_dq.shape == (len(lens), f)
            check_layouts(rows, row_dq, trans, col_dq, a.detach(), lens, fp8, (tuple(lens), f, fp8, "a"))
            rows, trans, packed, dprobs = swiglu_backward_rowwise_layouts(h, p, da, offs, fp8, fp8_max(fp8), 0,
                                                                          torch.float32)
            row_dq, col_dq = split_packed_scales(packed, m, 2 * f, len(lens))
            assert rows.shape == (m, 2 * f) and trans.shape == (2 * f, m) and col_dq.shape == (len(lens), 2 * f)
            check_layouts(rows, row_dq, trans, col_dq, hd.grad, lens, fp8, (tuple(lens), f, fp8, "dh"))
            scale = (da.cpu().double().abs() * g_.detach().abs() * u_.detach().abs()).sum(1) + 1e-30
            assert ((dprobs.cpu().double() - pd.grad).abs() <= 1e-5 * scale).all(), (tuple(lens), f, "dprobs")
    print("ok")
    """
)


def test_rowwise_swiglu_kernels_in_interpreter():
    assert_prints_ok(ROWWISE_KERNEL_CHECK.replace("DEVICE", "'cpu'").replace("EXACT", "True"))


@pytest.mark.gpu
def test_rowwise_swiglu_kernels_on_gpu():
    run_on_gpu(ROWWISE_KERNEL_CHECK.replace("DEVICE", "'cuda'").replace("EXACT", "False"), "rowwise_swiglu_check")


STATS_TILES_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton import rowwise_layouts as L
    device = DEVICE
    gen = torch.Generator().manual_seed(5)
    fp8 = torch.float8_e4m3fn
    # Every stats tiling (rows of a slab, columns of a block, warps, rows a step) gives the same
    # scales and FP8 bits (dprobs: summed over other column blocks, equal within float32
    # rounding): one step a slab (the reference), several, group ends inside a step, blocks past
    # the columns. Magnitudes spread over six decades by row, so that a missed row or column
    # changes a scale.
    reference, walked = (32, 64, 4, 32), ((32, 16, 4, 8), (64, 32, 4, 16), (16, 64, 4, 16), (128, 128, 4, 32))
    for lens, f in (([5, 0, 40, 17], 24), ([70], 40), ([3, 33, 0, 1, 29], 48)):
        m = sum(lens)
        offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
        spread = torch.logspace(-3, 3, m, dtype=torch.float64)[torch.randperm(m, generator=gen)][:, None]
        x = (torch.randn(m, 2 * f, generator=gen, dtype=torch.float64) * spread).to(torch.bfloat16).to(device)
        da = (torch.randn(m, f, generator=gen) * 3).to(torch.bfloat16).to(device)
        p = torch.rand(m, generator=gen).to(device)
        results = {}
        saved = dict(L._STATS), L._MIN_STATS_TILES
        try:
            L._MIN_STATS_TILES = 0
            for config in (reference,) + walked:
                L._GEOMETRY.clear()
                for source in L._STATS:
                    L._STATS[source] = config
                results[config] = (L.fp8_rowwise_layouts(x, offs, fp8, 448.0),
                                   L.swiglu_rowwise_layouts(x, p, offs, fp8, 448.0),
                                   L.swiglu_backward_rowwise_layouts(x, p, da, offs, fp8, 448.0, 0, torch.float32))
        finally:
            L._STATS.update(saved[0])
            L._MIN_STATS_TILES = saved[1]
            L._GEOMETRY.clear()
        for config in walked:
            for which, (got, want) in enumerate(zip(results[config], results[reference])):
                for k, (a, b) in enumerate(zip(got, want)):
                    label = (tuple(lens), f, config, ("x", "a", "dh")[which], k)
                    if which == 2 and k == 3:  # dprobs
                        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), label
                    else:
                        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), label
    print("ok")
    """
)


def test_rowwise_stats_tilings_agree_in_interpreter():
    assert_prints_ok(STATS_TILES_CHECK.replace("DEVICE", "'cpu'"))


@pytest.mark.gpu
def test_rowwise_stats_tilings_agree_on_gpu():
    run_on_gpu(STATS_TILES_CHECK.replace("DEVICE", "'cuda'"), "stats_tiles_check")


CAPACITY_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.swiglu_fp8 import swiglu_fp8_tensorwise, swiglu_backward_fp8_tensorwise
    device = DEVICE
    gen = torch.Generator().manual_seed(5)
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # a row capacity past the row count (a token bucket, docs/design.md "Not yet served"): the FP8
    # copies are views of the first M rows of capacity-row buffers, with the M-row call's bits
    for m, f, cap in ((70, 24, 96), (33, 40, 4000), (9, 16, 9)):
        h = (torch.randn(m, 2 * f, generator=gen) * 2).to(torch.bfloat16).to(device)
        p = torch.rand(m, generator=gen).to(device)
        da = torch.randn(m, f, generator=gen).to(torch.bfloat16).to(device)
        want = swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, 0, True, True)
        got = swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, 0, True, True, row_capacity=cap)
        assert got[1].shape == (f, m) and got[1].stride() == (cap, 1) and got[0].shape == (m, f)
        assert same(got[0], want[0]) and same(got[1], want[1]) and torch.equal(got[2], want[2]), (m, f, cap)
        want = swiglu_backward_fp8_tensorwise(h, p, da, torch.float8_e5m2, 57344.0, 0, torch.float32, True, True)
        got = swiglu_backward_fp8_tensorwise(h, p, da, torch.float8_e5m2, 57344.0, 0, torch.float32, True, True,
                                             row_capacity=cap)
        assert got[1].shape == (2 * f, m) and got[1].stride() == (cap, 1) and got[0].shape == (m, 2 * f)
        assert same(got[0], want[0]) and same(got[1], want[1]), (m, f, cap, "dh")
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]), (m, f, cap, "scale, dprobs")
        # delayed scaling: the same bits and the same amax recorded in the history
        from turbo_moe.delayed_scaling import AmaxHistory
        from turbo_moe.kernels.triton.swiglu_fp8 import swiglu_fp8_delayed, swiglu_backward_fp8_delayed
        runs = []
        for row_capacity in (None, cap):
            fwd, bwd = AmaxHistory(3, False), AmaxHistory(3, False)
            fwd.prepare(h.device, torch.float8_e4m3fn, 0, lambda: torch.tensor(2.0, device=device))
            bwd.prepare(h.device, torch.float8_e5m2, 0, lambda: torch.tensor(0.5, device=device))
            a = swiglu_fp8_delayed(h, p, fwd.state, fwd.ticket, 3, False, torch.float8_e4m3fn, 448.0, 0, True, True,
                                   row_capacity=row_capacity)
            d = swiglu_backward_fp8_delayed(h, p, da, bwd.state, bwd.ticket, 3, False, torch.float8_e5m2, 57344.0, 0,
                                            torch.float32, True, True, row_capacity=row_capacity)
            runs.append((a, d, fwd.state.clone(), bwd.state.clone()))
        (a0, d0, f0, b0), (a1, d1, f1, b1) = runs
        assert a1[1].stride() == (cap, 1) and d1[1].stride() == (cap, 1), (m, f, cap)
        assert all(same(x, y) for x, y in zip(a1[:2] + d1[:2], a0[:2] + d0[:2])), (m, f, cap, "delayed")
        assert torch.equal(d1[3], d0[3]) and torch.equal(f1, f0) and torch.equal(b1, b0), (m, f, cap, "delayed")
    try:
        swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, row_capacity=h.shape[0] - 1)
        raise AssertionError("a row capacity under the row count must raise")
    except ValueError as err:
        assert "row_capacity" in str(err)
    print("ok")
    """
)


ROWWISE_CAPACITY_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton import rowwise_layouts as L
    from turbo_moe.quantize import split_packed_scales
    device = DEVICE
    gen = torch.Generator().manual_seed(6)
    fp8 = torch.float8_e4m3fn
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # Rowwise layouts with a row capacity past the row count (a token bucket): the copies, row
    # scales and dprobs are views of the first M rows, with the M-row call's bits; the column scales
    # are the same; the packed scales hold the capacity's row scales, and split_packed_scales finds
    # both parts. Default stats tiles and one-step ones (several stats and cast tiles past M).
    for lens, f, cap in (([5, 0, 40, 17], 24, 96), ([70], 40, 300), ([3, 33, 0, 1], 16, 37)):
        m = sum(lens)
        offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
        h = (torch.randn(m, 2 * f, generator=gen) * 3).to(torch.bfloat16).to(device)
        da = torch.randn(m, f, generator=gen).to(torch.bfloat16).to(device)
        p = torch.rand(m, generator=gen).to(device)
        x = h[:, :f].contiguous()
        for tensor in (True, False):
            want = L.fp8_rowwise_layouts(x, offs, fp8, 448.0) if tensor else L.swiglu_rowwise_layouts(h, p, offs, fp8,
                                                                                                        448.0)
            got = (L.fp8_rowwise_layouts(x, offs, fp8, 448.0, row_capacity=cap) if tensor
                   else L.swiglu_rowwise_layouts(h, p, offs, fp8, 448.0, row_capacity=cap))
            assert got[0].shape == (m, f) and got[2].shape == (f, m) and got[2].stride() == (cap, 1), (lens, cap)
            assert same(got[0], want[0]) and same(got[2], want[2]), (lens, cap, tensor, "copies")
            assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3]), (lens, cap, tensor, "scales")
        want = L.swiglu_backward_rowwise_layouts(h, p, da, offs, fp8, 448.0, 0, torch.float32)
        got = L.swiglu_backward_rowwise_layouts(h, p, da, offs, fp8, 448.0, 0, torch.float32, row_capacity=cap)
        assert got[1].shape == (2 * f, m) and got[1].stride() == (cap, 1) and got[3].shape == (m,), (lens, cap)
        assert same(got[0], want[0]) and same(got[1], want[1]) and torch.equal(got[3], want[3]), (lens, cap, "dh")
        assert got[2].numel() == cap + len(lens) * 2 * f, (lens, cap, "packed")
        for a, b in zip(split_packed_scales(got[2], m, 2 * f, len(lens)),
                        split_packed_scales(want[2], m, 2 * f, len(lens))):
            assert torch.equal(a, b), (lens, cap, "split")
    # a batch of sources (weights: one group each), rows past the count in every batch's buffers
    xs = (torch.randn(3, 21, 40, generator=gen) * torch.logspace(-2, 2, 21)[:, None]).to(torch.bfloat16).to(device)
    want = L.fp8_rowwise_layouts(xs, None, fp8, 448.0)
    got = L.fp8_rowwise_layouts(xs, None, fp8, 448.0, row_capacity=50)
    assert got[0].shape == (3, 21, 40) and got[2].shape == (3, 40, 21) and got[1].shape == (3, 21), "batched"
    assert same(got[0], want[0]) and same(got[2], want[2]) and torch.equal(got[1], want[1]), "batched"
    assert torch.equal(got[3], want[3]), "batched column scales"
    try:
        L.fp8_rowwise_layouts(x, offs, fp8, 448.0, row_capacity=m - 1)
        raise AssertionError("a row capacity under the row count must raise")
    except ValueError as err:
        assert "row_capacity" in str(err)
    print("ok")
    """
)


def test_rowwise_layouts_row_capacity_in_interpreter():
    assert_prints_ok(ROWWISE_CAPACITY_CHECK.replace("DEVICE", "'cpu'"))


@pytest.mark.gpu
def test_rowwise_layouts_row_capacity_on_gpu():
    run_on_gpu(ROWWISE_CAPACITY_CHECK.replace("DEVICE", "'cuda'"), "rowwise_capacity_check")


def test_swiglu_row_capacity_in_interpreter():
    assert_prints_ok(CAPACITY_CHECK.replace("DEVICE", "'cpu'"))


@pytest.mark.gpu
def test_swiglu_row_capacity_on_gpu():
    run_on_gpu(CAPACITY_CHECK.replace("DEVICE", "'cuda'"), "swiglu_capacity_check")


GIVEN_AMAX_CHECK = textwrap.dedent(
    """
    import torch
    from turbo_moe.kernels.triton.swiglu_fp8 import swiglu_amax, swiglu_fp8_tensorwise
    device = DEVICE
    gen = torch.Generator().manual_seed(3)
    for r, f in ((37, 70), (300, 256)):
        h = (torch.randn(r, 2 * f, generator=gen) * 3).to(torch.bfloat16).to(device)
        p = torch.rand(r, generator=gen).to(device)
        plain = swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, write_rows=True, write_transposed=True)
        amax = swiglu_amax(h, p)
        # fc1's epilogue hands partials whose maximum is the amax: one slot each consumer, zeros elsewhere
        partials = torch.zeros(9, device=device)
        partials[4] = amax
        partials[7] = amax * 0.5
        given = swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, write_rows=True, write_transposed=True,
                                      amax_partials=partials)
        for a, b in zip(plain, given):
            assert torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)), (r, f)
        # a wrong maximum shows: the scale follows the partials
        partials[4] = amax * 2
        off = swiglu_fp8_tensorwise(h, p, torch.float8_e4m3fn, 448.0, amax_partials=partials)
        assert not torch.equal(off[2].cpu(), plain[2].cpu())
    print("ok")
    """
)


def test_swiglu_cast_takes_given_amax_partials_in_interpreter():
    """The SwiGLU's cast with fc1's amax partials (``amax_partials``) gives the bits of its own
    amax pass where their maximum is that amax, and follows them where it is not."""
    assert_prints_ok(GIVEN_AMAX_CHECK.replace("DEVICE", "'cpu'"))


@pytest.mark.gpu
def test_swiglu_cast_takes_given_amax_partials_on_gpu():
    run_on_gpu(GIVEN_AMAX_CHECK.replace("DEVICE", "'cuda'"), "swiglu_given_amax_check")


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
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_fused_matches_unfused_bits_and_float64(lens, f, n, fmt, granularity):
    cfg = Float8Config(format=fmt, granularity=granularity)
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


@pytest.mark.parametrize("lens,f,n", CASES)
@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_fine_grained_fused_matches_unfused_bits_and_float64(lens, f, n, granularity):
    """Blockwise and MXFP8 (turbo_moe.fine_grained.swiglu): y and dW bit for bit grouped_gemm_fp8 on
    the activation rounded to h's dtype (the rows copy is quantize_rows of that a, the token copy
    cast from it), dh and dprobs from the fused backward kernel's float32 math, all within FP8's
    bounds of float64; empty groups get dW = 0."""
    cfg = Float8Config(granularity=granularity)
    h, p, w, offs, dy = _problem(lens, f, n)
    h.requires_grad_(), p.requires_grad_(), w.requires_grad_()
    y = grouped_gemm_fp8_swiglu(h, p, w, offs, config=cfg)
    assert y.dtype == h.dtype and y.shape == (sum(lens), n)
    a = weighted_swiglu(h.detach(), p.detach().reshape(-1)).to(h.dtype)
    assert torch.equal(y, grouped_gemm_fp8_with_offs(a, w.detach(), offs, config=cfg, out_dtype=h.dtype))
    y.backward(dy)
    assert torch.equal(w.grad, grouped_wgrad_fp8(dy, a, offs, config=cfg, out_dtype=w.dtype))
    assert h.grad.dtype == h.dtype and p.grad.shape == p.shape and p.grad.dtype == p.dtype
    y64, dh64, dp64, dw64 = _float64_grads(h, p, w, offs, dy)
    # e4m3 everywhere (the fine-grained recipes' default format); bf16 h and a add < 1%
    assert _rel(y, y64) < 0.06
    assert _rel(h.grad, dh64) < 0.06 and _rel(p.grad, dp64) < 0.06 and _rel(w.grad, dw64) < 0.06
    for e in (e for e, n_e in enumerate(lens) if n_e == 0):
        assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e]))


def test_fine_grained_activation_backward_runs_after_fc2s_gradient_is_freed(monkeypatch):
    """The fine-grained fused fc2 is two autograd nodes, as unfused: fc2's output gradient ([M, N])
    is freed before the activation's backward allocates dh ([M, 2F]), so the fusion adds no peak."""
    import weakref

    import turbo_moe.swiglu as sw

    h, p, w, offs, dy = _problem([5, 0, 7], 16, 8)
    h.requires_grad_(), p.requires_grad_(), w.requires_grad_()
    y = grouped_gemm_fp8_swiglu(h, p, w, offs, config=Float8Config(granularity=ScalingGranularity.BLOCKWISE))
    refs, seen = [], []
    y.register_hook(lambda g: refs.append(weakref.ref(g)))  # fc2's output gradient, not kept alive
    backward = sw.weighted_swiglu_backward
    monkeypatch.setattr(sw, "weighted_swiglu_backward",
                        lambda *args: (seen.append(refs[0]() is None), backward(*args))[1])
    (y.float() * dy.float()).sum().backward()  # y's gradient an intermediate, as in a model
    assert seen == [True] and h.grad is not None and p.grad is not None


def test_fine_grained_activation_backward_materializes_no_gradient_for_the_rows_copy():
    """The activation's rows copy (FP8, non-differentiable) gets no zero-filled gradient in the
    backward: the H100 profile of the training step showed one [M, F] FP8 fill per call before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp8 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if ("zero" in name or "fill" in name) and any(
                    isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                    for t in (out if isinstance(out, (tuple, list)) else (out,))):
                self.fp8.append(name)
            return out

    h, p, w, offs, dy = _problem([5, 0, 7], 16, 8)
    h.requires_grad_(), p.requires_grad_(), w.requires_grad_()
    y = grouped_gemm_fp8_swiglu(h, p, w, offs, config=Float8Config(granularity=ScalingGranularity.BLOCKWISE))
    with Log() as log:
        y.backward(dy)
    assert log.fp8 == [] and h.grad is not None and p.grad is not None and w.grad is not None


def _fine_mlp_grads(granularity, handoff, h_also=None, seed=4):
    """fc1 (FineGrainedFP8Function) -> the fused fine-grained SwiGLU + fc2, with or without a
    GradRowsHandoff between them; ``h_also``: a second use of fc1's output added to y (its gradient
    then sums with dh). Returns the gradients of x, probs, W1 and W2, and the handoff."""
    from turbo_moe.autograd import _grouped_gemm_fp8_resolved
    from turbo_moe.fine_grained.autograd import GradRowsHandoff

    cfg = Float8Config(granularity=granularity)
    gen = torch.Generator().manual_seed(seed)
    lens, k, f, n = [40, 0, 91, 128], 96, 128, 64
    m = sum(lens)
    offs = torch.tensor([0] + lens).cumsum(0)
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16().requires_grad_()
    w1 = (torch.randn(len(lens), 2 * f, k, generator=gen) / k ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(len(lens), n, f, generator=gen) / f ** 0.5).bfloat16().requires_grad_()
    p = torch.rand(m, generator=gen).requires_grad_()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    ho = GradRowsHandoff() if handoff else None
    h = _grouped_gemm_fp8_resolved(x, w1, offs, config=cfg, backend="torch", grad_handoff=ho)
    y = grouped_gemm_fp8_swiglu(h, p, w2, offs, config=cfg, backend="torch", h_grad_handoff=ho)
    loss = (y.float() * dy.float()).sum()
    if h_also is not None:
        loss = loss + h_also(h)
    loss.backward()
    return (x.grad, p.grad, w1.grad, w2.grad), ho


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_fine_grained_dh_rows_handoff_is_taken_and_changes_no_bit(granularity, monkeypatch):
    """fc2's backward makes dh's rows copy for fc1's dgrad (GradRowsHandoff): fc1 casts dh once
    fewer, and every gradient is bit for bit the run without the handoff."""
    import turbo_moe.fine_grained.autograd as fine_autograd

    plain, _ = _fine_mlp_grads(granularity, handoff=False)
    casts = []
    rows = fine_autograd.quantize_rows
    monkeypatch.setattr(fine_autograd, "quantize_rows", lambda t, *a: (casts.append(tuple(t.shape)), rows(t, *a))[1])
    handed, ho = _fine_mlp_grads(granularity, handoff=True)
    assert ho.expecting is not None and ho._held is None  # expected by fc1, put by fc2, taken by fc1
    assert (259, 256) not in casts, casts  # dh [M, 2F] never cast by fc1
    for name, a, b in zip(("dx", "dprobs", "dW1", "dW2"), plain, handed):
        assert torch.equal(a, b), name


def test_fine_grained_dh_rows_handoff_steps_aside_for_a_summed_gradient():
    """fc1's output used twice: its gradient is dh plus the other use's, a tensor the rows copy was
    not made for, so fc1 casts it itself: the same bits as without the handoff."""
    also = lambda h: (h.float() * 0.25).sum()  # noqa: E731
    plain, _ = _fine_mlp_grads("blockwise", handoff=False, h_also=also)
    handed, ho = _fine_mlp_grads("blockwise", handoff=True, h_also=also)
    assert ho._held is None
    for name, a, b in zip(("dx", "dprobs", "dW1", "dW2"), plain, handed):
        assert torch.equal(a, b), name


def test_grad_rows_handoff_matches_only_the_tensor_it_was_made_for():
    from turbo_moe.fine_grained.autograd import GradRowsHandoff

    ho = GradRowsHandoff()
    dh, rows, scales = torch.randn(4, 8), torch.zeros(4, 8), torch.ones(4, 1)
    ho.put(dh, rows, scales)
    assert ho.take(dh.clone()) is None and ho.take(dh) is None  # a look drops the held copy either way
    ho.put(dh, rows, scales)
    dh.add_(1.0)  # written in place since (autograd summing another gradient into it)
    assert ho.take(dh) is None
    ho.put(dh, rows, scales)
    got = ho.take(dh)
    assert got[0] is rows and got[1] is scales


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
    from turbo_moe.autograd import QuantizedGradHandoff

    assert fuses_swiglu(Float8Config()) and fuses_swiglu(Float8Config(granularity=ScalingGranularity.ROWWISE))
    assert not fuses_swiglu(None) and not fuses_swiglu(Float8Config(granularity=ScalingGranularity.BLOCKWISE))
    blockwise = Float8Config(granularity=ScalingGranularity.BLOCKWISE)
    assert swiglu_gemm_supports(blockwise) and swiglu_gemm_supports(Float8Config(granularity="mxfp8"))
    assert not swiglu_gemm_supports(None)
    from turbo_moe.fine_grained.autograd import GradRowsHandoff

    with pytest.raises(TypeError, match="h_grad_handoff under fine-grained blockwise scaling must be a .*GradRowsHandoff"):
        grouped_gemm_fp8_swiglu(h, p, w, offs, config=blockwise, h_grad_handoff=QuantizedGradHandoff())
    with pytest.raises(TypeError, match="h_grad_handoff under tensorwise scaling must be a .*QuantizedGradHandoff"):
        grouped_gemm_fp8_swiglu(h, p, w, offs, h_grad_handoff=GradRowsHandoff())
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


# ----------------------------------------------------------------------------------------------
# The grad handoff: fc2's backward writes dh straight into fc1's FP8 layouts
# ----------------------------------------------------------------------------------------------


def _mlp(lens, hidden, f, dtype, handoff, seed=3, observe_h=None, h_also=None, fmt="hybrid", device="cpu",
         backend="torch", granularity="tensorwise"):
    """fc1 (grouped_gemm_fp8) -> weighted SwiGLU + fc2 (grouped_gemm_fp8_swiglu), with or without
    a QuantizedGradHandoff; returns (y, (x, w1, w2, p), dy)."""
    from turbo_moe.autograd import QuantizedGradHandoff, _grouped_gemm_fp8_resolved

    gen = torch.Generator().manual_seed(seed)
    m = sum(lens)
    offs = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64, device=device)

    def leaf(t):
        return t.to(device).requires_grad_()

    x = leaf(torch.randn(m, hidden, generator=gen).to(dtype))
    w1 = leaf((torch.randn(len(lens), 2 * f, hidden, generator=gen) / hidden ** 0.5).to(dtype))
    w2 = leaf((torch.randn(len(lens), hidden, f, generator=gen) / f ** 0.5).to(dtype))
    p = leaf(torch.rand(m, generator=gen) * 0.9 + 0.1)
    dy = torch.randn(m, hidden, generator=gen).to(dtype).to(device)
    cfg = Float8Config(format=fmt, granularity=granularity)
    ho = QuantizedGradHandoff() if handoff else None
    h = _grouped_gemm_fp8_resolved(x, w1, offs, config=cfg, backend=backend, grad_handoff=ho)
    if observe_h is not None:
        h.register_hook(observe_h)
    y = grouped_gemm_fp8_swiglu(h, p, w2, offs, config=cfg, backend=backend, h_grad_handoff=ho)
    if h_also is not None:
        y = y + h_also(h)
    return y, (x, w1, w2, p), dy


def _float64_mlp_grads(lens, hidden, f, seed=3):
    """float64 gradients (x, w1, w2, p) of :func:`_mlp`'s chain on the same bf16 inputs."""
    y, inputs, dy = _mlp(lens, hidden, f, torch.bfloat16, False, seed=seed)
    x, w1, w2, p = (t.detach().double().requires_grad_() for t in inputs)
    dy = dy.cpu()
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    out = []
    for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        g, u = (x[lo:hi] @ w1[e].T).chunk(2, dim=1)
        out.append((torch.nn.functional.silu(g) * u * p[lo:hi, None]) @ w2[e].T)
    torch.cat(out).backward(dy.double())
    return [t.grad for t in (x, w1, w2, p)]


def _grads(inputs):
    return [t.grad.clone() for t in inputs]


def test_grad_handoff_gives_the_same_gradients_without_dh_in_h_dtype(monkeypatch):
    """float32 tensors (dh is float32 either way): with the handoff every gradient is bit-identical
    to the path without it, fc1's backward quantizes no gradient of its own (its dy arrived in FP8)
    and the bf16-style dh kernel never runs; bf16 tensors: within FP8 rounding of the same values
    (without the handoff dh is rounded to bf16 before FP8)."""
    import turbo_moe.autograd as autograd_module
    import turbo_moe.swiglu as swiglu_module

    quantized_shapes, bf16_dh = [], []
    real_q, real_bwd = autograd_module.quantize_tensorwise_layouts, swiglu_module.weighted_swiglu_backward
    monkeypatch.setattr(autograd_module, "quantize_tensorwise_layouts",
                        lambda t, *a, **k: quantized_shapes.append(tuple(t.shape)) or real_q(t, *a, **k))
    monkeypatch.setattr(swiglu_module, "weighted_swiglu_backward",
                        lambda *a, **k: bf16_dh.append(1) or real_bwd(*a, **k))
    lens, hidden, f = [9, 0, 14, 5], 24, 20
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for handoff in (False, True):
            quantized_shapes.clear()
            bf16_dh.clear()
            y, inputs, dy = _mlp(lens, hidden, f, dtype, handoff)
            y.backward(dy)
            results[dtype, handoff] = _grads(inputs)
            dh_shape = (sum(lens), 2 * f)
            assert (dh_shape in quantized_shapes) == (not handoff), quantized_shapes
            assert len(bf16_dh) == (0 if handoff else 1)
    for a, b in zip(results[torch.float32, True], results[torch.float32, False]):
        assert torch.equal(a, b)
    # bf16 against float64 (hybrid: e5m2 gradients, 2 mantissa bits): both paths within the
    # FP8 bound the other tests use, and the handoff no worse than rounding dh to bf16 first
    reference = _float64_mlp_grads([9, 0, 14, 5], 24, 20)
    for name, a, b, ref in zip("x w1 w2 p".split(), results[torch.bfloat16, True], results[torch.bfloat16, False],
                               reference):
        assert _rel(a, ref) < 0.12 and _rel(b, ref) < 0.12, name
        assert _rel(a, ref) <= 1.25 * _rel(b, ref) + 1e-3, (name, _rel(a, ref), _rel(b, ref))
    assert not all(torch.equal(a, b) for a, b in zip(results[torch.bfloat16, True], results[torch.bfloat16, False])), \
        "bf16: dh rounded once (FP8) vs twice (bf16, FP8) should differ somewhere"


def test_grad_handoff_leaves_an_observed_gradient_alone():
    """A hook on fc1's output sees the real dh (equal to the path without the handoff), and the
    gradients are unchanged: the handoff steps aside instead of handing the hook its placeholder."""
    seen = {}
    for handoff in (False, True):
        y, inputs, dy = _mlp([6, 11], 16, 12, torch.float32, handoff,
                             observe_h=lambda g, handoff=handoff: seen.__setitem__(handoff, g.clone()))
        y.backward(dy)
        seen[handoff, "grads"] = _grads(inputs)
    assert seen[True].abs().sum() > 0 and torch.equal(seen[True], seen[False])
    for a, b in zip(seen[True, "grads"], seen[False, "grads"]):
        assert torch.equal(a, b)


def test_grad_handoff_refuses_a_gradient_it_did_not_hand_over():
    """fc1's output also feeds another op: autograd sums the two gradients, fc1's backward gets the
    sum instead of the placeholder and raises instead of dropping the other op's contribution."""
    y, _, dy = _mlp([6, 11], 16, 12, torch.float32, True, h_also=lambda h: h[:, :16] * 2.0)
    with pytest.raises(RuntimeError, match="QuantizedGradHandoff"):
        y.backward(dy)


def test_grad_handoff_needs_per_tensor_or_rowwise_scaling():
    """A blockwise fc1 does not register: fc2 gives dh in h's dtype, fc1 quantizes it itself. A
    rowwise one does, marked rowwise (the scale handed over is both scales, packed)."""
    from turbo_moe.autograd import QuantizedGradHandoff

    ho = QuantizedGradHandoff()
    ho.expect(Float8Config(granularity=ScalingGranularity.BLOCKWISE), True, True)
    assert not ho.expecting
    ho.expect(Float8Config(), True, False)
    assert ho.expecting and ho.need_rows and not ho.need_transposed and not ho.rowwise
    assert ho.take(torch.zeros(2)) is None  # nothing handed over: the producer quantizes dy itself
    ho.expect(Float8Config(granularity=ScalingGranularity.ROWWISE), True, True)
    assert ho.expecting and ho.rowwise


def test_rowwise_grad_handoff_gives_the_same_gradients_without_dh_in_h_dtype(monkeypatch):
    """Rowwise: with the handoff every gradient is bit-identical to the path without it (float32:
    dh has the same values either way, quantized per row and per (group, column) the same way),
    fc1's backward quantizes no gradient of its own, and the bf16-style dh kernel never runs."""
    import turbo_moe.autograd as autograd_module
    import turbo_moe.swiglu as swiglu_module

    quantized_shapes, bf16_dh = [], []
    real_q, real_bwd = autograd_module.quantize_rowwise_layouts, swiglu_module.weighted_swiglu_backward
    monkeypatch.setattr(autograd_module, "quantize_rowwise_layouts",
                        lambda t, *a, **k: quantized_shapes.append(tuple(t.shape)) or real_q(t, *a, **k))
    monkeypatch.setattr(swiglu_module, "weighted_swiglu_backward",
                        lambda *a, **k: bf16_dh.append(1) or real_bwd(*a, **k))
    lens, hidden, f = [9, 0, 14, 5], 24, 20
    results = {}
    for handoff in (False, True):
        quantized_shapes.clear()
        bf16_dh.clear()
        y, inputs, dy = _mlp(lens, hidden, f, torch.float32, handoff, granularity="rowwise")
        y.backward(dy)
        results[handoff] = _grads(inputs)
        assert ((sum(lens), 2 * f) in quantized_shapes) == (not handoff), quantized_shapes
        assert len(bf16_dh) == (0 if handoff else 1)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    reference = _float64_mlp_grads(lens, hidden, f)
    for name, a, ref in zip("x w1 w2 p".split(), results[True], reference):
        assert _rel(a, ref) < 0.12, name


@pytest.mark.gpu
def test_grad_handoff_on_gpu():
    """The Triton path (kernels/triton/swiglu_fp8.py's FP8 backward, fc1's GEMMs on the handed-over
    layouts) at a size spanning many tiles and amax programs: against the path without the
    handoff (float32: the same dh values, up to the compilers' float32 contractions, so an FP8
    rounding may flip now and then) and, in bf16, both against float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
    lens, hidden, f = [700, 0, 1, 2048, 333, 64], 256, 384
    for dtype in (torch.float32, torch.bfloat16):
        results = []
        for handoff in (True, False):
            y, inputs, dy = _mlp(lens, hidden, f, dtype, handoff, device="cuda", backend="triton")
            y.backward(dy)
            results.append([t.grad.cpu() for t in inputs])
        for name, a, b in zip("x w1 w2 p".split(), *results):
            assert a.abs().sum() > 0
            assert _rel(a, b.double()) < (2e-2 if dtype == torch.float32 else 0.15), (dtype, name, _rel(a, b.double()))
