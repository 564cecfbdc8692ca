"""One grouped linear under the blockwise and MXFP8 recipes as one C++ autograd node.

``turbo_moe.planned_layer`` does this for the per-tensor recipes; here the steps are the regions
``FineGrainedFP8Function`` replays, looked up by exactly the keys it computes:

* forward: the offsets kernel (with ``group_lens``); the forward GEMM (x's rows copy, the weight's
  copies unless cached); x's token copy for the wgrad (where W needs a gradient);
* backward: dgrad (dy's rows copy, the GEMM; W^T released after it unless the cache's), then the
  wgrad (dy's token copy, the GEMM; into a float32 ``main_grad`` in its epilogue, the weight's
  gradient then its placeholder).

Saved, held and released as the Function does (``fine_grained.planned_mlp`` explains the same
choices for the MLP); what no plan covers (a second backward after W^T was released, a misaligned
gradient, ``create_graph``) runs :func:`_linear_backward`, the Function's own backward code on the
table's values. Callers: ``GroupedLinearFP8`` and Megatron's ``TurboGroupedLinear`` through
``planned_layer.plan_layer``, which hands these recipes here.
"""

from __future__ import annotations

import types
from typing import Dict, NamedTuple, Optional

import torch

from .. import host_plan, planned_layer
from ..checks import OFFSETS_REGION, offsets_region_key
from ..planned_layer import NOT_PLANNABLE, PlannedLayer, _Builder, _contiguous_strides, release_after_last_read
from . import autograd as fine
from .autograd import fine_gemm_backward
from .planned_mlp import _cache_tensors, _forward_inputs

__all__ = ["plan_layer", "layer_arguments"]

# The value table: the arguments (layer_arguments' order), then what the steps make.
X, W, SRC = 0, 1, 2  # SRC: the offsets, or group_lens when the offsets are a step
CACHE = (3, 4, 5, 6)  # the cached W, its scales, W^T, W^T's scales (fine_grained.planned_mlp)
MAIN_GRAD, PLACEHOLDER = 7, 8
NUM_ARGS = 9
OFFS_MADE = 9
Y, W_KN, W_KN_SCALE, X_T, X_T_SCALE, X_WGRAD_OFFS = 10, 11, 12, 13, 14, 15
DY, DX, DW = 16, 17, 18
NUM_VALUES = 19


class _Backward(NamedTuple):
    """What the Python backward (:func:`_linear_backward`) needs besides the table."""
    config: object
    num_cu: Optional[int]
    backend: str
    offs: int
    kept: bool  # W^T is the cache's
    need_dx: bool
    need_dw: bool
    x_dtype: torch.dtype
    w_dtype: torch.dtype


_LAYER_IDS: Dict[tuple, int] = {}


def layer_arguments(x, w_nk, src, w_fp8, delayed=None, main_grad=None, placeholder=None) -> list:
    """The layer's arguments (its table's first ``NUM_ARGS`` values) for one call (``delayed``:
    always None under these recipes)."""
    return [x, w_nk, src, *_cache_tensors(w_fp8), main_grad, placeholder]


