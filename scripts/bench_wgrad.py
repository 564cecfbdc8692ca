"""The variable-K wgrad into an fp32 main_grad, as a training step runs it: ours vs CUTLASS.

    python scripts/bench_wgrad.py [--configs all|default] [--out table.md]

Megatron with ``gradient_accumulation_fusion`` adds every micro-batch's weight gradient into an
fp32 ``main_grad``. Ours does it in the wgrad's epilogue (``accumulate=True``: a read-modify-write
of fp32 tiles); bf16 runs CUTLASS's ``torch._grouped_mm`` into bf16 and then ``main_grad.add_``.
Shapes: the training-step bench's expert-dominated layer (64 experts, top-8 of 12288 tokens,
hidden 1024, expert FFN 2048: fc1 and fc2, multinomial routing) and the kernel bench's DeepSeek-V3
fc1 at 32 x 512 and 128 x 128 tokens per expert. For each: every K-grouped candidate config given
explicitly (``--configs all``) or the tuned choice, then ours without accumulation (bf16 out,
tuned), beside CUTLASS bf16 (+ add) and CUTLASS FP8 ``torch._scaled_grouped_mm`` (bf16 out, + add;
and alone, the wgrad peer without accumulation) in the same process. Times: ``triton.testing.do_bench`` medians; TFLOPS count the GEMM's 2*N*K*tokens only.
Checks each of ours against a float64 reference of the same FP8 operands on one group first.
"""

from __future__ import annotations

import argparse

import torch


def _routing(tokens: int, topk: int, experts: int, gen) -> torch.Tensor:
    """Group sizes of ``tokens`` tokens each routed to ``topk`` distinct experts (uniform router)."""
    scores = torch.rand(tokens, experts, generator=gen, device="cuda")
    chosen = scores.topk(topk, dim=1).indices.flatten()
    return torch.bincount(chosen, minlength=experts)


SHAPES = {
    # name: (experts, N (rows of dW), K (cols of dW), group sizes or tokens per expert)
    "train fc1 64e top8": (64, 4096, 1024, "route"),
    "train fc2 64e top8": (64, 1024, 2048, "route"),
    "dsv3 fc1 32x512": (32, 4096, 7168, 512),
    "dsv3 fc1 128x128": (128, 4096, 7168, 128),
}


def main(argv=None):
    import triton.testing

    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
    from turbo_moe.backends.triton_backend import ACCUMULATE_CANDIDATES, BACKEND

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", choices=("all", "default"), default="all")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.tensor(1.0, device="cuda")
    lines = [f"device: {torch.cuda.get_device_name()}", "",
             "| shape | what | ms | TFLOPS | vs CUTLASS bf16 + add |", "|---|---|---|---|---|"]

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    for name in args.shapes.split(","):
        G, N, K, tokens = SHAPES[name]
        # CUTLASS needs every group's token count to be a multiple of 16 bytes: routed sizes are
        # rounded down to multiples of 16 tokens (the same problem for every implementation).
        lens = _routing(12288, 8, G, gen) // 16 * 16 if tokens == "route" else torch.full((G,), tokens, device="cuda")
        offs = torch.zeros(G + 1, dtype=torch.int64, device="cuda")
        offs[1:] = lens.cumsum(0)
        M = int(offs[-1])
        flops = 2.0 * N * K * M
        dy = torch.randn(M, N, device="cuda", generator=gen, dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        main_grad = torch.randn(G, N, K, device="cuda", generator=gen)
        rows = []

        # CUTLASS bf16: dW = dy^T @ x per group (torch._grouped_mm with offs over the tokens), + add.
        offs32 = offs[1:].to(torch.int32)
        dyt, xt = dy.t().contiguous(), x.t().contiguous()

        def bf16_wgrad():
            main_grad.add_(torch._grouped_mm(dyt, xt.t(), offs=offs32, out_dtype=torch.bfloat16))

        base = bench(bf16_wgrad)
        rows.append(("CUTLASS bf16 + add", base))
        dyt8, xt8 = dyt.to(torch.float8_e4m3fn), xt.to(torch.float8_e4m3fn)
        try:
            def fp8_cutlass():
                out = torch._scaled_grouped_mm(dyt8, xt8.t(), torch.ones(G * N, device="cuda"),
                                               torch.ones(G * K, device="cuda"), offs=offs32,
                                               out_dtype=torch.bfloat16, use_fast_accum=True)
                main_grad.add_(out)

            rows.append(("CUTLASS FP8 + add", bench(fp8_cutlass)))
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
            rows.append((f"CUTLASS FP8 unavailable: {type(exc).__name__}", float("nan")))

        reference = dyt8[:, : int(offs[1])].double() @ xt8[:, : int(offs[1])].double().T

        def ours(config, accumulate):
            out = main_grad if accumulate else None
            problem = GroupedGemmProblem(GemmKind.K_GROUPED, dyt8, xt8, one, one, offs, torch.float32 if accumulate
                                         else torch.bfloat16, role="wgrad", out=out, accumulate=accumulate)
            return lambda: BACKEND.run(problem, config)

        configs = list(ACCUMULATE_CANDIDATES) if args.configs == "all" else [None]
        for config in configs:
            check = torch.zeros(G, N, K, device="cuda")
            saved = main_grad
            main_grad = check
            ours(config, True)()
            main_grad = saved
            err = float((check[0].double() - reference).norm() / reference.norm())
            label = f"ours += fp32 [{config or 'tuned'}]"
            rows.append((label + ("" if err < 5e-3 else f" WRONG rel err {err:.2e}"), bench(ours(config, True))))
        rows.append(("ours bf16 out, no accumulation [tuned]", bench(ours(None, False))))
        try:
            rows.append(("CUTLASS FP8 bf16 out (no add)", bench(lambda: torch._scaled_grouped_mm(
                dyt8, xt8.t(), torch.ones(G * N, device="cuda"), torch.ones(G * K, device="cuda"), offs=offs32,
                out_dtype=torch.bfloat16, use_fast_accum=True))))
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
            rows.append((f"CUTLASS FP8 bf16 out unavailable: {type(exc).__name__}", float("nan")))
        for what, ms in rows:
            lines.append(f"| {name} (M={M}) | {what} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f}x |")
        print("\n".join(lines[-len(rows):]), flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
