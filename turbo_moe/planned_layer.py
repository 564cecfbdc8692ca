"""An FP8 grouped GEMM's forward and backward as one C++ autograd node, once both are host plans.

``turbo_moe.host_plan`` replays each region's launches from C++, but around them a
``GroupedLinearFP8`` call still ran Python: the module's checks, the offsets, the autograd
``Function``'s forward and backward, and the regions' signature keys. On the GPU machines' slow
CPUs that was most of a layer's host time (``docs/results/h100_host_plans.md``). Here, once a
call signature's plans all exist -- the offsets kernel (when ``group_lens`` come with the call),
the forward, and the backward (one region, or dgrad and wgrad) -- the layer is registered with the
extension as a *planned layer* (``add_layer`` in ``csrc/launch_plan.cpp``): a table of values
(x, w, the offsets source, the weight's FP8 copies, then each step's outputs) and the steps that
read and write it. A later call with the same signature is one C++ call (``apply_layer``): its
forward replays the steps and saves what backward reads; its ``grad_fn`` is a C++ node whose
backward replays the backward steps without entering Python.

What makes it the Python path, bit for bit: every step is a plan the Python path recorded and
verified, looked up by exactly the key the Python path would compute for that call (the facts of
the step's inputs are derived from the earlier steps' recorded outputs: shapes, strides, dtypes,
alignment); what is saved, held and released is what ``GroupedGemmFP8Function`` saves, holds and
releases. What no plan covers goes to the Python backward (:func:`_python_backward`): a second
backward (``retain_graph``) after W^T's FP8 copy was released, a gradient laid out unlike the
recorded one, and ``create_graph`` (which must stay once-differentiable). Dispatch records and
replay counts of the C++ backward are accounted by ``host_plan.flush_layer_replays``.

Served: tensorwise (current or delayed scaling) or rowwise, with or without the FP8 weight cache,
any ``requires_grad`` combination, and a float32 ``main_grad`` the wgrad accumulates into
(``WgradTarget``: ``GroupedLinearFP8`` and Megatron's ``TurboGroupedLinear``); the blockwise and
MXFP8 recipes through ``turbo_moe.fine_grained.planned_layer`` (their own table). A deferred wgrad
keeps the Python ``Function``; the SwiGLU handoff is the planned MLP's (``turbo_moe.planned_mlp``).
``TURBO_MOE_PLANNED_LAYERS=0`` turns this off.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import host_plan
from .autograd import (_BACKWARD_REGION, _DGRAD_REGION, _FORWARD_REGION, _WGRAD_REGION, WgradTarget,
                       cached_weight_inputs, cached_weight_key, fp8_gemm_backward, stash_for_fp8_gemm_backward)
from .checks import OFFSETS_REGION, offsets_region_key
from .delayed_scaling import AmaxHistory

__all__ = ["enabled", "set_enabled", "PlannedLayer", "plan_layer", "apply_layer", "cached_plan", "known_unplannable",
           "KeepsPlannedLayers", "NOT_PLANNABLE"]

_ENABLED = os.environ.get("TURBO_MOE_PLANNED_LAYERS", "1") not in ("", "0")


def enabled() -> bool:
    return _ENABLED and host_plan.enabled()


def set_enabled(flag: bool) -> bool:
    """Turn planned layers on or off (tests, benchmarks); returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(flag)
    return previous


# The value table (csrc/launch_plan.cpp, Layer): apply_layer's arguments, then what the steps make.
X, W, SRC, CACHE = 0, 1, 2, (3, 4, 5, 6)  # SRC: the offsets, or group_lens when the offsets are a step
X_HISTORY, DY_HISTORY = (7, 8), (9, 10)  # delayed scaling: each AmaxHistory's (state, ticket)
MAIN_GRAD, PLACEHOLDER = 11, 12  # a float32 buffer wgrad accumulates into (WgradTarget), the weight's gradient then
NUM_ARGS = 13
OFFS_MADE = 13
Y, W_KN, W_KN_SCALE, X_KM, X_KM_SCALE = 14, 15, 16, 17, 18
DY, DX, DW, DY_T, DY_T_SCALE = 19, 20, 21, 22, 23
NUM_VALUES = 24
# Where the cache's W^T (Float8Weight.data_t) sits among the forward region's inputs
# (x, w, offsets, *cached_weight_inputs(w_fp8), ...).
_CACHED_W_KN_POSITION = 5


