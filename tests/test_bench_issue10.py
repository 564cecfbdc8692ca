"""Issue 10's measurements on the CPU: the GPU-time classification (quantization / GEMM / other) on
synthetic kernel names and events, the hot-path table's new columns, the end-to-end target lines,
``--preset issue10``'s smoke mode, and the fine-grained variants of ``--preset train``.
The GPU side is in tests/test_bench_gpu.py.
"""

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch

from turbo_moe.bench import cli, report, step_metrics
from turbo_moe.bench.issue10 import ISSUE10_SHAPES, e2e_targets

SMALL_CORPUS = 256 << 10
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

# Names as the profiler shows them: Triton kernels by their function name, library kernels mangled.
QUANT_NAMES = [
    "amax_partials_kernel", "fp8_cast_kernel", "fp8_rowwise_cast_kernel", "fp8_colwise_grouped_cast_kernel",
    "resolve_group_offs_kernel", "block_cast_rows_kernel", "block_cast_weight_kernel", "block_cast_tokens_kernel",
    "fp8_cast_delayed_kernel", "zero_f32_kernel", "rowwise_layouts_stats_kernel", "rowwise_layouts_cast_kernel",
    "rowwise_layouts_straddle_kernel",
]
GEMM_NAMES = [
    "m_grouped_gemm_kernel", "k_grouped_gemm_kernel", "m_grouped_gemm_tma_kernel", "k_grouped_gemm_tma_kernel",
    "m_grouped_block_scaled_kernel", "k_grouped_block_scaled_kernel", "m_grouped_block_scaled_tma_kernel",
    "k_grouped_block_scaled_tma_kernel", "k_grouped_gemm_gluon_kernel", "k_grouped_block_scaled_gluon_kernel",
    "m_grouped_block_scaled_coop_kernel", "k_grouped_block_scaled_coop_kernel",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<...>>>(...)",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
]
OTHER_NAMES = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>(int, ...)",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>(...)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>(...)",
    "triton_poi_fused_add_mul_0", "my_fp8_cast_kernel_v2", "fp8_cast_kernels",
]


def test_classify_gpu_activity_names():
    for name in QUANT_NAMES:
        assert step_metrics.classify_gpu_activity(name) == "quant", name
    for name in GEMM_NAMES:
        assert step_metrics.classify_gpu_activity(name) == "gemm", name
    for name in OTHER_NAMES:  # a quantization name inside a longer identifier is not one of ours
        assert step_metrics.classify_gpu_activity(name) == "kernel", name
    assert step_metrics.classify_gpu_activity("Memcpy HtoD (Pinned -> Device)") == "memcpy"
    assert step_metrics.classify_gpu_activity("Memset (Device)") == "memset"
    # Every quantization kernel the kernels define is listed (a renamed kernel would silently be "other").
    from kernels.triton import amax_history, blockwise_cast, fp8_cast, group_offsets, rowwise_layouts

    defined = {n for mod in (fp8_cast, blockwise_cast, group_offsets, amax_history, rowwise_layouts) for n in dir(mod)
               if n.endswith("_kernel") and getattr(mod, n).__module__ == mod.__name__}
    assert defined == set(step_metrics.QUANT_KERNELS)


def test_gpu_time_by_class_sums_and_shares():
    acts = [("fp8_cast_kernel", 30.0), ("amax_partials_kernel", 10.0), ("m_grouped_gemm_kernel", 200.0),
            ("k_grouped_gemm_kernel", 150.0), ("Memset (Device)", 2.0), ("triton_poi_fused_add_0", 8.0)]
    split = step_metrics.gpu_time_by_class(acts)
    assert split["quant_ms"] == pytest.approx(0.040) and split["gemm_ms"] == pytest.approx(0.350)
    assert split["other_ms"] == pytest.approx(0.010) and split["total_ms"] == pytest.approx(0.400)
    assert split["quant_share"] == pytest.approx(0.1)
    assert (split["quant_launches"], split["gemm_launches"], split["other_launches"]) == (2, 2, 2)
    empty = step_metrics.gpu_time_by_class([])
    assert empty["total_ms"] == 0 and empty["quant_share"] is None


def _event(name, us, device="CUDA"):
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_profiler_events_are_read_by_device_type():
    events = [_event("fp8_cast_kernel", 5.0), _event("m_grouped_gemm_kernel", 20.0), _event("Memset (Device)", 1.0),
              _event("Memcpy DtoD (Device -> Device)", 1.0), _event("aten::mm", 99.0, device="CPU")]
    assert list(step_metrics._device_activities(events)) == [
        ("fp8_cast_kernel", 5.0), ("m_grouped_gemm_kernel", 20.0), ("Memset (Device)", 1.0),
        ("Memcpy DtoD (Device -> Device)", 1.0)]
    # Launch counting folds quantization and GEMM kernels into "kernel", as before.
    assert step_metrics._count_device_events(events) == {"kernel": 2, "memset": 1, "memcpy": 1}
    with pytest.raises(step_metrics.NotAvailable, match="CUDA"):
        step_metrics.gpu_time_breakdown(lambda: None, torch.device("cpu"))


