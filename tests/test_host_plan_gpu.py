"""GPU: host launch plans (turbo_moe/host_plan.py) give the Python path's results bit for bit.

Each case runs the same sequence of calls twice, on identical fresh modules: once with host plans
off (every call through Python) and once on (the first calls record, later ones replay from C++);
every output and gradient of every call must be equal bitwise, and the replays must have happened
(a plan silently never used would pass the equality and prove nothing).
"""

import pytest
import torch

from turbo_moe import Float8Config, GroupedLinearFP8, GroupedSwiGLUMLPFP8, host_plan
from turbo_moe import autograd as fp8_autograd
from turbo_moe import swiglu as fp8_swiglu
from turbo_moe.fine_grained import autograd as fine_autograd
from turbo_moe.fine_grained import swiglu as fine_swiglu

from _cuda_graph import capture_fwd_bwd, replay_against_eager

pytestmark = pytest.mark.gpu

# Forward; dgrad and wgrad apart (W^T's FP8 copy freed between them); the whole backward in one
# region (W^T kept by the weight cache).
LINEAR_REGIONS = (fp8_autograd._FORWARD_REGION, fp8_autograd._DGRAD_REGION, fp8_autograd._WGRAD_REGION,
                  fp8_autograd._BACKWARD_REGION)
FINE_REGIONS = (fine_autograd._FORWARD_REGION, fine_autograd._TOKENS_REGION, fine_autograd._DGRAD_REGION,
                fine_autograd._WGRAD_REGION, fine_swiglu._FORWARD_REGION, fine_swiglu._BACKWARD_ROWS_REGION,
                fine_swiglu._BACKWARD_REGION)
REGIONS = LINEAR_REGIONS + (fp8_swiglu._FORWARD_REGION, fp8_swiglu._BACKWARD_REGION) + FINE_REGIONS


def _plans_on(flag: bool):
    for region in REGIONS:
        region.clear()
    return host_plan.set_enabled(flag)


def _replays():
    return tuple(region.replays for region in REGIONS)


def _assert_bitwise(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def _routings(num_groups, tokens, calls, seed):
    """Per call: group sizes summing to ``tokens`` (same M every call: one signature), ragged, with
    empty experts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        cuts = torch.sort(torch.randint(0, tokens + 1, (num_groups - 1,), generator=g)).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
        lens = bounds[1:] - bounds[:-1]
        lens[0] = 0  # an empty expert every call
        lens[-1] += tokens - lens.sum()
        out.append(lens.cuda())
    return out


def _run_linear(config, cache, calls, plans, seed=0, dtype=torch.bfloat16, G=6, M=517, K=384, N=272):
    previous = _plans_on(plans)
    try:
        torch.manual_seed(seed)
        layer = GroupedLinearFP8(G, K, N, config=config, device="cuda", dtype=dtype, cache_fp8_weight=cache)
        results = []
        for i, lens in enumerate(_routings(G, M, calls, seed)):
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(i))
            x.requires_grad_(True)
            y = layer(x, lens)
            dy = torch.randn(y.shape, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(100 + i))
            layer.weight.grad = None
            y.backward(dy)
            results.append((y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()))
        torch.cuda.synchronize()
        return results, _replays()
    finally:
        host_plan.set_enabled(previous)


CONFIGS = {
    "tensorwise": Float8Config(),
    "hybrid": Float8Config(format="hybrid"),
    "delayed": Float8Config(strategy="delayed", amax_history_len=4),
    "rowwise": Float8Config(granularity="rowwise"),
}


def _linear_plans_equal_python(config, cache, calls, label):
    """Run ``calls`` fwd+bwd with plans off, then on (skipping where plans cannot be built here);
    every y, dx and dW bit for bit. Returns the replays of every region."""
    python_results, _ = _run_linear(config, cache, calls, plans=False)
    plan_results, replays = _run_linear(config, cache, calls, plans=True)
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    for i, (a, b) in enumerate(zip(python_results, plan_results)):
        for what, ta, tb in zip(("y", "dx", "dW"), a, b):
            _assert_bitwise(ta, tb, f"{label} call {i}: {what}")
    return replays


@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_linear_replay_equals_python_path_bitwise(name, cache):
    calls = 6
    replays = _linear_plans_equal_python(CONFIGS[name], cache, calls, name)
    refusals = [r for region in REGIONS for r in region.refusals]
    # Per-tensor recipes replay every region they use, each recorded call after the first: the
    # forward, then dgrad and wgrad apart without the cache, the fused backward with it.
    forward, dgrad, wgrad, backward = replays[:4]
    used, unused = ((forward, backward), (dgrad, wgrad)) if cache else ((forward, dgrad, wgrad), (backward,))
    if name != "rowwise":
        assert all(n >= calls - 3 for n in used), (replays, refusals)
    else:
        assert sum(used) > 0, (replays, refusals)
    assert not any(unused), replays


@pytest.mark.parametrize("cache", [True, False], ids=["wcache", "nocache"])
@pytest.mark.parametrize("granularity", ["blockwise", "mxfp8"])
def test_fine_grained_linear_replay_equals_python_path_bitwise(granularity, cache):
    """The fine-grained Function's regions (forward, the wgrad operand's token copy, dgrad, wgrad)
    replay every call after the recording one, bit for bit the Python path's."""
    calls = 6
    _linear_plans_equal_python(Float8Config(granularity=granularity), cache, calls, granularity)
    replays = [region.replays for region in FINE_REGIONS[:4]]
    refusals = [r for region in FINE_REGIONS for r in region.refusals]
    assert all(n >= calls - 3 for n in replays), (replays, refusals)