class PlannedLayer(NamedTuple):
    layer_id: int
    regions: Tuple[Tuple[host_plan.Region, object], ...]  # the forward steps' (region, plan): counted per call
    # (x, w_nk, src, w_fp8, delayed, main_grad, placeholder) -> the layer's arguments in its table's
    # order (the fine-grained recipes' table is laid out by turbo_moe.fine_grained.planned_layer)
    arguments: Callable


class _Backward(NamedTuple):
    """What the Python backward needs of a layer (:func:`_python_backward`)."""
    saved: Tuple[int, ...]
    offs: int
    kept: bool
    need_dx: bool
    need_dw: bool
    config: object
    num_cu: Optional[int]
    backend: str
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    delayed: bool
    main_grad: bool


NOT_PLANNABLE = object()  # a signature some of whose regions keep their Python path for good
calls = 0  # forwards run as planned layers (tests, benchmarks)
fallbacks = 0  # backwards of planned layers (and MLPs) that ran the Python path (_python_backward)
_BACKWARDS: Dict[int, object] = {}  # layer id -> its Python backward (register_backward)
_LAYER_IDS: Dict[tuple, int] = {}  # add_extension_layer's identity of a layer -> its extension id
_FALLBACK_SET = False


def _spec_fact(spec, input_facts, allocs, device):
    """The signature fact of a plan's output, as a replay makes it (allocations are fresh, so
    16-byte aligned)."""
    if spec is None:
        return None
    if spec[0] == "input":
        return input_facts[spec[1]]
    shape, strides, dtype = allocs[spec[1]][:3]
    if spec[0] == "alloc":
        return (torch.Size(shape), tuple(strides), dtype, device, 0)
    return (torch.Size(spec[2]), tuple(spec[3]), dtype, device, spec[4] * dtype.itemsize % 16)


class _Builder:
    """Looks up each step's plan by the key the Python path computes, with the facts of values the
    earlier steps make derived from their recorded outputs."""

    def __init__(self, device: int):
        self.device = device
        self.facts: Dict[int, object] = {}
        self.steps = []
        self.regions = []
        self.missing = False  # a plan not recorded yet
        self.refused = False  # a plan that never will be

    def step(self, region: host_plan.Region, static_key, values, outputs, release=()):
        """``values``: the value index of each region input (None: absent); ``outputs``: where
        each region output goes (-1: dropped). Returns whether the plan exists."""
        if self.missing or self.refused:
            return False
        input_facts = tuple(None if v is None else self.facts.get(v) for v in values)
        key = (static_key, *input_facts)
        plan = region.plan_for(key)
        if plan is None:
            if region.refused(key):
                self.refused = True
            else:
                self.missing = True
            return False
        positions = plan.tensor_positions
        self.steps.append((plan.plan_id, [values[p] for p in positions], list(outputs), list(release)))
        self.regions.append((region, plan))
        for spec, out in zip(plan.outputs, outputs):
            if out != -1:
                self.facts[out] = _spec_fact(spec, input_facts, plan.allocs, self.device)
        return True


