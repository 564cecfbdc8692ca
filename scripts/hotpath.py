"""Hot-path numbers of one GroupedLinearFP8 forward+backward, beside bf16 ``torch._grouped_mm``.

For each shape and implementation, in one process on one GPU:

* host us: CPU time to *issue* one fwd+bwd (with ``--compare-host-plans``, also ``host_us_python``:
  the same with turbo_moe's host launch plans off, measured alternately with them; with
  ``--compare-plan-allocations``, ``host_us_python_allocations``: plans replayed with their
  allocations made from Python instead of inside the extension; with ``--compare-planned-layers``,
  ``host_us_no_planned_layer``: host plans on but the layer's Python autograd Function instead of
  its C++ node, turbo_moe/planned_layer.py). A loop of steps runs without synchronizing while the
  GPU is kept busy by a long kernel queued first (``torch.cuda._sleep``), so the host never waits
  on the GPU and the loop's wall time is pure issue cost;
* launches: GPU kernels of one fwd+bwd (torch.profiler, CUDA activity, after warm-up; with
  micro-batches, the mean over one optimizer step's micro-batches, the weight's quantization included);
* eager ms / graph ms: CUDA-event median of one fwd+bwd, eager and replayed from a CUDA graph;
* peak MB: ``torch.cuda.max_memory_allocated`` over one step (inputs included).

``--mlp`` measures a whole expert MLP instead (``MLP_SHAPES``): turbo_moe's
``GroupedSwiGLUMLPFP8`` (fc1, the routing-weighted SwiGLU fused into fc2's FP8 input, fc2, the dh
handoff; with ``--compare-planned-layers`` against its two Python Functions, turbo_moe/planned_mlp.py)
beside bf16 ``torch._grouped_mm`` fc1 and fc2 with the activation in torch ops between them, as
Megatron's eager grouped MLP runs it.

``--micro-batches 4`` runs the turbo layer as a trainer does under gradient accumulation: the
weight cache is on and the weight does not change between the 4 micro-batches, so the weight is
quantized once per 4 steps (the numbers are per micro-batch).

Run the same command under two checkouts (``PYTHONPATH=<old tree>``) for a before/after table;
``--json`` writes the rows for that.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

SHAPES = {
    # name: (experts, tokens per expert, N, K)
    "tiny-8x128-256x256": (8, 128, 256, 256),
    "gptoss-fc2-16x1024": (16, 1024, 2880, 2880),
    "dsv3-fc1-32x512": (32, 512, 4096, 7168),
    "qwen3-fc2-32x512": (32, 512, 4096, 1536),
    "dsv3-fc1-128x128": (128, 128, 4096, 7168),
    "dsv3-fc1-8x4096": (8, 4096, 4096, 7168),
}


MLP_SHAPES = {
    # name: (experts, tokens per expert, hidden, ffn); fc1 is hidden -> 2 x ffn (gate, linear)
    "tiny-8x128-256x256": (8, 128, 256, 256),
    # the training preset's configs (turbo_moe/bench/train_model.py), one layer and micro-batch
    "moderate-16x256-1024x2048": (16, 256, 1024, 2048),
    "expert-dominated-64x1536-1024x2048": (64, 1536, 1024, 2048),
    "dsv3-32x512-7168x2048": (32, 512, 7168, 2048),
}


def _events_ms(fn, reps=20):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def _issue_us(fn, steps=10):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # ~0.2 s of GPU spin: the queue never drains during the loop
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / steps * 1e6


def _count_kernels(fn, steps=1):
    """GPU kernels per call of ``fn``, averaged over ``steps`` calls (a micro-batch loop's steps
    differ: one of them re-quantizes the weight)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / steps


def _graph_ms(fn):
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        return _events_ms(graph.replay), ""
    except Exception as exc:  # report, do not fail the table
        return float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"


