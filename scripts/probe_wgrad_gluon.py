"""Probe: a K-grouped (variable-K wgrad) FP8 kernel in Gluon whose copy engine runs ahead across tiles.

    python scripts/probe_wgrad_gluon.py            (needs an sm_90 GPU and Triton 3.6's Gluon API)
    python scripts/probe_wgrad_gluon.py --compile  (any machine: compile for sm_90 and print the
                                                    kernel's registers, spills and shared memory)

Why: at 32-128 experts a wgrad output tile runs only 1-4 K steps (128 tokens each). The library's
Triton kernel fills its load pipeline afresh for every tile, and its epilogue runs while no MMA
does: that costs about a third of a tile's time, and keeps it at 0.86-0.92x CUTLASS FP8.
Triton 3.6 could not be made to overlap them (docs/results/h100_issue10_preset.md):
- its automatic warp specialization gave nothing;
- a flattened (tile, chunk) loop whose chunk count comes from data is left unpipelined.

Here the pipeline is written out. One instruction stream, with a producer cursor that walks this
program's (tile, chunk) sequence STAGES - 1 loads ahead of the MMAs:
- its first steps into a tile are issued while the previous tile's last MMAs and its epilogue run;
- the epilogue's TMA store is waited for only when its shared buffer is written again, one tile later.

Status (2026-11-26): compiled with Triton 3.6 for sm_90a on a CPU machine (``--compile``), with no
spills and no serialized wgmma. Resources per config:
- 128 x 256, 3 stages: 254 registers, 213 KB of shared memory;
- 128 x 128, 4 stages: 128 registers, 164 KB.

**It has not yet run on a GPU**: the session's device time was spent. Its first run answers
whether explicit cross-tile pipelining closes the wgrad's gap to CUTLASS.

The probe takes aligned groups only: every group's token count a multiple of BLOCK_K, possibly 0,
as in the bench's balanced shapes and with a router that pads groups. Tiles follow the shared
scheduler's group-major order; scales are tensorwise; the output is bf16. It prints TFLOPS beside
the library's tuned wgrad and CUTLASS FP8 (``torch._scaled_grouped_mm``), on the same operands, and
checks that its output equals the library's bit for bit.
"""
import argparse
import sys

import torch
import triton

from turbo_moe.kernels.triton import scheduler as S

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as exc:  # a Triton without Gluon's Hopper API
    gluon = None
    _GLUON_ERROR = exc


