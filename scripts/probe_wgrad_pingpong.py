"""Probe: the accumulating wgrad ping-pong against the single-stream Gluon wgrad (H100)

    python scripts/probe_wgrad_pingpong.py

The variable-K wgrad adding into an fp32 main_grad (Megatron's gradient_accumulation_fusion) at
the train preset's expert-dominated fc1 and fc2 and at DeepSeek-V3's fc1 (32 x 512 tokens):
``grouped_gemm_gluon.k_grouped_gemm_pingpong_kernel`` (two consumer warpgroups taking alternate
tiles, one's fp32 read-modify-write beside the other's MMAs) against ``k_grouped_gemm_gluon_kernel``
(the read-modify-write after each tile's MMAs), bit for bit first from the same main_grad, then
timed (warm-L2 CUDA-event medians, ``warm_median_ms``), beside the same GEMM into bf16 without the
add (the GEMM's own time). docs/results/h100_wgrad_main_grad.md: the single-stream epilogue cost
0.68 ms at fc1 (1.68 ms against 1.00 ms into bf16).
"""

import dataclasses

import torch

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.timing import warm_median_ms

# name -> (experts G, tokens M, N rows of dW, K columns of dW)
SHAPES = {
    "train fc1": (64, 98304, 4096, 1024),
    "train fc2": (64, 98304, 1024, 2048),
    "dsv3 fc1 32x512": (32, 16384, 4096, 7168),
}


def main() -> None:
    print(f"device: {torch.cuda.get_device_name(0)}")
    pingpong = next(c for c in tb.ACCUMULATE_CANDIDATES if c.pingpong)
    variants = {"single-stream " + str(c): c for c in tb.ACCUMULATE_CANDIDATES if c.gluon and not c.pingpong}
    variants["ping-pong " + str(pingpong)] = pingpong
    for stages in (2,):
        variants[f"ping-pong s{stages}"] = dataclasses.replace(pingpong, num_stages=stages)
    for name, (G, M, N, K) in SHAPES.items():
        torch.manual_seed(0)
        a = (torch.randn(N, M, device="cuda") * 2).to(torch.float8_e5m2)
        b = (torch.randn(K, M, device="cuda") * 2).to(torch.float8_e4m3fn)
        offs = torch.arange(G + 1, device="cuda") * (M // G)
        sa, sb = torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda")
        plain = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.bfloat16)
        start = torch.randn(G, N, K, device="cuda")
        results, times = {}, {}
        for label, config in variants.items():
            main_grad = start.clone()
            problem = dataclasses.replace(plain, out_dtype=torch.float32, out=main_grad, accumulate=True)
            why = tb._gluon_reason(problem, config, main_grad)
            if why:
                print(f"{name}: {label}: cannot run: {why}")
                continue
            plan = tb.BACKEND._make_plan(problem, main_grad, config)
            plan.launch(problem, main_grad)
            torch.cuda.synchronize()
            results[label] = main_grad.clone()
            times[label] = warm_median_ms(lambda: plan.launch(problem, main_grad))
        first = next(iter(results.values()))
        same = {label: torch.equal(r.view(torch.int32), first.view(torch.int32)) for label, r in results.items()}
        t_bf16 = warm_median_ms(lambda: tb.BACKEND.run(plain))
        flops = 2 * N * K * M
        print(f"{name}: bitwise against the first: {same}")
        base = next(iter(times.values()))
        for label, t in times.items():
            print(f"{name}: {label:45s} {t:.3f} ms {flops / t / 1e9:6.0f} TFLOPS ({t / base:.3f}x the first)")
        print(f"{name}: into bf16 without the add (default plan) {t_bf16:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
