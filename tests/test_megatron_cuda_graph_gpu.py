"""Megatron-core's own CUDA graphs (``cuda_graph_impl="local"``, its ``CudaGraphManager``) around a
TransformerLayer whose MoE experts are turbo_moe's (FP8 hybrid, Triton), on one GPU (issue 11,
item 4).

Per capture scope: warm up and record through Megatron's manager, ``create_cudagraphs()`` (what
Megatron's schedules call at the end of a step), then replay with new hidden states -- hence a new
routing -- and compare output and input gradient with an eager twin holding the same weights (a
copy of the graphed layer's state dict); fwd+bwd step time of both is printed (``-s`` shows it).

Scopes and what is expected:

* ``moe_router + moe_preprocess`` (partial): router and preprocessing graphed, dispatch and
  turbo_moe's experts eager -- works with dynamic routing (nothing of ours is captured).
* ``moe`` and the whole layer (empty ``cuda_graph_modules``) with drop-and-pad
  (``moe_expert_capacity_factor=1``, ``moe_pad_expert_input_to_capacity``): static token counts, the
  alltoall dispatcher does no host sync, turbo_moe's experts keep ``tokens_per_expert`` on the
  device -- expected to work.
* the whole layer *without* drop-and-pad: Megatron's dispatcher reads the token counts on the host
  (``.tolist()``/``.cpu()``), which a capture forbids -- expected to be refused or to fail at capture
  (the test asserts it does not silently run).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from _megatron_harness import make_config, megatron_world, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

SEQ, BATCH = 64, 2
DROP_AND_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
SCOPES = {
    "router+preprocess": (["moe_router", "moe_preprocess"], {}),
    "moe (drop-and-pad)": (["moe"], DROP_AND_PAD),
    "layer (drop-and-pad)": ([], DROP_AND_PAD),
}


def _layer(graph_modules, extra, graphed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from turbo_moe.megatron import use_turbo_moe_experts

    config = make_config(
        num_moe_experts=8, hidden_size=256, moe_ffn_hidden_size=512, ffn_hidden_size=512, num_attention_heads=4,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=False, params_dtype=torch.bfloat16, bf16=True,
        hidden_dropout=0.0, attention_dropout=0.0, cuda_graph_warmup_steps=1,
        **(dict(cuda_graph_impl="local", cuda_graph_modules=graph_modules) if graphed else {}), **extra)
    spec = use_turbo_moe_experts(get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True), fp8="hybrid",
                                 backend="triton")
    # .bfloat16(): what Megatron's Float16Module does to a bf16 model (the torch LayerNorm fallback
    # ignores params_dtype and would meet bf16 activations with float32 weights).
    return build_module(spec, config=config, layer_number=1).cuda().bfloat16()


def _copy_weights(src, dst):
    missing, _ = dst.load_state_dict(src.state_dict(), strict=False)  # src may hold graph-manager state
    assert not missing, missing


def _step(layer, hidden, causal):
    h = hidden.clone().requires_grad_()
    out, _ = layer(hidden_states=h, attention_mask=causal)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return out.detach().clone(), h.grad.detach().clone()


def _timed(fn, reps=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


@pytest.fixture
def cuda_world():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with megatron_world("cuda"):
        # Megatron's local CUDA graphs refuse its default RNG tracker ("RNG tracker does not
        # support cudagraphs!"): the graph-safe one, as a training run with CUDA graphs sets it.
        model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
        yield
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
    # The graph-safe tracker swapped the default CUDA generator's state for one that a capture
    # may have left mid-capture (a failed capture never runs its epilogue); later tests in this
    # process then fail in torch.randn ("Offset increment outside graph capture"). Give the
    # default generator a fresh state.
    device = torch.cuda.current_device()
    torch.cuda.default_generators[device].graphsafe_set_state(
        torch.Generator(device=f"cuda:{device}").graphsafe_get_state())
    torch.cuda.manual_seed(0)


def _inputs(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)
    return hidden, causal


# Not yet seen working (issue 11, blocked on its multi-GPU run): on the H100 run of 2026-11-23 with
# megatron-core 0.19.2, Megatron created no graph for the two partial scopes, and the whole layer
# refused the default RNG tracker (the fixture now seeds the graph-safe one; not re-run since).
@pytest.mark.xfail(reason="Megatron local CUDA graphs with this harness: no graph created for partial scopes; "
                          "whole-layer RNG-tracker fix not re-run (H100, 2026-11-23)", strict=False)
@pytest.mark.parametrize("scope", list(SCOPES))
def test_megatron_local_cuda_graph_replays_turbo_moe_layer(cuda_world, scope):
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, create_cudagraphs

    modules, extra = SCOPES[scope]
    torch.manual_seed(0)
    graphed = _layer(modules, extra, graphed=True)
    eager = _layer(modules, extra, graphed=False)
    _copy_weights(graphed, eager)

    hidden, causal = _inputs(0)
    for _ in range(2):  # cuda_graph_warmup_steps=1, then the recording step
        _step(graphed, hidden, causal)
        create_cudagraphs()
    assert _CudagraphGlobalRecord.cudagraph_created, f"{scope}: Megatron created no CUDA graph"

    routings = set()
    for seed in (1, 2, 3):  # new hidden states: a new routing each time
        hidden, causal = _inputs(seed)
        out_g, dx_g = _step(graphed, hidden, causal)
        out_e, dx_e = _step(eager, hidden, causal)
        with torch.no_grad():
            routings.add(tuple(eager.mlp.router(hidden)[1].sum(0).tolist()))  # tokens per expert
        assert torch.isfinite(out_g).all()
        # Same kernels on the same inputs: equal up to non-deterministic reduction order.
        assert rel_err(out_g, out_e) < 1e-3, (scope, seed, rel_err(out_g, out_e))
        assert rel_err(dx_g, dx_e) < 1e-3, (scope, seed, rel_err(dx_g, dx_e))

    assert len(routings) > 1, f"the replays did not change the routing: {routings}"
    hidden, causal = _inputs(4)
    graph_ms = _timed(lambda: _step(graphed, hidden, causal))
    eager_ms = _timed(lambda: _step(eager, hidden, causal))
    print(f"\n[cuda graph] scope {scope}: fwd+bwd {graph_ms:.3f} ms graphed vs {eager_ms:.3f} ms eager")


def test_whole_layer_without_drop_and_pad_is_not_silently_graphed(cuda_world):
    """Dynamic token counts: Megatron's dispatcher syncs with the host; capture must not succeed
    silently with wrong (stale-count) results."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    hidden, causal = _inputs(0)
    # The same layer runs eagerly: an error below then comes from the capture, not from the layer.
    eager = _layer([], {}, graphed=False)
    _step(eager, hidden, causal)
    try:
        graphed = _layer([], {}, graphed=True)
        for _ in range(2):
            _step(graphed, hidden, causal)
            create_cudagraphs()
    except Exception as exc:  # the expected outcome: refused at build or capture
        print(f"\n[cuda graph] whole layer without drop-and-pad refused: {type(exc).__name__}: {str(exc)[:300]}")
        return
    # Captured: a replay on a new routing must still match eager.
    _copy_weights(graphed, eager)
    h2, _ = _inputs(5)
    out_g, _ = _step(graphed, h2, causal)
    out_e, _ = _step(eager, h2, causal)
    err = rel_err(out_g, out_e)
    assert err < 1e-3, f"whole layer without drop-and-pad was captured but replays wrongly: rel err {err}"
    pytest.skip("whole layer without drop-and-pad captured and replays correctly (better than expected)")
