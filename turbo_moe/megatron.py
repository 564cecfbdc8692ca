"""Megatron-core drop-in: turbo_moe grouped GEMMs as the expert MLPs of a Megatron ``MoELayer``.

Needs megatron-core >= 0.19.2 (the ``[megatron]`` extra); ``import turbo_moe`` never imports this
module. The one line a user changes::

    from turbo_moe.megatron import use_turbo_moe_experts
    layer_spec = use_turbo_moe_experts(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True),
                                       fp8="hybrid")

(or ``get_turbo_moe_module_spec(...)`` for the ``MoELayer`` builder alone).

What is here:

* :class:`TurboGroupedLinear` (and its column/row-parallel flavours) -- the grouped linear that
  Megatron's ``GroupedMLPSubmodules`` builds for ``linear_fc1`` / ``linear_fc2``, with the
  constructor and ``forward(x, m_splits) -> (out, bias)`` of Transformer Engine's
  ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``. It keeps one
  ``weight`` Parameter ``[E_local, out, in]`` (the storage the kernels read) and presents it to
  checkpoints the way Megatron names per-expert weights (``weight{i}`` in ``state_dict``; a
  ``...experts.linear_fc1.weight`` ShardedTensor of global shape ``[E, out, in]`` in
  ``sharded_state_dict``).
* :class:`TurboMoEGroupedMLP` -- a ``TEGroupedMLP`` subclass whose forward keeps
  ``tokens_per_expert`` on the device (Megatron's calls ``.tolist()``, a host sync), so the expert
  computation can be captured in a CUDA graph with a kernel backend.
* spec helpers: :func:`get_turbo_moe_experts_spec`, :func:`get_turbo_moe_module_spec`,
  :func:`use_turbo_moe_experts`.

FP8 is turbo_moe's own switch (``fp8=`` on the helpers): Megatron's ``config.fp8`` refuses MoE
without Transformer Engine. ``fp8="megatron"`` (the default) follows ``config.fp8`` when it is set
(``"e4m3"`` / ``"hybrid"``), so TE users keep their setting; ``None`` runs the high-precision
``turbo_moe.grouped_gemm``; ``"e4m3"`` / ``"hybrid"`` or a :class:`turbo_moe.Float8Config` turn
FP8 on explicitly. See docs/megatron.md for the checkpoint layout and the trade-offs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F

try:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
    from megatron.core.utils import get_pg_rank, get_pg_size
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "turbo_moe.megatron needs megatron-core >= 0.19.2 (pip install 'turbo_moe[megatron]'; on Python "
        "3.11: pip install --no-deps --ignore-requires-python megatron-core==0.19.2 numpy packaging)"
    ) from exc

from .autograd import _grouped_gemm_fp8_resolved, _grouped_wgrad_fp8_resolved, add_group_bias, group_rows, grouped_gemm
from .checks import resolve_group_offs
from .config import Float8Config, ScalingGranularity

__all__ = [
    "TurboMoEOptions",
    "resolve_fp8_config",
    "TurboGroupedLinear",
    "TurboColumnParallelGroupedLinear",
    "TurboRowParallelGroupedLinear",
    "TurboMoEGroupedMLP",
    "get_turbo_moe_experts_spec",
    "get_turbo_moe_module_spec",
    "use_turbo_moe_experts",
]

Fp8Setting = Union[None, str, Float8Config]


# --------------------------------------------------------------------------------------------
# Options and the FP8 switch
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TurboMoEOptions:
    """turbo_moe's own settings for Megatron experts (Megatron's config carries everything else).

    ``fp8``: ``"megatron"`` (follow ``config.fp8``; off when it is None), ``None`` (high precision),
    ``"e4m3"``, ``"hybrid"`` or a ``Float8Config``. ``granularity``: ``"tensorwise"`` or
    ``"rowwise"`` when ``fp8`` is a format name (``None``: derived from ``config.fp8_recipe`` under
    ``"megatron"``, else tensorwise). ``backend``: ``"auto"``, ``"triton"``, ``"flydsl"``,
    ``"torch"``. ``num_cu``: cap on the SMs/CUs the FP8 kernels occupy.
    """

    fp8: Fp8Setting = "megatron"
    granularity: Optional[str] = None
    backend: str = "auto"
    num_cu: Optional[int] = None

    def __post_init__(self) -> None:
        if not (self.fp8 is None or isinstance(self.fp8, (str, Float8Config))):
            raise TypeError(f"fp8 must be None, 'megatron', 'e4m3', 'hybrid' or a Float8Config, got {self.fp8!r}")
        if isinstance(self.fp8, str) and self.fp8 not in ("megatron", "e4m3", "hybrid"):
            raise ValueError(f"fp8={self.fp8!r} is not one of None, 'megatron', 'e4m3', 'hybrid' (or a Float8Config)")
        if self.granularity is not None:
            allowed = [g.value for g in ScalingGranularity]
            if _enum_value(self.granularity) not in allowed:
                raise ValueError(f"granularity={self.granularity!r} is not one of None, {allowed}")
            if isinstance(self.fp8, Float8Config):
                raise ValueError("granularity must be None when fp8 is a Float8Config (set it in the Float8Config)")
        if self.num_cu is not None and (isinstance(self.num_cu, bool) or not isinstance(self.num_cu, int) or self.num_cu < 1):
            raise ValueError(f"num_cu must be None or a positive int, got {self.num_cu!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a string, got {type(self.backend).__name__}")


# Megatron's fp8_recipe -> the closest turbo_moe granularity. turbo_moe scales with the current
# amax (no history), so Megatron's "delayed" recipe maps to current tensorwise scaling; MXFP8 and
# blockwise (1x32 / 128x128 blocks) map to rowwise, the finest granularity turbo_moe has.
_RECIPE_TO_GRANULARITY = {
    "tensorwise": ScalingGranularity.TENSORWISE,
    "delayed": ScalingGranularity.TENSORWISE,
    "mxfp8": ScalingGranularity.ROWWISE,
    "blockwise": ScalingGranularity.ROWWISE,
}


def _enum_value(value):
    return getattr(value, "value", value)


def resolve_fp8_config(options: TurboMoEOptions, config) -> Optional[Float8Config]:
    """The Float8Config turbo_moe's experts run with, or None for the high-precision path."""
    fp8 = options.fp8
    if isinstance(fp8, Float8Config):
        return fp8
    if fp8 is None:
        return None
    margin = 0
    granularity = options.granularity
    if fp8 == "megatron":
        fp8 = _enum_value(getattr(config, "fp8", None))
        if not fp8:
            return None
        margin = int(getattr(config, "fp8_margin", 0) or 0)
        if granularity is None:
            recipe = _enum_value(getattr(config, "fp8_recipe", None)) or "tensorwise"
            if recipe not in _RECIPE_TO_GRANULARITY:
                raise ValueError(
                    f"config.fp8_recipe={recipe!r} has no turbo_moe equivalent; pass fp8='e4m3'/'hybrid' "
                    f"with granularity='tensorwise'/'rowwise' to the turbo_moe spec helper instead"
                )
            granularity = _RECIPE_TO_GRANULARITY[recipe]
    return Float8Config.from_megatron(
        fp8, granularity=granularity or ScalingGranularity.TENSORWISE, margin=margin
    )


