"""Autograd helpers of the grouped linear: ``main_grad`` accumulation (Megatron's
``gradient_accumulation_fusion``), the gradient-output stash of high-precision delayed wgrad, and
the invalidation of the FP8 weight caches after optimizer steps."""

from __future__ import annotations

import functools
from typing import Optional

import torch

# Bumped after every optimizer step by invalidate_fp8_weight_cache_on_step: part of the key of the
# grouped linears' FP8 weight caches.
_fp8_weight_generation = [0]
_step_hook_installed = [False]


def fp8_weight_generation() -> int:
    return _fp8_weight_generation[0]


def fp8_weight_generation_is_bumped_on_step() -> bool:
    """Whether ``invalidate_fp8_weight_cache_on_step`` was installed on an optimizer."""
    return _step_hook_installed[0]


def _ddp_managed(weight: torch.Tensor) -> bool:
    """Megatron's DDP (or Megatron-FSDP) gave the parameter a ``main_grad`` (or its getter)."""
    return hasattr(weight, "main_grad") or callable(getattr(weight, "get_main_grad", None))


def fp8_weight_cache_is_safe(weight: torch.Tensor) -> bool:
    """False for a Megatron-DDP parameter (it has ``main_grad``) while no optimizer invalidates
    the caches: its updates would go unseen by the version counter."""
    return _step_hook_installed[0] or not _ddp_managed(weight)


def version_counter_sees_updates(weight: torch.Tensor) -> bool:
    """Whether ``cache_fp8_weight="auto"`` may key the cache on the parameter's version counter
    alone: not Megatron-DDP managed (no ``main_grad``) *and* a single-process run. Across processes
    a parameter may be refilled behind the counter's back without DDP's ``main_grad`` marking it
    (torch FSDP2 all-gathers into the unsharded parameter, ZeRO-style optimizers write flat
    buffers), so there "auto" waits for Megatron's micro-batch flag or the step hook instead."""
    if _ddp_managed(weight):
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def invalidate_fp8_weight_caches() -> None:
    """Mark every cached FP8 weight stale (call after changing weights behind autograd's back)."""
    _fp8_weight_generation[0] += 1


def invalidate_fp8_weight_cache_on_step(optimizer):
    """Make each optimizer step invalidate the FP8 weight caches of
    ``TurboMoEOptions(cache_fp8_weight=True / "auto")`` layers; returns ``optimizer``.

    Needed because Megatron's optimizers update parameters through DDP's flat buffers (the
    parameters are ``.data`` views of them; the distributed optimizer copies its fp32 shards into
    the buffer, then all-gathers it), which the Parameter's version counter does not see.

    Wraps ``step`` and, where present, ``step_with_ready_grads`` -- the method Megatron's
    ``ChainedOptimizer.step`` calls on each optimizer it chains -- of ``optimizer`` and of the
    optimizers it chains, so passing the ``ChainedOptimizer`` that ``get_megatron_optimizer``
    returns or any one of its members both work.
    """
    for opt in (optimizer, *getattr(optimizer, "chained_optimizers", ())):
        for name in ("step", "step_with_ready_grads"):
            _invalidate_after(opt, name)
    _step_hook_installed[0] = True
    return optimizer


def _invalidate_after(optimizer, name: str) -> None:
    method = getattr(optimizer, name, None)
    if method is None or getattr(method, "_turbo_moe_invalidates_fp8_weights", False):
        return

    @functools.wraps(method)
    def then_invalidate(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            invalidate_fp8_weight_caches()

    then_invalidate._turbo_moe_invalidates_fp8_weights = True
    setattr(optimizer, name, then_invalidate)


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


def _main_grad_placeholder(weight: torch.nn.Parameter, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """What autograd hands back as ``weight``'s gradient once it went into ``main_grad``: Megatron's
    placeholder (``grad_added_to_main_grad`` protocol), or None for a parameter without it."""
    if hasattr(weight, "grad_added_to_main_grad"):
        return _dummy_wgrad(weight, dtype, getattr(weight, "zero_out_wgrad", False))
    return None


def _mark_grad_added_to_main_grad(weight: torch.nn.Parameter, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """After the gradient went into ``main_grad``: flag it (``grad_added_to_main_grad``) and return
    the placeholder autograd should hand back as ``weight``'s gradient, or None."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
    return _main_grad_placeholder(weight, dtype)


def _add_into_main_grad(weight: torch.nn.Parameter, wgrad: torch.Tensor) -> Optional[torch.Tensor]:
    """``main_grad += wgrad``; returns what autograd should hand back as ``weight``'s gradient."""
    _main_grad_of(weight).add_(wgrad)
    return _mark_grad_added_to_main_grad(weight, wgrad.dtype)


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
    """Identity on a high-precision GEMM's output whose backward queues a ``DeferredWgrad`` over
    ``(x, dy)`` for the layer's ``backward_dw()`` (delayed wgrad; FP8 layers queue one from their
    GEMM's own backward instead)."""

    @staticmethod
    def forward(ctx, y, x, group_offs, layer, weight):
        # ``weight`` is an input only so that the output requires grad (and this backward runs)
        # even when x does not; its gradient comes from backward_dw(), never from here.
        ctx.layer = layer
        ctx.save_for_backward(x, group_offs)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        from ..autograd import DeferredWgrad

        x, group_offs = ctx.saved_tensors
        layer, ctx.layer = ctx.layer, None
        layer._defer_wgrad(DeferredWgrad(functools.partial(layer._wgrad, x, dy.detach(), group_offs)))
        return dy, None, None, None, None
