"""GPU: an expert MLP (GroupedSwiGLUMLPFP8: fc1, the fused SwiGLU + fc2, the dh handoff) as one
planned layer (turbo_moe/planned_mlp.py) gives the Python Functions' results bit for bit.

As tests/test_planned_layer_gpu.py: the same calls run twice on identical fresh modules, host
plans on both times, planned layers off then on. Outputs and every gradient (x, both weights, the
routing weights) must be equal bitwise, and the planned path must have run.
"""

import pytest
import torch

from turbo_moe import Float8Config, GroupedSwiGLUMLPFP8, host_plan, planned_layer, planned_mlp
from turbo_moe.bench.end_to_end import HandOverGrad

from _planned import assert_bitwise, compare_planned, planned_layers, ragged_lens

pytestmark = pytest.mark.gpu

CONFIGS = {
    "tensorwise": Float8Config(),
    "hybrid": Float8Config(format="hybrid"),
    "delayed": Float8Config(strategy="delayed", amax_history_len=4),
    "rowwise": Float8Config(format="hybrid", granularity="rowwise"),
}


def _run(planned, config, cache=True, offsets=False, probs_grad=True, unweighted=False, x_grad=True,
         no_grad=False, retain=False, misaligned_dy=False, hand_over=False, calls=6, G=5, M=389, hidden=256,
         ffn=192):
    """Per call: (y, dx, dW1, dW2, dprobs) and whether the call ran as a planned MLP."""
    with planned_layers(planned):
        torch.manual_seed(0)
        mlp = GroupedSwiGLUMLPFP8(G, hidden, ffn, config=config, device="cuda", dtype=torch.bfloat16,
                                  cache_fp8_weight=cache)
        out = []
        for i in range(calls):
            lens = ragged_lens(G, M, 2000 + i)
            gen = torch.Generator("cuda").manual_seed(i)
            x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(x_grad)
            probs = None if unweighted else torch.rand(M, 1, device="cuda", generator=gen).requires_grad_(probs_grad)
            kwargs = {"group_offs": torch.cat([lens.new_zeros(1), lens.cumsum(0)])} if offsets else {"group_lens": lens}
            before = planned_mlp.calls
            with torch.set_grad_enabled(not no_grad):
                y = mlp(x, probs=probs, **kwargs)
            used = planned_mlp.calls > before
            grads = (None,) * 4
            if y.requires_grad:
                dy = torch.randn(y.shape, device="cuda", dtype=torch.bfloat16,
                                 generator=torch.Generator("cuda").manual_seed(100 + i))
                if misaligned_dy and i >= 3:
                    dy = torch.cat([dy.new_zeros(1), dy.reshape(-1)])[1:].view(dy.shape)
                for p in mlp.parameters():
                    p.grad = None
                out_y = HandOverGrad.apply(y) if hand_over else y
                out_y.backward(dy, retain_graph=retain)
                if retain:
                    out_y.backward(dy)
                grads = (x.grad if x_grad else None, mlp.fc1.weight.grad, mlp.fc2.weight.grad,
                         None if probs is None or not probs_grad else probs.grad)
            out.append(((y.detach(), *grads), used))
        torch.cuda.synchronize()
        return out


def _compare(**kwargs):
    return compare_planned(_run, ("y", "dx", "dW1", "dW2", "dprobs"), **kwargs)


@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_planned_mlp_equals_the_python_functions_bitwise(name, cache):
    used = _compare(config=CONFIGS[name], cache=cache)
    # Calls 1-2 run the Python Functions (call 2 records the plans); delayed scaling seeds its
    # histories in call 1, one call later.
    first = 3 if name == "delayed" else 2
    assert used == [False] * first + [True] * (6 - first), used


@pytest.mark.parametrize("case", ["offsets", "unweighted", "probs-no-grad", "x-no-grad", "no-grad", "retain-graph",
                                  "misaligned-dy", "handed-over-dy", "handed-over-dy-nocache"])
