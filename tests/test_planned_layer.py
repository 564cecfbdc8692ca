"""Planned layers (turbo_moe/planned_layer.py, csrc/launch_plan.cpp): the C++ autograd node's
wiring on the CPU, with plans that allocate and launch nothing. GPU equality with the Python
path: tests/test_planned_layer_gpu.py."""

import functools

import pytest
import torch

from turbo_moe import host_plan, planned_layer

from _planned import needs_compiler

pytestmark = needs_compiler


def _plan(ext, num_inputs, allocs, fill=0.0):
    """A plan without launches: its allocations (shape; zero filled) are its outputs, in order."""
    error, plan = ext.add_plan(num_inputs + len(allocs), [])
    assert error == ""
    specs = [(list(shape), [shape[1], 1] if len(shape) == 2 else [1], torch.empty(0), True, [], []) for shape in allocs]
    assert ext.set_allocs(plan, specs) == ""
    assert ext.set_outputs(plan, [(2, j, [], [], 0) for j in range(len(allocs))]) == ""
    return plan


def _args(*tensors):
    """apply_layer's arguments of a grouped linear's table: x, w, then a0..a8 (None: absent)."""
    return list(tensors) + [None] * (11 - len(tensors))


def _linear_args(*tensors):
    """apply_layer's arguments of planned_layer's table (x, w, the offsets source, the cache, the
    histories, main_grad, its placeholder), None where absent."""
    return list(tensors) + [None] * (planned_layer.NUM_ARGS - len(tensors))


def _grads(dx=-1, dw=-1):
    """add_layer's gradient of each argument: x's and w's, none for a0..a8."""
    return [dx, dw] + [-1] * 9


def _layer(ext, held):
    """x [4, 5], w [3, 5] (values 0, 1; 2-10 are the optional arguments). Forward: y [4, 3] into 11,
    a saved tensor into 12. Backward reads dy (13) and 12 -- or the held 12 -- and makes dx (14) and
    dw (15)."""
    forward = _plan(ext, 2, [(4, 3), (2,)])
    backward = _plan(ext, 2, [(4, 5), (3, 5)])
    saved = [1] if held else [12, 1]
    error, layer = ext.add_layer(16, 11, [(forward, [0, 1], [11, 12], [])], [(backward, [13, 12], [14, 15], [])], saved,
                                 [12] if held else [], [], 11, 13, _grads(14, 15))
    assert error == ""
    return layer, backward


def test_layer_runs_its_forward_steps_and_its_backward_in_a_cpp_node(plan_ext):
    ext = plan_ext
    layer, backward = _layer(ext, held=False)
    ext.take_replayed()
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    y = ext.apply_layer(layer, 0, _args(x, w))
    assert y.shape == (4, 3) and torch.equal(y, torch.zeros(4, 3))
    assert "turbo_moe::PlannedLayer" in y.grad_fn.name()
    y.backward(torch.randn(4, 3))
    # The backward plan's allocations came back as the gradients (zero filled: no launch ran).
    assert torch.equal(x.grad, torch.zeros(4, 5)) and torch.equal(w.grad, torch.zeros(3, 5))
    assert ext.take_replayed() == [backward] and ext.take_replayed() == []
    # Without grad, no node.
    with torch.no_grad():
        assert ext.apply_layer(layer, 0, _args(x, w)).grad_fn is None