@pytest.mark.parametrize("ffn", [256, 192])
def test_fine_grained_mlp_replays_bitwise(ffn):
    """The fine-grained fused SwiGLU MLP (turbo_moe.fine_grained.swiglu): every region it uses
    replays, outputs and gradients bit for bit the Python path's. With F a multiple of 128 the
    activation's backward hands dh's rows copy to fc1; with F = 192 it cannot (a block would
    straddle the gate and linear halves) and the backward without the copy runs instead."""
    results = {}
    for plans in (False, True):
        previous = _plans_on(plans)
        try:
            torch.manual_seed(0)
            mlp = GroupedSwiGLUMLPFP8(4, 256, ffn, config=Float8Config(granularity="blockwise"), device="cuda",
                                      dtype=torch.bfloat16)
            out = []
            for i, lens in enumerate(_routings(4, 300, 6, 1)):
                gen = torch.Generator("cuda").manual_seed(i)
                x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                probs = torch.rand(300, device="cuda", generator=gen).requires_grad_()
                y = mlp(x, lens, probs=probs)
                mlp.zero_grad(set_to_none=True)
                y.backward(torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=gen))
                out.append((y.detach().clone(), x.grad.clone(), probs.grad.clone(), mlp.fc1.weight.grad.clone(),
                            mlp.fc2.weight.grad.clone()))
            torch.cuda.synchronize()
            results[plans] = (out, [region.replays for region in FINE_REGIONS],
                              [r for region in FINE_REGIONS for r in region.refusals])
        finally:
            host_plan.set_enabled(previous)
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    for i, (a, b) in enumerate(zip(results[False][0], results[True][0])):
        for what, ta, tb in zip(("y", "dx", "dprobs", "dW1", "dW2"), a, b):
            _assert_bitwise(ta, tb, f"call {i}: {what}")
    replays, refusals = results[True][1], results[True][2]
    # every region but one of the activation's two backwards (FINE_REGIONS' last two)
    handed = ffn % 128 == 0
    assert all(n > 0 for n in replays[:-2]), (replays, refusals)
    assert (replays[-2] > 0, replays[-1] > 0) == (handed, not handed), (replays, refusals)


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_mlp_with_fp8_grad_handoff_replays_bitwise(name):
    """The SwiGLU MLP (fc1's dh handed over in FP8, fp32 routing weights) through plans: every
    region, the activation's included, replays."""
    def run(plans):
        previous = _plans_on(plans)
        try:
            torch.manual_seed(3)
            mlp = GroupedSwiGLUMLPFP8(4, 256, 320, config=CONFIGS[name], device="cuda", dtype=torch.bfloat16)
            out = []
            for i, lens in enumerate(_routings(4, 300, 5, 3)):
                x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                probs = torch.rand(300, device="cuda", dtype=torch.float32, requires_grad=True)
                y = mlp(x, lens, probs=probs)
                for p in mlp.parameters():
                    p.grad = None
                y.backward(torch.randn_like(y))
                out.append((y.detach().clone(), x.grad.clone(), probs.grad.clone(),
                            *[p.grad.clone() for p in mlp.parameters()]))
            torch.cuda.synchronize()
            return out, _replays()
        finally:
            host_plan.set_enabled(previous)

    torch.manual_seed(0)
    reference, _ = run(False)
    torch.manual_seed(0)
    replayed, replays = run(True)
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    # The MLP caches its FP8 weights: both GEMMs' backwards are fused regions (dgrad and wgrad unused).
    forward, dgrad, wgrad, backward, swiglu_forward, swiglu_backward = replays[:6]
    assert all(n > 0 for n in (forward, backward, swiglu_forward, swiglu_backward)) and dgrad == wgrad == 0, (
        replays, [r for region in REGIONS for r in region.refusals])
    assert not any(replays[6:]), replays  # the fine-grained regions are not this recipe's
    for i, (a, b) in enumerate(zip(reference, replayed)):
        for j, (ta, tb) in enumerate(zip(a, b)):
            _assert_bitwise(ta, tb, f"call {i} tensor {j}")


