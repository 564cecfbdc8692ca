"""Reproducer: which way of writing one FP8 tile both row-major and transposed does this GPU's
compiler get right, and how fast is each?

    python scripts/probe_dual_store_cast.py

On an H100 with Triton 3.6 (bundled ptxas 12.9), 2026-11-23: every form that stores one loaded
float32 tile twice (modes 1, 6, 7, 8: tl.trans of float32 or FP8, a barrier between the stores,
the transposed store first, transposed addresses) wrote about a quarter of the transposed bytes
wrong once the grid had more than one row block; bf16 sources and single-store kernels were right.
Mode 9 (a second, transposed load of the tile for the transposed copy) and mode 10 (two launches)
were right everywhere, mode 9 as fast as the broken single-load forms. kernels/triton/fp8_cast.py
and blockwise_cast.py use mode 9. Run this again after a Triton or ptxas upgrade: if every mode
prints OK, the single-load form may come back.
"""
import torch
import triton
import triton.language as tl

@triton.jit
def clampnan(x, M: tl.constexpr):
    x = tl.where(x > M, M, x)
    return tl.where(x < -M, -M, x)

@triton.jit
def dual_cast(x_ptr, out_ptr, out_t_ptr, scale, R, C, sxr, sxc, M: tl.constexpr, MODE: tl.constexpr,
              WROWS: tl.constexpr, WT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    pr = tl.program_id(0); pc = tl.program_id(1)
    rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
    cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    if MODE == 9:  # rows from a row tile; transposed from a second, transposed load
        if WROWS:
            x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask).to(tl.float32)
            tl.store(out_ptr + rows[:, None] * C + cols[None, :], clampnan(x * scale, M).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        if WT:
            mt = (cols[:, None] < C) & (rows[None, :] < R)
            xt = tl.load(x_ptr + cols[:, None] * sxc + rows[None, :] * sxr, mask=mt).to(tl.float32)
            tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], clampnan(xt * scale, M).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mt)
    else:
        x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :] * sxc, mask=mask).to(tl.float32)
        q = clampnan(x * scale, M)
        if MODE == 7:  # transposed first
            if WT:
                tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))
            if WROWS:
                tl.store(out_ptr + rows[:, None] * C + cols[None, :], q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        else:
            if WROWS:
                tl.store(out_ptr + rows[:, None] * C + cols[None, :], q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            if MODE == 6:
                tl.debug_barrier()
            if WT:
                if MODE == 8:  # fp8 tile, transposed addresses
                    tl.store(out_t_ptr + cols[None, :] * R + rows[:, None], q.to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
                else:
                    tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q).to(out_t_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=tl.trans(mask))

def ref(x, scale, fp8):
    m = torch.finfo(fp8).max
    return (x.float() * scale).clamp(-m, m).to(fp8)

def run(mode, x, fp8, wrows, wt=True, BR=64, BC=64, nw=4):
    R, C = x.shape
    out = torch.full((R, C), 0x5A, dtype=torch.uint8, device="cuda").view(fp8)
    out_t = torch.full((C, R), 0x5A, dtype=torch.uint8, device="cuda").view(fp8)
    scale = torch.finfo(fp8).max / x.abs().max().item()
    grid = (triton.cdiv(R, BR), triton.cdiv(C, BC))
    kw = dict(M=torch.finfo(fp8).max, BR=BR, BC=BC, num_warps=nw)
    if mode == 10:  # two launches: rows only, transposed only
        if wrows:
            dual_cast[grid](x, out, out_t, scale, R, C, x.stride(0), x.stride(1), MODE=1, WROWS=True, WT=False, **kw)
        dual_cast[grid](x, out, out_t, scale, R, C, x.stride(0), x.stride(1), MODE=1, WROWS=False, WT=True, **kw)
    else:
        dual_cast[grid](x, out, out_t, scale, R, C, x.stride(0), x.stride(1), MODE=mode, WROWS=wrows, WT=wt, **kw)
    return out.view(torch.uint8), out_t.view(torch.uint8), scale

MODES = (1, 6, 7, 8, 9, 10)
shapes = [(320, 80), (4096, 512), (37, 70), (130, 80), (200, 136)]
bad = {}
for mode in MODES:
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for wrows in (True, False):
            for shape in shapes:
                for dtype in (torch.float32, torch.bfloat16):
                    torch.manual_seed(0)
                    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
                    o, ot, s = run(mode, x, fp8, wrows)
                    r = ref(x, s, fp8).view(torch.uint8)
                    nr = (o != r).sum().item() if wrows else 0
                    nt = (ot != r.t().contiguous()).sum().item()
                    if nr or nt:
                        bad.setdefault(mode, []).append(f"{str(fp8)[-6:]} rows={wrows} {shape} {dtype}: rows {nr} trans {nt}")
    print(f"MODE {mode}: {'OK' if mode not in bad else str(len(bad[mode])) + ' bad: ' + '; '.join(bad[mode][:8])}", flush=True)
for dtype in (torch.bfloat16, torch.float32):
    x = torch.randn(16384, 7168, device="cuda", dtype=dtype)
    for mode in MODES:
        for BR, BC, nw in ((64, 64, 4), (128, 64, 8), (64, 128, 8)):
            f = lambda: run(mode, x, torch.float8_e4m3fn, True, True, BR, BC, nw)
            f(); torch.cuda.synchronize()
            ts = []
            for _ in range(15):
                a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
                a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
            ts.sort()
            print(f"{dtype} MODE {mode}{' BAD' if mode in bad else ''} BR{BR} BC{BC} w{nw}: {ts[7]*1e3:.0f} us (incl. 2 fills)", flush=True)
