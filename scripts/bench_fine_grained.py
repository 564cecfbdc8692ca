"""H100 speed table of the fine-grained recipes beside tensorwise (issue 12, item 5).

    python scripts/bench_fine_grained.py [--shapes deepseek|small] [--routing skewed|dirichlet|zipf] [--align 1]
                                         [--recipes blockwise] [--shape-index 0,2] [--no-peer] [--out table.md]

Each shape's table is printed when it is done (``python -u`` under a time limit keeps what finished).

Times the GEMM kernels alone on pre-quantized operands (triton.testing.do_bench, median ms) for
fwd (M-grouped NT), dgrad (M-grouped, W^T) and wgrad (K-grouped), per recipe: tensorwise (the
Triton backend's tuned kernels), blockwise (1x128 / 128x128) and mxfp8 (promotion loop on sm_90;
``TURBO_MOE_MX_DOT_SCALED=1`` for the bf16-emulated tl.dot_scaled). Prints TFLOPS and the ratio
to tensorwise; issue 12 asks blockwise fwd/dgrad >= 0.9x tensorwise and wgrad >= 0.9x.

``--sweep``: instead, time the blockwise kernels (fwd, dgrad, wgrad) under each candidate tile
configuration of ``_sweep_configs`` (TMA and pointer loads, store paths, tiles, warps, stages) at
the shapes ``--sweep-shapes`` names (default the first), beside tensorwise: which configuration
the defaults (``turbo_moe/fine_grained/triton_gemm.py``) should be.

Peer (blockwise, the ``torchao blockwise`` row): torchao's blockwise FP8 training recipe
(``torchao.prototype.blockwise_fp8_training``, the same 1x128 / 128x128 scales; its own Triton casts)
on cuBLAS's blockwise-scaled dense GEMM (``F.scaled_mm`` with ``ScalingType.BlockWise1x128`` /
``BlockWise128x128``), one call per expert. torchao has no grouped blockwise GEMM (its
``emulated_blockwise_scaled_grouped_mm`` dequantizes to bf16, and its DeepGEMM path needs
``deep_gemm``, which publishes no wheel to carry to the offline device). The per-expert loop is
captured in a CUDA graph and the replay timed, so the peer's host loop costs it nothing: its
kernels' time alone, as ours is. Its operands are quantized outside the timing, as ours are.
DeepGEMM itself is reported only as installed or not. Also runs the quantization kernels' time.
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

    # The default tiles first, on the Triton TMA kernels (what runs where the Gluon ones decline);
    # wgrad's tile stored through pointers; the same tiles through pointer loads; other pipeline
    # depths; one warpgroup (two CTAs per SM, so one CTA's promotion can overlap the other's wgmma);
    # last, the Gluon kernels that sm_90 runs by default (triton_gemm.default_config).
    return [C(128, 128, 128, num_warps=8, num_stages=4), C(128, 128, 128, num_warps=8, num_stages=4, tma_store=False),
            C(128, 128, 128, num_warps=8, num_stages=4, tma=False),
            C(128, 128, 128, num_warps=8, num_stages=3), C(128, 128, 128, num_warps=8, num_stages=5),
            C(64, 128, 128, num_warps=4, num_stages=4), C(128, 64, 128, num_warps=4, num_stages=4),
            # 128 x 64 on two warpgroups: the K-grouped TMA kernel compiles without spills there
            # (its 128 x 128 default spills 60 bytes: the wgrad's column-scale vector)
            C(128, 64, 128, num_warps=8, num_stages=4),
            # the Gluon kernels (sm_90: the library's default there; the cooperative wgrad for bf16 dW)
            C(128, 128, 128, num_warps=8, num_stages=4, gluon=True),
            # the Gluon kernels' ring depth: the best one moved with the ptxas in the dense probe
            # (4 stages under 12.8, 5 under 12.9)
            C(128, 128, 128, num_warps=8, num_stages=3, gluon=True),
            C(128, 128, 128, num_warps=8, num_stages=5, gluon=True)]


def sweep_shape(G, T, K, N, rows=None):
    """Blockwise fwd/dgrad/wgrad TFLOPS per candidate config (see the module docstring); ``rows``:
    the indices of the configs to time (None: all)."""
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import triton_gemm

    problems, flops, tensorwise_ms, _, _ = _problems(G, T, K, N, Float8Config(granularity="blockwise"))
    lines = [f"blockwise config sweep, G={G} tokens/expert={T} K={K} N={N}",
             "| config | fwd TFLOPS | dgrad TFLOPS | wgrad TFLOPS | kernels (fwd, dgrad, wgrad) |", "|---|---|---|---|---|",
             "| tensorwise (tuned) | " + " | ".join(f"{_tflops(*flops[op], tensorwise_ms[op]):.0f}"
                                                  for op in ("fwd", "dgrad", "wgrad")) + " | |"]
    for i, cfg in enumerate(_sweep_configs()):
        if rows is not None and i not in rows:
            continue
        cells, ran = [], []
        for op in ("fwd", "dgrad", "wgrad"):
            try:
                ms = _bench(lambda p=problems[op]: triton_gemm.run(p, cfg))
                cells.append(f"{_tflops(*flops[op], ms):.0f} ({tensorwise_ms[op] / ms:.2f}x)")
                # which kernel ran: a config a kernel declines falls back to another one
                ran.append(triton_gemm.plan(problems[op], cfg).kernel_name)
            except Exception as exc:  # e.g. out of shared memory for this tile shape
                cells.append(f"fails: {type(exc).__name__}")
                ran.append("-")
        cells.append(", ".join(ran))
        name = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}" + ("" if cfg.tma else " ptr") + ("" if cfg.tma_store else " ptr-store")
                + (" gluon" if cfg.gluon else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _problems(G, T, K, N, cfg, time_tensorwise=True, lens=None):
    """The recipe's fwd/dgrad/wgrad problems on fresh operands, their (M, N, K) for TFLOPS, the
    tensorwise kernels' ms on the same shapes (None unless ``time_tensorwise``), and a function
    that quantizes x as the recipe does (rows and tokens layouts). ``lens``: the groups' token
    counts (G x T in all; None: T each)."""
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
    if lens is None:
        offs = torch.arange(0, M + 1, T, device=dev, dtype=torch.int64)
    else:
        offs = torch.tensor([0] + list(lens), device=dev, dtype=torch.int64).cumsum(0)
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
    # The wgrad's operands as the autograd makes them on a GPU: each group from a 16-token boundary.
    xt, xts, wgrad_offs = Q.quantize_tokens_for_wgrad(x, offs, r, e4)
    dt, dts, _ = Q.quantize_tokens_for_wgrad(dy, offs, r, e4, wgrad_offs=wgrad_offs)
    wf = quantize_weight(w, cfg)
    problems = {
        "fwd": BlockScaledProblem(GemmKind.M_GROUPED, xq, wf.data, xs, wf.scale, offs, torch.bfloat16, r),
        "dgrad": BlockScaledProblem(GemmKind.M_GROUPED, dq, wf.data_t, ds, wf.scale_t, offs, torch.bfloat16, r),
        "wgrad": BlockScaledProblem(GemmKind.K_GROUPED, dt, xt, dts, xts, wgrad_offs, torch.bfloat16, r),
    }
    flops = {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (M, N, K)}
    return (problems, flops, tensorwise_ms,
            lambda: (Q.quantize_rows(x, r, e4), Q.quantize_tokens_for_wgrad(x, offs, r, e4)), (x, w, dy))


def torchao_blockwise_ms(x, w, dy, T):
    """The peer's fwd / dgrad / wgrad ms (see the module docstring), or why it cannot run. Each op:
    one blockwise-scaled cuBLAS GEMM per expert (T tokens each), as torchao's ``fp8_blockwise_mm``
    issues them for one dense linear, captured in a CUDA graph."""
    try:
        import torch.nn.functional as F
        from torchao.prototype.blockwise_fp8_training import kernels as K
    except Exception as exc:  # noqa: BLE001 - report, do not stop the bench
        return f"torchao's blockwise recipe does not import ({type(exc).__name__}: {str(exc)[:120]})"
    one_by_128, block = K.BLOCKWISE_1X128_SCALING_TYPE, K.BLOCKWISE_128X128_SCALING_TYPE

    def mm(a, b, sa, ra, sb, rb):
        return F.scaled_mm(a, b, scale_a=sa, scale_recipe_a=ra, scale_b=K._prepare_blockwise_scaled_mm_rhs_scale(sb, rb),
                           scale_recipe_b=rb, output_dtype=torch.bfloat16)

    calls = {"fwd": [], "dgrad": [], "wgrad": []}
    for g in range(w.shape[0]):
        xg, dyg = x[g * T:(g + 1) * T], dy[g * T:(g + 1) * T]
        xq, xs = K.triton_fp8_blockwise_act_quant_lhs(xg, 128)
        wtq, wts = K.triton_fp8_blockwise_weight_quant_transposed_rhs(w[g], block_size=128)
        calls["fwd"].append((xq, wtq, xs, one_by_128, wts, block))
        dq, dsc = K.triton_fp8_blockwise_act_quant_lhs(dyg.contiguous(), 128)
        wq, wsc = K.triton_fp8_blockwise_weight_quant_rhs(w[g], block_size=128)
        calls["dgrad"].append((dq, wq, dsc, one_by_128, wsc, block))
        dtq, dts = K.triton_fp8_blockwise_act_quant_transposed_lhs(dyg.contiguous(), 128)
        xrq, xrs = K.triton_fp8_blockwise_act_quant_rhs(xg.contiguous(), 128)
        calls["wgrad"].append((dtq, xrq, dts, one_by_128, xrs.transpose(-1, -2), one_by_128))
    out = {}
    for op, args in calls.items():
        try:
            for a in args:  # compile / warm cuBLAS's heuristics outside the capture
                mm(*a)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for a in args:
                    mm(*a)
            out[op] = _bench(graph.replay)
        except Exception as exc:  # noqa: BLE001 - a recipe cuBLAS refuses on this GPU: say so
            out[op] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return out


def _bench(fn):
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def _tflops(m, n, k, ms):
    return 2.0 * m * n * k / ms / 1e9


def run_shape(G, T, K, N, routing="balanced", align=16, recipes=("blockwise", "mxfp8"), peer=True):
    """The table of one shape. ``routing`` / ``align``: the group sizes
    (``turbo_moe.bench.shapes.make_group_sizes``; ``align=1`` ragged, groups starting anywhere). The
    torchao peer runs on balanced routing only: its per-expert graph is built for equal groups.
    ``recipes``: the fine-grained rows beside tensorwise; ``peer``: time the torchao peer."""
    from turbo_moe.bench.shapes import make_group_sizes
    from turbo_moe.config import Float8Config
    from turbo_moe.fine_grained import triton_gemm

    lens = None if routing == "balanced" and align == 16 else make_group_sizes(G, T, routing, align=align)
    rows, notes = {}, []
    for name in recipes:
        problems, flops, tensorwise_ms, quantize_x, (x, w, dy) = _problems(
            G, T, K, N, Float8Config(granularity=name), time_tensorwise="tensorwise" not in rows, lens=lens)
        rows.setdefault("tensorwise", tensorwise_ms)
        rows[name] = {op: _bench(lambda p=p: triton_gemm.run(p)) for op, p in problems.items()}
        rows[name]["quant x (rows+tokens)"] = _bench(quantize_x)
        if name == "blockwise" and lens is None and peer:
            peer_ms = torchao_blockwise_ms(x, w, dy, T)
            if isinstance(peer_ms, str):
                notes.append(f"torchao blockwise: {peer_ms}")
            else:
                notes += [f"torchao blockwise {op}: {v}" for op, v in peer_ms.items() if isinstance(v, str)]
                rows["torchao blockwise"] = {op: v for op, v in peer_ms.items() if not isinstance(v, str)}
    lines = [f"G={G} tokens/expert={T} K={K} N={N} routing={routing} align={align}",
             "| recipe | fwd TFLOPS | dgrad TFLOPS | wgrad TFLOPS | x quant ms |", "|---|---|---|---|---|"]
    for name, ms in rows.items():
        cells = []
        for op in ("fwd", "dgrad", "wgrad"):
            if op not in ms:
                cells.append("n/a")
                continue
            t = _tflops(*flops[op], ms[op])
            ratio = "" if name == "tensorwise" else f" ({rows['tensorwise'][op] / ms[op]:.2f}x)"
            cells.append(f"{t:.0f}{ratio}")
        quant = ms.get("quant x (rows+tokens)")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'' if quant is None else f'{quant:.3f}'} |")
    peer_row = rows.get("torchao blockwise", {})
    ours = [f"{op} {peer_row[op] / rows['blockwise'][op]:.2f}x" for op in ("fwd", "dgrad", "wgrad") if op in peer_row]
    if ours:
        lines.append("")
        lines.append("blockwise against the torchao peer (its time over ours): " + ", ".join(ours))
    return "\n".join(lines + [""] + notes if notes else lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="deepseek", choices=sorted(SHAPES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--routing", default="balanced", choices=("balanced", "skewed", "dirichlet", "zipf"),
                        help="group sizes (turbo_moe.bench.shapes.make_group_sizes); the peer runs on balanced only")
    parser.add_argument("--align", type=int, default=16,
                        help="group sizes are multiples of this (1: ragged, groups starting anywhere)")
    parser.add_argument("--recipes", default="blockwise,mxfp8",
                        help="the fine-grained recipes timed beside tensorwise, comma-separated")
    parser.add_argument("--shape-index", default=None,
                        help="only these of the --shapes set, comma-separated indices (default all)")
    parser.add_argument("--no-peer", action="store_true", help="skip the torchao peer (balanced routing only)")
    parser.add_argument("--sweep", action="store_true", help="blockwise tile configs at the first shape instead")
    parser.add_argument("--sweep-rows", default=None,
                        help="with --sweep: the indices of the configs to time, comma-separated (default all)")
    parser.add_argument("--sweep-shapes", default="0",
                        help="with --sweep: the indices of the shapes to sweep, comma-separated (default 0)")
    args = parser.parse_args()
    from turbo_moe.backends.triton_backend import ptxas_description

    # the blockwise promotion's speed moves with the ptxas (docs/results/h100_fine_grained.md)
    header = f"device: {torch.cuda.get_device_name()}; ptxas {ptxas_description()}"
    print(header)
    try:
        import deep_gemm  # noqa: F401

        peer = "deep_gemm imports; adapter not written yet (see module doc): no peer column"
    except Exception as exc:
        peer = f"no peer: deep_gemm does not import ({type(exc).__name__}: {exc})"
    print(peer)
    if args.sweep:
        rows = None if args.sweep_rows is None else {int(r) for r in args.sweep_rows.split(",")}
        tables = [sweep_shape(*SHAPES[args.shapes][int(i)], rows=rows) for i in args.sweep_shapes.split(",")]
    else:
        shapes = SHAPES[args.shapes]
        if args.shape_index is not None:
            shapes = [shapes[int(i)] for i in args.shape_index.split(",")]
        tables = []
        for shape in shapes:  # each table printed when done: a call that runs out of time keeps the rest
            tables.append(run_shape(*shape, routing=args.routing, align=args.align,
                                    recipes=tuple(args.recipes.split(",")), peer=not args.no_peer))
            print(tables[-1] + "\n", flush=True)
    text = "\n\n".join(tables)
    if args.sweep:
        print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n" + peer + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
