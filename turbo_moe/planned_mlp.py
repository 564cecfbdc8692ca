"""An expert MLP's forward and backward -- fc1, the routing-weighted SwiGLU fused into fc2's FP8
input, fc2, and fc1's output gradient handed back in FP8 -- as one C++ autograd node.

``turbo_moe.planned_layer`` made one grouped linear a C++ call with a C++ backward node. An expert
MLP on the per-tensor FP8 path is two Python ``Function``s (``GroupedGemmFP8Function`` for fc1,
``swiglu.GroupedSwiGLUGemmFP8Function`` for fc2) tied by a Python ``QuantizedGradHandoff``, with
Megatron's ``main_grad`` accumulation (``WgradTarget``) on both: that is where a Megatron MoE
training step spent its experts' host time. Here the whole MLP is one extension layer
(``csrc/launch_plan.cpp``): its value table holds the arguments (x, both weights, the routing
weights, the offsets or group_lens, both weights' FP8 caches, both ``main_grad`` buffers and their
placeholders, the delayed-scaling histories) and what the steps make; its steps are the regions'
own plans, looked up by exactly the keys the Python path computes for that call:

* forward: the offsets kernel (with ``group_lens``), fc1's forward, the SwiGLU + fc2 forward;
* backward: fc2's dgrad and wgrad (one region, or two with W^T released between them, as
  ``autograd.fp8_gemm_backward`` chooses), the SwiGLU backward writing ``dh``'s FP8 layouts (the
  handoff: inside the node ``dh`` is just a value of the table, no placeholder travels), fc1's
  dgrad and wgrad reading them. With ``main_grad`` the wgrad steps accumulate into it (float32, in
  the kernel's epilogue) and the weight's gradient is its placeholder, as in the Python path.

What the Python path saves, holds and releases is kept the same way: the weights and routing
weights are saved (autograd's version checks), W^T's FP8 copies are held for the first backward
and released after dgrad, and every intermediate (fc1's output ``h``, the FP8 copies) is kept by the
node only until the backward step that reads it last -- fc2's saved values are gone before fc1's
wgrad allocates, as when autograd frees fc2's ``Function`` first. What no plan covers (a second
backward after W^T was released, a misaligned gradient, ``create_graph``) runs
:func:`_mlp_backward`, the Python path's functions on the table's values.

Served: per-tensor scaling (current or delayed) and rowwise where both linears' inputs need
gradients, with or without the FP8 weight caches and ``main_grad`` (float32) targets, no bias; the
blockwise and MXFP8 recipes through ``turbo_moe.fine_grained.planned_mlp`` (its own table: their
Functions, regions and handoff differ), which :func:`plan_mlp` hands them to. Callers:
``GroupedSwiGLUMLPFP8`` and the Megatron ``TurboMoEGroupedMLP``.
"""

from __future__ import annotations

import types
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import host_plan, planned_layer, swiglu
from .autograd import (_FORWARD_REGION, QuantizedGradHandoff, cached_weight_inputs, cached_weight_key,
                       fp8_gemm_backward, fuses_swiglu_amax, stash_for_fp8_gemm_backward)
from .checks import OFFSETS_REGION, offsets_region_key
from .config import ScalingGranularity
from .planned_layer import NOT_PLANNABLE, _Builder, _contiguous_strides, _history_tensors, gemm_backward_steps

__all__ = ["MLPSide", "PlannedMLP", "plan_mlp", "apply_mlp", "NOT_PLANNABLE"]

