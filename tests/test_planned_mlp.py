"""The planned MLP (turbo_moe/planned_mlp.py) on the CPU: its wiring through the C++ node with
plans that allocate and launch nothing, and its Python backward against the Python Functions.
GPU equality with the Python path: tests/test_planned_mlp_gpu.py and test_megatron_gpu.py."""

import pytest
import torch

from turbo_moe import Float8Config, GroupedSwiGLUMLPFP8, host_plan, planned_mlp as pm
from turbo_moe.autograd import _fp8_forward_tensors
from turbo_moe.swiglu import _swiglu_gemm_forward_tensors

from _planned import LaunchlessPlans, assert_mlp_grads_equal_the_module, mlp_python_backward_case, needs_compiler

pytestmark = needs_compiler

G, M, HIDDEN, F = 3, 20, 32, 24
E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


def _contiguous(*shape):
    return tuple(pm._contiguous_strides(shape))


AMAX_SLOTS = 256  # the SwiGLU amax partials of the fake fc1 forward


def _fake_regions(ext, monkeypatch, main_grad=False):
    """Tensorwise, no weight cache, group_lens: offsets; fc1 forward; SwiGLU + fc2 forward; fc2
    dgrad (W^T held, released) and wgrad; the SwiGLU backward (dh's two layouts); fc1 dgrad
    (passing the handed token-major copy through) and wgrad (``main_grad``: into its out=)."""
    alloc = [("alloc", k) for k in range(5)]
    wgrad = ([([1, 2, 3, 4, 5, 6], [], [("input", 6)])] * 2 if main_grad else
             [([1, 2, 3, 4, 5], [((G, HIDDEN, F), BF16)], alloc[:1]), ([1, 2, 3, 4, 5], [((G, 2 * F, HIDDEN), BF16)], alloc[:1])])
    regions = {
        "OFFSETS_REGION": LaunchlessPlans(ext, ([0], [((G + 1,), torch.int64)], alloc[:1])),
        # fc1's forward also makes the SwiGLU amax partials (tensorwise current scaling), from the
        # routing weights (its input 7, after the weight cache's four).
        "_FORWARD_REGION": LaunchlessPlans(ext, ([0, 1, 2, 7], [((M, 2 * F), BF16), ((G, HIDDEN, 2 * F), E4M3), ((), F32),
                                                      ((HIDDEN, M), E4M3), ((AMAX_SLOTS,), F32)],
                                        [*alloc[:4], ("alloc", 2), ("alloc", 4)])),
        "_DGRAD_REGION": LaunchlessPlans(ext, ([0, 4, 5, 6], [((M, F), BF16), ((HIDDEN, M), E4M3), ((), F32)], alloc[:3]),
                                ([1, 2, 3, 4, 5, 6], [((M, HIDDEN), BF16)], [alloc[0], ("input", 2), ("input", 3)])),
        "_WGRAD_REGION": LaunchlessPlans(ext, *wgrad),
    }
    swiglu_regions = {
        "_FORWARD_REGION": LaunchlessPlans(ext, ([0, 1, 2, 3, 8], [((M, HIDDEN), BF16), ((G, F, HIDDEN), E4M3), ((), F32),
                                                         ((F, M), E4M3)], [*alloc[:4], ("alloc", 2)])),
        "_BACKWARD_REGION": LaunchlessPlans(ext, ([0, 1, 2], [((M, 2 * F), E4M3), ((2 * F, M), E4M3), ((), F32), ((M,), F32)],
                                         alloc[:4])),
    }
    for name, region in regions.items():  # the GEMM backward regions are looked up by planned_layer's steps
        monkeypatch.setattr(pm if name in ("OFFSETS_REGION", "_FORWARD_REGION") else pm.planned_layer, name, region)
    for name, region in swiglu_regions.items():
        monkeypatch.setattr(pm.swiglu, name, region)
    return regions, swiglu_regions


def _side(**kwargs):
    return pm.MLPSide(**{**dict(num_cu=None, backend="auto", w_fp8=None, delayed=None, main_grad=None,
                                placeholder=None), **kwargs})


def _args(x, w1, w2, probs, lens, sides):
    return [x, w1, w2, probs, lens, *pm._side_args(sides[0])[:4], *pm._side_args(sides[1])[:4],
            sides[0].main_grad, sides[1].main_grad, sides[0].placeholder, sides[1].placeholder,
            *pm._side_args(sides[0])[4:], *pm._side_args(sides[1])[4:]]


