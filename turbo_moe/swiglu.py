"""fc2 of an expert MLP with the routing-weighted SwiGLU fused into its FP8 input quantization.

``grouped_gemm_fp8_swiglu(h, probs, w, offs)`` is ``grouped_gemm_fp8(a, w)`` for
``a = silu(h[:, :F]) * h[:, F:] * probs[:, None]``, where ``h [M, 2F]`` is fc1's output and
``probs`` the routing weights: what Megatron's grouped experts compute between fc1 and fc2
(``weighted_bias_swiglu_impl``), then fc2. In an FP8 MLP ``a`` is only ever read as FP8, so:

* forward computes ``a`` inside its quantization (``kernels/triton/swiglu_fp8.py``: an amax pass
  and a cast pass over ``h``) and runs fc2's NT kernel on it; ``a`` never exists in bf16, and the
  activation's own kernels (several elementwise launches in Megatron's path) are gone;
* backward runs fc2's dgrad and wgrad as ``grouped_gemm_fp8`` does (``da``, ``dW``), then one
  kernel turns ``da`` into ``dh`` and ``dprobs``. Given ``h_grad_handoff``
  (``autograd.QuantizedGradHandoff``) that fc1's forward registered with, it writes ``dh``
  straight into the FP8 layouts fc1's backward needs (two kernels: ``dprobs`` and ``max|dh|``,
  then the cast), and autograd carries only a placeholder from here to fc1.

Saved for backward: ``h`` (Megatron's activation saves it too), ``probs``, ``a``'s token-major FP8
copy (wgrad) and, held on ctx, W^T in FP8 (dgrad) -- never ``a`` in high precision.

Under delayed scaling (``turbo_moe.delayed_scaling``) each of these is one pass: ``a``'s cast, and
``dh``'s layouts with ``dprobs``, take their scale from an amax history and record their amax.

Tensorwise scaling (one scale for ``a``: the amax pass sees the whole tensor before the cast) and
rowwise (``kernels/triton/rowwise_layouts.py``: a stats pass finds ``a``'s row and (group, column)
amaxes, a cast pass writes both layouts; ``dh`` the same way, its two scales handed to fc1 packed in
one tensor); :func:`fuses_swiglu` says whether a recipe gets this module's fusion and the ``dh``
handoff. The fine-grained recipes (blockwise, MXFP8) go to ``turbo_moe.fine_grained.swiglu``: the
activation fused with ``a``'s rows cast, ``dh`` and ``dprobs`` from one backward kernel, no
handoff; :func:`swiglu_gemm_supports` says whether :func:`grouped_gemm_fp8_swiglu` takes a recipe
at all (every FP8 one). The activation's
arithmetic is float32 from ``h`` (Megatron's rounds ``silu(gate) * linear`` to bf16 first); the
quantization is ``turbo_moe.quantize``'s. On a GPU with Triton the kernels run; elsewhere torch
ops with the same math (to an ulp of float32 ``exp``) do.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

from . import host_plan
from ._triton_kernels import triton_kernels
from .autograd import (
    Float8Weight,
    QuantizedGradHandoff,
    WgradTarget,
    _autocast_out_dtype,
    _run,
    cached_weight_inputs,
    cached_weight_key,
    fp8_gemm_backward,
    fp8_weight_for,
    resolve_call_options,
    stash_for_fp8_gemm_backward,
    through_plan,
)
from .backends import GemmKind
from .checks import HIGH_PRECISION_DTYPES, check_group_offs
from .config import Float8Config, ScalingGranularity, fp8_max
from .delayed_scaling import AmaxHistory, DelayedScalingState
from .quantize import (pack_scales, quantize_rowwise, quantize_rowwise_layouts, quantize_tensorwise_layouts,
                       rowwise_layout_kernels)

__all__ = ["fuses_swiglu", "swiglu_gemm_supports", "grouped_gemm_fp8_swiglu", "weighted_swiglu", "quantize_weighted_swiglu",
           "quantize_weighted_swiglu_rowwise", "weighted_swiglu_backward", "quantize_weighted_swiglu_backward"]


def fuses_swiglu(config: Optional[Float8Config]) -> bool:
    """Whether this recipe gets this module's fusion (the activation inside both FP8 layouts'
    quantization) and can hand ``dh`` to fc1 in FP8 (``autograd.QuantizedGradHandoff``): per-tensor
    scaling, current or delayed, or rowwise."""
    return config is not None and not config.fine_grained and config.granularity in (ScalingGranularity.TENSORWISE,
                                                                                      ScalingGranularity.ROWWISE)


def swiglu_gemm_supports(config: Optional[Float8Config]) -> bool:
    """Whether :func:`grouped_gemm_fp8_swiglu` takes this recipe: every FP8 one (the fine-grained
    recipes through ``turbo_moe.fine_grained.swiglu``, without the ``dh`` handoff)."""
    return config is not None and (fuses_swiglu(config) or config.fine_grained)



def _halves(h: torch.Tensor):
    f = h.shape[1] // 2
    return h[:, :f].float(), h[:, f:].float()


def weighted_swiglu(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """float32 ``silu(h[:, :F]) * h[:, F:] * probs[:, None]``, in the kernels' order of operations."""
    gate, linear = _halves(h)
    return gate * torch.sigmoid(gate) * linear * probs.float()[:, None]


