"""Host launcher of the FlyDSL MXFP8 M-grouped variant (``KernelConfig(mx=True)``, gfx950's
``v_mfma_scale_f32_16x16x128_f8f6f4``) for the block-scaled dispatch
(``turbo_moe.fine_grained.gemm.select_block_scaled_backend``).

It takes the M-grouped ``BlockScaledProblem`` s of the ``mxfp8`` recipe: the forward
``y = x W^T`` (``a = x [M, K]``, ``b = W [G, N, K]``) and dgrad ``dx = dy W`` (``a = dy [M, N]``,
``b = W^T [G, K, N]`` quantized along N by ``quantize_weight_fine``); both have their e8m0 scales
along the contraction in the block-major storage ``quantize_rows`` returns, which is the layout
``kernels/flydsl/mx_host.py`` reads (checked with ``mx_host.check_scale_layout``). e4m3 x e4m3
operands (not the hybrid recipe's e5m2 gradients), a bf16 out whose column count is a multiple
of 4 (the compiled and ISA-checked variant has vector stores), no ``out`` / ``accumulate``.
Everything else (K_GROUPED wgrad, blockwise) stays on triton / torch.

Compiled and ISA-checked for gfx950 and emulated on CPU (docs/flydsl.md); never run on hardware.
"""

from __future__ import annotations

import torch

from . import flydsl_backend
from .base import GemmKind

__all__ = ["unsupported_reason", "plan", "run"]


def unsupported_reason(problem) -> str:
    """Why the MX variant does not apply to ``problem`` on any machine ("" if it does)."""
    from ..fine_grained.quantize import MXFP8

    if problem.kind is not GemmKind.M_GROUPED:
        return ("FlyDSL has an MXFP8 M-grouped (forward / dgrad) variant only; K_GROUPED (wgrad) runs on "
                "triton or torch")
    if problem.recipe != MXFP8:
        return "FlyDSL has an MXFP8 M-grouped variant only; blockwise runs on triton or torch"
    for name, t in (("a", problem.a), ("b", problem.b)):
        if t.dtype != torch.float8_e4m3fn:
            return (f"{name} is {t.dtype}; the FlyDSL MXFP8 variant is e4m3 x e4m3 (e5m2 gradients of the "
                    "hybrid format run on triton or torch)")
    if problem.out_dtype != torch.bfloat16:
        return f"out_dtype is {problem.out_dtype}; the FlyDSL MXFP8 variant writes bfloat16"
    if problem.out is not None or problem.accumulate:
        return "the FlyDSL MXFP8 variant allocates its out (no out / accumulate)"
    if problem.out_shape[-1] % 4:
        return (f"out has {problem.out_shape[-1]} columns; the FlyDSL MXFP8 variant is compiled with vector "
                "stores (a multiple of 4 columns)")
    return ""


def plan(problem):
    """The launch plan (``host.MGroupedLaunch``, the persistent grid of the tensorwise M-grouped
    launch) after checking what the kernel reads; raises ValueError naming the argument."""
    from ..kernels.flydsl import mx_host

    why = unsupported_reason(problem)
    if why:
        raise ValueError(why)
    flydsl_backend.check_offsets(problem)
    m, n, k = problem.a.shape[0], problem.b.shape[1], problem.a.shape[1]
    # The kernel's descriptors end at mx_host.a_scale_end / b_scale_end (of the last expert):
    # the scale tensors must hold exactly those bytes, block-major.
    ends = {"a_scale": mx_host.a_scale_end(m, k), "b_scale": mx_host.b_scale_end(problem.num_groups - 1, n, k)}
    for name, s in (("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
        if s.dtype != torch.uint8 or s.device != problem.device:
            raise ValueError(f"{name} must be uint8 e8m0 scales on the operands' device, got {s.dtype} on {s.device}")
        mx_host.check_scale_layout(name, tuple(s.shape), s.stride())
        if s.numel() != ends[name]:
            raise ValueError(f"{name} holds {s.numel()} scale bytes; the kernel reads {ends[name]} "
                             "(cdiv(K, 32) per row)")
        if s.numel() >= 2**31:
            raise ValueError(f"{name} holds {s.numel()} scale bytes; the kernel takes the count as 32-bit")
    launch_plan = flydsl_backend.plan_m_grouped(problem, "bf16")
    flydsl_backend.require_rocm(problem)  # last: the checks above run (and are tested) on CPU
    return launch_plan


def run(problem) -> torch.Tensor:
    """Compute ``problem`` with the MX variant (register-staged main loop; it has no LDS-DMA one)."""
    from ..kernels.flydsl import grouped_gemm_fp8 as kernels

    launch_plan = plan(problem)
    config = kernels.KernelConfig("e4m3", "e4m3", "bf16", vec_store=True, mx=True)
    return flydsl_backend.execute(problem, launch_plan, config, False)
