"""The grouped linear Megatron's ``GroupedMLPSubmodules`` builds for ``linear_fc1`` / ``linear_fc2``:
one ``weight`` Parameter ``[E_local, out, in]``, TE's grouped-linear constructor and forward."""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
from megatron.core.utils import get_pg_rank, get_pg_size

from .. import autograd as _autograd  # quantize_weight is looked up at call time (tests count it)
from .. import host_plan, planned_layer
from ..autograd import (
    DeferredWgrad,
    QuantizedGradHandoff,
    WgradTarget,
    _grouped_gemm_fp8_resolved,
    add_group_bias,
    grouped_gemm,
)
from ..checks import resolve_group_offs
from ..delayed_scaling import delayed_state_for
from ..fine_grained.autograd import GradRowsHandoff
from ..swiglu import fuses_swiglu, grouped_gemm_fp8_swiglu, swiglu_gemm_supports
from .checkpoint import GroupedLinearCheckpointMixin
from .main_grad import (
    _AccumulateWgradIntoMainGrad,
    _StashGradOutputForWgrad,
    _main_grad_of,
    _main_grad_placeholder,
    _mark_grad_added_to_main_grad,
    fp8_weight_cache_is_safe,
    fp8_weight_generation,
    fp8_weight_generation_is_bumped_on_step,
    version_counter_sees_updates,
)
from .options import TurboMoEOptions, resolve_fp8_config, resolve_num_cu

__all__ = ["TurboGroupedLinear", "TurboColumnParallelGroupedLinear", "TurboRowParallelGroupedLinear"]



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


