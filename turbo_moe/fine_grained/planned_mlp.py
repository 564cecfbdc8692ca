"""An expert MLP under the blockwise and MXFP8 recipes as one C++ autograd node.

``turbo_moe.planned_mlp`` made the per-tensor MLP one extension layer; here the fine-grained
Python path (``GroupedSwiGLUMLPFP8`` and the Megatron experts: fc1's ``FineGrainedFP8Function``,
``FineGrainedSwiGLUFunction``, then fc2's ``FineGrainedFP8Function`` on the activation's rows
copy, tied by a ``GradRowsHandoff``) becomes one. Its steps are the regions that path replays,
looked up by exactly the keys it computes:

* forward: the offsets kernel (with ``group_lens``); fc1's forward GEMM (x's rows copy, the
  weight's copies unless cached); x's token copy for fc1's wgrad; the SwiGLU and its rows cast;
  fc2's forward on that rows copy (released once read, as the Python path frees it before the
  token cast); the activation's token copy for fc2's wgrad;
* backward: fc2's dgrad (releasing its W^T) and wgrad; the SwiGLU backward, which also writes
  ``dh``'s rows copy where fc1 casts into whole 1xB blocks (F a multiple of the block); fc1's
  dgrad on that copy (releasing its W^T) and wgrad. With ``main_grad`` (float32) each wgrad
  accumulates into it in the kernel's epilogue and the weight's gradient is its placeholder.

Saved, held and released as the Python path does: the weights, routing weights and given offsets
saved with autograd's version checks; each W^T made by the forward held for the first backward
and released by its dgrad; every intermediate released after the step that reads it last. What no
plan covers (a second backward after W^T was released, a misaligned gradient, ``create_graph``)
runs :func:`_mlp_backward`: the Python Functions' own backward code on the table's values.

Served: both fine-grained recipes, with or without the FP8 weight caches and float32 ``main_grad``,
no bias, where fc1's input or weight needs a gradient (else the Python path). A deferred wgrad and
delayed scaling (refused by these recipes) keep the Python path.
"""

from __future__ import annotations

import types
from typing import Dict, NamedTuple, Optional

import torch

from .. import host_plan, planned_layer
from ..autograd import cached_weight_parts
from ..checks import OFFSETS_REGION, offsets_region_key
from ..planned_layer import NOT_PLANNABLE, _Builder, _contiguous_strides
from ..planned_mlp import PlannedMLP, mlp_grads, split_steps
from . import autograd as fine
from . import swiglu as fine_swiglu
from .autograd import GradRowsHandoff, fine_gemm_backward
from .quantize import recipe_of
from .swiglu import fine_swiglu_backward

__all__ = ["plan_mlp", "mlp_arguments"]

# The value table: the arguments (mlp_arguments' order), then what the steps make.
X, W1, W2, PROBS, SRC = 0, 1, 2, 3, 4  # as planned_mlp's (its mlp_grads relies on it); SRC: the offsets or group_lens
# Each weight's cached FP8 copies: W, its scales, W^T, W^T's scales (blockwise: a transposed view
# of W's, which the forward region does not take as an input of its own, but dgrad reads).
CACHE1, CACHE2 = (5, 6, 7, 8), (9, 10, 11, 12)
MAIN_GRAD1, MAIN_GRAD2, PLACEHOLDER1, PLACEHOLDER2 = 13, 14, 15, 16
NUM_ARGS = 17
OFFS_MADE = 17
H, W1_KN, W1_KN_SCALE, X_T, X_T_SCALE, X_WGRAD_OFFS = 18, 19, 20, 21, 22, 23
A, A_ROWS, A_ROWS_SCALE = 24, 25, 26
Y, W2_KN, W2_KN_SCALE, A_T, A_T_SCALE, A_WGRAD_OFFS = 27, 28, 29, 30, 31, 32
DY, DA, DW2, DH, DPROBS, DH_ROWS, DH_ROWS_SCALE, DX, DW1 = 33, 34, 35, 36, 37, 38, 39, 40, 41
NUM_VALUES = 42


class _MLPBackward(NamedTuple):
    """What the Python backward (:func:`_mlp_backward`) needs besides the table."""
    config: object
    num_cu1: Optional[int]
    backend1: str
    num_cu2: Optional[int]
    backend2: str
    offs: int
    kept1: bool  # W^T is the cache's (its table values, not the forward's)
    kept2: bool
    need_dx1: bool
    need_dw1: bool
    need_dw2: bool
    need_dprobs: bool
    x_dtype: torch.dtype
    a_dtype: torch.dtype
    w1_dtype: torch.dtype
    w2_dtype: torch.dtype