def plan_layer(x, w_nk, src, from_lens: bool, w_fp8, config, num_cu, backend, out_dtype, need_dx: bool,
               need_dw: bool, forward_only: bool = False, delayed=None, main_grad=None, placeholder=None):
    """The :class:`PlannedLayer` for this call's signature, None if some plan is not recorded yet,
    or ``NOT_PLANNABLE``. ``src``: the offsets (``from_lens`` False: already checked) or the
    call's ``group_lens`` (the offsets kernel becomes the first step). ``need_dx``/``need_dw``:
    the inputs' requires_grad (what the forward prepares for backward, as the Python Function's
    needs_input_grad); ``forward_only``: grad mode is off, no backward will run (nor was one
    recorded). ``delayed``: the ``DelayedScalingState`` under delayed scaling, its histories
    seeded on x's device (a history is a region input through ``autograd.through_plan``).
    ``main_grad``: a float32 buffer the wgrad accumulates into (``autograd.WgradTarget``: Megatron's
    ``gradient_accumulation_fusion``); the weight's gradient is then ``placeholder`` (None: none).
    The fine-grained recipes' layer is ``turbo_moe.fine_grained.planned_layer``'s."""
    if config.fine_grained:
        from .fine_grained import planned_layer as fine_grained_layer

        return fine_grained_layer.plan_layer(x, w_nk, src, from_lens, w_fp8, config, num_cu, backend, out_dtype,
                                             need_dx, need_dw, forward_only, delayed, main_grad, placeholder)
    ext = host_plan._extension()
    if ext is None:
        return NOT_PLANNABLE
    b = _Builder(x.get_device())
    cache = cached_weight_inputs(w_fp8)
    histories = _history_tensors(delayed)
    for v, t in ((X, x), (W, w_nk), (SRC, src), *zip(CACHE, cache), *zip(X_HISTORY + DY_HISTORY, histories),
                 (MAIN_GRAD, main_grad)):
        b.facts[v] = host_plan.fact(t)
    out = MAIN_GRAD if main_grad is not None else None
    live = 1 if delayed is not None else 0  # through_plan's count of live histories per region
    x_history = X_HISTORY if delayed is not None else ()
    dy_history = DY_HISTORY if delayed is not None else ()
    forward_steps = 1
    offs = SRC
    if from_lens:
        num_rows = x.shape[0]
        b.step(OFFSETS_REGION, offsets_region_key(num_rows, True), (SRC,), (OFFS_MADE,))
        offs, forward_steps = OFFS_MADE, 2
    # autograd.fp8_gemm_forward's region and key (through_plan appends each live history's tensors).
    static = ((config, num_cu, backend, out_dtype, need_dx, need_dw, *cached_weight_key(w_fp8)), live)
    b.step(_FORWARD_REGION, static,
           (X, W, offs, *(c if t is not None else None for c, t in zip(CACHE, cache)), *x_history),
           (Y, W_KN, W_KN_SCALE, X_KM, X_KM_SCALE))
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    y_fact = b.facts[Y]
    b.facts[DY] = (y_fact[0], _contiguous_strides(y_fact[0]), y_fact[2], y_fact[3], 0)  # backward's dy.contiguous()
    # W^T's FP8 copy is the cache's (kept) when the forward passed it through from its inputs.
    forward_plan = b.regions[-1][1]
    kept = forward_plan.outputs[1] == ("input", _CACHED_W_KN_POSITION)
    x_dtype, w_dtype = x.dtype, w_nk.dtype
    if forward_only:
        need_dx = need_dw = kept = False  # nothing saved or held: no node is made
    else:
        gemm_backward_steps(b, config, num_cu, backend, live, x_dtype, w_dtype, need_dx, need_dw, kept,
                            (DY, None, None, None), W_KN, W_KN_SCALE, X_KM, X_KM_SCALE, offs, out, dy_history,
                            (DX, DW), (DX, DY_T, DY_T_SCALE), DW)
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    b.steps[forward_steps:] = release_after_last_read(b.steps[forward_steps:], DY)
    saved = () if forward_only else tuple(
        v for v in ((W,) if need_dx else ()) + (W_KN_SCALE, X_KM, X_KM_SCALE, offs) + ((W_KN,) if kept else ())
        + dy_history if b.facts.get(v) is not None)
    held = W_KN if need_dx and not kept else -1
    backward = _Backward(saved, offs, kept, need_dx, need_dw, config, num_cu, backend, x_dtype, w_dtype,
                         delayed is not None, main_grad is not None)
    # main_grad and the placeholder stay with the node without version checks: DDP's gradient
    # buffer is one storage whose version moves with every other parameter's gradient.
    kept_args = [] if forward_only or main_grad is None else (
        [MAIN_GRAD] + ([PLACEHOLDER] if placeholder is not None else []))
    grads = [-1] * NUM_ARGS
    grads[X] = DX if need_dx else -1
    grads[W] = -1 if not need_dw else DW if main_grad is None else PLACEHOLDER if placeholder is not None else -1
    layer_id = add_extension_layer(ext, _LAYER_IDS, NUM_VALUES, NUM_ARGS, b.steps[:forward_steps],
                                   b.steps[forward_steps:], saved, [] if held == -1 else [held], kept_args, Y, DY,
                                   grads, _linear_backward, backward)
    if layer_id is None:
        return NOT_PLANNABLE
    return PlannedLayer(layer_id, tuple(b.regions[:forward_steps]), _arguments)