def test_what_the_plans_do_not_cover_goes_to_the_python_backward(plan_ext):
    """A second backward after the held value was released, a misaligned gradient and
    create_graph each call the registered fallback with the saved values; the planned backward
    runs otherwise."""
    ext = plan_ext
    layer, _ = _layer(ext, held=True)
    calls = []

    def fallback(layer_id, dy, table, create_graph):
        shapes = {k: t.shape for k, t in enumerate(table) if t is not None}
        calls.append((layer_id, dy.clone(), shapes, table[12] is None, create_graph))
        return _args(torch.ones(4, 5), torch.full((3, 5), 2.0))

    ext.set_layer_fallback(fallback)
    try:
        x = torch.randn(4, 5, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)
        y = ext.apply_layer(layer, 0, _args(x, w))
        dy = torch.randn(4, 3)
        y.backward(dy, retain_graph=True)  # planned: zeros
        assert calls == [] and torch.equal(x.grad, torch.zeros(4, 5))
        y.backward(dy)  # the held value is gone: the Python backward
        assert len(calls) == 1
        layer_id, seen, saved_shapes, held_released, create_graph = calls[0]
        assert layer_id == layer and torch.equal(seen, dy) and saved_shapes == {1: (3, 5)}
        assert held_released and not create_graph
        assert torch.equal(x.grad, torch.ones(4, 5)) and torch.equal(w.grad, torch.full((3, 5), 2.0))

        # A gradient 4 bytes off 16-byte alignment: the recorded plans assume an aligned dy.
        y = ext.apply_layer(layer, 0, _args(x, w))
        storage = torch.randn(13)
        misaligned = storage[1:].view(4, 3)
        assert misaligned.data_ptr() % 16 != 0
        y.backward(misaligned)
        assert len(calls) == 2 and torch.equal(calls[1][1], misaligned) and not calls[1][3]
        # A non-contiguous gradient is made contiguous (a fresh, aligned buffer): planned.
        y = ext.apply_layer(layer, 0, _args(x, w))
        y.backward(torch.randn(3, 4).t())
        assert len(calls) == 2

        y = ext.apply_layer(layer, 0, _args(x, w))
        torch.autograd.grad(y, (x, w), torch.randn(4, 3), create_graph=True)
        assert len(calls) == 3 and calls[2][4]
    finally:
        ext.set_layer_fallback(planned_layer._python_backward)


def test_kept_values_leave_with_the_backward_unless_the_graph_is_retained(plan_ext):
    """A kept value (an intermediate the backward steps read, 12 here) stays with the node while
    the graph is retained -- a second backward is planned too -- and goes with the last backward:
    one more raises torch's "second time" advice instead of reading a freed value."""
    ext = plan_ext
    forward = _plan(ext, 2, [(4, 3), (2,)])
    backward = _plan(ext, 2, [(4, 5), (3, 5)])
    error, layer = ext.add_layer(16, 11, [(forward, [0, 1], [11, 12], [])], [(backward, [13, 12], [14, 15], [12])],
                                 [], [], [12], 11, 13, _grads(14, 15))
    assert error == ""
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    ext.take_replayed()
    y = ext.apply_layer(layer, 0, _args(x, w))
    dy = torch.randn(4, 3)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    assert ext.take_replayed() == [backward, backward]
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)


def test_the_profiler_ties_the_nodes_backward_to_its_forward(plan_ext):
    """apply_layer records a ``turbo_moe::PlannedLayer`` range with the sequence number its node
    takes (as a Python Function's apply does), so the training benchmark's attribution
    (bench.train_step.attributed_events) counts the C++ backward with the forward's range."""
    ext = plan_ext
    from torch.profiler import ProfilerActivity, profile

    from turbo_moe.bench.train_step import attributed_events

    layer, _ = _layer(ext, held=False)
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("experts"):
            y = ext.apply_layer(layer, 0, _args(x, w))
        y.backward(torch.randn(4, 3))
    events = prof.events()
    forward = [e for e in events if e.name == "turbo_moe::PlannedLayer"]
    assert len(forward) == 1 and forward[0].sequence_nr >= 0
    backward = [e for e in attributed_events(events, "experts") if "evaluate_function" in e.name]
    assert [e.sequence_nr for e in backward] == [forward[0].sequence_nr]
    assert "PlannedLayer" in backward[0].name


