"""Time the Triton grouped FP8 kernels beside their peers, in one process, on one GPU.

Peers: ``torch._scaled_grouped_mm`` (CUTLASS, rowwise scales, fast accumulation) for fwd, dgrad
and wgrad, and dense ``torch._scaled_mm`` (tensorwise, fast accumulation) on the whole token batch
as the ceiling of a balanced grouped GEMM. Every result of ours is also checked against the peer's
output (relative Frobenius error; both are FP8 products, so they agree to fp32/bf16 rounding).

    python scripts/triton_tune.py                      # all shapes, table on stdout
    python scripts/triton_tune.py --models dsv3 --experts 8x4096 --ops fwd --json out.json
    python scripts/triton_tune.py --configs            # also time every candidate config

TFLOPS = 2*M*N*K / time (M = all tokens). "skew": one expert gets half of the tokens, the others
split the rest evenly (rounded to multiples of 16, which the CUTLASS peer needs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

MODELS = {  # name: (hidden, ffn)
    "dsv3": (7168, 2048),
    "qwen3": (4096, 1536),
    "gptoss": (2880, 2880),
}
EXPERTS = {"8x4096": (8, 4096), "32x512": (32, 512), "128x128": (128, 128)}


def group_lens(num_groups: int, tokens_each: int, skewed: bool) -> list:
    total = num_groups * tokens_each
    if not skewed:
        return [tokens_each] * num_groups
    light = (total // 2) // (num_groups - 1) // 16 * 16
    return [total - light * (num_groups - 1)] + [light] * (num_groups - 1)


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--experts", nargs="*", default=list(EXPERTS))
    parser.add_argument("--ops", nargs="*", default=["fwd", "dgrad", "wgrad"])
    parser.add_argument("--layers", nargs="*", default=["fc1", "fc2"])
    parser.add_argument("--skew", nargs="*", default=["bal", "skew"])
    parser.add_argument("--configs", action="store_true", help="time every candidate config too")
    parser.add_argument("--rowwise", action="store_true", help="our kernels with rowwise scales (default tensorwise)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.backends.triton_backend import BACKEND, GPU_CANDIDATES

    dev = torch.device("cuda")
    e4m3 = torch.float8_e4m3fn
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    rows = []
    torch.manual_seed(0)
    for model in args.models:
        hidden, ffn = MODELS[model]
        for layer in args.layers:
            n, k = (2 * ffn, hidden) if layer == "fc1" else (hidden, ffn)
            for experts in args.experts:
                G, tokens = EXPERTS[experts]
                M = G * tokens
                x = (torch.randn(M, k, device=dev) * 0.5).to(e4m3)
                w = (torch.randn(G, n, k, device=dev) * 0.5).to(e4m3)
                w_t = w.transpose(1, 2).contiguous()  # [G, K, N], K-major for dgrad
                dy = (torch.randn(M, n, device=dev) * 0.5).to(e4m3)
                dy_t = dy.t().contiguous()  # [N, M]
                x_t = x.t().contiguous()  # [K, M]
                one = torch.ones((), device=dev)
                dense_ms = bench(lambda: torch._scaled_mm(x, w[0].t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True))
                for skew in args.skew:
                    lens = group_lens(G, tokens, skew == "skew")
                    offs = torch.tensor([0] + lens, device=dev).cumsum(0)
                    ends32 = offs[1:].to(torch.int32)
                    for op in args.ops:
                        if op == "fwd":
                            prob = GroupedGemmProblem(GemmKind.M_GROUPED, x, w, one, one, offs, torch.bfloat16, role="fwd")
                            sa, sb = torch.ones(M, device=dev), torch.ones(G, n, device=dev)
                            peer = lambda: torch._scaled_grouped_mm(x, w.transpose(1, 2), sa, sb, offs=ends32, out_dtype=torch.bfloat16, use_fast_accum=True)
                            flops = 2 * M * n * k
                        elif op == "dgrad":
                            prob = GroupedGemmProblem(GemmKind.M_GROUPED, dy, w_t, one, one, offs, torch.bfloat16, role="dgrad")
                            sa, sb = torch.ones(M, device=dev), torch.ones(G, k, device=dev)
                            peer = lambda: torch._scaled_grouped_mm(dy, w_t.transpose(1, 2), sa, sb, offs=ends32, out_dtype=torch.bfloat16, use_fast_accum=True)
                            flops = 2 * M * n * k
                        else:
                            prob = GroupedGemmProblem(GemmKind.K_GROUPED, dy_t, x_t, one, one, offs, torch.bfloat16, role="wgrad")
                            sa, sb = torch.ones(G * n, device=dev), torch.ones(G * k, device=dev)
                            peer = lambda: torch._scaled_grouped_mm(dy_t, x_t.t(), sa, sb, offs=ends32, out_dtype=torch.bfloat16, use_fast_accum=True)
                            flops = 2 * M * n * k
                        if args.rowwise:
                            if prob.kind is GemmKind.M_GROUPED:
                                prob.a_scale, prob.b_scale = sa, sb
                            else:
                                prob.a_scale, prob.b_scale = sa.view(G, n), sb.view(G, k)
                        t0 = time.time()
                        ours_out = BACKEND.run(prob)  # first eager call tunes
                        tune_s = time.time() - t0
                        config = BACKEND.tuned_configs().get(BACKEND.shape_class(prob))
                        try:
                            peer_out = peer()
                            err = rel_err(ours_out, peer_out)
                            peer_ms = bench(peer)
                        except Exception as exc:  # peer unsupported for this case
                            err, peer_ms = float("nan"), float("nan")
                            print(f"peer failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                        ours_ms = bench(lambda: BACKEND.run(prob))
                        row = dict(
                            model=model, layer=layer, n=n, k=k, experts=experts, skew=skew, op=op,
                            ours_tflops=flops / ours_ms / 1e9, peer_tflops=flops / peer_ms / 1e9,
                            dense_tflops=2 * M * n * k / dense_ms / 1e9, ratio=peer_ms / ours_ms,
                            rel_err_vs_peer=err, config=str(config), tune_s=tune_s,
                        )
                        if args.configs:
                            cands = GPU_CANDIDATES[prob.kind]
                            row["candidates"] = {
                                str(c): flops / bench(lambda c=c: BACKEND.run(prob, config=c)) / 1e9 for c in cands
                            }
                        rows.append(row)
                        print(
                            f"{model:6s} {layer} {experts:7s} {skew:4s} {op:5s} ours {row['ours_tflops']:7.1f} "
                            f"peer {row['peer_tflops']:7.1f} x{row['ratio']:.2f} dense {row['dense_tflops']:7.1f} "
                            f"err {err:.1e} [{config}]" + (f" {row.get('candidates')}" if args.configs else ""),
                            flush=True,
                        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