def add_extension_layer(ext, layer_ids: dict, num_values: int, num_args: int, forward, backward, saved, held, kept, y,
                        dy, grads, python_backward, info) -> Optional[int]:
    """The extension layer (``add_layer`` in ``csrc/launch_plan.cpp``) of these steps and value
    lists, registered once per distinct set in ``layer_ids`` (its module's) and shared by every
    module and signature that maps to it (a module's own cache of layers is bounded and may be
    rebuilt), with ``python_backward(info, dy, table, create_graph)`` as its Python backward; None
    where the extension refuses it."""
    identity = (tuple((plan, tuple(ins), tuple(outs), tuple(rel)) for plan, ins, outs, rel in (*forward, *backward)),
                len(forward), tuple(saved), tuple(held), tuple(kept), tuple(grads), info)
    layer_id = layer_ids.get(identity)
    if layer_id is None:
        error, layer_id = ext.add_layer(num_values, num_args, list(forward), list(backward), list(saved), list(held),
                                        list(kept), y, dy, list(grads))
        if error:
            return None
        layer_ids[identity] = layer_id
        register_backward(layer_id, functools.partial(python_backward, info))
    _ensure_fallback(ext)
    return layer_id


def gemm_backward_steps(b: _Builder, config, num_cu, backend, live: int, x_dtype, w_dtype, need_dx: bool,
                        need_dw: bool, kept: bool, dy_in, w_kn, w_kn_scale, x_km, x_km_scale, offs, out, dy_history,
                        fused_out, dgrad_out, dw) -> None:
    """``autograd.fp8_gemm_backward``'s regions and keys for one FP8 GEMM (no deferred wgrad), as
    steps of ``b``: one region when nothing is freed between dgrad and wgrad (W^T is the cache's, or
    there is no dgrad), else dgrad (releasing W^T) then wgrad. Value indices: ``dy_in`` the (dy,
    handed rows, handed token-major, handed scale) inputs; ``out`` the float32 buffer the wgrad
    accumulates into (``WgradTarget``) or None; ``fused_out`` / ``dgrad_out`` where the one-region
    backward's (dx, dW) and dgrad's (dx, dy token-major, its scale) go; ``dw`` the wgrad's output."""
    # autograd._wgrad_destination: a float32 buffer is the wgrad's out=, accumulated in its epilogue.
    dw_dtype = torch.float32 if out is not None else w_dtype
    if need_dw and (kept or not need_dx):
        b.step(_BACKWARD_REGION, ((config, num_cu, backend, x_dtype, need_dx, dw_dtype), live),
               (*dy_in, w_kn, w_kn_scale, x_km, x_km_scale, offs, out, *dy_history), fused_out)
        return
    if not (need_dx or need_dw):
        return
    b.step(_DGRAD_REGION, ((config, num_cu, backend, x_dtype, need_dx, need_dw), live),
           (*dy_in, w_kn, w_kn_scale, offs, *dy_history), dgrad_out, release=(w_kn,))
    if need_dw:
        dy_t, dy_t_scale = dgrad_out[1], dgrad_out[2]
        made = b.facts.get(dy_t) is not None
        b.step(_WGRAD_REGION, ((config, num_cu, backend, dw_dtype), 0),
               (None if made else dy_in[0], dy_t if made else None, dy_t_scale if made else None, x_km, x_km_scale,
                offs, out), (dw,))


