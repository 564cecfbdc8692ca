"""fp32 accumulation into ``main_grad`` in the wgrad kernel's epilogue (issue 15, item 1).

``GroupedGemmProblem(out=main_grad, accumulate=True)``: every backend adds its fp32 K-grouped
result into the fp32 ``out`` (no rounding to bf16 first, no separate add kernel; an empty group
leaves its slice untouched). The reference is an fp32 accumulation over several micro-batches of
the same backend's fp32 result: the bits must be equal. The old path (wgrad in bf16, then added
to the fp32 buffer) must differ, so the tests can tell the two apart.

The Triton kernels run in one child process under ``TRITON_INTERPRET=1`` (this file run as a
script), as ``tests/triton_interpreter_cases.py`` does, so no other test is switched to the
interpreter. Also here: the Megatron adapter's ``gradient_accumulation_fusion`` path uses it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter_child import results_json  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MICRO_BATCHES = [[5, 0, 37, 16, 0, 6], [0, 9, 23, 31, 0, 1], [16, 0, 0, 48, 0, 32]]  # group 4 empty throughout


def _wgrad_problem(group_lens, n, k, rowwise, seed, out_dtype=torch.float32):
    """A K-grouped problem on real-valued FP8 operands (fp32 sums of them round)."""
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    gen = torch.Generator().manual_seed(seed)
    G, M = len(group_lens), sum(group_lens)
    offs = torch.tensor([0] + group_lens, dtype=torch.int64).cumsum(0)
    a = (torch.randn(n, M, generator=gen) * 1.5).to(E5M2)  # dy^T
    b = (torch.randn(k, M, generator=gen) * 1.5).to(E4M3)  # x^T
    a_scale = torch.rand(G, n, generator=gen) + 0.5 if rowwise else torch.tensor(0.7)
    b_scale = torch.rand(G, k, generator=gen) + 0.5 if rowwise else torch.tensor(1.3)
    return GroupedGemmProblem(GemmKind.K_GROUPED, a, b, a_scale, b_scale, offs, out_dtype, role="wgrad")


def _initial_main_grad(G, n, k):
    main_grad = torch.randn(G, n, k, generator=torch.Generator().manual_seed(99))
    main_grad[4, 0, 0] = -0.0  # an empty group must keep even the sign of a zero
    return main_grad


def accumulation_report(run, n=20, k=33, rowwise=False) -> dict:
    """Accumulate MICRO_BATCHES into an fp32 main_grad with ``run(problem)``; compare with the
    fp32 reference accumulation and the old bf16-then-add path. Returns booleans and counts."""
    G = len(MICRO_BATCHES[0])
    main_grad = _initial_main_grad(G, n, k)
    start = main_grad.clone()
    reference, old_path = main_grad.clone(), main_grad.clone()
    returned_same = True
    for i, lens in enumerate(MICRO_BATCHES):
        problem = _wgrad_problem(lens, n, k, rowwise, seed=i)
        result = run(dataclasses.replace(problem, out=main_grad, accumulate=True))
        returned_same &= result is main_grad
        reference += run(problem)  # the backend's fp32 result, then an fp32 add
        old_path += run(dataclasses.replace(problem, out_dtype=torch.bfloat16)).float()
    return {
        "returned_main_grad": bool(returned_same),
        "bits_equal_fp32_reference": bool(torch.equal(main_grad, reference)),
        "old_path_differs": int((old_path != main_grad).sum()),
        "empty_group_untouched": bool(torch.equal(main_grad[4], start[4]) and torch.signbit(main_grad[4, 0, 0]).item()),
        "changed": int((main_grad != start).sum()),
    }


def _check_report(report, label):
    assert report["returned_main_grad"], label
    assert report["bits_equal_fp32_reference"], label
    assert report["empty_group_untouched"], label
    assert report["old_path_differs"] > 0, f"{label}: the bf16 path gives the same bits, so the test cannot tell"
    assert report["changed"] > 0, label


@pytest.mark.parametrize("rowwise", [False, True])
def test_torch_backend_accumulates_in_fp32(rowwise):
    from turbo_moe.backends.torch_backend import BACKEND

    _check_report(accumulation_report(BACKEND.run, rowwise=rowwise), f"torch rowwise={rowwise}")


def test_out_without_accumulate_is_written_and_returned():
    from turbo_moe.backends.torch_backend import BACKEND

    problem = _wgrad_problem([3, 0, 7, 2], 8, 12, rowwise=False, seed=5, out_dtype=torch.bfloat16)
    out = torch.full(problem.out_shape, float("nan"), dtype=torch.bfloat16)
    assert BACKEND.run(dataclasses.replace(problem, out=out)) is out
    assert torch.equal(out, BACKEND.run(problem))
    assert torch.count_nonzero(out[1]) == 0  # written (not accumulated): the empty group is zero


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(accumulate=True), "needs an out tensor"),
        (dict(accumulate=True, out=torch.zeros(4, 8, 12, dtype=torch.bfloat16), out_dtype=torch.bfloat16),
         "needs a float32 out"),
        (dict(out=torch.zeros(4, 8, 11)), "out must have shape"),
        (dict(out=torch.zeros(4, 8, 12, dtype=torch.float16)), "out has dtype"),
    ],
)
def test_bad_out_is_refused_naming_the_argument(change, message):
    from turbo_moe.backends.torch_backend import BACKEND

    problem = dataclasses.replace(_wgrad_problem([3, 0, 7, 2], 8, 12, False, seed=5), **change)
    ok, why = BACKEND.can_handle(problem)
    assert not ok and message in why
    with pytest.raises(ValueError, match=message):
        BACKEND.run(problem)


def test_accumulate_is_refused_for_m_grouped():
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.backends.torch_backend import BACKEND

    a, b = torch.ones(5, 16).to(E4M3), torch.ones(2, 8, 16).to(E4M3)
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, a, b, torch.tensor(1.0), torch.tensor(1.0),
                                 torch.tensor([0, 2, 5]), torch.float32, out=torch.zeros(5, 8), accumulate=True)
    assert "K_GROUPED" in BACKEND.can_handle(problem)[1]


def test_grouped_wgrad_fp8_main_grad_keyword():
    from turbo_moe import Float8Config
    from turbo_moe.autograd import grouped_wgrad_fp8

    gen = torch.Generator().manual_seed(3)
    offs = torch.tensor([0, 4, 4, 13, 20])
    dy, x = torch.randn(20, 24, generator=gen).bfloat16(), torch.randn(20, 16, generator=gen).bfloat16()
    cfg = Float8Config.from_megatron("hybrid")
    main_grad = torch.randn(4, 24, 16, generator=gen)
    expected = main_grad + grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch", out_dtype=torch.float32)
    assert grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch", main_grad=main_grad) is main_grad
    assert torch.equal(main_grad, expected)
    with pytest.raises(TypeError, match="main_grad must be a float32"):
        grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch", main_grad=main_grad.bfloat16())
    with pytest.raises(ValueError, match="main_grad must be"):
        grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch", main_grad=main_grad[:, :, :8])
    with pytest.raises(ValueError, match="out_dtype"):
        grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="torch", main_grad=main_grad, out_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (child process)
# ----------------------------------------------------------------------------------------------


def _interpreter_child() -> dict:
    from turbo_moe.backends import triton_backend as tb

    from turbo_moe.backends.triton_checks import _tma_store_ok

    results = {}
    for tma in (True, False):
        config = tb.KernelConfig(16, 16, 32, group_m=2, num_warps=1, num_stages=1, tma=tma)
        # main_grad [G, 20, k] fp32: rows of 132 bytes take the pointer epilogue, rows of 128 bytes
        # the read-modify-write through the copy engine (TMA load and store of each tile).
        for k in (33, 32) if tma else (33,):
            for rowwise in (False, True):
                # M = 80 tokens per micro-batch, row strides of 80 bytes: TMA-eligible operands.
                probe = _wgrad_problem(MICRO_BATCHES[0], 20, k, rowwise, seed=0)
                kernel = "pointer"
                if tma and not tb._tma_reason(probe):
                    kernel = "tma-rmw" if _tma_store_ok(_initial_main_grad(len(MICRO_BATCHES[0]), 20, k)) else "tma"
                report = accumulation_report(lambda p: tb.BACKEND.run(p, config=config), k=k, rowwise=rowwise)
                results[f"{kernel}_rowwise={rowwise}"] = report
    # Through the autograd entry point, the backend's own config choice.
    from turbo_moe import Float8Config
    from turbo_moe.autograd import grouped_wgrad_fp8

    gen = torch.Generator().manual_seed(4)
    offs = torch.tensor([0, 16, 16, 48])
    dy, x = torch.randn(48, 24, generator=gen).bfloat16(), torch.randn(48, 16, generator=gen).bfloat16()
    main_grad = torch.randn(3, 24, 16, generator=gen)
    expected = main_grad + grouped_wgrad_fp8(dy, x, offs, backend="triton", out_dtype=torch.float32)
    got = grouped_wgrad_fp8(dy, x, offs, config=Float8Config(), backend="triton", main_grad=main_grad)
    results["grouped_wgrad_fp8"] = {"bits_equal_fp32_reference": bool(got is main_grad and torch.equal(got, expected))}
    # The GEMM's own backward into a WgradTarget (Megatron's fused main_grad), per-tensor and
    # blockwise Triton kernels: the same bits as grouped_wgrad_fp8(main_grad=...) on the same inputs.
    from turbo_moe.autograd import WgradTarget, _grouped_gemm_fp8_resolved

    w = torch.randn(3, 24, 16, generator=gen).bfloat16()
    for granularity in ("tensorwise", "rowwise", "blockwise"):
        cfg = Float8Config(format="hybrid", granularity=granularity)
        start = torch.randn(3, 24, 16, generator=gen)
        target_buffer, reference = start.clone(), start.clone()
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _grouped_gemm_fp8_resolved(xx, ww, offs, config=cfg, backend="triton",
                                       wgrad_target=WgradTarget(buffer=lambda: target_buffer))
        y.backward(dy)
        grouped_wgrad_fp8(dy, x, offs, config=cfg, backend="triton", main_grad=reference)
        results[f"wgrad_target_{granularity}"] = {
            "bits_equal_fp32_reference": bool(torch.equal(target_buffer, reference) and ww.grad is None)}
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return results_json([__file__, "--interpreter-child"])


def test_triton_kernels_accumulate_in_fp32_under_interpreter(interpreter_results):
    entry_points = {"grouped_wgrad_fp8", "wgrad_target_tensorwise", "wgrad_target_rowwise", "wgrad_target_blockwise"}
    assert entry_points <= set(interpreter_results), sorted(interpreter_results)
    kernels = {name.split("_")[0] for name in interpreter_results if name not in entry_points}
    assert kernels == {"tma", "tma-rmw", "pointer"}, f"every K-grouped epilogue must run: {sorted(interpreter_results)}"
    for name, report in interpreter_results.items():
        if name in entry_points:
            assert report["bits_equal_fp32_reference"], name
        else:
            _check_report(report, name)


def _target_inputs(seed, lens, n, k):
    """(generator, offsets, x [M, k], w [G, n, k], dy [M, n]) with x and w requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor([0] + lens).cumsum(0)
    x = torch.randn(sum(lens), k, generator=gen).requires_grad_()
    w = (torch.randn(len(lens), n, k, generator=gen) / k**0.5).requires_grad_()
    return gen, offs, x, w, torch.randn(sum(lens), n, generator=gen)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_target_accumulates_dw_and_hands_back_the_placeholder(buffer_dtype, granularity):
    """``WgradTarget``: backward adds dW into the buffer (float32: the kernel's epilogue, equal to
    grouped_wgrad_fp8's fp32 result added; another dtype: dW in that dtype, then added), returns
    the placeholder as w's gradient, and leaves dx as without a target; an empty group's slice is
    untouched."""
    from turbo_moe import Float8Config
    from turbo_moe.autograd import WgradTarget, _grouped_gemm_fp8_resolved, grouped_gemm_fp8, grouped_wgrad_fp8

    gen, offs, x, w, dy = _target_inputs(31, [7, 0, 12, 5], n=40, k=48)
    buffer = torch.randn(4, 40, 48, generator=gen).to(buffer_dtype)
    start = buffer.clone()
    placeholder = torch.full_like(w, 3.0)
    asked = []
    target = WgradTarget(buffer=lambda: (asked.append("buffer"), buffer)[1],
                         placeholder=lambda: (asked.append("placeholder"), placeholder)[1])
    cfg = Float8Config(format="hybrid", granularity=granularity)
    _grouped_gemm_fp8_resolved(x, w, offs, config=cfg, backend="torch", wgrad_target=target).backward(dy)
    assert asked == ["buffer", "placeholder"]
    assert torch.equal(w.grad, placeholder)
    dw = grouped_wgrad_fp8(dy, x.detach(), offs, config=cfg, backend="torch", out_dtype=buffer_dtype)
    assert torch.equal(buffer, start + dw)
    assert torch.equal(buffer[1], start[1])  # the empty group
    x2 = x.detach().clone().requires_grad_()
    grouped_gemm_fp8(x2, w.detach(), group_offs=offs, config=cfg, backend="torch").backward(dy)
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("granularity", ["tensorwise", "mxfp8"])
def test_wgrad_target_refuses_a_buffer_of_the_wrong_shape(granularity):
    """A main_grad that does not match dW (e.g. a sharding mistake) raises, naming out's shape,
    instead of broadcasting into it."""
    from turbo_moe import Float8Config
    from turbo_moe.autograd import WgradTarget, _grouped_gemm_fp8_resolved

    _, offs, x, w, dy = _target_inputs(33, [5, 11, 0, 16], n=32, k=64)
    wrong = torch.zeros(4, 32, 32)  # K halved
    y = _grouped_gemm_fp8_resolved(x, w, offs, config=Float8Config(granularity=granularity), backend="torch",
                                   wgrad_target=WgradTarget(buffer=lambda: wrong))
    from turbo_moe.backends import BackendUnavailable

    with pytest.raises((ValueError, BackendUnavailable), match="out must"):
        y.backward(dy)
    assert torch.count_nonzero(wrong) == 0


