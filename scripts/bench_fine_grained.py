"""H100 speed table of the fine-grained recipes beside tensorwise (issue 12, item 5).

    python scripts/bench_fine_grained.py [--shapes deepseek|small] [--out table.md]

Times the GEMM kernels alone on pre-quantized operands (triton.testing.do_bench, median ms) for
fwd (M-grouped NT), dgrad (M-grouped, W^T) and wgrad (K-grouped), per recipe: tensorwise (the
Triton backend's tuned kernels), blockwise (1x128 / 128x128) and mxfp8 (promotion loop on sm_90;
``TURBO_MOE_MX_DOT_SCALED=1`` for the bf16-emulated tl.dot_scaled). Prints TFLOPS and the ratio
to tensorwise; issue 12 asks blockwise fwd/dgrad >= 0.9x tensorwise and wgrad >= 0.9x.

``--sweep``: instead, time the blockwise kernels (fwd, dgrad, wgrad) under each candidate tile
configuration of ``_sweep_configs`` (TMA and pointer loads, store paths, tiles, warps, stages) at
the shapes ``--sweep-shapes`` names (default the first), beside tensorwise: which configuration
the defaults (``turbo_moe/fine_grained/triton_gemm.py``) should be.

Peer: DeepGEMM's m-grouped contiguous blockwise GEMM, if ``deep_gemm`` imports; the adapter is
not written yet (its per-group 128-row alignment and TMA-aligned scale layout differ from ours),
so the script only reports whether it is installed. Also runs the quantization kernels' time.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {
    # (experts, tokens per expert, hidden K, intermediate N): DeepSeek-V3-like expert GEMMs per rank
    "deepseek": [(8, 4096, 7168, 4096), (8, 4096, 2048, 7168), (32, 512, 7168, 4096)],
    "small": [(4, 1024, 1024, 2048)],
}


def _sweep_configs():
    from turbo_moe.fine_grained.triton_gemm import BlockKernelConfig as C

    # The default first (through TMA); wgrad's tile stored through pointers; the same tiles through
    # pointer loads; other pipeline depths; one warpgroup (two CTAs per SM, so one CTA's promotion
    # can overlap the other's wgmma).
    return [C(128, 128, 128, num_warps=8, num_stages=4), C(128, 128, 128, num_warps=8, num_stages=4, tma_store=False),
            C(128, 128, 128, num_warps=8, num_stages=4, tma=False),
            C(128, 128, 128, num_warps=8, num_stages=3), C(128, 128, 128, num_warps=8, num_stages=5),
            C(64, 128, 128, num_warps=4, num_stages=4), C(128, 64, 128, num_warps=4, num_stages=4),
            # 128 x 64 on two warpgroups: the K-grouped TMA kernel compiles without spills there
            # (its 128 x 128 default spills 60 bytes: the wgrad's column-scale vector)
            C(128, 64, 128, num_warps=8, num_stages=4)]


def sweep_shape(G, T, K, N):
    """Blockwise fwd/dgrad/wgrad TFLOPS per candidate config (see the module docstring)."""
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import triton_gemm

    problems, flops, tensorwise_ms, _ = _problems(G, T, K, N, Float8Config(granularity="blockwise"))
    lines = [f"blockwise config sweep, G={G} tokens/expert={T} K={K} N={N}",
             "| config | fwd TFLOPS | dgrad TFLOPS | wgrad TFLOPS |", "|---|---|---|---|",
             "| tensorwise (tuned) | " + " | ".join(f"{_tflops(*flops[op], tensorwise_ms[op]):.0f}"
                                                  for op in ("fwd", "dgrad", "wgrad")) + " |"]
    for cfg in _sweep_configs():
        cells = []
        for op in ("fwd", "dgrad", "wgrad"):
            try:
                ms = _bench(lambda p=problems[op]: triton_gemm.run(p, cfg))
                cells.append(f"{_tflops(*flops[op], ms):.0f} ({tensorwise_ms[op] / ms:.2f}x)")
            except Exception as exc:  # e.g. out of shared memory for this tile shape
                cells.append(f"fails: {type(exc).__name__}")
        name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + ("" if cfg.tma else " ptr") + ("" if cfg.tma_store else " ptr-store")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _problems(G, T, K, N, cfg, time_tensorwise=True):
    """The recipe's fwd/dgrad/wgrad problems on fresh operands, their (M, N, K) for TFLOPS, the
    tensorwise kernels' ms on the same shapes (None unless ``time_tensorwise``), and a function
    that quantizes x as the recipe does (rows and tokens layouts)."""
    from turbo_moe.autograd import quantize_weight
    from turbo_moe.backends import triton_backend
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import BlockScaledProblem, quantize as Q
    from turbo_moe.quantize import quantize_tensorwise_layouts

    M = G * T
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(0, M + 1, T, device=dev, dtype=torch.int64)
    e4 = torch.float8_e4m3fn
    xq, xt, xs = quantize_tensorwise_layouts(x, e4, transposed=True)
    dq, dt, ds = quantize_tensorwise_layouts(dy, e4, transposed=True)
    wq = quantize_weight(w, Float8Config())
    tensorwise = {
        "fwd": GroupedGemmProblem(GemmKind.M_GROUPED, xq, wq.data, xs, wq.scale, offs, torch.bfloat16),
        "dgrad": GroupedGemmProblem(GemmKind.M_GROUPED, dq, wq.data_t, ds, wq.scale_t, offs, torch.bfloat16),
        "wgrad": GroupedGemmProblem(GemmKind.K_GROUPED, dt, xt, ds, xs, offs, torch.bfloat16),
    }
    tensorwise_ms = ({op: _bench(lambda p=p: triton_backend.BACKEND.run(p)) for op, p in tensorwise.items()}
                     if time_tensorwise else None)
    r = Q.recipe_of(cfg)
    xq, xs = Q.quantize_rows(x, r, e4)
    dq, ds = Q.quantize_rows(dy, r, e4)
    xt, xts = Q.quantize_tokens(x, offs, r, e4)
    dt, dts = Q.quantize_tokens(dy, offs, r, e4)
    wf = quantize_weight(w, cfg)
    problems = {
        "fwd": BlockScaledProblem(GemmKind.M_GROUPED, xq, wf.data, xs, wf.scale, offs, torch.bfloat16, r),
        "dgrad": BlockScaledProblem(GemmKind.M_GROUPED, dq, wf.data_t, ds, wf.scale_t, offs, torch.bfloat16, r),
        "wgrad": BlockScaledProblem(GemmKind.K_GROUPED, dt, xt, dts, xts, offs, torch.bfloat16, r),
    }
    flops = {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (M, N, K)}
    return problems, flops, tensorwise_ms, lambda: (Q.quantize_rows(x, r, e4), Q.quantize_tokens(x, offs, r, e4))


def _bench(fn):
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _tflops(m, n, k, ms):
    return 2.0 * m * n * k / ms / 1e9


def run_shape(G, T, K, N):
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import triton_gemm

    rows = {}
    for name in ("blockwise", "mxfp8"):
        problems, flops, tensorwise_ms, quantize_x = _problems(G, T, K, N, Float8Config(granularity=name),
                                                               time_tensorwise="tensorwise" not in rows)
        rows.setdefault("tensorwise", tensorwise_ms)
        rows[name] = {op: _bench(lambda p=p: triton_gemm.run(p)) for op, p in problems.items()}
        rows[name]["quant x (rows+tokens)"] = _bench(quantize_x)
    lines = [f"G={G} tokens/expert={T} K={K} N={N}",
             "| recipe | fwd TFLOPS | dgrad TFLOPS | wgrad TFLOPS | x quant ms |", "|---|---|---|---|---|"]
    for name, ms in rows.items():
        cells = []
        for op in ("fwd", "dgrad", "wgrad"):
            t = _tflops(*flops[op], ms[op])
            ratio = "" if name == "tensorwise" else f" ({rows['tensorwise'][op] / ms[op]:.2f}x)"
            cells.append(f"{t:.0f}{ratio}")
        quant = ms.get("quant x (rows+tokens)")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'' if quant is None else f'{quant:.3f}'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="deepseek", choices=sorted(SHAPES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="blockwise tile configs at the first shape instead")
    parser.add_argument("--sweep-shapes", default="0",
                        help="with --sweep: the indices of the shapes to sweep, comma-separated (default 0)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    try:
        import deep_gemm  # noqa: F401

        peer = "deep_gemm imports; adapter not written yet (see module doc): no peer column"
    except Exception as exc:
        peer = f"no peer: deep_gemm does not import ({type(exc).__name__}: {exc})"
    print(peer)
    if args.sweep:
        tables = [sweep_shape(*SHAPES[args.shapes][int(i)]) for i in args.sweep_shapes.split(",")]
    else:
        tables = [run_shape(*shape) for shape in SHAPES[args.shapes]]
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(peer + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