def build(impl, shape, fmt, granularity, micro_batches):
    import turbo_moe

    g, t, n, k = SHAPES[shape]
    m = g * t
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    w = torch.nn.Parameter(torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    lens = torch.full((g,), t, dtype=torch.int64, device=dev)
    if impl == "bf16":
        ends = torch.cumsum(lens, 0).to(torch.int32)

        def step():
            y = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
            return torch.autograd.grad(y, (x, w), dy)

        return step
    kwargs = {"cache_fp8_weight": micro_batches > 1} if micro_batches > 1 else {}
    try:
        from turbo_moe.bench.recipes import bench_float8_config
    except ImportError:  # a checkout from before the recipes module (a before/after run): granularities only
        def bench_float8_config(fmt, recipe):
            return turbo_moe.Float8Config(format=fmt, granularity=recipe)

    cfg = bench_float8_config(fmt, granularity)  # a granularity, or tensorwise-delayed
    layer = turbo_moe.GroupedLinearFP8(g, k, n, config=cfg, device="meta", dtype=torch.bfloat16, **kwargs)
    layer.weight = w
    if micro_batches == 1 and hasattr(layer, "cache_fp8_weight"):
        layer.cache_fp8_weight = False  # a fresh quantization every step (1 micro-batch per optimizer step)
    return _micro_batch_step(micro_batches, (w,), lambda: torch.autograd.grad(layer(x, lens), (x, w), dy))


def _micro_batch_step(micro_batches, weights, run):
    """``run`` as one micro-batch of a trainer's step: every ``micro_batches`` calls the weights
    change (an in-place add of 0: a version bump, so FP8 weight caches re-quantize)."""
    state = {"i": 0}

    def step():
        if micro_batches > 1 and state["i"] % micro_batches == 0:
            with torch.no_grad():
                for w in weights:
                    w.add_(0.0)
        state["i"] += 1
        return run()

    return step


def build_mlp(impl, shape, fmt, granularity, micro_batches):
    """One expert MLP fwd+bwd (see the module doc): turbo_moe's GroupedSwiGLUMLPFP8 or bf16."""
    import turbo_moe
    from turbo_moe.bench.recipes import bench_float8_config

    g, t, hidden, ffn = MLP_SHAPES[shape]
    m = g * t
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    probs = torch.rand(m, device=dev).requires_grad_(True)
    w1 = torch.nn.Parameter(torch.randn(g, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16) * hidden**-0.5)
    w2 = torch.nn.Parameter(torch.randn(g, hidden, ffn, device=dev, dtype=torch.bfloat16) * ffn**-0.5)
    dy = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    lens = torch.full((g,), t, dtype=torch.int64, device=dev)
    if impl == "bf16":
        ends = torch.cumsum(lens, 0).to(torch.int32)

        def step():
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
            gate, linear = h.chunk(2, dim=-1)
            a = (torch.nn.functional.silu(gate) * linear * probs[:, None]).to(h.dtype)
            y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=ends)
            return torch.autograd.grad(y, (x, w1, w2, probs), dy)

        return step
    mlp = turbo_moe.GroupedSwiGLUMLPFP8(g, hidden, ffn, config=bench_float8_config(fmt, granularity), device="meta",
                                        dtype=torch.bfloat16, cache_fp8_weight=micro_batches > 1)
    mlp.fc1.weight, mlp.fc2.weight = w1, w2
    return _micro_batch_step(micro_batches, (w1, w2),
                             lambda: torch.autograd.grad(mlp(x, lens, probs=probs), (x, w1, w2, probs), dy))


def _host_us_alternating(step, switch, rounds=7):
    """(median host us with ``switch(True)``, the same with ``switch(False)``), measured alternately
    so that the machine's drift hits both alike; ``switch`` returns the previous setting."""
    previous = switch(True)
    on, off = [], []
    try:
        for _ in range(rounds):
            switch(False)
            off.append(_issue_us(step))
            switch(True)
            on.append(_issue_us(step))
    finally:
        switch(previous)
    return statistics.median(on), statistics.median(off)


def _plan_allocations_in_cpp(flag):
    """Replays make their allocations in the extension (True) or in Python (False)."""
    from turbo_moe import host_plan

    previous, host_plan.CPP_ALLOCATIONS = host_plan.CPP_ALLOCATIONS, flag
    return previous


def _planned_layers(flag):
    from turbo_moe import planned_layer

    return planned_layer.set_enabled(flag)