def test_add_layer_refuses_what_it_cannot_run(plan_ext):
    ext = plan_ext
    plan = _plan(ext, 2, [(4, 3)])
    step = (plan, [0, 1], [11], [])
    assert "no plan" in ext.add_layer(16, 11, [(10 ** 6, [0], [11], [])], [], [], [], [], 11, 13, _grads())[0]
    assert "out of range" in ext.add_layer(16, 11, [(plan, [0, 16], [11], [])], [], [], [], [], 11, 13, _grads())[0]
    assert "out of range" in ext.add_layer(16, 11, [step], [], [40], [], [], 11, 13, _grads())[0]
    assert "out of range" in ext.add_layer(16, 11, [step], [], [], [16], [], 11, 13, _grads())[0]
    assert "out of range" in ext.add_layer(16, 11, [step], [], [], [], [], 11, 13, _grads(16))[0]
    assert "without forward steps" in ext.add_layer(16, 11, [], [], [], [], [], 11, 13, _grads())[0]
    assert "starts with its arguments" in ext.add_layer(10, 11, [step], [], [], [], [], 3, 4, _grads())[0]
    assert "one gradient per argument" in ext.add_layer(16, 11, [step], [], [], [], [], 11, 13, [-1, -1])[0]
    # A step input the caller did not give is a clear error, not a crash.
    error, reads_a0 = ext.add_layer(16, 11, [(plan, [0, 2], [11], [])], [], [], [], [], 11, 13, _grads())
    assert error == ""
    x = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="step input"):
        ext.apply_layer(reads_a0, 0, _args(x, x))
    with pytest.raises(RuntimeError, match="takes 11 arguments"):
        ext.apply_layer(reads_a0, 0, [x, x])


def test_spec_facts_are_the_keys_the_python_path_computes():
    """A replay's outputs have the facts plan_layer derives for them (alloc: aligned; view: its
    storage offset's alignment; input: the input's own)."""
    allocs = (((4, 6), (6, 1), torch.float32, False, ()),)
    t = torch.empty_strided((4, 6), (6, 1), dtype=torch.float32)
    assert planned_layer._spec_fact(("alloc", 0), (), allocs, -1) == host_plan.fact(t)
    view = t.as_strided((2, 3), (6, 1), 1)
    assert planned_layer._spec_fact(("view", 0, (2, 3), (6, 1), 1), (), allocs, -1) == \
        (view.shape, view.stride(), view.dtype, -1, (view.data_ptr() - t.data_ptr()) % 16)
    assert planned_layer._spec_fact(("input", 1), ("a", "b"), allocs, -1) == "b"
    assert planned_layer._contiguous_strides((4, 0, 3)) == torch.empty(4, 0, 3).stride()


class _FakeRegion:
    """A region whose plans are launch-less extension plans (allocations only): records the keys
    plan_layer asks for."""

    def __init__(self, ext, positions, allocs, outputs):
        error, self.plan_id = ext.add_plan(len(positions) + len(allocs), [])
        assert error == ""
        specs = [(list(shape), list(strides), torch.empty(0, dtype=dtype), False, [], []) for shape, strides, dtype in allocs]
        assert ext.set_allocs(self.plan_id, specs) == ""
        assert ext.set_outputs(self.plan_id, [host_plan._cpp_output_spec(o, positions) for o in outputs]) == ""
        self.plan = host_plan._Plan(self.plan_id, positions, tuple((*a, False, (), ()) for a in allocs), tuple(outputs),
                                    ext)
        self.keys = []

    def plan_for(self, key):
        self.keys.append(key)
        return self.plan

    def refused(self, key):
        return False