# The value table: the arguments (apply_mlp's order), then what the steps make.
X, W1, W2, PROBS, SRC = 0, 1, 2, 3, 4  # SRC: the offsets, or group_lens when the offsets are a step
CACHE1, CACHE2 = (5, 6, 7, 8), (9, 10, 11, 12)  # each weight's cached FP8 copies (cached_weight_inputs)
MAIN_GRAD1, MAIN_GRAD2, PLACEHOLDER1, PLACEHOLDER2 = 13, 14, 15, 16
HISTORIES1, HISTORIES2 = (17, 18, 19, 20), (21, 22, 23, 24)  # delayed: (x state, ticket, dy state, ticket)
NUM_ARGS = 25
OFFS_MADE = 25
H, W1_KN, W1_KN_SCALE, X_KM, X_KM_SCALE = 26, 27, 28, 29, 30
Y, W2_KN, W2_KN_SCALE, A_KM, A_SCALE = 31, 32, 33, 34, 35
DY, DA, DW2, DY_T, DY_T_SCALE = 36, 37, 38, 39, 40
DH_ROWS, DH_T, DH_SCALE, DPROBS = 41, 42, 43, 44
DX, DW1, DH_T_PASSED, DH_SCALE_PASSED = 45, 46, 47, 48
AMAX1 = 49  # tensorwise current scaling: the SwiGLU amax partials fc1's forward hands to the SwiGLU's cast
NUM_VALUES = 50
# Where a cache's W^T (Float8Weight.data_t) sits among each forward region's inputs: fc1's
# (x, w, offsets, *cache), the SwiGLU forward's (h, probs, w, offsets, *cache).
_FC1_CACHED_W_KN, _FC2_CACHED_W_KN = 5, 6

calls = 0  # forwards run as planned MLPs (tests, benchmarks)


class MLPSide(NamedTuple):
    """One linear of the MLP as the call runs it."""
    num_cu: Optional[int]
    backend: str
    w_fp8: object  # the FP8 weight cache (autograd.Float8Weight) or None
    delayed: object  # its DelayedScalingState under delayed scaling, seeded on x's device, else None
    main_grad: Optional[torch.Tensor]  # float32 buffer its wgrad accumulates into (Megatron), or None
    placeholder: Optional[torch.Tensor]  # the weight's gradient when main_grad is given (None: no gradient)


class PlannedMLP(NamedTuple):
    layer_id: int
    regions: Tuple[Tuple[host_plan.Region, object], ...]  # the forward steps' (region, plan)
    # (x, w1, w2, probs, src, fc1, fc2) -> the layer's arguments in its table's order (the
    # fine-grained recipes' table is laid out by turbo_moe.fine_grained.planned_mlp)
    arguments: Callable


class _MLPBackward(NamedTuple):
    """What the Python backward (:func:`_mlp_backward`) needs besides the table."""
    config: object
    num_cu1: Optional[int]
    backend1: str
    num_cu2: Optional[int]
    backend2: str
    offs: int
    kept1: bool
    kept2: bool
    need_dx1: bool
    need_dw1: bool
    need_dw2: bool
    need_dprobs: bool
    x_dtype: torch.dtype
    h_dtype: torch.dtype
    w1_dtype: torch.dtype
    w2_dtype: torch.dtype
    main_grad1: bool
    main_grad2: bool


_LAYER_IDS: Dict[tuple, int] = {}


def _side_args(side: MLPSide) -> tuple:
    return (*cached_weight_inputs(side.w_fp8), *_history_tensors(side.delayed))