@pytest.mark.parametrize("granularity", ["tensorwise", "blockwise"])
def test_wgrad_target_defers_dw_from_the_fp8_copies(granularity):
    """``WgradTarget(defer=...)``: backward computes dx, hands over a ``DeferredWgrad`` and returns no
    weight gradient; computing it later gives grouped_wgrad_fp8's dW bit for bit, and accumulating
    it into a float32 buffer equals adding that fp32 dW."""
    from turbo_moe import Float8Config
    from turbo_moe.autograd import DeferredWgrad, WgradTarget, _grouped_gemm_fp8_resolved, grouped_wgrad_fp8

    gen, offs, x, w, dy = _target_inputs(32, [0, 9, 14, 3], n=32, k=64)
    queued = []
    cfg = Float8Config(granularity=granularity)
    _grouped_gemm_fp8_resolved(x, w, offs, config=cfg, backend="torch",
                               wgrad_target=WgradTarget(defer=queued.append)).backward(dy)
    assert w.grad is None and x.grad is not None and len(queued) == 1 and isinstance(queued[0], DeferredWgrad)
    expected = grouped_wgrad_fp8(dy, x.detach(), offs, config=cfg, backend="torch", out_dtype=torch.float32)
    assert torch.equal(queued[0].compute(torch.float32), expected)
    buffer = torch.randn(4, 32, 64, generator=gen)
    start = buffer.clone()
    queued[0].accumulate_into(buffer)
    assert torch.equal(buffer, start + expected)


