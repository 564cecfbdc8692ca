"""turbo_moe.megatron on a GPU with the Triton backend: a real Megatron MoELayer against Megatron's
own SequentialMLP experts, the experts captured in a CUDA graph and replayed with new routing, and
main_grad / delayed wgrad with bf16 parameters. Skipped without CUDA, megatron-core or triton.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytest.importorskip("triton", reason="triton is not installed")

import turbo_moe  # noqa: E402

from _megatron_harness import (  # noqa: E402
    build_sequential_moe,
    build_turbo_moe,
    copy_sequential_into_turbo,
    expert_mlp_reference,
    make_config,
    megatron_world,
    randomize_,
    rel_err,
)

tm = pytest.importorskip("turbo_moe.megatron")

# Same bounds as the CPU tests (measured 6-9% there); bf16 activations add well under 1%.
FP8_FWD_TOL = 0.12
FP8_BWD_TOL = 0.15
# bf16 GEMMs of different libraries (torch._grouped_mm vs per-expert matmul) on the same data.
BF16_TOL = 2e-2

# Hidden and FFN sizes that are not multiples of 128 (the kernels' tile).
HIDDEN, FFN = 320, 448


@pytest.fixture(scope="module")
def world():
    with megatron_world("cuda"):
        yield


def _gpu_config(**overrides):
    params = dict(hidden_size=HIDDEN, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, num_moe_experts=8,
                  use_cpu_initialization=False, params_dtype=torch.bfloat16, bf16=True)
    params.update(overrides)
    return make_config(**params)


def _chosen_backends():
    return {r.problem.split()[0]: r.chosen for r in turbo_moe.recent_dispatches()}


def _pg():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


@pytest.mark.parametrize("fp8", [None, "e4m3", "hybrid"])
def test_moe_layer_on_gpu_matches_megatron(world, fp8):
    config = _gpu_config()
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, scale=0.05, seed=21)
    turbo_layer = build_turbo_moe(config, fp8=fp8, backend="triton" if fp8 else "auto")
    copy_sequential_into_turbo(seq_layer, turbo_layer)
    assert turbo_layer.experts.linear_fc1.weight.is_cuda

    hidden = torch.randn(256, 2, HIDDEN, generator=torch.Generator().manual_seed(22)).to("cuda", torch.bfloat16)
    h_seq, h_tm = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    turbo_moe.backends.clear_recent_dispatches()
    out_seq, _ = seq_layer(h_seq)
    out_tm, _ = turbo_layer(h_tm)
    grad = torch.randn_like(out_seq)
    out_seq.backward(grad)
    out_tm.backward(grad)
    torch.cuda.synchronize()

    fwd_tol, bwd_tol = (BF16_TOL, BF16_TOL) if fp8 is None else (FP8_FWD_TOL, FP8_BWD_TOL)
    assert rel_err(out_tm, out_seq) < fwd_tol
    assert rel_err(h_tm.grad, h_seq.grad) < bwd_tol
    for name in ("linear_fc1", "linear_fc2"):
        theirs = torch.stack([getattr(e, name).weight.grad for e in seq_layer.experts.local_experts])
        assert rel_err(getattr(turbo_layer.experts, name).weight.grad, theirs) < bwd_tol
    if fp8 is not None:
        assert _chosen_backends() == {"fwd": "triton", "dgrad": "triton", "wgrad": "triton"}, turbo_moe.recent_dispatches()
        assert rel_err(out_tm, out_seq) > 1e-4  # FP8 really ran


def _routing(tokens_per_expert, seed):
    gen = torch.Generator().manual_seed(seed)
    m = sum(tokens_per_expert)
    x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16)
    probs = (torch.rand(m, generator=gen) * 0.9 + 0.1).to(torch.float32)
    return x, torch.tensor(tokens_per_expert, dtype=torch.int64), probs


@pytest.mark.parametrize("fp8,granularity", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("e4m3", "blockwise")])
def test_experts_cuda_graph_replays_new_routing(world, fp8, granularity):
    """Capture forward+backward of the experts once; replay with other token counts per expert.
    Blockwise (FFN 512, a multiple of its 128 blocks): the fused SwiGLU, dh's rows copy handed to
    fc1, and the routing-independent token layout of the wgrad operands, all inside the graph."""
    num_experts, num_tokens = 6, 384
    ffn = dict(moe_ffn_hidden_size=512, ffn_hidden_size=512) if granularity == "blockwise" else {}
    config = _gpu_config(num_moe_experts=num_experts, **ffn)
    experts = tm.TurboMoEGroupedMLP(num_experts, config, pg_collection=_pg(),
                                    options=tm.TurboMoEOptions(fp8=fp8, granularity=granularity, backend="triton"))
    randomize_(experts, scale=0.05, seed=23)
    # The eager reference: the same weights in a second module, with its own .grad buffers.
    eager = tm.TurboMoEGroupedMLP(num_experts, config, pg_collection=_pg(),
                                  options=tm.TurboMoEOptions(fp8=fp8, granularity=granularity, backend="triton"))
    eager.load_state_dict(experts.state_dict())

    routings = [[64, 64, 64, 64, 64, 64], [0, 200, 1, 0, 130, 53], [384, 0, 0, 0, 0, 0]]
    assert all(sum(r) == num_tokens for r in routings)
    x0, tpe0, p0 = _routing(routings[0], 0)
    x_static = x0.cuda().requires_grad_()
    tpe_static, probs_static = tpe0.cuda(), p0.cuda()
    grad_static = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(24)).to("cuda", torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles here, outside the capture)
        for _ in range(2):
            out, _ = experts(x_static, tpe_static, probs_static)
            out.backward(grad_static)
    torch.cuda.current_stream().wait_stream(side)
    experts.zero_grad(set_to_none=True)
    x_static.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static, _ = experts(x_static, tpe_static, probs_static)
        out_static.backward(grad_static)

    previous = None
    for i, routing in enumerate(routings):
        x, tpe, probs = _routing(routing, 100 + i)
        with torch.no_grad():
            x_static.copy_(x.cuda())
            tpe_static.copy_(tpe.cuda())
            probs_static.copy_(probs.cuda())
        graph.replay()
        torch.cuda.synchronize()
        got_out = out_static.detach().clone()
        got_dx = x_static.grad.detach().clone()
        got_dw = {n: getattr(experts, n).weight.grad.detach().clone() for n in ("linear_fc1", "linear_fc2")}

        eager.zero_grad(set_to_none=True)
        x_eager = x.cuda().requires_grad_()
        ref_out, _ = eager(x_eager, tpe.cuda(), probs.cuda())
        ref_out.backward(grad_static)
        torch.cuda.synchronize()
        # The graph replays the eager computation on the new routing (deterministic kernels).
        assert rel_err(got_out, ref_out) < 1e-3, f"routing {i}"
        assert rel_err(got_dx, x_eager.grad) < 1e-3, f"routing {i}"
        for n in got_dw:
            assert rel_err(got_dw[n], getattr(eager, n).weight.grad) < 1e-3, f"routing {i} {n}"
            for e, count in enumerate(routing):
                if count == 0:
                    assert torch.count_nonzero(got_dw[n][e]) == 0, f"routing {i}: empty expert {e} {n}"
        # And it is right: float64 oracle on the CPU.
        w1 = experts.linear_fc1.weight.detach().float().cpu()
        w2 = experts.linear_fc2.weight.detach().float().cpu()
        oracle = expert_mlp_reference(x.float(), routing, probs, w1, w2)
        assert rel_err(got_out.float().cpu(), oracle) < FP8_FWD_TOL, f"routing {i}"
        if previous is not None:
            assert rel_err(got_out, previous) > 0.1  # new inputs really went through the graph
        previous = got_out


@pytest.mark.parametrize("granularity", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("delayed", [False, True])
def test_main_grad_and_delayed_wgrad_on_gpu(world, delayed, granularity):
    """fp32 main_grad filled by the FP8 GEMM's own backward (WgradTarget): at once, or from the
    DeferredWgrad that backward_dw() runs."""
    options = dict(fp8="e4m3", granularity=granularity, backend="triton")
    config = _gpu_config(num_moe_experts=4)
    base = tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg(), options=tm.TurboMoEOptions(**options))
    randomize_(base, scale=0.05, seed=25)
    x, tpe, probs = _routing([100, 0, 37, 91], 26)
    x, tpe, probs = x.cuda(), tpe.cuda(), probs.cuda()
    base(x, tpe, probs)[0].float().square().sum().backward()
    expected = {n: getattr(base, n).weight.grad.float() for n in ("linear_fc1", "linear_fc2")}

    cfg = _gpu_config(num_moe_experts=4)
    cfg.gradient_accumulation_fusion = True
    cfg.delay_wgrad_compute = delayed  # set after __post_init__, which wants EP comm overlap for it
    layer = tm.TurboMoEGroupedMLP(4, cfg, pg_collection=_pg(), options=tm.TurboMoEOptions(**options))
    layer.load_state_dict(base.state_dict())
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    layer(x, tpe, probs)[0].float().square().sum().backward()
    if delayed:
        assert all(torch.count_nonzero(p.main_grad) == 0 for p in layer.parameters())  # wgrad deferred
        layer.backward_dw()
    torch.cuda.synchronize()
    for n, ref in expected.items():
        w = getattr(layer, n).weight
        # fp32 main_grad from the FP8 wgrad kernel vs bf16 .grad from the same kernel.
        assert rel_err(w.main_grad, ref) < 1e-2
        assert torch.count_nonzero(w.main_grad[1]) == 0


def _experts_calls(planned, fp8, granularity, main_grad, calls=5):
    """Per call of a TurboMoEGroupedMLP: (output, dx, dprobs, fc1's and fc2's weight gradient or
    main_grad) and whether it ran planned (one MLP node, turbo_moe.planned_mlp, or each linear as a
    planned layer where the activation is not fused: rowwise)."""
    from turbo_moe import host_plan, planned_layer, planned_mlp

    previous = planned_layer.set_enabled(planned), host_plan.set_enabled(True)
    host_plan.clear_all()
    try:
        cfg = _gpu_config(num_moe_experts=4)
        cfg.gradient_accumulation_fusion = main_grad
        layer = tm.TurboMoEGroupedMLP(4, cfg, pg_collection=_pg(),
                                      options=tm.TurboMoEOptions(fp8=fp8, granularity=granularity, backend="triton"))
        randomize_(layer, scale=0.05, seed=27)
        weights = [layer.linear_fc1.weight, layer.linear_fc2.weight]
        if main_grad:
            for w in weights:
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                w.grad_added_to_main_grad = False
        out = []
        for i in range(calls):
            x, tpe, probs = _routing([70 + 13 * i, 0, 37, 91 - 13 * i], 40 + i)  # 198 tokens: one signature
            x, tpe, probs = x.cuda().requires_grad_(), tpe.cuda(), probs.cuda().requires_grad_()
            before = planned_mlp.calls, planned_layer.calls
            y = layer(x, tpe, probs)[0]
            used = (planned_mlp.calls - before[0], planned_layer.calls - before[1])
            for w in weights:
                w.grad = None
            dy = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(90 + i))
            y.backward(dy.to(y.dtype))
            grads = [(w.main_grad.clone() if main_grad else w.grad.clone()) for w in weights]
            flags = [getattr(w, "grad_added_to_main_grad", None) for w in weights]
            out.append(((y.detach(), x.grad, probs.grad, *grads), used, flags))
        torch.cuda.synchronize()
        return out
    finally:
        planned_layer.set_enabled(previous[0])
        host_plan.set_enabled(previous[1])


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("fp8,granularity", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"), ("hybrid", "rowwise"),
                                           ("e4m3", "blockwise")])
def test_planned_experts_equal_the_python_path_bitwise(world, fp8, granularity, main_grad):
    """The experts as one planned MLP node (fc1, the fused SwiGLU + fc2, the dh handoff, wgrads into
    main_grad; tensorwise, rowwise and blockwise alike) give the Python Functions' output, dx, dprobs and
    weight gradients (accumulated into main_grad across calls) bit for bit, with Megatron's
    grad_added_to_main_grad protocol kept."""
    from turbo_moe import host_plan

    reference = _experts_calls(False, fp8, granularity, main_grad)
    got = _experts_calls(True, fp8, granularity, main_grad)
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    for i, ((a, used_a, flags_a), (b, used_b, flags_b)) in enumerate(zip(reference, got)):
        assert used_a == (0, 0) and flags_a == flags_b
        for what, ta, tb in zip(("y", "dx", "dprobs", "fc1 dW", "fc2 dW"), a, b):
            assert ta.shape == tb.shape and ta.dtype == tb.dtype, (i, what)
            assert torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), (i, what)
    planned = (1, 0)  # one MLP node
    assert [used for _, used, _ in got] == [(0, 0), (0, 0), planned, planned, planned]
