"""Where the host time of one GroupedLinearFP8 forward+backward goes (GPU machine).

scripts/hotpath.py gives the total issue cost; this splits it by switching parts off, each row
measured the same way (the GPU kept busy by a long ``torch.cuda._sleep`` so the host never waits):

* ``full``: the real fwd+bwd;
* ``no triton launcher``: every lean launch does all its own work (key, memo lookup) but skips
  Triton's launcher call (``CompiledKernel.run``): what remains is turbo_moe's Python, torch's
  allocations and autograd;
* ``no GEMM launch``: the three GEMMs' launch plans return at once (no descriptors, no launch);
* components: a small and a large ``torch.empty`` on the GPU, one host TMA descriptor, an empty
  ``autograd.Function`` forward+backward, and the bf16 ``torch._grouped_mm`` fwd+bwd.

Outputs are garbage in the switched-off rows (kernels do not run): only their time is read.
``--profile N``: instead, cProfile N fwd+bwd (weight quantized every call, then with the FP8
weight cache) and print the functions by own time and by cumulative time: where the Python goes.
Both keep at most 20 fwd+bwd behind one GPU sleep: with hundreds queued, the driver's launch queue
fills and the launches that block are charged with the GPU's time (an earlier profile showed host
launch plans' C++ call at 155 us, of which 19 us is the call's own cost).

With host launch plans on (``turbo_moe/host_plan.py``), ``full`` runs the planned layer (one C++
call, a C++ backward node: ``turbo_moe/planned_layer.py``); one row runs the Python autograd
Function replaying the plans instead, and one times a plan's C++ ``replay()`` call alone there. The
switched-off rows run with plans off (a replay would launch its kernels on the garbage the
switched-off launches leave).

Usage: ``python scripts/host_breakdown.py [--shape tiny|dsv3] [--profile N]``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


def _issue_us(fn, steps=20, reps=11):
    """``(min, median)`` over ``reps`` loops of ``steps`` calls, in us per call. The machine's other
    load only ever adds time, so the minimum is the steadier estimate of the cost itself (run to
    run, medians here moved by 20%); the median says what a loop typically saw."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        out.append((time.perf_counter() - t0) / steps * 1e6)
        torch.cuda.synchronize()
    return min(out), statistics.median(out)


def _profile(name, fn, steps, top, chunk=20):
    """cProfile ``steps`` calls of ``fn`` with the GPU kept busy (the host never waits), ``chunk``
    calls per busy period: hundreds of calls queued behind one long sleep fill the driver's launch
    queue, and the launches that then block would be charged with the GPU's time."""
    import cProfile
    import io
    import pstats

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    elapsed = 0.0
    for done in range(0, steps, chunk):
        torch.cuda._sleep(int(1e8))
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(min(chunk, steps - done)):
            fn()
        prof.disable()
        elapsed += time.perf_counter() - t0
        torch.cuda.synchronize()
    us = elapsed / steps * 1e6
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats(order).print_stats(top)
        text = buf.getvalue()
        text = text[text.find("   ncalls"):]  # drop the header lines
        print(f"== {name}: {us:.0f} us per fwd+bwd under cProfile, {steps} steps; by {order}")
        print(text)


