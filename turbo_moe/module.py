"""``GroupedLinearFP8``: the expert MLP linear of an MoE layer, one weight matrix per expert."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import host_plan, planned_layer
from .autograd import _grouped_gemm_fp8_resolved, add_group_bias, quantize_weight
from .checks import check_operands, resolve_group_offs
from .config import Float8Config
from .delayed_scaling import delayed_state_for, restore_delayed_state

__all__ = ["GroupedLinearFP8"]


class GroupedLinearFP8(nn.Module):
    """``y[rows of g] = x[rows of g] @ weight[g]^T (+ bias[g])`` with FP8 grouped GEMMs.

    Args:
        num_groups: number of experts G.
        in_features / out_features: K and N of every expert.
        bias: add a per-expert bias ``[G, out_features]`` (kept in high precision).
        config: the FP8 recipe (``Float8Config``; default e4m3, tensorwise, current scaling). With
            ``strategy="delayed"`` the layer keeps the amax histories of its input and output
            gradient (``fp8_delayed``, a ``DelayedScalingState``; ``turbo_moe.delayed_scaling``).
        num_cu: cap on the SMs/CUs the kernels occupy, or None for all.
        backend: ``"auto"``, ``"flydsl"``, ``"triton"`` or ``"torch"``.
        cache_fp8_weight: (default True) keep the FP8 copies of the weight between calls and
            re-quantize only when the weight changed (its version counter or storage moved:
            ``optimizer.step()``, ``load_state_dict``, any in-place op on the Parameter). Under
            gradient accumulation the weight is then quantized once per optimizer step instead of
            once per micro-batch, which is what a trainer wants: the quantization of a large expert
            weight otherwise dominates the step at many experts. The price is ~2 bytes per weight
            element kept alive between calls (the forward copy and dgrad's transposed copy: as much
            as the bf16 weight itself). Updates made through ``weight.data`` (or into a flat
            buffer the parameter views, as ZeRO-style optimizers do) bypass the version counter:
            call :meth:`invalidate_fp8_weight_cache` after them, or pass False. Never used while a
            CUDA graph is being captured (the graph re-quantizes on every replay).

    ``weight`` is ``[G, out_features, in_features]``, each expert initialised as ``nn.Linear``
    would initialise it. ``forward(x, group_lens)`` takes tokens already sorted by expert and an
    int64 ``[G]`` tensor of tokens per expert on x's device (or ``group_offs=`` ``[G+1]``).
    Under ``torch.autocast`` the output takes the autocast dtype (as ``nn.Linear``; the FP8 math is
    the same, see ``grouped_gemm_fp8``'s ``out_dtype``).
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        config: Optional[Float8Config] = None,
        num_cu: Optional[int] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
        cache_fp8_weight: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if config is not None and not isinstance(config, Float8Config):
            raise TypeError(f"config must be a turbo_moe.Float8Config, got {type(config).__name__}")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.config = config if config is not None else Float8Config()
        self.num_cu = num_cu
        self.backend = backend
        self.cache_fp8_weight = bool(cache_fp8_weight)
        self._fp8_weight_cache = None  # (key, Float8Weight)
        # call signature -> ((config, num_cu, backend, plans' generation), PlannedLayer or NOT_PLANNABLE)
        self._planned_layers = {}
        self.fp8_delayed = delayed_state_for(self.config)
        self.register_state_dict_post_hook(GroupedLinearFP8._save_delayed_histories)
        self.register_load_state_dict_pre_hook(GroupedLinearFP8._load_delayed_histories)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init per expert: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for g in range(self.num_groups):
                nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
            if self.bias is not None:
                nn.init.uniform_(self.bias, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        group_lens: Optional[torch.Tensor] = None,
        *,
        group_offs: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if type(x) is torch.Tensor and x.is_cuda and planned_layer.enabled() and not torch.compiler.is_compiling():
            y, offs = self._forward_planned(x, group_lens, group_offs)
            if y is not None:
                return y
            if offs is not None:  # checked and resolved there
                return self._forward_python(x, offs)
        check_operands(x, self.weight, trans_b=True)  # first: every error names the argument
        # Resolve the offsets once: the GEMM and the bias gather share them.
        return self._forward_python(x, resolve_group_offs(group_lens, group_offs, self.num_groups, x.shape[0],
                                                          x.device))

    def _forward_python(self, x, offs):
        y = _grouped_gemm_fp8_resolved(
            x,
            self.weight,
            offs,
            w_fp8=self._cached_fp8_weight() if self.cache_fp8_weight else None,
            config=self.config,
            num_cu=self.num_cu,
            backend=self.backend,
            delayed_state=self.fp8_delayed,
        )
        if self.bias is not None:
            y = add_group_bias(y, self.bias, offs)
        return y

    def _forward_planned(self, x, group_lens, group_offs):
        """The forward as one C++ call with a C++ backward node (``turbo_moe.planned_layer``) once this
        call signature's host plans all exist. Returns ``(y, offs)``: y None means the Python path,
        with the offsets resolved here if offs is not None. A signature is everything the Python
        path's checks and launches derive from (the inputs' facts, grad requirements, the output
        dtype, the recipe), so a hit skips the checks: they passed for this signature before, and
        the offsets' values are checked on the device as always."""
        w = self.weight
        lens_given = group_offs is None
        src = group_lens if lens_given else group_offs
        if not isinstance(src, torch.Tensor) or (group_lens is not None and group_offs is not None):
            return None, None
        delayed = self.fp8_delayed
        grad = torch.is_grad_enabled()
        if not planned_layer.histories_ready(delayed, x, grad):
            return None, None
        w_fp8 = self._fp8_weight_now() if self.cache_fp8_weight else None  # not compiling: no wrapper needed
        out_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype  # as F.linear
        offsets_step = lens_given and self.bias is None  # else the offsets are needed here too (bias)
        offs = None
        if not offsets_step:
            check_operands(x, w, trans_b=True)
            offs = src = resolve_group_offs(group_lens, group_offs, self.num_groups, x.shape[0], x.device)
        # requires_grad whatever the grad mode: the Python Function's needs_input_grad, which decides
        # what its forward makes for backward, does not look at the grad mode either.
        key = (offsets_step, host_plan.fact(x), host_plan.fact(w), host_plan.fact(src), w_fp8 is None,
               x.requires_grad, w.requires_grad, out_dtype, grad)
        static = (self.config, self.num_cu, self.backend, host_plan.generation())
        layer = planned_layer.cached_plan(self._planned_layers, key, static, lambda: planned_layer.plan_layer(
            x, w, src, offsets_step, w_fp8, self.config, self.num_cu, self.backend, out_dtype, key[5], key[6],
            forward_only=not grad, delayed=delayed))
        if layer is None:
            return None, offs
        y = planned_layer.apply_layer(layer, x, w, src, w_fp8, delayed)
        if self.bias is not None:
            y = add_group_bias(y, self.bias, offs)
        return y, offs

    # Delayed scaling's amax histories travel in the state dict as ``_extra_state`` (only then: a
    # current-scaling layer's state dict is just its parameters), so that a resumed run casts with
    # the scales the interrupted one would have used (turbo_moe.delayed_scaling). Hooks rather than
    # get/set_extra_state, which would put the key in every layer's state dict.
    @staticmethod
    def _save_delayed_histories(module, state_dict, prefix, local_metadata) -> None:
        if module.fp8_delayed is not None:
            state_dict[prefix + "_extra_state"] = module.fp8_delayed.state_dict()

    @staticmethod
    def _load_delayed_histories(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                error_msgs) -> None:
        # No saved histories (a checkpoint from current scaling or from before they were saved):
        # the next casts seed afresh.
        saved = state_dict.pop(prefix + "_extra_state", None)
        if not restore_delayed_state(module.fp8_delayed, saved, type(module).__name__):
            error_msgs.append(f"{prefix}_extra_state: expected a saved delayed-scaling state "
                              f"(DelayedScalingState.state_dict()) or None, got {type(saved).__name__}")

    def __getstate__(self):
        # The FP8 cache is derived data keyed on storage addresses and version counters, which mean
        # nothing in another process or copy (and FP8 tensors inside a tuple do not unpickle):
        # pickle, deepcopy and torch.save leave it out, and the first forward rebuilds it.
        state = super().__getstate__()  # a copy of __dict__
        state["_fp8_weight_cache"] = None
        state["_planned_layers"] = {}  # extension ids of this process
        return state

    def __setstate__(self, state):
        state.setdefault("_planned_layers", {})  # pickled before planned layers
        super().__setstate__(state)

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the cached FP8 weight (after changing ``weight.data`` behind autograd's back)."""
        self._fp8_weight_cache = None

    @torch.compiler.disable
    def _cached_fp8_weight(self):
        return self._fp8_weight_now()

    def _fp8_weight_now(self):
        w = self.weight
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # the quantization must be part of the captured graph
        key = (w._version, w.data_ptr(), w.dtype, w.device, self.config)
        if self._fp8_weight_cache is None or self._fp8_weight_cache[0] != key:
            self._fp8_weight_cache = None  # release the stale copies before making new ones
            with torch.no_grad():
                self._fp8_weight_cache = (key, quantize_weight(w.detach(), self.config, transposed=True))
        return self._fp8_weight_cache[1]

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={cfg.format.value}, granularity={cfg.granularity.value}, "
            + (f"strategy=delayed(history={cfg.amax_history_len}, {cfg.amax_compute_algo}), " if cfg.delayed else "")
            + f"num_cu={self.num_cu}, backend={self.backend!r}"
            + (", cache_fp8_weight=True" if self.cache_fp8_weight else "")
        )
