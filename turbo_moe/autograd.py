"""The differentiable grouped GEMMs: FP8 (``grouped_gemm_fp8``) and high precision (``grouped_gemm``).

``y[rows of g] = x[rows of g] @ W[g]^T`` (``trans_b=True``, ``W: [G, N, K]``) or ``@ W[g]``
(``trans_b=False``, ``W: [G, K, N]``).

FP8 data flow (current scaling, per tensor or rowwise):

* forward quantizes ``x`` and ``W`` (e4m3) and runs the M-grouped NT kernel; it saves the FP8
  copies backward needs, in the layouts backward's kernels read (both operands contiguous along
  the contracted dimension) -- never the high-precision originals;
* backward quantizes ``dy`` (e4m3, or e5m2 with ``format="hybrid"``) and runs the M-grouped
  kernel for ``dx = dy @ W[g]`` and the K-grouped (variable-K) kernel for ``dW[g] = dy_g^T x_g``.

Gradients come back in the inputs' dtypes; a group with no tokens gets an exactly zero ``dW[g]``.
Nothing here reads the group sizes on the host when the data is on a GPU (see ``checks``), so
forward+backward can be captured in a CUDA graph with a kernel backend. Backward is not itself
differentiable (``once_differentiable``): a double backward raises instead of returning a wrong
second-order gradient. On the meta device every entry infers shapes and dtypes (no kernel runs).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from .backends import GemmKind, GroupedGemmProblem, select_backend
from .checks import HIGH_PRECISION_DTYPES, check_group_offs, check_operands, check_wgrad_operands, resolve_group_offs
from ._triton_kernels import triton_kernels
from .config import Float8Config, ScalingGranularity
from . import host_plan
from .delayed_scaling import AmaxHistory, DelayedScalingState
from .quantize import (quantize_columnwise, quantize_rowwise, quantize_rowwise_layouts, quantize_tensorwise_layouts,
                       row_group_ids, split_packed_scales)

__all__ = [
    "GroupedGemmFP8Function",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_with_offs",
    "grouped_wgrad_fp8",
    "Float8Weight",
    "WgradTarget",
    "QuantizedGradHandoff",
    "DeferredWgrad",
    "quantize_weight",
    "grouped_gemm",
    "add_group_bias",
    "group_rows",
]


def _autocast_out_dtype(x: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The output dtype when the caller gave ``out_dtype`` (None: not given). As ``F.linear``: the
    autocast dtype while autocast is on for x's device, else ``x.dtype``."""
    if out_dtype is not None:
        return out_dtype
    device_type = x.device.type
    # is_autocast_enabled raises for device types without autocast (meta).
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _run(kind, a, b, a_scale, b_scale, offs, out_dtype, num_cu, backend, role, config: Float8Config, out=None,
         accumulate=False) -> torch.Tensor:
    problem = GroupedGemmProblem(kind, a, b, a_scale, b_scale, offs, out_dtype, num_cu, role, out, accumulate,
                                 config.promotes_accumulation)
    if a.device.type == "meta":  # shape inference: no values, no kernel
        return out if out is not None else torch.empty(problem.out_shape, dtype=out_dtype, device=a.device)
    return select_backend(problem, backend).run(problem)


def _token_major_operand(t, offs, fp8_dtype, margin, rowwise):
    """``t [M, C]`` as the wgrad kernel reads it: FP8 ``[C, M]`` (tokens contiguous) and its scale."""
    if rowwise:
        return quantize_columnwise(t, fp8_dtype, margin, group_offs=offs)
    _, q_t, scale = quantize_tensorwise_layouts(t, fp8_dtype, margin, rows=False, transposed=True)
    return q_t, scale


class _GroupRows(torch.autograd.Function):
    """``out[r] = table[group of row r]``: a per-group row (a bias) broadcast to every row.

    ``index_select``'s backward is an atomic ``index_add_`` on CUDA, so its sum order (and bits)
    vary run to run; here the gradient is a segmented sum over the group offsets: ordered,
    without a host sync, accumulated in float32.
    """

    @staticmethod
    def forward(ctx, table, group_offs, num_rows: int):
        ctx.save_for_backward(group_offs)
        ctx.table_dtype = table.dtype
        return table.index_select(0, row_group_ids(group_offs, num_rows))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (group_offs,) = ctx.saved_tensors
        dtable = torch.segment_reduce(grad.float(), "sum", offsets=group_offs, axis=0, unsafe=True)
        return dtable.to(ctx.table_dtype), None, None


def group_rows(table: torch.Tensor, group_offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``table [G, N]`` expanded to ``[num_rows, N]`` by group; deterministic gradient."""
    return _GroupRows.apply(table, group_offs, num_rows)


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """``y[rows of g] + bias[g]`` for ``bias [G, N]``; deterministic gradient, no host sync."""
    return y + group_rows(bias.to(y.dtype), group_offs, y.shape[0])


class Float8Weight(NamedTuple):
    """A weight ``[G, N, K]`` in FP8 as the kernels read it: ``data`` for the forward GEMM and, for
    dgrad, ``data_t`` ``[G, K, N]`` (contracted over N); each with its dequantization scale."""

    data: torch.Tensor
    scale: torch.Tensor
    data_t: Optional[torch.Tensor]
    scale_t: Optional[torch.Tensor]


def quantize_weight(w_nk: torch.Tensor, config: Float8Config, transposed: bool = True) -> Float8Weight:
    """Quantize ``w_nk [G, N, K]`` as the forward (and, with ``transposed``, dgrad) GEMMs read it."""
    if config.fine_grained:  # blockwise / mxfp8: turbo_moe.fine_grained
        from .fine_grained import quantize_weight_fine
        return quantize_weight_fine(w_nk, config, transposed=transposed)
    dtype, margin = config.forward_dtype, config.margin
    if config.granularity is ScalingGranularity.TENSORWISE:
        w_fp8, w_kn, w_scale = quantize_tensorwise_layouts(w_nk, dtype, margin, transposed=transposed)
        return Float8Weight(w_fp8, w_scale, w_kn, w_scale if transposed else None)
    if transposed:  # per (g, n) over K for the forward, per (g, k) over N for dgrad: two passes over W
        return Float8Weight(*quantize_rowwise_layouts(w_nk, dtype, margin))
    w_fp8, w_scale = quantize_rowwise(w_nk, dtype, margin)
    return Float8Weight(w_fp8, w_scale, None, None)


class DeferredWgrad:
    """One backward's ``dW``, to be computed later from the FP8 copies that backward made (dy and x
    token-major, with their scales): what ``WgradTarget.defer`` receives. It holds FP8 data, half
    the bytes of the high-precision x and dy a deferred wgrad would otherwise keep.

    ``run(out_dtype, out=None, accumulate=False)``: the recipe's K-grouped GEMM on those operands.
    """

    __slots__ = ("_run",)

    def __init__(self, run: Callable[..., torch.Tensor]):
        self._run = run

    def compute(self, out_dtype: torch.dtype) -> torch.Tensor:
        """``dW`` ``[G, N, K]`` in ``out_dtype`` (an expert with no tokens gets zeros)."""
        return self._run(out_dtype)

    def accumulate_into(self, buffer: torch.Tensor) -> None:
        """``buffer += dW``: a float32 buffer in the wgrad kernel's epilogue (no rounding, no separate
        add; an expert with no tokens leaves its slice as it was), another dtype through ``compute``."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"the wgrad buffer must be a tensor, got {type(buffer).__name__}")
        if buffer.dtype == torch.float32:  # shape, device: checked by the backend
            self._run(torch.float32, out=buffer, accumulate=True)
        else:
            buffer.add_(self.compute(buffer.dtype))


