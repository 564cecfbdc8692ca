"""``TurboMoEGroupedMLP``: Megatron's ``TEGroupedMLP`` with turbo_moe's grouped linears and the
routing kept on the device."""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from .. import host_plan, planned_layer, planned_mlp
from ..autograd import QuantizedGradHandoff, add_group_bias, group_rows
from ..checks import resolve_group_offs
from ..fine_grained.autograd import GradRowsHandoff
from .linear import TurboColumnParallelGroupedLinear, TurboGroupedLinear, TurboRowParallelGroupedLinear, _as_group_lens
from .options import TurboMoEOptions

__all__ = ["TurboMoEGroupedMLP"]


def _turbo_submodules(options: TurboMoEOptions) -> GroupedMLPSubmodules:
    return GroupedMLPSubmodules(
        linear_fc1=functools.partial(TurboColumnParallelGroupedLinear, options=options),
        linear_fc2=functools.partial(TurboRowParallelGroupedLinear, options=options),
    )


def _unsupported_options(config) -> List[str]:
    """Megatron expert options this forward does not implement (each needs TE or is not wired)."""
    bad = []
    if getattr(config, "use_transformer_engine_op_fuser", False):
        bad.append("use_transformer_engine_op_fuser (TE's fused grouped MLP)")
    if getattr(config, "use_te_activation_func", False):
        bad.append("use_te_activation_func (a TE activation module)")
    offload = set(getattr(config, "offload_modules", None) or ())
    if getattr(config, "fine_grained_activation_offloading", False) and offload & {"expert_fc1", "moe_act", "fused_group_mlp"}:
        bad.append("fine_grained_activation_offloading of expert_fc1/moe_act/fused_group_mlp")
    if getattr(config, "moe_paged_stash", False):
        bad.append("moe_paged_stash")
    return bad


