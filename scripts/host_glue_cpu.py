"""turbo_moe's own Python in one GroupedLinearFP8 fwd+bwd, measured on any machine (no GPU needed).

``scripts/host_breakdown.py`` measures the host cost on a GPU, where the device machine's load moves
it by 20-50% between minutes. This runs the GPU code path itself on CPU tensors, with every kernel
launch a no-op:

* the Triton backend's dispatch, launch plans and TMA descriptors (the first GPU candidate config);
* the Triton casts' and the offsets kernel's host code;
* the lean launcher's keys, memo lookups and hook checks. Only ``_Memo.run`` (Triton's C entry)
  is skipped, and a miss memoizes a stand-in kernel instead of compiling.

What it leaves out, so read its numbers as turbo_moe's Python alone:
* the C launches themselves;
* CUDA's caching allocator (CPU ``torch.empty`` is cheaper);
* the autograd engine's hand-off to its device thread (CPU backward runs inline).

Nothing is computed: outputs are uninitialized memory, only time is read.

Usage: ``python scripts/host_glue_cpu.py [--shape tiny|dsv3] [--granularity tensorwise|rowwise|blockwise|mxfp8|tensorwise-delayed]
[--cache] [--host-plans] [--profile N] [--mlp]`` (``--mlp``: an expert MLP's fwd+bwd, ``GroupedSwiGLUMLPFP8``;
the per-tensor recipes' planned MLP node is not emulated, so they show their Python ``Function`` path) (the fine-grained recipes: their Triton casts and GEMMs, MXFP8 through its
promotion loop as on Hopper)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _StandInKernel:
    """What a miss memoizes instead of a compiled kernel (its launcher is never called)."""

    run = None
    function = None
    packed_metadata = None


@contextlib.contextmanager
def gpu_path_on_cpu():
    """Route CPU tensors through the GPU code path with every launch a no-op (see the module doc)."""
    from turbo_moe import checks, delayed_scaling, quantize, swiglu
    from turbo_moe.backends import clear_dispatch_cache, triton_backend
    from turbo_moe.fine_grained import quantize as fine_quantize
    from turbo_moe.fine_grained import triton_gemm
    from turbo_moe.kernels.triton import amax_history, blockwise_cast, fp8_cast, group_offsets, launch, swiglu_fp8

    patches = [
        (launch, "_cuda_get_device", lambda: 0),
        (launch._Memo, "run", lambda self, grid, device, args: None),
        (launch.LeanLauncher, "_first_launch", _memoize_stand_in),
        (quantize, "_cast_kernels", lambda t: fp8_cast if t.dim() in (2, 3) else None),
        (delayed_scaling, "_history_kernels", lambda t: amax_history if t.dim() in (2, 3) else None),
        (swiglu, "_swiglu_kernels", lambda h: swiglu_fp8),
        (checks, "_offsets_kernel", lambda t: group_offsets),
        (triton_backend, "_interpreting", lambda: False),
        (triton_backend, "_tma_reason", lambda problem: ""),
        (triton_backend.TritonBackend, "is_available", lambda self: (True, "")),
        (triton_backend.TritonBackend, "_device_reason", lambda self, device: ""),
        (triton_backend.TritonBackend, "_choose_config",
         lambda self, problem, out: triton_backend.GPU_CANDIDATES[problem.kind][0]),
        # The fine-grained recipes: the device casts and the GPU tile configs for CPU tensors.
        (fine_quantize, "_kernels", lambda t: blockwise_cast),
        (triton_gemm, "default_config", lambda problem: triton_gemm._GPU_DEFAULTS[(problem.recipe.block, False)]),
        (triton_gemm, "_num_programs_limit", lambda problem: 132),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    clear_dispatch_cache()
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        clear_dispatch_cache()
        triton_backend.BACKEND._plans.clear()
        # Forget the stand-in kernels, so that no later launch in this process can hit one.
        for launcher in launch._LAUNCHERS:
            for memos in (launcher._memo, launcher._keyed):
                for key in [key for key, memo in memos.items() if isinstance(memo.kernel, _StandInKernel)]:
                    del memos[key]


@contextlib.contextmanager
def replayed_regions():
    """Host launch plans on CPU tensors (``--host-plans``): every region's call after its first per
    signature costs what a replay costs in Python -- the signature key, the outputs' allocations
    (as the first call made them) -- and no C++ launch. What is left is the Python outside the
    regions, which plans do not remove. (A GPU replay now makes its allocations inside its C++
    call, so the outputs' ``torch.empty_strided`` calls here slightly overstate it.)"""
    from turbo_moe import host_plan

    made = {}
    original = host_plan.Region.__call__

    def call(self, static_key, inputs, fn, pure):
        key = (id(self), static_key, *map(host_plan.fact, inputs))
        specs = made.get(key)
        if specs is None:
            outputs = fn()
            made[key] = tuple(None if o is None else next((("input", i) for i, t in enumerate(inputs) if t is o),
                                                          ("new", tuple(o.shape), o.stride(), o.dtype))
                              for o in outputs)
            return outputs
        return tuple(None if spec is None else inputs[spec[1]] if spec[0] == "input" else
                     torch.empty_strided(spec[1], spec[2], dtype=spec[3]) for spec in specs)

    def through_plan(region, static, inputs, compute, histories=(), writes_inputs=False):  # CPU tensors too
        live = [h for h in histories if h is not None]
        if any(h.state is None for h in live):
            return compute()
        state = tuple(t for h in live for t in (h.state, h.ticket))
        return region((static, len(live)), (*inputs, *state), compute, pure=not (live or writes_inputs))

    from turbo_moe import autograd, swiglu

    saved = [(autograd, autograd.through_plan), (swiglu, swiglu.through_plan)]
    host_plan.Region.__call__ = call
    autograd.through_plan = swiglu.through_plan = through_plan
    try:
        yield
    finally:
        host_plan.Region.__call__ = original
        for module, value in saved:
            module.through_plan = value


def _memoize_stand_in(self, key, grid, args, kwargs):
    from turbo_moe.kernels.triton import launch

    self.misses += 1
    self._memo[key] = launch._Memo(_StandInKernel(), self._constexpr_values(args, kwargs))
    return self._memo[key].kernel


def _issue_us(fn, steps, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        out.append((time.perf_counter() - t0) / steps * 1e6)
    return min(out), statistics.median(out)


def main(argv=None):
    import turbo_moe
    from turbo_moe.kernels.triton.launch import launch_stats

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=["tiny", "dsv3"])
    p.add_argument("--granularity", default="tensorwise",
                   choices=["tensorwise", "rowwise", "blockwise", "mxfp8", "tensorwise-delayed"])
    p.add_argument("--cache", action="store_true", help="the FP8 weight cache on (quantized once, not per call)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--profile", type=int, default=0, help="cProfile this many fwd+bwd instead of timing")
    p.add_argument("--host-plans", action="store_true",
                   help="the regions replayed as host launch plans replay them (Python cost only: see replayed_regions)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--mlp", action="store_true",
                   help="an expert MLP (GroupedSwiGLUMLPFP8: fc1, the SwiGLU fused into fc2's input, fc2) instead "
                        "of one layer; the shape's N is the FFN width. With the fine-grained recipes the "
                        "activation's kernels need --host-plans (their first call runs the torch math on the CPU)")
    args = p.parse_args(argv)
    g, t, n, k = {"tiny": (8, 128, 256, 256), "dsv3": (32, 512, 4096, 7168)}[args.shape]
    # No memory is touched: empty tensors of the real shapes (uninitialized, never read).
    x = torch.empty(g * t, k, dtype=torch.bfloat16).requires_grad_()
    lens = torch.full((g,), t, dtype=torch.int64)
    from turbo_moe.bench.recipes import bench_float8_config

    config = bench_float8_config("e4m3", args.granularity)
    if args.mlp:
        layer = turbo_moe.GroupedSwiGLUMLPFP8(g, k, n, device="meta", dtype=torch.bfloat16, config=config,
                                              backend="triton")
        for linear in (layer.fc1, layer.fc2):
            linear.weight = torch.nn.Parameter(torch.zeros(linear.weight.shape, dtype=torch.bfloat16))
        probs = torch.rand(g * t).requires_grad_()
        dy = torch.randn(g * t, k, dtype=torch.bfloat16)
        x.data = torch.randn(g * t, k, dtype=torch.bfloat16)  # the first call's torch math reads it

        def step():
            return torch.autograd.grad(layer(x, lens, probs=probs), (x, probs, layer.fc1.weight, layer.fc2.weight), dy)
    else:
        dy = torch.empty(g * t, n, dtype=torch.bfloat16)
        layer = turbo_moe.GroupedLinearFP8(g, k, n, device="meta", dtype=torch.bfloat16, config=config,
                                           cache_fp8_weight=args.cache, backend="triton")
        layer.weight = torch.nn.Parameter(torch.empty(g, n, k, dtype=torch.bfloat16))

        def step():
            return torch.autograd.grad(layer(x, lens), (x, layer.weight), dy)

    with gpu_path_on_cpu(), (replayed_regions() if args.host_plans else contextlib.nullcontext()):
        for _ in range(3):
            step()
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
            return
        lo, med = _issue_us(step, args.steps, args.reps)
        empty = _empty_function_us(args.steps, args.reps)
    print(f"{'MLP ' if args.mlp else ''}shape {args.shape} G={g} tokens/expert={t} N={n} K={k} {args.granularity}"
          f"{' +weight cache' if args.cache else ''}{' +host plans (emulated)' if args.host_plans else ''}, launches stubbed")
    print(f"fwd+bwd turbo_moe Python: min {lo:.1f} us, median {med:.1f} us")
    print(f"empty autograd.Function fwd + autograd.grad (CPU): min {empty[0]:.1f} us, median {empty[1]:.1f} us")
    print("lean launches (hits, misses, direct):",
          {name: stats for name, stats in launch_stats().items() if stats[0] or stats[1]})


def _empty_function_us(steps, reps):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from host_breakdown import Nop  # the GPU breakdown's empty Function, so both rows measure one thing

    a = torch.empty(4, requires_grad=True)
    g = torch.empty(4)
    return _issue_us(lambda: torch.autograd.grad(Nop.apply(a), a, g), steps, reps)


if __name__ == "__main__":
    main()