def plan_layer(x, w_nk, src, from_lens: bool, w_fp8, config, num_cu, backend, out_dtype, need_dx: bool,
               need_dw: bool, forward_only: bool = False, delayed=None, main_grad=None, placeholder=None):
    """``turbo_moe.planned_layer.plan_layer`` for the fine-grained recipes (same arguments and results)."""
    ext = host_plan._extension()
    if ext is None or delayed is not None or (main_grad is not None and main_grad.dtype != torch.float32):
        return NOT_PLANNABLE
    b = _Builder(x.get_device())
    for v, t in ((X, x), (W, w_nk), (SRC, src), *zip(CACHE, _cache_tensors(w_fp8)), (MAIN_GRAD, main_grad)):
        b.facts[v] = host_plan.fact(t)
    offs = SRC
    if from_lens:
        b.step(OFFSETS_REGION, offsets_region_key(x.shape[0], True), (SRC,), (OFFS_MADE,))
        offs = OFFS_MADE
    # FineGrainedFP8Function.forward's regions and keys (through_plan: no live amax histories).
    key, cache = _forward_inputs(w_fp8, CACHE)
    b.step(fine._FORWARD_REGION, ((config, num_cu, backend, out_dtype, need_dx, False, *key), 0),
           (X, None, None, W, offs, *cache), (Y, W_KN, W_KN_SCALE))
    if need_dw and not forward_only:  # (a forward without grad would make it and drop it)
        b.step(fine._TOKENS_REGION, ((config, "forward"), 0), (X, offs), (X_T, X_T_SCALE, X_WGRAD_OFFS))
    forward_steps = len(b.steps)
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    kept = need_dx and b.facts[W_KN] is None  # the forward returns no W^T where the cache holds it
    w_kn = (CACHE[2], CACHE[3]) if kept else (W_KN, W_KN_SCALE)
    if forward_only:
        need_dx = need_dw = kept = False  # nothing saved or held: no node is made
    else:
        y_fact = b.facts[Y]
        b.facts[DY] = (y_fact[0], _contiguous_strides(y_fact[0]), y_fact[2], y_fact[3], 0)  # dy.contiguous()
        # fine_gemm_backward: dgrad (W^T dgrad's alone), then the wgrad.
        if need_dx:
            b.step(fine._DGRAD_REGION, ((config, num_cu, backend, x.dtype, False), 0), (DY, None, None, *w_kn, offs),
                   (DX,), release=() if kept else w_kn)
        if need_dw:
            out = MAIN_GRAD if main_grad is not None else None
            dw_dtype = torch.float32 if out is not None else w_nk.dtype
            b.step(fine._WGRAD_REGION, ((config, num_cu, backend, dw_dtype), 0),
                   (DY, X_T, X_T_SCALE, offs, X_WGRAD_OFFS, out), (DW,))
    if b.missing or b.refused:
        return NOT_PLANNABLE if b.refused else None
    grads = [-1] * NUM_ARGS
    grads[X] = DX if need_dx else -1
    grads[W] = -1 if not need_dw else DW if main_grad is None else PLACEHOLDER if placeholder is not None else -1
    backward = release_after_last_read(b.steps[forward_steps:], DY)
    read = {v for step in backward for v in step[1]} | {v for v in grads if v != -1}
    made = {v for step in backward for v in step[2]} | {DY}
    # Saved by the Function with autograd's version checks: the weight (to re-derive W^T on a second
    # backward), the token copy and the offsets.
    saved = [] if forward_only else [v for v in ((W,) if need_dx else ()) + (X_T, X_T_SCALE, offs, X_WGRAD_OFFS)
                                     if b.facts.get(v) is not None]
    held = [v for v in (W_KN, W_KN_SCALE) if need_dx and not kept and b.facts.get(v) is not None]
    kept_values = [] if forward_only else sorted(
        v for v in read - made - set(saved) - set(held)
        if (placeholder is not None if v == PLACEHOLDER else b.facts.get(v) is not None))
    info = _Backward(config, num_cu, backend, offs, kept, need_dx, need_dw, x.dtype, w_nk.dtype)
    forward = b.steps[:forward_steps]
    layer_id = planned_layer.add_extension_layer(ext, _LAYER_IDS, NUM_VALUES, NUM_ARGS, forward, backward, saved, held,
                                                 kept_values, Y, DY, grads, _linear_backward, info)
    if layer_id is None:
        return NOT_PLANNABLE
    return PlannedLayer(layer_id, tuple(b.regions[:forward_steps]), layer_arguments)


def _linear_backward(info: _Backward, dy, v, create_graph: bool):
    """The Function's backward (``fine_gemm_backward``) from the node's value table; W^T None once
    released (re-derived from the saved weight)."""
    pair = (v[CACHE[2]], v[CACHE[3]]) if info.kept else (v[W_KN], v[W_KN_SCALE])
    ctx = types.SimpleNamespace(
        saved_tensors=(v[W], v[X_T], v[X_T_SCALE], v[info.offs], v[X_WGRAD_OFFS]),
        needs_input_grad=(info.need_dx, info.need_dw), config=info.config, num_cu=info.num_cu, backend=info.backend,
        x_dtype=info.x_dtype, w_dtype=info.w_dtype, w_kn=None if pair[0] is None else pair, grad_rows=None,
        wgrad_target=planned_layer.wgrad_target_from(v[MAIN_GRAD], v[PLACEHOLDER]))
    with torch.no_grad():
        dx, dw = fine_gemm_backward(ctx, dy)
    grads = [None] * NUM_ARGS
    grads[X], grads[W] = planned_layer.once_differentiable([dx, dw], dy, create_graph)
    return grads