def finish_wgrad(target: "WgradTarget", wgrad: DeferredWgrad) -> Optional[torch.Tensor]:
    """Hand ``wgrad`` to ``target`` (deferred, or added into its buffer now); returns the gradient
    autograd receives for the weight. Shared by the per-tensor and fine-grained Functions."""
    if target.defer is not None:
        target.defer(wgrad)
    else:
        wgrad.accumulate_into(target.buffer())
    return target.placeholder() if target.placeholder is not None else None


class WgradTarget(NamedTuple):
    """Where backward puts ``dW`` instead of returning it (Megatron's ``gradient_accumulation_fusion``
    and ``delay_wgrad_compute``).

    ``buffer()``: the ``[G, N, K]`` buffer ``dW`` is added into, asked for in backward (so a buffer
    allocated lazily works); float32 is accumulated in the wgrad kernel's epilogue, another dtype
    gets ``dW`` in its dtype, then added. Or ``defer(wgrad)``: backward hands over a
    ``DeferredWgrad`` for the caller to run later, and computes nothing. ``placeholder()``: what
    autograd then receives as the weight's gradient (one the caller's gradient hooks recognize);
    None or absent: no gradient.

    Either way ``dW`` comes from the FP8 copies the forward and backward made anyway (x and dy
    token-major): x and dy are each quantized once per fwd+bwd.
    """

    buffer: Optional[Callable[[], torch.Tensor]] = None
    placeholder: Optional[Callable[[], Optional[torch.Tensor]]] = None
    defer: Optional[Callable[[DeferredWgrad], None]] = None


class QuantizedGradHandoff:
    """An FP8 GEMM's output gradient made in FP8 by its consumer's backward, handed straight to the
    GEMM's backward: fc1 of an expert MLP and the fused SwiGLU + fc2 (``turbo_moe.swiglu``), whose
    backward computes ``dh`` = d(loss)/d(fc1's output) elementwise from ``h``, ``da`` and the
    routing weights. Quantizing ``dh`` there (``kernels/triton/swiglu_fp8.py``: an amax pass and a
    cast pass that recompute it) spares writing ``dh`` in bf16 and fc1's own amax and cast passes
    reading it back.

    Protocol (per-tensor or rowwise scaling; one object per forward of the pair):

    * the producer's forward (:class:`GroupedGemmFP8Function`) calls :meth:`expect` with its
      config and the layouts its backward needs (rows for dgrad, token-major for wgrad);
    * the consumer's backward, if :attr:`expecting`, makes those layouts and calls :meth:`give`,
      which returns what autograd gets as the gradient of the producer's output: zeros of its
      shape and dtype, broadcast from one element (no memory);
    * the producer's backward calls :meth:`take` with the gradient autograd hands it: the FP8
      copies if that gradient *is* the placeholder; anything else (the output fed other ops too,
      so autograd summed gradients) raises instead of dropping those contributions.

    The caller guarantees that nothing between the two reads that gradient (a bias add, a hook):
    such an op would see the zeros. ``TurboMoEGroupedMLP`` hands off only with no fc1 bias.

    The forward pair uses the same object. With the SwiGLU's routing weights given
    (``swiglu_probs``, by the MLP before fc1 runs), a tensorwise current-scaling fc1 reduces
    ``max |silu(gate) * linear * probs|`` of its output in its GEMM's epilogue
    (``backends.base.GroupedGemmProblem.swiglu_amax``), and the fused SwiGLU + fc2 forward takes its
    scale from that (:meth:`forward_amax`) instead of an amax pass over ``h``.
    """

    __slots__ = ("grad_dtype", "margin", "need_rows", "need_transposed", "history", "rowwise", "_given",
                 "_placeholder", "swiglu_probs", "_amax", "_amax_of", "_amax_version")

    def __init__(self, swiglu_probs: Optional[torch.Tensor] = None) -> None:
        # [M] routing weights of the SwiGLU that consumes the producer's output (forward fusion).
        self.swiglu_probs = swiglu_probs
        self._amax = self._amax_of = self._amax_version = None
        self.grad_dtype: Optional[torch.dtype] = None
        self.margin = 0
        self.history: Optional[AmaxHistory] = None  # delayed scaling: the producer's grad_output history
        self.need_rows = self.need_transposed = False
        # Rowwise: the layouts are scaled per row and per (group, column), and the scale handed over
        # is both scales packed in one tensor (quantize.pack_scales).
        self.rowwise = False
        self._given = self._placeholder = None

    @property
    def expecting(self) -> bool:
        """Whether a producer registered (:meth:`expect`) and needs a layout."""
        return self.grad_dtype is not None and (self.need_rows or self.need_transposed)

    def expect(self, config: Float8Config, need_rows: bool, need_transposed: bool,
               history: Optional[AmaxHistory] = None) -> None:
        if config.fine_grained:
            return  # blockwise / MXFP8: the producer quantizes its own gradient
        self.grad_dtype, self.margin = config.grad_dtype, config.margin
        self.rowwise = config.granularity is ScalingGranularity.ROWWISE
        self.need_rows, self.need_transposed = need_rows, need_transposed
        self.history = history

    def give(self, rows: Optional[torch.Tensor], transposed: Optional[torch.Tensor], scale: torch.Tensor,
             like: torch.Tensor) -> torch.Tensor:
        self._given = (rows, transposed, scale)
        self._placeholder = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        return self._placeholder

    def note_forward_amax(self, h: torch.Tensor, amax: Optional[torch.Tensor]) -> None:
        """The producer's forward: ``amax`` (float32 1-D, its maximum the SwiGLU's amax) of ``h``."""
        self._amax = amax
        self._amax_of = None if amax is None else weakref.ref(h)
        self._amax_version = h._version

    def forward_amax(self, h: torch.Tensor) -> Optional[torch.Tensor]:
        """What :meth:`note_forward_amax` kept, if it was of this ``h`` as it is now (not changed in
        place since); None otherwise (the SwiGLU then runs its own amax pass)."""
        amax, of = self._amax, self._amax_of
        self._amax = self._amax_of = None
        if amax is None or of() is not h or h._version != self._amax_version:
            return None
        return amax

    def take(self, grad: torch.Tensor):
        """``(rows, transposed, scale)`` handed over for ``grad``, or None if nothing was."""
        given, placeholder = self._given, self._placeholder
        self._given = self._placeholder = None
        if given is None:
            return None
        if grad is not placeholder:
            raise RuntimeError(
                "turbo_moe: this FP8 GEMM's output gradient was handed over in FP8 by its consumer's backward "
                "(QuantizedGradHandoff), but autograd passed another gradient: the output also fed other "
                "differentiable ops. Pass grad_handoff only where its one consumer is the fused SwiGLU + fc2.")
        return given


