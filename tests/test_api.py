"""Public API: the module, configuration, dispatch, packaging and every bad input."""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import turbo_moe
from turbo_moe import BackendUnavailable, Float8Config, GroupedLinearFP8
from turbo_moe.backends import AUTO_ORDER, GemmKind, GroupedGemmProblem, get_backend, select_backend

from fp8_reference import fresh_inputs, grouped_matmul_f64

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- packaging
def test_kernels_install_as_turbo_moe_kernels_not_kernels(tmp_path):
    """As installed (run outside the checkout): our kernels are turbo_moe.kernels, never `kernels`."""
    code = textwrap.dedent(
        """
        import importlib.util, pathlib
        spec = importlib.util.find_spec("turbo_moe.kernels")
        print(pathlib.Path(spec.origin).parent)
        import turbo_moe.kernels.tile_scheduler
        top = importlib.util.find_spec("kernels")
        print(None if top is None else pathlib.Path(top.origin or "").parent)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ours, top = out.stdout.split()
    assert pathlib.Path(ours).name == "kernels" and pathlib.Path(ours).parent.name != "site-packages"
    # The unrelated PyPI package `kernels` must stay importable by its own name: ours never claims it.
    assert top != ours


def test_distribution_names():
    from importlib import metadata

    dist = metadata.distribution("turbo_moe")
    assert dist.metadata["Name"] == "turbo_moe"
    assert dist.version == turbo_moe.__version__


def test_import_needs_only_torch():
    """Block every optional backend library: turbo_moe imports and runs on the torch backend."""
    code = textwrap.dedent(
        """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('triton', 'flydsl', 'megatron', 'transformer_engine'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import torch, turbo_moe
        m = turbo_moe.GroupedLinearFP8(2, 16, 8)
        y = m(torch.randn(5, 16), torch.tensor([2, 3]))
        y.sum().backward()
        print(turbo_moe.available_backends()['triton'] != 'available', 'triton' not in sys.modules, y.shape)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "torch.Size([5,", "8])"]


# ---------------------------------------------------------------- module
def test_module_forward_matches_functional_and_bias():
    torch.manual_seed(0)
    m = GroupedLinearFP8(3, 40, 24, bias=True)
    x = torch.randn(19, 40)
    lens = torch.tensor([7, 0, 12])
    y = m(x, lens)
    expected = turbo_moe.grouped_gemm_fp8(x, m.weight, lens)
    expected = expected + torch.cat([m.bias[0].expand(7, -1), m.bias[2].expand(12, -1)])
    assert torch.equal(y, expected)
    y.sum().backward()
    assert torch.allclose(m.bias.grad[0], torch.full((24,), 7.0))
    assert torch.equal(m.bias.grad[1], torch.zeros(24))


def test_module_init_matches_nn_linear_per_expert():
    torch.manual_seed(1)
    m = GroupedLinearFP8(8, 256, 64, bias=True)
    bound = 1 / math.sqrt(256)
    assert m.weight.shape == (8, 64, 256) and m.bias.shape == (8, 64)
    assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound
    # U(-b, b) has std b/sqrt(3); 131072 samples pin it within 1%.
    assert abs(m.weight.std().item() - bound / math.sqrt(3)) < 0.01 * bound
    assert not torch.equal(m.weight[0], m.weight[1])


def test_module_repr_and_state_dict_round_trip():
    torch.manual_seed(2)
    m = GroupedLinearFP8(4, 32, 16, bias=True, config=Float8Config(format="hybrid"), num_cu=8)
    text = repr(m)
    for part in ("num_groups=4", "in_features=32", "out_features=16", "format=hybrid", "num_cu=8"):
        assert part in text
    m2 = GroupedLinearFP8(4, 32, 16, bias=True, config=Float8Config(format="hybrid"), num_cu=8)
    m2.load_state_dict(m.state_dict())
    assert set(m.state_dict()) == {"weight", "bias"}
    x, lens = torch.randn(10, 32), torch.tensor([1, 2, 3, 4])
    assert torch.equal(m(x, lens), m2(x, lens))


def test_module_under_autocast_returns_autocast_dtype():
    torch.manual_seed(3)
    m = GroupedLinearFP8(2, 32, 16)
    x = torch.randn(9, 32, requires_grad=True)
    lens = torch.tensor([4, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, lens)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32
    # Same FP8 math as outside autocast, up to the bf16 output cast.
    ref = m(x.detach(), lens)
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("fn", ["grouped_gemm_fp8", "grouped_gemm"])
def test_functional_under_autocast_follows_f_linear(fn):
    """As F.linear: float32 inputs under CPU autocast give the autocast dtype; out_dtype given wins;
    the values are the float32 call's, rounded once to the autocast dtype; grads stay float32."""
    torch.manual_seed(5)
    gemm = getattr(turbo_moe, fn)
    x, w, lens = fresh_inputs([4, 0, 7, 2], 24, 40, dtype=torch.float32, seed=5)
    x.requires_grad_(True)
    ref = gemm(x.detach(), w, lens)
    for autocast_dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=autocast_dtype):
            y = gemm(x, w, lens)
            linear_dtype = torch.nn.functional.linear(x[:1], w[0]).dtype
            y_fp32 = gemm(x.detach(), w, lens, out_dtype=torch.float32)
        assert linear_dtype == autocast_dtype
        assert y.dtype == autocast_dtype
        assert y_fp32.dtype == torch.float32
        if fn == "grouped_gemm_fp8":
            # Same FP8 math and fp32 accumulation; only the final cast differs.
            assert torch.equal(y, ref.to(autocast_dtype))
            assert torch.equal(y_fp32, ref)
        else:
            # The high-precision path computes in the autocast dtype, as F.linear does: its
            # inputs are rounded to it (relative 2**-9 for bf16), so the whole result is close.
            rel = float((y.detach().double() - ref.double()).norm() / ref.double().norm())
            assert rel < 2**-6, rel
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    # Autocast off (also inside an autocast region): the input dtype.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert gemm(x.detach(), w, lens).dtype == torch.float32
    # A device type without autocast (meta) is no error: the input dtype.
    from turbo_moe.autograd import _autocast_out_dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast_out_dtype(torch.empty(2, 3, device="meta"), None) == torch.float32
        assert _autocast_out_dtype(x, torch.float16) == torch.float16


def test_module_and_functional_agree_under_autocast():
    torch.manual_seed(6)
    m = GroupedLinearFP8(3, 40, 24, bias=True)
    x, lens = torch.randn(13, 40), torch.tensor([6, 0, 7])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_module = m(x, lens)
        y_functional = turbo_moe.grouped_gemm_fp8(x, m.weight, lens)
        y_linear = torch.nn.functional.linear(x, m.weight[0], m.bias[0])
    assert y_module.dtype == y_functional.dtype == y_linear.dtype == torch.bfloat16
    offs = [0, 6, 6, 13]
    expected = torch.cat([y_functional[offs[g]:offs[g + 1]] + m.bias[g].to(torch.bfloat16) for g in range(3)])
    assert torch.equal(y_module, expected.detach())


def test_module_under_torch_compile():
    torch.manual_seed(4)
    m = GroupedLinearFP8(3, 32, 16, bias=True)
    x, lens = torch.randn(12, 32), torch.tensor([5, 0, 7])
    compiled = torch.compile(m, backend="eager")
    assert torch.equal(compiled(x, lens), m(x, lens))


def test_module_trains_a_regression_problem():
    """A few SGD steps on a grouped linear regression reduce the loss substantially."""
    torch.manual_seed(5)
    target = GroupedLinearFP8(4, 32, 16)
    m = GroupedLinearFP8(4, 32, 16)
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    lens = torch.tensor([30, 10, 0, 24])
    losses = []
    for _ in range(40):
        x = torch.randn(64, 32)
        with torch.no_grad():
            y_true = grouped_matmul_f64(x, target.weight, lens.tolist()).float()
        loss = torch.nn.functional.mse_loss(m(x, lens), y_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


# ---------------------------------------------------------------- config
def test_float8_config_validation():
    assert Float8Config().grad_dtype == torch.float8_e4m3fn
    assert Float8Config(format="hybrid").grad_dtype == torch.float8_e5m2
    assert Float8Config.from_megatron("hybrid").format.value == "hybrid"
    with pytest.raises(ValueError, match="format"):
        Float8Config(format="e3m4")
    with pytest.raises(ValueError, match="granularity"):
        Float8Config(granularity="per_block")
    assert Float8Config(granularity="blockwise", power_of_two_scales=True).fine_grained
    assert Float8Config(granularity="mxfp8").fine_grained and not Float8Config(granularity="rowwise").fine_grained
    with pytest.raises(ValueError, match="power_of_two_scales.*blockwise"):
        Float8Config(granularity="mxfp8", power_of_two_scales=True)
    with pytest.raises(TypeError, match="power_of_two_scales"):
        Float8Config(granularity="blockwise", power_of_two_scales=1)
    assert Float8Config(strategy="delayed").delayed  # tests/test_delayed_scaling.py
    with pytest.raises(ValueError, match="delayed"):
        Float8Config(strategy="delayed", granularity="rowwise")
    with pytest.raises(ValueError, match="margin"):
        Float8Config(margin=-1)
    assert not Float8Config().promotes_accumulation
    assert Float8Config(accumulation="promoted").promotes_accumulation
    with pytest.raises(ValueError, match="Float8Config.accumulation"):
        Float8Config(accumulation="exact")


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_promoted_accumulation_reaches_every_gemm_and_changes_no_fp32_result(granularity):
    """accumulation="promoted" is carried to the fwd, dgrad and wgrad problems (their dispatch
    records say so), and where products accumulate in fp32 anyway (the torch reference) the results
    are bit-identical to "fast"."""
    x, w, lens = fresh_inputs([5, 0, 9], 24, 16, seed=3)
    dy = torch.randn(x.shape[0], 24, generator=torch.Generator().manual_seed(4))
    results = {}
    for mode in ("fast", "promoted"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        turbo_moe.backends.clear_recent_dispatches()
        y = turbo_moe.grouped_gemm_fp8(xx, ww, lens, config=Float8Config(granularity=granularity, accumulation=mode))
        y.backward(dy)
        problems = [r.problem for r in turbo_moe.recent_dispatches()]
        assert len(problems) == 3 and all(("promoted-acc" in p) == (mode == "promoted") for p in problems), problems
        results[mode] = (y, xx.grad, ww.grad)
    for fast, promoted in zip(results["fast"], results["promoted"]):
        assert torch.equal(fast, promoted)


# ---------------------------------------------------------------- dispatch
def test_auto_dispatch_on_cpu_records_reasons():
    x, w, lens = fresh_inputs([3, 4], 16, 16, seed=1)
    turbo_moe.grouped_gemm_fp8(x, w, lens)
    record = turbo_moe.recent_dispatches()[-1]
    assert record.chosen == "torch"
    assert [name for name, _ in record.passed_over] == [n for n in AUTO_ORDER if n != "torch"]
    assert all(why for _, why in record.passed_over)


def test_dispatch_log_line(caplog):
    x, w, lens = fresh_inputs([3, 4], 16, 16, seed=1)
    import logging

    with caplog.at_level(logging.DEBUG, logger="turbo_moe.dispatch"):
        turbo_moe.grouped_gemm_fp8(x, w, lens)
    assert any("fwd G=2 M=7 N=16 K=16" in r.message and "-> torch" in r.message for r in caplog.records)


def test_named_backend_that_cannot_run_raises_with_reason():
    x, w, lens = fresh_inputs([3, 4], 16, 16, seed=1)
    for name in ("triton", "flydsl"):
        with pytest.raises(BackendUnavailable, match=f"backend='{name}'"):
            turbo_moe.grouped_gemm_fp8(x, w, lens, backend=name)
    with pytest.raises(ValueError, match="backend='cutlass'"):
        turbo_moe.grouped_gemm_fp8(x, w, lens, backend="cutlass")


def test_backend_objects_expose_the_contract():
    torch_backend = get_backend("torch")
    assert torch_backend.is_available() == (True, "")
    a = torch.randn(6, 8).to(torch.float8_e4m3fn)
    b = torch.randn(2, 4, 8).to(torch.float8_e4m3fn)
    offs = torch.tensor([0, 2, 6])
    one = torch.tensor(1.0)
    p = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, one, one, offs, torch.float32)
    assert select_backend(p, "torch") is torch_backend
    out = torch_backend.run(p)
    torch.testing.assert_close(out[2:], a[2:].float() @ b[1].float().T)


# ---------------------------------------------------------------- bad input
def _good():
    x, w, lens = fresh_inputs([3, 4], 16, 24, seed=2)
    return x, w, lens


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda x, w, l: (x.to(torch.int32), w, l), TypeError, "x must be bfloat16"),
        (lambda x, w, l: (x.to(torch.float8_e4m3fn), w, l), TypeError, "x must be"),
        (lambda x, w, l: (x, w.to(torch.float64), l), TypeError, "w must be"),
        (lambda x, w, l: (x[None], w, l), ValueError, "x must be 2-D"),
        (lambda x, w, l: (x, w[0], l), ValueError, "w must be 3-D"),
        (lambda x, w, l: (x[:, :8], w, l), ValueError, r"x.shape\[1\]=8"),
        (lambda x, w, l: (x, w[:0], l[:0]), ValueError, "0 groups"),
        (lambda x, w, l: (x, w, l.float()), TypeError, "group_lens must be int64"),
        (lambda x, w, l: (x, w, l.tolist()), TypeError, "group_lens must be an integer torch.Tensor"),
        (lambda x, w, l: (x, w, l[None]), ValueError, "group_lens must be 1-D"),
        (lambda x, w, l: (x, w, l[:1]), ValueError, r"len\(group_lens\)=1 but w has 2 groups"),
        (lambda x, w, l: (x, w, torch.tensor([8, -1])), ValueError, "negative"),
        (lambda x, w, l: (x, w, torch.tensor([3, 5])), ValueError, "sums to 8 but x has 7 rows"),
        (lambda x, w, l: (x, w, torch.tensor([3, 3])), ValueError, "sums to 6 but x has 7 rows"),
        (lambda x, w, l: (x, w, l.to("meta")), ValueError, "group_lens must be on the data's device"),
        (lambda x, w, l: (x, w.to("meta"), l), ValueError, "same device"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, error, match):
    x, w, lens = mutate(*_good())
    with pytest.raises(error, match=match):
        turbo_moe.grouped_gemm_fp8(x, w, lens)


def test_bad_group_offs():
    x, w, _ = _good()
    for offs, match in (
        (torch.tensor([1, 3, 7]), r"group_offs\[0\] must be 0"),
        (torch.tensor([0, 5, 4]), "non-decreasing"),
        (torch.tensor([0, 3, 6]), r"group_offs\[-1\]=6 but x has 7 rows"),
        (torch.tensor([0, 7]), r"len\(group_offs\)=2"),
    ):
        with pytest.raises(ValueError, match=match):
            turbo_moe.grouped_gemm_fp8(x, w, group_offs=offs)
    with pytest.raises(ValueError, match="exactly one of group_lens and group_offs"):
        turbo_moe.grouped_gemm_fp8(x, w)
    with pytest.raises(ValueError, match="exactly one of group_lens and group_offs"):
        turbo_moe.grouped_gemm_fp8(x, w, torch.tensor([3, 4]), group_offs=torch.tensor([0, 3, 7]))


def test_bad_options():
    x, w, lens = _good()
    with pytest.raises(ValueError, match="num_cu"):
        turbo_moe.grouped_gemm_fp8(x, w, lens, num_cu=0)
    with pytest.raises(TypeError, match="config must be a turbo_moe.Float8Config"):
        turbo_moe.grouped_gemm_fp8(x, w, lens, config={"format": "e4m3"})
    with pytest.raises(TypeError, match="out_dtype"):
        turbo_moe.grouped_gemm_fp8(x, w, lens, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        GroupedLinearFP8(0, 8, 8)
    with pytest.raises(ValueError, match="in_features"):
        GroupedLinearFP8(2, -8, 8)
    with pytest.raises(ValueError, match="x must be 2-D"):
        GroupedLinearFP8(2, 8, 8)(torch.randn(2, 3, 8), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"x.shape\[1\]=9"):
        GroupedLinearFP8(2, 8, 8)(torch.randn(3, 9), torch.tensor([1, 2]))


# ---------------------------------------------------------------- the high-precision twin
def test_grouped_gemm_high_precision():
    x, w, lens = fresh_inputs([5, 0, 9], 20, 28, seed=14)
    x.requires_grad_(True)
    y = turbo_moe.grouped_gemm(x, w, lens)
    torch.testing.assert_close(y.double(), grouped_matmul_f64(x, w, [5, 0, 9]), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad.shape == x.shape
    y2 = turbo_moe.grouped_gemm(x, w.transpose(1, 2).contiguous(), lens, trans_b=False)
    torch.testing.assert_close(y, y2, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="config must be None"):
        turbo_moe.grouped_gemm(x, w, lens, config=Float8Config())
    with pytest.raises(ValueError, match="backend='triton'"):
        turbo_moe.grouped_gemm(x, w, lens, backend="triton")


# ---------------------------------------------------------------- FP8 weight cache
def test_fp8_weight_cache_matches_uncached_and_tracks_updates():
    torch.manual_seed(6)
    cached = GroupedLinearFP8(3, 32, 24)  # the cache is the default
    plain = GroupedLinearFP8(3, 32, 24, cache_fp8_weight=False)
    plain.load_state_dict(cached.state_dict())
    opt = torch.optim.SGD(cached.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    lens = torch.tensor([5, 0, 11])
    calls = []
    import turbo_moe.module as module_mod

    real = module_mod.quantize_weight
    module_mod.quantize_weight = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for step in range(3):
            for micro in range(2):  # gradient accumulation: one quantization per optimizer step
                x = torch.randn(16, 32)
                y_c, y_p = cached(x, lens), plain(x, lens)
                assert torch.equal(y_c, y_p)
                y_c.sum().backward()
                y_p.sum().backward()
            assert torch.equal(cached.weight.grad, plain.weight.grad)
            opt.step()
            opt_plain.step()
            opt.zero_grad()
            opt_plain.zero_grad()
        assert len(calls) == 3, calls
        x = torch.randn(16, 32)
        assert torch.equal(cached(x, lens), plain(x, lens))  # quantizes the stepped weight: call 4
        assert len(calls) == 4, calls
        cached.weight.data.mul_(2)  # behind the version counter: a stale cache until invalidated
        plain.weight.data.mul_(2)
        assert not torch.equal(cached(x, lens), plain(x, lens))
        cached.invalidate_fp8_weight_cache()
        assert torch.equal(cached(x, lens), plain(x, lens))
        plain2 = GroupedLinearFP8(3, 32, 24, cache_fp8_weight=False)
        cached.load_state_dict(plain2.state_dict())  # copy_ bumps the version
        plain.load_state_dict(plain2.state_dict())
        assert torch.equal(cached(x, lens), plain(x, lens))
    finally:
        module_mod.quantize_weight = real
    assert "cache_fp8_weight=True" in repr(cached) and "cache_fp8_weight" not in repr(plain)
