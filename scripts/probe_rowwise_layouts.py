"""Probe: tile configurations of the rowwise layouts (kernels/triton/rowwise_layouts.py), per-kernel
GPU time from torch.profiler, per source (a tensor x, the SwiGLU output a from h, its gradient dh
from h and da), at the training bench's expert-dominated size (98304 routed rows, 64 experts) and
its moderate one (4096 rows, 16 experts). Each configuration's bits are checked against the
default's before timing.

    python scripts/probe_rowwise_layouts.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

# Stats (rows of a slab, columns of a block, warps, rows a step).
STATS = [(32, 64, 4, 32), (256, 64, 4, 32), (512, 64, 4, 32), (256, 128, 4, 32), (512, 128, 4, 32),
         (256, 64, 4, 16), (512, 64, 8, 32)]
CASTS = [(32, 64, 4)] * len(STATS)


def kernel_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.count and "layouts" in evt.key:
            out["stats" if "stats" in evt.key else "cast"] = round(evt.device_time_total / 1e3 / reps, 3)
    return out


def main():
    from turbo_moe.kernels.triton import rowwise_layouts as L
    e4m3 = torch.float8_e4m3fn
    print("#", torch.cuda.get_device_name())
    for m, groups, f in ((98304, 64, 2048), (4096, 16, 2048)):
        offs = torch.arange(0, m + 1, m // groups, device="cuda")
        offs[1:-1] += 7  # groups not aligned to any tile
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
        da = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(m, device="cuda")
        calls = {
            L.SOURCE_TENSOR: lambda: L.fp8_rowwise_layouts(x, offs, e4m3, 448.0),
            L.SOURCE_SWIGLU: lambda: L.swiglu_rowwise_layouts(h, probs, offs, e4m3, 448.0),
            L.SOURCE_SWIGLU_GRAD: lambda: L.swiglu_backward_rowwise_layouts(h, probs, da, offs, e4m3, 448.0, 0,
                                                                            torch.float32),
        }
        for source, call in calls.items():
            default_stats, default_cast = L._STATS[source], L._CAST[source]
            ref = [t.clone() for t in call() if t is not None]
            print(f"M={m} G={groups} source {source} default:", kernel_ms(call))
            saved_min, L._MIN_STATS_TILES = L._MIN_STATS_TILES, 0
            for stats, cast in zip(STATS, CASTS):
                L._STATS[source], L._CAST[source] = stats, cast
                L._GEOMETRY.clear()  # the tiles are part of each shape's cached geometry
                got = [t for t in call() if t is not None]
                # Bits of the FP8 copies and scales; dprobs (the gradient's last result) is summed
                # over other splits when the split changes: equal within float32 rounding.
                grad = source == L.SOURCE_SWIGLU_GRAD
                exact = list(zip(got[:-1], ref[:-1])) if grad else list(zip(got, ref))
                ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in exact)
                if grad:  # sums of 2F terms of both signs: error relative to the largest
                    ok = ok and bool((got[-1] - ref[-1]).abs().max() <= 1e-5 * ref[-1].abs().max())
                print(f"  stats {stats} cast {cast} ok={ok}:", kernel_ms(call))
            L._STATS[source], L._CAST[source], L._MIN_STATS_TILES = default_stats, default_cast, saved_min
            L._GEOMETRY.clear()


if __name__ == "__main__":
    main()