def test_planned_mlp_cases_equal_the_python_functions(case):
    kwargs = {"handed-over-dy": dict(hand_over=True), "handed-over-dy-nocache": dict(hand_over=True, cache=False),
              "offsets": dict(offsets=True), "unweighted": dict(unweighted=True),
              "probs-no-grad": dict(probs_grad=False), "x-no-grad": dict(x_grad=False), "no-grad": dict(no_grad=True),
              "retain-graph": dict(retain=True, cache=False), "misaligned-dy": dict(misaligned_dy=True)}[case]
    used = _compare(config=CONFIGS["tensorwise"], **kwargs)
    assert used[-1], used


FINE_CONFIGS = {"blockwise": Float8Config(granularity="blockwise"), "mxfp8": Float8Config(granularity="mxfp8")}


@pytest.mark.parametrize("ffn", [256, 192], ids=["ffn256", "ffn192"])
@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("name", list(FINE_CONFIGS))
def test_fine_grained_planned_mlp_equals_the_python_functions_bitwise(name, cache, ffn):
    """The fine-grained planned MLP (turbo_moe/fine_grained/planned_mlp.py): blockwise hands dh's
    rows copy to fc1 at FFN 256 and casts it in fc1 at 192 (not a multiple of 128); MXFP8 (1x32
    blocks) hands it over at both."""
    used = _compare(config=FINE_CONFIGS[name], cache=cache, ffn=ffn)
    assert used == [False] * 2 + [True] * 4, used


@pytest.mark.parametrize("case", ["offsets", "unweighted", "x-no-grad", "no-grad", "retain-graph", "misaligned-dy",
                                  "handed-over-dy"])
def test_fine_grained_planned_mlp_cases_equal_the_python_functions(case):
    kwargs = {"handed-over-dy": dict(hand_over=True), "offsets": dict(offsets=True), "unweighted": dict(unweighted=True),
              "x-no-grad": dict(x_grad=False), "no-grad": dict(no_grad=True),
              "retain-graph": dict(retain=True, cache=False), "misaligned-dy": dict(misaligned_dy=True)}[case]
    used = _compare(config=FINE_CONFIGS["blockwise"], ffn=256, **kwargs)
    assert used[-1], used


def test_planned_mlp_captures_in_a_cuda_graph_and_follows_new_routing():
    """Planned eagerly, then captured with dy handed over (the node frees it inside the graph; no
    weight cache: capture re-quantizes): replaying the graph with new routing gives the eager
    Python Functions' output and gradients bit for bit."""
    G, M, hidden, ffn = 4, 256, 256, 192
    host_plan.clear_all()  # earlier tests of this process may have used up the recordings of its static keys
    torch.manual_seed(2)
    mlp = GroupedSwiGLUMLPFP8(G, hidden, ffn, device="cuda", dtype=torch.bfloat16, cache_fp8_weight=False)
    x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(M, 1, device="cuda", requires_grad=True)
    lens = torch.tensor([100, 0, 56, 100], device="cuda")
    dy = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16)
    leaves = (x, probs, mlp.fc1.weight, mlp.fc2.weight)

    def fwd_bwd():
        for t in leaves:
            t.grad = None  # written fresh (inside the graph: by the graph)
        y = mlp(x, group_lens=lens, probs=probs)
        HandOverGrad.apply(y).backward(dy)
        return y

    for _ in range(3):  # Python, recorded, planned
        fwd_bwd()
    before = planned_mlp.calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for t in leaves:
            t.grad = None
        with torch.cuda.graph(graph):
            y = mlp(x, group_lens=lens, probs=probs)
            HandOverGrad.apply(y).backward(dy)
    torch.cuda.current_stream().wait_stream(stream)
    assert planned_mlp.calls > before, "the capture did not run the planned node"
    lens.copy_(torch.tensor([0, 200, 0, 56]))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (y.detach().clone(), *(t.grad.clone() for t in leaves))
    previous = planned_layer.set_enabled(False)
    try:
        y_eager = fwd_bwd()
        torch.cuda.synchronize()
    finally:
        planned_layer.set_enabled(previous)
    eager = (y_eager.detach(), *(t.grad for t in leaves))
    for what, a, b in zip(("y", "dx", "dprobs", "dW1", "dW2"), replayed, eager):
        assert_bitwise(a, b, what)