def test_optimizer_step_bumps_once_then_runs_the_micro_batches():
    w = torch.nn.Parameter(torch.randn(3))
    seen = []
    run = step_metrics.optimizer_step(lambda: seen.append(w._version), w, 3)
    run()
    run()
    assert len(seen) == 6 and seen[0] == seen[2] != seen[3] == seen[5]
    with pytest.raises(ValueError, match="micro_batches"):
        step_metrics.optimizer_step(lambda: None, w, 0)


# ---------------------------------------------------------------- tables and targets


def _e2e(impl, case="deepseek-v3 fc1 32x512 balanced", **kw):
    model, layer, shape = case.split()[:3]
    experts, tpe = map(int, shape.split("x"))
    rec = dict(level="e2e", op="fwd+bwd", status="ok", case=case, model=model, layer=layer, num_experts=experts,
               tokens_per_expert=tpe, M=experts * tpe, N=4096, K=7168, impl=impl, ms=1.0, tflops=1.0, peak_mb=100.0,
               mb4_ms=1.0, mb1_ms=1.0, graph_ms=1.0, host_us=100.0, launches=8)
    rec.update(kw)
    return rec


def test_hot_path_table_shows_the_gpu_split_and_quant_share():
    records = [
        _e2e("turbo:triton:tensorwise+wcache", mb4_ms=0.5, gpu_mb4_ms=0.48, quant_mb4_ms=0.06, gemm_mb4_ms=0.40,
             other_mb4_ms=0.02, quant_share_mb4=0.13, gpu_mb1_ms=0.6, quant_share_mb1=0.25),
        _e2e("bf16", mb4_ms=1.0, gpu_mb4_ms=0.95, quant_mb4_ms=0.0, gemm_mb4_ms=0.9, other_mb4_ms=0.05,
             quant_share_mb4=0.0, quant_share_mb1=0.0),
        _e2e("torchao_fp8", mb4_ms=0.75),
    ]
    text = "\n".join(report.e2e_hot_path_table(records))
    assert "GPU ms/µb of 4 (quant/gemm/other)" in text and "0.480 (0.060/0.400/0.020)" in text
    assert "13% / 25%" in text  # quant share, 4 and 1 micro-batches
    assert "| 2.00x " in text and "| 1.50x " in text  # vs bf16, vs torchao
    flops = 6.0 * 32 * 512 * 4096 * 7168
    assert f"{flops / 0.5e-3 / 1e12:.0f}" in text  # TFLOPS per micro-batch of 4
    bf16_row = next(line for line in text.splitlines() if "| bf16 " in line)
    assert "0%" not in bf16_row  # no quantization share for the peers (their quantization is not classified)


def test_e2e_targets_pass_and_miss():
    ok_shape, slow_shape = "deepseek-v3 fc1 32x512 balanced", "qwen3-235b fc2 32x512 balanced"
    records = [
        _e2e("bf16", ok_shape, mb4_ms=1.6, peak_mb=100.0, peak_act_mb=150.0), _e2e("torchao_fp8", ok_shape, mb4_ms=2.5),
        _e2e("bf16", slow_shape, mb4_ms=1.0, peak_mb=100.0, peak_act_mb=150.0), _e2e("torchao_fp8", slow_shape, mb4_ms=1.2),
        _e2e("turbo:triton:tensorwise+wcache", ok_shape, mb4_ms=1.0, quant_share_mb4=0.10),
        _e2e("turbo:triton:tensorwise+wcache", slow_shape, mb4_ms=1.25, quant_share_mb4=0.20),
        _e2e("turbo:triton:tensorwise", ok_shape, host_us=250.0, launches=9, peak_mb=90.0, peak_act_mb=120.0, ms=1.2,
             graph_ms=1.0),
        _e2e("turbo:triton:tensorwise", slow_shape, host_us=400.0, launches=12, peak_mb=110.0, peak_act_mb=180.0),
    ]
    lines = e2e_targets(records)
    impl = "turbo:triton:tensorwise+wcache"
    assert f"- PASS {impl}: µb of 4 >= 1.5x bf16 at deepseek-v3 fc1 32x512: 1/1 shapes; worst 1.6 at deepseek-v3 fc1 32x512" in lines
    assert f"- MISS {impl}: µb of 4 >= 1.0x bf16, every shape: 1/2 shapes; worst 0.8 at qwen3-235b fc2 32x512" in lines
    assert f"- MISS {impl}: µb of 4 >= 1.5x torchao, every shape: 1/2 shapes; worst 0.96 at qwen3-235b fc2 32x512" in lines
    assert any(line.startswith(f"- MISS {impl}: quantization <= 15%") and "1/2 shapes; worst 0.2 at qwen3" in line
               for line in lines)
    plain = "turbo:triton:tensorwise"
    assert f"- MISS {plain}: host <= 300 µs per fwd+bwd: 1/2 shapes; worst 400 at qwen3-235b fc2 32x512" in lines
    assert f"- MISS {plain}: <= 10 launches per fwd+bwd (tensorwise): 1/2 shapes; worst 12 at qwen3-235b fc2 32x512" in lines
    # Both memory lines: x an activation (the target), and x held by the caller.
    assert f"- MISS {plain}: peak memory <= bf16's (no weight cache): 1/2 shapes; worst 1.2 at qwen3-235b fc2 32x512" in lines
    assert (f"- MISS {plain}: peak memory <= bf16's (no weight cache), x held by the caller: 1/2 shapes; "
            "worst 1.1 at qwen3-235b fc2 32x512") in lines
    assert f"- MISS {plain}: eager <= 1.1x CUDA graph at >= 16k tokens: 1/2 shapes; worst 1.2 at deepseek-v3 fc1 32x512" in lines
    # Speed targets are the cached layers' (the weight quantized once per step); host/launch/memory the others'.
    assert not any(line.startswith(f"- PASS {plain}: µb") or line.startswith(f"- MISS {plain}: µb") for line in lines)
    assert not any(f"{impl}: host" in line for line in lines)


