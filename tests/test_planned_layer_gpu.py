"""GPU: a GroupedLinearFP8 call as a planned layer (one C++ call, a C++ backward node;
turbo_moe/planned_layer.py) gives the Python Function's results bit for bit.

Each case runs the same calls twice on identical fresh modules, host plans on both times: once
with planned layers off (the Python autograd Function replaying each region) and once on (from
the third call of a signature: all its plans exist). Outputs and gradients must be equal
bitwise, and the planned path must have run (else the equality proves nothing).
"""

import pytest
import torch

from turbo_moe import Float8Config, GroupedLinearFP8, host_plan, planned_layer
from turbo_moe.backends import clear_recent_dispatches, recent_dispatches
from turbo_moe.bench.end_to_end import HandOverGrad

from _cuda_graph import capture_fwd_bwd, replay_against_eager

from _planned import assert_bitwise, compare_planned, planned_layers, ragged_lens

pytestmark = pytest.mark.gpu

CONFIGS = {
    "tensorwise": Float8Config(),
    "hybrid": Float8Config(format="hybrid"),
    "rowwise": Float8Config(granularity="rowwise"),
    "delayed": Float8Config(strategy="delayed", amax_history_len=4),
}


def _run(planned, config, cache=True, bias=False, offsets=False, x_grad=True, w_grad=True, no_grad=False,
         calls=5, G=6, M=517, K=384, N=272, dy_of=None, retain=False, hand_over=False):
    """Per call: (y, dx, dW, db) and whether the call ran as a planned layer."""
    with planned_layers(planned):
        torch.manual_seed(0)
        layer = GroupedLinearFP8(G, K, N, bias=bias, config=config, device="cuda", dtype=torch.bfloat16,
                                 cache_fp8_weight=cache)
        layer.weight.requires_grad_(w_grad)
        out = []
        for i in range(calls):
            lens = ragged_lens(G, M, 1000 + i)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
            x.requires_grad_(x_grad)
            before = planned_layer.calls
            kwargs = {"group_offs": torch.cat([lens.new_zeros(1), lens.cumsum(0)])} if offsets else {"group_lens": lens}
            with torch.set_grad_enabled(not no_grad):
                y = layer(x, **kwargs)
            used = planned_layer.calls > before
            grads = (None, None, None)
            if y.requires_grad:
                dy = torch.randn(y.shape, device="cuda", dtype=torch.bfloat16,
                                 generator=torch.Generator("cuda").manual_seed(100 + i))
                if dy_of is not None:
                    dy = dy_of(i, dy)
                for p in layer.parameters():
                    p.grad = None
                out_y = HandOverGrad.apply(y) if hand_over else y
                out_y.backward(dy, retain_graph=retain)
                if retain:  # a second backward accumulates the same gradients again
                    out_y.backward(dy)
                grads = (x.grad if x_grad else None, layer.weight.grad if w_grad else None,
                         layer.bias.grad if bias else None)
            out.append(((y.detach(), *grads), used))
        torch.cuda.synchronize()
        return out


def _compare(**kwargs):
    return compare_planned(_run, ("y", "dx", "dW", "db"), **kwargs)


@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_layer_equals_the_python_function_bitwise(name, cache):
    used = _compare(config=CONFIGS[name], cache=cache, calls=6)
    # Calls 1-2 run the Python Function (call 2 records the plans), the rest are planned. Delayed
    # scaling seeds its histories in call 1 (they join the regions' inputs from call 2 on): one
    # call later.
    first = 3 if name == "delayed" else 2
    assert used == [False] * first + [True] * (6 - first), used


@pytest.mark.parametrize("case", ["bias", "offsets", "x-no-grad", "w-frozen", "no-grad", "retain-graph",
                                  "strided-dy", "misaligned-dy", "handed-over-dy", "handed-over-dy-nocache",
                                  "handed-over-dy-retain-graph"])
def test_planned_layer_cases_equal_the_python_function(case):
    kwargs = dict(config=CONFIGS["tensorwise"], cache=case not in ("retain-graph", "handed-over-dy-nocache"))
    kwargs.update({
        # dy owned by the engine alone (freed by the node once quantized): with the weight cache
        # (one backward region), without (dgrad, then wgrad), and with the graph retained.
        "handed-over-dy": dict(hand_over=True), "handed-over-dy-nocache": dict(hand_over=True),
        "handed-over-dy-retain-graph": dict(hand_over=True, retain=True),
        "bias": dict(bias=True), "offsets": dict(offsets=True), "x-no-grad": dict(x_grad=False),
        "w-frozen": dict(w_grad=False), "no-grad": dict(no_grad=True), "retain-graph": dict(retain=True),
        # From the fourth call, dy laid out column-major (the node makes it contiguous), or 2 bytes off
        # 16-byte alignment (the node hands it to the Python backward; the plans were recorded on
        # aligned ones).
        "strided-dy": dict(dy_of=lambda i, dy: dy.t().contiguous().t() if i >= 3 else dy),
        "misaligned-dy": dict(dy_of=lambda i, dy: torch.cat([dy.new_zeros(1), dy.reshape(-1)])[1:].view(dy.shape)
                              if i >= 3 else dy),
    }[case])
    used = _compare(**kwargs)
    assert used[2:] == [True] * 3, used


FINE_CONFIGS = {"blockwise": Float8Config(granularity="blockwise"), "mxfp8": Float8Config(granularity="mxfp8")}