# --------------------------------------------------------------------------------------------
# Autograd helpers: main_grad accumulation and delayed wgrad
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# The grouped linear
# --------------------------------------------------------------------------------------------

_INDEXED_EXTRA_STATE = re.compile(r"^_extra_state\d+$")


def _as_group_lens(m_splits, num_gemms: int, device: torch.device) -> torch.Tensor:
    """int64 tokens-per-expert on ``device`` from a Megatron ``m_splits`` (list or tensor)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype.is_floating_point or m_splits.dtype == torch.bool:
            raise TypeError(f"m_splits must be an integer tensor (tokens per expert), got {m_splits.dtype}")
        if m_splits.dim() != 1 or m_splits.shape[0] != num_gemms:
            raise ValueError(f"m_splits must have shape [{num_gemms}] (one count per local expert), got {tuple(m_splits.shape)}")
        # A host tensor is copied to the device (no sync); a device tensor stays where it is.
        return m_splits.to(device=device, dtype=torch.int64, non_blocking=True)
    if isinstance(m_splits, (list, tuple)):
        if len(m_splits) != num_gemms:
            raise ValueError(f"m_splits has {len(m_splits)} entries but the layer has {num_gemms} local experts")
        return torch.tensor([int(v) for v in m_splits], dtype=torch.int64, device=device)
    raise TypeError(f"m_splits must be a list of ints or an integer tensor, got {type(m_splits).__name__}")


class TurboGroupedLinear(torch.nn.Module):
    """Expert-parallel grouped linear ``y[rows of e] = x[rows of e] @ weight[e]^T (+ bias[e])``.

    Constructor and forward follow Megatron's ``GroupedLinearFc1Builder`` protocol (the signature
    of ``TEColumnParallelGroupedLinear``), plus ``parallel_mode`` and turbo_moe's ``options``.
    ``input_size`` / ``output_size`` are the full (expert-tensor-parallel unsharded) sizes; the
    layer keeps this rank's shard: ``output_size / ETP`` rows (column) or ``input_size / ETP``
    columns (row).

    Parameters: ``weight`` ``[num_gemms, out, in]`` and, with ``bias=True``, ``bias``
    ``[num_gemms, out]`` (zero-initialised, as Megatron does).
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection=None,
        name: Optional[str] = None,
        options: Optional[TurboMoEOptions] = None,
    ) -> None:
        super().__init__()
        if not is_expert:
            raise ValueError("TurboGroupedLinear is an expert layer; is_expert must be True")
        if parallel_mode not in ("column", "row", None):
            raise ValueError(f"parallel_mode must be 'column', 'row' or None, got {parallel_mode!r}")
        for arg, value in (("num_gemms", num_gemms), ("input_size", input_size), ("output_size", output_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config = config
        self.options = options if options is not None else TurboMoEOptions()
        if not isinstance(self.options, TurboMoEOptions):
            raise TypeError(f"options must be a TurboMoEOptions, got {type(self.options).__name__}")
        self.fp8_config = resolve_fp8_config(self.options, config)
        self.num_gemms = num_gemms
        self.parallel_mode = parallel_mode
        self.name = name
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        self.tp_size = get_pg_size(self._tp_group)
        self.tp_rank = get_pg_rank(self._tp_group)
        self.global_input_size, self.global_output_size = input_size, output_size
        # Megatron's dispatcher does the expert-parallel and expert-tensor-parallel communication,
        # so this layer only computes on its shard (as TE's grouped linear does for experts).
        if parallel_mode == "column":
            output_size = _divide(output_size, self.tp_size, "output_size")
        elif parallel_mode == "row":
            input_size = _divide(input_size, self.tp_size, "input_size")
        self.in_features, self.out_features = input_size, output_size
        self.use_bias = bool(bias)
        self.skip_bias_add = bool(skip_bias_add)
        # Set for fc1 under gated linear units by TurboColumnParallelGroupedLinear: the checkpoint
        # stores the gate and the linear halves as separately sharded blocks (Megatron's layout).
        self.glu_fc1 = False

        self.delay_wgrad_compute = bool(
            getattr(config, "delay_wgrad_compute", False)
            or getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False)
        )
        self._pending_wgrads: List[tuple] = []
        self._wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []

        if getattr(config, "use_cpu_initialization", False) or not torch.cuda.is_available():
            device = torch.device("cpu")
        else:
            device = torch.cuda.current_device()  # where Megatron's own layers allocate
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.empty(num_gemms, output_size, input_size, dtype=dtype, device=device))
        if self.use_bias:
            self.bias = torch.nn.Parameter(torch.zeros(num_gemms, output_size, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if getattr(config, "perform_initialization", True):
            self._init_weight(init_method)
        self._set_parameter_attributes()

        self.register_state_dict_post_hook(TurboGroupedLinear._present_per_expert_tensors)
        self.register_load_state_dict_pre_hook(TurboGroupedLinear._accept_per_expert_tensors)

    # -- initialisation ---------------------------------------------------------------------

    def _init_weight(self, init_method) -> None:
        config = self.config
        with torch.no_grad():
            if getattr(config, "use_cpu_initialization", False):
                # As Megatron's CPU path: draw each expert's full matrix, keep this rank's shard, so the
                # values do not depend on the expert-tensor-parallel size.
                axis = 0 if self.parallel_mode == "column" else 1
                for e in range(self.num_gemms):
                    master = torch.empty(self.global_output_size, self.global_input_size, dtype=torch.float32)
                    init_method(master)
                    shard = master.chunk(self.tp_size, dim=axis)[self.tp_rank] if self.parallel_mode else master
                    self.weight[e].copy_(shard)
                return
            from megatron.core.tensor_parallel.random import (
                get_cuda_rng_tracker,
                get_expert_parallel_rng_tracker_name,
            )

            tracker = get_cuda_rng_tracker()
            # Experts draw from the expert-parallel RNG stream (different on each EP rank).
            ctx = tracker.fork(get_expert_parallel_rng_tracker_name()) if tracker.is_initialized() else contextlib.nullcontext()
            with ctx:
                for e in range(self.num_gemms):
                    init_method(self.weight[e])

    def _set_parameter_attributes(self) -> None:
        config = self.config
        ep_size = get_pg_size(self._pg_collection.ep)
        tp_size_dense = getattr(config, "tensor_model_parallel_size", 1)
        etp_size = getattr(config, "expert_tensor_parallel_size", None) or tp_size_dense
        # Same rule as Megatron's TE grouped linear: expert parameters reduce over the expert-data-
        # parallel group (allreduce=False) whenever experts have their own process groups.
        use_expert_pgs = ep_size > 1 or getattr(config, "expert_model_parallel_size", 1) > 1 or etp_size != tp_size_dense
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            param.allreduce = not use_expert_pgs
            sharded = self.parallel_mode == "column" or (self.parallel_mode == "row" and name == "weight")
            param.tensor_model_parallel = sharded
            if sharded:
                # The expert index is dim 0 here (TE's per-expert weights partition dim 0 / 1).
                param.partition_dim = (1 if self.parallel_mode == "column" else 2) if name == "weight" else 1
                param.partition_stride = 1
            if name == "weight" and self.delay_wgrad_compute:
                # Megatron DDP then registers its grad hooks through
                # register_wgrad_accumulation_and_reduce_hooks and backward_dw() fires them.
                param.skip_backward_post_hook = True

    # -- forward ------------------------------------------------------------------------------

    def group_offsets(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        """int64 ``[E+1]`` device offsets from Megatron's ``m_splits`` (list or tensor)."""
        lens = _as_group_lens(m_splits, self.num_gemms, x.device)
        return resolve_group_offs(lens, None, self.num_gemms, x.shape[0], x.device)

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        if self.fp8_config is None:
            return grouped_gemm(x, weight, group_offs=offs, out_dtype=out_dtype)
        return _grouped_gemm_fp8_resolved(  # offs resolved (checked) once in forward
            x, weight, offs, config=self.fp8_config, num_cu=self.options.num_cu,
            backend=self.options.backend, out_dtype=out_dtype,
        )

    def _fuses_main_grad(self) -> bool:
        weight = self.weight
        return bool(getattr(self.config, "gradient_accumulation_fusion", False)) and (
            getattr(weight, "main_grad", None) is not None or callable(getattr(weight, "get_main_grad", None))
        )

    def forward(self, x: torch.Tensor, m_splits=None, *, group_offs: Optional[torch.Tensor] = None):
        """``(y, bias)``: ``bias`` is the ``[E, out]`` bias when ``skip_bias_add`` (else added, None).

        ``m_splits``: tokens per local expert, a list (Megatron's ``TEGroupedMLP`` passes
        ``tokens_per_expert.tolist()``) or an integer tensor; or pass ``group_offs`` (int64
        ``[E+1]`` on x's device) instead.
        """
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, {self.in_features}], got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_features:
            raise ValueError(f"x.shape[1]={x.shape[1]} but this layer's input size is {self.in_features}")
        if group_offs is None:
            if m_splits is None:
                raise ValueError("pass m_splits (tokens per local expert) or group_offs")
            offs = self.group_offsets(x, m_splits)
        else:
            offs = resolve_group_offs(None, group_offs, self.num_gemms, x.shape[0], x.device)
        weight = self.weight
        defer_wgrad = self.delay_wgrad_compute and torch.is_grad_enabled() and weight.requires_grad
        if defer_wgrad:
            # The GEMM's backward then computes dgrad only; backward_dw() computes wgrad later.
            y = self._gemm(x, weight.detach(), offs)
            y = _StashGradOutputForWgrad.apply(y, x.detach(), offs, self, weight)
        elif self._fuses_main_grad() and torch.is_grad_enabled() and weight.requires_grad:
            y = self._gemm(x, _AccumulateWgradIntoMainGrad.apply(weight), offs)
        else:
            y = self._gemm(x, weight, offs)
        if self.bias is None:
            return y, None
        if self.skip_bias_add:
            return y, self.bias
        return add_group_bias(y, self.bias, offs), None

    # -- delayed wgrad ------------------------------------------------------------------------

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Megatron DDP's seam for parameters whose gradient ``backward_dw()`` produces."""
        self._wgrad_accumulation_and_reduce_hooks.append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self._wgrad_accumulation_and_reduce_hooks:
            hook()

    def _wgrad(self, x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``dW[e] = dy[rows of e]^T @ x[rows of e]``, ``[E, out, in]``; empty experts get zeros."""
        cfg = self.fp8_config
        if cfg is None:
            bounds = offs.tolist()  # the high-precision path loops over experts on the host
            dw = torch.zeros(self.weight.shape, dtype=out_dtype, device=x.device)
            for e in range(self.num_gemms):
                lo, hi = bounds[e], bounds[e + 1]
                if hi > lo:
                    dw[e] = (dy[lo:hi].t() @ x[lo:hi]).to(out_dtype)
            return dw
        # Quantized exactly as the FP8 autograd function's backward quantizes its wgrad GEMM.
        return _grouped_wgrad_fp8_resolved(dy, x, offs, config=cfg, num_cu=self.options.num_cu,
                                           backend=self.options.backend, out_dtype=out_dtype)

    def backward_dw(self) -> None:
        """Compute the weight gradients deferred by ``delay_wgrad_compute`` (no-op otherwise)."""
        if not self.delay_wgrad_compute:
            return
        weight = self.weight
        pending, self._pending_wgrads = self._pending_wgrads, []
        for x, dy, offs in pending:
            fuse = self._fuses_main_grad()
            out_dtype = _main_grad_of(weight).dtype if fuse else weight.dtype
            dw = self._wgrad(x, dy, offs, out_dtype)
            if fuse:
                _add_into_main_grad(weight, dw)
            elif weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw
        if pending:
            self._trigger_wgrad_accumulation_and_reduce_hooks()

    # -- checkpoints ----------------------------------------------------------------------------

    def get_extra_state(self):
        # Present so that state_dict has the ``_extra_state`` key Megatron's / TE's layouts carry;
        # turbo_moe scales with the current amax and keeps no FP8 state.
        return None

    def set_extra_state(self, state) -> None:
        # Transformer Engine's FP8 metadata (amax history) has no meaning for current scaling.
        return None

    @staticmethod
    def _present_per_expert_tensors(module, state_dict, prefix, local_metadata) -> None:
        """state_dict hook: ``weight`` ``[E, out, in]`` -> ``weight0..weight{E-1}`` (TE's names)."""
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict:
                stacked = state_dict.pop(key)
                for e in range(module.num_gemms):
                    state_dict[f"{prefix}{name}{e}"] = stacked[e]

    @staticmethod
    def _accept_per_expert_tensors(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                   unexpected_keys, error_msgs) -> None:
        """load_state_dict pre-hook: stack ``weight{i}`` / ``bias{i}`` into the fused parameters.

        Accepts TE's per-GEMM keys, a single stacked ``weight`` (TE's ``single_grouped_weight``
        and our own sharded checkpoints), and drops TE's per-GEMM ``_extra_state{i}``.
        """
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if _INDEXED_EXTRA_STATE.match(key[len(prefix):]):
                state_dict.pop(key)
        # Nothing is kept in the extra state, so a checkpoint without it (a SequentialMLP layout
        # renamed by hand, say) loads strictly too.
        state_dict.setdefault(prefix + "_extra_state", None)
        for name in ("weight", "bias"):
            indexed = [f"{prefix}{name}{e}" for e in range(module.num_gemms)]
            present = [k for k in indexed if k in state_dict]
            if not present:
                continue
            if len(present) != module.num_gemms:
                missing = [k for k in indexed if k not in state_dict]
                error_msgs.append(f"{prefix}{name}: the checkpoint has {len(present)} of {module.num_gemms} "
                                  f"per-expert tensors (missing {missing[:4]})")
                continue
            if prefix + name in state_dict:
                error_msgs.append(f"{prefix}{name}: the checkpoint has both the stacked and per-expert tensors")
                continue
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in indexed])
        # Any other ``weight{N}`` (e.g. from a checkpoint with more local experts) is left for
        # load_state_dict to report as unexpected.

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron distributed-checkpoint entries, in the layout of TE's grouped linear.

        Sharded keys are ``{prefix}weight`` / ``{prefix}bias`` (``TEGroupedMLP`` then renames the
        prefix to ``...experts.linear_fc{1,2}.``) with global shape ``[E_global, out, in]``. This
        rank holds experts ``[ep_rank*E_local, (ep_rank+1)*E_local)`` and its ETP shard. The
        data of the weight entry is the Parameter itself, so Megatron's optimizer checkpointing
        finds it. Under ``singleton_local_shards`` each expert is its own entry, as in TE.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        ep_group = self._pg_collection.ep
        ep_size, ep_rank = get_pg_size(ep_group), get_pg_rank(ep_group)
        edp_rank = get_pg_rank(self._pg_collection.expt_dp)
        num_global = ep_size * self.num_gemms
        first_global = ep_rank * self.num_gemms
        prepend = len(sharded_offsets)
        out = {}
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            # Axis of the per-expert tensor that ETP shards (None: replicated, the row bias).
            tp_axis = 0 if self.parallel_mode == "column" else (1 if name == "weight" and self.parallel_mode == "row" else None)
            replica_id = (0, 0 if tp_axis is not None else self.tp_rank, edp_rank)
            if singleton:
                for e in range(self.num_gemms):
                    offsets = list(sharded_offsets)
                    if tp_axis is not None:
                        offsets.append((prepend + tp_axis, self.tp_rank, self.tp_size))
                    out[f"{prefix}{name}{e}"] = ShardedTensor.from_rank_offsets(
                        f"{first_global + e}.{prefix}{name}", param[e], *offsets,
                        replica_id=replica_id, prepend_axis_num=prepend,
                    )
                continue
            expert_offset = (prepend, ep_rank, ep_size)
            if self.glu_fc1:
                out[f"{prefix}{name}"] = self._glu_sharded_factory(
                    f"{prefix}{name}", param, sharded_offsets, expert_offset, replica_id
                )
                continue
            offsets = [*sharded_offsets, expert_offset]
            if tp_axis is not None:
                offsets.append((prepend + 1 + tp_axis, self.tp_rank, self.tp_size))
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", param, *offsets, replica_id=replica_id, prepend_axis_num=prepend
            )
        extra = self.get_extra_state()
        for e in range(self.num_gemms):
            global_e = first_global + e
            if singleton:
                key, offsets = f"{global_e}.{prefix}_extra_state", tuple(sharded_offsets)
            else:
                key, offsets = f"{prefix}_extra_state", (*sharded_offsets, (prepend, global_e, num_global))
            if offsets:
                shape = tuple(frag for _, _, frag in sorted(offsets))
                offset = tuple(off for _, off, _ in sorted(offsets))
            else:
                shape, offset = (1,), (0,)
            out[f"{prefix}_extra_state{'' if e == 0 else e}"] = ShardedObject(
                key, extra, shape, offset, replica_id=(0, self.tp_rank, edp_rank)
            )
        return out

    def _glu_sharded_factory(self, key, param, sharded_offsets, expert_offset, replica_id):
        """Gate and linear halves of a GLU fc1 as separately sharded blocks (Megatron's layout).

        The local ``[E, 2F/t, in]`` tensor is ``[gate_r; linear_r]`` along dim 1; the checkpoint's
        global ``[E, 2F, in]`` is ``[gate; linear]``, so ETP rank r's gate block is chunk r and its
        linear block chunk t + r of 2t along that axis.
        """
        prepend = len(sharded_offsets)
        tp_rank, tp_size = self.tp_rank, self.tp_size
        axis = prepend + 1

        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            gate, lin = torch.chunk(t, 2, dim=1)
            return [
                ShardedTensor.from_rank_offsets(key, gate, *sharded_offsets, expert_offset,
                                                (axis, tp_rank, 2 * tp_size), replica_id=replica_id,
                                                prepend_axis_num=prepend),
                ShardedTensor.from_rank_offsets(key, lin, *sharded_offsets, expert_offset,
                                                (axis, tp_size + tp_rank, 2 * tp_size), replica_id=replica_id,
                                                prepend_axis_num=prepend),
            ]

        def merge(sub_state_dict):
            with torch.no_grad():
                return torch.cat(sub_state_dict, dim=1)

        return ShardedTensorFactory(key, param, build, merge, replica_id)

    def extra_repr(self) -> str:
        fp8 = "off" if self.fp8_config is None else (
            f"{self.fp8_config.format.value}/{self.fp8_config.granularity.value}")
        return (f"num_gemms={self.num_gemms}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.use_bias}, parallel_mode={self.parallel_mode}, ETP={self.tp_size}, fp8={fp8}, "
                f"backend={self.options.backend!r}, delay_wgrad={self.delay_wgrad_compute}")


class TurboColumnParallelGroupedLinear(TurboGroupedLinear):
    """fc1 of the experts: output features sharded over expert tensor parallelism."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, /, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str] = None,
                 pg_collection=None, name: Optional[str] = None, options: Optional[TurboMoEOptions] = None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name,
                         options=options)
        self.glu_fc1 = bool(getattr(config, "gated_linear_unit", False))


class TurboRowParallelGroupedLinear(TurboGroupedLinear):
    """fc2 of the experts: input features sharded over expert tensor parallelism."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, /, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str] = None,
                 pg_collection=None, name: Optional[str] = None, options: Optional[TurboMoEOptions] = None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name,
                         options=options)