def test_issue10_shapes_are_the_bench_shapes_named_first():
    assert ISSUE10_SHAPES[:2] == (("deepseek-v3", "fc1", 32), ("qwen3-235b", "fc2", 32))
    assert len(ISSUE10_SHAPES) == len(set(ISSUE10_SHAPES)) == 18


def test_issue10_preset_cpu_smoke(tmp_path):
    pytest.importorskip("megatron")
    out = tmp_path / "i10"
    argv = ["--preset", "issue10", "--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1", "--experts", "16:16",
            "--layers", "fc1", "--train-configs", "expert-dominated", "--variants", "turbo-bf16,fp8-tensorwise",
            "--corpus-bytes", str(SMALL_CORPUS), "--out", str(out)]
    args = cli.parse_args(argv)
    assert args.levels == ["e2e"] and args.granularity == ["tensorwise", "tensorwise+wcache", "rowwise", "rowwise+wcache",
                                                           "tensorwise-delayed+wcache"]
    assert args.format == "e4m3" and args.train_format == "hybrid" and "gpusplit" in args.e2e_extras
    assert cli.main(argv) == 0
    with open(out / "results.json") as f:
        e2e = json.load(f)["records"]
    assert [r["impl"] for r in e2e] == ["turbo:torch:tensorwise", "turbo:torch:tensorwise+wcache", "turbo:torch:rowwise",
                                        "turbo:torch:rowwise+wcache", "turbo:torch:tensorwise-delayed+wcache", "bf16",
                                        "torchao_fp8"]
    assert all(r["status"] == "ok" for r in e2e[:6]) and e2e[6]["status"] == "missing"
    assert all("gpusplit: the profiler's GPU-time breakdown needs a CUDA device" in r["hot_path_notes"] for r in e2e[:6])
    md = (out / "results.md").read_text()
    assert "### Issue 10 targets (end to end)" in md and "host <= 300 µs" in md
    with open(out / "train" / "results.json") as f:
        train = json.load(f)
    assert train["meta"]["args"]["format"] == "hybrid"
    assert [(r["impl"], r["status"], r["steps"]) for r in train["records"]] == [
        ("turbo-bf16", "ok", 2), ("fp8-tensorwise", "ok", 2)]


@needs_megatron
def test_train_preset_fine_grained_variants(tmp_path):
    out = tmp_path / "fine"
    rc = cli.main(["--preset", "train", "--device", "cpu", "--corpus-bytes", str(SMALL_CORPUS), "--train-configs",
                   "moderate", "--train-steps", "3", "--train-variants", "turbo-bf16,fp8-blockwise,fp8-mxfp8",
                   "--no-profile", "--out", str(out)])
    assert rc == 0
    with open(out / "results.json") as f:
        by = {r["impl"]: r for r in json.load(f)["records"]}
    assert list(by) == ["turbo-bf16", "fp8-blockwise", "fp8-mxfp8"]
    bf16 = by["turbo-bf16"]["loss_curve"]
    for name in ("fp8-blockwise", "fp8-mxfp8"):
        r = by[name]
        assert r["status"] == "ok" and r["steps"] == 3, r["reason"]
        assert r["loss_curve"] != bf16 and all(math.isfinite(x) for x in r["loss_curve"])  # FP8 really ran
        assert all(abs(a / b - 1) < 0.01 for a, b in zip(r["loss_curve"], bf16))
    md = (out / "results.md").read_text()
    assert "fp8-blockwise" in md and "fp8-mxfp8" in md
    # The default list keeps the GPU time of before: the fine-grained variants are opt-in.
    assert cli.parse_args(["--device", "cpu", "--preset", "train"]).variants == [
        "turbo-bf16", "fp8-tensorwise", "fp8-rowwise", "megatron"]
