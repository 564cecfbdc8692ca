"""The differentiable grouped GEMM under the blockwise and MXFP8 recipes.

Same contract as ``turbo_moe.autograd.GroupedGemmFP8Function`` (which dispatches here when
``config.granularity`` is ``"blockwise"`` or ``"mxfp8"``): ``y[rows of g] = x[rows of g] @ W[g]^T``
with ``W`` as ``[G, N, K]``; gradients in the inputs' dtypes; an empty group gets ``dW[g] = 0``.

What each GEMM reads (B = 128 blockwise, 32 mxfp8; module doc of ``turbo_moe.fine_grained``):

* forward ``y = x W^T``: ``x`` in 1xB blocks along K; ``W`` in 128x128 blocks (blockwise) or 1x32
  blocks along K (mxfp8);
* dgrad ``dx = dy W``: ``dy`` in 1xB blocks along N; ``W^T`` ``[G, K, N]``: blockwise, the same
  FP8 values and scales as the forward's ``W``, transposed; mxfp8, ``W`` quantized again in 1x32
  blocks along N;
* wgrad ``dW[g] = dy_g^T x_g``: ``dy^T`` and ``x^T`` token-contiguous, in 1xB blocks along each
  group's tokens.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

from .. import autograd as per_tensor  # attributes read at call time (each module imports the other)
from .. import host_plan
from ..backends.base import GemmKind
from ..config import Float8Config
from .gemm import BlockScaledProblem, run_block_scaled
from .quantize import quantize_rows, quantize_tokens_for_wgrad, quantize_weight_blocks, recipe_of

__all__ = ["FineGrainedFP8Function", "GradRowsHandoff", "fine_gemm_backward", "grouped_gemm_fine", "grouped_wgrad_fine",
           "quantize_weight_fine"]


def quantize_weight_fine(w_nk: torch.Tensor, config: Float8Config, transposed: bool = True):
    """``turbo_moe.autograd.quantize_weight`` for the fine-grained recipes: a ``Float8Weight``."""
    from ..autograd import Float8Weight

    recipe, dtype, margin = recipe_of(config), config.forward_dtype, config.margin
    if not recipe.e8m0:
        q, q_t, scale = quantize_weight_blocks(w_nk, recipe, dtype, margin, transposed=transposed)
        return Float8Weight(q, scale, q_t, scale.transpose(1, 2) if transposed else None)
    q, scale = quantize_rows(w_nk, recipe, dtype, margin)
    q_t, scale_t = quantize_rows(w_nk.transpose(1, 2), recipe, dtype, margin) if transposed else (None, None)
    return Float8Weight(q, scale, q_t, scale_t)


def _gemm(kind, a, b, sa, sb, offs, out_dtype, recipe, num_cu, backend, role, out=None, accumulate=False):
    problem = BlockScaledProblem(kind, a, b, sa, sb, offs, out_dtype, recipe, num_cu, role, out, accumulate)
    return run_block_scaled(problem, backend)


class GradRowsHandoff:
    """An FP8 GEMM's output gradient's rows copy, made by its consumer's backward where that backward
    computes the gradient anyway: fc1 of an expert MLP and the fused SwiGLU + fc2
    (``turbo_moe.fine_grained.swiglu``), whose backward computes ``dh`` and can write its rows
    copy (fc1's dgrad operand) in the same pass, sparing fc1 a cast that reads ``dh`` again.

    fc1's forward says what it will cast its output gradient to (:meth:`expect`); the consumer's
    backward, given ``expecting``, :meth:`put` s the copy beside ``dh``; fc1's backward
    :meth:`take` s it only for that very tensor, unwritten since (a gradient summed with another
    consumer's is a new tensor, or that one written in place: cast as usual). ``dh`` itself still
    goes to fc1 in h's dtype (its wgrad casts it along tokens). One object per forward of the pair."""

    __slots__ = ("expecting", "_held")

    def __init__(self):
        self.expecting = None  # (recipe, FP8 dtype, margin), from fc1's forward
        self._held = None

    def expect(self, recipe, fp8_dtype, margin: int) -> None:
        self.expecting = (recipe, fp8_dtype, margin)

    def put(self, grad: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> None:
        self._held = (weakref.ref(grad), grad._version, rows, scales)

    def take(self, grad: torch.Tensor):
        """``(rows, scales)`` made for ``grad``, or None; held copies are dropped either way."""
        held, self._held = self._held, None
        if held is None or held[0]() is not grad or grad._version != held[1]:
            return None
        return held[2], held[3]


# Host-plan regions (turbo_moe.host_plan: a signature's launches recorded once, then replayed from
# C++), as the per-tensor Functions have them: the forward GEMM (with x's rows copy and the
# weight's copies where this call makes them), the wgrad operand's token copy, dgrad, and wgrad.
# Off a GPU each runs its function directly.
_FORWARD_REGION = host_plan.Region("fine-grained gemm forward")
_TOKENS_REGION = host_plan.Region("fine-grained wgrad operand")
_DGRAD_REGION = host_plan.Region("fine-grained gemm dgrad")
_WGRAD_REGION = host_plan.Region("fine-grained gemm wgrad")


def _through_plan(region, static, inputs, compute, writes_inputs=False):
    return per_tensor.through_plan(region, static, inputs, compute, writes_inputs=writes_inputs)


def _forward_tensors(x, x_q, x_scale, w_nk, w_fp8, group_offs, config, num_cu, backend, out_dtype, need_dx):
    """``(y, W^T in FP8, its scales)`` (None, None without dgrad, or where ``w_fp8`` has W^T): x's
    rows copy unless given, the weight's FP8 copies unless ``w_fp8`` has them, the forward GEMM."""
    recipe = recipe_of(config)
    made = w_fp8 is None or (need_dx and w_fp8.data_t is None)
    if made:
        w_fp8 = quantize_weight_fine(w_nk, config, transposed=need_dx)
    if x_q is None:
        x_q, x_scale = quantize_rows(x, recipe, config.forward_dtype, config.margin)
    y = _gemm(GemmKind.M_GROUPED, x_q, w_fp8.data, x_scale, w_fp8.scale, group_offs, out_dtype, recipe, num_cu,
              backend, "fwd")
    # A cached W^T stays the caller's: a host-plan region's outputs are its own allocations or
    # its inputs, and blockwise's W^T scales are a view of W's (not an input of their own).
    return (y, w_fp8.data_t, w_fp8.scale_t) if need_dx and made else (y, None, None)


def _dgrad_tensors(dy, dy_q, dy_scale, w_kn, w_kn_scale, group_offs, config, num_cu, backend, dx_dtype):
    """``(dx,)``: dy's rows copy (unless handed over: ``dy_q``, ``dy_scale``), the dgrad GEMM."""
    recipe = recipe_of(config)
    if dy_q is None:
        dy_q, dy_scale = quantize_rows(dy, recipe, config.grad_dtype, config.margin)
    return (_gemm(GemmKind.M_GROUPED, dy_q, w_kn, dy_scale, w_kn_scale, group_offs, dx_dtype, recipe, num_cu, backend,
                  "dgrad"),)


def _dy_tokens(dy, group_offs, wgrad_offs, config):
    return quantize_tokens_for_wgrad(dy, group_offs, recipe_of(config), config.grad_dtype, config.margin, wgrad_offs)


def _wgrad_tensors(dy, x_t, x_t_scale, group_offs, wgrad_offs, config, num_cu, backend, dw_dtype, out):
    dy_t, dy_t_scale, _ = _dy_tokens(dy, group_offs, wgrad_offs, config)
    return (_gemm(GemmKind.K_GROUPED, dy_t, x_t, dy_t_scale, x_t_scale, wgrad_offs, dw_dtype, recipe_of(config),
                  num_cu, backend, "wgrad", out=out, accumulate=out is not None),)


class FineGrainedFP8Function(torch.autograd.Function):
    """Blockwise / MXFP8 grouped GEMM; ``w`` is passed as ``[G, N, K]``."""

    @staticmethod
    def forward(ctx, x, w_nk, group_offs, config: Float8Config, num_cu, backend, out_dtype, w_fp8=None,
                wgrad_target=None, x_rows=None, grad_rows: Optional[GradRowsHandoff] = None):
        # x_rows: x's rows copy when the caller made it (``[fp8, scales]``, a list emptied here:
        # its last reference, so that the copy is freed once the GEMM has read it). grad_rows: where
        # y's consumer may leave dy's rows copy (GradRowsHandoff).
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_rows is not None and need_dx:
            grad_rows.expect(recipe_of(config), config.grad_dtype, config.margin)
        ctx.grad_rows = grad_rows if need_dx else None
        given = x_rows is not None
        x_q, x_scale = x_rows if given else (None, None)
        if given:
            x_rows.clear()
        compute = functools.partial(_forward_tensors, x, x_q, x_scale, w_nk, w_fp8, group_offs, config, num_cu,
                                    backend, out_dtype, need_dx)
        cache_key, cache_inputs = per_tensor.cached_weight_parts(w_fp8)
        static = (config, num_cu, backend, out_dtype, need_dx, given, *cache_key)
        inputs = (None if given else x, x_q, x_scale, w_nk, group_offs, *cache_inputs)
        y, w_kn, w_kn_scale = _through_plan(_FORWARD_REGION, static, inputs, compute)
        if need_dx and w_kn is None:  # the cache's W^T (see _forward_tensors)
            w_kn, w_kn_scale = w_fp8.data_t, w_fp8.scale_t
        # the rows copy is dead: the token-major copy (its own pass anyway) is made once it is freed
        del compute, inputs, x_q, x_scale
        x_t = x_t_scale = wgrad_offs = None
        if need_dw:
            recipe = recipe_of(config)
            x_t, x_t_scale, wgrad_offs = _through_plan(
                _TOKENS_REGION, (config, "forward"), (x, group_offs),
                functools.partial(quantize_tokens_for_wgrad, x, group_offs, recipe, config.forward_dtype, config.margin))
        ctx.w_kn = (w_kn, w_kn_scale) if need_dx else None  # dgrad's alone: dropped before wgrad
        ctx.save_for_backward(w_nk if need_dx else None, x_t, x_t_scale, group_offs, wgrad_offs)
        ctx.config, ctx.num_cu, ctx.backend = config, num_cu, backend
        ctx.x_dtype, ctx.w_dtype = x.dtype, w_nk.dtype
        ctx.wgrad_target = wgrad_target  # turbo_moe.autograd.WgradTarget
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return (*fine_gemm_backward(ctx, dy), None, None, None, None, None, None, None, None, None)


def fine_gemm_backward(ctx, dy):
    """``(dx, dW)`` of :class:`FineGrainedFP8Function` (None where not needed) from what its forward
    left on ``ctx`` (its ``saved_tensors``, ``needs_input_grad`` and attributes; the planned MLP's
    Python backward passes a namespace holding the same); run without grad."""
    w_nk, x_t, x_t_scale, group_offs, wgrad_offs = ctx.saved_tensors
    config, num_cu, backend = ctx.config, ctx.num_cu, ctx.backend
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w_kn, ctx.w_kn = ctx.w_kn, None
    if w_kn is None and need_dx:  # a second backward (retain_graph): re-derive W^T
        requantized = quantize_weight_fine(w_nk, config, transposed=True)
        w_kn = (requantized.data_t, requantized.scale_t)
    dy = dy.contiguous()
    dx = dw = None
    if need_dx:
        handed = ctx.grad_rows.take(dy) if ctx.grad_rows is not None else None
        dy_rows = handed or (None, None)
        (dx,) = _through_plan(_DGRAD_REGION, (config, num_cu, backend, ctx.x_dtype, handed is not None),
                              (None if handed else dy, *dy_rows, *w_kn, group_offs),
                              functools.partial(_dgrad_tensors, dy, *dy_rows, *w_kn, group_offs, config, num_cu,
                                                backend, ctx.x_dtype))
        del w_kn, handed, dy_rows  # dgrad's alone: freed before wgrad allocates
    if need_dw:
        target = ctx.wgrad_target
        if target is not None and target.defer is not None:  # for the caller to run later
            dy_t, dy_t_scale, _ = _dy_tokens(dy, group_offs, wgrad_offs, config)
            recipe = recipe_of(config)
            dw = per_tensor.finish_wgrad(target, per_tensor.DeferredWgrad(functools.partial(
                _gemm, GemmKind.K_GROUPED, dy_t, x_t, dy_t_scale, x_t_scale, wgrad_offs, recipe=recipe,
                num_cu=num_cu, backend=backend, role="wgrad")))
        else:  # returned, or into the target's buffer now (float32: in the kernel's epilogue)
            buffer, out, dw_dtype = per_tensor._wgrad_destination(ctx, target)
            (dw,) = _through_plan(
                _WGRAD_REGION, (config, num_cu, backend, dw_dtype), (dy, x_t, x_t_scale, group_offs, wgrad_offs, out),
                functools.partial(_wgrad_tensors, dy, x_t, x_t_scale, group_offs, wgrad_offs, config, num_cu,
                                  backend, dw_dtype, out),
                writes_inputs=out is not None)
            dw = per_tensor._wgrad_result(target, buffer, out, dw)
    return dx, dw


def grouped_gemm_fine(x, w_nk, offs, *, config: Float8Config, num_cu=None, backend="auto", out_dtype=None,
                      w_fp8=None, wgrad_target=None, x_rows=None, grad_rows=None) -> torch.Tensor:
    """``turbo_moe.autograd._grouped_gemm_fp8_resolved`` for the fine-grained recipes (operands,
    offsets, config and out_dtype already checked and resolved there). ``x_rows``, ``grad_rows``:
    see ``FineGrainedFP8Function.forward``."""
    return FineGrainedFP8Function.apply(x, w_nk, offs, config, num_cu, backend, out_dtype, w_fp8, wgrad_target,
                                        x_rows, grad_rows)


def grouped_wgrad_fine(dy, x, group_offs, *, config: Float8Config, num_cu=None, backend="auto",
                       out_dtype: Optional[torch.dtype] = None, main_grad=None) -> torch.Tensor:
    """``turbo_moe.autograd._grouped_wgrad_fp8_resolved`` for the fine-grained recipes (checked there)."""
    recipe = recipe_of(config)
    dy_t, dy_scale, wgrad_offs = quantize_tokens_for_wgrad(dy, group_offs, recipe, config.grad_dtype, config.margin)
    x_t, x_scale, _ = quantize_tokens_for_wgrad(x, group_offs, recipe, config.forward_dtype, config.margin, wgrad_offs)
    return _gemm(GemmKind.K_GROUPED, dy_t, x_t, dy_scale, x_scale, wgrad_offs,
                 dy.dtype if out_dtype is None else out_dtype, recipe, num_cu, backend, "wgrad",
                 out=main_grad, accumulate=main_grad is not None)
