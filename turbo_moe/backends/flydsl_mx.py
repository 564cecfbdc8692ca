"""Host launcher of the FlyDSL MXFP8 variants (``KernelConfig(mx=True)``, gfx950's
``v_mfma_scale_f32_16x16x128_f8f6f4``) for the block-scaled dispatch
(``turbo_moe.fine_grained.gemm.select_block_scaled_backend``).

It takes the ``BlockScaledProblem`` s of the ``mxfp8`` recipe:

* M-grouped: the forward ``y = x W^T`` (``a = x [M, K]``, ``b = W [G, N, K]``) and dgrad
  ``dx = dy W`` (``a = dy [M, N]``, ``b = W^T [G, K, N]`` quantized along N by
  ``quantize_weight_fine``). Their e8m0 scales run along the contraction in the block-major
  storage ``quantize_rows`` returns, the layout ``kernels/flydsl/mx_host.py`` reads (checked with
  ``mx_host.check_scale_layout``).
* K-grouped: the wgrad ``dW[g] = dy_g^T x_g`` (``a = dy^T [N, M]``, ``b = x^T [K, M]``). Their
  scales run along each group's tokens in the slot-major storage ``quantize_tokens`` returns
  (``mx_host``, "K-grouped"): a bf16 dW, or added in the epilogue into a float32 ``out`` (Megatron's
  ``main_grad``, ``accumulate``).

e4m3 x e4m3 operands only (the hybrid recipe's e5m2 gradients run on triton or torch). The out's
column count must be a multiple of 4: the compiled and ISA-checked variants have vector stores.
M-grouped allocates its bf16 out (no ``out`` / ``accumulate``).

Blockwise with power-of-two scales (``power_of_two_scales=True``, UE8M0 blockwise) runs on the
same variant: its scales are exact e8m0 values, expanded to one per 32 elements on the device
(``fine_grained.gemm.pow2_blockwise_as_mxfp8``; the scaled MFMA then applies them, no promotion
loop). Blockwise with float32 scales stays on triton / torch.

Compiled and ISA-checked for gfx950 and emulated on CPU (docs/flydsl.md); never run on hardware.
"""

from __future__ import annotations

import torch

from . import flydsl_backend
from .base import GemmKind

__all__ = ["unsupported_reason", "plan", "run"]


def unsupported_reason(problem) -> str:
    """Why the MX variants do not apply to ``problem`` on any machine ("" if they do)."""
    from ..fine_grained.quantize import BLOCKWISE, MXFP8

    if problem.recipe == BLOCKWISE:
        return ("FlyDSL has MXFP8 variants only; blockwise with float32 scales runs on triton or torch "
                "(power_of_two_scales=True would run on the MX variant)")
    if problem.recipe not in (MXFP8, BLOCKWISE._replace(pow2=True)):
        return f"FlyDSL has no variant for recipe {problem.recipe}"
    for name, t in (("a", problem.a), ("b", problem.b)):
        if t.dtype != torch.float8_e4m3fn:
            return (f"{name} is {t.dtype}; the FlyDSL MXFP8 variants are e4m3 x e4m3 (e5m2 gradients of the "
                    "hybrid format run on triton or torch)")
    if problem.kind is GemmKind.M_GROUPED:
        if problem.out_dtype != torch.bfloat16:
            return f"out_dtype is {problem.out_dtype}; the FlyDSL MXFP8 M-grouped variant writes bfloat16"
        if problem.out is not None or problem.accumulate:
            return "the FlyDSL MXFP8 M-grouped variant allocates its out (no out / accumulate)"
    elif problem.accumulate:
        if problem.out_dtype != torch.float32:
            return f"accumulate needs a float32 out, got out_dtype {problem.out_dtype}"
    elif problem.out_dtype != torch.bfloat16:
        return (f"out_dtype is {problem.out_dtype}; the FlyDSL MXFP8 wgrad writes bfloat16 or adds into a "
                "float32 out (accumulate)")
    if problem.out_shape[-1] % 4:
        return (f"out has {problem.out_shape[-1]} columns; the FlyDSL MXFP8 variants are compiled with vector "
                "stores (a multiple of 4 columns)")
    return ""


