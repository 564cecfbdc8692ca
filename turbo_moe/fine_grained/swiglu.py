"""fc2 of an expert MLP under the blockwise and MXFP8 recipes, the routing-weighted SwiGLU fused in.

``grouped_gemm_fine_swiglu(h, probs, w, offs)`` is ``grouped_gemm_fine(a, w)`` for
``a = silu(h[:, :F]) * h[:, F:] * probs[:, None]`` (``turbo_moe.swiglu.weighted_swiglu``, float32,
rounded once to h's dtype), what Megatron's grouped experts compute between fc1 and fc2:

* forward: one launch computes ``a`` from fc1's output ``h`` and casts it into the forward GEMM's
  1xB blocks (``quantize.quantize_swiglu_rows``), where the unfused path runs the activation's
  own kernels and then a rows cast that reads ``a`` again. fc2 (``FineGrainedFP8Function``) takes
  that rows copy and casts its wgrad's token copy from ``a``, which is then freed (the fine-grained
  token copy needs each group's column block maxima before its cast: a pass of its own);
* backward: fc2's dgrad and wgrad, then one kernel turns ``da`` into ``dh`` and ``dprobs``
  together (``turbo_moe.swiglu.weighted_swiglu_backward``: each program owns whole rows, so the
  row sums behind ``dprobs`` are ordered and need no atomics), where the activation's own
  backward reduces ``dprobs`` in a second pass.

Two autograd nodes, as unfused (the activation's, :class:`FineGrainedSwiGLUFunction`, then fc2's):
fc2's output gradient is freed before the activation's backward allocates ``dh``. Saved: ``h`` and
``probs`` (the activation saves them too), ``a``'s token copy in FP8 and W^T in FP8 (fc2's).
``dh`` goes to fc1 in h's dtype (its wgrad casts it along tokens); given fc1's
``autograd.GradRowsHandoff`` (F a multiple of fc1's block), the backward kernel also writes
``dh``'s rows copy, fc1's dgrad operand, which fc1 then takes instead of casting ``dh`` again.
Every copy is bit for bit ``quantize_rows`` of the tensor it comes with (``a``, ``dh``), so this
equals the activation followed by ``grouped_gemm_fine`` where the activation computes
``weighted_swiglu``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import autograd as per_tensor  # attributes read at call time (each module imports the other)
from .. import host_plan
from ..config import Float8Config
from .autograd import GradRowsHandoff, grouped_gemm_fine
from .quantize import quantize_swiglu_backward_rows, quantize_swiglu_rows, recipe_of

__all__ = ["FineGrainedSwiGLUFunction", "fine_swiglu_backward", "grouped_gemm_fine_swiglu"]

# Host-plan regions (turbo_moe.host_plan), one launch each: the forward's activation and rows cast,
# the backward's dh and dprobs (and dh's rows copy, for fc1). Off a GPU each runs its function directly.
_FORWARD_REGION = host_plan.Region("fine-grained swiglu rows cast")
_BACKWARD_REGION = host_plan.Region("fine-grained swiglu backward")
_BACKWARD_ROWS_REGION = host_plan.Region("fine-grained swiglu backward + dh rows")


class FineGrainedSwiGLUFunction(torch.autograd.Function):
    """``(a, a's FP8 rows copy, its scales)`` of ``weighted_swiglu(h, probs)``; the copy is not
    differentiable (fc2's backward quantizes its own gradient)."""

    @staticmethod
    def forward(ctx, h, probs, config: Float8Config, grad_rows: Optional[GradRowsHandoff] = None):
        a, a_q, a_scale = per_tensor.through_plan(_FORWARD_REGION, (config,), (h, probs), functools.partial(
            quantize_swiglu_rows, h, probs, recipe_of(config), config.forward_dtype, config.margin))
        ctx.mark_non_differentiable(a_q, a_scale)
        # Without this autograd hands backward a zero-filled gradient for the rows copy: an FP8
        # [M, F] fill per call (0.5 ms a step and a transient M x F bytes at the expert-dominated
        # training config, H100 profile).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, probs)
        ctx.grad_rows = grad_rows
        return a, a_q, a_scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, da, _rows_grad, _scales_grad):
        return (*fine_swiglu_backward(ctx, da), None, None)


def fine_swiglu_backward(ctx, da):
    """``(dh, dprobs)`` of :class:`FineGrainedSwiGLUFunction` (both None where ``da`` never came),
    leaving ``dh``'s rows copy in the ``GradRowsHandoff`` where fc1 expects it, from what its forward
    left on ``ctx`` (the planned MLP's Python backward passes a namespace holding the same); run
    without grad."""
    from ..swiglu import weighted_swiglu_backward

    h, probs = ctx.saved_tensors
    if da is None:  # a's gradient never came (set_materialize_grads(False)): nothing flows back
        ctx.grad_rows = None
        return None, None
    da = da.contiguous()
    # The handoff stays: a second backward (retain_graph) makes the rows copy again, so that every
    # backward is the same computation (dprobs from the rows kernel differs from the plain kernel's
    # in its last bit) whether it runs here, in the planned MLP's node or in its Python fallback.
    handoff = ctx.grad_rows
    expected = handoff.expecting if handoff is not None and ctx.needs_input_grad[0] else None
    if expected is not None and (h.shape[1] // 2) % expected[0].block == 0:
        # fc1 casts dh into these 1xB blocks for its dgrad: made here from the same pass
        dh, dprobs, rows, scales = per_tensor.through_plan(
            _BACKWARD_ROWS_REGION, expected, (h, probs, da),
            functools.partial(quantize_swiglu_backward_rows, h, probs, da, *expected))
        handoff.put(dh, rows, scales)
        return dh, dprobs
    return per_tensor.through_plan(_BACKWARD_REGION, (), (h, probs, da),
                                   functools.partial(weighted_swiglu_backward, h, probs, da))


def grouped_gemm_fine_swiglu(h, probs, w_nk, offs, *, config: Float8Config, num_cu=None, backend="auto",
                             out_dtype=None, w_fp8=None, wgrad_target=None,
                             h_grad_rows: Optional[GradRowsHandoff] = None) -> torch.Tensor:
    """``turbo_moe.swiglu.grouped_gemm_fp8_swiglu`` for the fine-grained recipes (``h`` with unit
    column stride, ``probs`` 1-D contiguous, offsets, config and out_dtype checked and resolved
    there). ``h_grad_rows``: the ``GradRowsHandoff`` that fc1 (the GEMM producing ``h``) was given:
    the activation's backward then leaves ``dh``'s rows copy there for fc1's dgrad."""
    a, *rows = FineGrainedSwiGLUFunction.apply(h, probs, config, h_grad_rows)
    # rows: a's rows copy, its last reference handed to fc2 (freed once its GEMM has read it)
    return grouped_gemm_fine(a, w_nk, offs, config=config, num_cu=num_cu, backend=backend, out_dtype=out_dtype,
                             w_fp8=w_fp8, wgrad_target=wgrad_target, x_rows=rows)