def fp8_weight_for(w_nk, w_fp8: Optional[Float8Weight], config: Float8Config, need_dx: bool) -> Float8Weight:
    """The forward's FP8 weight: the caller's copy (a cache) unless dgrad needs a W^T it lacks,
    else ``w_nk`` quantized now (with W^T only when dgrad runs)."""
    if w_fp8 is None or (need_dx and w_fp8.data_t is None):
        w_fp8 = quantize_weight(w_nk, config, transposed=need_dx)
    return w_fp8


def stash_for_fp8_gemm_backward(ctx, w_kn, config, num_cu, backend, x_dtype, w_dtype, wgrad_target,
                                grad_handoff: Optional[QuantizedGradHandoff] = None,
                                grad_history: Optional[AmaxHistory] = None,
                                w_fp8: Optional[Float8Weight] = None) -> None:
    """What :func:`fp8_gemm_backward` reads from ``ctx`` besides the saved tensors. W^T in FP8 is
    dgrad's alone: held on ctx (not saved) so backward can drop it before the wgrad output is
    allocated -- unless it belongs to the caller's cache (``w_fp8``, the forward's cached weight),
    which keeps it anyway. ``grad_history``: dy's amax history under delayed scaling."""
    ctx.w_kn = w_kn
    ctx.w_kn_kept = w_kn is not None and w_fp8 is not None and w_kn is w_fp8.data_t
    ctx.grad_history = grad_history
    ctx.config, ctx.num_cu, ctx.backend = config, num_cu, backend
    ctx.x_dtype, ctx.w_dtype = x_dtype, w_dtype
    ctx.wgrad_target = wgrad_target
    ctx.grad_handoff = grad_handoff


def fp8_gemm_backward(ctx, dy, w_nk, w_kn_scale, x_km, x_km_scale, group_offs, need_dx: bool, need_dw: bool):
    """``(dx, dw)`` of an FP8 grouped GEMM ``y = x @ W[g]^T`` from ``dy``: quantizes ``dy`` (or takes
    its FP8 copies from ``ctx.grad_handoff``) and runs dgrad (``need_dx``) and wgrad (``need_dw``).
    What the forward left: ``ctx.w_kn`` (W^T in FP8, taken and dropped here), ``ctx.config``,
    ``num_cu``, ``backend``, ``x_dtype``, ``w_dtype``, ``wgrad_target``, ``grad_handoff``
    (:func:`stash_for_fp8_gemm_backward`); saved ``w_nk`` (to re-derive W^T on a second backward),
    ``w_kn_scale`` and x's token-major FP8 copy ``x_km`` with its scale. Shared by every Function
    whose forward ends in this GEMM (``GroupedGemmFP8Function``, ``turbo_moe.swiglu``'s)."""
    handed = ctx.grad_handoff.take(dy) if ctx.grad_handoff is not None else None
    w_kn, ctx.w_kn = ctx.w_kn, None
    if w_kn is None and need_dx:  # a second backward (retain_graph): re-derive W^T
        requantized = quantize_weight(w_nk, ctx.config, transposed=True)
        w_kn, w_kn_scale = requantized.data_t, requantized.scale_t
    config, num_cu, backend = ctx.config, ctx.num_cu, ctx.backend
    if handed is None:
        dy = dy.contiguous()
    history = ctx.grad_history
    target = ctx.wgrad_target
    if need_dw and (target is None or target.defer is None) and (ctx.w_kn_kept or not need_dx):
        # Nothing to free between dgrad and wgrad (W^T is the cache's, or there is no dgrad): one
        # region for both, so one replay issues the whole backward.
        return _fused_backward(ctx, dy, handed, w_kn, w_kn_scale, x_km, x_km_scale, group_offs, need_dx, history)
    dgrad = functools.partial(_dgrad_tensors, dy, handed, w_kn, w_kn_scale, group_offs, config, num_cu, backend,
                              ctx.x_dtype, need_dx, need_dw, history)
    inputs = (None if handed is not None else dy, *(handed or (None, None, None)), w_kn, w_kn_scale, group_offs)
    dx, dy_t, dy_t_scale = through_plan(_DGRAD_REGION, (config, num_cu, backend, ctx.x_dtype, need_dx, need_dw),
                                        inputs, dgrad, (history,))
    # dgrad's operands are dead: release them before wgrad allocates dW (the peak of the step).
    del w_kn, dgrad, handed, inputs
    if not need_dw:
        return dx, None
    if target is not None and target.defer is not None:
        if dy_t is None:  # rowwise without dgrad
            dy_t, dy_t_scale = _token_major_operand(dy, group_offs, config.grad_dtype, config.margin, rowwise=True)
        return dx, finish_wgrad(target, DeferredWgrad(functools.partial(
            _run, GemmKind.K_GROUPED, dy_t, x_km, _token_major_scale(dy_t, dy_t_scale, group_offs), x_km_scale,
            group_offs, num_cu=num_cu, backend=backend, role="wgrad", config=config)))
    buffer, out, dw_dtype = _wgrad_destination(ctx, target)
    wgrad = functools.partial(_wgrad_tensors, dy, dy_t, dy_t_scale, x_km, x_km_scale, group_offs, config, num_cu,
                              backend, dw_dtype, out)
    inputs = (dy if dy_t is None else None, dy_t, dy_t_scale, x_km, x_km_scale, group_offs, out)
    (dw,) = through_plan(_WGRAD_REGION, (config, num_cu, backend, dw_dtype), inputs, wgrad,
                         writes_inputs=out is not None)
    return dx, _wgrad_result(target, buffer, out, dw)


