"""Rowwise FP8 of a wgrad operand, both layouts: the two one-pass kernels against the two-pass pair.

    python scripts/bench_rowwise_casts.py [--tokens 98304] [--hidden 1024] [--ffn 2048] [--experts 64]

A rowwise wgrad operand (x, dy, the SwiGLU output a, its gradient dh; the weight) needs two FP8
copies: row-major scaled per row, token-major scaled per (group, column). Before, one kernel made
each (``fp8_rowwise_cast`` then ``fp8_colwise_grouped_cast``), each reading the source twice; now
``fp8_rowwise_layouts`` finds both amaxes in one pass and writes both copies in a second. Tensorwise's
two launches (amax partials, then the cast writing both layouts) are timed beside them as the bar.
Routing: balanced (equal groups) and skewed (half the rows in one group, the rest spread). Every
new result is checked bit for bit against the old kernels before timing. Times: CUDA-event medians
of 30 x 5 calls, L2 warm (``turbo_moe.bench.timing.warm_median_ms``); GB/s counts one read of the
source and both FP8 writes.
"""

from __future__ import annotations

import argparse

import torch

from turbo_moe.bench.timing import warm_median_ms as _median_ms


def _offsets(m: int, groups: int, skewed: bool) -> torch.Tensor:
    if skewed:
        lens = [m // 2] + [(m - m // 2) // (groups - 1)] * (groups - 1)
    else:
        lens = [m // groups] * groups
    lens[-1] += m - sum(lens)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, device="cuda")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=98304, help="routed rows (tokens x top-k)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args(argv)

    from turbo_moe.kernels.triton import fp8_cast as F
    from turbo_moe.kernels.triton import rowwise_layouts as L

    e4m3 = torch.float8_e4m3fn
    m, k, f, g = args.tokens, args.hidden, args.ffn, args.experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(f"x / dy [{m}, {k}]", (m, k)), (f"a [{m}, {f}]", (m, f)), (f"dh [{m}, {2 * f}]", (m, 2 * f)),
             (f"W1 [{g}, {2 * f}, {k}]", (g, 2 * f, k))]
    print(f"# {torch.cuda.get_device_name()}, bf16 sources, e4m3")
    print("| tensor | routing | old: rowwise + colwise ms | new: layouts ms | new / old | tensorwise ms | new GB/s |")
    print("|---|---|---|---|---|---|---|")
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for name, shape in cases:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for routing in (("balanced", "skewed") if len(shape) == 2 else ("per expert",)):
            offs = None if len(shape) == 3 else _offsets(m, g, routing == "skewed")

            def old():
                return F.fp8_rowwise_cast(x, e4m3, 448.0) + F.fp8_colwise_grouped_cast(x, offs, e4m3, 448.0)

            def new():
                return L.fp8_rowwise_layouts(x, offs, e4m3, 448.0)

            def tensorwise():
                return F.fp8_tensorwise_cast(x, e4m3, 448.0, 0, True, True)

            want, got = old(), new()
            for a, b in zip(got, want):
                assert (same(a, b) if a.dtype == e4m3 else torch.equal(a, b)), (name, routing)
            t_old, t_new, t_tw = (_median_ms(fn) for fn in (old, new, tensorwise))
            gbs = (x.numel() * x.element_size() + 2 * x.numel()) / t_new / 1e6
            print(f"| {name} | {routing} | {t_old:.3f} | {t_new:.3f} | {t_new / t_old:.2f}x | {t_tw:.3f} | {gbs:.0f} |")


if __name__ == "__main__":
    main()
