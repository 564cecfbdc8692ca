"""Compile the FlyDSL kernels for an AMD arch on a machine without one, and read their ISA.

FlyDSL's compile-only mode (``COMPILE_ONLY=1``, ``ARCH=<gfx>``) lowers a kernel to a code object
without a device; ``FLYDSL_DEBUG_DUMP_ASM=1`` with ``FLYDSL_DUMP_DIR`` writes the final ISA to
``<dir>/<kernel>_0/22_final_isa.s``. Its last step runs ``$ROCM_PATH/llvm/bin/ld.lld`` (never PATH);
where ROCm is absent, :func:`lld_shim` makes a folder whose ``llvm/bin/ld.lld`` runs the LLD of the
``ziglang`` wheel, and :func:`compile_for_arch` points ROCM_PATH there for the compile only.

Kernel arguments are plain integers (device addresses and sizes), so compiling needs no tensor:
the addresses passed here are never dereferenced.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from . import host

__all__ = [
    "UnsupportedArchError",
    "IsaReport",
    "lld_shim",
    "find_lld",
    "compile_for_arch",
    "parse_isa",
    "VARIANTS",
    "check_arch",
]

_lock = threading.Lock()


class UnsupportedArchError(ValueError):
    """The FlyDSL kernels do not target this AMD arch."""


def check_arch(arch: str) -> None:
    if arch not in host.SUPPORTED_ARCHS:
        raise UnsupportedArchError(
            f"the FlyDSL grouped FP8 kernels target {', '.join(host.SUPPORTED_ARCHS)} only, not {arch!r}: they "
            "use the K=128 FP8 MFMA v_mfma_f32_16x16x128_f8f6f4 of CDNA4 (gfx942/CDNA3 has only K=32 FP8 MFMAs)"
        )


def find_lld() -> Optional[str]:
    """The ROCm root (ROCM_PATH, else /opt/rocm) whose llvm/bin/ld.lld exists, or None."""
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if root and os.access(os.path.join(root, "llvm", "bin", "ld.lld"), os.X_OK):
            return root
    return None


def lld_shim(directory: Optional[str] = None) -> str:
    """A folder usable as ROCM_PATH whose ``llvm/bin/ld.lld`` runs ziglang's LLD; returns it.

    Raises RuntimeError (naming the fix) if the ``ziglang`` package is not installed.
    """
    try:
        import ziglang  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "compiling FlyDSL kernels without ROCm needs an ld.lld: install the 'ziglang' package "
            "(pip install ziglang, part of turbo_moe's 'dev' extra) or set ROCM_PATH to a ROCm install"
        ) from exc
    root = Path(directory or tempfile.mkdtemp(prefix="turbo_moe_rocm_lld_"))
    bin_dir = root / "llvm" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "ld.lld"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n')
    script.chmod(0o755)
    return str(root)


@contextlib.contextmanager
def temporary_environ(values: Dict[str, str]) -> Iterator[None]:
    """os.environ with ``values`` set for the duration of the block, then as it was."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# Every variant the backend can launch: (kind, a_format, b_format, out_dtype, a_rowwise, b_rowwise,