if gluon is not None:

    @gluon.jit
    def _tile_of(i, pid, P, G, num_m, num_n, offs_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
        """The program's i-th tile: (group, first row of a, first row of b, first token, K steps)."""
        group, m_block, n_block = S.k_grouped_group_major(pid + i * P, G, num_m, num_n, GROUP_M)
        lo = gl.load(offs_ptr + group).to(gl.int32)
        hi = gl.load(offs_ptr + group + 1).to(gl.int32)
        return group, m_block * BLOCK_M, n_block * BLOCK_N, lo, (hi - lo) // BLOCK_K

    @gluon.jit
    def _produce(a_desc, b_desc, a_bufs, b_bufs, bars, issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b, my_tiles,
                 pid, P, G, num_m, num_n, offs_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """Issue the load of the producer cursor's next (tile, chunk), if any, into ring slot
        ``issued % STAGES``; returns the advanced cursor and load count."""
        # Move past finished tiles (and tiles of empty groups: no steps).
        while (p_c == p_steps) & (p_i < my_tiles):
            p_i += 1
            p_c = 0
            if p_i < my_tiles:
                _, p_row_a, p_row_b, p_lo, p_steps = _tile_of(p_i, pid, P, G, num_m, num_n, offs_ptr, BLOCK_M,
                                                              BLOCK_N, BLOCK_K, GROUP_M)
        if p_i < my_tiles:
            slot = issued % STAGES
            mbarrier.expect(bars.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            token = p_lo + p_c * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [p_row_a, token], bars.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [p_row_b, token], bars.index(slot), b_bufs.index(slot))
            p_c += 1
            issued += 1
        return issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b

    @gluon.jit
    def gl_k_grouped_kernel(a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr, offs_ptr, N, K, G,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """out[g] = a[:, tokens of g] @ b[:, tokens of g]^T * sa * sb for every group g (aligned groups).
        a_desc: a [N, M] token-major FP8; b_desc: b [K, M]; c_desc: out as one [G*N, K] bf16 matrix
        (N a multiple of BLOCK_M)."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        num_m = gl.cdiv(N, BLOCK_M)
        num_n = gl.cdiv(K, BLOCK_N)
        my_tiles = gl.cdiv(G * num_m * num_n - pid, P)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        a_scale = gl.load(a_scale_ptr)
        b_scale = gl.load(b_scale_ptr)

        # The producer cursor starts "past" a virtual tile -1 with no steps.
        issued = pid * 0
        p_i = pid * 0 - 1
        p_c = pid * 0
        p_steps = pid * 0
        p_lo = pid * 0
        p_row_a = pid * 0
        p_row_b = pid * 0
        for _ in gl.static_range(STAGES - 1):
            issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b = _produce(
                a_desc, b_desc, a_bufs, b_bufs, bars, issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b, my_tiles,
                pid, P, G, num_m, num_n, offs_ptr, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)

        consumed = pid * 0
        for i in range(my_tiles):
            group, row_a, row_b, lo, steps = _tile_of(i, pid, P, G, num_m, num_n, offs_ptr, BLOCK_M, BLOCK_N,
                                                      BLOCK_K, GROUP_M)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma_layout)
            for c in range(steps):
                slot = consumed % STAGES
                mbarrier.wait(bars.index(slot), (consumed // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                # One wgmma in flight: the previous step's is done, so its slot can take a new load.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                consumed += 1
                issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b = _produce(
                    a_desc, b_desc, a_bufs, b_bufs, bars, issued, p_i, p_c, p_lo, p_steps, p_row_a, p_row_b,
                    my_tiles, pid, P, G, num_m, num_n, offs_ptr, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            # acc * a_scale * b_scale in that order, as the library's epilogue (bitwise comparable).
            c_smem.store((acc * a_scale * b_scale).to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [group * N + row_a, row_b], c_smem)
        tma.store_wait(pendings=0)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


# (block M x N x K, warps, stages). Shared memory: stages * (BM + BN) * BK FP8 bytes plus the
# BM x BN bf16 store tile, within Hopper's 227 KB: 128 x 256 fits 3 stages, 128 x 128 fits 5.
CONFIGS = (((128, 256, 128), 8, 3), ((128, 128, 128), 8, 4), ((128, 128, 128), 8, 5), ((128, 128, 128), 4, 4))


def run_gluon(a, b, sa, sb, offs, G, block=(128, 256, 128), warps=8, stages=3, num_sms=132):
    bm, bn, bk = block
    N, M = a.shape
    K = b.shape[0]
    out = torch.empty((G, N, K), dtype=torch.bfloat16, device=a.device)
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], fp8))
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], fp8))
    out2d = out.view(G * N, K)
    c_desc = TensorDescriptor.from_tensor(out2d, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16))
    tiles = G * triton.cdiv(N, bm) * triton.cdiv(K, bn)
    gl_k_grouped_kernel[(min(tiles, num_sms),)](a_desc, b_desc, c_desc, sa, sb, offs, N, K, G, GROUP_M=8,
                                                 STAGES=stages, num_warps=warps)
    return out


def compile_only() -> int:
    """Compile for sm_90 (no GPU needed) and print registers, spills and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for (bm, bn, bk), warps, stages in CONFIGS:
        # Host descriptors over small CPU tensors give the argument types the launcher would derive.
        fp8, bf16 = gl.float8e4nv, gl.bfloat16
        a = TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=torch.float8_e4m3fn), [bm, bk],
                                         gl.NVMMASharedLayout.get_default_for([bm, bk], fp8))
        b = TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=torch.float8_e4m3fn), [bn, bk],
                                         gl.NVMMASharedLayout.get_default_for([bn, bk], fp8))
        c = TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=torch.bfloat16), [bm, bn],
                                         gl.NVMMASharedLayout.get_default_for([bm, bn], bf16))
        sig = {"a_desc": mangle_type(a), "b_desc": mangle_type(b), "c_desc": mangle_type(c),
               "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "offs_ptr": "*i64", "N": "i32", "K": "i32", "G": "i32",
               "GROUP_M": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
        src = GluonASTSource(fn=gl_k_grouped_kernel, signature=sig,
                             constexprs={"GROUP_M": 8, "STAGES": stages, "num_warps": warps})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        ptx = k.asm["ptx"]
        print(f"{bm}x{bn}x{bk} w{warps} s{stages}: shared {k.metadata.shared} B, "
              f"wgmma {ptx.count('wgmma.mma_async')}, TMA loads {ptx.count('cp.async.bulk.tensor.2d.shared')}, "
              f"wgmma waits {ptx.count('wgmma.wait_group')}", flush=True)
        _ptxas_report(k)
    return 0


def _ptxas_report(kernel) -> None:
    """Registers and spills from ptxas -v on the kernel's PTX (Triton's bundled ptxas)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if "registers" in line or "spill" in line
             or "warning" in line.lower()]
    print("   ", " | ".join(lines)[:600])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true", help="compile for sm_90 only and print the kernel's resources")
    args = p.parse_args(argv)
    if gluon is None:
        print(f"Gluon's Hopper API is not importable: {_GLUON_ERROR}")
        return 1
    if args.compile:
        return compile_only()
    from turbo_moe.backends import GemmKind, GroupedGemmProblem, select_backend

    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [("deepseek-v3 fc1 32x512", 32, 512, 4096, 7168), ("deepseek-v3 fc1 128x128", 128, 128, 4096, 7168),
              ("qwen3-235b fc2 32x512", 32, 512, 4096, 1536), ("deepseek-v3 fc1 8x4096", 8, 4096, 4096, 7168)]
    for name, G, tokens, N, K in shapes:
        M = G * tokens
        offs = torch.tensor([g * tokens for g in range(G + 1)], dtype=torch.int64, device=dev)
        a = (torch.randn(N, M, device=dev) * 0.5).to(torch.float8_e4m3fn)
        b = (torch.randn(K, M, device=dev) * 0.5).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.75, device=dev)
        sb = torch.tensor(1.25, device=dev)
        flops = 2.0 * M * N * K
        problem = GroupedGemmProblem(GemmKind.K_GROUPED, a, b, sa, sb, offs, torch.bfloat16, None, "wgrad")
        backend = select_backend(problem, "triton")
        ref = backend.run(problem)
        line = [name, f"library {flops / triton.testing.do_bench(lambda: backend.run(problem)) / 1e9:.0f}"]
        ends = offs[1:].to(torch.int32)
        ones_n, ones_k = torch.full((G * N,), 0.75, device=dev), torch.full((G * K,), 1.25, device=dev)
        cutlass = lambda: torch._scaled_grouped_mm(a, b.t(), ones_n, ones_k, offs=ends,  # noqa: E731
                                                   out_dtype=torch.bfloat16, use_fast_accum=True)
        line.append(f"CUTLASS {flops / triton.testing.do_bench(cutlass) / 1e9:.0f}")
        for block, warps, stages in CONFIGS:
            tag = f"gluon {block[0]}x{block[1]} w{warps} s{stages}"
            try:
                out = run_gluon(a, b, sa, sb, offs, G, block, warps, stages, num_sms)
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                ms = triton.testing.do_bench(lambda: run_gluon(a, b, sa, sb, offs, G, block, warps, stages, num_sms))
                line.append(f"{tag} {flops / ms / 1e9:.0f}" + ("" if same else " (differs from the library)"))
            except Exception as exc:  # noqa: BLE001 -- a probe reports and goes on
                line.append(f"{tag} error {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        print(" | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
