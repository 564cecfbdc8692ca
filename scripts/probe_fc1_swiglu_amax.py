"""Probe: can fc1's grouped GEMM reduce the SwiGLU's amax in its epilogue for free? (H100)

    python scripts/probe_fc1_swiglu_amax.py

Tensorwise FP8 of the routing-weighted SwiGLU ``a = silu(h[:, :F]) * h[:, F:] * probs`` needs
``max |a|`` before its cast; today a memory-bound pass over fc1's output ``h`` finds it
(``swiglu_fp8.swiglu_amax_partials_kernel``, 0.28 ms at the train preset's expert-dominated layer).
This probe builds fc1 as a tile of BLOCK_N gate columns plus the same BLOCK_N linear columns (two
accumulators over one A tile, both halves stored through descriptors), in modes:

* 0: no amax (the cost of the two-accumulator tile itself);
* 1: the exact ``max |a|`` per tile, reduced to a scalar per tile;
* 3: the same, reduced per row across a program's tiles and to a scalar once at its end;
* 4: mode 3 with the routing weights loaded before the K loop;
* 5: mode 1 with them loaded before the K loop;

over tile shapes and one or two programs per SM, against the tuned plain fc1 of the backend. Each
mode's h is checked bit for bit against the plain GEMM's. The result (docs/results/h100_fc1_swiglu_amax.md):
the epilogue's math (a sigmoid per element, which no MMA overlaps in these persistent kernels)
costs as much as the pass it would replace, so fc1 stays as it is. (A wired-up version, backend
and autograd, was built on a local branch and not merged.)
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from turbo_moe.backends import triton_backend as tb
from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.bench.timing import warm_median_ms
from turbo_moe.kernels.triton import grouped_gemm as gg

# name -> (routed rows M, experts G, hidden K, expert FFN F)
SHAPES = {
    "train": (98304, 64, 1024, 2048),  # the train preset's expert-dominated layer
    "dsv3": (16384, 32, 7168, 2048),  # DeepSeek-V3 fc1, 32 experts x 512 tokens
}


def _offsets(m: int, groups: int) -> torch.Tensor:
    lens = [m // groups] * groups
    lens[-1] += m - sum(lens)
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda")


@triton.jit
def variant(a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, group_offs_ptr, probs_ptr, amax_ptr, F, K, G, num_amax,
            stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            MODE: tl.constexpr):
    """fc1 (tensorwise, out [M, 2F]) in grouped_gemm.m_grouped_gemm_tma_kernel's tile walk, a tile
    holding BLOCK_N gate and BLOCK_N linear columns; MODE: the amax epilogue (module docstring)."""
    pid, num_programs, num_n_blocks, num_k_blocks = gg._persistent_start(F, K, BLOCK_N, BLOCK_K)
    group, group_first_tile, lo, hi, group_tiles = gg._m_grouped_cursor_start(group_offs_ptr, G, BLOCK_M, num_n_blocks)
    tile = pid.to(tl.int64)
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    amax_bits = tl.zeros((), dtype=tl.int32)
    row_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    while group < G:
        group, group_first_tile, lo, hi, group_tiles = gg._m_grouped_cursor_advance(
            tile, group, group_first_tile, lo, hi, group_tiles, group_offs_ptr, G, BLOCK_M, num_n_blocks)
        if group < G:
            rows, m_block, n_block = gg._m_grouped_tile_blocks(tile, group_first_tile, lo, hi, BLOCK_M, num_n_blocks,
                                                               GROUP_M)
            row0 = (lo + m_block * BLOCK_M).to(tl.int32)
            gate_row = (group * 2 * F + n_block * BLOCK_N).to(tl.int32)
            linear_row = gate_row + F
            offs_m = m_block * BLOCK_M + arange_m
            out_rows = tl.where(offs_m < rows, lo + offs_m, -1)
            if MODE >= 4:
                p_early = tl.load(probs_ptr + out_rows, mask=out_rows >= 0, other=0.0).to(tl.float32)
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_linear = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_block in range(num_k_blocks):
                a = a_desc.load([row0, k_block * BLOCK_K])
                b_gate = b_desc.load([gate_row, k_block * BLOCK_K])
                b_linear = b_desc.load([linear_row, k_block * BLOCK_K])
                acc_gate = gg._dot_nt(acc_gate, a, b_gate, BLOCK_K, False)
                acc_linear = gg._dot_nt(acc_linear, a, b_linear, BLOCK_K, False)
            offs_n = n_block.to(tl.int32) * BLOCK_N + arange_n
            out_dtype = out_ptr.dtype.element_ty
            gate = gg._dequantize(acc_gate, a_scale_ptr, 0, b_scale_ptr, 0, False, False).to(out_dtype)
            linear = gg._dequantize(acc_linear, a_scale_ptr, 0, b_scale_ptr, 0, False, False).to(out_dtype)
            gate_desc = tl.make_tensor_descriptor(out_ptr, shape=[hi.to(tl.int32), F], strides=[stride_om, 1],
                                                  block_shape=[BLOCK_M, BLOCK_N])
            linear_desc = tl.make_tensor_descriptor(out_ptr + F, shape=[hi.to(tl.int32), F], strides=[stride_om, 1],
                                                    block_shape=[BLOCK_M, BLOCK_N])
            col0 = (n_block * BLOCK_N).to(tl.int32)
            gate_desc.store([row0, col0], gate)
            linear_desc.store([row0, col0], linear)
            if MODE > 0:
                valid = (offs_m < rows)[:, None] & (offs_n < F)[None, :]
                if MODE >= 4:
                    p = p_early[:, None]
                else:
                    p = tl.load(probs_ptr + out_rows, mask=out_rows >= 0, other=0.0).to(tl.float32)[:, None]
                g = gate.to(tl.float32)
                l = linear.to(tl.float32)
                a = tl.where(valid, g * tl.sigmoid(g) * l * p, 0.0)
                bits = tl.abs(a).to(tl.int32, bitcast=True)
                if MODE == 1 or MODE == 5:
                    amax_bits = tl.maximum(amax_bits, tl.max(tl.max(bits, axis=1), axis=0))
                else:
                    row_bits = tl.maximum(row_bits, tl.max(bits, axis=1))
        tile += num_programs
    if MODE == 3 or MODE == 4:
        amax_bits = tl.max(row_bits, axis=0)
    for slot in range(pid, num_amax, num_programs):
        tl.store(amax_ptr + slot, tl.where(slot == pid, amax_bits.to(tl.float32, bitcast=True), 0.0))

# (BLOCK_M, BLOCK_N of each half, warps, stages, programs): one program per SM, then two.
CONFIGS = ((128, 128, 8, 3, 132), (128, 64, 4, 2, 264), (64, 128, 4, 2, 264), (128, 64, 8, 2, 264),
           (128, 64, 4, 3, 132))


def main() -> None:
    fp8 = torch.float8_e4m3fn
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for name, (m, g, k, f) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda").to(fp8)
        w = (torch.randn(g, 2 * f, k, device="cuda") * 0.5).to(fp8)
        sx, sw = torch.tensor(0.05, device="cuda"), torch.tensor(0.03, device="cuda")
        probs = torch.rand(m, device="cuda")
        offs = _offsets(m, g)
        plain = GroupedGemmProblem(GemmKind.M_GROUPED, x, w, sx, sw, offs, torch.bfloat16, role="fwd")
        h0 = tb.BACKEND.run(plain)
        gate = h0[:, :f].float()
        ref = (gate * torch.sigmoid(gate) * h0[:, f:].float() * probs[:, None]).abs().max().item()
        print(f"{name}: plain fc1 (tuned) {warm_median_ms(lambda: tb.BACKEND.run(plain)):.3f} ms; torch's max|a| {ref}",
              flush=True)
        out, amax = torch.empty_like(h0), torch.empty(512, device="cuda")
        for bm, bn, warps, stages, grid in CONFIGS:
            a_desc = TensorDescriptor(x, [m, k], [k, 1], [bm, 128])
            b_desc = TensorDescriptor(w.view(g * 2 * f, k), [g * 2 * f, k], [k, 1], [bn, 128])
            for mode in (0, 1, 3, 4, 5):
                def fn():
                    variant[(grid,)](a_desc, b_desc, out, sx, sw, offs, probs, amax, f, k, g, 512, out.stride(0),
                                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, MODE=mode, num_warps=warps,
                                     num_stages=stages)
                fn()
                torch.cuda.synchronize()
                same = torch.equal(out.view(torch.int16), h0.view(torch.int16))
                print(f"{name} {bm}x{bn} w{warps} s{stages} programs={grid} mode={mode}: {warm_median_ms(fn):.3f} ms, "
                      f"h bitwise {same}, amax {amax.max().item()}", flush=True)


if __name__ == "__main__":
    main()
