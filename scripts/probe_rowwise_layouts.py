"""Probe: tile configurations of ``fp8_rowwise_layouts`` (kernels/triton/rowwise_layouts.py), per-kernel
GPU time from torch.profiler, on the training bench's expert-dominated shapes (balanced routing).

    python scripts/probe_rowwise_layouts.py
"""

from __future__ import annotations

import itertools

import torch
from torch.profiler import ProfilerActivity, profile


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
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.count:
            out[evt.key[:40]] = evt.device_time_total / 1e3 / reps
    return out


def main():
    from turbo_moe.kernels.triton import fp8_cast as F
    from turbo_moe.kernels.triton import rowwise_layouts as L
    e4m3 = torch.float8_e4m3fn
    m, groups = 98304, 64
    offs = torch.arange(0, m + 1, m // groups, device="cuda")
    offs[1:-1] += 7  # groups not aligned to any tile
    print("#", torch.cuda.get_device_name())
    for c in (1024, 4096):
        x = torch.randn(m, c, device="cuda", dtype=torch.bfloat16)
        ref = F.fp8_rowwise_cast(x, e4m3, 448.0) + F.fp8_colwise_grouped_cast(x, offs, e4m3, 448.0)
        tw = kernel_ms(lambda: F.fp8_tensorwise_cast(x, e4m3, 448.0, 0, True, True))
        print(f"C={c} tensorwise:", {k: round(v, 3) for k, v in tw.items()})
        for stats_r, stats_c, stats_w, cast_r, cast_c, cast_w in itertools.chain(
                [(sr, sc, sw, 64, 64, 4) for sr, sc, sw in ((128, 64, 8), (128, 128, 8), (256, 64, 8), (64, 64, 4))],
                [(128, 64, 8, cr, cc, cw) for cr, cc, cw in ((32, 64, 4), (64, 128, 4), (128, 64, 8), (32, 128, 4),
                                                             (64, 64, 8))]):
            L._STATS_R, L._STATS_C, L._STATS_WARPS = stats_r, stats_c, stats_w
            L._CAST_R, L._CAST_C, L._CAST_WARPS = cast_r, cast_c, cast_w
            got = L.fp8_rowwise_layouts(x, offs, e4m3, 448.0)
            ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, ref))
            t = kernel_ms(lambda: L.fp8_rowwise_layouts(x, offs, e4m3, 448.0))
            print(f"C={c} stats {stats_r}x{stats_c} w{stats_w} cast {cast_r}x{cast_c} w{cast_w} ok={ok}:",
                  {k.split('_kernel')[0][-14:]: round(v, 3) for k, v in t.items()}, round(sum(t.values()), 3))


if __name__ == "__main__":
    main()
