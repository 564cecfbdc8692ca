"""The fine-grained planned MLP and linear (turbo_moe/fine_grained/planned_mlp.py, planned_layer.py)
on the CPU: their wiring through the C++ node with plans that allocate and launch nothing, and
their Python backwards against the Python Functions. GPU equality with the Python path:
tests/test_planned_mlp_gpu.py, test_planned_layer_gpu.py and test_megatron_gpu.py."""

import pytest
import torch

from turbo_moe import Float8Config, GroupedLinearFP8, host_plan, planned_layer, planned_mlp
from turbo_moe.fine_grained import autograd as fine
from turbo_moe.fine_grained import planned_layer as fpl
from turbo_moe.fine_grained import planned_mlp as fpm
from turbo_moe.fine_grained import swiglu as fine_swiglu
from turbo_moe.fine_grained.autograd import quantize_weight_fine
from turbo_moe.fine_grained.quantize import quantize_swiglu_rows, quantize_tokens_for_wgrad, recipe_of

from _planned import LaunchlessPlans, assert_mlp_grads_equal_the_module, mlp_python_backward_case, needs_compiler

G, M, HIDDEN = 3, 20, 64
E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
BLOCKWISE = Float8Config(granularity="blockwise")


def _contiguous(*shape):
    return tuple(fpm._contiguous_strides(shape))


def _alloc_fact(*shape, dtype):
    return (torch.Size(shape), _contiguous(*shape), dtype, -1, 0)


def _side(**kwargs):
    return planned_mlp.MLPSide(**{**dict(num_cu=None, backend="auto", w_fp8=None, delayed=None, main_grad=None,
                                         placeholder=None), **kwargs})