def _wgrad_destination(ctx, target: Optional[WgradTarget]):
    """``(buffer, out, dW dtype)``: the ``WgradTarget``'s buffer (or None), the float32 buffer the
    wgrad kernel accumulates into in its epilogue (or None: another dtype gets dW in its dtype,
    added after), and the dtype the kernel writes."""
    buffer = None if target is None else target.buffer()
    if buffer is not None and not isinstance(buffer, torch.Tensor):
        raise TypeError(f"the wgrad buffer must be a tensor, got {type(buffer).__name__}")
    out = buffer if buffer is not None and buffer.dtype == torch.float32 else None
    return buffer, out, ctx.w_dtype if buffer is None else buffer.dtype


def _wgrad_result(target: Optional[WgradTarget], buffer, out, dw):
    """What autograd receives for the weight once the wgrad kernel made ``dw`` (see WgradTarget)."""
    if buffer is None:
        return dw
    if out is None:
        buffer.add_(dw)
    return target.placeholder() if target.placeholder is not None else None


def _fused_backward(ctx, dy, handed, w_kn, w_kn_scale, x_km, x_km_scale, group_offs, need_dx, history):
    """``fp8_gemm_backward`` when nothing has to be freed between dgrad and wgrad: both in one
    host-plan region (one signature key, one replay)."""
    config, num_cu, backend = ctx.config, ctx.num_cu, ctx.backend
    target = ctx.wgrad_target
    buffer, out, dw_dtype = _wgrad_destination(ctx, target)
    both = functools.partial(_backward_tensors, dy, handed, w_kn, w_kn_scale, x_km, x_km_scale, group_offs, config,
                             num_cu, backend, ctx.x_dtype, need_dx, history, dw_dtype, out)
    inputs = (None if handed is not None else dy, *(handed or (None, None, None)), w_kn, w_kn_scale, x_km, x_km_scale,
              group_offs, out)
    dx, dw = through_plan(_BACKWARD_REGION, (config, num_cu, backend, ctx.x_dtype, need_dx, dw_dtype), inputs, both,
                          (history,), writes_inputs=out is not None)
    return dx, _wgrad_result(target, buffer, out, dw)


def _backward_tensors(dy, handed, w_kn, w_kn_scale, x_km, x_km_scale, group_offs, config, num_cu, backend, dx_dtype,
                      need_dx, history, dw_dtype, out):
    """dgrad then wgrad (``_dgrad_tensors``, ``_wgrad_tensors``): ``(dx or None, dW)``. dy's row-major
    FP8 copy dies with dgrad, before dW is allocated, as in the split path."""
    dx, dy_t, dy_t_scale = _dgrad_tensors(dy, handed, w_kn, w_kn_scale, group_offs, config, num_cu, backend, dx_dtype,
                                          need_dx, True, history)
    (dw,) = _wgrad_tensors(dy, dy_t, dy_t_scale, x_km, x_km_scale, group_offs, config, num_cu, backend, dw_dtype, out)
    return dx, dw


def _dgrad_tensors(dy, handed, w_kn, w_kn_scale, group_offs, config, num_cu, backend, dx_dtype, need_dx, need_dw,
                   history):
    """Backward's first GPU work: quantize ``dy`` (unless ``handed`` its FP8 copies) and run
    dgrad. Returns ``(dx, dy token-major in FP8, its scale)``; the last two None where the wgrad
    makes its own (rowwise without dgrad)."""
    rowwise = config.granularity is ScalingGranularity.ROWWISE
    gdtype, margin = config.grad_dtype, config.margin
    dy_t = dy_t_scale = None
    if handed is not None:  # in the layouts this backward asked for (expect)
        dy_fp8, dy_t, dy_scale = handed
        dy_t_scale = dy_scale
        if rowwise and dy_fp8 is not None:  # both scales, packed: the M row scales, then the G x N column ones
            # the row scales (dy_t_scale stays packed: _token_major_scale)
            dy_scale = split_packed_scales(dy_scale, *dy_fp8.shape, group_offs.shape[0] - 1)[0]
    elif rowwise and need_dx and need_dw:  # both copies from two passes over dy (not four)
        dy_fp8, dy_scale, dy_t, dy_t_scale = quantize_rowwise_layouts(dy, gdtype, margin, group_offs)
    elif rowwise:
        dy_fp8, dy_scale = quantize_rowwise(dy, gdtype, margin) if need_dx else (None, None)
    else:  # one pass writes both layouts (tensorwise shares one amax)
        dy_fp8, dy_t, dy_scale = quantize_tensorwise_layouts(dy, gdtype, margin, rows=need_dx, transposed=need_dw,
                                                             history=history)
        dy_t_scale = dy_scale
    dx = None
    if need_dx:
        dx = _run(GemmKind.M_GROUPED, dy_fp8, w_kn, dy_scale, w_kn_scale, group_offs, dx_dtype, num_cu, backend,
                  "dgrad", config)
    return dx, dy_t, dy_t_scale