@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("name", list(FINE_CONFIGS))
def test_fine_grained_planned_layer_equals_the_python_function_bitwise(name, cache):
    """The fine-grained planned layer (turbo_moe/fine_grained/planned_layer.py): K and N not
    multiples of 128, ragged groups with an empty one."""
    used = _compare(config=FINE_CONFIGS[name], cache=cache, calls=6)
    assert used == [False] * 2 + [True] * 4, used


@pytest.mark.parametrize("case", ["bias", "offsets", "x-no-grad", "w-frozen", "no-grad", "retain-graph",
                                  "misaligned-dy", "handed-over-dy"])
def test_fine_grained_planned_layer_cases_equal_the_python_function(case):
    kwargs = dict(config=FINE_CONFIGS["blockwise"], cache=case != "retain-graph")
    kwargs.update({
        "handed-over-dy": dict(hand_over=True), "bias": dict(bias=True), "offsets": dict(offsets=True),
        "x-no-grad": dict(x_grad=False), "w-frozen": dict(w_grad=False), "no-grad": dict(no_grad=True),
        "retain-graph": dict(retain=True),
        "misaligned-dy": dict(dy_of=lambda i, dy: torch.cat([dy.new_zeros(1), dy.reshape(-1)])[1:].view(dy.shape)
                              if i >= 3 else dy),
    }[case])
    used = _compare(**kwargs)
    assert used[2:] == [True] * 3, used


def _warmed_layer():
    """A layer, its routing and input after three fwd+bwd: the next call is planned if enabled
    (plans cleared first: earlier tests of this process may have used up their static key's
    recordings, host_plan.MAX_PLANS_PER_STATIC_KEY)."""
    host_plan.clear_all()
    layer = GroupedLinearFP8(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([100, 0, 56, 100], device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        layer(x, lens).sum().backward()
    return layer, lens, x


def test_planned_layer_logs_the_dispatches_the_python_function_logs():
    def records(planned):
        previous = planned_layer.set_enabled(planned)
        try:
            layer, lens, x = _warmed_layer()
            clear_recent_dispatches()
            before = planned_layer.calls
            layer(x, lens).sum().backward()
            assert (planned_layer.calls > before) == planned
            return [str(r) for r in recent_dispatches()]
        finally:
            planned_layer.set_enabled(previous)

    python, planned = records(False), records(True)
    assert len(python) == 3 and planned == python  # fwd, dgrad, wgrad, in that order


@pytest.mark.parametrize("planned", [False, True], ids=["python", "planned"])
def test_planned_layer_backward_stays_once_differentiable(planned):
    """Under create_graph the gradients are once-differentiable, as the Python Function's: a
    second differentiation raises."""
    previous = planned_layer.set_enabled(planned)
    try:
        layer, lens, x = _warmed_layer()
        before = planned_layer.calls
        y = layer(x, lens)
        assert (planned_layer.calls > before) == planned
        dy = torch.randn_like(y, requires_grad=True)
        (dx,) = torch.autograd.grad(y, x, dy, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            dx.sum().backward()
    finally:
        planned_layer.set_enabled(previous)


@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_planned_layer_captures_in_a_cuda_graph_and_follows_new_routing(name):
    """Planned eagerly, then captured (no weight cache: capture re-quantizes): replaying the graph
    with new routing gives the eager Python Function's results (blockwise: the token layout that
    follows the routing inside the graph)."""
    G, M, K, N = 4, 256, 256, 128
    host_plan.clear_all()  # as _warmed_layer
    torch.manual_seed(1)
    config = {**CONFIGS, **FINE_CONFIGS}[name]
    layer = GroupedLinearFP8(G, K, N, config=config, device="cuda", dtype=torch.bfloat16, cache_fp8_weight=False)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lens = torch.tensor([100, 0, 56, 100], device="cuda")
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        layer(x, lens).backward(dy)
    before = planned_layer.calls
    graph, y = capture_fwd_bwd(layer, x, lens, dy)
    assert planned_layer.calls > before
    replayed, eager = replay_against_eager(layer, x, lens, dy, graph, y, torch.tensor([0, 200, 0, 56]),
                                           planned_layer.set_enabled)
    for what, a, b in zip(("y", "dx", "dW"), replayed, eager):
        assert_bitwise(a, b, what)


def test_planned_backward_frees_a_handed_over_gradient_once_quantized():
    """The node takes the engine's reference to dy and its plans drop it after its cast, so dgrad's
    output can take its memory; a Python Function holds dy to the end of its backward. With N = K
    (no weight cache) the Python backward's peak is at dgrad's output, dy beside it (x's clone and
    FP8 copies make the forward's peak lower), and the planned one is lower by dy's bytes:
    docs/design.md, "Peak memory"."""
    G, M, K, N = 4, 8192, 1024, 1024
    dy_bytes = M * N * 2
    peaks = {}
    for planned in (False, True):
        with planned_layers(planned):
            torch.manual_seed(0)
            layer = GroupedLinearFP8(G, K, N, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            lens = ragged_lens(G, M, 7)
            before = planned_layer.calls
            for _ in range(4):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                y = HandOverGrad.apply(layer(x.clone(), group_lens=lens))  # x and dy activations, as in a model
                dx, dw = torch.autograd.grad(y, (x, layer.weight), dy)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                del y, dx, dw
            used = planned_layer.calls > before
            peaks[planned] = peak
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    assert used, "the last calls did not run as planned layers"
    saved = peaks[False] - peaks[True]
    assert saved >= 0.9 * dy_bytes, (peaks, dy_bytes)