def _swiglu_kernels(h: torch.Tensor):
    return triton_kernels("swiglu_fp8") if h.is_cuda else None


def quantize_weighted_swiglu(h: torch.Tensor, probs: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, *,
                             rows: bool = True, transposed: bool = False, history: Optional[AmaxHistory] = None,
                             amax_partials: Optional[torch.Tensor] = None):
    """Tensorwise FP8 of :func:`weighted_swiglu` ``(h, probs)`` in the layouts asked for:
    ``(rows [M, F] or None, transposed [F, M] or None, 0-dim dequant scale)``, as
    ``quantize.quantize_tensorwise_layouts`` returns them for a materialized activation.
    ``history``: delayed scaling (``turbo_moe.delayed_scaling``): one pass, the scale from it.
    ``amax_partials``: float32, their maximum ``max |a|`` (fc1's GEMM reduced it in its epilogue,
    ``autograd.QuantizedGradHandoff.forward_amax``): the cast pass alone runs."""
    kernels = _swiglu_kernels(h)
    if kernels is not None and history is not None:
        history.prepare(h.device, fp8_dtype, margin, lambda: kernels.swiglu_amax(h, probs))
        return kernels.swiglu_fp8_delayed(h, probs, history.state, history.ticket, history.history_len,
                                          history.most_recent, fp8_dtype, fp8_max(fp8_dtype), margin, write_rows=rows,
                                          write_transposed=transposed)
    if kernels is not None:
        return kernels.swiglu_fp8_tensorwise(h, probs, fp8_dtype, fp8_max(fp8_dtype), margin, write_rows=rows,
                                             write_transposed=transposed, amax_partials=amax_partials)
    return quantize_tensorwise_layouts(weighted_swiglu(h, probs), fp8_dtype, margin, rows=rows, transposed=transposed,
                                       history=history)


def quantize_weighted_swiglu_rowwise(h: torch.Tensor, probs: torch.Tensor, group_offs: torch.Tensor,
                                     fp8_dtype: torch.dtype, margin: int = 0, *, transposed: bool = True):
    """Rowwise FP8 of :func:`weighted_swiglu` ``(h, probs)``: ``(rows [M, F], row dequant [M],
    token-major [F, M] or None, (group, column) dequant [G, F])``, as
    ``quantize.quantize_rowwise_layouts`` returns them for a materialized activation; on a GPU
    without materializing it (two passes over ``h``)."""
    kernels = rowwise_layout_kernels(h, group_offs)
    if kernels is not None:
        return kernels.swiglu_rowwise_layouts(h, probs, group_offs, fp8_dtype, fp8_max(fp8_dtype), margin,
                                              write_transposed=transposed)
    a = weighted_swiglu(h, probs)
    if not transposed:
        rows, row_dequant = quantize_rowwise(a, fp8_dtype, margin)
        return rows, row_dequant, None, None
    return quantize_rowwise_layouts(a, fp8_dtype, margin, group_offs)


