"""The benchmark's GPU-only measurements on a CUDA device: kernel-launch counting, host issue time,
CUDA-graph timing, the profiler's expert attribution, and a tiny run of ``--preset train``.
Skipped without CUDA. These check the measuring tools, not turbo_moe's speed.
"""

import importlib.util
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from turbo_moe.bench import cli, step_metrics  # noqa: E402
from turbo_moe.bench.train_step import expert_ranges, expert_time_split  # noqa: E402

CUDA = torch.device("cuda")


def test_count_kernel_launches_counts_each_launch():
    x = torch.randn(256, 256, device=CUDA)
    out = torch.empty_like(x)

    def three_kernels():
        torch.add(x, 1, out=out)
        out.mul_(2)
        out.zero_()  # a fill kernel (or a memset): one launch either way
        return out

    three_kernels()
    assert step_metrics.count_kernel_launches(three_kernels) == 3
    assert step_metrics.count_kernel_launches(lambda: None) == 0


def test_count_kernel_launches_of_a_bf16_grouped_fwd_bwd():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    x = torch.randn(512, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 128, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 128, device=CUDA, dtype=torch.bfloat16)
    offs = torch.tensor([128, 256, 384, 512], device=CUDA, dtype=torch.int32)

    def step():
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return (y, *torch.autograd.grad(y, (x, w), dy))

    step()
    counts = step_metrics.gpu_activity_counts(step)
    assert 3 <= counts["total"] <= 12, counts  # fwd, dgrad, wgrad (+ small setup kernels)
    assert counts["kernel"] >= 3


def test_host_issue_time_sees_a_synchronizing_step():
    x = torch.randn(1024, 1024, device=CUDA)
    quiet = step_metrics.host_issue_us(lambda: x @ x, CUDA)
    assert 0 < quiet["us"] < 2000 and not quiet["synchronizes"]
    syncing = step_metrics.host_issue_us(lambda: (x @ x).sum().item(), CUDA)
    assert syncing["synchronizes"]


def test_cuda_graph_ms_replays_and_refuses_a_sync():
    x = torch.randn(2048, 2048, device=CUDA, dtype=torch.bfloat16)
    ms = step_metrics.cuda_graph_ms(lambda: x @ x, CUDA, warmup_ms=5, rep_ms=20)
    assert ms > 0

    def refuses_capture():  # what a host sync under capture amounts to, without poisoning the context
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x @ x

    with pytest.raises(step_metrics.NotAvailable, match="capture failed: RuntimeError: operation not permitted"):
        step_metrics.cuda_graph_ms(refuses_capture, CUDA, warmup_ms=5, rep_ms=20)
    assert step_metrics.cuda_graph_ms(lambda: x @ x, CUDA, warmup_ms=5, rep_ms=20) > 0  # still usable


