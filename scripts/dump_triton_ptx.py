#!/usr/bin/env python3
"""Compile every variant of the Triton grouped-GEMM kernels for sm_90 (no GPU needed) and write
each one's TTGIR and PTX into a folder, with source locations and DWARF debug info stripped, so
that a refactor of ``kernels/triton/grouped_gemm.py`` can be checked to leave the generated code
unchanged:

    git stash; python scripts/dump_triton_ptx.py --out /tmp/ptx_before; git stash pop
    python scripts/dump_triton_ptx.py --out /tmp/ptx_after
    diff -r /tmp/ptx_before /tmp/ptx_after && echo "same PTX"

56 variants (the constexpr switches of each kernel x tensorwise/rowwise scales), ~1 min on 2
cores. TTGIR names its SSA values after the Python variables, so a moved line can differ there
while the PTX is the same; the PTX is what runs.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re
import sys
from pathlib import Path

# The repository's turbo_moe, not whichever one is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCALES = {"a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "group_offs_ptr": "*i64", "N": "i32", "K": "i32", "G": "i32"}
M_TMA = {"a_desc": "tensordesc<fp8e5[128, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>"}
K_TAIL = {"a_tail_desc": "tensordesc<fp8e5[128, 32]>", "b_tail_desc": "tensordesc<fp8e4nv[128, 32]>"}


def _strides(*names):
    return {name: "i32" for name in names}


def variants():
    """(kernel name, signature, constexprs) of every variant the backend can launch."""
    for a_rowwise, b_rowwise in itertools.product([True, False], repeat=2):
        blocks = dict(A_ROWWISE=a_rowwise, B_ROWWISE=b_rowwise, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
        for tma_store in (True, False):
            signature = {**M_TMA, "out_ptr": "*bf16", **SCALES, **_strides("stride_om", "stride_on")}
            yield "m_grouped_gemm_tma_kernel", signature, dict(blocks, TMA_STORE=tma_store)
        for band_cyclic, tma_store, accumulate in itertools.product([True, False], repeat=3):
            if tma_store and accumulate:
                continue  # refused by the kernel (accumulate reads out through pointers)
            signature = {**M_TMA, **K_TAIL, "out_desc": "tensordesc<bf16[1, 128, 128]>",
                         "out_ptr": "*fp32" if accumulate else "*bf16", **SCALES,
                         **_strides("stride_og", "stride_on", "stride_ok")}
            yield "k_grouped_gemm_tma_kernel", signature, dict(
                blocks, BAND_CYCLIC=band_cyclic, TMA_STORE=tma_store, TAIL_K=32, ACCUMULATE=accumulate)
        for even_k in (True, False):
            signature = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", **SCALES,
                         **_strides("stride_am", "stride_ak", "stride_bg", "stride_bn", "stride_bk", "stride_om", "stride_on")}
            yield "m_grouped_gemm_kernel", signature, dict(blocks, EVEN_K=even_k)
        for band_cyclic, accumulate in itertools.product([True, False], repeat=2):
            signature = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*fp32" if accumulate else "*bf16", **SCALES,
                         **_strides("stride_an", "stride_am", "stride_bk", "stride_bm", "stride_og", "stride_on", "stride_ok")}
            yield "k_grouped_gemm_kernel", signature, dict(blocks, BAND_CYCLIC=band_cyclic, ACCUMULATE=accumulate)


def strip_locations(text: str) -> str:
    """The code without source locations: ``.loc``/``.file`` lines, debug labels and the DWARF
    sections of PTX (they change when code moves into a helper), ``loc(...)`` of TTGIR."""
    cut = text.find("\t.section\t.debug")
    if cut >= 0:
        text = text[:cut]
    text = re.sub(r"^\s*\.(loc|file)\b.*$", "", text, flags=re.M)
    text = re.sub(r"^\$L__tmp\d+:$", "", text, flags=re.M)
    text = re.sub(r"\s*loc\(.*\)\s*$", "", text, flags=re.M)
    text = re.sub(r"^#loc.*$", "", text, flags=re.M)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write <variant>.ttgir / .ptx into")
    parser.add_argument("--kernel", default=None, help="only the kernels whose name contains this")
    parser.add_argument("--promote-acc", action="store_true",
                        help="the Float8Config(accumulation='promoted') variants (PROMOTE_ACC=True)")
    args = parser.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from turbo_moe.kernels.triton import grouped_gemm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, signature, constexprs in variants():
        if args.kernel and args.kernel not in name:
            continue
        fn = getattr(grouped_gemm, name)
        if any(param.name == "PROMOTE_ACC" for param in fn.params):  # absent from trees before it existed
            constexprs = dict(constexprs, PROMOTE_ACC=args.promote_acc)
        signature = dict(signature, **{key: "constexpr" for key in constexprs})
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
        # PROMOTE_ACC=False is left out of the name: the same file names as trees without it.
        tag = name + "".join(f"_{key}{int(value)}" for key, value in constexprs.items()
                             if isinstance(value, bool) and (key != "PROMOTE_ACC" or value))
        for kind in ("ttgir", "ptx"):
            (out / f"{tag}.{kind}").write_text(strip_locations(compiled.asm[kind]))
        digest = hashlib.sha256((out / f"{tag}.ptx").read_bytes()).hexdigest()[:16]
        print(f"{tag} ptx {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