def test_plan_layer_asks_each_region_for_the_python_paths_key_and_wires_the_steps(plan_ext, monkeypatch):
    """Tensorwise, no weight cache, group_lens: offsets, forward, dgrad, wgrad. Each step's key is
    made of the facts the earlier steps' recorded outputs give (fresh allocations: aligned), the
    layer is registered once per distinct set of steps, and it runs (launch-less plans: the
    gradients are the backward plans' allocations, of the inputs' shapes)."""
    ext = plan_ext
    from turbo_moe import Float8Config, checks

    G, M, K, N = 3, 8, 16, 12
    e4m3 = torch.float8_e4m3fn
    f32, bf16 = torch.float32, torch.bfloat16
    offsets = _FakeRegion(ext, [0], [((G + 1,), (1,), torch.int64)], [("alloc", 0)])
    forward = _FakeRegion(ext, [0, 1, 2], [((M, N), (N, 1), bf16), ((G, K, N), (K * N, N, 1), e4m3), ((), (), f32),
                                           ((K, M), (M, 1), e4m3)],
                          [("alloc", 0), ("alloc", 1), ("alloc", 2), ("alloc", 3), ("alloc", 2)])
    dgrad = _FakeRegion(ext, [0, 4, 5, 6], [((M, K), (K, 1), bf16), ((N, M), (M, 1), e4m3), ((), (), f32)],
                        [("alloc", 0), ("alloc", 1), ("alloc", 2)])
    wgrad = _FakeRegion(ext, [1, 2, 3, 4, 5], [((G, N, K), (N * K, K, 1), bf16)], [("alloc", 0)])
    monkeypatch.setattr(planned_layer, "OFFSETS_REGION", offsets)
    for name, fake in (("_FORWARD_REGION", forward), ("_DGRAD_REGION", dgrad), ("_WGRAD_REGION", wgrad)):
        monkeypatch.setattr(planned_layer, name, fake)
    config = Float8Config()
    x = torch.randn(M, K, dtype=bf16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=bf16, requires_grad=True)
    lens = torch.tensor([3, 0, 5])
    layer = planned_layer.plan_layer(x, w, lens, True, None, config, None, "auto", bf16, True, True)
    assert isinstance(layer, planned_layer.PlannedLayer)
    # dy is read by dgrad alone (the wgrad reads dgrad's token-major copy), which releases it: the
    # node holds the engine's reference, so dy is freed once quantized.
    steps = next(k for k, v in planned_layer._LAYER_IDS.items() if v == layer.layer_id)[0]
    readers = [step for step in steps if planned_layer.DY in step[1]]
    assert [step[0] for step in readers] == [dgrad.plan_id] and planned_layer.DY in readers[0][3]
    fact = host_plan.fact
    assert offsets.keys == [(checks.offsets_region_key(M, True), fact(lens))]
    offs_fact = (torch.Size([G + 1]), (1,), torch.int64, -1, 0)
    assert forward.keys == [(((config, None, "auto", bf16, True, True, True, False), 0), fact(x), fact(w), offs_fact,
                             None, None, None, None)]
    w_kn = (torch.Size([G, K, N]), (K * N, N, 1), e4m3, -1, 0)
    scalar = (torch.Size([]), (), f32, -1, 0)
    dy = (torch.Size([M, N]), (N, 1), bf16, -1, 0)
    assert dgrad.keys == [(((config, None, "auto", bf16, True, True), 0), dy, None, None, None, w_kn, scalar, offs_fact)]
    assert wgrad.keys == [(((config, None, "auto", bf16), 0), None, (torch.Size([N, M]), (M, 1), e4m3, -1, 0), scalar,
                           (torch.Size([K, M]), (M, 1), e4m3, -1, 0), scalar, offs_fact, None)]
    # The same steps again (another module, or a rebuilt cache): the same extension layer.
    again = planned_layer.plan_layer(x, w, lens, True, None, config, None, "auto", bf16, True, True)
    assert again.layer_id == layer.layer_id
    y = ext.apply_layer(layer.layer_id, 0, _linear_args(x, w, lens))
    assert y.shape == (M, N) and y.dtype == bf16 and "PlannedLayer" in y.grad_fn.name()
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn(M, N, dtype=bf16))
    assert dx.shape == x.shape and dw.shape == w.shape