# --------------------------------------------------------------------------------------------
# The experts
# --------------------------------------------------------------------------------------------


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
    if getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in (getattr(config, "recompute_modules", None) or ()):
        bad.append("recompute_modules=['moe_act'] (selective recompute of the expert activation)")
    if getattr(config, "moe_paged_stash", False):
        bad.append("moe_paged_stash")
    return bad


class TurboMoEGroupedMLP(TEGroupedMLP):
    """Megatron's grouped experts on turbo_moe kernels, with ``tokens_per_expert`` kept on the device.

    Same constructor, parameters, checkpoint layout (``sharded_state_dict`` is inherited from
    ``TEGroupedMLP``) and ``backward_dw`` as ``TEGroupedMLP``. Differences: no ``.tolist()`` of
    the routing (the offsets are computed on the device once and shared by fc1, fc2 and the bias),
    and no FP8 padding of each expert's tokens (turbo_moe's kernels take any token count).
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

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, output_buffer=None, grad_input_buffer=None):
        """``(output, None)`` for tokens sorted by local expert; see ``TEGroupedMLP.forward``."""
        if output_buffer is not None or grad_input_buffer is not None:
            raise NotImplementedError("output_buffer/grad_input_buffer (NCCL-EP zero copy) are TE op-fuser features")
        x = permuted_local_hidden_states
        num_tokens = x.shape[0]
        lens = _as_group_lens(tokens_per_expert, self.num_local_experts, x.device)
        offs = resolve_group_offs(lens, None, self.num_local_experts, num_tokens, x.device)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            x = (probs * x).to(permuted_local_hidden_states.dtype)
            probs = torch.ones_like(probs)
        fc1_output, fc1_bias = self.linear_fc1(x, group_offs=offs)
        if fc1_bias is not None:  # a fc1 built with skip_bias_add=True by a custom spec
            fc1_output = add_group_bias(fc1_output, fc1_bias, offs)
        intermediate = self._activation(fc1_output, probs)
        output, fc2_bias = self.linear_fc2(intermediate, group_offs=offs)
        if fc2_bias is not None:
            # Megatron weights the fc2 bias by the routing probability, like the rest of the output.
            bias_rows = group_rows(fc2_bias, offs, num_tokens)
            output = (output + bias_rows * probs).to(output.dtype)
        return output, None

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


# --------------------------------------------------------------------------------------------
# Spec helpers
# --------------------------------------------------------------------------------------------


def _turbo_submodules(options: TurboMoEOptions) -> GroupedMLPSubmodules:
    return GroupedMLPSubmodules(
        linear_fc1=functools.partial(TurboColumnParallelGroupedLinear, options=options),
        linear_fc2=functools.partial(TurboRowParallelGroupedLinear, options=options),
    )


def _make_options(fp8, granularity, backend, num_cu) -> TurboMoEOptions:
    return TurboMoEOptions(fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu)


def get_turbo_moe_experts_spec(*, fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                               backend: str = "auto", num_cu: Optional[int] = None):
    """The experts builder (``MoESubmodules.experts``) for turbo_moe's grouped experts."""
    options = _make_options(fp8, granularity, backend, num_cu)
    return functools.partial(TurboMoEGroupedMLP, submodules=_turbo_submodules(options), options=options)