# lds_dma, accumulate, vec_store[, mx]). Hybrid FP8 feeds e5m2 gradients as operand a of dgrad (a = dy) and wgrad (a = dy^T).
# lds_dma: the M-grouped main loop that fills LDS with buffer_load ... lds (K % 16 == 0, aligned).
VARIANTS = {
    "m_grouped_e4m3_bf16_tensorwise": ("m_grouped", "e4m3", "e4m3", "bf16", False, False, False, False, True),
    "m_grouped_e4m3_bf16_rowwise": ("m_grouped", "e4m3", "e4m3", "bf16", True, True, False, False, True),
    "m_grouped_e5m2xe4m3_bf16_tensorwise": ("m_grouped", "e5m2", "e4m3", "bf16", False, False, False, False, True),
    "m_grouped_e4m3_f32_tensorwise": ("m_grouped", "e4m3", "e4m3", "f32", False, False, False, False, True),
    # Output column count % 4 != 0: one store per element.
    "m_grouped_e4m3_bf16_tensorwise_scalar_store": ("m_grouped", "e4m3", "e4m3", "bf16", False, False, False, False, False),
    # MXFP8 forward: e8m0 scales per 32 K elements in the scaled MFMA's scale operands (last field: mx).
    "m_grouped_mx_e4m3_bf16": ("m_grouped", "e4m3", "e4m3", "bf16", False, False, False, False, True, True),
    "m_grouped_dma_e4m3_bf16_tensorwise": ("m_grouped", "e4m3", "e4m3", "bf16", False, False, True, False, True),
    "m_grouped_dma_e5m2xe4m3_bf16_rowwise": ("m_grouped", "e5m2", "e4m3", "bf16", True, True, True, False, True),
    "k_grouped_e4m3_bf16_tensorwise": ("k_grouped", "e4m3", "e4m3", "bf16", False, False, False, False, True),
    "k_grouped_e4m3_bf16_rowwise": ("k_grouped", "e4m3", "e4m3", "bf16", True, True, False, False, True),
    "k_grouped_e5m2xe4m3_bf16_tensorwise": ("k_grouped", "e5m2", "e4m3", "bf16", False, False, False, False, True),
    "k_grouped_e4m3_f16_tensorwise": ("k_grouped", "e4m3", "e4m3", "f16", False, False, False, False, True),
    # wgrad into an fp32 main_grad: out += result in the epilogue.
    "k_grouped_e4m3_f32_accumulate": ("k_grouped", "e4m3", "e4m3", "f32", False, False, False, True, True),
    "k_grouped_e4m3_f32_accumulate_scalar_store": ("k_grouped", "e4m3", "e4m3", "f32", False, False, False, True, False),
    # MXFP8 wgrad: e8m0 scales per 32 tokens of each group (slot-major), bf16 out or into main_grad.
    "k_grouped_mx_e4m3_bf16": ("k_grouped", "e4m3", "e4m3", "bf16", False, False, False, False, True, True),
    "k_grouped_mx_e4m3_f32_accumulate": ("k_grouped", "e4m3", "e4m3", "f32", False, False, False, True, True, True),
}


def variant(name: str):
    """(kind, KernelConfig, lds_dma) of a variant of :data:`VARIANTS`."""
    from . import grouped_gemm_fp8 as kernels

    kind, a_fmt, b_fmt, out_dtype, a_row, b_row, lds_dma, *rest = VARIANTS[name]
    return kind, kernels.KernelConfig(a_fmt, b_fmt, out_dtype, a_row, b_row, *rest), lds_dma


def _placeholder_args(kind: str):
    """Plausible launch arguments (addresses are fake and never used: nothing runs)."""
    addresses = (0x10000, 0x20000, 0x30000, 0x40000, 0x50000, 0x60000)
    if kind == "m_grouped":
        plan = host.plan_m_grouped((1000, 1000), (1000, 1), (4, 600, 1000), (600000, 1000, 1), "bf16", 304)
        return addresses + (1000, 4 * 600) + plan.scalar_args()
    plan = host.plan_k_grouped((600, 1000), (1000, 1), (700, 1000), (1000, 1), 4, "bf16", 304)
    return addresses + (4 * 600, 4 * 700) + plan.scalar_args()


