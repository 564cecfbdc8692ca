"""How Triton lowers ``tl.dot_scaled`` (MXFP8 e4m3 x e4m3, 128x128x128 tile) per target, compiled on
this machine (no GPU): ``python scripts/dot_scaled_lowering.py [--json] [--kernels]``.

Counts, in the generated PTX, bf16 wgmma (sm_90 emulation: operands upcast to bf16 with the scales
multiplied in), FP8 wgmma, and tcgen05 block-scaled MMAs (sm_100 native). And the FP8 promotion
loop of kernels/triton/blockwise_gemm.py for sm_90 (what the backend runs on Hopper)."""

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe(a_ptr, b_ptr, sa_ptr, sb_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    s = tl.arange(0, BK // 32)
    a = tl.load(a_ptr + m[:, None] * BK + k[None, :])
    b = tl.load(b_ptr + k[:, None] * BN + n[None, :])
    sa = tl.load(sa_ptr + m[:, None] * (BK // 32) + s[None, :])
    sb = tl.load(sb_ptr + n[:, None] * (BK // 32) + s[None, :])
    acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", tl.zeros((BM, BN), tl.float32))
    tl.store(o_ptr + m[:, None] * BN + n[None, :], acc)


def _counts(ptx: str) -> dict:
    lines = [l for l in ptx.splitlines() if "wgmma.mma_async" in l or "tcgen05.mma" in l]
    return {
        "bf16_wgmma": sum(".bf16.bf16" in l for l in lines),
        "fp8_wgmma": sum(".e4m3.e4m3" in l for l in lines),
        "tcgen05_block_scale": sum("block_scale" in l for l in lines),
    }


def compile_block_scaled_kernels(cap: int = 90) -> dict:
    """kernels/triton/blockwise_gemm.py compiled for sm_<cap> with the H100 defaults: FP8 wgmma counts."""
    from turbo_moe.kernels.triton import blockwise_gemm as K

    out = {}
    ptr = lambda t: f"*{t}"  # noqa: E731
    for name, recipe_block, e8m0, scale_t, block_k, stages in (
        ("blockwise", 128, False, "fp32", 128, 4), ("mxfp8_promotion", 32, True, "u8", 32, 6)):
        for kind, fn in (("m", K.m_grouped_block_scaled_kernel), ("k", K.k_grouped_block_scaled_kernel)):
            names = list(fn.arg_names)
            sig, consts = {}, {}
            for i, arg in enumerate(names):
                if fn.params[i].is_constexpr:
                    sig[arg] = "constexpr"
                elif arg in ("a_ptr", "b_ptr"):
                    sig[arg] = ptr("fp8e4nv")
                elif arg == "out_ptr":
                    sig[arg] = ptr("bf16")
                elif arg in ("a_scale_ptr", "b_scale_ptr"):
                    sig[arg] = ptr(scale_t)
                elif arg == "group_offs_ptr":
                    sig[arg] = ptr("i64")
                else:
                    sig[arg] = "i32"
            consts = dict(SCALE_BLOCK=recipe_block, E8M0=e8m0, USE_DOT_SCALED=False, A_FORMAT="e4m3", B_FORMAT="e4m3",
                          BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8)
            consts.update(dict(B_ROW_BLOCK=1 if e8m0 else 128, EVEN_K=True) if kind == "m" else
                          dict(BAND_CYCLIC=False, ACCUMULATE=False))
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 8, "num_stages": stages})
            out[f"{kind}_{name}"] = _counts(compiled.asm["ptx"])
    return out


def main() -> int:
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*u8", "sb_ptr": "*u8", "o_ptr": "*fp32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    report = {"triton": triton.__version__}
    for cap in (90, 100):
        src = ASTSource(fn=_probe, signature=sig, constexprs={"BM": 128, "BN": 128, "BK": 128})
        compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 8})
        report[f"sm_{cap}"] = _counts(compiled.asm["ptx"])
    if "--kernels" in sys.argv:
        report["block_scaled_kernels_sm_90"] = compile_block_scaled_kernels(90)
    if "--json" in sys.argv:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