def plan_mlp(x, w1, w2, probs, src, from_lens: bool, fc1: MLPSide, fc2: MLPSide, config, out_dtype1, out_dtype2,
             forward_only: bool = False):
    """The :class:`PlannedMLP` for this call's signature, None while a plan is not recorded yet,
    or ``NOT_PLANNABLE``. ``x [M, hidden]``, ``w1 [G, 2F, hidden]``, ``w2 [G, hidden, F]``,
    ``probs [M]`` (contiguous), ``src``: the checked offsets or (``from_lens``) ``group_lens``;
    ``out_dtype1``/``out_dtype2``: fc1's and fc2's output dtypes as the Python path resolves them;
    ``forward_only``: grad mode is off. The fine-grained recipes' MLP is
    ``turbo_moe.fine_grained.planned_mlp``'s."""
    if config.fine_grained:
        from .fine_grained import planned_mlp as fine_grained_mlp

        return fine_grained_mlp.plan_mlp(x, w1, w2, probs, src, from_lens, fc1, fc2, config, out_dtype1, out_dtype2,
                                         forward_only)
    ext = host_plan._extension()
    if ext is None:
        return NOT_PLANNABLE
    need_dx1, need_dw1, need_dw2, need_dprobs = x.requires_grad, w1.requires_grad, w2.requires_grad, probs.requires_grad
    h_grad = not forward_only and (need_dx1 or need_dw1)  # h's requires_grad, as the SwiGLU Function sees it
    need_da = h_grad or need_dprobs
    if not forward_only and not h_grad:
        return NOT_PLANNABLE  # no handoff (nothing of fc1 needs dh): the Python path's plain SwiGLU backward
    b = _Builder(x.get_device())
    for v, t in ((X, x), (W1, w1), (W2, w2), (PROBS, probs), (SRC, src),
                 *zip(CACHE1 + HISTORIES1, _side_args(fc1)), *zip(CACHE2 + HISTORIES2, _side_args(fc2)),
                 (MAIN_GRAD1, fc1.main_grad), (MAIN_GRAD2, fc2.main_grad)):
        b.facts[v] = host_plan.fact(t)
    live1, live2 = int(fc1.delayed is not None), int(fc2.delayed is not None)
    x_hist1, dy_hist1 = (HISTORIES1[:2], HISTORIES1[2:]) if live1 else ((), ())
    x_hist2, dy_hist2 = (HISTORIES2[:2], HISTORIES2[2:]) if live2 else ((), ())

    def present(values):
        return tuple(v if b.facts.get(v) is not None else None for v in values)

    forward_steps = 2
    offs = SRC
    if from_lens:
        b.step(OFFSETS_REGION, offsets_region_key(x.shape[0], True), (SRC,), (OFFS_MADE,))
        offs, forward_steps = OFFS_MADE, 3
    # Tensorwise current scaling: fc1's forward also makes the SwiGLU amax partials (in its GEMM's
    # epilogue where the ping-pong runs, else by the amax pass) and the SwiGLU's cast takes them:
    # the Python path's region keys and inputs (autograd.fp8_gemm_forward, swiglu's Function).
    amax = fuses_swiglu_amax(config)
    key1 = (config, fc1.num_cu, fc1.backend, out_dtype1, need_dx1, need_dw1, *cached_weight_key(fc1.w_fp8))
    key2 = (config, fc2.num_cu, fc2.backend, out_dtype2, need_da, need_dw2, *cached_weight_key(fc2.w_fp8))
    b.step(_FORWARD_REGION, ((*key1, "swiglu amax") if amax else key1, live1),
           (X, W1, offs, *present(CACHE1), *((PROBS,) if amax else ()), *x_hist1),
           (H, W1_KN, W1_KN_SCALE, X_KM, X_KM_SCALE, *((AMAX1,) if amax else ())))
    b.step(swiglu._FORWARD_REGION, ((*key2, "given amax") if amax else key2, live2),
           (H, PROBS, W2, offs, *present(CACHE2), *((AMAX1,) if amax else ()), *x_hist2),
           (Y, W2_KN, W2_KN_SCALE, A_KM, A_SCALE))
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    kept1 = b.regions[-2][1].outputs[1] == ("input", _FC1_CACHED_W_KN)
    kept2 = b.regions[-1][1].outputs[1] == ("input", _FC2_CACHED_W_KN)
    h_dtype = b.facts[H][2]
    if not forward_only:
        y_fact = b.facts[Y]
        b.facts[DY] = (y_fact[0], _contiguous_strides(y_fact[0]), y_fact[2], y_fact[3], 0)  # backward's dy.contiguous()
        # fc2's backward (autograd.fp8_gemm_backward), da for the SwiGLU backward.
        gemm_backward_steps(b, config, fc2.num_cu, fc2.backend, live2, h_dtype, w2.dtype, need_da, need_dw2, kept2,
                            (DY, None, None, None), W2_KN, W2_KN_SCALE, A_KM, A_SCALE, offs,
                            MAIN_GRAD2 if fc2.main_grad is not None else None, dy_hist2, (DA, DW2),
                            (DA, DY_T, DY_T_SCALE), DW2)
        # The SwiGLU backward with the handoff: dh's FP8 layouts as fc1's backward asked for them.
        # (rowwise: dh's scales per row and per (group, column), packed in DH_SCALE)
        rowwise = config.granularity is ScalingGranularity.ROWWISE
        b.step(swiglu._BACKWARD_REGION, ((config.grad_dtype, config.margin, need_dx1, need_dw1, rowwise), live1),
               (H, PROBS, DA, offs if rowwise else None, *dy_hist1), (DH_ROWS, DH_T, DH_SCALE, DPROBS))
        # fc1's backward on the handed-over dh.
        gemm_backward_steps(b, config, fc1.num_cu, fc1.backend, live1, x.dtype, w1.dtype, need_dx1, need_dw1, kept1,
                            (None, *present((DH_ROWS, DH_T)), DH_SCALE), W1_KN, W1_KN_SCALE, X_KM, X_KM_SCALE, offs,
                            MAIN_GRAD1 if fc1.main_grad is not None else None, dy_hist1, (DX, DW1),
                            (DX, DH_T_PASSED, DH_SCALE_PASSED), DW1)
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    grads = mlp_grads(NUM_ARGS, forward_only, fc1, fc2, (need_dx1, need_dw1, need_dw2, need_dprobs),
                      (DX, DW1, DW2, DPROBS), (PLACEHOLDER1, PLACEHOLDER2))
    forward, backward, read, made = split_steps(b, forward_steps, grads, NUM_ARGS, DY)
    # What GroupedGemmFP8Function and the SwiGLU Function save (with autograd's version checks):
    # the weights (to re-derive W^T on a second backward), the routing weights, given offsets.
    saved = [] if forward_only else [
        v for v, needed in ((W1, need_dx1), (W2, need_da), (PROBS, need_da), (SRC, not from_lens)) if needed]
    # W^T's FP8 copies made by the forward are dgrad's alone: held for the first backward only.
    held = [] if forward_only else [v for v, kept in ((W1_KN, kept1), (W2_KN, kept2))
                                    if not kept and v in read and b.facts.get(v) is not None]
    kept = [] if forward_only else sorted(v for v in read - made - set(saved) - set(held) if _present(b, v, fc1, fc2))
    info = _MLPBackward(config, fc1.num_cu, fc1.backend, fc2.num_cu, fc2.backend, offs, kept1, kept2, need_dx1,
                        need_dw1, need_dw2, need_dprobs, x.dtype, h_dtype, w1.dtype, w2.dtype,
                        fc1.main_grad is not None, fc2.main_grad is not None)
    layer_id = planned_layer.add_extension_layer(ext, _LAYER_IDS, NUM_VALUES, NUM_ARGS, forward, backward, saved, held,
                                                 kept, Y, DY, grads, _mlp_backward, info)
    if layer_id is None:
        return NOT_PLANNABLE
    return PlannedMLP(layer_id, tuple(b.regions[:forward_steps]), _arguments)