def weighted_swiglu_backward(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor):
    """``(dh [M, 2F] in h's dtype, dprobs [M] in probs' dtype)`` of :func:`weighted_swiglu`, given
    ``da`` ``[M, F]``; float32 inside, ``dprobs`` summed per row in a fixed order."""
    kernels = _swiglu_kernels(h)
    if kernels is not None:
        return kernels.swiglu_backward(h, probs, da, probs.dtype)
    dh, dprobs = _weighted_swiglu_grads(h, probs, da)
    return dh.to(h.dtype), dprobs.to(probs.dtype)


def _weighted_swiglu_grads(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor):
    """float32 ``(dh [M, 2F], dprobs [M])`` of :func:`weighted_swiglu`: the torch path's math."""
    gate, linear = _halves(h)
    s = torch.sigmoid(gate)
    silu = gate * s
    d = da.float()
    dap = d * probs.float()[:, None]
    dgate = dap * linear * s * (1.0 + gate * (1.0 - s))
    return torch.cat((dgate, dap * silu), dim=1), (d * silu * linear).sum(dim=1)


def quantize_weighted_swiglu_backward(h: torch.Tensor, probs: torch.Tensor, da: torch.Tensor, fp8_dtype: torch.dtype,
                                      margin: int = 0, *, rows: bool = True, transposed: bool = False,
                                      history: Optional[AmaxHistory] = None,
                                      rowwise_offs: Optional[torch.Tensor] = None):
    """``(rows [M, 2F] or None, transposed [2F, M] or None, dequant scale, dprobs [M])``: ``dh`` of
    :func:`weighted_swiglu_backward` quantized tensorwise from its float32 values, as
    ``quantize.quantize_tensorwise_layouts`` returns a materialized tensor's layouts, without ``dh``
    ever existing in h's dtype; ``dprobs`` in probs' dtype. ``history``: delayed scaling (one pass
    on a GPU: ``dh``'s layouts and ``dprobs`` together). ``rowwise_offs``: rowwise instead, per row
    and per (group of these offsets, column); the scale is then both scales packed in one tensor
    (``quantize.pack_scales``: what a rowwise ``QuantizedGradHandoff`` carries)."""
    if rowwise_offs is not None:
        kernels = rowwise_layout_kernels(h, rowwise_offs)
        if kernels is not None:
            return kernels.swiglu_backward_rowwise_layouts(h, probs, da, rowwise_offs, fp8_dtype, fp8_max(fp8_dtype),
                                                           margin, probs.dtype, write_rows=rows,
                                                           write_transposed=transposed)
        dh, dprobs = _weighted_swiglu_grads(h, probs, da)
        q_rows, row_dequant, q_t, col_dequant = quantize_rowwise_layouts(dh, fp8_dtype, margin, rowwise_offs)
        return (q_rows if rows else None, q_t if transposed else None, pack_scales(row_dequant, col_dequant),
                dprobs.to(probs.dtype))
    kernels = _swiglu_kernels(h)
    if kernels is not None and history is not None:
        history.prepare(h.device, fp8_dtype, margin, lambda: kernels.swiglu_backward_dh_amax(h, probs, da))
        return kernels.swiglu_backward_fp8_delayed(h, probs, da, history.state, history.ticket, history.history_len,
                                                   history.most_recent, fp8_dtype, fp8_max(fp8_dtype), margin,
                                                   probs.dtype, write_rows=rows, write_transposed=transposed)
    if kernels is not None:
        return kernels.swiglu_backward_fp8_tensorwise(h, probs, da, fp8_dtype, fp8_max(fp8_dtype), margin, probs.dtype,
                                                      write_rows=rows, write_transposed=transposed)
    dh, dprobs = _weighted_swiglu_grads(h, probs, da)
    q_rows, q_t, scale = quantize_tensorwise_layouts(dh, fp8_dtype, margin, rows=rows, transposed=transposed,
                                                     history=history)
    return q_rows, q_t, scale, dprobs.to(probs.dtype)