def _token_major_scale(dy_t, dy_t_scale, group_offs):
    """dy's token-major dequantization scale as the wgrad kernel reads it. A rowwise
    ``QuantizedGradHandoff`` hands both of dy's scales packed in one 1-D tensor
    (``quantize.pack_scales``); its column scales are viewed out here, in the region that reads
    them, because a region cannot return a view of its input (``host_plan``). Packed is the one
    1-D form: a tensorwise scale is 0-dim, a rowwise token-major one [G, N]."""
    if dy_t_scale.dim() == 1:
        n, m = dy_t.shape
        return split_packed_scales(dy_t_scale, m, n, group_offs.shape[0] - 1)[1]
    return dy_t_scale


def _wgrad_tensors(dy, dy_t, dy_t_scale, x_km, x_km_scale, group_offs, config, num_cu, backend, dw_dtype, out):
    """Backward's wgrad: ``(dW,)``, added into ``out`` (float32) when given. ``dy_t`` None
    (rowwise without dgrad): dy's token-major copy made here."""
    if dy_t is None:
        dy_t, dy_t_scale = _token_major_operand(dy, group_offs, config.grad_dtype, config.margin, rowwise=True)
    return (_run(GemmKind.K_GROUPED, dy_t, x_km, _token_major_scale(dy_t, dy_t_scale, group_offs), x_km_scale,
                 group_offs, dw_dtype, num_cu, backend, "wgrad", config, out=out, accumulate=out is not None),)


# Slots of the SwiGLU amax that fc1's epilogue writes: two per program of the ping-pong's persistent
# grid (the backend caps the grid to half of them: 256 programs, more than an H100's 132 SMs); the
# SwiGLU's cast reads them all (at most fp8_cast.MAX_PARTIALS).
SWIGLU_AMAX_SLOTS = 512


def fuses_swiglu_amax(config: Float8Config) -> bool:
    """Whether fc1's forward reduces the SwiGLU's amax for it: tensorwise current scaling (rowwise
    needs per-row and per-column maxima; delayed scaling takes the scale from its history)."""
    return config.granularity is ScalingGranularity.TENSORWISE and not config.fine_grained \
        and not config.delayed


# (backend argument, the fused problem's signature) -> whether that backend's kernel fuses the amax
_SWIGLU_AMAX_FUSED: dict = {}


def _fc1_with_swiglu_amax(x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu, backend, config, probs):
    """``(h, amax)``: fc1's GEMM and the SwiGLU amax of its output as float32 partials, reduced in
    the GEMM's epilogue where the chosen backend does it (Triton), else by the SwiGLU's amax pass."""
    problem = GroupedGemmProblem(GemmKind.M_GROUPED, x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu,
                                 "fwd", None, False, config.promotes_accumulation)
    chosen = select_backend(problem, backend)
    slots = torch.empty((SWIGLU_AMAX_SLOTS,), dtype=torch.float32, device=x_fp8.device)
    fused = dataclasses.replace(problem, swiglu_probs=probs, swiglu_amax=slots)
    key = (chosen.name, fused.signature())
    fuses = _SWIGLU_AMAX_FUSED.get(key)
    if fuses is None:
        fuses = _SWIGLU_AMAX_FUSED[key] = chosen.can_handle(fused)[0]
    if fuses:
        return chosen.run(fused), slots
    h = chosen.run(problem)
    kernels = triton_kernels("swiglu_fp8") if h.is_cuda else None
    return h, (kernels.swiglu_amax_partials(h, probs) if kernels is not None else None)


def _fp8_forward_tensors(x, w_nk, w_fp8, group_offs, config, num_cu, backend, out_dtype, need_dx, need_dw, delayed,
                         swiglu_probs=None):
    """The forward's GPU work (see :func:`fp8_gemm_forward`)."""
    dtype, margin = config.forward_dtype, config.margin
    # Backward's operands, contiguous along their contraction dims: dgrad reads W as
    # [G, K, N] (contracted over N), wgrad reads x as [K, M] (contracted over tokens).
    w_q, w_scale, w_kn, w_kn_scale = fp8_weight_for(w_nk, w_fp8, config, need_dx)
    rowwise = config.granularity is ScalingGranularity.ROWWISE
    if rowwise and need_dw:  # both copies from two passes over x (not four)
        x_fp8, x_scale, x_km, x_km_scale = quantize_rowwise_layouts(x, dtype, margin, group_offs)
    elif rowwise:
        x_fp8, x_scale = quantize_rowwise(x, dtype, margin)
        x_km = x_km_scale = None
    else:
        x_fp8, x_km, x_scale = quantize_tensorwise_layouts(x, dtype, margin, transposed=need_dw,
                                                           history=delayed and delayed.input)
        x_km_scale = x_scale
    if not need_dx:
        w_kn = w_kn_scale = None
    if swiglu_probs is not None and x.device.type != "meta":
        y, amax = _fc1_with_swiglu_amax(x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu, backend, config,
                                        swiglu_probs)
        return y, w_kn, w_kn_scale, x_km, x_km_scale, amax
    y = _run(GemmKind.M_GROUPED, x_fp8, w_q, x_scale, w_scale, group_offs, out_dtype, num_cu, backend, "fwd", config)
    if swiglu_probs is not None:
        return y, w_kn, w_kn_scale, x_km, x_km_scale, None
    return y, w_kn, w_kn_scale, x_km, x_km_scale


# The FP8 GEMM's host-plan regions: forward; dy's quantization + dgrad; wgrad (a region of its own
# so that W^T's FP8 copy is freed before dW is allocated, as the Python path does); and the whole
# backward in one region where W^T is not freed (the weight cache keeps it, or there is no dgrad).
_FORWARD_REGION = host_plan.Region("fp8 gemm forward")
_DGRAD_REGION = host_plan.Region("fp8 gemm dgrad")
_WGRAD_REGION = host_plan.Region("fp8 gemm wgrad")
_BACKWARD_REGION = host_plan.Region("fp8 gemm dgrad + wgrad")


