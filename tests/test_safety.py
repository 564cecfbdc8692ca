"""No silently wrong answer (issue 16): tiny and huge magnitudes, second-order gradients, offsets
of every public entry, pickling, the margin's bounds, the meta device and argument-naming errors.

Property tests (hypothesis) draw magnitudes across float32's whole range (subnormals included),
zero rows, ragged offsets, every granularity and format, and check the FP8 error bound of
``fp8_reference`` (per element: half an FP8 ulp relative, or half a subnormal step absolute).
"""

import copy
import io
import pickle
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import turbo_moe
from turbo_moe import Float8Config, GroupedLinearFP8
from turbo_moe.autograd import grouped_gemm_fp8_with_offs, grouped_wgrad_fp8
from turbo_moe.config import MAX_MARGIN, fp8_max
from turbo_moe.quantize import (MAX_QUANT_SCALE, quantize_columnwise, quantize_rowwise, quantize_tensorwise,
                                row_group_ids)

from fp8_reference import (FP8_HALF_SUBNORMAL, FP8_UNIT_ROUNDOFF, assert_within_fp8_bound, fp8_error_bound,
                           fresh_inputs, grouped_matmul_f64, grouped_wgrad_f64, offsets)
from interpreter_child import assert_prints_ok

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max
QUICK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- 1. magnitudes: quantization


def _dequantized(t, granularity, fp8, margin, offs):
    """(dequantized float64 tensor of t's shape, dequant scale per element) for one granularity."""
    if granularity == "tensorwise":
        q, d = quantize_tensorwise(t, fp8, margin)
        d_el = d.double().expand(t.shape)
        return q.double() * d_el, d_el
    if granularity == "rowwise":
        q, d = quantize_rowwise(t, fp8, margin)
        d_el = d.double()[:, None].expand(t.shape)
        return q.double() * d_el, d_el
    q_t, d = quantize_columnwise(t, fp8, margin, group_offs=offs)
    d_el = d.double()[row_group_ids(offs, t.shape[0])]
    return q_t.t().double() * d_el, d_el


@QUICK
@given(
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-149, 125),
    rows=st.integers(0, 9),
    cols=st.integers(1, 9),
    zero_rows=st.lists(st.booleans(), min_size=9, max_size=9),
    granularity=st.sampled_from(["tensorwise", "rowwise", "columnwise"]),
    fp8=st.sampled_from([E4M3, E5M2]),
    margin=st.integers(0, MAX_MARGIN),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    cut=st.lists(st.integers(0, 9), min_size=2, max_size=4),
)
def test_every_finite_magnitude_quantizes_within_the_fp8_bound(seed, exponent, rows, cols, zero_rows, granularity,
                                                              fp8, margin, dtype, cut):
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 2.0**exponent
    x64[torch.tensor(zero_rows[:rows], dtype=torch.bool)] = 0.0
    x = x64.clamp(-FLT_MAX, FLT_MAX).to(dtype)
    bounds = sorted(min(c, rows) for c in cut)
    offs = torch.tensor([0] + bounds + [rows], dtype=torch.int64)  # ragged, some groups empty
    deq, d = _dequantized(x, granularity, fp8, margin, offs)
    # The dequantization scale is a finite, normal, positive float32 for every finite input.
    assert torch.isfinite(d).all() and (d >= 2.0**-126).all(), d
    assert not torch.isnan(deq).any()
    exact = x.double()
    err = (deq - exact).abs()
    allowed = exact.abs() * FP8_UNIT_ROUNDOFF[fp8] + FP8_HALF_SUBNORMAL[fp8] * d
    assert (err <= allowed).all(), (err - allowed).max()
    # The largest element of every slice is never flushed to zero while it is above the FP8 grid's
    # floor at the capped scale (the bug: tiny amax -> scale inf -> all zeros / NaN).
    # (Smaller elements of a slice may round to zero at the slice's scale, within the bound above:
    # with a margin of 6, 1e-4 next to an amax of 1.9 does.)
    floor = FP8_HALF_SUBNORMAL[fp8] * 2.0**-126
    for rows_of, cols_of in _slices(granularity, offs, rows, cols):
        slice_exact, slice_deq = exact[rows_of, cols_of].flatten(), deq[rows_of, cols_of].flatten()
        if slice_exact.numel() and slice_exact.abs().max() > 2 * floor:
            assert slice_deq[slice_exact.abs().argmax()] != 0, (rows_of, cols_of)


