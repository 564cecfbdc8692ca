"""Autograd helpers of the grouped linear: ``main_grad`` accumulation (Megatron's
``gradient_accumulation_fusion``) and the gradient-output stash of delayed wgrad."""

from __future__ import annotations

from typing import Optional

import torch

_dummy_wgrads: dict = {}


def _dummy_wgrad(weight: torch.Tensor, dtype: torch.dtype, zero: bool) -> torch.Tensor:
    """A placeholder ``weight.grad`` once the real gradient went into ``main_grad``.

    Megatron's DDP wants a non-None grad to run its hooks on the main thread, then drops it
    (``grad_added_to_main_grad``). One buffer per shape is reused, as Transformer Engine does.
    """
    key = (tuple(weight.shape), dtype, weight.device)
    buf = _dummy_wgrads.get(key)
    if buf is None:
        buf = torch.empty(weight.shape, dtype=dtype, device=weight.device)
        _dummy_wgrads[key] = buf
    if zero:
        buf.zero_()
    return buf


def _main_grad_of(weight: torch.nn.Parameter) -> Optional[torch.Tensor]:
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None and callable(getattr(weight, "get_main_grad", None)):
        main_grad = weight.get_main_grad()  # Megatron-FSDP allocates it lazily
        weight.main_grad = main_grad
    return main_grad


def _add_into_main_grad(weight: torch.nn.Parameter, wgrad: torch.Tensor) -> Optional[torch.Tensor]:
    """``main_grad += wgrad``; returns what autograd should hand back as ``weight``'s gradient."""
    _main_grad_of(weight).add_(wgrad)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return _dummy_wgrad(weight, wgrad.dtype, getattr(weight, "zero_out_wgrad", False))
    return None


class _AccumulateWgradIntoMainGrad(torch.autograd.Function):
    """Identity on the weight whose backward adds the weight gradient into ``weight.main_grad``.

    Megatron's ``gradient_accumulation_fusion``: the gradient goes to the fp32 ``main_grad``
    buffer of its DDP instead of ``weight.grad``.
    """

    @staticmethod
    def forward(ctx, weight):
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, wgrad):
        weight = ctx.weight
        ctx.weight = None
        return _add_into_main_grad(weight, wgrad)


class _StashGradOutputForWgrad(torch.autograd.Function):
    """Identity on the GEMM output whose backward queues ``(x, dy)`` for ``backward_dw()``."""

    @staticmethod
    def forward(ctx, y, x, group_offs, layer, weight):
        # ``weight`` is an input only so that the output requires grad (and this backward runs)
        # even when x does not; its gradient comes from backward_dw(), never from here.
        ctx.layer = layer
        ctx.save_for_backward(x, group_offs)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, group_offs = ctx.saved_tensors
        ctx.layer._pending_wgrads.append((x, dy.detach(), group_offs))
        ctx.layer = None
        return dy, None, None, None, None

