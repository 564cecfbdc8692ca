"""fc2 of an expert MLP under the blockwise and MXFP8 recipes, the routing-weighted SwiGLU fused in.

``grouped_gemm_fine_swiglu(h, probs, w, offs)`` is ``grouped_gemm_fine(a, w)`` for
``a = silu(h[:, :F]) * h[:, F:] * probs[:, None]`` (``turbo_moe.swiglu.weighted_swiglu``, float32,
rounded once to h's dtype), what Megatron's grouped experts compute between fc1 and fc2:

* forward: one launch computes ``a`` from fc1's output ``h`` and casts it into the forward GEMM's
  1xB blocks (``quantize.quantize_swiglu_rows``), where the unfused path runs the activation's
  own kernels and then a rows cast that reads ``a`` again; the wgrad's token copy is cast from that
  ``a``, which is then freed (the fine-grained token copy needs each group's column maxima before
  its cast: a pass of its own, as ``FineGrainedFP8Function`` makes it);
* backward: fc2's dgrad and wgrad as ``FineGrainedFP8Function``'s (``autograd.fine_backward``),
  then one kernel turns ``da`` into ``dh`` and ``dprobs`` together
  (``turbo_moe.swiglu.weighted_swiglu_backward``: each program owns whole rows, so the row sums
  behind ``dprobs`` are ordered and need no atomics), where the activation's own backward
  reduces ``dprobs`` in a second pass.

Saved for backward: ``h`` and ``probs`` (the activation saves them too), ``a``'s token copy in FP8,
and W^T in FP8 on ctx. Memory: fc2's output gradient stays alive through the activation's backward
(autograd holds it until this backward returns; unfused, it is freed before the activation's
backward runs): one ``[M, N]`` tensor more at that point. ``dh`` goes to fc1 in h's dtype (fc1 quantizes it as any output gradient:
no FP8 handoff under these recipes). The rows copy of ``a`` is bit for bit ``quantize_rows`` of
the ``a`` it comes with, so this equals the activation followed by ``grouped_gemm_fine`` where
the activation computes ``weighted_swiglu``.
"""

from __future__ import annotations

import torch

from ..config import Float8Config
from .autograd import fine_backward, fine_forward
from .quantize import quantize_swiglu_rows, recipe_of

__all__ = ["FineGrainedSwiGLUGemmFunction", "grouped_gemm_fine_swiglu"]


class FineGrainedSwiGLUGemmFunction(torch.autograd.Function):
    """``grouped_gemm_fine(weighted_swiglu(h, probs), w)``; see the module docstring."""

    @staticmethod
    def forward(ctx, h, probs, w_nk, group_offs, config: Float8Config, num_cu, backend, out_dtype, w_fp8=None,
                wgrad_target=None):
        need_da = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        a, *rows = quantize_swiglu_rows(h, probs, recipe_of(config), config.forward_dtype, config.margin)
        # rows: a's FP8 rows copy, its last reference handed over (freed once the GEMM has read it,
        # before a's token copy is made)
        y, (a_t, a_t_scale, wgrad_offs) = fine_forward(ctx, a, rows, w_nk, group_offs, config, num_cu, backend,
                                                       out_dtype, w_fp8, wgrad_target, need_da, need_dw)
        del a
        ctx.save_for_backward(h if need_da else None, probs if need_da else None, w_nk if need_da else None,
                              a_t, a_t_scale, group_offs, wgrad_offs)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        from ..swiglu import weighted_swiglu_backward

        h, probs, w_nk, a_t, a_t_scale, group_offs, wgrad_offs = ctx.saved_tensors
        need_da = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        da, dw = fine_backward(ctx, dy, w_nk, a_t, a_t_scale, group_offs, wgrad_offs, need_da,
                               ctx.needs_input_grad[2])
        dh = dprobs = None
        if need_da:
            dh, dprobs = weighted_swiglu_backward(h, probs, da)
        return dh, dprobs, dw, None, None, None, None, None, None, None


def grouped_gemm_fine_swiglu(h, probs, w_nk, offs, *, config: Float8Config, num_cu=None, backend="auto",
                             out_dtype=None, w_fp8=None, wgrad_target=None) -> torch.Tensor:
    """``turbo_moe.swiglu.grouped_gemm_fp8_swiglu`` for the fine-grained recipes (``h`` with unit
    column stride, ``probs`` 1-D contiguous, offsets, config and out_dtype checked and resolved there)."""
    return FineGrainedSwiGLUGemmFunction.apply(h, probs, w_nk, offs, config, num_cu, backend, out_dtype, w_fp8,
                                               wgrad_target)