class Nop(torch.autograd.Function):
    """An autograd.Function that does nothing: the engine's own cost of one fwd+bwd."""

    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad):
        return grad


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def main(argv=None):
    import turbo_moe
    from turbo_moe.backends import triton_backend
    from turbo_moe.kernels.triton import launch as lean_launch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=["tiny", "dsv3"])
    p.add_argument("--profile", type=int, default=0, help="cProfile this many fwd+bwd instead of the table")
    p.add_argument("--top", type=int, default=45, help="rows of each profile listing")
    args = p.parse_args(argv)
    g, t, n, k = {"tiny": (8, 128, 256, 256), "dsv3": (32, 512, 4096, 7168)}[args.shape]
    dev = torch.device("cuda")
    x = torch.randn(g * t, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5)
    dy = torch.randn(g * t, n, device=dev, dtype=torch.bfloat16)
    lens = torch.full((g,), t, dtype=torch.int64, device=dev)
    layer = turbo_moe.GroupedLinearFP8(g, k, n, device="meta", dtype=torch.bfloat16, cache_fp8_weight=False)
    layer.weight = w

    def step():
        return torch.autograd.grad(layer(x, lens), (x, w), dy)

    ends = torch.cumsum(lens, 0).to(torch.int32)

    def bf16_step():
        return torch.autograd.grad(torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), (x, w), dy)

    for _ in range(5):
        step()
        bf16_step()
    torch.cuda.synchronize()
    if args.profile:
        cached = turbo_moe.GroupedLinearFP8(g, k, n, device="meta", dtype=torch.bfloat16, cache_fp8_weight=True)
        cached.weight = w

        def cached_step():
            return torch.autograd.grad(cached(x, lens), (x, w), dy)

        for name, fn in (("weight quantized every call", step), ("FP8 weight cache", cached_step)):
            _profile(name, fn, args.profile, args.top)
        return
    rows = [("full fwd+bwd", _issue_us(step)), ("bf16 _grouped_mm fwd+bwd", _issue_us(bf16_step))]

    # Host launch plans replay recorded launches from C++: with them off, the Python path's row.
    # The switched-off rows below run with plans off: a replayed plan would launch its kernels on
    # the garbage the switched-off launches leave (offsets never checked: out-of-bounds reads).
    from turbo_moe import host_plan, planned_layer

    layers_were_on = planned_layer.set_enabled(False)
    rows.append(("full fwd+bwd, Python Function (planned layers off)", _issue_us(step)))
    plans_were_on = host_plan.set_enabled(False)
    rows.append(("full fwd+bwd, host launch plans off", _issue_us(step)))
    # Every lean hit does all its own work (key, memo lookup) but the launch itself (_Memo.run:
    # Triton's launcher, scratch, descriptors' expansion) returns at once.
    if hasattr(lean_launch._Memo, "run"):
        with _patched(lean_launch._Memo, "run", lambda self, grid, device, args: None):
            rows.append(("no triton launcher call (plans off)", _issue_us(step)))
    with _patched(triton_backend._LaunchPlan, "launch", lambda self, problem, out: None):
        rows.append(("no GEMM launch (plan returns at once; plans off)", _issue_us(step)))
    host_plan.set_enabled(plans_were_on)
    if plans_were_on:
        ext = host_plan._extension()
        calls = []

        def timed(real):
            def call(*args):
                t0 = time.perf_counter()
                result = real(*args)
                calls.append(time.perf_counter() - t0)
                return result
            return call

        timed_calls = {"launch": timed(ext.launch), "replay": timed(ext.replay)}

        class _Ext:  # the extension's functions are read-only: wrap the module
            def __getattr__(self, name):
                return timed_calls.get(name) or getattr(ext, name)

        saved = {}
        for region in host_plan._REGIONS:
            for key, plan in region._plans.items():
                if plan is not host_plan._FAILED:
                    saved[id(plan)] = (plan, plan.ext)
                    plan.ext = _Ext()
        try:
            _issue_us(step)
        finally:
            for plan, original in saved.values():
                plan.ext = original
        if calls:
            calls.sort()
            rows.append(("  of which one plan's C++ replay() (median)",
                         calls[len(calls) // 2] * 1e6))
    planned_layer.set_enabled(layers_were_on)

    def many(fn, n=2000):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return us

    rows.append(("torch.empty((), float32) on GPU", many(lambda: torch.empty((), dtype=torch.float32, device=dev))))
    rows.append(("torch.empty(16384x7168 fp8) on GPU",
                 many(lambda: torch.empty((16384, 7168), dtype=torch.float8_e4m3fn, device=dev))))
    from triton.tools.tensor_descriptor import TensorDescriptor

    a8 = torch.empty((g * t, k), dtype=torch.float8_e4m3fn, device=dev)
    rows.append(("TensorDescriptor(...) construction", many(lambda: TensorDescriptor(a8, [g * t, k], [k, 1], [128, 128]))))

    rows.append(("empty autograd.Function fwd + autograd.grad", many(lambda: torch.autograd.grad(Nop.apply(x), x, dy[:, :1].expand(-1, k)), 500)))
    print(f"shape {args.shape}: G={g} tokens/expert={t} N={n} K={k}")
    print(f"{'':55s} {'min':>9s}    {'median':>9s}")
    for name, us in rows:
        low, mid = us if isinstance(us, tuple) else (us, us)
        print(f"{name:55s} {low:9.1f} us {mid:9.1f} us")
    print("lean launches (hits, misses, direct):", lean_launch.launch_stats())


if __name__ == "__main__":
    main()