def _slices(granularity, offs, rows, cols):
    """(row slice, column slice) of every set of elements that shares one scale."""
    if granularity == "tensorwise":
        return [(slice(None), slice(None))]
    if granularity == "rowwise":
        return [(slice(r, r + 1), slice(None)) for r in range(rows)]
    bounds = offs.tolist()
    return [(slice(bounds[g], bounds[g + 1]), slice(c, c + 1)) for g in range(len(bounds) - 1) for c in range(cols)]


def test_tiny_amax_gets_the_capped_scale_and_zero_rows_stay_zero():
    # The cases: amax below fp8_max / FLT_MAX overflowed the scale to inf, which zeroed the
    # data, and made an all-zero row next to it NaN.
    for fp8 in (E4M3, E5M2):
        x = torch.tensor([[3e-37, -1e-37, 2e-38], [0.0, 0.0, 0.0], [1e-40, 5e-41, 0.0]])
        q, d = quantize_rowwise(x, fp8)
        assert torch.equal(d, torch.full((3,), 2.0**-126).where(torch.tensor([True, False, True]), torch.ones(3)))
        deq = q.float() * d[:, None]
        assert not torch.isnan(deq).any() and torch.equal(deq[1], torch.zeros(3))
        assert (deq[0] != 0).all() and deq[2, 0] != 0
        q, d = quantize_tensorwise(x, fp8)
        assert d.item() == 2.0**-126 and (q.float()[0] != 0).all()
    assert MAX_QUANT_SCALE == 2.0**126 and 1.0 / MAX_QUANT_SCALE == torch.finfo(torch.float32).tiny


def test_nan_and_inf_still_propagate():
    for granularity in ("tensorwise", "rowwise"):
        x = torch.randn(4, 5)
        x[2, 1] = float("nan")
        deq, _ = _dequantized(x, granularity, E4M3, 0, None)
        nan_rows = torch.isnan(deq).any(1).tolist()
        assert nan_rows == ([True] * 4 if granularity == "tensorwise" else [False, False, True, False])
        x[2, 1] = float("inf")
        deq, _ = _dequantized(x, granularity, E4M3, 0, None)
        assert not torch.isfinite(deq[2]).all()


def test_margin_8_keeps_huge_tensors_finite():
    x = torch.tensor([[FLT_MAX, -1.0], [3.0, FLT_MAX / 3]])
    for fp8 in (E4M3, E5M2):
        for granularity in ("tensorwise", "rowwise"):
            deq, d = _dequantized(x, granularity, fp8, MAX_MARGIN, None)
            assert torch.isfinite(d).all()
            assert abs(deq[0, 0].item() / FLT_MAX - 1) <= FP8_UNIT_ROUNDOFF[fp8], deq[0, 0]


# ---------------------------------------------------------------- 1. magnitudes: the GEMMs


@pytest.mark.parametrize("exponent", [0, -100, -120, -124, -127, -130])
@pytest.mark.parametrize("tiny", ["x", "w"])
def test_forward_at_tiny_magnitudes_is_within_the_fp8_bound(exponent, tiny):
    lens = [5, 0, 9, 3]
    x, w, glens = fresh_inputs(lens, 12, 24, seed=exponent & 0xFF)
    if tiny == "x":
        x = x * 2.0**exponent
    else:
        w = w * 2.0**exponent
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, backend="torch")
    ref = grouped_matmul_f64(x, w, lens)
    quant_scale = lambda t: min(fp8_max(E4M3) / t.abs().max().item(), MAX_QUANT_SCALE)  # noqa: E731
    sx, sw = quant_scale(x), quant_scale(w)
    offs = offsets(lens)
    for g, (lo, hi) in enumerate(zip(offs[:-1], offs[1:])):
        bound = fp8_error_bound(x[lo:hi].double(), w[g].double(), (E4M3, sx), (E4M3, sw), torch.float32, 24)
        bound += 2.0**-147  # the epilogue's float32-subnormal roundings (acc * 2**-126 * b_scale)
        assert_within_fp8_bound(y[lo:hi], ref[lo:hi], bound, torch.float32, f"group {g} at 2**{exponent}")
    assert (y[:5] != 0).any() and (y[5:14] != 0).any()


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_hybrid_backward_with_tiny_dy_is_not_zero(granularity):
    # The issue: dy * 1e-35 in e5m2 overflowed the scale and gave dx = dW = 0.
    lens = [7, 0, 11]
    x, w, glens = fresh_inputs(lens, 16, 24, seed=3)
    x.requires_grad_(), w.requires_grad_()
    cfg = Float8Config(format="hybrid", granularity=granularity)
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, config=cfg, backend="torch")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)) * 1e-35
    y.backward(dy)
    dx_ref = torch.cat([dy[lo:hi].double() @ w[g].double() for g, (lo, hi) in
                        enumerate(zip(offsets(lens)[:-1], offsets(lens)[1:]))])
    dw_ref = grouped_wgrad_f64(dy, x, lens)
    for got, ref in ((x.grad, dx_ref), (w.grad, dw_ref)):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 0.15, rel  # e5m2 x e4m3: ~2**-3 per element at worst, far less in norm
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