class TurboGroupedLinear(planned_layer.KeepsPlannedLayers, GroupedLinearCheckpointMixin, torch.nn.Module):
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
        self.fp8_delayed = delayed_state_for(self.fp8_config)  # amax histories (fp8_recipe="delayed")
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
        self._pending_wgrads: List[DeferredWgrad] = []  # the wgrads backward_dw() runs
        # options.num_cu="comm": the cap that leaves the expert-parallel all-to-all its SMs.
        self.num_cu = resolve_num_cu(self.options.num_cu, get_pg_size(getattr(pg_collection, "ep", None)))
        self._fp8_weight_cache = None  # (key, Float8Weight) under options.cache_fp8_weight
        # call signature -> ((recipe, num_cu, backend, plans' generation), PlannedLayer or NOT_PLANNABLE)
        self._planned = {}
        # Transformer Engine's micro-batch contract, which Megatron's schedules drive: they call
        # model.set_is_first_microbatch() at the first micro-batch of every step (only under
        # config.fp8 / fp4 / kitchen / quant_recipe), setting this flag True on every module that
        # has it; the layer sets it False after each forward. True: the weight may have changed
        # since the last forward (refresh the FP8 copy); False: same step, reuse it.
        self.is_first_microbatch = True
        # "auto" trusts a False flag only once it has seen the flag come back True after its own
        # forward set it False: proof that something (a schedule) drives it. A layer run outside
        # Megatron's schedules keeps False forever, which must not read as "same step".
        self._cleared_first_microbatch = False
        self._first_microbatch_driven = False
        # As TE's linears: no FP8 weight kept across micro-batches under this setting.
        self._no_parameter_cache = bool(getattr(config, "disable_parameter_transpose_cache", False))
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

        self._register_checkpoint_hooks()

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

    def fuses_swiglu_input(self) -> bool:
        """Whether ``forward(h, swiglu_probs=probs)`` can take fc1's output and fuse the weighted
        SwiGLU into this layer's FP8 input quantization (``turbo_moe.swiglu``): every FP8 recipe."""
        return swiglu_gemm_supports(self.fp8_config)

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
              wgrad_target: Optional[WgradTarget] = None, swiglu_probs: Optional[torch.Tensor] = None,
              grad_handoff: Optional[QuantizedGradHandoff] = None) -> torch.Tensor:
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        if swiglu_probs is not None:  # forward checked fuses_swiglu_input()
            return grouped_gemm_fp8_swiglu(
                x, swiglu_probs, weight, offs, config=self.fp8_config, num_cu=self.num_cu,
                backend=self.options.backend, out_dtype=out_dtype, w_fp8=self._cached_fp8_weight(),
                wgrad_target=wgrad_target, h_grad_handoff=grad_handoff, delayed_state=self.fp8_delayed)
        if self.fp8_config is None:
            return grouped_gemm(x, weight, group_offs=offs, out_dtype=out_dtype)
        return _grouped_gemm_fp8_resolved(  # offs resolved (checked) once in forward
            x, weight, offs, config=self.fp8_config, num_cu=self.num_cu,
            backend=self.options.backend, out_dtype=out_dtype, w_fp8=self._cached_fp8_weight(),
            wgrad_target=wgrad_target, grad_handoff=grad_handoff, delayed_state=self.fp8_delayed,
        )

    def _defer_wgrad(self, wgrad) -> None:
        """Queue a backward's wgrad for ``backward_dw()`` (the queue is looked up at backward time:
        a forward made before a ``backward_dw()`` whose backward runs after it queues afresh)."""
        self._pending_wgrads.append(wgrad)

    def _main_grad_target(self) -> WgradTarget:
        """dW into ``weight.main_grad`` (asked for in backward), then Megatron's placeholder grad."""
        weight = self.weight
        return WgradTarget(buffer=lambda: _main_grad_of(weight),
                           placeholder=lambda: _mark_grad_added_to_main_grad(weight, weight.dtype))

    def invalidate_fp8_weight_cache(self) -> None:
        """Drop the cached FP8 weight (see ``TurboMoEOptions.cache_fp8_weight``)."""
        self._fp8_weight_cache = None

    def _uses_fp8_weight_cache(self) -> bool:
        """Whether :meth:`_cached_fp8_weight` returns a cached FP8 weight now (no side effects;
        raises where ``cache_fp8_weight=True`` cannot be honoured)."""
        mode = self.options.cache_fp8_weight
        if mode is False:
            return False
        w = self.weight
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # the quantization must be part of the captured graph
        if mode is True:
            if not fp8_weight_cache_is_safe(w):
                raise RuntimeError(
                    "cache_fp8_weight=True on a Megatron DDP parameter needs "
                    "turbo_moe.megatron.invalidate_fp8_weight_cache_on_step(optimizer): Megatron's optimizer "
                    "updates the weights through DDP's buffers, which the cache could not see otherwise")
            return True
        # "auto": a driven flag covers what the key cannot see (an optimizer writing DDP's buffers):
        # True refreshes, False means no step since. Else the key must be sound alone: the step
        # hook bumps the generation, or, in a single process, a parameter without main_grad is
        # updated in place by torch optimizers (a version bump). Neither: quantize in every forward.
        if self._no_parameter_cache:
            return False
        return bool(self._first_microbatch_driven or fp8_weight_generation_is_bumped_on_step()
                    or version_counter_sees_updates(w))

    @torch.compiler.disable
    def _cached_fp8_weight(self):
        """The FP8 weight kept across micro-batches, or None (quantize in the GEMM call).
        Keyed on the weight's version counter and storage *and* on the generation that
        ``invalidate_fp8_weight_cache_on_step`` bumps after each optimizer step: Megatron's DDP
        makes parameters views of its buffers through ``.data``, and its (distributed) optimizer
        writes them through those buffers, which bumps no version counter of the Parameter.
        ``"auto"`` caches only where one of these signals is sound (see ``TurboMoEOptions``).
        """
        if not self._uses_fp8_weight_cache():
            return None
        w = self.weight
        refresh = self.options.cache_fp8_weight == "auto" and self.is_first_microbatch
        key = (w._version, w.data_ptr(), w.dtype, w.device, fp8_weight_generation(), self.fp8_config)
        if refresh or self._fp8_weight_cache is None or self._fp8_weight_cache[0] != key:
            self._fp8_weight_cache = None  # release the stale copies before making new ones
            with torch.no_grad():
                self._fp8_weight_cache = (key, _autograd.quantize_weight(w.detach(), self.fp8_config, transposed=True))
        return self._fp8_weight_cache[1]

    def _fuses_main_grad(self) -> bool:
        weight = self.weight
        return bool(getattr(self.config, "gradient_accumulation_fusion", False)) and (
            getattr(weight, "main_grad", None) is not None or callable(getattr(weight, "get_main_grad", None))
        )

    def hands_off_output_grad(self) -> bool:
        """Whether ``forward(..., grad_handoff=)`` can take this layer's output gradient in FP8
        from its consumer's backward: an FP8 per-tensor recipe and no bias added here (a bias
        add's backward would read the placeholder autograd carries instead)."""
        return fuses_swiglu(self.fp8_config) and (self.bias is None or self.skip_bias_add)

    def takes_grad_rows(self) -> bool:
        """Whether ``forward(..., grad_handoff=GradRowsHandoff())`` can take its output gradient's
        rows copy from its consumer's backward (``turbo_moe.fine_grained.autograd.GradRowsHandoff``):
        a fine-grained FP8 recipe (the copy is matched to the very gradient tensor it was made for,
        so a bias, whose backward passes that tensor on or sums it, changes nothing)."""
        return self.fp8_config is not None and self.fp8_config.fine_grained

    def forward(self, x: torch.Tensor, m_splits=None, *, group_offs: Optional[torch.Tensor] = None,
                swiglu_probs: Optional[torch.Tensor] = None, grad_handoff: Optional[QuantizedGradHandoff] = None):
        """``(y, bias)``: ``bias`` is the ``[E, out]`` bias when ``skip_bias_add`` (else added, None).

        ``m_splits``: tokens per local expert, a list (Megatron's ``TEGroupedMLP`` passes
        ``tokens_per_expert.tolist()``) or an integer tensor; or pass ``group_offs`` (int64
        ``[E+1]`` on x's device) instead.
        ``swiglu_probs``: ``[tokens]`` or ``[tokens, 1]`` routing weights; then ``x`` is fc1's output
        ``[tokens, 2 * in]`` and the layer computes ``(silu(x[:, :in]) * x[:, in:] * probs) @ W^T``
        with the activation fused into its FP8 quantization (only where ``fuses_swiglu_input()``: an
        FP8 recipe).
        ``grad_handoff``: a ``turbo_moe.autograd.QuantizedGradHandoff`` shared by fc1 and the fused
        fc2 of one expert MLP: given to fc1 (``hands_off_output_grad()``), fc1's output gradient
        arrives through it in FP8; given to fc2 with ``swiglu_probs``, fc2's backward hands
        ``dh`` over through it. Only where fc1's output feeds fc2 alone. Under the fine-grained
        recipes a ``turbo_moe.fine_grained.autograd.GradRowsHandoff`` instead (``takes_grad_rows()``):
        fc2's backward leaves ``dh``'s rows copy there for fc1's dgrad.
        """
        width = self.in_features if swiglu_probs is None else 2 * self.in_features
        if swiglu_probs is not None and not self.fuses_swiglu_input():
            raise ValueError("swiglu_probs needs an FP8 recipe (fuses_swiglu_input() is False): "
                             "apply the activation and pass its output instead")
        if grad_handoff is not None and swiglu_probs is None:
            if isinstance(grad_handoff, GradRowsHandoff):
                if not self.takes_grad_rows():
                    raise ValueError("grad_handoff=GradRowsHandoff needs a fine-grained FP8 recipe (takes_grad_rows() is "
                                     "False)")
            elif not self.hands_off_output_grad():
                raise ValueError("grad_handoff needs an FP8 tensorwise or rowwise recipe and no bias added by this layer "
                                 "(hands_off_output_grad() is False)")
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, {width}], got shape {tuple(x.shape)}")
        if x.shape[1] != width:
            raise ValueError(f"x.shape[1]={x.shape[1]} but this layer's input is {width} wide"
                             + (" (fc1's output: 2 x its input size)" if swiglu_probs is not None else ""))
        if group_offs is None:
            if m_splits is None:
                raise ValueError("pass m_splits (tokens per local expert) or group_offs")
            offs = self.group_offsets(x, m_splits)
        else:
            offs = resolve_group_offs(None, group_offs, self.num_gemms, x.shape[0], x.device)
        self._note_first_microbatch_flag()
        weight = self.weight
        wants_wgrad = torch.is_grad_enabled() and weight.requires_grad
        fuse_main_grad = wants_wgrad and self._fuses_main_grad()
        y = None
        if swiglu_probs is None and grad_handoff is None:
            y = self._forward_planned(x, offs, fuse_main_grad)
        if y is None:
            y = self._forward_gemm(x, offs, wants_wgrad, fuse_main_grad, swiglu_probs, grad_handoff)
        self._clear_first_microbatch_flag()
        if self.bias is None:
            return y, None
        if self.skip_bias_add:
            return y, self.bias
        return add_group_bias(y, self.bias, offs), None

    def _forward_gemm(self, x, offs, wants_wgrad: bool, fuse_main_grad: bool, swiglu_probs, grad_handoff):
        """The GEMM of ``forward`` through the Python autograd ``Function``s."""
        weight = self.weight
        if self.fp8_config is not None and wants_wgrad and (self.delay_wgrad_compute or fuse_main_grad):
            # The FP8 GEMM's own backward makes dW from the FP8 copies of x and dy it made for the
            # forward and dgrad (each quantized once per fwd+bwd): into main_grad at once (fp32: in
            # the wgrad kernel's epilogue), or handed over for backward_dw() (delayed wgrad).
            target = WgradTarget(defer=self._defer_wgrad) if self.delay_wgrad_compute else self._main_grad_target()
            y = self._gemm(x, weight, offs, wgrad_target=target, swiglu_probs=swiglu_probs, grad_handoff=grad_handoff)
        elif swiglu_probs is not None or grad_handoff is not None:
            y = self._gemm(x, weight, offs, swiglu_probs=swiglu_probs, grad_handoff=grad_handoff)
        elif wants_wgrad and self.delay_wgrad_compute:
            # High precision: the GEMM's backward computes dgrad only; _StashGradOutputForWgrad's
            # backward queues (x, dy) for backward_dw().
            y = self._gemm(x, weight.detach(), offs)
            y = _StashGradOutputForWgrad.apply(y, x.detach(), offs, self, weight)
        elif fuse_main_grad:
            # High precision: torch computes dW in the weight's dtype, then it is added to main_grad.
            y = self._gemm(x, _AccumulateWgradIntoMainGrad.apply(weight), offs)
        else:
            y = self._gemm(x, weight, offs)
        return y

    def _forward_planned(self, x, offs, fuse_main_grad: bool) -> Optional[torch.Tensor]:
        """The GEMM as one C++ call with a C++ backward node (``turbo_moe.planned_layer``), its
        wgrad into ``main_grad`` under ``gradient_accumulation_fusion``; None: the Python path (a
        signature whose plans are not all recorded yet, or one the planned layer does not serve:
        high precision, delayed wgrad, a lazily allocated or non-float32 ``main_grad``). ``grad_added_to_main_grad`` is set here, at forward, as Megatron's own
        CUDA-graphed layers set it: no Python runs in this backward."""
        config = self.fp8_config
        if config is None or self.delay_wgrad_compute or type(x) is not torch.Tensor \
                or not x.is_cuda or not planned_layer.enabled() or torch.compiler.is_compiling():
            return None
        w = self.weight
        grad = torch.is_grad_enabled()
        delayed = self.fp8_delayed
        target = self._planned_wgrad_target(fuse_main_grad)
        if target is None or not planned_layer.histories_ready(delayed, x, grad):
            return None
        main_grad, placeholder = target
        out_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        caching = self._uses_fp8_weight_cache()
        key = (host_plan.fact(x), host_plan.fact(w), host_plan.fact(offs), caching, host_plan.fact(main_grad),
               placeholder is not None, x.requires_grad, w.requires_grad, out_dtype, grad)
        static = (config, self.num_cu, self.options.backend, host_plan.generation())
        if planned_layer.known_unplannable(self._planned, key, static):
            return None  # before the cache lookup, which the Python path makes itself
        w_fp8 = self._cached_fp8_weight() if caching else None
        layer = planned_layer.cached_plan(self._planned, key, static, lambda: planned_layer.plan_layer(
            x, w, offs, False, w_fp8, config, self.num_cu, self.options.backend, out_dtype, x.requires_grad,
            w.requires_grad, forward_only=not grad, delayed=delayed, main_grad=main_grad, placeholder=placeholder))
        if layer is None:
            return None
        y = planned_layer.apply_layer(layer, x, w, offs, w_fp8, delayed, main_grad, placeholder)
        self._mark_planned_wgrad(placeholder)
        return y

    def _planned_wgrad_target(self, fuse_main_grad: bool):
        """``(main_grad, placeholder)`` a planned GEMM's wgrad accumulates into and hands back as the
        weight's gradient (both None without ``gradient_accumulation_fusion``), or None where the
        planned paths leave it to the Python one: a ``main_grad`` allocated lazily (Megatron-FSDP),
        not float32 (added after the kernel), or a placeholder that must be zeroed each time."""
        if not fuse_main_grad:
            return None, None
        w = self.weight
        main_grad = getattr(w, "main_grad", None)
        if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 \
                or getattr(w, "zero_out_wgrad", False):
            return None
        return main_grad, _main_grad_placeholder(w, w.dtype)

    def _mark_planned_wgrad(self, placeholder: Optional[torch.Tensor]) -> None:
        """After a planned forward: Megatron's ``grad_added_to_main_grad``, set now (as Megatron's own
        CUDA-graphed layers set it) since no Python runs in the planned backward."""
        if placeholder is not None:
            self.weight.grad_added_to_main_grad = True

    def _note_first_microbatch_flag(self) -> None:
        """Before a forward's FP8 weight cache lookup: a flag set True again since this layer's last
        forward cleared it proves that something (Megatron's schedule) drives it."""
        if self.is_first_microbatch and self._cleared_first_microbatch:
            self._first_microbatch_driven = True

    def _clear_first_microbatch_flag(self) -> None:
        """After a forward: as TE's linears, later micro-batches of this step reuse the FP8 weight."""
        self.is_first_microbatch = False
        self._cleared_first_microbatch = True

    # -- delayed wgrad ------------------------------------------------------------------------

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Megatron DDP's seam for parameters whose gradient ``backward_dw()`` produces."""
        self._wgrad_accumulation_and_reduce_hooks.append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self._wgrad_accumulation_and_reduce_hooks:
            hook()

    def _wgrad(self, x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype,
               out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
        """High precision ``dW[e] = dy[rows of e]^T @ x[rows of e]``, ``[E, out, in]``; empty experts
        get zeros; with ``out`` and ``accumulate``, added into ``out`` (the runner of the
        ``DeferredWgrad`` that high-precision delayed wgrad queues; FP8 layers queue their GEMM's)."""
        bounds = offs.tolist()  # the high-precision path loops over experts on the host
        dw = torch.zeros(self.weight.shape, dtype=out_dtype, device=x.device)
        for e in range(self.num_gemms):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                dw[e] = (dy[lo:hi].t() @ x[lo:hi]).to(out_dtype)
        if out is not None and accumulate:
            return out.add_(dw)
        return dw

    def backward_dw(self) -> None:
        """Compute the weight gradients deferred by ``delay_wgrad_compute`` (no-op otherwise)."""
        if not self.delay_wgrad_compute:
            return
        weight = self.weight
        pending, self._pending_wgrads = self._pending_wgrads, []
        for wgrad in pending:  # DeferredWgrad: FP8 copies (FP8 layers) or (x, dy) (high precision)
            if self._fuses_main_grad():
                wgrad.accumulate_into(_main_grad_of(weight))
                _mark_grad_added_to_main_grad(weight, weight.dtype)
                continue
            dw = wgrad.compute(weight.dtype)
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw
        if pending:
            self._trigger_wgrad_accumulation_and_reduce_hooks()

    def extra_repr(self) -> str:
        fp8 = "off" if self.fp8_config is None else (
            f"{self.fp8_config.format.value}/{self.fp8_config.granularity.value}"
            + ("/delayed" if self.fp8_config.delayed else ""))
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


def _divide(value: int, parts: int, name: str) -> int:
    if value % parts:
        raise ValueError(f"{name}={value} is not divisible by the expert tensor parallel size {parts}")
    return value // parts