def release_after_last_read(steps: list, value: int) -> list:
    """``steps`` with ``value`` released by the last step that reads it. For a layer's dy: the
    node's backward took the engine's reference (``csrc/launch_plan.cpp``), so released by the
    step that quantizes it, dy is freed after its cast launch, before dgrad's output is allocated
    (a Python ``Function`` holds its gradient to the end of its backward)."""
    for k in reversed(range(len(steps))):
        plan, inputs, outputs, release = steps[k]
        if value in inputs:
            steps[k] = (plan, inputs, outputs, sorted({*release, value}))
            break
    return steps


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _history_tensors(delayed) -> tuple:
    if delayed is None:
        return (None,) * 4
    return (delayed.input.state, delayed.input.ticket, delayed.grad_output.state, delayed.grad_output.ticket)


def apply_layer(layer: PlannedLayer, x, w_nk, src, w_fp8, delayed=None, main_grad=None,
                placeholder=None) -> torch.Tensor:
    """The layer's forward (one C++ call); the result's ``grad_fn`` runs its backward in C++."""
    global calls
    calls += 1
    return run_extension_layer(layer.layer_id, layer.regions, x.get_device(),
                               layer.arguments(x, w_nk, src, w_fp8, delayed, main_grad, placeholder))


def _arguments(x, w_nk, src, w_fp8, delayed, main_grad, placeholder) -> list:
    """The per-tensor layer's arguments (its table's first ``NUM_ARGS`` values) for one call."""
    return [x, w_nk, src, *cached_weight_inputs(w_fp8), *_history_tensors(delayed), main_grad, placeholder]


def run_extension_layer(layer_id: int, forward_regions, device: int, args) -> torch.Tensor:
    """``apply_layer`` of the extension on ``args`` (its value table's arguments, None where
    absent), on the current stream of ``device``; the forward steps' regions count a replay and
    repeat their host-side records, as a Python-path replay does."""
    host_plan.flush_layer_replays()
    for region, plan in forward_regions:
        region._replays += 1
        for effect in plan.effects:
            effect()
    return host_plan._EXT.apply_layer(layer_id, host_plan._raw_stream(device), args)


def histories_ready(delayed, x: torch.Tensor, grad: bool) -> bool:
    """Whether a call under ``delayed`` (a ``DelayedScalingState``, or None: current scaling) can
    be planned: its amax histories hold their state on x's device (what a replayed region reads;
    the dy history only when a backward will run). Else the Python path seeds (or moves) them."""
    if delayed is None:
        return True

    def seeded(history):
        return history.state is not None and history.state.device == x.device

    return seeded(delayed.input) and (not grad or seeded(delayed.grad_output))


def known_unplannable(cache: dict, key, static) -> bool:
    """Whether ``cache`` (see :func:`cached_plan`) already says this signature keeps the Python
    path: a caller checks it before side effects that the Python path would repeat."""
    found = cache.get(key)
    return found is not None and found[0] == static and found[1] is NOT_PLANNABLE


class KeepsPlannedLayers:
    """Mixin of the modules that keep planned layers per call signature (``_planned``): those are
    extension ids of this process, so pickling and ``copy.deepcopy`` leave them out (a copy plans
    afresh), and an object pickled before it had them gets an empty cache."""

    def __getstate__(self):
        state = super().__getstate__()
        state["_planned"] = {}
        return state

    def __setstate__(self, state):
        state.setdefault("_planned", {})
        super().__setstate__(state)


