"""How Triton lowers ``tl.dot_scaled`` (MXFP8 e4m3 x e4m3, 128x128x128 tile) per target, compiled on
this machine (no GPU): ``python scripts/dot_scaled_lowering.py [--json]``.

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


def main() -> int:
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*u8", "sb_ptr": "*u8", "o_ptr": "*fp32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    report = {"triton": triton.__version__}
    for cap in (90, 100):
        src = ASTSource(fn=_probe, signature=sig, constexprs={"BM": 128, "BN": 128, "BK": 128})
        compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 8})
        report[f"sm_{cap}"] = _counts(compiled.asm["ptx"])
    if "--json" in sys.argv:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