def test_expert_time_split_on_gpu():
    import turbo_moe
    from torch.profiler import ProfilerActivity, profile

    layer = turbo_moe.GroupedLinearFP8(8, 512, 1024, device=CUDA, dtype=torch.bfloat16)
    outside = torch.nn.Linear(1024, 1024, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(4096, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    lens = torch.full((8,), 512, device=CUDA, dtype=torch.int64)

    def step():
        outside(layer(x, lens)).float().square().mean().backward()

    step()
    with expert_ranges([layer]):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    split = expert_time_split(prof.events(), on_gpu=True)
    # what the GPU time is made of (the activities the split counts), for the failure message
    by_name = {}
    for e in step_metrics.gpu_activities(prof.events()):
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    assert 0 < split["expert_ms"] < split["total_ms"], (split, top)
    assert split["unattributed_ms"] < 0.1 * split["total_ms"], (split, top)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_train_preset_tiny_on_gpu(tmp_path):
    out = tmp_path / "train"
    tiny = [f"{c}.{k}={v}" for c in ("moderate", "expert-dominated")
            for k, v in (("layers", 1), ("hidden", 256), ("heads", 4), ("ffn", 256), ("seq", 128), ("mbs", 4))]
    argv = ["--preset", "train", "--train-steps", "6", "--timed-steps", "3", "--warmup-steps", "2",
            "--eval-interval", "3", "--eval-batches", "2", "--corpus-bytes", str(1 << 20), "--out", str(out)]
    for item in tiny:
        argv += ["--train-override", item]
    assert cli.main(argv) == 0
    with open(out / "results.json") as f:
        records = json.load(f)["records"]
    assert len(records) == 8
    for r in records:
        assert r["status"] == "ok", r
        assert r["step_ms"] > 0 and r["peak_mb"] > 0 and 0 < r["expert_share"] < 1
        assert r["unattributed_ms"] < 0.2 * r["gpu_ms"], r


def _turbo_step(granularity, cache=False, groups=8, tokens=256, k=512, n=1024):
    import turbo_moe

    from turbo_moe.bench.recipes import bench_float8_config

    layer = turbo_moe.GroupedLinearFP8(groups, k, n, config=bench_float8_config("e4m3", granularity),
                                       backend="triton", device=CUDA, dtype=torch.bfloat16, cache_fp8_weight=cache)
    x = torch.randn(groups * tokens, k, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(groups * tokens, n, device=CUDA, dtype=torch.bfloat16)
    lens = torch.full((groups,), tokens, device=CUDA, dtype=torch.int64)

    def step():
        y = layer(x, lens)
        return (y, *torch.autograd.grad(y, (x, layer.weight), dy))

    step()
    return layer, step


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "blockwise", "mxfp8", "tensorwise-delayed"])
def test_gpu_time_breakdown_names_every_turbo_kernel(granularity):
    """The profiler split of a turbo_moe fwd+bwd: its quantization and GEMM kernels are all recognised
    (none of turbo_moe's Triton kernels lands in "other"), and the three GEMMs are there."""
    from torch.profiler import ProfilerActivity, profile

    from kernels.triton import (amax_history, blockwise_cast, blockwise_gemm, blockwise_gemm_gluon, fp8_cast,
                                grouped_gemm, grouped_gemm_gluon, group_offsets)

    _, step = _turbo_step(granularity)
    split = step_metrics.gpu_time_breakdown(step)
    assert split["gemm_launches"] >= 3 and split["quant_launches"] >= 2, split
    assert 0 < split["quant_share"] < 1 and split["gemm_ms"] > 0, split
    assert split["total_ms"] == pytest.approx(split["quant_ms"] + split["gemm_ms"] + split["other_ms"])
    ours = {n for mod in (fp8_cast, blockwise_cast, group_offsets, grouped_gemm, blockwise_gemm, amax_history,
                          grouped_gemm_gluon, blockwise_gemm_gluon)
            for n in dir(mod) if n.endswith("_kernel")}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [name for name, _ in step_metrics._device_activities(prof.events())]
    unclassified = [n for n in names if n in ours and step_metrics.classify_gpu_activity(n) not in ("quant", "gemm")]
    assert not unclassified and any(n in ours for n in names), names


def test_gpu_time_breakdown_micro_batches_quantize_the_cached_weight_once():
    layer, step = _turbo_step("tensorwise", cache=True)
    for _ in range(4):  # warm-up: tuning, compiles, the host plans' recording (its check replays once)
        step()
    per_mb4 = step_metrics.gpu_time_breakdown(step_metrics.optimizer_step(step, layer.weight, 4), calls=4)
    per_mb1 = step_metrics.gpu_time_breakdown(step_metrics.optimizer_step(step, layer.weight, 1), calls=1)
    # The weight's casts run once per 4 micro-batches instead of once per micro-batch.
    assert per_mb4["quant_launches"] < per_mb1["quant_launches"], (per_mb4, per_mb1)
    assert per_mb4["gemm_launches"] == per_mb1["gemm_launches"]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_train_preset_fine_grained_variants_on_gpu(tmp_path):
    out = tmp_path / "fine"
    argv = ["--preset", "train", "--train-configs", "moderate", "--train-steps", "6", "--warmup-steps", "2",
            "--eval-interval", "3", "--eval-batches", "2", "--corpus-bytes", str(1 << 20),
            "--train-variants", "turbo-bf16,fp8-blockwise,fp8-mxfp8", "--out", str(out)]
    for k, v in (("layers", 1), ("hidden", 256), ("heads", 4), ("ffn", 256), ("seq", 128), ("mbs", 4)):
        argv += ["--train-override", f"moderate.{k}={v}"]
    assert cli.main(argv) == 0
    with open(out / "results.json") as f:
        by = {r["impl"]: r for r in json.load(f)["records"]}
    bf16 = by["turbo-bf16"]["loss_curve"]
    for name in ("fp8-blockwise", "fp8-mxfp8"):
        r = by[name]
        assert r["status"] == "ok" and r["step_ms"] > 0 and 0 < r["expert_share"] < 1, r
        assert r["loss_curve"] != bf16 and all(abs(a / b - 1) < 0.02 for a, b in zip(r["loss_curve"], bf16))


def test_activation_input_peak_counts_what_each_layer_saves_of_x():
    """``peak_act_mb`` (x an activation) against ``peak_mb`` (x held by the caller): bf16
    ``_grouped_mm`` keeps its bf16 input for backward, so its peak grows by the input's copy (2 bytes
    per element of x); turbo_moe keeps only an FP8 copy, so its peak grows by less than that."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    from turbo_moe.bench.end_to_end import E2EInputs, bf16_step, turbo_step

    g, tokens, n, k = 8, 1024, 512, 2048
    m = g * tokens
    sizes = [tokens] * g
    inputs = E2EInputs(
        x=torch.randn(m, k, device=CUDA, dtype=torch.bfloat16, requires_grad=True),
        w=torch.nn.Parameter(torch.randn(g, n, k, device=CUDA, dtype=torch.bfloat16) * k ** -0.5),
        dy=torch.randn(m, n, device=CUDA, dtype=torch.bfloat16),
        group_lens=torch.tensor(sizes, device=CUDA),
        group_ends_int32=torch.tensor([tokens * (i + 1) for i in range(g)], device=CUDA, dtype=torch.int32),
        offs_host=[tokens * i for i in range(g + 1)],
    )
    x_mb = m * k * 2 / 2**20
    growth = {}
    for name, step in (("bf16", bf16_step(inputs)), ("turbo", turbo_step(inputs, "triton", "tensorwise", "e4m3", None))):
        y_held = step()
        y_act = step.on_activation()
        for a, b in zip(y_held, y_act):  # the same math: the copy only changes who owns x
            assert torch.equal(a, b), name
        del y_held, y_act
        cli._release_device_memory(CUDA)
        torch.cuda.reset_peak_memory_stats(CUDA)
        outs = step()
        torch.cuda.synchronize()
        held = torch.cuda.max_memory_allocated(CUDA) / 2**20
        del outs
        growth[name] = cli._activation_input_peak_mb(step, CUDA) - held
    assert growth["bf16"] >= 0.9 * x_mb, (growth, x_mb)
    assert growth["turbo"] < growth["bf16"] - 0.25 * x_mb, (growth, x_mb)
