"""H100 speed table of the fine-grained recipes beside tensorwise (issue 12, item 5).

    python scripts/bench_fine_grained.py [--shapes deepseek|small] [--out table.md]

Times the GEMM kernels alone on pre-quantized operands (triton.testing.do_bench, median ms) for
fwd (M-grouped NT), dgrad (M-grouped, W^T) and wgrad (K-grouped), per recipe: tensorwise (the
Triton backend's tuned kernels), blockwise (1x128 / 128x128) and mxfp8 (promotion loop on sm_90;
``TURBO_MOE_MX_DOT_SCALED=1`` for the bf16-emulated tl.dot_scaled). Prints TFLOPS and the ratio
to tensorwise; issue 12 asks blockwise fwd/dgrad >= 0.9x tensorwise and wgrad >= 0.9x.

Peer: DeepGEMM's m-grouped contiguous blockwise GEMM, if ``deep_gemm`` imports; the adapter is
not written yet (its per-group 128-row alignment and TMA-aligned scale layout differ from ours),
so the script only reports whether it is installed. Also runs the quantization kernels' time.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

SHAPES = {
    # (experts, tokens per expert, hidden K, intermediate N): DeepSeek-V3-like expert GEMMs per rank
    "deepseek": [(8, 4096, 7168, 4096), (8, 4096, 2048, 7168), (32, 512, 7168, 4096)],
    "small": [(4, 1024, 1024, 2048)],
}


def _bench(fn):
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _tflops(m, n, k, ms):
    return 2.0 * m * n * k / ms / 1e9


def run_shape(G, T, K, N):
    from turbo_moe.autograd import quantize_weight
    from turbo_moe.backends import triton_backend
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import BlockScaledProblem, quantize as Q, triton_gemm
    from turbo_moe.quantize import quantize_tensorwise_layouts

    M = G * T
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(0, M + 1, T, device=dev, dtype=torch.int64)
    rows = {}
    # tensorwise
    e4 = torch.float8_e4m3fn
    xq, xt, xs = quantize_tensorwise_layouts(x, e4, transposed=True)
    dq, dt, ds = quantize_tensorwise_layouts(dy, e4, transposed=True)
    wq = quantize_weight(w, Float8Config())
    problems = {
        "fwd": GroupedGemmProblem(GemmKind.M_GROUPED, xq, wq.data, xs, wq.scale, offs, torch.bfloat16),
        "dgrad": GroupedGemmProblem(GemmKind.M_GROUPED, dq, wq.data_t, ds, wq.scale_t, offs, torch.bfloat16),
        "wgrad": GroupedGemmProblem(GemmKind.K_GROUPED, dt, xt, ds, xs, offs, torch.bfloat16),
    }
    rows["tensorwise"] = {op: _bench(lambda p=p: triton_backend.BACKEND.run(p)) for op, p in problems.items()}
    for name, cfg in (("blockwise", Float8Config(granularity="blockwise")), ("mxfp8", Float8Config(granularity="mxfp8"))):
        r = Q.recipe_of(cfg)
        xq, xs = Q.quantize_rows(x, r, e4)
        dq, ds = Q.quantize_rows(dy, r, e4)
        xt, xts = Q.quantize_tokens(x, offs, r, e4)
        dt, dts = Q.quantize_tokens(dy, offs, r, e4)
        wf = quantize_weight(w, cfg)
        fine = {
            "fwd": BlockScaledProblem(GemmKind.M_GROUPED, xq, wf.data, xs, wf.scale, offs, torch.bfloat16, r),
            "dgrad": BlockScaledProblem(GemmKind.M_GROUPED, dq, wf.data_t, ds, wf.scale_t, offs, torch.bfloat16, r),
            "wgrad": BlockScaledProblem(GemmKind.K_GROUPED, dt, xt, dts, xts, offs, torch.bfloat16, r),
        }
        rows[name] = {op: _bench(lambda p=p: triton_gemm.run(p)) for op, p in fine.items()}
        rows[name]["quant x (rows+tokens)"] = _bench(lambda: (Q.quantize_rows(x, r, e4), Q.quantize_tokens(x, offs, r, e4)))
    flops = {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (M, N, K)}
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
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    try:
        import deep_gemm  # noqa: F401

        peer = "deep_gemm imports; adapter not written yet (see module doc): no peer column"
    except Exception as exc:
        peer = f"no peer: deep_gemm does not import ({type(exc).__name__}: {exc})"
    print(peer)
    tables = [run_shape(*shape) for shape in SHAPES[args.shapes]]
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(peer + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