def compile_for_arch(
    kind: str, config, arch: str, dump_dir: str, rocm_path: Optional[str] = None, lds_dma: bool = False
) -> Path:
    """Compile one kernel variant for ``arch`` without a device; return the path of its ISA (.s).

    ``config`` is a ``grouped_gemm_fp8.KernelConfig``. ``rocm_path``: a folder with ``llvm/bin/ld.lld``
    (default: ROCM_PATH or /opt/rocm if one has it, else a ziglang shim in a temp dir).
    """
    check_arch(arch)
    from . import grouped_gemm_fp8 as kernels

    if rocm_path is None:
        rocm_path = find_lld() or lld_shim()
    dump = Path(dump_dir) / f"{kind}{'_dma' if lds_dma else ''}_{config.tag}_{arch}"
    if dump.exists():
        shutil.rmtree(dump)
    dump.mkdir(parents=True)
    env = {
        "COMPILE_ONLY": "1",
        "ARCH": arch,
        "FLYDSL_DEBUG_DUMP_ASM": "1",
        "FLYDSL_DUMP_DIR": str(dump),
        "ROCM_PATH": rocm_path,
        # Always trace and lower (a cached artifact would skip the ISA dump).
        "FLYDSL_RUNTIME_ENABLE_CACHE": "0",
    }
    with _lock, temporary_environ(env):
        # Fresh builders: FlyDSL keeps compiled artifacts per launcher object, and a launcher built
        # under one ARCH must not answer for another.
        if kind == "m_grouped":
            launch = kernels.build_m_grouped.__wrapped__(config, lds_dma)
        elif lds_dma:
            raise ValueError("lds_dma is an M-grouped variant only")
        else:
            launch = kernels.build_k_grouped.__wrapped__(config)
        launch(*_placeholder_args(kind), 0)
    name = kernels.KERNEL_NAMES[kind]
    isa = dump / f"{name}_0" / "22_final_isa.s"
    if not isa.exists():
        found = sorted(str(p) for p in dump.rglob("*.s"))
        raise RuntimeError(f"FlyDSL compiled {kind} but wrote no {isa} (found: {found})")
    return isa


# ----------------------------------------------------------------------------------------------
# ISA report.
# ----------------------------------------------------------------------------------------------


