"""A/B on a GPU: the cooperative blockwise wgrad (k_grouped_block_scaled_coop_kernel) at 3 and 4 ring
stages, alternated five times in one process, into a bf16 dW and into an fp32 main_grad, at
bench_fine_grained.py's DeepSeek shapes. Prints medians, per-run ranges, the kernel each config ran,
and whether the bf16 outputs are bit-equal. ``--sweep`` single runs put 3 stages 4-11% ahead under
ptxas 12.8; this interleaved form found 0-2.5% (docs/results/h100_fine_grained.md).

    python scripts/probe_wgrad_stages.py
"""
import dataclasses
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fine_grained as B  # noqa: E402

from turbo_moe.config import Float8Config  # noqa: E402
from turbo_moe.fine_grained import triton_gemm  # noqa: E402
from turbo_moe.fine_grained.triton_gemm import BlockKernelConfig as C  # noqa: E402


def main():
    cfgs = {s: C(128, 128, 128, num_warps=8, num_stages=s, gluon=True) for s in (3, 4)}
    for shape in B.SHAPES["deepseek"]:
        G, T, K, N = shape
        problems, flops, _, _, _ = B._problems(G, T, K, N, Float8Config(granularity="blockwise"), time_tensorwise=False)
        p = problems["wgrad"]
        mg = torch.randn(G, N, K, device="cuda", dtype=torch.float32)
        pa = dataclasses.replace(p, out=mg, out_dtype=torch.float32, accumulate=True)
        for name, prob in (("bf16", p), ("main_grad", pa)):
            outs = {s: triton_gemm.run(dataclasses.replace(prob, out=None) if name == "bf16" else prob, c) for s, c in cfgs.items()}
            ms = {3: [], 4: []}
            for _ in range(5):
                for s, c in cfgs.items():
                    ms[s].append(triton.testing.do_bench(lambda: triton_gemm.run(prob, c), warmup=25, rep=200))
            kern = {s: triton_gemm.plan(prob, c).kernel_name for s, c in cfgs.items()}
            same = torch.equal(outs[3], outs[4]) if name == "bf16" else "n/a"
            print(f"G={G} T={T} K={K} N={N} {name}: " + " ".join(
                f"s{s} {statistics.median(v):.4f} ms ({B._tflops(*flops['wgrad'], statistics.median(v)):.0f} TFLOPS, {kern[s]}, runs {min(v):.4f}-{max(v):.4f})" for s, v in ms.items())
                + f" s3/s4 {statistics.median(ms[3]) / statistics.median(ms[4]):.3f} bits equal {same}", flush=True)


if __name__ == "__main__":
    main()