# ----------------------------------------------------------------------------------------------
# The Megatron adapter: gradient_accumulation_fusion runs the accumulating wgrad kernel
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from _megatron_harness import megatron_world

    with megatron_world("cpu"):
        yield


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_megatron_fused_main_grad_bits_equal_fp32_accumulation(world, fp8, granularity, monkeypatch):
    """bf16 parameters, fp32 main_grad, three micro-batches (immediate wgrad): main_grad equals the
    fp32 accumulation of each micro-batch's fp32 wgrad (``grouped_wgrad_fp8`` on the layer's own x,
    dy and offsets: the same quantization as the GEMM's backward) bit for bit; the old path (wgrad
    rounded to bf16, then added) differs. x and dy are each quantized once per fwd+bwd: the wgrad
    reuses the FP8 copies the forward and dgrad made."""
    import turbo_moe.autograd as autograd_module
    from _megatron_harness import make_config, randomize_
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from turbo_moe.autograd import grouped_wgrad_fp8
    from turbo_moe.megatron import TurboMoEGroupedMLP, TurboMoEOptions
    from turbo_moe.swiglu import weighted_swiglu

    config = make_config(num_moe_experts=4, params_dtype=torch.bfloat16)
    config.gradient_accumulation_fusion = True
    experts = TurboMoEGroupedMLP(4, config, pg_collection=get_default_pg_collection(),
                                 options=TurboMoEOptions(fp8=fp8, granularity=granularity, backend="torch",
                                                         cache_fp8_weight=False))
    randomize_(experts, seed=21)
    fp8_config = experts.linear_fc1.fp8_config
    quantized = []  # the high-precision tensors quantized, by role
    for name in ("quantize_tensorwise_layouts", "quantize_rowwise", "quantize_columnwise"):
        real = getattr(autograd_module, name)
        monkeypatch.setattr(autograd_module, name,
                            lambda t, *a, _real=real, **kw: (quantized.append(t.data_ptr()), _real(t, *a, **kw))[1])
    seen = {}  # linear name -> list of [x, offs, dy] per micro-batch

    def record(name):
        def pre_hook(module, args, kwargs):
            x = args[0].detach()
            if kwargs.get("swiglu_probs") is not None:  # fc2 fusing the activation: its input is fc1's
                # output, and the GEMMs read the float32 activation (turbo_moe.swiglu), rounded to
                # h's dtype under the fine-grained recipes (turbo_moe.fine_grained.swiglu)
                a = weighted_swiglu(x, kwargs["swiglu_probs"].detach().reshape(-1))
                x = a.to(x.dtype) if fp8_config.fine_grained else a
            seen.setdefault(name, []).append([x, kwargs["group_offs"], None])

        def hook(module, args, kwargs, output):
            entry = seen[name][-1]
            output[0].register_hook(lambda dy: entry.__setitem__(2, dy.detach()))
        return pre_hook, hook

    for name in ("linear_fc1", "linear_fc2"):
        pre_hook, hook = record(name)
        getattr(experts, name).register_forward_pre_hook(pre_hook, with_kwargs=True)
        getattr(experts, name).register_forward_hook(hook, with_kwargs=True)
    start = {}
    for p in experts.parameters():
        p.main_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(22))
        p.grad_added_to_main_grad = False
        start[p.data_ptr()] = p.main_grad.clone()
    gen = torch.Generator().manual_seed(23)
    for lens in ([6, 0, 9, 2], [3, 5, 0, 11], [0, 0, 7, 4]):
        m = sum(lens)
        x = torch.randn(m, config.hidden_size, generator=gen).bfloat16().requires_grad_()
        probs = (torch.rand(m, generator=gen) * 0.9 + 0.1).bfloat16()
        quantized.clear()
        experts(x, torch.tensor(lens), probs)[0].float().square().sum().backward()
        # fc1 and fc2: the weight, x and dy each quantized once (rowwise: W and W^T, x^T by group,
        # dy and dy^T by group are separate calls, still one per tensor and layout; blockwise and
        # MXFP8 quantize in turbo_moe.fine_grained, not counted here)
        if granularity in ("tensorwise", "rowwise"):
            assert len(quantized) == len(set(quantized)) * (1 if granularity == "tensorwise" else 2), quantized
    for name in ("linear_fc1", "linear_fc2"):
        w = getattr(experts, name).weight
        reference, bf16_path = start[w.data_ptr()].clone(), start[w.data_ptr()].clone()
        assert len(seen[name]) == 3
        for x, offs, dy in seen[name]:
            reference += grouped_wgrad_fp8(dy, x, offs, config=fp8_config, backend="torch", out_dtype=torch.float32)
            bf16_path += grouped_wgrad_fp8(dy, x, offs, config=fp8_config, backend="torch",
                                           out_dtype=torch.bfloat16).float()
        assert torch.equal(w.main_grad, reference), name
        assert (bf16_path != w.main_grad).sum() > 0, name
        assert w.grad_added_to_main_grad is True and w.grad.shape == w.shape  # Megatron's placeholder