@dataclass
class IsaReport:
    path: str
    arch: str
    vgprs: int  # architectural VGPRs (.amdhsa_next_free_vgpr counts arch + AGPRs on gfx90a+)
    agprs: int
    sgprs: int
    lds_bytes: int
    scratch_bytes: int
    vgpr_spills: int
    sgpr_spills: int
    counts: Dict[str, int] = field(default_factory=dict)
    waterfall_loops: int = 0

    @property
    def total_vgprs(self) -> int:
        return self.vgprs

    def occupancy_waves_per_simd(self) -> int:
        """Waves per SIMD the register file allows (512 unified VGPR+AGPR per lane on CDNA3/4,
        allocated in blocks of 8)."""
        regs = max(8, -(-self.total_vgprs // 8) * 8)
        return min(8, 512 // regs)

    def summary(self) -> str:
        mix = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return (
            f"{Path(self.path).parent.name if Path(self.path).name == '22_final_isa.s' else Path(self.path).stem}: arch={self.arch} vgpr(total)={self.vgprs} agpr={self.agprs} "
            f"sgpr={self.sgprs} lds={self.lds_bytes}B scratch={self.scratch_bytes}B "
            f"spills(v/s)={self.vgpr_spills}/{self.sgpr_spills} waves/SIMD<={self.occupancy_waves_per_simd()} "
            f"waterfall_loops={self.waterfall_loops} | {mix}"
        )


_COUNTED = {
    "fp8_mfma": r"v_mfma_(?:scale_)?f32_16x16x128_f8f6f4",
    "buffer_load": r"buffer_load_dword\w*",
    "buffer_store": r"buffer_store_\w+",
    "s_buffer_load": r"s_buffer_load_dword\w*",
    "ds_read": r"ds_read_b128",
    "ds_write": r"ds_write_b128",
    "s_barrier": r"s_barrier\b",
    "s_add_u32": r"s_add_u32",
    "s_addc_u32": r"s_addc_u32",
    "v_readfirstlane": r"v_readfirstlane_b32",
    "s_waitcnt_lgkm0": r"s_waitcnt\s+lgkmcnt\(0\)",
    "scratch_or_private": r"(?:scratch_|buffer_store_dword\w*\s+\S+,\s*off,\s*s\[0:3\])",
}


def _field(text: str, name: str) -> int:
    match = re.search(rf"^\s*(?:-\s+)?\.{re.escape(name)}:?\s+(\d+)", text, re.M)
    if not match:
        raise ValueError(f"no .{name} in the ISA")
    return int(match.group(1))


def _count_waterfall_loops(text: str) -> int:
    """Waterfall loops around buffer ops: v_readfirstlane of a descriptor, v_cmp_eq on it and an
    s_and_saveexec, repeated until every lane's descriptor was served. A uniform SRD has none."""
    count = 0
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if "s_and_saveexec_b64" in line:
            window = "\n".join(lines[max(0, index - 12): index])
            if "v_readfirstlane_b32" in window and re.search(r"v_cmp_eq_u(?:32|64)", window):
                count += 1
    return count


def parse_isa(path: str) -> IsaReport:
    text = Path(path).read_text()
    arch = re.search(r'\.amdgcn_target\s+"[^"]*-(gfx\w+)"', text).group(1)
    code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith((".", ";", "-")))
    counts = {key: len(re.findall(pattern, code)) for key, pattern in _COUNTED.items()}
    return IsaReport(
        path=str(path),
        arch=arch,
        vgprs=_field(text, "amdhsa_next_free_vgpr"),
        agprs=_field(text, "agpr_count"),
        sgprs=_field(text, "sgpr_count"),
        lds_bytes=_field(text, "amdhsa_group_segment_fixed_size"),
        scratch_bytes=_field(text, "amdhsa_private_segment_fixed_size"),
        vgpr_spills=_field(text, "vgpr_spill_count"),
        sgpr_spills=_field(text, "sgpr_spill_count"),
        counts=counts,
        waterfall_loops=_count_waterfall_loops(code),
    )


def isa_lines(path: str) -> List[str]:
    return [l.strip() for l in Path(path).read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# Loops of an ISA listing (the tests' budgets and the script's table read the same numbers).
# ----------------------------------------------------------------------------------------------


def code_lines(text: str) -> List[str]:
    """Instructions and branch labels (.LBB*:), without directives and comments."""
    lines = (l.split(";")[0].strip() for l in text.splitlines())
    return [l for l in lines if l and (not l.startswith(".") or (l.startswith(".LBB") and l.endswith(":")))]


def loops(lines: List[str]) -> Iterator[List[str]]:
    """The bodies of the loops (label .. backward branch), in text order."""
    labels = {l[:-1]: i for i, l in enumerate(lines) if l.endswith(":") and l.startswith(".LBB")}
    for i, line in enumerate(lines):
        match = re.match(r"s_cbranch_\w+\s+(\.LBB\w+)", line)
        if match and labels.get(match.group(1), i + 1) < i:
            yield lines[labels[match.group(1)]: i + 1]


def main_loop(lines: List[str]) -> List[str]:
    """The K main loop: the first loop (text order) that contains MFMAs."""
    for body in loops(lines):
        if any(l.startswith("v_mfma") for l in body):
            return body
    raise AssertionError("no loop containing MFMAs found")


def loop_stats(body: List[str]) -> Dict[str, int]:
    instrs = [l for l in body if not l.endswith(":")]
    return {
        "instrs": len(instrs),
        "mfma": sum(l.startswith("v_mfma") for l in instrs),
        "vmcnt0": sum(bool(re.match(r"s_waitcnt\s+vmcnt\(0\)", l)) for l in instrs),
        "loads": sum(l.startswith("buffer_load") for l in instrs),
        "ds_reads": sum(l.startswith("ds_read") for l in instrs),
        "waits": sum(l.startswith("s_waitcnt") for l in instrs),
    }


def main_loop_per_k_block(path: str) -> Dict[str, float]:
    """Main-loop counts per K block (16 MFMAs per wave per 128-deep block of a 64x64 wave tile)."""
    stats = loop_stats(main_loop(code_lines(Path(path).read_text())))
    blocks = max(1, stats["mfma"] // 16)
    return {key: value / blocks for key, value in stats.items()}