@pytest.mark.parametrize("cache", [False, True], ids=["nocache", "wcache"])
def test_replayed_step_captures_in_a_cuda_graph_and_follows_new_routing(cache):
    """Plans recorded eagerly, then a capture (the replay path runs inside it): replaying the
    graph with new routing gives the eager Python path's results. (The weight cache is not used
    while capturing: the graph re-quantizes, so both cases capture the split backward.)"""
    config = Float8Config()
    G, M, K, N = 4, 256, 256, 128
    previous = _plans_on(True)
    try:
        torch.manual_seed(1)
        layer = GroupedLinearFP8(G, K, N, config=config, device="cuda", dtype=torch.bfloat16, cache_fp8_weight=cache)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lens = torch.tensor([100, 0, 56, 100], device="cuda")
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):  # record, then replay
            layer.weight.grad = None
            x.grad = None
            layer(x, lens).backward(dy)
        assert fp8_autograd._FORWARD_REGION.replays > 0
        graph, y = capture_fwd_bwd(layer, x, lens, dy)
        replayed, eager = replay_against_eager(layer, x, lens, dy, graph, y, torch.tensor([0, 200, 0, 56]),
                                               host_plan.set_enabled)
    finally:
        host_plan.set_enabled(previous)
    for what, a, b in zip(("y", "dx", "dW"), replayed, eager):
        _assert_bitwise(a, b, what)


def test_a_new_token_count_takes_the_python_path_then_its_own_plan():
    config = Float8Config()
    previous = _plans_on(True)
    try:
        layer = GroupedLinearFP8(3, 128, 64, config=config, device="cuda", dtype=torch.bfloat16)
        for M in (96, 96, 96, 160, 160, 160):
            x = torch.randn(M, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            lens = torch.tensor([M // 2, 0, M - M // 2], device="cuda")
            layer(x, lens).sum().backward()
        torch.cuda.synchronize()
        # Per token count: call 1 Python, call 2 recorded, call 3 replayed.
        assert fp8_autograd._FORWARD_REGION.replays == 2, fp8_autograd._FORWARD_REGION.refusals
    finally:
        host_plan.set_enabled(previous)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_recording_call_peaks_no_higher_than_a_python_call(name):
    """The recording call (a signature's second) must not hold two copies of a region's outputs:
    its peak memory stays within a small margin of a replayed call's, where the W^T FP8 copy
    (G*N*K bytes, the largest output here) would show twice. Rowwise's recorded forward keeps x's
    rows copy alive until the region ends (M*K bytes), which the margin allows."""
    previous = _plans_on(True)
    try:
        G, M, K, N = 4, 1024, 2048, 4096
        layer = GroupedLinearFP8(G, K, N, config=CONFIGS[name], device="cuda", dtype=torch.bfloat16,
                                 cache_fp8_weight=False)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((G,), M // G, device="cuda", dtype=torch.int64)
        peaks = []
        for _ in range(4):  # Python (tunes, compiles), recorded, replayed, replayed
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            layer(x, lens).backward(dy)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
            x.grad = layer.weight.grad = None
        assert sum(r.replays for r in LINEAR_REGIONS) >= 4  # two calls replayed
        margin = M * K + (1 << 20)
        assert G * N * K > 8 * margin
        assert peaks[1] <= peaks[2] + margin, peaks
        assert abs(peaks[3] - peaks[2]) <= (1 << 20), peaks
    finally:
        host_plan.set_enabled(previous)