def _fake_regions(ext, monkeypatch, F, cached=False, main_grad=False):
    """Blockwise, group_lens. Forward: offsets; fc1's GEMM (W^T and its scales, a transposed view,
    unless the cache has them: then None); x's token copy; the SwiGLU rows cast; fc2's GEMM on that
    copy; a's token copy. Backward: fc2 dgrad and wgrad; the SwiGLU backward (with dh's rows copy
    where F is a multiple of 128); fc1 dgrad and wgrad (``main_grad``: into its out=)."""
    alloc = [("alloc", k) for k in range(4)]
    fb = -(-F // 128)

    def gemm_forward(positions, y_shape, n, k):
        if cached:
            return (positions, [(y_shape, BF16)], [alloc[0], None, None])
        nb, kb_ = -(-n // 128), -(-k // 128)
        return (positions, [(y_shape, BF16), ((G, k, n), E4M3), ((G, nb, kb_), F32)],
                [alloc[0], alloc[1], ("view", 2, (G, kb_, nb), (nb * kb_, 1, kb_), 0)])

    cache = [5, 6, 7] if cached else []  # data, scale, data_t (scale_t shares scale's memory)
    tokens = lambda c: ([0, 1], [((c, M + 16 * G), E4M3), ((c, 2 * G), F32), ((G + 1,), torch.int64)], alloc[:3])
    wgrad = lambda shape: ([0, 1, 2, 3, 4, 5], [], [("input", 5)]) if main_grad else \
        ([0, 1, 2, 3, 4], [(shape, BF16)], alloc[:1])
    rows = F % 128 == 0
    regions = {
        (fpm, "OFFSETS_REGION"): LaunchlessPlans(ext, ([0], [((G + 1,), torch.int64)], alloc[:1])),
        (fine, "_FORWARD_REGION"): LaunchlessPlans(ext, gemm_forward([0, 3, 4, *cache], (M, 2 * F), 2 * F, HIDDEN),
                                                   gemm_forward([1, 2, 3, 4, *cache], (M, HIDDEN), HIDDEN, F)),
        (fine, "_TOKENS_REGION"): LaunchlessPlans(ext, tokens(HIDDEN), tokens(F)),
        (fine_swiglu, "_FORWARD_REGION"): LaunchlessPlans(ext, ([0, 1], [((M, F), BF16), ((M, F), E4M3),
                                                                         ((M, fb), F32)], alloc[:3])),
        (fine, "_DGRAD_REGION"): LaunchlessPlans(ext, ([0, 3, 4, 5], [((M, F), BF16)], alloc[:1]),
                                                 ([1, 2, 3, 4, 5] if rows else [0, 3, 4, 5], [((M, HIDDEN), BF16)],
                                                  alloc[:1])),
        (fine, "_WGRAD_REGION"): LaunchlessPlans(ext, wgrad((G, HIDDEN, F)), wgrad((G, 2 * F, HIDDEN))),
        (fine_swiglu, "_BACKWARD_ROWS_REGION" if rows else "_BACKWARD_REGION"): LaunchlessPlans(
            ext, ([0, 1, 2], [((M, 2 * F), BF16), ((M,), F32), ((M, 2 * F), E4M3), ((M, 2 * fb), F32)][:4 if rows else 2],
                  alloc[:4 if rows else 2])),
    }
    for (module, name), region in regions.items():
        monkeypatch.setattr(module, name, region)
    return {(module.__name__.rsplit(".", 1)[-1], name): region for (module, name), region in regions.items()}


def _leaves(F):
    x = torch.randn(M, HIDDEN, dtype=BF16, requires_grad=True)
    w1 = torch.randn(G, 2 * F, HIDDEN, dtype=BF16, requires_grad=True)
    w2 = torch.randn(G, HIDDEN, F, dtype=BF16, requires_grad=True)
    probs = torch.rand(M, requires_grad=True)
    return x, w1, w2, probs


def _identity(layer):
    return next(k for k, v in fpm._LAYER_IDS.items() if v == layer.layer_id)


@needs_compiler
@pytest.mark.parametrize("F", [128, 80], ids=["dh-rows-handed", "F-not-a-block-multiple"])
def test_fine_plan_chains_the_regions_keys_and_runs_as_one_node(plan_ext, monkeypatch, F):
    """Each step is looked up by the Python Functions' key, with facts derived from the earlier
    steps' outputs: fc2's forward takes the SwiGLU's rows copy, fc1's dgrad takes dh's rows copy
    where F tiles into 1x128 blocks (else it casts dh itself), each wgrad the token copies and the
    aligned offsets the forward made; the node returns x's, both weights' and the routing weights'
    gradients; W^T is held for the first backward, and the rows copies die as soon as read."""
    ext = plan_ext
    regions = _fake_regions(ext, monkeypatch, F)
    x, w1, w2, probs = _leaves(F)
    lens = torch.tensor([7, 0, M - 7])
    sides = (_side(), _side())
    layer = planned_mlp.plan_mlp(x, w1, w2, probs, lens, True, *sides, BLOCKWISE, BF16, BF16)
    assert isinstance(layer, planned_mlp.PlannedMLP) and layer.arguments is fpm.mlp_arguments
    fact = host_plan.fact
    offs = _alloc_fact(G + 1, dtype=torch.int64)
    h = _alloc_fact(M, 2 * F, dtype=BF16)
    no_cache = (True, False)
    fc1_forward, fc2_forward = regions[("autograd", "_FORWARD_REGION")].keys
    assert fc1_forward == (((BLOCKWISE, None, "auto", BF16, True, False, *no_cache), 0), fact(x), None, None, fact(w1),
                           offs, None, None, None, None)
    a_rows, a_scale = _alloc_fact(M, F, dtype=E4M3), _alloc_fact(M, -(-F // 128), dtype=F32)
    assert fc2_forward == (((BLOCKWISE, None, "auto", BF16, True, True, *no_cache), 0), None, a_rows, a_scale,
                           fact(w2), offs, None, None, None, None)
    assert regions[("swiglu", "_FORWARD_REGION")].keys == [(((BLOCKWISE,), 0), h, fact(probs))]
    x_tokens, a_tokens = regions[("autograd", "_TOKENS_REGION")].keys
    assert x_tokens == (((BLOCKWISE, "forward"), 0), fact(x), offs)
    assert a_tokens == (((BLOCKWISE, "forward"), 0), _alloc_fact(M, F, dtype=BF16), offs)
    fc2_dgrad, fc1_dgrad = regions[("autograd", "_DGRAD_REGION")].keys
    fb = -(-F // 128)
    w2_kn = (_alloc_fact(G, F, HIDDEN, dtype=E4M3), (torch.Size([G, fb, 1]), (fb, 1, fb), F32, -1, 0))
    assert fc2_dgrad == (((BLOCKWISE, None, "auto", BF16, False), 0), _alloc_fact(M, HIDDEN, dtype=BF16), None, None,
                         *w2_kn, offs)
    rows = F % 128 == 0
    dh = _alloc_fact(M, 2 * F, dtype=BF16)
    handed = (None, _alloc_fact(M, 2 * F, dtype=E4M3), _alloc_fact(M, 2 * fb, dtype=F32)) if rows else (dh, None, None)
    assert fc1_dgrad[0] == ((BLOCKWISE, None, "auto", BF16, rows), 0) and fc1_dgrad[1:4] == handed
    swiglu_backward = regions[("swiglu", "_BACKWARD_ROWS_REGION" if rows else "_BACKWARD_REGION")].keys
    static = (recipe_of(BLOCKWISE), BLOCKWISE.grad_dtype, BLOCKWISE.margin) if rows else ()
    assert swiglu_backward == [((static, 0), h, fact(probs), _alloc_fact(M, F, dtype=BF16))]
    fc2_wgrad, fc1_wgrad = regions[("autograd", "_WGRAD_REGION")].keys
    assert fc2_wgrad[0] == ((BLOCKWISE, None, "auto", BF16), 0) and fc2_wgrad[-1] is None
    assert fc1_wgrad[1] == dh and fc1_wgrad[2] == _alloc_fact(HIDDEN, M + 16 * G, dtype=E4M3)
    steps, forward_steps, saved, held, kept = _identity(layer)[:5]
    assert forward_steps == 6
    assert saved == (fpm.W1, fpm.W2, fpm.PROBS) and held == (fpm.W1_KN, fpm.W1_KN_SCALE, fpm.W2_KN, fpm.W2_KN_SCALE)
    assert {fpm.H, fpm.X_T, fpm.X_T_SCALE, fpm.X_WGRAD_OFFS, fpm.A_T, fpm.A_T_SCALE, fpm.A_WGRAD_OFFS,
            fpm.OFFS_MADE} <= set(kept)
    assert not {fpm.A, fpm.A_ROWS, fpm.Y} & set(kept)
    # fc2's forward releases a's rows copy, a's token cast releases a; dgrads release their W^T.
    assert {fpm.A_ROWS, fpm.A_ROWS_SCALE} <= set(steps[4][3]) and fpm.A in steps[5][3]
    assert {fpm.W2_KN, fpm.W2_KN_SCALE} <= set(steps[6][3])
    # Same steps again: the same extension layer.
    assert planned_mlp.plan_mlp(x, w1, w2, probs, lens, True, *sides, BLOCKWISE, BF16, BF16).layer_id == layer.layer_id
    y = ext.apply_layer(layer.layer_id, 0, layer.arguments(x, w1, w2, probs, lens, *sides))
    assert y.shape == (M, HIDDEN) and "PlannedLayer" in y.grad_fn.name()
    ext.take_replayed()
    grads = torch.autograd.grad(y, (x, w1, w2, probs), torch.randn(M, HIDDEN, dtype=BF16))
    assert [g.shape for g in grads] == [x.shape, w1.shape, w2.shape, probs.shape]
    assert len(ext.take_replayed()) == 5  # fc2 dgrad + wgrad, the SwiGLU backward, fc1 dgrad + wgrad


@needs_compiler
def test_fine_plan_with_weight_caches_and_main_grad(plan_ext, monkeypatch):
    """The caches' W, scales and W^T join the forward regions' inputs (W^T's scales, a view of W's,
    do not); the forward returns no W^T, so dgrad reads the cache's (kept by the node, not held);
    the wgrads write into main_grad and the weights' gradients are their placeholders; offsets
    passed in are saved."""
    ext = plan_ext
    F = 128
    regions = _fake_regions(ext, monkeypatch, F, cached=True, main_grad=True)
    x, w1, w2, probs = _leaves(F)
    offs = torch.tensor([0, 7, 7, M])
    main1, main2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    placeholder = torch.full(w1.shape, 3.0, dtype=BF16)
    caches = [quantize_weight_fine(w.detach(), BLOCKWISE) for w in (w1, w2)]
    sides = (_side(w_fp8=caches[0], main_grad=main1, placeholder=placeholder), _side(w_fp8=caches[1], main_grad=main2))
    layer = planned_mlp.plan_mlp(x, w1, w2, probs, offs, False, *sides, BLOCKWISE, BF16, BF16)
    assert isinstance(layer, planned_mlp.PlannedMLP)
    fact = host_plan.fact
    fc1_forward, _ = regions[("autograd", "_FORWARD_REGION")].keys
    cache = caches[0]
    assert fc1_forward == (((BLOCKWISE, None, "auto", BF16, True, False, False, True), 0), fact(x), None, None,
                           fact(w1), fact(offs), fact(cache.data), fact(cache.scale), fact(cache.data_t), None)
    fc2_dgrad, fc1_dgrad = regions[("autograd", "_DGRAD_REGION")].keys
    assert fc1_dgrad[4:6] == (fact(cache.data_t), fact(cache.scale_t))  # the cache's W^T and its scales' view
    fc2_wgrad, fc1_wgrad = regions[("autograd", "_WGRAD_REGION")].keys
    assert fc2_wgrad[0] == ((BLOCKWISE, None, "auto", F32), 0) and fc2_wgrad[-1] == fact(main2)
    assert fc1_wgrad[-1] == fact(main1)
    _, _, saved, held, kept = _identity(layer)[:5]
    assert saved == (fpm.W1, fpm.W2, fpm.PROBS, fpm.SRC) and held == ()
    assert {*fpm.CACHE1[2:], *fpm.CACHE2[2:], fpm.MAIN_GRAD1, fpm.MAIN_GRAD2, fpm.PLACEHOLDER1} <= set(kept)
    y = ext.apply_layer(layer.layer_id, 0, layer.arguments(x, w1, w2, probs, offs, *sides))
    y.backward(torch.randn(M, HIDDEN, dtype=BF16))
    assert torch.equal(w1.grad, placeholder) and w2.grad is None
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape


@needs_compiler
def test_fine_plan_refuses_what_the_python_path_keeps(plan_ext):
    """No plan where h needs no gradient (no handoff), or a main_grad the wgrad cannot accumulate
    into in its epilogue (not float32: added after the kernel)."""
    F = 128
    x, w1, w2, probs = _leaves(F)
    lens = torch.tensor([7, 0, M - 7])
    x.requires_grad_(False)
    w1.requires_grad_(False)
    assert planned_mlp.plan_mlp(x, w1, w2, probs, lens, True, _side(), _side(), BLOCKWISE, BF16, BF16) \
        is fpm.NOT_PLANNABLE
    x.requires_grad_(True)
    bf16_main = _side(main_grad=torch.zeros(w1.shape, dtype=BF16))
    assert planned_mlp.plan_mlp(x, w1, w2, probs, lens, True, bf16_main, _side(), BLOCKWISE, BF16, BF16) \
        is fpm.NOT_PLANNABLE


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("F", [128, 80], ids=["dh-rows-handed", "F-not-a-block-multiple"])
@pytest.mark.parametrize("held", [True, False], ids=["first-backward", "W^T-released"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_fine_mlp_python_backward_equals_the_python_functions(granularity, F, held, main_grad):
    """The node's Python backward (fine_grained.planned_mlp._mlp_backward) on a table made by the
    forward tensors equals GroupedSwiGLUMLPFP8's Python Functions bit for bit (torch backend, CPU):
    every gradient, into main_grad or returned, with W^T held or re-derived, dh's rows copy handed
    to fc1 or cast there."""
    config = Float8Config(granularity=granularity)
    recipe = recipe_of(config)
    mlp, x, probs, offs, dy, w1, w2 = mlp_python_backward_case(G, M, HIDDEN, F, config)
    fwd, margin = config.forward_dtype, config.margin
    h, w1_kn, w1_kn_scale = fine._forward_tensors(x, None, None, w1, None, offs, config, None, "torch", BF16, True)
    x_t, x_t_scale, x_offs = quantize_tokens_for_wgrad(x, offs, recipe, fwd, margin)
    a, a_rows, a_scale = quantize_swiglu_rows(h, probs, recipe, fwd, margin)
    _, w2_kn, w2_kn_scale = fine._forward_tensors(a, a_rows, a_scale, w2, None, offs, config, None, "torch", BF16, True)
    a_t, a_t_scale, a_offs = quantize_tokens_for_wgrad(a, offs, recipe, fwd, margin)
    table = [None] * fpm.NUM_VALUES
    for v, t in ((fpm.W1, w1), (fpm.W2, w2), (fpm.PROBS, probs), (fpm.SRC, offs), (fpm.H, h), (fpm.X_T, x_t),
                 (fpm.X_T_SCALE, x_t_scale), (fpm.X_WGRAD_OFFS, x_offs), (fpm.A_T, a_t), (fpm.A_T_SCALE, a_t_scale),
                 (fpm.A_WGRAD_OFFS, a_offs)):
        table[v] = t
    if held:
        table[fpm.W1_KN], table[fpm.W1_KN_SCALE], table[fpm.W2_KN], table[fpm.W2_KN_SCALE] = \
            w1_kn, w1_kn_scale, w2_kn, w2_kn_scale
    main = None
    if main_grad:
        main = (torch.randn(w1.shape), torch.randn(w2.shape))
        table[fpm.MAIN_GRAD1], table[fpm.MAIN_GRAD2] = main[0].clone(), main[1].clone()
    info = fpm._MLPBackward(config, None, "torch", None, "torch", fpm.SRC, False, False, True, True, True, True, BF16,
                            BF16, BF16, BF16)
    grads = fpm._mlp_backward(info, dy, table, False)
    assert_mlp_grads_equal_the_module(fpm, grads, table, main, mlp, x, probs, offs, dy)


# -- one grouped linear (turbo_moe/fine_grained/planned_layer.py) ---------------------------------

K, N = 64, 48


def _fake_linear_regions(ext, monkeypatch, cached=False, main_grad=False):
    """Blockwise: offsets; the forward GEMM (W^T and its scales' transposed view unless cached);
    x's token copy; dgrad; wgrad (``main_grad``: into its out=)."""
    alloc = [("alloc", k) for k in range(3)]
    nb, kb = -(-N // 128), -(-K // 128)
    cache = [5, 6, 7] if cached else []
    forward = (([0, 3, 4, *cache], [((M, N), BF16)], [alloc[0], None, None]) if cached else
               ([0, 3, 4], [((M, N), BF16), ((G, K, N), E4M3), ((G, nb, kb), F32)],
                [alloc[0], alloc[1], ("view", 2, (G, kb, nb), (nb * kb, 1, kb), 0)]))
    regions = {
        (fpl, "OFFSETS_REGION"): LaunchlessPlans(ext, ([0], [((G + 1,), torch.int64)], alloc[:1])),
        (fine, "_FORWARD_REGION"): LaunchlessPlans(ext, forward),
        (fine, "_TOKENS_REGION"): LaunchlessPlans(ext, ([0, 1], [((K, M + 16 * G), E4M3), ((K, 2 * G), F32),
                                                                  ((G + 1,), torch.int64)], alloc[:3])),
        (fine, "_DGRAD_REGION"): LaunchlessPlans(ext, ([0, 3, 4, 5], [((M, K), BF16)], alloc[:1])),
        (fine, "_WGRAD_REGION"): LaunchlessPlans(ext, ([0, 1, 2, 3, 4, 5], [], [("input", 5)]) if main_grad else
                                                 ([0, 1, 2, 3, 4], [((G, N, K), BF16)], alloc[:1])),
    }
    for (module, name), region in regions.items():
        monkeypatch.setattr(module, name, region)
    return {name: region for (_, name), region in regions.items()}


def _linear_identity(layer):
    return next(k for k, v in fpl._LAYER_IDS.items() if v == layer.layer_id)


@needs_compiler
def test_fine_linear_plan_chains_the_regions_keys_and_runs_as_one_node(plan_ext, monkeypatch):
    """The Function's keys, with facts from the earlier steps' outputs (dgrad reads the forward's
    W^T and its scales' view, the wgrad the token copy and its aligned offsets); the node returns
    x's and W's gradients; W^T is held for the first backward and released by dgrad; dy is released
    by its last reader, the wgrad."""
    ext = plan_ext
    regions = _fake_linear_regions(ext, monkeypatch)
    x = torch.randn(M, K, dtype=BF16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=BF16, requires_grad=True)
    lens = torch.tensor([7, 0, M - 7])
    layer = planned_layer.plan_layer(x, w, lens, True, None, BLOCKWISE, None, "auto", BF16, True, True)
    assert isinstance(layer, planned_layer.PlannedLayer) and layer.arguments is fpl.layer_arguments
    fact = host_plan.fact
    offs = _alloc_fact(G + 1, dtype=torch.int64)
    assert regions["_FORWARD_REGION"].keys == [(((BLOCKWISE, None, "auto", BF16, True, False, True, False), 0),
                                                fact(x), None, None, fact(w), offs, None, None, None, None)]
    assert regions["_TOKENS_REGION"].keys == [(((BLOCKWISE, "forward"), 0), fact(x), offs)]
    dy = _alloc_fact(M, N, dtype=BF16)
    assert regions["_DGRAD_REGION"].keys == [(((BLOCKWISE, None, "auto", BF16, False), 0), dy, None, None,
                                              _alloc_fact(G, K, N, dtype=E4M3),
                                              (torch.Size([G, 1, 1]), (1, 1, 1), F32, -1, 0), offs)]
    assert regions["_WGRAD_REGION"].keys == [(((BLOCKWISE, None, "auto", BF16), 0), dy,
                                              _alloc_fact(K, M + 16 * G, dtype=E4M3), _alloc_fact(K, 2 * G, dtype=F32),
                                              offs, _alloc_fact(G + 1, dtype=torch.int64), None)]
    steps, forward_steps, saved, held, kept = _linear_identity(layer)[:5]
    assert forward_steps == 3
    assert saved == (fpl.W, fpl.X_T, fpl.X_T_SCALE, fpl.OFFS_MADE, fpl.X_WGRAD_OFFS)
    assert held == (fpl.W_KN, fpl.W_KN_SCALE) and kept == ()
    assert {fpl.W_KN, fpl.W_KN_SCALE} <= set(steps[3][3]) and fpl.DY in steps[4][3] and fpl.DY not in steps[3][3]
    assert planned_layer.plan_layer(x, w, lens, True, None, BLOCKWISE, None, "auto", BF16, True, True).layer_id \
        == layer.layer_id
    y = ext.apply_layer(layer.layer_id, 0, layer.arguments(x, w, lens, None))
    assert y.shape == (M, N) and "PlannedLayer" in y.grad_fn.name()
    ext.take_replayed()
    grads = torch.autograd.grad(y, (x, w), torch.randn(M, N, dtype=BF16))
    assert [g.shape for g in grads] == [x.shape, w.shape]
    assert len(ext.take_replayed()) == 2  # dgrad, wgrad


@needs_compiler
def test_fine_linear_plan_with_weight_cache_main_grad_and_forward_only(plan_ext, monkeypatch):
    """The cache's W, scales and W^T are the forward's inputs and dgrad reads the cache's W^T (kept,
    not held); the wgrad writes into main_grad and W's gradient is the placeholder. Under no grad
    the layer is the forward steps alone, without the token copy (nothing would read it)."""
    ext = plan_ext
    regions = _fake_linear_regions(ext, monkeypatch, cached=True, main_grad=True)
    x = torch.randn(M, K, dtype=BF16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=BF16, requires_grad=True)
    offs = torch.tensor([0, 7, 7, M])
    cache = quantize_weight_fine(w.detach(), BLOCKWISE)
    main = torch.zeros(w.shape)
    placeholder = torch.full(w.shape, 3.0, dtype=BF16)
    layer = planned_layer.plan_layer(x, w, offs, False, cache, BLOCKWISE, None, "auto", BF16, True, True,
                                     main_grad=main, placeholder=placeholder)
    fact = host_plan.fact
    assert regions["_DGRAD_REGION"].keys[0][4:6] == (fact(cache.data_t), fact(cache.scale_t))
    assert regions["_WGRAD_REGION"].keys[0][0] == ((BLOCKWISE, None, "auto", F32), 0)
    assert regions["_WGRAD_REGION"].keys[0][-1] == fact(main)
    _, _, saved, held, kept = _linear_identity(layer)[:5]
    assert saved == (fpl.W, fpl.X_T, fpl.X_T_SCALE, fpl.SRC, fpl.X_WGRAD_OFFS) and held == ()
    assert set(kept) == {fpl.CACHE[2], fpl.CACHE[3], fpl.MAIN_GRAD, fpl.PLACEHOLDER}
    y = ext.apply_layer(layer.layer_id, 0, layer.arguments(x, w, offs, cache, None, main, placeholder))
    y.backward(torch.randn(M, N, dtype=BF16))
    assert torch.equal(w.grad, placeholder) and x.grad.shape == x.shape
    tokens_before = len(regions["_TOKENS_REGION"].keys)
    inference = planned_layer.plan_layer(x, w, offs, False, cache, BLOCKWISE, None, "auto", BF16, True, True,
                                         forward_only=True)
    assert len(regions["_TOKENS_REGION"].keys) == tokens_before
    steps, forward_steps, saved, held, kept = _linear_identity(inference)[:5]
    assert len(steps) == forward_steps == 1 and saved == held == kept == ()


@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("held", [True, False], ids=["first-backward", "W^T-released"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_fine_linear_python_backward_equals_the_python_function(granularity, held, main_grad):
    """The node's Python backward (fine_grained.planned_layer._linear_backward) on a table made by
    the forward tensors equals GroupedLinearFP8's Python Function bit for bit (torch backend, CPU)."""
    torch.manual_seed(1)
    config = Float8Config(granularity=granularity)
    recipe = recipe_of(config)
    layer = GroupedLinearFP8(G, K, N, config=config, backend="torch", dtype=BF16, cache_fp8_weight=False)
    x = torch.randn(M, K, dtype=BF16)
    offs = torch.tensor([0, 7, 7, M])
    dy = torch.randn(M, N, dtype=BF16)
    w = layer.weight.detach()
    _, w_kn, w_kn_scale = fine._forward_tensors(x, None, None, w, None, offs, config, None, "torch", BF16, True)
    x_t, x_t_scale, x_offs = quantize_tokens_for_wgrad(x, offs, recipe, config.forward_dtype, config.margin)
    table = [None] * fpl.NUM_VALUES
    for v, t in ((fpl.W, w), (fpl.SRC, offs), (fpl.X_T, x_t), (fpl.X_T_SCALE, x_t_scale), (fpl.X_WGRAD_OFFS, x_offs)):
        table[v] = t
    if held:
        table[fpl.W_KN], table[fpl.W_KN_SCALE] = w_kn, w_kn_scale
    main = torch.randn(w.shape) if main_grad else None
    if main_grad:
        table[fpl.MAIN_GRAD] = main.clone()
    info = fpl._Backward(config, None, "torch", fpl.SRC, False, True, True, BF16, BF16)
    grads = fpl._linear_backward(info, dy, table, False)
    x_ref = x.clone().requires_grad_()
    layer(x_ref, group_offs=offs).backward(dy)
    assert torch.equal(grads[fpl.X].view(torch.uint8), x_ref.grad.view(torch.uint8))
    if main_grad:
        assert grads[fpl.W] is None
        assert torch.allclose(table[fpl.MAIN_GRAD], main + layer.weight.grad.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(grads[fpl.W].view(torch.uint8), layer.weight.grad.view(torch.uint8))
    assert all(g is None for k, g in enumerate(grads) if k not in (fpl.X, fpl.W))