def through_plan(region: host_plan.Region, static, inputs, compute, histories=(), writes_inputs=False):
    """``compute()`` through ``region`` (``turbo_moe.host_plan``: recorded once per signature, then
    replayed from C++) when its tensors are on a GPU; directly otherwise. ``inputs``: every tensor
    ``compute`` reads or writes that it does not make (None where absent); ``histories``: the
    delayed-scaling ``AmaxHistory`` objects it casts with (their device state joins the inputs;
    a history not yet seeded -- its first cast seeds it in torch ops -- runs directly);
    ``writes_inputs``: ``compute`` writes an input (e.g. adds into a gradient buffer)."""
    first = next((t for t in inputs if t is not None), None)
    live = [h for h in histories if h is not None]
    if first is None or not first.is_cuda or any(h.state is None or h.state.device != first.device for h in live):
        return compute()
    state = tuple(t for h in live for t in (h.state, h.ticket))
    return region((static, len(live)), (*inputs, *state), compute, pure=not (live or writes_inputs))


def fp8_gemm_forward(x, w_nk, w_fp8: Optional[Float8Weight], group_offs, config: Float8Config, num_cu, backend,
                     out_dtype, need_dx: bool, need_dw: bool, delayed: Optional[DelayedScalingState],
                     swiglu_probs: Optional[torch.Tensor] = None):
    """``(y, W^T in FP8, its scale, x token-major in FP8, its scale)``: quantize ``W`` (unless
    ``w_fp8`` has it) and ``x``, run the forward GEMM. On a GPU, a repeated signature replays its
    recorded launches from C++ (``turbo_moe.host_plan``). ``swiglu_probs`` (fc1 of an expert MLP,
    where :func:`fuses_swiglu_amax`): a sixth result, the SwiGLU amax partials of ``y`` (None
    where no kernel makes them: off a GPU)."""
    compute = functools.partial(_fp8_forward_tensors, x, w_nk, w_fp8, group_offs, config, num_cu, backend, out_dtype,
                                need_dx, need_dw, delayed, swiglu_probs)
    cache_key, cache_inputs = cached_weight_parts(w_fp8)
    static = (config, num_cu, backend, out_dtype, need_dx, need_dw, *cache_key)
    inputs = (x, w_nk, group_offs, *cache_inputs)
    if swiglu_probs is not None:  # the key and inputs of a plain forward stay as they were
        static, inputs = (*static, "swiglu amax"), (*inputs, swiglu_probs)
    return through_plan(_FORWARD_REGION, static, inputs, compute, (delayed and delayed.input,))


def cached_weight_inputs(w_fp8: Optional[Float8Weight]) -> tuple:
    """A cached FP8 weight's tensors as host-plan inputs. A transposed scale that is the forward
    scale itself (tensorwise) or a view of its memory (blockwise's 128x128 blocks, which W and W^T
    share) goes in once: each input must own its memory, or the recorded pointers would be
    ambiguous (:func:`cached_weight_key` says which)."""
    return cached_weight_parts(w_fp8)[1]


def cached_weight_parts(w_fp8: Optional[Float8Weight]) -> tuple[tuple, tuple]:
    """``(cached_weight_key(w_fp8), cached_weight_inputs(w_fp8))`` from one overlap test."""
    if w_fp8 is None:
        return (True, False), (None, None, None, None)
    shared = _scale_t_shared(w_fp8)
    return (False, shared), (w_fp8.data, w_fp8.scale, w_fp8.data_t, None if shared else w_fp8.scale_t)


def _scale_t_shared(w_fp8: Float8Weight) -> bool:
    """Whether W^T's scales overlap W's in memory (the same tensor, or a view of its elements).
    Disjoint views of one buffer (a kernel writing both scales into one allocation) stay apart."""
    scale, scale_t = w_fp8.scale, w_fp8.scale_t
    if scale_t is scale:
        return True
    if scale_t is None or scale is None or scale_t.device != scale.device:
        return False
    if scale_t._base is scale or scale._base is scale_t:  # a view of the other's whole tensor
        return True
    (a0, n0), (a1, n1) = host_plan.storage_extent(scale), host_plan.storage_extent(scale_t)
    return a0 < a1 + max(n1, 1) and a1 < a0 + max(n0, 1)


def cached_weight_key(w_fp8: Optional[Float8Weight]) -> tuple:
    return cached_weight_parts(w_fp8)[0]


