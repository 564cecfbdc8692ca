"""The GPU host path of one GroupedLinearFP8 fwd+bwd, run on CPU tensors with the kernel launches
made no-ops (``scripts/host_glue_cpu.py``'s ``gpu_path_on_cpu``): how many kernels it launches and
how many tensors it allocates. Issue 10 counts both per fwd+bwd (<= 10 launches tensorwise). This
pins them in CI, so an added launch or allocation on the hot path fails here, not on a GPU later.
It also runs the lean launcher's keyed path, the launch plans, the TMA ``HostDesc`` s and the casts'
cached geometry, which the interpreter tests (Triton's own path) never reach."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("needs compiled-mode kernel objects", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import turbo_moe  # noqa: E402
from host_glue_cpu import gpu_path_on_cpu  # noqa: E402
from turbo_moe.bench.recipes import bench_float8_config  # noqa: E402
from turbo_moe.kernels.triton.launch import launch_stats  # noqa: E402


def _launches():
    return {name: hits + misses for name, (hits, misses, _) in launch_stats().items()}


def _one_step_counts(granularity, cache, monkeypatch):
    """(launches by kernel, torch.empty calls) of the second fwd+bwd (the first builds the plans)."""
    g, t, n, k = 4, 64, 128, 256
    x = torch.empty(g * t, k, dtype=torch.bfloat16).requires_grad_()
    dy = torch.empty(g * t, n, dtype=torch.bfloat16)
    lens = torch.full((g,), t, dtype=torch.int64)
    layer = turbo_moe.GroupedLinearFP8(g, k, n, device="meta", dtype=torch.bfloat16, backend="triton",
                                       config=bench_float8_config("e4m3", granularity), cache_fp8_weight=cache)
    layer.weight = torch.nn.Parameter(torch.empty(g, n, k, dtype=torch.bfloat16))
    allocations = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        allocations.append(args)
        return real_empty(*args, **kwargs)

    with gpu_path_on_cpu():
        torch.autograd.grad(layer(x, lens), (x, layer.weight), dy)
        before = _launches()
        monkeypatch.setattr(torch, "empty", counting_empty)
        dx, dw = torch.autograd.grad(layer(x, lens), (x, layer.weight), dy)
        monkeypatch.setattr(torch, "empty", real_empty)
    after = _launches()
    assert dx.shape == x.shape and dw.shape == layer.weight.shape
    return {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}, len(allocations)


@pytest.mark.parametrize("cache", [False, True])
def test_tensorwise_fwd_bwd_launches_and_allocations(cache, monkeypatch):
    launches, allocations = _one_step_counts("tensorwise", cache, monkeypatch)
    casts = 2 if cache else 3  # x, dy (and W unless its FP8 copies are cached)
    assert launches == {"resolve_group_offs_kernel": 1, "amax_partials_kernel": casts, "fp8_cast_kernel": casts,
                        "m_grouped_gemm_tma_kernel": 2, "k_grouped_gemm_tma_kernel": 1}
    assert sum(launches.values()) == (8 if cache else 10)
    # offsets; per cast the two FP8 layouts and one buffer for the amax partials and the scale; y, dx, dW.
    assert allocations == 1 + 3 * casts + 3


@pytest.mark.parametrize("cache", [False, True])
def test_rowwise_fwd_bwd_launches(cache, monkeypatch):
    launches, _ = _one_step_counts("rowwise", cache, monkeypatch)
    casts = 2 if cache else 3  # x, dy (and W unless its FP8 copies are cached): both layouts each
    # per cast: zero the amaxes, the stats pass, the cast pass writing both layouts; x and dy (grouped
    # by expert) also the launch for transposed tiles across groups (W's layouts: one group each)
    assert launches == {"resolve_group_offs_kernel": 1, "zero_f32_kernel": casts,
                        "rowwise_layouts_stats_kernel": casts, "rowwise_layouts_cast_kernel": casts,
                        "rowwise_layouts_straddle_kernel": 2, "m_grouped_gemm_tma_kernel": 2,
                        "k_grouped_gemm_tma_kernel": 1}


@pytest.mark.parametrize("cache", [False, True])
def test_delayed_scaling_fwd_bwd_launches_and_allocations(cache, monkeypatch):
    """Delayed scaling: x and dy each cast in one launch that records their amax (no amax pass);
    the weight stays current-scaled (amax pass + cast) unless cached."""
    launches, allocations = _one_step_counts("tensorwise-delayed", cache, monkeypatch)
    weight = {} if cache else {"amax_partials_kernel": 1, "fp8_cast_kernel": 1}
    assert launches == {"resolve_group_offs_kernel": 1, "fp8_cast_delayed_kernel": 2, **weight,
                        "m_grouped_gemm_tma_kernel": 2, "k_grouped_gemm_tma_kernel": 1}
    assert sum(launches.values()) == (6 if cache else 8)
    # offsets; per delayed cast its two FP8 layouts and the scale it used (W's: two layouts and the
    # partials + scale buffer); y, dx, dW.
    assert allocations == 1 + 2 * 3 + (0 if cache else 3) + 3


@pytest.mark.parametrize("recipe, expected", [
    ("tensorwise", {"amax_partials_kernel": 2, "fp8_cast_kernel": 2, "swiglu_amax_partials_kernel": 1,
                    "swiglu_fp8_cast_kernel": 1, "swiglu_backward_amax_kernel": 1, "swiglu_backward_fp8_cast_kernel": 1}),
    ("tensorwise-delayed", {"fp8_cast_delayed_kernel": 2, "swiglu_fp8_cast_delayed_kernel": 1,
                            "swiglu_backward_fp8_delayed_kernel": 1, "swiglu_dprobs_sum_kernel": 1}),
])
def test_swiglu_mlp_fwd_bwd_launches(recipe, expected):
    """GroupedSwiGLUMLPFP8 (weights cached): four M-grouped and two K-grouped GEMMs, one offsets
    launch, and the casts: x and dy (fc1's input, fc2's output gradient), the SwiGLU inside fc2's
    quantization of ``a``, fc1's ``dh`` handed over in FP8 with ``dprobs`` -- 15 launches with
    current scaling, 12 with delayed."""
    g, t, hidden, ffn = 4, 64, 256, 128
    mlp = turbo_moe.GroupedSwiGLUMLPFP8(g, hidden, ffn, config=bench_float8_config("e4m3", recipe), device="meta",
                                        dtype=torch.bfloat16, backend="triton")
    mlp.fc1.weight = torch.nn.Parameter(torch.empty(g, 2 * ffn, hidden, dtype=torch.bfloat16))
    mlp.fc2.weight = torch.nn.Parameter(torch.empty(g, hidden, ffn, dtype=torch.bfloat16))
    x = torch.empty(g * t, hidden, dtype=torch.bfloat16).requires_grad_()
    probs = torch.rand(g * t, requires_grad=True)
    lens = torch.full((g,), t, dtype=torch.int64)
    dy = torch.empty(g * t, hidden, dtype=torch.bfloat16)
    with gpu_path_on_cpu():
        for _ in range(2):  # the first builds the plans and the FP8 weight caches
            before = _launches()
            grads = torch.autograd.grad(mlp(x, lens, probs=probs), (x, probs, mlp.fc1.weight, mlp.fc2.weight), dy)
    after = _launches()
    launches = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    assert launches == {"resolve_group_offs_kernel": 1, "m_grouped_gemm_tma_kernel": 4, "k_grouped_gemm_tma_kernel": 2,
                        **expected}
    assert sum(launches.values()) == (15 if recipe == "tensorwise" else 12)
    assert [tuple(t.shape) for t in grads] == [tuple(x.shape), tuple(probs.shape), tuple(mlp.fc1.weight.shape),
                                               tuple(mlp.fc2.weight.shape)]


def test_the_harness_leaves_no_stand_in_kernel_behind(monkeypatch):
    """Launchers are process-global: a stand-in memo left behind would be hit by a later real launch."""
    from host_glue_cpu import _StandInKernel
    from turbo_moe.kernels.triton.launch import _LAUNCHERS

    _one_step_counts("tensorwise", False, monkeypatch)
    assert not any(isinstance(memo.kernel, _StandInKernel)
                   for launcher in _LAUNCHERS for memos in (launcher._memo, launcher._keyed) for memo in memos.values())


@pytest.mark.parametrize("granularity", ["blockwise", "tensorwise"])
def test_host_glue_script_times_an_expert_mlp(granularity, capsys):
    """``scripts/host_glue_cpu.py --mlp``: an expert MLP's fwd+bwd through the GPU code path on CPU
    tensors, every launch stubbed (with the fine-grained recipes' regions replayed as plans do)."""
    import host_glue_cpu

    host_glue_cpu.main(["--mlp", "--granularity", granularity, "--host-plans", "--steps", "3", "--reps", "1"])
    out = capsys.readouterr().out
    assert f"MLP shape tiny G=8 tokens/expert=128 N=256 K=256 {granularity}" in out and "fwd+bwd turbo_moe Python" in out