_LAYER_IDS: Dict[tuple, int] = {}


def _cache_tensors(w_fp8) -> tuple:
    if w_fp8 is None:
        return (None,) * 4
    return (w_fp8.data, w_fp8.scale, w_fp8.data_t, w_fp8.scale_t)


def mlp_arguments(x, w1, w2, probs, src, fc1, fc2) -> list:
    """The layer's arguments (its table's first ``NUM_ARGS`` values) for one call."""
    return [x, w1, w2, probs, src, *_cache_tensors(fc1.w_fp8), *_cache_tensors(fc2.w_fp8), fc1.main_grad,
            fc2.main_grad, fc1.placeholder, fc2.placeholder]


def _forward_inputs(w_fp8, cache) -> tuple:
    """``(static key part, the cache's value indices)`` as the forward region takes them
    (``autograd.cached_weight_parts``: a W^T scale sharing W's memory is not an input)."""
    key, inputs = cached_weight_parts(w_fp8)
    return key, tuple(v if t is not None else None for v, t in zip(cache, inputs))


def plan_mlp(x, w1, w2, probs, src, from_lens: bool, fc1, fc2, config, out_dtype1, out_dtype2,
             forward_only: bool = False):
    """``turbo_moe.planned_mlp.plan_mlp`` for the fine-grained recipes (same arguments and results;
    ``fc1``/``fc2`` are ``planned_mlp.MLPSide``)."""
    ext = host_plan._extension()
    if ext is None or fc1.delayed is not None or fc2.delayed is not None:
        return NOT_PLANNABLE
    if any(side.main_grad is not None and side.main_grad.dtype != torch.float32 for side in (fc1, fc2)):
        return NOT_PLANNABLE  # added after the kernel in the Python path: not a plan's step
    need_dx1, need_dw1, need_dw2, need_dprobs = x.requires_grad, w1.requires_grad, w2.requires_grad, probs.requires_grad
    if not forward_only and not (need_dx1 or need_dw1):
        return NOT_PLANNABLE  # h needs no gradient: no handoff, the Python path
    # The Functions see requires_grad (needs_input_grad), grad mode or not; a (the activation's
    # output) requires a gradient only where the graph is built.
    need_da = not forward_only
    b = _Builder(x.get_device())
    for v, t in ((X, x), (W1, w1), (W2, w2), (PROBS, probs), (SRC, src), *zip(CACHE1, _cache_tensors(fc1.w_fp8)),
                 *zip(CACHE2, _cache_tensors(fc2.w_fp8)), (MAIN_GRAD1, fc1.main_grad), (MAIN_GRAD2, fc2.main_grad)):
        b.facts[v] = host_plan.fact(t)
    offs = SRC
    if from_lens:
        b.step(OFFSETS_REGION, offsets_region_key(x.shape[0], True), (SRC,), (OFFS_MADE,))
        offs = OFFS_MADE
    # fine_grained.autograd.FineGrainedFP8Function.forward and FineGrainedSwiGLUFunction.forward:
    # their regions' keys (through_plan appends the count of live amax histories: none here).
    key1, cache1 = _forward_inputs(fc1.w_fp8, CACHE1)
    key2, cache2 = _forward_inputs(fc2.w_fp8, CACHE2)
    b.step(fine._FORWARD_REGION, ((config, fc1.num_cu, fc1.backend, out_dtype1, need_dx1, False, *key1), 0),
           (X, None, None, W1, offs, *cache1), (H, W1_KN, W1_KN_SCALE))
    if need_dw1 and not forward_only:  # (a forward without grad would make it and drop it)
        b.step(fine._TOKENS_REGION, ((config, "forward"), 0), (X, offs), (X_T, X_T_SCALE, X_WGRAD_OFFS))
    b.step(fine_swiglu._FORWARD_REGION, ((config,), 0), (H, PROBS), (A, A_ROWS, A_ROWS_SCALE))
    # a's rows copy is freed once fc2's GEMM has read it, before a's token copy allocates.
    b.step(fine._FORWARD_REGION, ((config, fc2.num_cu, fc2.backend, out_dtype2, need_da, True, *key2), 0),
           (None, A_ROWS, A_ROWS_SCALE, W2, offs, *cache2), (Y, W2_KN, W2_KN_SCALE), release=(A_ROWS, A_ROWS_SCALE))
    if need_dw2 and not forward_only:
        b.step(fine._TOKENS_REGION, ((config, "forward"), 0), (A, offs), (A_T, A_T_SCALE, A_WGRAD_OFFS),
               release=(A,))
    forward_steps = len(b.steps)
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    # The forward returns no W^T where the cache holds it (FineGrainedFP8Function.forward): dgrad
    # reads the cache's.
    kept1, kept2 = need_dx1 and b.facts[W1_KN] is None, need_da and b.facts[W2_KN] is None
    w1_kn = (CACHE1[2], CACHE1[3]) if kept1 else (W1_KN, W1_KN_SCALE)
    w2_kn = (CACHE2[2], CACHE2[3]) if kept2 else (W2_KN, W2_KN_SCALE)
    a_dtype = b.facts[A][2]
    if not forward_only:
        y_fact = b.facts[Y]
        b.facts[DY] = (y_fact[0], _contiguous_strides(y_fact[0]), y_fact[2], y_fact[3], 0)  # dy.contiguous()
        recipe = recipe_of(config)
        # fine_gemm_backward of fc2: dgrad (W^T dgrad's alone), wgrad.
        b.step(fine._DGRAD_REGION, ((config, fc2.num_cu, fc2.backend, a_dtype, False), 0),
               (DY, None, None, *w2_kn, offs), (DA,), release=() if kept2 else w2_kn)
        if need_dw2:
            _wgrad_step(b, config, fc2, w2.dtype, (DY, A_T, A_T_SCALE, offs, A_WGRAD_OFFS), MAIN_GRAD2, DW2)
        # fine_swiglu_backward: dh's rows copy where fc1 expects it (GradRowsHandoff.expect) and
        # its blocks tile F.
        rows = need_dx1 and (w1.shape[1] // 2) % recipe.block == 0
        if rows:
            b.step(fine_swiglu._BACKWARD_ROWS_REGION, ((recipe, config.grad_dtype, config.margin), 0),
                   (H, PROBS, DA), (DH, DPROBS, DH_ROWS, DH_ROWS_SCALE))
        else:
            b.step(fine_swiglu._BACKWARD_REGION, ((), 0), (H, PROBS, DA), (DH, DPROBS))
        # fine_gemm_backward of fc1, on the handed copy.
        if need_dx1:
            b.step(fine._DGRAD_REGION, ((config, fc1.num_cu, fc1.backend, x.dtype, rows), 0),
                   (None if rows else DH, *((DH_ROWS, DH_ROWS_SCALE) if rows else (None, None)), *w1_kn, offs), (DX,),
                   release=() if kept1 else w1_kn)
        if need_dw1:
            _wgrad_step(b, config, fc1, w1.dtype, (DH, X_T, X_T_SCALE, offs, X_WGRAD_OFFS), MAIN_GRAD1, DW1)
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    grads = mlp_grads(NUM_ARGS, forward_only, fc1, fc2, (need_dx1, need_dw1, need_dw2, need_dprobs),
                      (DX, DW1, DW2, DPROBS), (PLACEHOLDER1, PLACEHOLDER2))
    forward, backward, read, made = split_steps(b, forward_steps, grads, NUM_ARGS, DY)
    # What the Functions save with autograd's version checks: the weights (to re-derive W^T on a
    # second backward), the routing weights (the SwiGLU's), given offsets.
    saved = [] if forward_only else [
        v for v, needed in ((W1, need_dx1), (W2, need_da), (PROBS, True), (SRC, not from_lens)) if needed]
    # W^T made by a forward is its dgrad's alone (ctx.w_kn): held for the first backward only.
    held = [] if forward_only else [v for v in (*((W1_KN, W1_KN_SCALE) if need_dx1 and not kept1 else ()),
                                                *((W2_KN, W2_KN_SCALE) if not kept2 else ()))
                                    if v in read and b.facts.get(v) is not None]
    kept = [] if forward_only else sorted(v for v in read - made - set(saved) - set(held) if _present(b, v, fc1, fc2))
    info = _MLPBackward(config, fc1.num_cu, fc1.backend, fc2.num_cu, fc2.backend, offs, kept1, kept2, need_dx1,
                        need_dw1, need_dw2, need_dprobs, x.dtype, a_dtype, w1.dtype, w2.dtype)
    layer_id = planned_layer.add_extension_layer(ext, _LAYER_IDS, NUM_VALUES, NUM_ARGS, forward, backward, saved, held,
                                                 kept, Y, DY, grads, _mlp_backward, info)
    if layer_id is None:
        return NOT_PLANNABLE
    return PlannedMLP(layer_id, tuple(b.regions[:forward_steps]), mlp_arguments)


def _wgrad_step(b: _Builder, config, side, w_dtype, inputs, main_grad: int, dw: int) -> None:
    """fine_gemm_backward's wgrad region: into ``main_grad`` (float32, the kernel's epilogue) or a
    new dW in the weight's dtype."""
    out = main_grad if side.main_grad is not None else None
    dw_dtype = torch.float32 if out is not None else w_dtype
    b.step(fine._WGRAD_REGION, ((config, side.num_cu, side.backend, dw_dtype), 0), (*inputs, out), (dw,))


def _present(b, v, fc1, fc2) -> bool:
    if v in (PLACEHOLDER1, PLACEHOLDER2):
        return (fc1 if v == PLACEHOLDER1 else fc2).placeholder is not None
    return b.facts.get(v) is not None


def _function_ctx(saved, needs, config, num_cu, backend, x_dtype, w_dtype, w_kn, main_grad, placeholder, grad_rows):
    """What ``FineGrainedFP8Function.forward`` leaves on its ctx, for :func:`fine_gemm_backward`."""
    return types.SimpleNamespace(
        saved_tensors=saved, needs_input_grad=needs, config=config, num_cu=num_cu, backend=backend, x_dtype=x_dtype,
        w_dtype=w_dtype, w_kn=w_kn, grad_rows=grad_rows,
        wgrad_target=planned_layer.wgrad_target_from(main_grad, placeholder))


def _mlp_backward(info: _MLPBackward, dy, v, create_graph: bool):
    """The Python path's backward of the MLP (fc2's, the SwiGLU's with the handoff, fc1's) from the
    node's value table: the Functions' own backward code; W^T None once released (re-derived)."""
    config = info.config
    offs = v[info.offs]

    def w_kn(kept, cache, made):
        pair = (v[cache[2]], v[cache[3]]) if kept else (v[made[0]], v[made[1]])
        return None if pair[0] is None else pair

    handoff = GradRowsHandoff()
    if info.need_dx1:  # FineGrainedFP8Function.forward of fc1
        handoff.expect(recipe_of(config), config.grad_dtype, config.margin)
    ctx2 = _function_ctx((v[W2], v[A_T], v[A_T_SCALE], offs, v[A_WGRAD_OFFS]), (True, info.need_dw2), config,
                         info.num_cu2, info.backend2, info.a_dtype, info.w2_dtype,
                         w_kn(info.kept2, CACHE2, (W2_KN, W2_KN_SCALE)), v[MAIN_GRAD2], v[PLACEHOLDER2], None)
    ctx_swiglu = types.SimpleNamespace(saved_tensors=(v[H], v[PROBS]), needs_input_grad=(True, info.need_dprobs),
                                       grad_rows=handoff)
    ctx1 = _function_ctx((v[W1], v[X_T], v[X_T_SCALE], offs, v[X_WGRAD_OFFS]), (info.need_dx1, info.need_dw1), config,
                         info.num_cu1, info.backend1, info.x_dtype, info.w1_dtype,
                         w_kn(info.kept1, CACHE1, (W1_KN, W1_KN_SCALE)), v[MAIN_GRAD1], v[PLACEHOLDER1],
                         handoff if info.need_dx1 else None)
    with torch.no_grad():
        da, dw2 = fine_gemm_backward(ctx2, dy)
        dh, dprobs = fine_swiglu_backward(ctx_swiglu, da)
        del da
        dx, dw1 = fine_gemm_backward(ctx1, dh)
    grads = [None] * NUM_ARGS
    grads[X], grads[W1], grads[W2], grads[PROBS] = planned_layer.once_differentiable(
        [dx if info.need_dx1 else None, dw1 if info.need_dw1 else None, dw2 if info.need_dw2 else None,
         dprobs if info.need_dprobs else None], dy, create_graph)
    return grads