class GroupedGemmFP8Function(torch.autograd.Function):
    """FP8 grouped GEMM; see the module docstring. ``w`` is always passed here as ``[G, N, K]``."""

    @staticmethod
    def forward(ctx, x, w_nk, group_offs, config: Float8Config, num_cu, backend, out_dtype,
                w_fp8: Optional[Float8Weight] = None, wgrad_target: Optional[WgradTarget] = None,
                grad_handoff: Optional[QuantizedGradHandoff] = None, delayed: Optional[DelayedScalingState] = None):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        probs = grad_handoff.swiglu_probs if grad_handoff is not None and fuses_swiglu_amax(config) else None
        y, w_kn, w_kn_scale, x_km, x_km_scale, *amax = fp8_gemm_forward(
            x, w_nk, w_fp8, group_offs, config, num_cu, backend, out_dtype, need_dx, need_dw, delayed, probs)
        if probs is not None:
            grad_handoff.note_forward_amax(y, amax[0])
        # w itself is saved (a live parameter: no memory) to re-derive W^T if backward runs again
        # (retain_graph); the saved-tensor version check then also catches an in-place change of w.
        grad_history = delayed and delayed.grad_output
        if grad_handoff is not None:
            grad_handoff.expect(config, need_dx, need_dw, grad_history)
        stash_for_fp8_gemm_backward(ctx, w_kn, config, num_cu, backend, x.dtype, w_nk.dtype, wgrad_target,
                                    grad_handoff, grad_history, w_fp8)
        ctx.save_for_backward(w_nk if need_dx else None, w_kn_scale, x_km, x_km_scale, group_offs)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: one clear error, never a wrong one
    def backward(ctx, dy):
        w_nk, w_kn_scale, x_km, x_km_scale, group_offs = ctx.saved_tensors
        dx, dw = fp8_gemm_backward(ctx, dy, w_nk, w_kn_scale, x_km, x_km_scale, group_offs,
                                   ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None, None, None, None, None, None


def _prepare(x, w, group_lens, group_offs, trans_b):
    num_groups, num_rows, _, _ = check_operands(x, w, trans_b)
    offs = resolve_group_offs(group_lens, group_offs, num_groups, num_rows, x.device)
    return offs


def resolve_call_options(config, num_cu, out_dtype, delayed_state=None) -> Float8Config:
    """The FP8 entry points' shared checks: ``config`` (None: ``Float8Config()``), ``num_cu``,
    ``out_dtype`` and ``delayed_state`` (present exactly when the config is delayed), each named
    when wrong; returns the config."""
    config = Float8Config() if config is None else config
    if not isinstance(config, Float8Config):
        raise TypeError(f"config must be a turbo_moe.Float8Config, got {type(config).__name__}")
    if config.delayed and not isinstance(delayed_state, DelayedScalingState):
        raise ValueError("config.strategy='delayed' needs delayed_state=, the amax histories the scales come from "
                         "(a turbo_moe.DelayedScalingState kept across calls; GroupedLinearFP8 owns one), got "
                         f"{type(delayed_state).__name__}")
    if delayed_state is not None and not config.delayed:
        raise ValueError(f"delayed_state= is for Float8Config(strategy='delayed'), got strategy="
                         f"{config.strategy.value!r}")
    _check_num_cu(num_cu)
    if out_dtype is not None and out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return config


def _check_num_cu(num_cu):
    if num_cu is not None and (isinstance(num_cu, bool) or not isinstance(num_cu, int) or num_cu < 1):
        raise ValueError(f"num_cu must be None or a positive int (CUs/SMs the kernel may use), got {num_cu!r}")


@torch.compiler.disable
def grouped_gemm_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    group_lens: Optional[torch.Tensor] = None,
    *,
    trans_b: bool = True,
    config: Optional[Float8Config] = None,
    num_cu: Optional[int] = None,
    backend: str = "auto",
    group_offs: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    delayed_state: Optional[DelayedScalingState] = None,
) -> torch.Tensor:
    """Differentiable FP8 grouped GEMM: ``y[rows of g] = x[rows of g] @ (W[g]^T if trans_b else W[g])``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 tokens sorted by group.
        w: ``[G, N, K]`` (``trans_b=True``) or ``[G, K, N]``; bf16/fp16/fp32.
        group_lens: int64 ``[G]`` tokens per group, on x's device. Or pass ``group_offs``
            (int64 ``[G+1]``, starting at 0, ending at M). Never read on the host for GPU data.
        config: the FP8 recipe (default ``Float8Config()``: e4m3, tensorwise, current scaling).
        num_cu: cap on the SMs/CUs the kernels occupy (persistent grid), or None for all.
        backend: ``"auto"``, ``"flydsl"``, ``"triton"`` or ``"torch"``.
        out_dtype: dtype of ``y``; default, as ``F.linear``: the autocast dtype under
            ``torch.autocast`` for x's device, else ``x.dtype``.
        delayed_state: with ``config.strategy="delayed"`` (and only then), the
            ``DelayedScalingState`` whose amax histories scale x and dy; keep one per layer
            across calls (``GroupedLinearFP8`` does).
    """
    offs = _prepare(x, w, group_lens, group_offs, trans_b)
    return _grouped_gemm_fp8_resolved(x, w, offs, trans_b=trans_b, config=config, num_cu=num_cu,
                                      backend=backend, out_dtype=out_dtype, delayed_state=delayed_state)


@torch.compiler.disable
def grouped_gemm_fp8_with_offs(x, w, offs, *, trans_b=True, config=None, num_cu=None, backend="auto", out_dtype=None,
                               w_fp8: Optional[Float8Weight] = None,
                               delayed_state: Optional[DelayedScalingState] = None):
    """``grouped_gemm_fp8`` on int64 ``[G+1]`` offsets ``offs``, checked (and on a GPU clamped) as
    ``grouped_gemm_fp8`` checks its ``group_offs``.

    ``w_fp8``: the weight already quantized by ``quantize_weight`` with this config (a cache the
    caller keeps valid), skipping its quantization; None quantizes ``w`` here.
    """
    num_groups, num_rows, _, _ = check_operands(x, w, trans_b)
    offs = check_group_offs(offs, num_groups, num_rows, x.device, name="offs")
    return _grouped_gemm_fp8_resolved(x, w, offs, trans_b=trans_b, config=config, num_cu=num_cu,
                                      backend=backend, out_dtype=out_dtype, w_fp8=w_fp8, delayed_state=delayed_state)


@torch.compiler.disable
def _grouped_gemm_fp8_resolved(x, w, offs, *, trans_b=True, config=None, num_cu=None, backend="auto", out_dtype=None,
                               w_fp8: Optional[Float8Weight] = None, wgrad_target: Optional[WgradTarget] = None,
                               grad_handoff: Optional[QuantizedGradHandoff] = None,
                               delayed_state: Optional[DelayedScalingState] = None):
    """``grouped_gemm_fp8_with_offs`` on operands and offsets already checked (by ``check_operands``
    and ``checks.resolve_group_offs``): for callers that resolved them once for several uses.
    ``wgrad_target``: see ``WgradTarget``; ``grad_handoff``: see ``QuantizedGradHandoff``, or under
    the fine-grained recipes ``fine_grained.autograd.GradRowsHandoff`` (a ``QuantizedGradHandoff``
    is ignored there: they quantize their own gradient)."""
    config = resolve_call_options(config, num_cu, out_dtype, delayed_state)
    out_dtype = _autocast_out_dtype(x, out_dtype)
    w_nk = w if trans_b else w.transpose(1, 2)
    if config.fine_grained:  # blockwise / mxfp8: turbo_moe.fine_grained
        from .fine_grained.autograd import GradRowsHandoff, grouped_gemm_fine
        return grouped_gemm_fine(x, w_nk, offs, config=config, num_cu=num_cu, backend=backend, out_dtype=out_dtype,
                                 w_fp8=w_fp8, wgrad_target=wgrad_target,
                                 grad_rows=grad_handoff if isinstance(grad_handoff, GradRowsHandoff) else None)
    if grad_handoff is not None and not isinstance(grad_handoff, QuantizedGradHandoff):
        raise TypeError(f"grad_handoff under {config.granularity.value} scaling must be a QuantizedGradHandoff, got "
                        f"{type(grad_handoff).__name__}")
    return GroupedGemmFP8Function.apply(x, w_nk, offs, config, num_cu, backend, out_dtype, w_fp8, wgrad_target,
                                        grad_handoff, delayed_state)