def cached_plan(cache: dict, key, static, build):
    """A module's planned layer (or MLP) for a call signature: ``cache[key]`` holds
    ``(static, layer or NOT_PLANNABLE)``, rebuilt by ``build()`` when missing or made under other
    ``static`` settings (recipe, backend, the plans' generation). Returns the layer, or None for
    the Python path (a plan not recorded yet, or a signature never planned). Bounded: a module
    whose signatures keep changing starts its cache afresh."""
    found = cache.get(key)
    if found is None or found[0] != static:
        layer = build()
        if layer is None:  # not all recorded yet
            return None
        if len(cache) >= 64:
            cache.clear()
        found = cache[key] = (static, layer)
    return None if found[1] is NOT_PLANNABLE else found[1]


def _ensure_fallback(ext) -> None:
    global _FALLBACK_SET
    if not _FALLBACK_SET:
        ext.set_layer_fallback(_python_backward)
        host_plan.note_layer_use()
        _FALLBACK_SET = True


_ONCE = b"trying to differentiate twice a function that was marked with @once_differentiable"


def register_backward(layer_id: int, backward) -> None:
    """``backward(dy, table, create_graph)``: the Python path's backward of an extension layer,
    given its value table as the C++ node's backward found it (a list: the saved, held and kept
    values at their indices, None elsewhere and where a held value was released), returning one
    gradient (or None) per argument."""
    _BACKWARDS[layer_id] = backward


def _python_backward(layer_id: int, dy, table, create_graph: bool):
    """The Python path's backward for what a layer's plans do not cover (module docstring);
    called by the C++ node."""
    global fallbacks
    fallbacks += 1
    return _BACKWARDS[layer_id](dy, table, create_graph)


def once_differentiable(grads, dy, create_graph: bool):
    """``grads`` as ``torch.autograd.function.once_differentiable`` leaves them under
    ``create_graph``: differentiating them again raises."""
    if not (create_graph and dy.requires_grad):
        return grads
    present = [k for k, t in enumerate(grads) if t is not None]
    outputs = torch._C._functions.DelayedError(_ONCE, len(present))(
        *(grads[k].detach().requires_grad_() for k in present))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = list(grads)
    for k, t in zip(present, outputs):
        grads[k] = t
    return grads


def history_from(config, state, ticket) -> Optional[AmaxHistory]:
    """The ``AmaxHistory`` whose device tensors a call passed (a layer's table holds the tensors,
    the Python path's functions take the object); None where the call had none."""
    if state is None:
        return None
    history = AmaxHistory(config.amax_history_len, config.amax_compute_algo == "most_recent")
    history.state, history.ticket = state, ticket
    return history


def wgrad_target_from(main_grad, placeholder) -> Optional[WgradTarget]:
    """The ``WgradTarget`` a call's ``main_grad`` and placeholder stood for (None: no main_grad)."""
    if main_grad is None:
        return None
    return WgradTarget(buffer=lambda: main_grad, placeholder=lambda: placeholder)


def _linear_backward(info: _Backward, dy, values, create_graph: bool):
    """A grouped linear's Python-path backward, from its value table (W^T None once released)."""
    # What GroupedGemmFP8Function's forward leaves on its ctx, through the same function; kept
    # (W^T is the cache's) is known from the layer, not from a cached weight object.
    ctx = types.SimpleNamespace()
    stash_for_fp8_gemm_backward(ctx, values[W_KN], info.config, info.num_cu, info.backend, info.x_dtype, info.w_dtype,
                                wgrad_target_from(values[MAIN_GRAD], values[PLACEHOLDER]),
                                grad_history=history_from(info.config, *(values[v] for v in DY_HISTORY)))
    ctx.w_kn_kept = info.kept
    with torch.no_grad():
        dx, dw = fp8_gemm_backward(ctx, dy, values[W], values[W_KN_SCALE], values[X_KM], values[X_KM_SCALE],
                                   values[info.offs], info.need_dx, info.need_dw)
    grads = [None] * NUM_ARGS
    grads[X], grads[W] = once_differentiable([dx, dw], dy, create_graph)
    return grads
