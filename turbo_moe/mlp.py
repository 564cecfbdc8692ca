"""``GroupedSwiGLUMLPFP8``: an MoE layer's SwiGLU experts (fc1, the routing-weighted SwiGLU, fc2).

A thin module over the pieces the Megatron adapter uses, for training loops without Megatron: two
:class:`~turbo_moe.GroupedLinearFP8` children hold the weights (and their FP8 weight caches), and
with a per-tensor recipe the forward is fc1's FP8 GEMM followed by
:func:`~turbo_moe.swiglu.grouped_gemm_fp8_swiglu` (the activation inside fc2's FP8 quantization,
never materialized in high precision), with fc1's output gradient handed over in FP8
(:class:`~turbo_moe.autograd.QuantizedGradHandoff`). Other recipes run fc1, the activation in
float32 (rounded to fc1's output dtype), then fc2.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import host_plan, planned_layer, planned_mlp
from .autograd import QuantizedGradHandoff, _grouped_gemm_fp8_resolved
from .checks import check_operands, resolve_group_offs
from .config import Float8Config
from .fine_grained.autograd import GradRowsHandoff
from .module import GroupedLinearFP8
from .swiglu import fuses_swiglu, grouped_gemm_fp8_swiglu, swiglu_gemm_supports, weighted_swiglu

__all__ = ["GroupedSwiGLUMLPFP8"]


class GroupedSwiGLUMLPFP8(planned_layer.KeepsPlannedLayers, nn.Module):
    """``y[rows of g] = (silu(h[:, :F]) * h[:, F:] * probs) @ fc2.weight[g]^T`` with
    ``h = x[rows of g] @ fc1.weight[g]^T``, every GEMM in FP8.

    Args:
        num_groups: number of experts G.
        hidden: the tokens' width (fc1's input, fc2's output).
        ffn: each expert's FFN width F (fc1 makes ``2 * F``: the gate half, then the linear half).
        config, num_cu, backend, device, dtype, cache_fp8_weight: as :class:`GroupedLinearFP8`,
            for both linears.

    ``forward(x, group_lens, probs=None)``: ``x [M, hidden]`` tokens sorted by expert, int64
    ``group_lens [G]`` on x's device (or ``group_offs=`` ``[G+1]``), ``probs`` ``[M]`` or
    ``[M, 1]`` routing weights applied inside the activation (Megatron's ``moe_apply_probs_on_input=False``
    placement; None: unweighted). The gradient of ``probs`` is computed when it requires one.
    """

    def __init__(self, num_groups: int, hidden: int, ffn: int, config: Optional[Float8Config] = None,
                 num_cu: Optional[int] = None, backend: str = "auto", device=None, dtype=None,
                 cache_fp8_weight: bool = True) -> None:
        super().__init__()
        common = dict(config=config, num_cu=num_cu, backend=backend, device=device, dtype=dtype,
                      cache_fp8_weight=cache_fp8_weight)
        self.fc1 = GroupedLinearFP8(num_groups, hidden, 2 * ffn, **common)
        self.fc2 = GroupedLinearFP8(num_groups, ffn, hidden, **common)
        # call signature -> ((config, num_cu, backend, plans' generation), PlannedMLP or NOT_PLANNABLE)
        self._planned = {}
        self._ones = None  # the unweighted call's routing weights, kept per token count

    @property
    def config(self) -> Float8Config:
        return self.fc1.config

    def forward(self, x: torch.Tensor, group_lens: Optional[torch.Tensor] = None, *,
                group_offs: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        if type(x) is torch.Tensor and x.is_cuda and planned_layer.enabled() and swiglu_gemm_supports(self.config) \
                and fc1.bias is None and fc2.bias is None and not torch.compiler.is_compiling():
            y = self._forward_planned(x, group_lens, group_offs, self._unit_probs(x) if probs is None else probs)
            if y is not None:
                return y
        check_operands(x, fc1.weight, trans_b=True)  # first: every error names the argument
        offs = resolve_group_offs(group_lens, group_offs, fc1.num_groups, x.shape[0], x.device)
        if probs is None:
            probs = self._unit_probs(x)
        if not swiglu_gemm_supports(self.config):
            h = fc1(x, group_offs=offs)
            weights = probs.reshape(-1) if probs.dim() == 2 and probs.shape[1] == 1 else probs
            if weights.dim() != 1 or weights.shape[0] != x.shape[0]:
                raise ValueError(f"probs must be [M] or [M, 1] with M = {x.shape[0]}, got {tuple(probs.shape)}")
            return fc2(weighted_swiglu(h, weights).to(h.dtype), group_offs=offs)
        # fc1's output feeds the fused fc2 alone: its gradient can come back in FP8, and (tensorwise,
        # on the ping-pong) fc1's epilogue can reduce the activation's amax for fc2's cast. Under the
        # fine-grained recipes dh goes to fc1 in h's dtype, its rows copy through the handoff.
        handoff = QuantizedGradHandoff(swiglu_probs=probs.reshape(-1)) if fuses_swiglu(self.config) else GradRowsHandoff()
        h = _grouped_gemm_fp8_resolved(
            x, fc1.weight, offs, config=self.config, num_cu=fc1.num_cu, backend=fc1.backend,
            w_fp8=fc1._cached_fp8_weight() if fc1.cache_fp8_weight else None, grad_handoff=handoff,
            delayed_state=fc1.fp8_delayed)
        return grouped_gemm_fp8_swiglu(
            h, probs, fc2.weight, offs, config=self.config, num_cu=fc2.num_cu, backend=fc2.backend,
            w_fp8=fc2._cached_fp8_weight() if fc2.cache_fp8_weight else None, h_grad_handoff=handoff,
            delayed_state=fc2.fp8_delayed)

    def _unit_probs(self, x: torch.Tensor) -> torch.Tensor:
        """The routing weights of an unweighted call (ones), kept across calls of one token count."""
        ones = self._ones
        if ones is None or ones.shape[0] != x.shape[0] or ones.device != x.device:
            ones = self._ones = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
        return ones

    def _forward_planned(self, x, group_lens, group_offs, probs) -> Optional[torch.Tensor]:
        """The forward as one C++ call with a C++ backward node (``turbo_moe.planned_mlp``) once this
        call signature's host plans all exist; None: the Python path. As
        ``GroupedLinearFP8._forward_planned``, a hit skips the checks: the signature passed them."""
        fc1, fc2 = self.fc1, self.fc2
        w1, w2 = fc1.weight, fc2.weight
        lens_given = group_offs is None
        src = group_lens if lens_given else group_offs
        if not isinstance(src, torch.Tensor) or (group_lens is not None and group_offs is not None) \
                or not isinstance(probs, torch.Tensor):
            return None
        grad = torch.is_grad_enabled()
        if not all(planned_layer.histories_ready(fc.fp8_delayed, x, grad) for fc in (fc1, fc2)):
            return None
        p = probs.reshape(-1) if probs.dim() == 2 and probs.shape[1] == 1 else probs
        if p.dim() != 1 or not p.is_contiguous():
            return None
        out_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        out1 = x.dtype if out_dtype is None else out_dtype
        out2 = out1 if out_dtype is None else out_dtype  # the SwiGLU + fc2 output follows h's dtype
        sides = tuple(planned_mlp.MLPSide(fc.num_cu, fc.backend, fc._fp8_weight_now() if fc.cache_fp8_weight else None,
                                          fc.fp8_delayed, None, None) for fc in (fc1, fc2))
        if not lens_given:
            check_operands(x, w1, trans_b=True)
            src = resolve_group_offs(None, group_offs, fc1.num_groups, x.shape[0], x.device)
        key = (lens_given, host_plan.fact(x), host_plan.fact(w1), host_plan.fact(w2), host_plan.fact(p),
               host_plan.fact(src), sides[0].w_fp8 is None, sides[1].w_fp8 is None, x.requires_grad,
               w1.requires_grad, w2.requires_grad, p.requires_grad, out1, out2, grad)
        static = (self.config, fc1.num_cu, fc1.backend, fc2.num_cu, fc2.backend, host_plan.generation())
        layer = planned_layer.cached_plan(self._planned, key, static, lambda: planned_mlp.plan_mlp(
            x, w1, w2, p, src, lens_given, sides[0], sides[1], self.config, out1, out2, forward_only=not grad))
        if layer is None:
            return None
        return planned_mlp.apply_mlp(layer, x, w1, w2, p, src, sides[0], sides[1])

    def __setstate__(self, state):
        state.setdefault("_ones", None)  # pickled before it kept the unit routing weights
        super().__setstate__(state)

    def extra_repr(self) -> str:
        return f"fused_swiglu={swiglu_gemm_supports(self.config)}"