def measure(impl, shape, fmt, granularity, micro_batches, profile_top, compare_plans=False,
            compare_allocations=False, compare_planned=False, mlp=False):
    step = (build_mlp if mlp else build)(impl, shape, fmt, granularity, micro_batches)
    for _ in range(3 * max(micro_batches, 1)):
        step()
    torch.cuda.synchronize()
    row = {"impl": impl, "shape": shape, "mb": micro_batches}
    if compare_plans and impl == "turbo":
        from turbo_moe import host_plan

        row["host_us"], row["host_us_python"] = _host_us_alternating(step, host_plan.set_enabled)
    elif compare_allocations and impl == "turbo":
        row["host_us"], row["host_us_python_allocations"] = _host_us_alternating(step, _plan_allocations_in_cpp)
    elif compare_planned and impl == "turbo":
        row["host_us"], row["host_us_no_planned_layer"] = _host_us_alternating(step, _planned_layers)
    else:
        row["host_us"] = statistics.median(_issue_us(step) for _ in range(3))
    row["launches"] = _count_kernels(step, max(micro_batches, 1))
    row["eager_ms"] = _events_ms(step)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if micro_batches == 1:
        row["graph_ms"], row["graph_note"] = _graph_ms(step)
    g, t, n, k = MLP_SHAPES[shape] if mlp else SHAPES[shape]
    flops = 6 * g * t * n * k * (3 if mlp else 1)  # an MLP: fc1 (n -> 2k) and fc2 (k -> n)
    row["tflops"] = flops / (row["eager_ms"] * 1e-3) / 1e12
    if profile_top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(profile_top)
        row["profile"] = buf.getvalue()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny-8x128-256x256,dsv3-fc1-32x512")
    p.add_argument("--impls", default="turbo,bf16")
    p.add_argument("--format", default="hybrid")
    p.add_argument("--granularities", default="tensorwise,rowwise",
                   help="comma list of turbo_moe.bench.recipes.RECIPES (tensorwise-delayed: delayed scaling)")
    p.add_argument("--micro-batches", default="1,4")
    p.add_argument("--profile-top", type=int, default=0, help="cProfile the issue loop of the first shape")
    p.add_argument("--compare-host-plans", action="store_true",
                   help="turbo rows: host us with host launch plans (turbo_moe.host_plan) and without, interleaved")
    p.add_argument("--compare-plan-allocations", action="store_true",
                   help="turbo rows: host us with host-plan replays allocating in C++ (the default) and in "
                        "Python (host_us_python_allocations), interleaved")
    p.add_argument("--compare-planned-layers", action="store_true",
                   help="turbo rows: host us with the layer's C++ autograd node (turbo_moe.planned_layer, the "
                        "default) and with its Python Function (host_us_no_planned_layer), interleaved")
    p.add_argument("--mlp", action="store_true",
                   help="a whole expert MLP per step (MLP_SHAPES; --compare-planned-layers: its C++ node, "
                        "turbo_moe.planned_mlp, against the Python Functions)")
    p.add_argument("--label", default="")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    rows = []
    for si, shape in enumerate(args.shapes.split(",")):
        for impl in args.impls.split(","):
            variants = [("-", 1)] if impl == "bf16" else [
                (gr, int(mb)) for gr in args.granularities.split(",") for mb in args.micro_batches.split(",")
            ]
            for granularity, mb in variants:
                try:
                    row = measure(impl, shape, args.format, granularity, mb,
                                  args.profile_top if (si == 0 and impl == "turbo" and mb == 1) else 0,
                                  args.compare_host_plans, args.compare_plan_allocations,
                                  args.compare_planned_layers, args.mlp)
                except Exception as exc:
                    row = {"impl": impl, "shape": shape, "mb": mb, "error": f"{type(exc).__name__}: {exc}"}
                row["granularity"], row["label"] = granularity, args.label
                prof = row.pop("profile", None)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if prof:
                    print(prof, flush=True)
                torch.cuda.empty_cache()
    try:
        from turbo_moe.kernels.triton.launch import launch_stats

        print("lean launches (hits, misses, direct):", launch_stats())
    except ImportError:  # a checkout from before the lean launcher
        pass
    try:
        from turbo_moe import host_plan

        print(f"host plans: {host_plan.status()}; per region (replays, plans, refusals):", host_plan.region_stats())
    except ImportError:  # a checkout from before host plans
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
