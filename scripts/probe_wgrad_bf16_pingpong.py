"""Probe: the wgrad ping-pong into bf16 against the single-stream Gluon wgrad (H100)

    python scripts/probe_wgrad_bf16_pingpong.py [--cold] [--shapes a,b] [--align N]

The variable-K wgrad writing a bf16 dW (a layer's weight gradient without Megatron's main_grad:
what ``torch.autograd.grad`` and the end-to-end bench's layers get) at the kernel bench's
DeepSeek-V3 and Qwen3-235B shapes, 8 / 32 / 128 experts, balanced and skewed, and the train
preset's fc1 / fc2: ``grouped_gemm_gluon.k_grouped_gemm_pingpong_kernel`` (two consumer
warpgroups taking alternate tiles, one's epilogue beside the other's MMAs) against every
single-stream Gluon candidate (``k_grouped_gemm_gluon_kernel``, whose epilogue runs between two
tiles' MMAs). Each variant's output is checked bit for bit against the first's, then timed:
CUDA-event medians with L2 warm (``warm_median_ms``), or cold with ``--cold`` (``median_ms``,
the kernel bench's timing). ``--align`` rounds the group sizes to multiples of N tokens (16 by
default, as the kernel bench's; 32 or 128 on the skewed shapes takes away the masked slices that
groups ending off a 32-token slice need, which separates that cost from the rest). CUTLASS FP8
(``torch._scaled_grouped_mm``, rowwise scales of ones, fast accumulation) is timed beside where it
runs, as the kernel bench's peer.
"""

import argparse
import dataclasses

import torch

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.data import random_fp8
from turbo_moe.bench.shapes import make_group_sizes
from turbo_moe.bench.timing import median_ms, warm_median_ms

# name -> (experts, tokens per expert, N rows of dW, K columns of dW, routing)
SHAPES = {
    "dsv3 fc1 32x512": (32, 512, 4096, 7168, "balanced"),
    "dsv3 fc2 32x512": (32, 512, 7168, 2048, "balanced"),
    "qwen3 fc1 32x512": (32, 512, 3072, 4096, "balanced"),
    "qwen3 fc2 32x512": (32, 512, 4096, 1536, "balanced"),
    "dsv3 fc1 32x512 skewed": (32, 512, 4096, 7168, "skewed"),
    "qwen3 fc2 32x512 skewed": (32, 512, 4096, 1536, "skewed"),
    "dsv3 fc1 128x128": (128, 128, 4096, 7168, "balanced"),
    "qwen3 fc2 128x128": (128, 128, 4096, 1536, "balanced"),
    "dsv3 fc1 8x4096": (8, 4096, 4096, 7168, "balanced"),
    "qwen3 fc2 8x4096": (8, 4096, 4096, 1536, "balanced"),
    "train fc1": (64, 1536, 4096, 1024, "balanced"),
    "train fc2": (64, 1536, 1024, 2048, "balanced"),
}


def _cutlass_ms(a, b, offs, timer):
    """CUTLASS FP8's grouped wgrad (torch._scaled_grouped_mm, 2d x 2d with group offsets), or None."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None
    try:
        G = offs.numel()
        sa = torch.ones(G * a.shape[0], device="cuda")
        sb = torch.ones(G * b.shape[0], device="cuda")
        bt = b.t()  # [M, K] column-major view of the token-major b

        def run():
            return torch._scaled_grouped_mm(a, bt, sa, sb, offs=offs.to(torch.int32), out_dtype=torch.bfloat16,
                                            use_fast_accum=True)

        run()
        return timer(run)
    except Exception as exc:  # noqa: BLE001 - report, do not stop the probe
        print(f"  CUTLASS FP8 did not run: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="cold-L2 medians (the kernel bench's timing)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of the shapes")
    parser.add_argument("--align", type=int, default=16, help="group sizes are multiples of this many tokens")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = (lambda fn: median_ms(fn, device)) if args.cold else warm_median_ms
    print(f"device: {torch.cuda.get_device_name(0)}; timing: {'cold' if args.cold else 'warm'}-L2 medians; "
          f"group sizes multiples of {args.align}")
    candidates = tb.GPU_CANDIDATES[GemmKind.K_GROUPED]
    variants = {"single " + str(c): c for c in candidates if c.gluon and not c.pingpong}
    pingpong = next(c for c in candidates if c.pingpong)
    variants["ping-pong " + str(pingpong)] = pingpong
    variants["ping-pong s3"] = dataclasses.replace(pingpong, num_stages=3)
    for name in args.shapes.split(","):
        G, per, N, K, routing = SHAPES[name]
        lens = make_group_sizes(G, per, routing, align=args.align)
        M = sum(lens)
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = random_fp8((N, M), torch.float8_e4m3fn, device, gen)  # e4m3 both: CUTLASS's operands
        b = random_fp8((K, M), torch.float8_e4m3fn, device, gen)
        offs = torch.tensor([0] + lens, device="cuda").cumsum(0)
        sa, sb = torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda")
        problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.bfloat16)
        first, same, unwritten, times = None, True, 0, {}
        for label, config in variants.items():
            why = tb._gluon_reason(problem, config, None)
            if why:
                print(f"{name}: {label}: cannot run: {why}")
                continue
            out = torch.full(problem.out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            run_problem = dataclasses.replace(problem, out=out)
            plan = tb.BACKEND._make_plan(run_problem, out, config)
            plan.launch(run_problem, out)
            torch.cuda.synchronize()
            unwritten += int(out.isnan().sum())
            if first is None:
                first = out.clone()
            else:
                same = same and torch.equal(out.view(torch.int16), first.view(torch.int16))
            times[label] = timer(lambda: plan.launch(run_problem, out))
            del out, run_problem, plan
        del first
        flops = 2 * N * K * M
        best_single = min(t for label, t in times.items() if label.startswith("single"))
        cutlass = _cutlass_ms(a, b, offs[1:], timer)
        print(f"{name} (G={G}, M={M}, dW {N}x{K}): all bitwise equal: {same}; NaN left: {unwritten}")
        for label, t in times.items():
            print(f"  {label:52s} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOPS  {t / best_single:.3f}x the best single")
        if cutlass is not None:
            label = "CUTLASS FP8 (torch._scaled_grouped_mm)"
            print(f"  {label:52s} {cutlass:7.3f} ms {flops / cutlass / 1e9:6.0f} TFLOPS")
        print(flush=True)


if __name__ == "__main__":
    main()
