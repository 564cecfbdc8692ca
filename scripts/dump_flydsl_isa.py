#!/usr/bin/env python3
"""Compile every FlyDSL kernel variant for an AMD arch (no GPU needed) and write, into a folder,
each kernel's ISA (<variant>.s) and a resource report (report.txt, report.json).

    python scripts/dump_flydsl_isa.py --out flydsl_isa            # gfx950, all variants
    python scripts/dump_flydsl_isa.py --out isa --variant m_grouped_e4m3_bf16_tensorwise
    python scripts/dump_flydsl_isa.py --out isa --variant k_grouped_e4m3_bf16_tensorwise \
        --fp8-gemm-4wave ~/src/FlyDSL        # + FlyDSL's fp8_gemm_4wave, compiled the same way

Needs flydsl and an ld.lld: ROCm's ($ROCM_PATH/llvm/bin/ld.lld or /opt/rocm), else the ziglang
wheel's (pip install ziglang; a shim folder is made in a temp dir, see scripts/setup_rocm_lld.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


# The repository's turbo_moe, not whichever one is installed (running a file puts scripts/ first
# on sys.path, so an installed or editable turbo_moe elsewhere would otherwise be compiled).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from turbo_moe.kernels.flydsl import compile_only as co

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the .s files and the report into")
    parser.add_argument("--arch", default="gfx950", help="target arch (default gfx950; gfx942 is refused)")
    parser.add_argument("--variant", action="append", choices=sorted(co.VARIANTS),
                        help="variant(s) to compile (default: all)")
    parser.add_argument("--rocm-path", default=None, help="folder with llvm/bin/ld.lld (default: auto)")
    parser.add_argument("--fp8-gemm-4wave", metavar="FLYDSL_CHECKOUT", default=None,
                        help="also compile FlyDSL's kernels/gemm/fp8_gemm_4wave.py (K=4096) from this FlyDSL "
                             "source checkout, the same way, as a reference point (docs/flydsl.md)")
    args = parser.parse_args(argv)

    try:
        co.check_arch(args.arch)
    except co.UnsupportedArchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rocm_path = args.rocm_path or co.find_lld() or co.lld_shim()
    reports = {}
    lines = []
    with tempfile.TemporaryDirectory(prefix="flydsl_dump_") as dump:
        for name in args.variant or sorted(co.VARIANTS):
            kind, config, lds_dma = co.variant(name)
            start = time.time()
            isa = co.compile_for_arch(kind, config, args.arch, dump, rocm_path=rocm_path, lds_dma=lds_dma)
            seconds = time.time() - start
            shutil.copy(isa, out / f"{name}.s")
            report = co.parse_isa(str(isa))
            report.path = str(out / f"{name}.s")
            loop = co.main_loop_per_k_block(str(out / f"{name}.s"))
            reports[name] = {**dataclasses.asdict(report), "compile_seconds": round(seconds, 2),
                             "waves_per_simd": report.occupancy_waves_per_simd(), "main_loop_per_k_block": loop}
            per_block = ", ".join(f"{k}={v:g}" for k, v in loop.items())
            lines.append(f"{name} ({seconds:.1f} s): {report.summary()} | main loop per K block: {per_block}")
            print(lines[-1])
        if args.fp8_gemm_4wave:
            isa = _compile_fp8_gemm_4wave(args.fp8_gemm_4wave, args.arch, dump, rocm_path)
            shutil.copy(isa, out / "fp8_gemm_4wave.s")
            report = co.parse_isa(str(isa))
            # Unrolled at compile time (no loop): per K block = whole kernel / (K / 128) blocks.
            stats = co.loop_stats(co.code_lines(isa.read_text()))
            per_block = ", ".join(f"{k}={v / 32:g}" for k, v in stats.items())
            lines.append(f"fp8_gemm_4wave (256x256, K=4096): {report.summary()} | per K block (of 32): {per_block}")
            print(lines[-1])
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps(reports, indent=2) + "\n")
    print(f"wrote {len(reports)} ISA files and report.txt/report.json to {out}")
    return 0


def _compile_fp8_gemm_4wave(checkout: str, arch: str, dump: str, rocm_path: str) -> Path:
    """FlyDSL's 4-wave FP8 GEMM (M = N = K = 4096, bf16 out) compiled for ``arch`` without a device,
    with the environment compile_only uses; returns its ISA path. Needs torch (CPU tensors as the
    fx.Tensor arguments; nothing runs)."""
    import torch

    from turbo_moe.kernels.flydsl import compile_only as co

    sys.path.insert(0, str(Path(checkout).resolve()))  # its top-level "kernels" package, first
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        del sys.modules[name]
    from kernels.gemm.fp8_gemm_4wave import compile_fp8_gemm_4w

    folder = Path(dump) / "fp8_gemm_4wave"
    env = {"COMPILE_ONLY": "1", "ARCH": arch, "FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": str(folder),
           "ROCM_PATH": rocm_path, "FLYDSL_RUNTIME_ENABLE_CACHE": "0"}
    with co.temporary_environ(env):
        m = n = k = 4096
        launch = compile_fp8_gemm_4w(K=k)
        a, b = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        launch(a, b, torch.zeros(m, n, dtype=torch.bfloat16), torch.ones(m), torch.ones(n), m, n, 0)
    found = sorted(folder.rglob("22_final_isa.s"))
    if not found:
        raise RuntimeError(f"fp8_gemm_4wave compiled but wrote no ISA under {folder}")
    return found[0]


if __name__ == "__main__":
    sys.exit(main())