# ---------------------------------------------------------------- 2. second-order gradients


def _double_backward(backend, bias=False):
    lens = [3, 0, 5]
    x, w, glens = fresh_inputs(lens, 8, 16, seed=5)
    x.requires_grad_(), w.requires_grad_()
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, backend=backend)
    if bias:
        b = torch.randn(3, 8, requires_grad=True)
        y = turbo_moe.autograd.add_group_bias(y, b, torch.tensor(offsets(lens)))
        (gb,) = torch.autograd.grad(y.square().sum(), b, create_graph=True)
        gb.square().sum().backward()
        return
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    gx.square().sum().backward()  # a gradient penalty: needs d(dx)/dW


@pytest.mark.parametrize("bias", [False, True])
def test_double_backward_raises_once_differentiable(bias):
    with pytest.raises(RuntimeError, match="once_differentiable"):
        _double_backward("torch", bias)


def test_first_order_gradients_unchanged_under_create_graph():
    lens = [3, 0, 5]
    x, w, glens = fresh_inputs(lens, 8, 16, seed=6)
    x.requires_grad_(), w.requires_grad_()
    loss = turbo_moe.grouped_gemm_fp8(x, w, glens).square().sum()
    g1 = torch.autograd.grad(loss, (x, w), retain_graph=True)
    g2 = torch.autograd.grad(loss, (x, w), create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


# ---------------------------------------------------------------- 3. offsets of every public entry


BAD_OFFS = [
    (torch.tensor([0, 4, 8, 40]), r"group_offs\[-1\]=40 but x has 12 rows"),  # the case
    (torch.tensor([0, 4, 8, 11]), r"group_offs\[-1\]=11"),
    (torch.tensor([0, 8, 4, 12]), "non-decreasing"),
    (torch.tensor([2, 4, 8, 12]), r"group_offs\[0\] must be 0"),
    (torch.tensor([0, -4, 8, 12]), "non-decreasing"),
    (torch.tensor([0, 4, 8, 12]).float(), "group_offs must be int64"),
    (torch.tensor([[0, 4, 8, 12]]), "group_offs must be 1-D"),
    (torch.tensor([0]), r"len\(group_offs\)=1"),
    ([0, 4, 8, 12], "group_offs must be an integer torch.Tensor"),
    (torch.tensor([0, 4, 8, 12], device="meta"), "group_offs must be on the data's device"),
]


@pytest.mark.parametrize("offs, match", BAD_OFFS)
def test_grouped_wgrad_fp8_checks_its_offsets(offs, match):
    dy, x = torch.randn(12, 8), torch.randn(12, 16)
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_wgrad_fp8(dy, x, offs)


@pytest.mark.parametrize("offs, match", BAD_OFFS[:-3])
def test_grouped_gemm_fp8_with_offs_checks_its_offsets(offs, match):
    x, w = torch.randn(12, 16), torch.randn(3, 8, 16)
    with pytest.raises((ValueError, TypeError), match=match.replace("group_offs", "offs")):
        grouped_gemm_fp8_with_offs(x, w, offs)
    with pytest.raises(ValueError, match=r"len\(offs\)=3 but w has 3 groups"):
        grouped_gemm_fp8_with_offs(x, w, torch.tensor([0, 6, 12]))


def test_grouped_wgrad_fp8_checks_its_operands():
    offs = torch.tensor([0, 4, 12])
    for dy, x, error, match in (
        (torch.randn(12, 8), torch.randn(11, 16), ValueError, r"dy.shape\[0\]=12 and x.shape\[0\]=11"),
        (torch.randn(12, 8).to(E4M3), torch.randn(12, 16), TypeError, "dy must be bfloat16"),
        (torch.randn(12, 8), torch.randn(12, 16, 1), ValueError, "x must be 2-D"),
        ([1.0], torch.randn(12, 16), TypeError, "dy must be a torch.Tensor"),
        (torch.randn(12, 8), torch.randn(12, 16, device="meta"), ValueError, "same device"),
    ):
        with pytest.raises(error, match=match):
            grouped_wgrad_fp8(dy, x, offs)
    with pytest.raises(TypeError, match="config must be a turbo_moe.Float8Config"):
        grouped_wgrad_fp8(torch.randn(12, 8), torch.randn(12, 16), offs, config="e4m3")


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    granularity=st.sampled_from(["tensorwise", "rowwise"]),
    fmt=st.sampled_from(["e4m3", "hybrid"]),
    seed=st.integers(0, 2**31 - 1),
    bad_index=st.integers(0, 5),
    bad_delta=st.sampled_from([-3, -1, 1, 5]),
)
def test_wgrad_on_ragged_offsets_equals_the_backward_and_bad_ones_raise(lens, granularity, fmt, seed, bad_index,
                                                                        bad_delta):
    cfg = Float8Config(format=fmt, granularity=granularity)
    x, w, glens = fresh_inputs(lens, 6, 10, seed=seed)
    w.requires_grad_()
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, config=cfg, backend="torch")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    y.backward(dy)
    offs = torch.tensor(offsets(lens))
    dw = grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch")
    assert torch.equal(dw, w.grad)  # quantized exactly as the backward quantizes it
    bad = offs.clone()
    i = bad_index % len(bad)
    bad[i] += bad_delta
    if bad[0] != 0 or (bad[1:] < bad[:-1]).any() or bad[-1] != x.shape[0]:
        with pytest.raises(ValueError, match="group_offs"):
            grouped_wgrad_fp8(dy, x, bad, config=cfg, backend="torch")