def _grad_is_observed(h: Optional[torch.Tensor]) -> bool:
    """Whether something would read h's gradient on its way to fc1 (a tensor hook, retain_grad):
    then ``dh`` goes in h's dtype, as without a handoff, never as the handoff's placeholder."""
    return h is not None and (bool(h._backward_hooks) or h.retains_grad)


def _swiglu_gemm_forward_tensors(h, probs, w_nk, w_fp8, group_offs, config, num_cu, backend, out_dtype, need_da,
                                 need_dw, history, amax_partials=None):
    """The forward's GPU work: ``(y, W^T in FP8, its scale, a token-major in FP8, its scale)``
    with ``a = weighted_swiglu(h, probs)`` (never materialized in h's dtype)."""
    w_q, w_scale, w_kn, w_kn_scale = fp8_weight_for(w_nk, w_fp8, config, need_da)
    if config.granularity is ScalingGranularity.ROWWISE:
        a_fp8, a_scale, a_km, a_km_scale = quantize_weighted_swiglu_rowwise(h, probs, group_offs, config.forward_dtype,
                                                                            config.margin, transposed=need_dw)
    else:
        a_fp8, a_km, a_scale = quantize_weighted_swiglu(h, probs, config.forward_dtype, config.margin,
                                                        transposed=need_dw, history=history,
                                                        amax_partials=amax_partials)
        a_km_scale = a_scale
    y = _run(GemmKind.M_GROUPED, a_fp8, w_q, a_scale, w_scale, group_offs, out_dtype, num_cu, backend, "fwd", config)
    if not need_da:
        w_kn = w_kn_scale = None
    return y, w_kn, w_kn_scale, a_km, a_km_scale


# Host-plan regions (turbo_moe.host_plan): the forward (the activation's cast + fc2's GEMM) and
# the activation's backward (dh, with its FP8 layouts under a handoff); fc2's own backward goes
# through autograd's regions (fp8_gemm_backward).
_FORWARD_REGION = host_plan.Region("swiglu + fp8 gemm forward")
_BACKWARD_REGION = host_plan.Region("swiglu backward")