def as_mx(problem, compute: bool = True):
    """``problem`` as the MX variant reads it: MXFP8 as it is; power-of-two blockwise through
    ``fine_grained.gemm.pow2_blockwise_as_mxfp8`` (its scales expanded to e8m0 per 32 elements;
    ``compute=False`` only allocates them, for the plan's layout checks)."""
    from ..fine_grained.quantize import BLOCKWISE

    if problem.recipe == BLOCKWISE._replace(pow2=True):
        from ..fine_grained.gemm import pow2_blockwise_as_mxfp8

        return pow2_blockwise_as_mxfp8(problem, compute)
    return problem


def plan(problem):
    """The launch plan (``host.MGroupedLaunch`` / ``host.KGroupedLaunch``: the tensorwise launches'
    persistent grids) after checking what the kernel reads; raises ValueError naming the argument.
    ``problem`` is well-formed (``BlockScaledProblem.reason``, which ``run_block_scaled`` checks first)."""
    from ..kernels.flydsl import host, mx_host

    why = unsupported_reason(problem)
    if why:
        raise ValueError(why)
    problem = as_mx(problem, compute=False)  # an MXFP8 problem (run's converted one included) as it is
    flydsl_backend.check_offsets(problem)
    m, n, k = problem.mnk
    if problem.kind is GemmKind.M_GROUPED:
        # The kernel's descriptors end at mx_host.a_scale_end / b_scale_end (of the last expert):
        # the scale tensors must hold exactly those bytes, block-major.
        ends = {"a_scale": mx_host.a_scale_end(m, k), "b_scale": mx_host.b_scale_end(problem.num_groups - 1, n, k)}
    else:
        # Slot-major token-block scales ([rows, slots] views of [slots, rows] storage); each tile's
        # descriptor ends at its group's last slot (mx_host.token_scale_end).
        slots = problem.expected_scale_shapes()[0][1]
        ends = {"a_scale": slots * n, "b_scale": slots * k}
    for name, s in (("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
        if s.dtype != torch.uint8 or s.device != problem.device:
            raise ValueError(f"{name} must be uint8 e8m0 scales on the operands' device, got {s.dtype} on {s.device}")
        mx_host.check_scale_layout(name, tuple(s.shape), s.stride())
        if s.numel() != ends[name]:
            raise ValueError(f"{name} holds {s.numel()} scale bytes; the kernel reads {ends[name]}")
        if s.numel() >= 2**31:
            raise ValueError(f"{name} holds {s.numel()} scale bytes; the kernel takes the count as 32-bit")
    if problem.kind is GemmKind.M_GROUPED:
        launch_plan = flydsl_backend.plan_m_grouped(problem, "bf16")
    else:
        a, b = problem.a, problem.b
        if m >= 2**31:
            raise ValueError(f"{m} tokens; group offsets are read as 32-bit (< 2^31 tokens)")
        out = "f32" if problem.accumulate else "bf16"
        launch_plan = host.plan_k_grouped(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), problem.num_groups,
                                          out, flydsl_backend.resolve_num_cu(problem))
    flydsl_backend.require_rocm(problem)  # last: the checks above run (and are tested) on CPU
    return launch_plan


def run(problem) -> torch.Tensor:
    """Compute ``problem`` with the MX variant (register-staged main loop; it has no LDS-DMA one)."""
    from ..kernels.flydsl import grouped_gemm_fp8 as kernels

    problem = as_mx(problem)
    launch_plan = plan(problem)
    out = "f32" if problem.accumulate else "bf16"
    config = kernels.KernelConfig("e4m3", "e4m3", out, accumulate=problem.accumulate, vec_store=True, mx=True)
    return flydsl_backend.execute(problem, launch_plan, config, False)