# ---------------------------------------------------------------- 4. pickle, deepcopy, torch.save


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_module_round_trips_with_a_populated_fp8_cache(granularity):
    layer = GroupedLinearFP8(3, 16, 8, bias=True, config=Float8Config(granularity=granularity), cache_fp8_weight=True)
    x, _, lens = fresh_inputs([4, 0, 6], 8, 16, seed=7)
    y = layer(x, lens)
    assert layer._fp8_weight_cache is not None
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    copies = [pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer), torch.load(buf, weights_only=False)]
    assert layer._fp8_weight_cache is not None  # the original keeps its cache
    for other in copies:
        assert other._fp8_weight_cache is None
        assert torch.equal(other(x, lens), y)
        assert other._fp8_weight_cache is not None  # rebuilt on first use
        with torch.no_grad():
            other.weight.mul_(2)
        assert not torch.equal(other(x, lens), y)  # and tracks the copy's own weight
    assert torch.equal(layer(x, lens), y)


# ---------------------------------------------------------------- 5. margin


def test_margin_bounds_name_the_field():
    for bad in (True, False, -1, MAX_MARGIN + 1, 19, 200, 1.0, "2"):
        with pytest.raises(ValueError, match=r"Float8Config.margin must be an int in \[0, 8\]"):
            Float8Config(margin=bad)
    assert Float8Config(margin=MAX_MARGIN).margin == MAX_MARGIN


@pytest.mark.parametrize("margin", [0, 3, MAX_MARGIN])
def test_every_allowed_margin_gives_a_good_answer(margin):
    lens = [6, 0, 9]
    x, w, glens = fresh_inputs(lens, 8, 32, seed=8)
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, config=Float8Config(margin=margin))
    ref = grouped_matmul_f64(x, w, lens)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.06 * 2 ** (margin / 2)


# ---------------------------------------------------------------- 6. small items