@torch.compiler.disable
def grouped_wgrad_fp8(
    dy: torch.Tensor,
    x: torch.Tensor,
    group_offs: torch.Tensor,
    *,
    config: Optional[Float8Config] = None,
    num_cu: Optional[int] = None,
    backend: str = "auto",
    out_dtype: Optional[torch.dtype] = None,
    main_grad: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The wgrad GEMM alone, ``dW[g] = dy[rows of g]^T @ x[rows of g]`` -> ``[G, N, K]``, quantized
    exactly as ``grouped_gemm_fp8``'s backward quantizes it (for delayed-wgrad schedules).

    ``group_offs``: int64 ``[G+1]`` offsets on the data's device, checked (and on a GPU clamped)
    as ``grouped_gemm_fp8`` checks its ``group_offs``.
    ``out_dtype`` defaults to dy's dtype.
    ``main_grad``: a float32 ``[G, N, K]`` buffer (Megatron's fp32 ``main_grad``): the kernel's
    epilogue adds its fp32 result into it (never rounded narrower, no separate add; an expert with
    no tokens leaves its slice unchanged) and it is returned.
    """
    check_wgrad_operands(dy, x)
    group_offs = check_group_offs(group_offs, None, x.shape[0], x.device)
    return _grouped_wgrad_fp8_resolved(dy, x, group_offs, config=config, num_cu=num_cu, backend=backend,
                                       out_dtype=out_dtype, main_grad=main_grad)


@torch.compiler.disable
def _grouped_wgrad_fp8_resolved(dy, x, group_offs, *, config=None, num_cu=None, backend="auto", out_dtype=None,
                                main_grad=None):
    """``grouped_wgrad_fp8`` on operands and offsets already checked (see ``_grouped_gemm_fp8_resolved``)."""
    if main_grad is not None:
        expected = (group_offs.shape[0] - 1, dy.shape[1], x.shape[1])
        if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32:
            raise TypeError(f"main_grad must be a float32 tensor, got {getattr(main_grad, 'dtype', type(main_grad))}")
        if tuple(main_grad.shape) != expected or main_grad.device != dy.device:
            raise ValueError(f"main_grad must be [G, N, K] = {list(expected)} on {dy.device}, "
                             f"got {list(main_grad.shape)} on {main_grad.device}")
        if out_dtype not in (None, torch.float32):
            raise ValueError(f"out_dtype={out_dtype} conflicts with main_grad (accumulation is in float32)")
        out_dtype = torch.float32
    config = Float8Config() if config is None else config
    if isinstance(config, Float8Config) and config.delayed:
        raise ValueError("grouped_wgrad_fp8 quantizes dy and x afresh, with no amax history: config.strategy must be "
                         "'current' (a delayed-scaling layer makes dW in its GEMM's own backward, or queues it "
                         "through WgradTarget(defer=...))")
    config = resolve_call_options(config, num_cu, out_dtype)
    if config.fine_grained:  # blockwise / mxfp8: turbo_moe.fine_grained
        from .fine_grained import grouped_wgrad_fine
        return grouped_wgrad_fine(dy, x, group_offs, config=config, num_cu=num_cu, backend=backend,
                                  out_dtype=out_dtype, main_grad=main_grad)
    rowwise = config.granularity is ScalingGranularity.ROWWISE
    dy_t, dy_scale = _token_major_operand(dy, group_offs, config.grad_dtype, config.margin, rowwise)
    x_t, x_scale = _token_major_operand(x, group_offs, config.forward_dtype, config.margin, rowwise)
    result = _run(GemmKind.K_GROUPED, dy_t, x_t, dy_scale, x_scale, group_offs,
                  dy.dtype if out_dtype is None else out_dtype, num_cu, backend, "wgrad", config,
                  out=main_grad, accumulate=main_grad is not None)
    if main_grad is not None and result is not main_grad:
        raise RuntimeError(f"backend={backend!r} returned a new tensor instead of accumulating into main_grad")
    return result


@torch.compiler.disable
def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    group_lens: Optional[torch.Tensor] = None,
    *,
    trans_b: bool = True,
    config: None = None,
    num_cu: Optional[int] = None,
    backend: str = "auto",
    group_offs: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """High-precision grouped GEMM with ``grouped_gemm_fp8``'s signature, for comparison.

    Computes in x's dtype through torch (``torch._grouped_mm`` on CUDA bf16 when present, which
    is capturable; otherwise a per-group loop that reads the offsets on the host). ``config`` must
    be None and ``num_cu`` is ignored here: no FP8 kernel runs.
    """
    if config is not None:
        raise ValueError("grouped_gemm is the high-precision path; config must be None (use grouped_gemm_fp8)")
    if backend not in ("auto", "torch"):
        raise ValueError(f"grouped_gemm runs on torch only; backend={backend!r} is not 'auto' or 'torch'")
    _check_num_cu(num_cu)
    offs = _prepare(x, w, group_lens, group_offs, trans_b)
    w_nk = w if trans_b else w.transpose(1, 2)
    out_dtype = _autocast_out_dtype(x, out_dtype)
    use_grouped_mm = (
        x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        and x.shape[1] % 8 == 0 and w_nk.shape[1] % 8 == 0  # CUTLASS wants 16-byte aligned rows
    )
    if x.device.type == "meta":  # shape inference (and autograd's shapes); no values to loop over
        return (x @ w_nk[0].to(x.dtype).T).to(out_dtype)
    if use_grouped_mm:
        y = torch._grouped_mm(x, w_nk.transpose(1, 2), offs=offs[1:].to(torch.int32))
        return y.to(out_dtype)
    bounds = offs.tolist()
    pieces = [x[bounds[g]:bounds[g + 1]] @ w_nk[g].to(x.dtype).T for g in range(w_nk.shape[0])]
    y = torch.cat(pieces) if pieces else x.new_zeros(0, w_nk.shape[1])
    return y.to(out_dtype)
