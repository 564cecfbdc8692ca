"""Reference backend: the exact semantics of the two grouped FP8 problems in plain torch.

Dequantize the FP8 operands to float32, multiply group by group in float32, apply the scales, cast.
It runs anywhere torch runs, is the CPU default, and is the oracle of every kernel test.

The per-group loop slices tensors by ``group_offs``, which needs the offsets on the host; on a GPU
that is a device-to-host sync, so this backend is not CUDA-graph capturable (the kernel backends
are). It says so through ``can_handle`` when a capture is in progress.
"""

from __future__ import annotations

import torch

from .base import GemmKind, GroupedGemmBackend, GroupedGemmProblem


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TorchBackend(GroupedGemmBackend):
    name = "torch"

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def can_handle(self, problem: GroupedGemmProblem) -> tuple[bool, str]:
        if _is_capturing(problem.device):
            return False, "the torch reference reads group offsets on the host, which a CUDA graph capture forbids"
        why = problem.out_reason()
        if why:
            return False, why
        if problem.swiglu_probs is not None:
            return False, "the SwiGLU amax epilogue is fused by the Triton kernels only (the reference runs the amax apart)"
        return True, ""

    def run(self, problem: GroupedGemmProblem) -> torch.Tensor:
        why = problem.out_reason() or ("the SwiGLU amax epilogue is fused by the Triton kernels only"
                                       if problem.swiglu_probs is not None else "")
        if why:
            raise ValueError(f"torch backend cannot run {problem.describe()}: {why}")
        return run_reference(problem, reference_grouped_gemm)


def run_reference(problem, reference) -> torch.Tensor:
    """``reference(problem)`` (the exact semantics, float32) written as the kernels write it:
    a new ``out_dtype`` tensor, or into ``problem.out``, or added into it (``accumulate``)."""
    # The FP8 semantics are fixed by the recipe; an enclosing autocast must not recast the math.
    with torch.autocast(device_type=problem.device.type, enabled=False):
        result = reference(problem)
    out = problem.out
    if out is None:
        return result.to(problem.out_dtype)
    if not problem.accumulate:
        return out.copy_(result)
    # fp32 + fp32, as the kernels' epilogues add; empty groups are skipped so that their
    # out[g] keeps its bits (adding +0.0 would turn a -0.0 into +0.0).
    offs = problem.group_offs.tolist()
    for g in range(problem.num_groups):
        if offs[g + 1] > offs[g]:
            out[g].add_(result[g])
    return out


def reference_grouped_gemm(problem: GroupedGemmProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The problem's exact semantics in ``compute_dtype`` (float64 in tests), not yet cast to out_dtype.

    Operands may also be given in a high-precision dtype (tests pass ``|a|``, ``|b|`` in float64 to
    get the magnitude of the products for error bounds).
    """
    offs = problem.group_offs.tolist()
    a, b = problem.a.to(compute_dtype), problem.b.to(compute_dtype)
    a_scale, b_scale = problem.a_scale.to(compute_dtype), problem.b_scale.to(compute_dtype)
    out = torch.empty(problem.out_shape, dtype=compute_dtype, device=problem.device)
    for g in range(problem.num_groups):
        lo, hi = offs[g], offs[g + 1]
        sb = b_scale if b_scale.dim() == 0 else b_scale[g]
        if problem.kind is GemmKind.M_GROUPED:
            sa = a_scale if a_scale.dim() == 0 else a_scale[lo:hi, None]
            out[lo:hi] = (a[lo:hi] @ b[g].T) * sa * sb
        else:
            sa = a_scale if a_scale.dim() == 0 else a_scale[g][:, None]
            # An empty token range gives an exactly zero product.
            out[g] = (a[:, lo:hi] @ b[:, lo:hi].T) * sa * sb
    return out


BACKEND = TorchBackend()
