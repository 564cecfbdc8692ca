"""Probe: fc1 reducing the SwiGLU amax in the ping-pong's epilogue, against the amax pass (H100)

    python scripts/probe_fc1_swiglu_pingpong.py

An expert MLP's forward, tensorwise current scaling: fc1 (``h = x @ W1[g]^T``), then the SwiGLU's
FP8 cast of ``a = silu(h[:, :F]) * h[:, F:] * probs`` (both layouts), whose scale needs
``max |a|``. Unfused: fc1 on the ping-pong, the amax pass over ``h``, the cast. Fused: fc1's
SWIGLU tiles reduce the amax in their epilogue (``GroupedGemmProblem.swiglu_probs``), then the
cast. Both are checked bit for bit first (h, the amax, both FP8 layouts and the scale), then timed
(warm-L2 CUDA-event medians, ``warm_median_ms``). Stop 37 measured the same fusion in the Triton
kernel at 0.99-1.04x the unfused time, its epilogue overlapping no MMA
(``docs/results/h100_fc1_swiglu_amax.md``).
"""

import dataclasses

import torch

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.timing import warm_median_ms
from turbo_moe.kernels.triton import swiglu_fp8

# name -> (routed rows M, experts G, hidden K, expert FFN F)
SHAPES = {
    "train": (98304, 64, 1024, 2048),  # the train preset's expert-dominated layer
    "dsv3": (16384, 32, 7168, 2048),  # DeepSeek-V3 fc1, 32 experts x 512 tokens
}
SLOTS = 512


def _offsets(m: int, groups: int) -> torch.Tensor:
    lens = [m // groups] * groups
    lens[-1] += m - sum(lens)
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda")


def main() -> None:
    fp8 = torch.float8_e4m3fn
    print(f"device: {torch.cuda.get_device_name(0)}")
    for name, (m, g, k, f) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda").to(fp8)
        w = (torch.randn(g, 2 * f, k, device="cuda") * 0.5).to(fp8)
        sx, sw = torch.tensor(0.05, device="cuda"), torch.tensor(0.03, device="cuda")
        probs = torch.rand(m, device="cuda")
        plain = GroupedGemmProblem(GemmKind.M_GROUPED, x, w, sx, sw, _offsets(m, g), torch.bfloat16, role="fwd")
        slots = torch.empty(SLOTS, device="cuda")
        fused = dataclasses.replace(plain, swiglu_probs=probs, swiglu_amax=slots)
        why = tb.swiglu_reason(fused)
        if why:
            print(f"{name}: the fused path cannot run here: {why}")
            continue

        def unfused():
            h = tb.BACKEND.run(plain)
            partials = swiglu_fp8.swiglu_amax_partials(h, probs)
            return h, partials, swiglu_fp8.swiglu_fp8_tensorwise(h, probs, fp8, 448.0, write_transposed=True,
                                                                 amax_partials=partials)

        def fusedrun():
            h = tb.BACKEND.run(fused, tb.SWIGLU_CANDIDATES[0])
            return h, slots, swiglu_fp8.swiglu_fp8_tensorwise(h, probs, fp8, 448.0, write_transposed=True,
                                                              amax_partials=slots)

        h0, p0, (rows0, t0, s0) = unfused()
        h1, p1, (rows1, t1, s1) = fusedrun()
        torch.cuda.synchronize()
        same = {
            "h": torch.equal(h0.view(torch.int16), h1.view(torch.int16)),
            "amax": torch.equal(p0.max().view(torch.int32), p1.max().view(torch.int32)),
            "rows": torch.equal(rows0.view(torch.uint8), rows1.view(torch.uint8)),
            "transposed": torch.equal(t0.view(torch.uint8), t1.view(torch.uint8)),
            "scale": torch.equal(s0.reshape(1).view(torch.int32), s1.reshape(1).view(torch.int32)),
        }
        print(f"{name}: bitwise {same}", flush=True)
        t_unfused, t_fused = warm_median_ms(unfused), warm_median_ms(fusedrun)
        t_fc1 = warm_median_ms(lambda: tb.BACKEND.run(plain))
        t_fc1_fused = warm_median_ms(lambda: tb.BACKEND.run(fused, tb.SWIGLU_CANDIDATES[0]))
        print(f"{name}: fc1 {t_fc1:.3f} ms, fc1 with the amax {t_fc1_fused:.3f} ms; fc1 + amax pass + cast "
              f"{t_unfused:.3f} ms, fused + cast {t_fused:.3f} ms ({t_fused / t_unfused:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
