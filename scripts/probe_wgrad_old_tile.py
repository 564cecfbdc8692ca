"""Probe: when the accumulating Gluon wgrad reads a tile's old fp32 main_grad values (H100)

    python scripts/probe_wgrad_old_tile.py

``grouped_gemm_gluon.k_grouped_gemm_gluon_kernel`` adds each output tile into main_grad (Megatron's
gradient_accumulation_fusion): it reads the tile's old values through its one 64 KB staging tile,
adds, and stores them back. ``OLD_TILE_BOX`` says when the read is issued: in the epilogue (-1,
the kernel before 2026-11-27: the read's latency stood between two tiles' MMAs), or after box
min(boxes // 2, OLD_TILE_BOX) of the tile's MMAs (the previous tile's store must have left the
staging tile first). For the tuned candidates' tile shapes, at the train preset's expert-dominated
fc1 and fc2 (64 experts, balanced and skewed), and at DeepSeek-V3's fc1 (32 x 512 tokens): bit for
bit against the epilogue read, then timed (warm-L2 CUDA-event medians, ``warm_median_ms``), beside
the same GEMM into bf16 without the add and torch's ``main_grad.add_`` (the read-modify-write's
own DRAM time).
"""

import dataclasses

import torch

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.timing import warm_median_ms

# name -> (experts G, tokens M, N rows of dW, K columns of dW, skewed routing)
SHAPES = {
    "train fc1": (64, 98304, 4096, 1024, False),
    "train fc2": (64, 98304, 1024, 2048, False),
    "train fc1 skewed": (64, 98304, 4096, 1024, True),
    "dsv3 fc1 32x512": (32, 16384, 4096, 7168, False),
}
READS = {"epilogue": -1, f"box <= {tb.WGRAD_OLD_TILE_BOX} (default)": tb.WGRAD_OLD_TILE_BOX, "half the boxes": 1 << 20}


def group_offsets(G: int, M: int, skewed: bool) -> torch.Tensor:
    if not skewed:
        return torch.arange(G + 1, device="cuda") * (M // G)
    weights = torch.distributions.LogNormal(0.0, 1.0).sample((G,))  # a log-normal router, one expert empty
    lens = (weights / weights.sum() * M).floor().long()
    lens[3] = 0
    lens[0] += M - lens.sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).cuda()


def main() -> None:
    print(f"device: {torch.cuda.get_device_name(0)}")
    configs = [c for c in tb.ACCUMULATE_CANDIDATES if c.gluon and not c.pingpong]
    for name, (G, M, N, K, skewed) in SHAPES.items():
        torch.manual_seed(0)
        a = (torch.randn(N, M, device="cuda") * 2).to(torch.float8_e5m2)
        b = (torch.randn(K, M, device="cuda") * 2).to(torch.float8_e4m3fn)
        sa, sb = torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda")
        plain = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, group_offsets(G, M, skewed), torch.bfloat16)
        start = torch.randn(G, N, K, device="cuda")
        flops = 2 * N * K * M
        for config in configs:
            results, times = {}, {}
            for label, old_tile_box in READS.items():
                main_grad = start.clone()
                problem = dataclasses.replace(plain, out_dtype=torch.float32, out=main_grad, accumulate=True)
                if tb._gluon_reason(problem, config, main_grad):
                    break
                plan = tb.BACKEND._make_plan(problem, main_grad, config)  # a plan (and launch key) of its own
                plan = dataclasses.replace(plan, constexprs=dict(plan.constexprs, OLD_TILE_BOX=old_tile_box))
                plan.launch(problem, main_grad)
                torch.cuda.synchronize()
                results[label] = main_grad.clone()
                times[label] = warm_median_ms(lambda: plan.launch(problem, main_grad))
            if not times:
                continue
            first = results["epilogue"]
            for label, t in times.items():
                same = torch.equal(results[label].view(torch.int32), first.view(torch.int32))
                print(f"{name}: {str(config):32s} old tile read {label:22s} {t:.3f} ms {flops / t / 1e9:6.0f} TFLOPS "
                      f"{t / times['epilogue']:.3f}x  bits as the epilogue read: {same}", flush=True)
        t_bf16 = warm_median_ms(lambda: tb.BACKEND.run(plain))
        main_grad = start.clone()
        t_add = warm_median_ms(lambda: main_grad.add_(1.0))
        print(f"{name}: into bf16 without the add {t_bf16:.3f} ms; main_grad.add_ {t_add:.3f} ms "
              f"({main_grad.numel() * 8 / t_add / 1e9:.2f} TB/s)", flush=True)
        del a, b, start, main_grad, results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
