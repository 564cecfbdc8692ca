"""Probe: how much of the M-grouped FP8 GEMM (fwd / dgrad) is its epilogue, and what the ping-pong wins (H100)

    python scripts/probe_m_grouped_epilogue.py [--shapes train-fc1-fwd,...]

Issue 10's remaining expert time is mostly GEMMs (fwd + dgrad about 18 ms of the expert-dominated
step's ~50). A warp-specialized ping-pong kernel (one warpgroup's epilogue beside the other's
MMAs) can only win what the epilogue costs where no MMA runs. This probe brackets it at the train
preset's expert-dominated shapes (64 experts, 98304 routed rows), for the backend's first
M-grouped config (128 x 256 x 128, 8 warps, 3 stages), with a copy of
``grouped_gemm.m_grouped_gemm_tma_kernel``'s tile walk and main loop in three epilogue modes:

* 0: as shipped: dequantize, a store descriptor made per tile (ends at the group's last row), TMA store;
* 1: no store (the store sits behind a run-time condition that never holds: the MMAs stay);
* 2: a TMA store through one host descriptor over all of out (no per-tile descriptor; the rows
  past a group's end are overwritten by the next group's tile, so the result is wrong at group
  boundaries: a timing bound only).

Beside them: the backend's M-grouped candidates given explicitly (the Gluon ping-pong
among them, whose consumers overlap one's epilogue with the other's MMAs; plus two-programs-per-SM
configs the candidate table lacks), dense ``torch._scaled_mm`` over all rows with one weight (what
cuBLAS reaches at this M, N, K), and CUTLASS's ``torch._scaled_grouped_mm``. Mode 0's output is
checked bit for bit against the backend's. Warm-L2 CUDA-event medians (``warm_median_ms``).
Results: docs/results/h100_pingpong.md.
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.timing import warm_median_ms
from turbo_moe.kernels.triton import grouped_gemm as gg

# name -> (routed rows M, experts G, N, K): the expert-dominated layer's four M-grouped GEMMs
# (hidden 1024, expert FFN 2048: fc1 writes 2F = 4096 columns).
SHAPES = {
    "train-fc1-fwd": (98304, 64, 4096, 1024),
    "train-fc2-fwd": (98304, 64, 1024, 2048),
    "train-fc2-dgrad": (98304, 64, 2048, 1024),
    "train-fc1-dgrad": (98304, 64, 1024, 4096),
}
EXTRA_CONFIGS = (
    tb.KernelConfig(128, 128, 128, 8, 4, 2, programs_per_sm=2),
    tb.KernelConfig(64, 256, 128, 8, 4, 2, programs_per_sm=2),
    tb.KernelConfig(128, 128, 128, 8, 8, 2, programs_per_sm=2),
)


@triton.jit
def bracket(a_desc, b_desc, out_desc_all, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr, N, K, G, stride_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            MODE: tl.constexpr):
    """m_grouped_gemm_tma_kernel (tensorwise scales), its epilogue per MODE (module docstring)."""
    pid, num_programs, num_n_blocks, num_k_blocks = gg._persistent_start(N, K, BLOCK_N, BLOCK_K)
    group, group_first_tile, lo, hi, group_tiles = gg._m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)
    while group < G:
        group, group_first_tile, lo, hi, group_tiles = gg._m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks)
        if group < G:
            rows, m_block, n_block = gg._m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks,
                                                               GROUP_M)
            row0 = (lo + m_block * BLOCK_M).to(tl.int32)
            col0 = (group * N + n_block * BLOCK_N).to(tl.int32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                a = a_desc.load([row0, k_block * BLOCK_K])
                b = b_desc.load([col0, k_block * BLOCK_K])
                acc = gg._dot_nt(acc, a, b, BLOCK_K, False)
            acc = gg._dequantize(acc, a_scale_ptr, 0, b_scale_ptr, 0, False, False)
            col = (n_block * BLOCK_N).to(tl.int32)
            if MODE == 0:
                out_desc = tl.make_tensor_descriptor(out_ptr, shape=[hi.to(tl.int32), N], strides=[stride_om, 1],
                                                     block_shape=[BLOCK_M, BLOCK_N])
                out_desc.store([row0, col], acc.to(out_desc.dtype))
            elif MODE == 1:
                if N < 0:  # never: keeps the MMAs alive without storing
                    out_desc_all.store([row0, col], acc.to(out_desc_all.dtype))
            else:
                out_desc_all.store([row0, col], acc.to(out_desc_all.dtype))
        tile += num_programs


def _offsets(m: int, groups: int) -> torch.Tensor:
    lens = [m // groups] * groups
    lens[-1] += m - sum(lens)
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda")


def _tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    fp8 = torch.float8_e4m3fn
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name(0)}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}")
    for name in args.shapes.split(","):
        m, g, n, k = SHAPES[name]
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda").to(fp8)
        w = (torch.randn(g, n, k, device="cuda") * 0.5).to(fp8)
        sx, sw = torch.tensor(0.05, device="cuda"), torch.tensor(0.03, device="cuda")
        offs = _offsets(m, g)
        problem = GroupedGemmProblem(GemmKind.M_GROUPED, x, w, sx, sw, offs, torch.bfloat16, role="fwd")
        ref = tb.BACKEND.run(problem)
        torch.cuda.synchronize()
        line = lambda what, ms: print(f"{name} | {what} | {ms:.3f} ms | {_tflops(m, n, k, ms):.0f} TFLOPS", flush=True)
        line("backend, tuned", warm_median_ms(lambda: tb.BACKEND.run(problem)))
        for config in tb.GPU_CANDIDATES[GemmKind.M_GROUPED] + EXTRA_CONFIGS:
            try:
                out = tb.BACKEND.run(problem, config)
                torch.cuda.synchronize()
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                line(f"config {config}{'' if same else ' (BITS DIFFER)'}",
                     warm_median_ms(lambda: tb.BACKEND.run(problem, config)))
            except Exception as exc:  # a config that does not fit: say so, go on
                print(f"{name} | config {config} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        bm, bn, warps, stages = 128, 256, 8, 3
        out = torch.full_like(ref, float("nan"))
        a_desc = TensorDescriptor(x, [m, k], [k, 1], [bm, 128])
        b_desc = TensorDescriptor(w.view(g * n, k), [g * n, k], [k, 1], [bn, 128])
        out_all = TensorDescriptor(out, [m, n], [n, 1], [bm, bn])
        for mode in (0, 1, 2):
            def fn():
                bracket[(sms,)](a_desc, b_desc, out_all, out, sx, sw, offs, n, k, g, out.stride(0), BLOCK_M=bm,
                                BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, MODE=mode, num_warps=warps, num_stages=stages)
            fn()
            torch.cuda.synchronize()
            note = ""
            if mode == 0:
                note = "" if torch.equal(out.view(torch.int16), ref.view(torch.int16)) else " (BITS DIFFER from the backend's)"
            line(f"bracket {bm}x{bn} w{warps} s{stages} mode {mode}{note}", warm_median_ms(fn))
        wt = w[0].t()  # [K, N], column-major: what _scaled_mm wants for its second operand
        line("dense torch._scaled_mm, one weight", warm_median_ms(
            lambda: torch._scaled_mm(x, wt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)))
        if hasattr(torch, "_scaled_grouped_mm"):
            sxr = torch.full((m,), 0.05, device="cuda")
            swr = torch.full((g, n), 0.03, device="cuda")
            ends = offs[1:].to(torch.int32)
            try:
                line("CUTLASS torch._scaled_grouped_mm (rowwise scales)", warm_median_ms(
                    lambda: torch._scaled_grouped_mm(x, w.transpose(-2, -1), sxr, swr, offs=ends,
                                                     out_dtype=torch.bfloat16)))
            except Exception as exc:
                print(f"{name} | CUTLASS | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