def test_module_called_with_a_list_names_x():
    layer = GroupedLinearFP8(2, 4, 4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        layer([[1.0] * 4], torch.tensor([1, 0]))


def test_from_megatron_names_its_argument():
    with pytest.raises(ValueError, match=r"from_megatron\(fp8='fp8'\)"):
        Float8Config.from_megatron("fp8")


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("trans_b", [True, False])
def test_meta_device_infers_shapes(granularity, trans_b):
    cfg = Float8Config(granularity=granularity, format="hybrid")
    x = torch.empty(10, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty((3, 8, 16) if trans_b else (3, 16, 8), device="meta", requires_grad=True)
    lens = torch.empty(3, dtype=torch.int64, device="meta")
    y = turbo_moe.grouped_gemm_fp8(x, w, lens, trans_b=trans_b, config=cfg, out_dtype=torch.float32)
    assert (y.shape, y.dtype, y.device.type) == ((10, 8), torch.float32, "meta")
    y.sum().backward()
    assert (x.grad.shape, x.grad.dtype, w.grad.shape, w.grad.dtype) == (x.shape, x.dtype, w.shape, w.dtype)
    y = turbo_moe.grouped_gemm(x, w, lens, trans_b=trans_b)
    assert (y.shape, y.dtype, y.device.type) == ((10, 8), torch.bfloat16, "meta")
    layer = GroupedLinearFP8(3, 16, 8, bias=True, config=cfg, device="meta", cache_fp8_weight=True)
    y = layer(x, group_offs=torch.empty(4, dtype=torch.int64, device="meta"))
    assert (y.shape, y.dtype, y.device.type) == ((10, 8), torch.bfloat16, "meta")
    dw = grouped_wgrad_fp8(torch.empty(10, 8, device="meta"), x, torch.empty(4, dtype=torch.int64, device="meta"),
                           config=cfg)
    assert (dw.shape, dw.dtype, dw.device.type) == ((3, 8, 16), torch.float32, "meta")


# ---------------------------------------------------------------- Triton (interpreter)

TRITON_CHECK = textwrap.dedent(
    """
    import torch, turbo_moe
    from turbo_moe.autograd import grouped_wgrad_fp8
    from fp8_reference import fresh_inputs, grouped_matmul_f64, offsets
    lens = [3, 0, 5]
    x, w, glens = fresh_inputs(lens, 16, 32, seed=9)
    x.requires_grad_(), w.requires_grad_()
    y = turbo_moe.grouped_gemm_fp8(x, w, glens, backend="triton")
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    try:
        gx.square().sum().backward()
        raise SystemExit("double backward did not raise")
    except RuntimeError as e:
        assert "once_differentiable" in str(e), e
    try:
        grouped_wgrad_fp8(torch.randn(8, 16), x.detach(), torch.tensor([0, 4, 8, 40]), backend="triton")
        raise SystemExit("bad offsets accepted")
    except ValueError as e:
        assert "group_offs[-1]=40" in str(e), e
    for scale in (2.0**-126, 2.0**-130):  # tiny x through the Triton GEMM
        y = turbo_moe.grouped_gemm_fp8(x.detach() * scale, w.detach(), glens, backend="triton")
        ref = grouped_matmul_f64(x * scale, w, lens)
        rel = ((y.double() - ref).norm() / ref.norm()).item()
        assert rel < 0.1, (scale, rel)
    print("ok")
    """
)


def test_triton_interpreter_double_backward_offsets_and_tiny_inputs():
    assert_prints_ok(TRITON_CHECK)


# ------------------------------------------- offsets checked once, re-checked once they could differ

def test_resolved_offsets_are_checked_once_and_again_after_any_change(monkeypatch):
    """Offsets that resolve_group_offs / check_group_offs returned come back unchecked only while
    they are the same tensor, unmodified, for the same number of rows."""
    from turbo_moe import checks

    calls = []
    real = checks._check_on_host
    monkeypatch.setattr(checks, "_check_on_host", lambda *a: (calls.append(a[0]), real(*a)))
    lens = torch.tensor([3, 0, 5, 2])
    offs = checks.resolve_group_offs(lens, None, 4, 10, torch.device("cpu"))
    assert calls == ["group_lens"]
    assert checks.check_group_offs(offs, 4, 10, torch.device("cpu")) is offs and len(calls) == 1
    # an equal but different tensor is checked
    assert torch.equal(checks.check_group_offs(offs.clone(), 4, 10, torch.device("cpu")), offs) and len(calls) == 2
    # the same tensor for another number of rows is checked (and here refused)
    with pytest.raises(ValueError, match="x has 11 rows"):
        checks.check_group_offs(offs, 4, 11, torch.device("cpu"))
    # the wrong number of groups is refused by the metadata check, which always runs
    with pytest.raises(ValueError, match="len\\(group_offs\\)=5"):
        checks.check_group_offs(offs, 3, 10, torch.device("cpu"))
    # an in-place change bumps the version: checked again, and a now-decreasing offset is refused
    offs[2] = 9
    with pytest.raises(ValueError, match="non-decreasing"):
        checks.check_group_offs(offs, 4, 10, torch.device("cpu"))


def test_remembered_offsets_do_not_outlive_their_tensors():
    from turbo_moe import checks

    before = len(checks._checked)
    for _ in range(50):
        checks.resolve_group_offs(torch.tensor([1, 2, 3]), None, 3, 6, torch.device("cpu"))
    assert len(checks._checked) <= before + 1
    with torch.inference_mode():  # inference tensors have no version counter: never remembered
        offs = checks.resolve_group_offs(torch.tensor([1, 2, 3]), None, 3, 6, torch.device("cpu"))
    assert id(offs) not in checks._checked