class GroupedSwiGLUGemmFP8Function(torch.autograd.Function):
    """``grouped_gemm_fp8(weighted_swiglu(h, probs), w)``; see the module docstring."""

    @staticmethod
    def forward(ctx, h, probs, w_nk, group_offs, config: Float8Config, num_cu, backend, out_dtype,
                w_fp8: Optional[Float8Weight] = None, wgrad_target: Optional[WgradTarget] = None,
                h_grad_handoff: Optional[QuantizedGradHandoff] = None,
                delayed: Optional[DelayedScalingState] = None):
        need_da = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = ctx.needs_input_grad[2]
        history = delayed and delayed.input
        # fc1's GEMM may have reduced the activation's amax already (the handoff kept it for this h).
        amax = h_grad_handoff.forward_amax(h) if h_grad_handoff is not None else None
        compute = functools.partial(_swiglu_gemm_forward_tensors, h, probs, w_nk, w_fp8, group_offs, config, num_cu,
                                    backend, out_dtype, need_da, need_dw, history, amax)
        static = (config, num_cu, backend, out_dtype, need_da, need_dw, *cached_weight_key(w_fp8))
        inputs = (h, probs, w_nk, group_offs, *cached_weight_inputs(w_fp8))
        if amax is not None:  # the key and inputs without it stay as they were (the planned MLP's)
            static, inputs = (*static, "given amax"), (*inputs, amax)
        y, w_kn, w_kn_scale, a_km, a_km_scale = through_plan(_FORWARD_REGION, static, inputs, compute, (history,))
        stash_for_fp8_gemm_backward(ctx, w_kn, config, num_cu, backend, h.dtype, w_nk.dtype, wgrad_target,
                                    grad_history=delayed and delayed.grad_output, w_fp8=w_fp8)
        ctx.h_grad_handoff = h_grad_handoff
        ctx.h_ref = weakref.ref(h) if h_grad_handoff is not None else None
        ctx.save_for_backward(h if need_da else None, probs if need_da else None, w_nk if need_da else None,
                              w_kn_scale, a_km, a_km_scale if need_dw else None, group_offs)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        h, probs, w_nk, w_kn_scale, a_km, a_km_scale, group_offs = ctx.saved_tensors
        need_da = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        da, dw = fp8_gemm_backward(ctx, dy, w_nk, w_kn_scale, a_km, a_km_scale, group_offs, need_da,
                                   ctx.needs_input_grad[2])
        dh = dprobs = None
        handoff = ctx.h_grad_handoff
        if need_da and handoff is not None and handoff.expecting and ctx.needs_input_grad[0] \
                and not _grad_is_observed(ctx.h_ref()):
            offs = group_offs if handoff.rowwise else None
            compute = functools.partial(quantize_weighted_swiglu_backward, h, probs, da, handoff.grad_dtype,
                                        handoff.margin, rows=handoff.need_rows, transposed=handoff.need_transposed,
                                        history=handoff.history, rowwise_offs=offs)
            static = (handoff.grad_dtype, handoff.margin, handoff.need_rows, handoff.need_transposed, handoff.rowwise)
            rows, transposed, scale, dprobs = through_plan(_BACKWARD_REGION, static, (h, probs, da, offs), compute,
                                                           (handoff.history,))
            dh = handoff.give(rows, transposed, scale, like=h)
        elif need_da:
            dh, dprobs = through_plan(_BACKWARD_REGION, (), (h, probs, da),
                                      functools.partial(weighted_swiglu_backward, h, probs, da))
        return dh, dprobs, dw, None, None, None, None, None, None, None, None, None