def test_plan_layer_with_the_weight_cache_and_delayed_scaling(plan_ext, monkeypatch):
    """The cached weight's copies and each amax history's (state, ticket) join the regions' inputs
    as autograd.through_plan puts them; W^T passed through from the cache (kept) makes the backward
    one region, with W^T saved rather than held."""
    ext = plan_ext
    from turbo_moe import Float8Config
    from turbo_moe.autograd import quantize_weight
    from turbo_moe.delayed_scaling import DelayedScalingState

    G, M, K, N = 2, 8, 16, 12
    e4m3, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
    config = Float8Config(strategy="delayed", amax_history_len=4)
    offs = torch.tensor([0, 3, 8])
    forward = _FakeRegion(ext, [0, 1, 2, 3, 4, 5, 7, 8], [((M, N), (N, 1), bf16), ((K, M), (M, 1), e4m3), ((), (), f32)],
                          [("alloc", 0), ("input", 5), ("input", 4), ("alloc", 1), ("alloc", 2)])
    backward = _FakeRegion(ext, [0, 4, 5, 6, 7, 8, 10, 11], [((M, K), (K, 1), bf16), ((G, N, K), (N * K, K, 1), bf16)],
                           [("alloc", 0), ("alloc", 1)])
    monkeypatch.setattr(planned_layer, "_FORWARD_REGION", forward)
    monkeypatch.setattr(planned_layer, "_BACKWARD_REGION", backward)
    x = torch.randn(M, K, dtype=bf16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=bf16, requires_grad=True)
    w_fp8 = quantize_weight(w.detach(), config, transposed=True)
    delayed = DelayedScalingState(config)
    for history in (delayed.input, delayed.grad_output):
        history.state, history.ticket = torch.zeros(6), torch.zeros(1, dtype=torch.int32)
    layer = planned_layer.plan_layer(x, w, offs, False, w_fp8, config, None, "auto", bf16, True, True,
                                     delayed=delayed)
    assert isinstance(layer, planned_layer.PlannedLayer)
    fact = host_plan.fact
    history_facts = (fact(delayed.input.state), fact(delayed.input.ticket))
    assert forward.keys == [(((config, None, "auto", bf16, True, True, False, True), 1), fact(x), fact(w), fact(offs),
                             fact(w_fp8.data), fact(w_fp8.scale), fact(w_fp8.data_t), None, *history_facts)]
    dy = (torch.Size([M, N]), (N, 1), bf16, -1, 0)
    assert backward.keys == [(((config, None, "auto", bf16, True, bf16), 1), dy, None, None, None,
                              fact(w_fp8.data_t), fact(w_fp8.scale), (torch.Size([K, M]), (M, 1), e4m3, -1, 0),
                              (torch.Size([]), (), f32, -1, 0), fact(offs), None,
                              fact(delayed.grad_output.state), fact(delayed.grad_output.ticket))]
    info = planned_layer._BACKWARDS[layer.layer_id].args[0]
    assert info.kept and info.delayed and planned_layer.W_KN in info.saved
    assert set(planned_layer.DY_HISTORY) <= set(info.saved)
    y = ext.apply_layer(layer.layer_id, 0, _linear_args(x, w, offs, *planned_layer.cached_weight_inputs(w_fp8),
                                                        *planned_layer._history_tensors(delayed)))
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn(M, N, dtype=bf16))
    assert dx.shape == x.shape and dw.shape == w.shape


