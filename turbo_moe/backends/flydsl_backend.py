"""FlyDSL backend: the grouped FP8 GEMMs as FlyDSL kernels for AMD gfx950 (MI350 / MI355X).

Available only where flydsl imports AND the current device is a ROCm GPU of arch gfx950; anywhere
else ``is_available`` says why, so ``backend="auto"`` moves on (to Triton on ROCm, then torch).
``TURBO_MOE_DISABLE_FLYDSL=1`` turns it off (e.g. until tests/test_flydsl_gpu.py has passed on
your MI355X).

Verification status: the kernels are compiled for gfx950 and checked on their ISA in CI
(tests/test_flydsl_compile.py), and their host-side arithmetic is tested on CPU
(tests/test_flydsl_host.py, tests/test_flydsl_emulation.py). They have never run on an AMD GPU;
see docs/flydsl.md.

The MXFP8 M-grouped variant (``KernelConfig(mx=True)``) is launched for the block-scaled dispatch
by ``flydsl_mx.py``, through the plan / argument / launch helpers at the end of this file.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import torch

from .base import GemmKind, GroupedGemmBackend, GroupedGemmProblem

__all__ = ["FlyDSLBackend", "BACKEND", "device_arch"]

_FP8_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_OUT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def device_arch(index: int = 0) -> str:
    """The gfx arch of ROCm device ``index`` without feature suffixes (``gfx950:sramecc+:xnack-``)."""
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


@functools.lru_cache(maxsize=None)
def _flydsl_import_error() -> str:
    try:
        import flydsl  # noqa: F401
        import flydsl.compiler  # noqa: F401
    except Exception as exc:  # missing, or a broken install
        return f"flydsl is not importable ({type(exc).__name__}: {exc}); pip install 'turbo_moe[flydsl]'"
    return ""


@functools.lru_cache(maxsize=None)
def _num_cu(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_out(problem: GroupedGemmProblem) -> None:
    """``problem.out`` / ``accumulate`` as the kernels take them: the out tensor is written with
    the contiguous row strides of ``out_shape`` (the plan's ``ldc``), accumulation is a K_GROUPED
    fp32 epilogue (``out[g] += result``)."""
    out = problem.out
    if problem.accumulate:
        if problem.kind is not GemmKind.K_GROUPED:
            raise ValueError("accumulate is for K_GROUPED (wgrad) problems only")
        if out is None:
            raise ValueError("accumulate needs out (the float32 tensor to add the result to)")
        if out.dtype != torch.float32 or problem.out_dtype != torch.float32:
            raise ValueError(f"accumulate needs a float32 out and out_dtype, got {out.dtype} / {problem.out_dtype}")
    if out is None:
        return
    if tuple(out.shape) != tuple(problem.out_shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(problem.out_shape)}")
    if out.dtype != problem.out_dtype:
        raise ValueError(f"out is {out.dtype}, expected out_dtype {problem.out_dtype}")
    if out.device != problem.device or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor on the operands' device")


class FlyDSLBackend(GroupedGemmBackend):
    name = "flydsl"

    def is_available(self) -> Tuple[bool, str]:
        if os.environ.get("TURBO_MOE_DISABLE_FLYDSL", "0") not in ("", "0"):
            return False, "disabled by TURBO_MOE_DISABLE_FLYDSL"
        why = _flydsl_import_error()
        if why:
            return False, why
        if torch.version.hip is None or not torch.cuda.is_available():
            return False, "the FlyDSL kernels need a ROCm GPU (this torch has no HIP device)"
        arch = device_arch(torch.cuda.current_device())
        from ..kernels.flydsl import host

        if arch not in host.SUPPORTED_ARCHS:
            return False, (
                f"the FlyDSL kernels target {', '.join(host.SUPPORTED_ARCHS)} (FP8 MFMA with K=128); "
                f"this device is {arch}"
            )
        return True, ""

    def can_handle(self, problem: GroupedGemmProblem) -> Tuple[bool, str]:
        if problem.swiglu_probs is not None:
            return False, "the SwiGLU amax epilogue is not written for FlyDSL (the amax runs as its own pass)"
        try:
            self._plan(problem)
        except (ValueError, TypeError) as exc:
            return False, str(exc)
        return True, ""

    # ------------------------------------------------------------------------------------------

    def _plan(self, problem: GroupedGemmProblem):
        from ..kernels.flydsl import host

        a, b = problem.a, problem.b
        for name, t in (("a", a), ("b", b)):
            if t.dtype not in _FP8_FORMAT:
                raise ValueError(
                    f"{name} is {t.dtype}; the gfx950 FP8 MFMA takes OCP float8_e4m3fn / float8_e5m2 "
                    "(not the fnuz formats of gfx942)"
                )
        if problem.out_dtype not in _OUT_DTYPE:
            raise ValueError(f"out_dtype {problem.out_dtype} is not one of bfloat16, float16, float32")
        check_offsets(problem)
        for name, s in (("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
            if s.dtype != torch.float32 or not s.is_contiguous() or s.device != problem.device:
                raise ValueError(f"{name} must be a contiguous float32 tensor on the operands' device")
        g = problem.num_groups
        if problem.kind is GemmKind.M_GROUPED:
            rowwise_shapes = {"a_scale": (a.shape[0],), "b_scale": (g, b.shape[1])}
        else:
            rowwise_shapes = {"a_scale": (g, a.shape[0]), "b_scale": (g, b.shape[0])}
        for name, s in (("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
            if s.dim() != 0 and tuple(s.shape) != rowwise_shapes[name]:
                raise ValueError(
                    f"{name} has shape {tuple(s.shape)}; expected a 0-dim (tensorwise) or "
                    f"{rowwise_shapes[name]} (rowwise) tensor"
                )
        out = _OUT_DTYPE[problem.out_dtype]
        if problem.kind is GemmKind.M_GROUPED:
            plan = plan_m_grouped(problem, out)
        else:
            num_cu = resolve_num_cu(problem)
            if a.shape[1] >= 2**31:
                raise ValueError(f"{a.shape[1]} tokens; group offsets are read as 32-bit (< 2^31 tokens)")
            plan = host.plan_k_grouped(
                tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), problem.num_groups, out, num_cu
            )
        _check_out(problem)
        # Checked last so that the shape and layout checks above also run (and are tested) on CPU.
        require_rocm(problem)
        return plan

    def run(self, problem: GroupedGemmProblem) -> torch.Tensor:
        from ..kernels.flydsl import grouped_gemm_fp8 as kernels
        from ..kernels.flydsl import host

        plan = self._plan(problem)
        config = kernels.KernelConfig(
            _FP8_FORMAT[problem.a.dtype], _FP8_FORMAT[problem.b.dtype], _OUT_DTYPE[problem.out_dtype],
            problem.a_scale.dim() > 0, problem.b_scale.dim() > 0, problem.accumulate,
            # Each lane stores 4 consecutive output columns at once when no group of 4 straddles
            # the last column.
            problem.out_shape[-1] % 4 == 0,
        )
        # M-grouped: LDS-DMA main loop when every 16-byte chunk is whole and aligned, else
        # register-staged.
        lds_dma = problem.kind is GemmKind.M_GROUPED and host.m_grouped_lds_dma_ok(
            plan.k, problem.a.data_ptr(), plan.lda, problem.b.data_ptr(), plan.ldb, plan.stride_bg
        )
        return execute(problem, plan, config, lds_dma)


# ----------------------------------------------------------------------------------------------
# Shared by the tensorwise/rowwise launch above and the MXFP8 one (flydsl_mx.py): both take a
# problem with the fields of GroupedGemmProblem (a BlockScaledProblem has them too).
# ----------------------------------------------------------------------------------------------


def on_rocm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def require_rocm(problem) -> None:
    if not on_rocm(problem.device):
        raise ValueError(f"operands are on {problem.device}, not a ROCm GPU")


def check_offsets(problem) -> None:
    offs = problem.group_offs
    if offs.dtype != torch.int64 or offs.dim() != 1 or offs.device != problem.device:
        raise ValueError("group_offs must be a 1-D int64 tensor on the operands' device")


def resolve_num_cu(problem) -> int:
    """``problem.num_cu``, else the device's CU count (1 off a ROCm device: plans on CPU)."""
    if problem.num_cu is not None:
        if problem.num_cu < 1:
            raise ValueError(f"num_cu must be >= 1, got {problem.num_cu}")
        return problem.num_cu
    return _num_cu(problem.device.index or 0) if on_rocm(problem.device) else 1


def plan_m_grouped(problem, out: str):
    """``host.plan_m_grouped`` of an M-grouped problem (persistent grid over ``resolve_num_cu``)."""
    from ..kernels.flydsl import host

    a, b = problem.a, problem.b
    num_cu = resolve_num_cu(problem)
    if a.shape[0] >= 2**31:
        raise ValueError(f"a has {a.shape[0]} rows; group offsets are read as 32-bit (< 2^31 rows)")
    return host.plan_m_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), out, num_cu)