@torch.compiler.disable
def grouped_gemm_fp8_swiglu(h: torch.Tensor, probs: torch.Tensor, w: torch.Tensor, group_offs: torch.Tensor, *,
                            config: Optional[Float8Config] = None, num_cu: Optional[int] = None,
                            backend: str = "auto", out_dtype: Optional[torch.dtype] = None,
                            w_fp8: Optional[Float8Weight] = None,
                            wgrad_target: Optional[WgradTarget] = None,
                            h_grad_handoff: Optional[QuantizedGradHandoff] = None,
                            delayed_state: Optional[DelayedScalingState] = None) -> torch.Tensor:
    """Differentiable ``y[rows of g] = weighted_swiglu(h, probs)[rows of g] @ w[g]^T``.

    Args:
        h: ``[M, 2F]`` bf16/fp16/fp32 (fc1's output: gate half, then linear half), tokens sorted
            by group; unit column stride.
        probs: ``[M]`` or ``[M, 1]`` routing weights (any float dtype; ``dprobs`` comes back in it).
        w: ``[G, N, F]`` (fc2's weight, ``trans_b=True`` layout).
        group_offs: int64 ``[G+1]`` offsets on h's device, checked (and on a GPU clamped) as
            ``grouped_gemm_fp8`` checks its ``group_offs``.
        config: an FP8 ``Float8Config`` (:func:`swiglu_gemm_supports`); default ``Float8Config()``.
        num_cu, backend, out_dtype, w_fp8, wgrad_target: as ``grouped_gemm_fp8`` and
            ``autograd._grouped_gemm_fp8_resolved``.
        h_grad_handoff: the ``QuantizedGradHandoff`` that the FP8 GEMM producing ``h`` (fc1) was
            given as its ``grad_handoff``: ``dh`` then goes to fc1's backward in FP8 and autograd
            carries a placeholder; only where ``h`` feeds nothing else (see the class). Under the
            fine-grained recipes a ``fine_grained.autograd.GradRowsHandoff`` instead: ``dh`` goes
            to fc1 in h's dtype and its rows copy (fc1's dgrad operand) through the handoff.
        delayed_state: with ``config.strategy="delayed"``, fc2's ``DelayedScalingState``: its
            ``input`` history scales ``a``, its ``grad_output`` history fc2's ``dy`` (``dh`` takes
            fc1's, through ``h_grad_handoff``).
    """
    config = resolve_call_options(config, num_cu, out_dtype, delayed_state)
    if not swiglu_gemm_supports(config):  # resolve_call_options took a Float8Config: today every one passes
        raise ValueError(f"grouped_gemm_fp8_swiglu does not support {config.granularity.value} scaling; "
                         "apply the activation, then grouped_gemm_fp8")
    if h_grad_handoff is not None:
        from .fine_grained.autograd import GradRowsHandoff

        wanted = QuantizedGradHandoff if fuses_swiglu(config) else GradRowsHandoff
        if not isinstance(h_grad_handoff, wanted):
            raise TypeError(f"h_grad_handoff under {'fine-grained ' if config.fine_grained else ''}"
                            f"{config.granularity.value} scaling must be a {wanted.__module__}.{wanted.__name__} "
                            f"(the one fc1 was given), got {type(h_grad_handoff).__name__}")
    for name, t in (("h", h), ("w", w), ("probs", probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if h.dtype not in HIGH_PRECISION_DTYPES or w.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"h and w must be bfloat16, float16 or float32, got {h.dtype} and {w.dtype}")
    if not probs.dtype.is_floating_point:
        raise TypeError(f"probs must be a floating-point tensor, got {probs.dtype}")
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be 2-D [tokens, 2 * F] (gate, then linear half), got shape {tuple(h.shape)}")
    if w.dim() != 3 or w.shape[2] != h.shape[1] // 2:
        raise ValueError(f"w must be [G, N, F] with F = h.shape[1] / 2 = {h.shape[1] // 2}, got {tuple(w.shape)}")
    squeeze = probs.dim() == 2 and probs.shape[1] == 1
    if probs.dim() not in (1, 2) or (probs.dim() == 2 and not squeeze) or probs.shape[0] != h.shape[0]:
        raise ValueError(f"probs must be [M] or [M, 1] with M = {h.shape[0]}, got {tuple(probs.shape)}")
    if h.device != w.device or h.device != probs.device:
        raise ValueError(f"h, probs and w must be on one device, got {h.device}, {probs.device}, {w.device}")
    offs = check_group_offs(group_offs, w.shape[0], h.shape[0], h.device, name="group_offs")
    if h.stride(1) != 1:
        h = h.contiguous()
    p = probs.reshape(-1)
    p = p if p.is_contiguous() else p.contiguous()
    out_dtype = _autocast_out_dtype(h, out_dtype)
    if config.fine_grained:
        from .fine_grained.swiglu import grouped_gemm_fine_swiglu

        return grouped_gemm_fine_swiglu(h, p, w, offs, config=config, num_cu=num_cu, backend=backend, out_dtype=out_dtype,
                                        w_fp8=w_fp8, wgrad_target=wgrad_target, h_grad_rows=h_grad_handoff)
    return GroupedSwiGLUGemmFP8Function.apply(h, p, w, offs, config, num_cu, backend, out_dtype, w_fp8, wgrad_target,
                                              h_grad_handoff, delayed_state)