def test_plan_layer_with_main_grad_accumulates_there_and_returns_the_placeholder(plan_ext, monkeypatch):
    """WgradTarget (Megatron's main_grad): the wgrad region's key says float32 and its out= is the
    buffer (the plan passes it through), the weight's gradient is the placeholder, and main_grad and
    the placeholder stay with the node (kept), not saved."""
    ext = plan_ext
    from turbo_moe import Float8Config

    G, M, K, N = 2, 8, 16, 12
    e4m3, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
    config = Float8Config()
    offs = torch.tensor([0, 3, 8])
    forward = _FakeRegion(ext, [0, 1, 2], [((M, N), (N, 1), bf16), ((G, K, N), (K * N, N, 1), e4m3), ((), (), f32),
                                           ((K, M), (M, 1), e4m3)],
                          [("alloc", 0), ("alloc", 1), ("alloc", 2), ("alloc", 3), ("alloc", 2)])
    dgrad = _FakeRegion(ext, [0, 4, 5, 6], [((M, K), (K, 1), bf16), ((N, M), (M, 1), e4m3), ((), (), f32)],
                        [("alloc", 0), ("alloc", 1), ("alloc", 2)])
    wgrad = _FakeRegion(ext, [1, 2, 3, 4, 5, 6], [], [("input", 6)])
    for name, fake in (("_FORWARD_REGION", forward), ("_DGRAD_REGION", dgrad), ("_WGRAD_REGION", wgrad)):
        monkeypatch.setattr(planned_layer, name, fake)
    x = torch.randn(M, K, dtype=bf16, requires_grad=True)
    w = torch.randn(G, N, K, dtype=bf16, requires_grad=True)
    main_grad = torch.zeros(G, N, K)
    placeholder = torch.full((G, N, K), 7.0, dtype=bf16)
    layer = planned_layer.plan_layer(x, w, offs, False, None, config, None, "auto", bf16, True, True,
                                     main_grad=main_grad, placeholder=placeholder)
    assert isinstance(layer, planned_layer.PlannedLayer)
    assert wgrad.keys[0][0] == ((config, None, "auto", f32), 0) and wgrad.keys[0][-1] == host_plan.fact(main_grad)
    info = planned_layer._BACKWARDS[layer.layer_id].args[0]
    assert info.main_grad and planned_layer.MAIN_GRAD not in info.saved
    y = ext.apply_layer(layer.layer_id, 0, _linear_args(x, w, offs, *[None] * 8, main_grad, placeholder))
    y.backward(torch.randn(M, N, dtype=bf16))
    assert torch.equal(w.grad, placeholder) and x.grad.shape == x.shape
    # Without the placeholder protocol the weight gets no gradient.
    w.grad = None
    layer = planned_layer.plan_layer(x, w, offs, False, None, config, None, "auto", bf16, True, True,
                                     main_grad=main_grad)
    ext.apply_layer(layer.layer_id, 0, _linear_args(x, w, offs, *[None] * 8, main_grad)).backward(
        torch.randn(M, N, dtype=bf16))
    assert w.grad is None


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("held", [True, False], ids=["first-backward", "W^T-released"])
def test_python_backward_fallback_equals_the_python_function(held, main_grad):
    """The node's fallback (planned_layer._python_backward) rebuilds the Function's ctx from the
    saved values: its gradients equal GroupedGemmFP8Function's bit for bit (torch backend, CPU),
    with W^T held or, after a first backward released it, re-derived from the saved weight; with
    main_grad the wgrad accumulates into it exactly as the Function's WgradTarget does, and the
    weight's gradient is the placeholder."""
    from turbo_moe import Float8Config
    from turbo_moe.autograd import WgradTarget, _fp8_forward_tensors, _grouped_gemm_fp8_resolved

    torch.manual_seed(0)
    G, M, K, N = 3, 20, 32, 24
    config = Float8Config(format="hybrid")
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, dtype=torch.bfloat16)
    offs = torch.tensor([0, 7, 7, M])
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    start = torch.randn(G, N, K)
    placeholder = torch.zeros(G, N, K, dtype=torch.bfloat16)
    _, w_kn, w_kn_scale, x_km, x_km_scale = _fp8_forward_tensors(x, w, None, offs, config, None, "torch",
                                                                 torch.bfloat16, True, True, None)
    pl = planned_layer
    saved = (pl.W, pl.W_KN_SCALE, pl.X_KM, pl.X_KM_SCALE, pl.SRC)
    info = pl._Backward(saved, pl.SRC, False, True, True, config, None, "torch", torch.bfloat16, torch.bfloat16,
                        False, main_grad)
    pl.register_backward(-1, functools.partial(pl._linear_backward, info))
    try:
        table = [None] * pl.NUM_VALUES
        for v, t in zip(saved, (w, w_kn_scale, x_km, x_km_scale, offs)):
            table[v] = t
        table[pl.W_KN] = w_kn if held else None
        if main_grad:
            table[pl.MAIN_GRAD], table[pl.PLACEHOLDER] = start.clone(), placeholder
        grads = pl._python_backward(-1, dy, table, False)
        assert len(grads) == pl.NUM_ARGS and all(g is None for k, g in enumerate(grads) if k not in (pl.X, pl.W))
        dx, dw = grads[pl.X], grads[pl.W]
    finally:
        del pl._BACKWARDS[-1]
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_main = start.clone()
    target = WgradTarget(buffer=lambda: ref_main, placeholder=lambda: placeholder) if main_grad else None
    _grouped_gemm_fp8_resolved(x_ref, w_ref, offs, config=config, backend="torch", wgrad_target=target).backward(dy)
    assert torch.equal(dx.view(torch.int16), x_ref.grad.view(torch.int16))
    if main_grad:
        assert dw is placeholder and torch.equal(table[pl.MAIN_GRAD], ref_main) and not torch.equal(ref_main, start)
    else:
        assert torch.equal(dw.view(torch.int16), w_ref.grad.view(torch.int16))