def mlp_grads(num_args: int, forward_only: bool, fc1: MLPSide, fc2: MLPSide, needs, values, placeholders) -> list:
    """Per argument of an MLP table (x, w1, w2, probs first, in both layouts) the value holding its
    gradient (-1: none). ``needs``: (dx, dW1, dW2, dprobs) wanted; ``values``: where the steps make
    them; ``placeholders``: each weight's placeholder (its gradient where dW went into main_grad)."""
    grads = [-1] * num_args
    if not forward_only:
        need_dx1, need_dw1, need_dw2, need_dprobs = needs
        grads[X] = values[0] if need_dx1 else -1
        grads[W1] = _weight_grad(need_dw1, fc1, placeholders[0], values[1])
        grads[W2] = _weight_grad(need_dw2, fc2, placeholders[1], values[2])
        grads[PROBS] = values[3] if need_dprobs else -1
    return grads


def split_steps(b, forward_steps: int, grads, num_args: int, dy: int):
    """``(forward steps, backward steps with their releases, values the backward reads, values it
    makes)`` of a built MLP (dy counts as made: the node's incoming gradient)."""
    forward, backward = b.steps[:forward_steps], _with_releases(b.steps[forward_steps:], set(grads), num_args)
    read = {v for step in backward for v in step[1]} | {v for v in grads if v != -1}
    made = {v for step in backward for v in step[2]} | {dy}
    return forward, backward, read, made


def _present(b, v, fc1: MLPSide, fc2: MLPSide) -> bool:
    if v in (PLACEHOLDER1, PLACEHOLDER2):
        return (fc1 if v == PLACEHOLDER1 else fc2).placeholder is not None
    return b.facts.get(v) is not None


def _weight_grad(need_dw: bool, side: MLPSide, placeholder: int, dw: int) -> int:
    if not need_dw:
        return -1
    if side.main_grad is not None:  # autograd.WgradTarget: dW went into main_grad
        return placeholder if side.placeholder is not None else -1
    return dw