def get_turbo_moe_module_spec(*, use_te: bool = False, num_experts: Optional[int] = None,
                              fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                              backend: str = "auto", num_cu: Optional[int] = None):
    """``MoELayer`` builder as Megatron's ``get_moe_module_spec`` makes it, with turbo_moe experts.

    ``use_te`` picks TE or local modules for the router-side pieces Megatron builds (shared
    experts); the routed experts are turbo_moe's either way.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    base = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=True)
    return use_turbo_moe_experts(base, fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu)


def use_turbo_moe_experts(spec, *, fp8: Fp8Setting = "megatron", granularity: Optional[str] = None,
                          backend: str = "auto", num_cu: Optional[int] = None):
    """Return a copy of ``spec`` whose MoE layers use turbo_moe's experts.

    ``spec``: a GPT layer spec (``ModuleSpec``), a decoder block spec (``TransformerBlockSubmodules``
    or a list of layer specs), or an ``MoELayer`` builder (``functools.partial``). Everything other
    than ``MoESubmodules.experts`` is kept. Raises ValueError if it contains no MoE layer.
    """
    experts = get_turbo_moe_experts_spec(fp8=fp8, granularity=granularity, backend=backend, num_cu=num_cu)
    replaced = [0]

    def swap(obj, depth=0):
        if depth > 20:
            return obj
        if isinstance(obj, MoESubmodules):
            replaced[0] += 1
            return dataclasses.replace(obj, experts=experts)
        if isinstance(obj, functools.partial):
            keywords = {k: swap(v, depth + 1) for k, v in obj.keywords.items()}
            if all(keywords[k] is obj.keywords[k] for k in keywords):
                return obj
            return functools.partial(obj.func, *obj.args, **keywords)
        if isinstance(obj, ModuleSpec):
            new_sub = swap(obj.submodules, depth + 1)
            new_params = {k: swap(v, depth + 1) for k, v in (obj.params or {}).items()}
            if new_sub is obj.submodules and all(new_params[k] is obj.params[k] for k in new_params):
                return obj
            return dataclasses.replace(obj, submodules=new_sub, params=new_params)
        if isinstance(obj, (list, tuple)):
            items = [swap(v, depth + 1) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            return type(obj)(items)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {}
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                new = swap(value, depth + 1)
                if new is not value:
                    changes[f.name] = new
            return dataclasses.replace(obj, **changes) if changes else obj
        return obj

    result = swap(spec)
    if replaced[0] == 0:
        raise ValueError(f"spec contains no MoE layer (no MoESubmodules found in {type(spec).__name__})")
    return result


# --------------------------------------------------------------------------------------------


def _divide(value: int, parts: int, name: str) -> int:
    if value % parts:
        raise ValueError(f"{name}={value} is not divisible by the expert tensor parallel size {parts}")
    return value // parts