class TurboMoEGroupedMLP(planned_layer.KeepsPlannedLayers, TEGroupedMLP):
    """Megatron's grouped experts on turbo_moe kernels, with ``tokens_per_expert`` kept on the device.

    Same constructor, parameters, checkpoint layout (``sharded_state_dict`` is inherited from
    ``TEGroupedMLP``) and ``backward_dw`` as ``TEGroupedMLP``. Differences: no ``.tolist()`` of
    the routing (the offsets are computed on the device once and shared by fc1, fc2 and the bias),
    and no FP8 padding of each expert's tokens (turbo_moe's kernels take any token count). With
    FP8 tensorwise or rowwise SwiGLU experts, fc2 computes the routing-weighted activation inside
    its FP8 quantization (``_fuses_activation``, ``turbo_moe.swiglu``): no high-precision activation.
    """

    def __init__(self, num_local_experts: int, config, submodules: Optional[GroupedMLPSubmodules] = None,
                 pg_collection=None, name: Optional[str] = None, options: Optional[TurboMoEOptions] = None):
        bad = _unsupported_options(config)
        if bad:
            raise NotImplementedError("TurboMoEGroupedMLP does not support: " + "; ".join(bad))
        if submodules is None:
            submodules = _turbo_submodules(options or TurboMoEOptions())
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        # call signature -> ((recipe, num_cu, backend, plans' generation), PlannedMLP or NOT_PLANNABLE)
        self._planned = {}

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, output_buffer=None, grad_input_buffer=None):
        """``(output, None)`` for tokens sorted by local expert; see ``TEGroupedMLP.forward``."""
        if output_buffer is not None or grad_input_buffer is not None:
            raise NotImplementedError("output_buffer/grad_input_buffer (NCCL-EP zero copy) are TE op-fuser features")
        x = permuted_local_hidden_states
        num_tokens = x.shape[0]
        lens = _as_group_lens(tokens_per_expert, self.num_local_experts, x.device)
        if type(x) is torch.Tensor and x.is_cuda and planned_layer.enabled() and not torch.compiler.is_compiling():
            output = self._forward_planned(x, lens, permuted_probs)
            if output is not None:
                return output, None
        offs = resolve_group_offs(lens, None, self.num_local_experts, num_tokens, x.device)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            x = (probs * x).to(permuted_local_hidden_states.dtype)
            probs = torch.ones_like(probs)
        fuses_activation = self._fuses_activation()
        # The handoff also carries the routing weights to fc1, whose epilogue can then reduce the
        # activation's amax for fc2's cast (tensorwise, on the ping-pong; turbo_moe.autograd).
        # Under the fine-grained recipes, fc2's backward leaves dh's rows copy for fc1's dgrad instead.
        handoff = None
        if fuses_activation and self._hands_off_dh():
            handoff = QuantizedGradHandoff(swiglu_probs=probs.reshape(-1))
        elif fuses_activation and isinstance(self.linear_fc1, TurboGroupedLinear) and self.linear_fc1.takes_grad_rows():
            handoff = GradRowsHandoff()
        fc1_kwargs = {} if handoff is None else {"grad_handoff": handoff}  # a custom fc1 may not take it
        fc1_output, fc1_bias = self.linear_fc1(x, group_offs=offs, **fc1_kwargs)
        if fc1_bias is not None:  # a fc1 built with skip_bias_add=True by a custom spec
            fc1_output = add_group_bias(fc1_output, fc1_bias, offs)
        if fuses_activation:
            # The FP8 fc2 computes the weighted SwiGLU inside its input quantization: the
            # activation is never materialized in high precision (turbo_moe.swiglu). With the
            # handoff its backward also writes dh straight into fc1's FP8 layouts.
            output, fc2_bias = self.linear_fc2(fc1_output, group_offs=offs, swiglu_probs=probs, grad_handoff=handoff)
        elif self.activation_recompute:  # recompute_modules=['moe_act'], set by TEGroupedMLP.__init__
            # Megatron's own mechanism: the activation runs without saving its intermediates, its
            # output storage is freed once fc2 has consumed it, and fc2's output-gradient hook
            # recomputes it (from fc1's output and the probs) before fc2's and its own backward.
            from megatron.core import tensor_parallel

            # fp8=None: no TE FP8 autocast state to restore (its default False means "TE FP8 on").
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
            intermediate = self.activation_checkpoint.checkpoint(self._activation, fc1_output, probs)
            output, fc2_bias = self.linear_fc2(intermediate, group_offs=offs)
            self.activation_checkpoint.discard_output_and_register_recompute(output)
        else:
            intermediate = self._activation(fc1_output, probs)
            output, fc2_bias = self.linear_fc2(intermediate, group_offs=offs)
        if fc2_bias is not None:
            # Megatron weights the fc2 bias by the routing probability, like the rest of the output.
            bias_rows = group_rows(fc2_bias, offs, num_tokens)
            output = (output + bias_rows * probs).to(output.dtype)
        return output, None

    def _forward_planned(self, x: torch.Tensor, lens: torch.Tensor, probs: torch.Tensor) -> Optional[torch.Tensor]:
        """The experts' forward as one C++ call with a C++ backward node (``turbo_moe.planned_mlp``):
        the offsets, fc1, the fused SwiGLU + fc2 and, in backward, the dh handoff and both wgrads
        (into ``main_grad`` under ``gradient_accumulation_fusion``). None: the Python path (a
        signature whose plans are not all recorded yet, or one the planned MLP does not serve).
        What the linears' forwards do besides their GEMMs is done here too: the micro-batch flags
        of their FP8 weight caches, and ``grad_added_to_main_grad`` (set at forward, as Megatron's
        own CUDA-graphed layers set it, since no Python runs in this backward)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        cfg = self.config
        if not (isinstance(fc1, TurboGroupedLinear) and isinstance(fc2, TurboGroupedLinear)) \
                or cfg.moe_apply_probs_on_input or fc1.bias is not None or fc2.bias is not None \
                or fc1.delay_wgrad_compute or fc2.delay_wgrad_compute or fc1.fp8_config != fc2.fp8_config \
                or not self._fuses_activation() or not (self._hands_off_dh() or fc1.takes_grad_rows()):
            return None
        if probs.dim() != 1 or not probs.is_contiguous() or probs.shape[0] != x.shape[0] or x.dim() != 2:
            return None
        grad = torch.is_grad_enabled()
        targets = []
        for linear in (fc1, fc2):
            target = linear._planned_wgrad_target(grad and linear.weight.requires_grad and linear._fuses_main_grad())
            if target is None or not planned_layer.histories_ready(linear.fp8_delayed, x, grad):
                return None
            targets.append(target)
        out_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        out1 = x.dtype if out_dtype is None else out_dtype
        out2 = out1 if out_dtype is None else out_dtype
        w1, w2 = fc1.weight, fc2.weight
        caching = (fc1._uses_fp8_weight_cache(), fc2._uses_fp8_weight_cache())
        key = (host_plan.fact(x), host_plan.fact(w1), host_plan.fact(w2), host_plan.fact(probs), host_plan.fact(lens),
               *caching, *(host_plan.fact(main_grad) for main_grad, _ in targets),
               *(placeholder is not None for _, placeholder in targets),
               x.requires_grad, w1.requires_grad, w2.requires_grad, probs.requires_grad, out1, out2, grad)
        static = (fc1.fp8_config, fc1.num_cu, fc1.options.backend, fc2.num_cu, fc2.options.backend,
                  host_plan.generation())
        if planned_layer.known_unplannable(self._planned, key, static):
            return None  # before any side effect: the Python path runs the linears as always
        for linear in (fc1, fc2):  # as TurboGroupedLinear.forward, before the cache lookup
            linear._note_first_microbatch_flag()
        sides = tuple(planned_mlp.MLPSide(fc.num_cu, fc.options.backend, fc._cached_fp8_weight() if cached else None,
                                          fc.fp8_delayed, main_grad, placeholder)
                      for fc, cached, (main_grad, placeholder) in zip((fc1, fc2), caching, targets))
        layer = planned_layer.cached_plan(self._planned, key, static, lambda: planned_mlp.plan_mlp(
            x, w1, w2, probs, lens, True, sides[0], sides[1], fc1.fp8_config, out1, out2, forward_only=not grad))
        if layer is None:
            return None
        output = planned_mlp.apply_mlp(layer, x, w1, w2, probs, lens, sides[0], sides[1])
        for linear, side in zip((fc1, fc2), sides):  # as each linear's planned forward
            linear._mark_planned_wgrad(side.placeholder)
            linear._clear_first_microbatch_flag()
        return output

    def _fuses_activation(self) -> bool:
        """Whether fc2 takes fc1's output and fuses the activation into its FP8 quantization:
        SwiGLU with nothing around it (no clamp, offset, interleaving), an FP8 fc2 (any recipe:
        the fine-grained ones through ``turbo_moe.fine_grained.swiglu``), and no activation
        option the fused path would ignore (recompute, FP8 input store: there the activation runs
        unfused, as configured)."""
        fc2 = self.linear_fc2
        cfg = self.config
        return (isinstance(fc2, TurboGroupedLinear) and fc2.fuses_swiglu_input()
                and cfg.gated_linear_unit and self.activation_func == F.silu
                and cfg.moe_mlp_glu_interleave_size is None and cfg.activation_func_clamp_value is None
                and not getattr(cfg, "glu_linear_offset", 0.0)
                and not self.activation_recompute and not cfg.activation_func_fp8_input_store)

    def _hands_off_dh(self) -> bool:
        """Whether the fused fc2's backward can hand ``dh`` to fc1's in FP8
        (``autograd.QuantizedGradHandoff``): fc1 is FP8 per-tensor and its output reaches fc2
        directly (no bias, added by fc1 or here)."""
        fc1 = self.linear_fc1
        return isinstance(fc1, TurboGroupedLinear) and fc1.hands_off_output_grad() and fc1.bias is None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """TEGroupedMLP's activation (all of its non-TE branches), weighted by the routing probs."""
        from megatron.core.activations import squared_relu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu, weighted_bias_quick_geglu_impl
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
        from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl

        cfg = self.config
        glu_interleave = cfg.gated_linear_unit and cfg.moe_mlp_glu_interleave_size is not None
        if cfg.bias_activation_fusion and not glu_interleave:
            if self.activation_func == F.silu and cfg.gated_linear_unit:
                return weighted_bias_swiglu_impl(h, None, probs, cfg.activation_func_fp8_input_store)
            if self.activation_func == quick_gelu and cfg.gated_linear_unit:
                return weighted_bias_quick_geglu_impl(h, None, probs, cfg.activation_func_fp8_input_store,
                                                      cfg.glu_linear_offset, cfg.activation_func_clamp_value)
            raise ValueError("bias_activation_fusion supports only swiglu and quick_geglu in grouped experts")
        if self.activation_func == squared_relu and cfg.use_fused_weighted_squared_relu:
            return weighted_squared_relu_impl(h, probs)
        if cfg.gated_linear_unit:
            if glu_interleave:
                h = self._remove_glu_interleaving(h, cfg.moe_mlp_glu_interleave_size)
            gate, linear = torch.chunk(h, 2, dim=-1)
            clamp = cfg.activation_func_clamp_value
            if clamp is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            h = cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)
        else:
            h = self.activation_func(h)
        return (h * probs).to(h.dtype)