def _with_releases(steps, grads, num_args: int):
    """Each backward step also releases what no later step reads: the node's reference to an
    intermediate goes as soon as it is dead, as autograd frees a Function's saved tensors after
    its backward (the gradients stay: the node returns them). dy too: the node holds the engine's
    reference, so fc2's backward frees it once quantized (``planned_layer.release_after_last_read``)."""
    result = []
    for k, (plan, inputs, outputs, release) in enumerate(steps):
        later = {v for step in steps[k + 1:] for v in step[1]}
        dead = {v for v in inputs if v not in later and v >= num_args and v not in grads}
        result.append((plan, inputs, outputs, sorted(set(release) | dead)))
    return result


def apply_mlp(layer: PlannedMLP, x, w1, w2, probs, src, fc1: MLPSide, fc2: MLPSide) -> torch.Tensor:
    """The MLP's forward (one C++ call); the result's ``grad_fn`` runs its backward in C++."""
    global calls
    calls += 1
    return planned_layer.run_extension_layer(layer.layer_id, layer.regions, x.get_device(),
                                             layer.arguments(x, w1, w2, probs, src, fc1, fc2))


def _arguments(x, w1, w2, probs, src, fc1: MLPSide, fc2: MLPSide) -> list:
    """The per-tensor layer's arguments (its table's first ``NUM_ARGS`` values) for one call."""
    side1, side2 = _side_args(fc1), _side_args(fc2)
    return [x, w1, w2, probs, src, *side1[:4], *side2[:4], fc1.main_grad, fc2.main_grad, fc1.placeholder,
            fc2.placeholder, *side1[4:], *side2[4:]]


def _mlp_backward(info: _MLPBackward, dy, v, create_graph: bool):
    """The Python path's backward of the MLP (fc2's GEMM backward, the SwiGLU backward with the
    handoff, fc1's GEMM backward), from the node's value table; W^T None once released."""
    config = info.config
    offs = v[info.offs]
    dy_history1 = planned_layer.history_from(config, v[HISTORIES1[2]], v[HISTORIES1[3]])
    dy_history2 = planned_layer.history_from(config, v[HISTORIES2[2]], v[HISTORIES2[3]])
    ctx2 = types.SimpleNamespace()
    stash_for_fp8_gemm_backward(ctx2, v[W2_KN], config, info.num_cu2, info.backend2, info.h_dtype, info.w2_dtype,
                                planned_layer.wgrad_target_from(v[MAIN_GRAD2], v[PLACEHOLDER2]),
                                grad_history=dy_history2)
    ctx2.w_kn_kept = info.kept2
    with torch.no_grad():
        da, dw2 = fp8_gemm_backward(ctx2, dy, v[W2], v[W2_KN_SCALE], v[A_KM], v[A_SCALE], offs, True, info.need_dw2)
        rowwise = config.granularity is ScalingGranularity.ROWWISE
        rows, transposed, scale, dprobs = swiglu.quantize_weighted_swiglu_backward(
            v[H], v[PROBS], da, config.grad_dtype, config.margin, rows=info.need_dx1, transposed=info.need_dw1,
            history=dy_history1, rowwise_offs=offs if rowwise else None)
        handoff = QuantizedGradHandoff()
        handoff.expect(config, info.need_dx1, info.need_dw1, dy_history1)
        placeholder = handoff.give(rows, transposed, scale, like=v[H])
        ctx1 = types.SimpleNamespace()
        stash_for_fp8_gemm_backward(ctx1, v[W1_KN], config, info.num_cu1, info.backend1, info.x_dtype, info.w1_dtype,
                                    planned_layer.wgrad_target_from(v[MAIN_GRAD1], v[PLACEHOLDER1]),
                                    grad_handoff=handoff, grad_history=dy_history1)
        ctx1.w_kn_kept = info.kept1
        dx, dw1 = fp8_gemm_backward(ctx1, placeholder, v[W1], v[W1_KN_SCALE], v[X_KM], v[X_KM_SCALE], offs,
                                    info.need_dx1, info.need_dw1)
    grads = [None] * NUM_ARGS
    grads[X], grads[W1], grads[W2], grads[PROBS] = planned_layer.once_differentiable(
        [dx if info.need_dx1 else None, dw1 if info.need_dw1 else None, dw2 if info.need_dw2 else None,
         dprobs if info.need_dprobs else None], dy, create_graph)
    return grads