if __name__ == "__main__" and "--interpreter-child" in sys.argv:
    sys.path.insert(0, str(Path(__file__).parent.parent))
    print("RESULTS_JSON " + json.dumps(_interpreter_child()))


def test_planned_wgrad_target_rules(world):
    """Which main_grad a planned GEMM (turbo_moe.planned_layer / planned_mlp) may accumulate into,
    and the placeholder it then hands back; None leaves the call to the Python path: a main_grad
    Megatron-FSDP allocates lazily, a non-float32 one (added after the kernel), or zeroed wgrads."""
    from _megatron_harness import make_config
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from turbo_moe.megatron import TurboMoEGroupedMLP, TurboMoEOptions
    from turbo_moe.megatron.main_grad import _dummy_wgrad

    config = make_config(num_moe_experts=2, params_dtype=torch.bfloat16)
    config.gradient_accumulation_fusion = True
    experts = TurboMoEGroupedMLP(2, config, pg_collection=get_default_pg_collection(),
                                 options=TurboMoEOptions(fp8="e4m3", backend="torch"))
    linear = experts.linear_fc1
    w = linear.weight
    assert linear._planned_wgrad_target(False) == (None, None)
    w.get_main_grad = lambda: torch.zeros(w.shape)  # lazily allocated
    assert linear._planned_wgrad_target(True) is None
    del w.get_main_grad
    w.main_grad = torch.zeros(w.shape, dtype=torch.bfloat16)
    assert linear._planned_wgrad_target(True) is None
    w.main_grad = torch.zeros(w.shape)
    main_grad, placeholder = linear._planned_wgrad_target(True)
    assert main_grad is w.main_grad and placeholder is None  # no grad_added_to_main_grad protocol
    w.grad_added_to_main_grad = False
    main_grad, placeholder = linear._planned_wgrad_target(True)
    assert placeholder is _dummy_wgrad(w, w.dtype, False)
    w.zero_out_wgrad = True
    assert linear._planned_wgrad_target(True) is None
    linear._mark_planned_wgrad(None)
    assert w.grad_added_to_main_grad is False
    linear._mark_planned_wgrad(placeholder)
    assert w.grad_added_to_main_grad is True