def test_plan_mlp_chains_the_regions_keys_and_runs_as_one_node(plan_ext, monkeypatch):
    """Each step is looked up by the Python path's key, with facts derived from the earlier steps'
    outputs (the handoff's dh layouts feed fc1's dgrad; its pass-through feeds fc1's wgrad); the node
    returns x's, both weights' and the routing weights' gradients; held and intermediate values
    leave with the backward."""
    ext = plan_ext
    regions, swiglu_regions = _fake_regions(ext, monkeypatch)
    config = Float8Config()
    x = torch.randn(M, HIDDEN, dtype=BF16, requires_grad=True)
    w1 = torch.randn(G, 2 * F, HIDDEN, dtype=BF16, requires_grad=True)
    w2 = torch.randn(G, HIDDEN, F, dtype=BF16, requires_grad=True)
    probs = torch.rand(M, requires_grad=True)
    lens = torch.tensor([7, 0, M - 7])
    sides = (_side(), _side())
    layer = pm.plan_mlp(x, w1, w2, probs, lens, True, *sides, config, BF16, BF16)
    assert isinstance(layer, pm.PlannedMLP)
    # dy is read by fc2's dgrad alone, which releases it (freed once quantized).
    steps = next(k for k, v in pm._LAYER_IDS.items() if v == layer.layer_id)[0]
    readers = [step for step in steps if pm.DY in step[1]]
    assert [step[0] for step in readers] == [regions["_DGRAD_REGION"].plans[0].plan_id] and pm.DY in readers[0][3]
    fact = host_plan.fact
    offs = (torch.Size([G + 1]), (1,), torch.int64, -1, 0)

    def alloc(*shape, dtype):
        return (torch.Size(shape), _contiguous(*shape), dtype, -1, 0)

    scalar = alloc(dtype=F32)
    h = alloc(M, 2 * F, dtype=BF16)
    assert regions["_FORWARD_REGION"].keys == [(((config, None, "auto", BF16, True, True, True, False, "swiglu amax"),
                                                 0), fact(x), fact(w1), offs, None, None, None, None, fact(probs))]
    assert swiglu_regions["_FORWARD_REGION"].keys == [(((config, None, "auto", BF16, True, True, True, False,
                                                         "given amax"), 0), h, fact(probs), fact(w2), offs, None,
                                                       None, None, None, alloc(AMAX_SLOTS, dtype=F32))]
    fc2_dgrad, fc1_dgrad = regions["_DGRAD_REGION"].keys
    assert fc2_dgrad == (((config, None, "auto", BF16, True, True), 0), alloc(M, HIDDEN, dtype=BF16), None, None, None,
                         alloc(G, F, HIDDEN, dtype=E4M3), scalar, offs)
    assert swiglu_regions["_BACKWARD_REGION"].keys == [(((config.grad_dtype, 0, True, True, False), 0), h, fact(probs),
                                                        alloc(M, F, dtype=BF16), None)]
    dh_t = alloc(2 * F, M, dtype=E4M3)
    assert fc1_dgrad == (((config, None, "auto", BF16, True, True), 0), None, alloc(M, 2 * F, dtype=E4M3), dh_t, scalar,
                         alloc(G, HIDDEN, 2 * F, dtype=E4M3), scalar, offs)
    assert regions["_WGRAD_REGION"].keys[1] == (((config, None, "auto", BF16), 0), None, dh_t, scalar,
                                                alloc(HIDDEN, M, dtype=E4M3), scalar, offs, None)
    # Same steps again: the same extension layer.
    assert pm.plan_mlp(x, w1, w2, probs, lens, True, *sides, config, BF16, BF16).layer_id == layer.layer_id
    y = ext.apply_layer(layer.layer_id, 0, _args(x, w1, w2, probs, lens, sides))
    assert y.shape == (M, HIDDEN) and "PlannedLayer" in y.grad_fn.name()
    ext.take_replayed()
    grads = torch.autograd.grad(y, (x, w1, w2, probs), torch.randn(M, HIDDEN, dtype=BF16))
    assert [g.shape for g in grads] == [x.shape, w1.shape, w2.shape, probs.shape]
    assert len(ext.take_replayed()) == 5  # fc2 dgrad + wgrad, the SwiGLU backward, fc1 dgrad + wgrad


def test_plan_mlp_with_main_grad_returns_the_placeholder(plan_ext, monkeypatch):
    """With main_grad targets the wgrad steps write into them (the plans pass them through) and the
    weights' gradients are their placeholders; a weight without the protocol gets none."""
    ext = plan_ext
    regions, _ = _fake_regions(ext, monkeypatch, main_grad=True)
    x = torch.randn(M, HIDDEN, dtype=BF16, requires_grad=True)
    w1 = torch.randn(G, 2 * F, HIDDEN, dtype=BF16, requires_grad=True)
    w2 = torch.randn(G, HIDDEN, F, dtype=BF16, requires_grad=True)
    probs = torch.rand(M, requires_grad=True)
    lens = torch.tensor([7, 0, M - 7])
    main1, main2 = torch.zeros(w1.shape), torch.zeros(w2.shape)
    placeholder = torch.full(w1.shape, 3.0, dtype=BF16)
    sides = (_side(main_grad=main1, placeholder=placeholder), _side(main_grad=main2))
    layer = pm.plan_mlp(x, w1, w2, probs, lens, True, *sides, Float8Config(), BF16, BF16)
    assert regions["_WGRAD_REGION"].keys[0][0] == ((Float8Config(), None, "auto", torch.float32), 0)
    assert regions["_WGRAD_REGION"].keys[0][-1] == host_plan.fact(main2)
    y = ext.apply_layer(layer.layer_id, 0, _args(x, w1, w2, probs, lens, sides))
    y.backward(torch.randn(M, HIDDEN, dtype=BF16))
    assert torch.equal(w1.grad, placeholder) and w2.grad is None
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape


def test_plan_mlp_with_weight_caches_and_delayed_scaling(plan_ext, monkeypatch):
    """The caches' copies and each amax history's (state, ticket) join the regions' inputs as
    through_plan puts them (live histories counted in the static key); W^T passed through from a
    cache makes each GEMM's backward one region, and the node keeps that W^T (not held: the cache
    owns it) with everything else the backward reads; saved are the weights and routing weights."""
    ext = plan_ext
    from turbo_moe.autograd import quantize_weight
    from turbo_moe.delayed_scaling import DelayedScalingState

    config = Float8Config(strategy="delayed", amax_history_len=4)
    alloc = [("alloc", k) for k in range(3)]
    fc1_forward = LaunchlessPlans(ext, ([0, 1, 2, 3, 4, 5, 7, 8], [((M, 2 * F), BF16), ((HIDDEN, M), E4M3), ((), F32)],
                               [alloc[0], ("input", 5), ("input", 4), alloc[1], alloc[2]]))
    fc2_forward = LaunchlessPlans(ext, ([0, 1, 2, 3, 4, 5, 6, 8, 9], [((M, HIDDEN), BF16), ((F, M), E4M3), ((), F32)],
                               [alloc[0], ("input", 6), ("input", 5), alloc[1], alloc[2]]))
    backward = LaunchlessPlans(ext, ([0, 4, 5, 6, 7, 8, 10, 11], [((M, F), BF16), ((G, HIDDEN, F), BF16)], alloc[:2]),
                      ([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [((M, HIDDEN), BF16), ((G, 2 * F, HIDDEN), BF16)], alloc[:2]))
    swiglu_backward = LaunchlessPlans(ext, ([0, 1, 2, 4, 5], [((M, 2 * F), E4M3), ((2 * F, M), E4M3), ((), F32), ((M,), F32)],
                                   [("alloc", k) for k in range(4)]))
    monkeypatch.setattr(pm, "_FORWARD_REGION", fc1_forward)
    monkeypatch.setattr(pm.planned_layer, "_BACKWARD_REGION", backward)
    monkeypatch.setattr(pm.swiglu, "_FORWARD_REGION", fc2_forward)
    monkeypatch.setattr(pm.swiglu, "_BACKWARD_REGION", swiglu_backward)
    x = torch.randn(M, HIDDEN, dtype=BF16, requires_grad=True)
    w1 = torch.randn(G, 2 * F, HIDDEN, dtype=BF16, requires_grad=True)
    w2 = torch.randn(G, HIDDEN, F, dtype=BF16, requires_grad=True)
    probs = torch.rand(M, requires_grad=True)
    offs = torch.tensor([0, 7, 7, M])
    sides = []
    for k, w in enumerate((w1, w2)):
        delayed = DelayedScalingState(config)
        # States of distinct lengths per tensor role: their facts tell the four histories apart.
        for j, history in enumerate((delayed.input, delayed.grad_output)):
            history.state, history.ticket = torch.zeros(6 + 2 * k + j), torch.zeros(1, dtype=torch.int32)
        sides.append(_side(w_fp8=quantize_weight(w.detach(), config, transposed=True), delayed=delayed))
    layer = pm.plan_mlp(x, w1, w2, probs, offs, False, *sides, config, BF16, BF16)
    assert isinstance(layer, pm.PlannedMLP)
    fact = host_plan.fact

    def cache_facts(side):
        return fact(side.w_fp8.data), fact(side.w_fp8.scale), fact(side.w_fp8.data_t), None

    def history_facts(history):
        return fact(history.state), fact(history.ticket)

    h = (torch.Size([M, 2 * F]), _contiguous(M, 2 * F), BF16, -1, 0)
    assert fc1_forward.keys == [(((config, None, "auto", BF16, True, True, False, True), 1), fact(x), fact(w1),
                                 fact(offs), *cache_facts(sides[0]), *history_facts(sides[0].delayed.input))]
    assert fc2_forward.keys == [(((config, None, "auto", BF16, True, True, False, True), 1), h, fact(probs), fact(w2),
                                 fact(offs), *cache_facts(sides[1]), *history_facts(sides[1].delayed.input))]
    fc2_backward, fc1_backward = backward.keys
    assert fc2_backward[0] == ((config, None, "auto", BF16, True, BF16), 1)
    assert fc2_backward[-2:] == history_facts(sides[1].delayed.grad_output)
    assert fc1_backward[0] == ((config, None, "auto", BF16, True, BF16), 1) and fc1_backward[1] is None
    assert fc1_backward[-2:] == history_facts(sides[0].delayed.grad_output)
    # The dh handoff writes with fc1's gradient history.
    assert swiglu_backward.keys[0][-2:] == history_facts(sides[0].delayed.grad_output)
    identity = next(k for k, v in pm._LAYER_IDS.items() if v == layer.layer_id)
    saved, held, kept = identity[2:5]
    assert saved == (pm.W1, pm.W2, pm.PROBS, pm.SRC) and held == ()
    assert {pm.W1_KN, pm.W2_KN, pm.H, pm.X_KM, pm.A_KM, *pm.HISTORIES1[2:], *pm.HISTORIES2[2:]} <= set(kept)
    y = ext.apply_layer(layer.layer_id, 0, _args(x, w1, w2, probs, offs, sides))
    grads = torch.autograd.grad(y, (x, w1, w2, probs), torch.randn(M, HIDDEN, dtype=BF16))
    assert [g.shape for g in grads] == [x.shape, w1.shape, w2.shape, probs.shape]


@pytest.mark.parametrize("held", [True, False], ids=["first-backward", "W^T-released"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_mlp_python_backward_equals_the_python_functions(held, main_grad):
    """The node's Python backward (planned_mlp._mlp_backward) on a table made by the forward
    tensors equals GroupedSwiGLUMLPFP8's Python Functions bit for bit (torch backend, CPU): every
    gradient, into main_grad or returned, with W^T held or re-derived."""
    config = Float8Config(format="hybrid")
    mlp, x, probs, offs, dy, w1, w2 = mlp_python_backward_case(G, M, HIDDEN, F, config)
    h, w1_kn, w1_kn_scale, x_km, x_km_scale = _fp8_forward_tensors(x, w1, None, offs, config, None, "torch", BF16,
                                                                   True, True, None)
    _, w2_kn, w2_kn_scale, a_km, a_scale = _swiglu_gemm_forward_tensors(h, probs, w2, None, offs, config, None,
                                                                        "torch", BF16, True, True, None)
    table = [None] * pm.NUM_VALUES
    for v, t in ((pm.W1, w1), (pm.W2, w2), (pm.PROBS, probs), (pm.SRC, offs), (pm.H, h), (pm.W1_KN_SCALE, w1_kn_scale),
                 (pm.X_KM, x_km), (pm.X_KM_SCALE, x_km_scale), (pm.W2_KN_SCALE, w2_kn_scale), (pm.A_KM, a_km),
                 (pm.A_SCALE, a_scale)):
        table[v] = t
    if held:
        table[pm.W1_KN], table[pm.W2_KN] = w1_kn, w2_kn
    main = None
    if main_grad:
        main = (torch.randn(w1.shape), torch.randn(w2.shape))
        table[pm.MAIN_GRAD1], table[pm.MAIN_GRAD2] = main[0].clone(), main[1].clone()
        table[pm.PLACEHOLDER1] = table[pm.PLACEHOLDER2] = None
    info = pm._MLPBackward(config, None, "torch", None, "torch", pm.SRC, False, False, True, True, True, True, BF16,
                           BF16, BF16, BF16, main_grad, main_grad)
    grads = pm._mlp_backward(info, dy, table, False)
    assert_mlp_grads_equal_the_module(pm, grads, table, main, mlp, x, probs, offs, dy)


def test_planned_caches_are_left_out_of_copies():
    """A module's planned layers are extension ids of this process (KeepsPlannedLayers): deepcopy
    and pickle leave them out, and an object pickled before it had them gets an empty cache."""
    import copy
    import pickle

    mlp = GroupedSwiGLUMLPFP8(2, 16, 8, backend="torch")
    mlp._planned[("key",)] = ("static", host_plan)  # a module object: cannot be copied or pickled
    assert copy.deepcopy(mlp)._planned == {}
    assert pickle.loads(pickle.dumps(mlp))._planned == {}
    state = mlp.__getstate__()
    del state["_planned"], state["_ones"]  # as pickled before this session
    fresh = GroupedSwiGLUMLPFP8.__new__(GroupedSwiGLUMLPFP8)
    fresh.__setstate__(state)
    assert fresh._planned == {} and fresh._ones is None
    assert mlp._planned  # the original keeps its own
