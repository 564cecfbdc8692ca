"""turbo_moe.megatron on CPU, the full MoELayer: router + allgather dispatcher + our experts, forward
and backward against Megatron's own layer with SequentialMLP experts on the same weights; and a
TransformerLayer built from Megatron's GPT spec patched by use_turbo_moe_experts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from turbo_moe.config import Float8Format  # noqa: E402

from _megatron_harness import make_config, rel_err  # noqa: E402
from _megatron_cpu import (  # noqa: E402, F401 (world: a fixture)
    FP8_FWD_TOL,
    FP8_BWD_TOL,
    experts_pair,
    world,
)

tm = pytest.importorskip("turbo_moe.megatron")


def _moe_layer_pair(config, **options):
    return experts_pair(config, seed=2, **options)


@pytest.mark.parametrize("glu", [True, False])
def test_moe_layer_forward_backward_equals_megatron_without_fp8(world, glu):
    act = torch.nn.functional.silu if glu else torch.nn.functional.gelu
    config = make_config(gated_linear_unit=glu, activation_func=act, num_moe_experts=6, moe_router_topk=2)
    seq_layer, turbo_layer = _moe_layer_pair(config, fp8=None)
    hidden = torch.randn(9, 2, config.hidden_size, generator=torch.Generator().manual_seed(4))
    h_seq, h_tm = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out_seq, _ = seq_layer(h_seq)
    out_tm, _ = turbo_layer(h_tm)
    assert torch.equal(out_tm, out_seq)
    grad = torch.randn_like(out_seq)
    out_seq.backward(grad)
    out_tm.backward(grad)
    assert torch.equal(h_tm.grad, h_seq.grad)
    torch.testing.assert_close(turbo_layer.router.weight.grad, seq_layer.router.weight.grad, rtol=1e-6, atol=1e-7)
    for name in ("linear_fc1", "linear_fc2"):
        theirs = torch.stack([getattr(e, name).weight.grad for e in seq_layer.experts.local_experts])
        torch.testing.assert_close(getattr(turbo_layer.experts, name).weight.grad, theirs, rtol=1e-6, atol=1e-6)


def test_moe_layer_fp8_close_to_megatron(world):
    config = make_config(num_moe_experts=4, moe_router_topk=2)
    seq_layer, turbo_layer = _moe_layer_pair(config, fp8="hybrid")
    hidden = torch.randn(16, 2, config.hidden_size, generator=torch.Generator().manual_seed(6))
    h_seq, h_tm = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out_seq, _ = seq_layer(h_seq)
    out_tm, _ = turbo_layer(h_tm)
    err = rel_err(out_tm, out_seq)
    assert 1e-4 < err < FP8_FWD_TOL
    grad = torch.randn_like(out_seq)
    out_seq.backward(grad)
    out_tm.backward(grad)
    assert rel_err(h_tm.grad, h_seq.grad) < FP8_BWD_TOL
    for name in ("linear_fc1", "linear_fc2"):
        theirs = torch.stack([getattr(e, name).weight.grad for e in seq_layer.experts.local_experts])
        assert rel_err(getattr(turbo_layer.experts, name).weight.grad, theirs) < FP8_BWD_TOL


def test_transformer_layer_from_patched_gpt_spec(world, monkeypatch):
    """The one-line change: patch Megatron's GPT layer spec, build a TransformerLayer, run it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # Attention dropout forks Megatron's CUDA RNG tracker, which needs CUDA; no dropout runs here.
    monkeypatch.setattr(get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    config = make_config(num_moe_experts=4)
    spec = tm.use_turbo_moe_experts(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True), fp8="e4m3")
    layer = build_module(spec, config=config, layer_number=1)
    assert isinstance(layer.mlp.experts, tm.TurboMoEGroupedMLP)
    assert layer.mlp.experts.linear_fc1.fp8_config.format is Float8Format.E4M3
    hidden = torch.randn(6, 2, config.hidden_size, requires_grad=True)
    # An explicit causal mask: Megatron's default one is built on "cuda".
    causal = torch.triu(torch.ones(1, 1, 6, 6, dtype=torch.bool), diagonal=1)
    out, _ = layer(hidden, attention_mask=causal)
    out.sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
    assert layer.mlp.experts.linear_fc1.weight.grad is not None


def test_use_turbo_moe_experts_patches_block_spec_and_rejects_dense(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    config = make_config(num_layers=2, num_moe_experts=4, moe_layer_freq=[1, 0])
    block = tm.use_turbo_moe_experts(get_gpt_decoder_block_spec(config, use_transformer_engine=False), fp8=None)
    mlps = [s.submodules.mlp for s in block.layer_specs]
    moe = mlps[0].keywords["submodules"]
    assert isinstance(moe, MoESubmodules) and moe.experts.func is tm.TurboMoEGroupedMLP
    assert not isinstance(getattr(mlps[1], "keywords", {}).get("submodules"), MoESubmodules)
    with pytest.raises(ValueError, match="no MoE layer"):
        tm.use_turbo_moe_experts(get_gpt_layer_local_spec(num_experts=None))