def kernel_args(problem, plan, out: torch.Tensor) -> tuple:
    """The launchers' arguments before the stream: the addresses, the scales' element counts
    (bytes for the MX variant's uint8 scales), then ``plan.scalar_args()``."""
    return (
        problem.a.data_ptr(), problem.b.data_ptr(), out.data_ptr(),
        problem.a_scale.data_ptr(), problem.b_scale.data_ptr(), problem.group_offs.data_ptr(),
        problem.a_scale.numel(), problem.b_scale.numel(),
        *plan.scalar_args(),
    )


def launch(config, lds_dma: bool, kind: GemmKind, args: tuple, device: torch.device) -> None:
    """Build (cached) and launch the kernel of ``config`` on the current stream of ``device``."""
    from ..kernels.flydsl import grouped_gemm_fp8 as kernels

    build = kernels.build_m_grouped(config, lds_dma) if kind is GemmKind.M_GROUPED else kernels.build_k_grouped(config)
    build(*args, torch.cuda.current_stream(device))


def execute(problem, plan, config, lds_dma: bool) -> torch.Tensor:
    """Allocate out (unless ``problem.out`` is given) and launch; an empty out launches nothing."""
    out = problem.out
    if out is None:
        out = torch.empty(problem.out_shape, dtype=problem.out_dtype, device=problem.device)
    if out.numel() == 0:
        return out
    launch(config, lds_dma, problem.kind, kernel_args(problem, plan, out), problem.device)
    return out


BACKEND = FlyDSLBackend()
