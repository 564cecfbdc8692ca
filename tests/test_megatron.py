"""turbo_moe.megatron on CPU: a real Megatron MoELayer (router, allgather dispatcher) with our experts.

References: Megatron's own SequentialMLP experts on the same weights (exactly equal with FP8 off)
and a float64 oracle of the expert MLP (FP8 within what e4m3/e5m2 rounding explains).
"""

from __future__ import annotations

import contextlib
import tempfile
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import turbo_moe  # noqa: E402
from turbo_moe import Float8Config  # noqa: E402
from turbo_moe.config import Float8Format, ScalingGranularity  # noqa: E402

from _megatron_harness import (  # noqa: E402
    TWO_RANK_MODES,
    build_sequential_moe,
    build_turbo_moe,
    copy_sequential_into_turbo,
    expert_mlp_reference,
    make_config,
    megatron_world,
    randomize_,
    rel_err,
    two_rank_worker,
)

tm = pytest.importorskip("turbo_moe.megatron")

# e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element). Measured on these shapes
# (two GEMMs and a gated activation): 6-7% relative error in norm forward, 6-9% for the gradients
# (e5m2 under "hybrid"). The bounds leave head-room yet fail on a wrong expert, a transposed
# weight or a dropped scale (errors of order 100%).
FP8_FWD_TOL = 0.12
FP8_BWD_TOL = 0.15


@pytest.fixture(scope="module")
def world():
    with megatron_world("cpu"):
        yield


def _ragged_inputs(tokens_per_expert, hidden, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    m = sum(tokens_per_expert)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    probs = torch.rand(m, generator=gen).to(dtype) * 0.9 + 0.1
    return x, torch.tensor(tokens_per_expert, dtype=torch.int64), probs


def _experts_pair(config, **options):
    """Megatron's SequentialMLP experts and ours, ours holding a copy of the same fresh weights."""
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, seed=1)
    turbo_layer = build_turbo_moe(config, **options)
    copy_sequential_into_turbo(seq_layer, turbo_layer)
    return seq_layer, turbo_layer


def _stacked(experts, name, attr="weight"):
    return torch.stack([getattr(getattr(e, name), attr).detach() for e in experts.local_experts])


# ----------------------------------------------------------------------------------------------
# Experts level: ragged groups, empty experts, one expert, many experts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_experts, tokens_per_expert",
    [
        (4, [5, 0, 13, 3]),  # an empty expert in the middle
        (1, [11]),  # one expert
        (8, [0, 1, 7, 0, 2, 9, 0, 4]),  # many, ragged, several empty
        (3, [0, 0, 6]),  # leading empty experts
    ],
)
def test_experts_match_sequential_exactly_without_fp8(world, num_experts, tokens_per_expert):
    config = make_config(num_moe_experts=num_experts, moe_router_topk=min(2, num_experts), moe_router_pre_softmax=True)
    seq_layer, turbo_layer = _experts_pair(config, fp8=None)
    x, tpe, probs = _ragged_inputs(tokens_per_expert, config.hidden_size, seed=num_experts)
    x_seq, x_tm = x.clone().requires_grad_(), x.clone().requires_grad_()

    out_seq, _ = seq_layer.experts(x_seq, tpe, probs)
    out_tm, bias = turbo_layer.experts(x_tm, tpe, probs)
    assert bias is None
    assert torch.equal(out_tm, out_seq)
    # And both agree with the float64 oracle (so "equal" is not equal-and-wrong).
    ref = expert_mlp_reference(x, tokens_per_expert, probs, _stacked(seq_layer.experts, "linear_fc1"),
                               _stacked(seq_layer.experts, "linear_fc2"))
    assert rel_err(out_tm, ref) < 1e-5

    grad = torch.randn_like(out_seq)
    out_seq.backward(grad)
    out_tm.backward(grad)
    assert torch.equal(x_tm.grad, x_seq.grad)
    for name in ("linear_fc1", "linear_fc2"):
        ours = getattr(turbo_layer.experts, name).weight.grad
        theirs = torch.stack([getattr(e, name).weight.grad for e in seq_layer.experts.local_experts])
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        for e, n in enumerate(tokens_per_expert):
            if n == 0:
                assert torch.count_nonzero(ours[e]) == 0, f"empty expert {e} got a nonzero {name} grad"


@pytest.mark.parametrize(
    "overrides",
    [
        dict(bias_activation_fusion=True),  # Megatron's fused weighted SwiGLU
        dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
        dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
        dict(activation_func_clamp_value=0.5, glu_linear_offset=1.0),
    ],
    ids=["fused_swiglu", "probs_on_input", "gelu", "clamped_glu"],
)
def test_experts_activation_variants_match_sequential(world, overrides):
    config = make_config(num_moe_experts=3, **overrides)
    seq_layer, turbo_layer = _experts_pair(config, fp8=None)
    x, tpe, probs = _ragged_inputs([6, 0, 5], config.hidden_size, seed=17)
    x_seq, x_tm = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_seq, _ = seq_layer.experts(x_seq, tpe, probs)
    out_tm, _ = turbo_layer.experts(x_tm, tpe, probs)
    torch.testing.assert_close(out_tm, out_seq, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out_seq)
    out_seq.backward(grad)
    out_tm.backward(grad)
    torch.testing.assert_close(x_tm.grad, x_seq.grad, rtol=1e-6, atol=1e-6)


def test_importing_turbo_moe_does_not_import_megatron():
    import subprocess
    import sys

    code = "import sys, turbo_moe; bad = [m for m in sys.modules if m.split('.')[0] == 'megatron']; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_experts_fp8_within_tolerance_of_float64(world, fmt, granularity):
    config = make_config(num_moe_experts=5)
    tokens_per_expert = [9, 0, 17, 1, 6]
    seq_layer, turbo_layer = _experts_pair(config, fp8=fmt, granularity=granularity)
    assert turbo_layer.experts.linear_fc1.fp8_config == Float8Config(format=fmt, granularity=granularity)
    x, tpe, probs = _ragged_inputs(tokens_per_expert, config.hidden_size, seed=3)
    x_tm = x.clone().requires_grad_()
    x64 = x.double().requires_grad_()

    turbo_moe.backends.clear_recent_dispatches()
    out_tm, _ = turbo_layer.experts(x_tm, tpe, probs)
    w1 = _stacked(seq_layer.experts, "linear_fc1").double().requires_grad_()
    w2 = _stacked(seq_layer.experts, "linear_fc2").double().requires_grad_()
    ref = expert_mlp_reference(x64, tokens_per_expert, probs, w1, w2)
    err = rel_err(out_tm, ref)
    assert err < FP8_FWD_TOL
    assert err > 1e-4, "FP8 output equals the float64 one: quantization did not run"

    grad = torch.randn(out_tm.shape, generator=torch.Generator().manual_seed(5))
    out_tm.backward(grad)
    ref.backward(grad.double())
    assert rel_err(x_tm.grad, x64.grad) < FP8_BWD_TOL
    for name, w in (("linear_fc1", w1), ("linear_fc2", w2)):
        ours = getattr(turbo_layer.experts, name).weight.grad
        assert torch.count_nonzero(ours[1]) == 0  # the empty expert
        assert rel_err(ours, w.grad) < FP8_BWD_TOL
    roles = [r.problem.split()[0] for r in turbo_moe.recent_dispatches()]
    assert {"fwd", "dgrad", "wgrad"} <= set(roles)


def test_experts_with_bias_match_float64(world):
    config = make_config(num_moe_experts=3, add_bias_linear=True)
    tokens_per_expert = [4, 0, 7]
    seq_layer, turbo_layer = _experts_pair(config, fp8=None)
    x, tpe, probs = _ragged_inputs(tokens_per_expert, config.hidden_size, seed=7)
    # Megatron's SequentialMLP with biases errs in grad mode (an in-place op on a custom
    # Function's view in mlp.py), so it is the reference here under no_grad only.
    with torch.no_grad():
        out_seq, _ = seq_layer.experts(x, tpe, probs)
    x_tm = x.clone().requires_grad_()
    out_tm, _ = turbo_layer.experts(x_tm, tpe, probs)
    torch.testing.assert_close(out_tm, out_seq, rtol=1e-6, atol=1e-6)
    fc1, fc2 = turbo_layer.experts.linear_fc1, turbo_layer.experts.linear_fc2
    ref = expert_mlp_reference(x, tokens_per_expert, probs, fc1.weight.detach(), fc2.weight.detach(),
                               fc1.bias.detach(), fc2.bias.detach())
    assert rel_err(out_tm, ref) < 1e-5
    out_tm.sum().backward()
    assert fc2.bias.grad is not None and torch.count_nonzero(fc2.bias.grad[1]) == 0
    # The fc2 bias gradient is the prob-weighted row count of each expert.
    torch.testing.assert_close(fc2.bias.grad[2], probs[4:].sum().expand(config.hidden_size), rtol=1e-5, atol=1e-6)


def test_stock_te_grouped_mlp_runs_our_linears(world):
    """Megatron's own TEGroupedMLP (TE-free when FP8 is off) with our linears: the list m_splits path."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    config = make_config(num_moe_experts=4)
    seq_layer, turbo_layer = _experts_pair(config, fp8=None)
    stock = TEGroupedMLP(4, config, tm._turbo_submodules(tm.TurboMoEOptions(fp8=None)),
                         pg_collection=_pg())
    stock.load_state_dict(turbo_layer.experts.state_dict())
    x, tpe, probs = _ragged_inputs([3, 8, 0, 5], config.hidden_size, seed=11)
    out_stock, _ = stock(x, tpe, probs)
    out_tm, _ = turbo_layer.experts(x, tpe, probs)
    assert torch.equal(out_stock, out_tm)


def _needs_psutil():
    # Megatron's distributed-checkpoint writer imports psutil to log memory (not a declared dep).
    pytest.importorskip("psutil", reason="Megatron's dist-checkpoint writer needs psutil (pip install psutil)")


def _pg():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


# ----------------------------------------------------------------------------------------------
# Full MoELayer: router + dispatcher + experts, forward and backward
# ----------------------------------------------------------------------------------------------


def _moe_layer_pair(config, **options):
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, seed=2)
    turbo_layer = build_turbo_moe(config, **options)
    copy_sequential_into_turbo(seq_layer, turbo_layer)
    return seq_layer, turbo_layer


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


# ----------------------------------------------------------------------------------------------
# Config mapping
# ----------------------------------------------------------------------------------------------


def _ns(**kw):
    base = dict(fp8=None, fp8_recipe="tensorwise", fp8_margin=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_fp8_switch_mapping():
    resolve = tm.resolve_fp8_config
    opts = tm.TurboMoEOptions
    assert resolve(opts(), _ns()) is None  # follows config.fp8 = None
    assert resolve(opts(fp8=None), _ns(fp8="e4m3")) is None  # explicit off wins
    cfg = resolve(opts(), _ns(fp8="hybrid", fp8_margin=1))
    assert cfg == Float8Config(format="hybrid", granularity="tensorwise", margin=1)
    assert cfg.grad_dtype == torch.float8_e5m2
    # Recipes turbo_moe cannot run as Megatron defines them are refused (tests/test_megatron_options.py).
    assert resolve(opts(), _ns(fp8="e4m3", fp8_recipe="blockwise")) == Float8Config(granularity="blockwise")
    assert resolve(opts(), _ns(fp8="hybrid", fp8_recipe="mxfp8")) == Float8Config(format="hybrid", granularity="mxfp8")
    for recipe in ("delayed",):
        with pytest.raises(ValueError, match=f"fp8_recipe='{recipe}'"):
            resolve(opts(), _ns(fp8="e4m3", fp8_recipe=recipe))
    assert resolve(opts(fp8="e4m3", granularity="rowwise"), _ns()) == Float8Config(granularity="rowwise")
    explicit = Float8Config(format="hybrid", granularity="rowwise", margin=2)
    assert resolve(opts(fp8=explicit), _ns(fp8="e4m3")) is explicit
    with pytest.raises(ValueError, match="fp8_recipe"):
        resolve(opts(), _ns(fp8="e4m3", fp8_recipe="custom"))
    with pytest.raises(ValueError, match="fp8="):
        opts(fp8="e5m2")
    with pytest.raises(ValueError, match="granularity"):
        opts(fp8="e4m3", granularity="per_block")
    with pytest.raises(ValueError, match="num_cu"):
        opts(num_cu=0)


def test_layer_honours_megatron_config(world):
    """Sizes, GLU doubling, bias, params_dtype, init_method, and Megatron's config.fp8 names."""
    seen = []

    def init_method(t):
        seen.append(tuple(t.shape))
        torch.nn.init.constant_(t, 0.5)

    config = make_config(num_moe_experts=4, moe_ffn_hidden_size=24, add_bias_linear=True,
                         params_dtype=torch.bfloat16, init_method=init_method)
    experts = tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8="hybrid"))
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    assert fc1.weight.shape == (4, 48, config.hidden_size)  # SwiGLU: fc1 makes 2 x FFN
    assert fc2.weight.shape == (4, config.hidden_size, 24)
    assert fc1.bias.shape == (4, 48) and fc2.bias.shape == (4, config.hidden_size)
    assert fc1.weight.dtype == torch.bfloat16 and fc2.bias.dtype == torch.bfloat16
    assert (48, config.hidden_size) in seen and torch.all(fc1.weight == 0.5)
    assert fc1.fp8_config.format is Float8Format.HYBRID
    assert fc2.skip_bias_add and not fc1.skip_bias_add
    for p in experts.parameters():
        assert hasattr(p, "allreduce")

    # fp8="megatron" (the default) follows Megatron's own config.fp8 names. Megatron refuses
    # config.fp8 with MoE unless TE is installed (and TEGroupedMLP then builds TE's padding), so
    # the linear is checked alone, with config.fp8 set after construction.
    config.fp8, config.fp8_recipe = "e4m3", "tensorwise"
    fc = tm.TurboColumnParallelGroupedLinear(4, config.hidden_size, 48, config=config, init_method=init_method,
                                             bias=False, skip_bias_add=False, is_expert=True, pg_collection=_pg())
    assert fc.fp8_config == Float8Config(format="e4m3", granularity="tensorwise")
    x = torch.randn(7, config.hidden_size, dtype=torch.bfloat16)
    y, _ = fc(x, [3, 0, 4, 0])
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)


def test_bad_inputs_name_the_argument(world):
    config = make_config(num_moe_experts=3)
    experts = tm.TurboMoEGroupedMLP(3, config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=None))
    x = torch.randn(5, config.hidden_size)
    with pytest.raises(ValueError, match="m_splits"):
        experts.linear_fc1(x, [2, 3])
    with pytest.raises(ValueError, match="x.shape"):
        experts.linear_fc1(torch.randn(5, 3), [2, 3, 0])
    with pytest.raises(ValueError, match="group_lens sums to"):
        experts(x, torch.tensor([2, 2, 2]), torch.ones(5))
    with pytest.raises(TypeError, match="m_splits"):
        experts.linear_fc1(x, torch.tensor([2.0, 3.0, 0.0]))
    with pytest.raises(ValueError, match=r"group_offs\[-1\]=9 but x has 5 rows"):  # checked, never trusted
        experts.linear_fc1(x, group_offs=torch.tensor([0, 2, 3, 9]))
    unsupported = make_config(num_moe_experts=3)
    unsupported.use_te_activation_func = True
    with pytest.raises(NotImplementedError, match="use_te_activation_func"):
        tm.TurboMoEGroupedMLP(3, unsupported, pg_collection=_pg())


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_dist_checkpoint_round_trip_with_sequential_mlp(world, bias):
    """Megatron's distributed checkpoint: SequentialMLP -> ours -> SequentialMLP, bit-exact."""
    _needs_psutil()
    from megatron.core import dist_checkpointing

    config = make_config(num_moe_experts=4, add_bias_linear=bias)
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, seed=8)
    turbo_layer = build_turbo_moe(config, fp8=None)
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        dist_checkpointing.save(seq_layer.sharded_state_dict(prefix="mlp."), d1)
        loaded = dist_checkpointing.load(turbo_layer.sharded_state_dict(prefix="mlp."), d1)
        turbo_layer.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
        for name in ("linear_fc1", "linear_fc2"):
            assert torch.equal(getattr(turbo_layer.experts, name).weight, _stacked(seq_layer.experts, name))
            if bias:
                assert torch.equal(getattr(turbo_layer.experts, name).bias, _stacked(seq_layer.experts, name, "bias"))

        with torch.no_grad():
            for p in turbo_layer.experts.parameters():
                p.add_(torch.randn_like(p))
        dist_checkpointing.save(turbo_layer.sharded_state_dict(prefix="mlp."), d2)
        back = build_sequential_moe(config)
        loaded = dist_checkpointing.load(back.sharded_state_dict(prefix="mlp."), d2)
        back.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
        for name in ("linear_fc1", "linear_fc2"):
            assert torch.equal(_stacked(back.experts, name), getattr(turbo_layer.experts, name).weight)
        hidden = torch.randn(5, 2, config.hidden_size)
        with torch.no_grad():
            assert torch.equal(back(hidden)[0], turbo_layer(hidden)[0])


def test_plain_state_dict_uses_te_names_and_round_trips(world):
    config = make_config(num_moe_experts=3, add_bias_linear=True)
    a = tm.TurboMoEGroupedMLP(3, config, pg_collection=_pg())
    randomize_(a, seed=9)
    sd = a.state_dict()
    expected = {f"linear_fc{j}.{n}{i}" for j in (1, 2) for n in ("weight", "bias") for i in range(3)}
    assert expected <= set(sd) and "linear_fc1.weight" not in sd
    assert {"linear_fc1._extra_state", "linear_fc2._extra_state"} <= set(sd)
    assert torch.equal(sd["linear_fc1.weight2"], a.linear_fc1.weight[2])

    b = tm.TurboMoEGroupedMLP(3, config, pg_collection=_pg())
    b.load_state_dict(sd, strict=True)
    assert torch.equal(b.linear_fc2.weight, a.linear_fc2.weight) and torch.equal(b.linear_fc1.bias, a.linear_fc1.bias)

    # TE's per-GEMM extra states and a single stacked tensor (TE's single_grouped_weight) load too.
    te_style = dict(sd)
    te_style["linear_fc1._extra_state1"] = torch.empty(0, dtype=torch.uint8)
    te_style["linear_fc2.weight"] = torch.stack([te_style.pop(f"linear_fc2.weight{i}") for i in range(3)])
    c = tm.TurboMoEGroupedMLP(3, config, pg_collection=_pg())
    c.load_state_dict(te_style, strict=True)
    assert torch.equal(c.linear_fc2.weight, a.linear_fc2.weight)

    partial = {k: v for k, v in sd.items() if k != "linear_fc1.weight1"}
    with pytest.raises(RuntimeError, match="2 of 3 per-expert"):
        tm.TurboMoEGroupedMLP(3, config, pg_collection=_pg()).load_state_dict(partial)


def test_optimizer_state_maps_onto_our_sharded_entries(world):
    """Megatron's optimizer checkpointing finds model shards by parameter identity: ours are found."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    config = make_config(num_moe_experts=4, add_bias_linear=True)
    layer = build_turbo_moe(config, fp8=None)
    params = list(layer.parameters())
    mapping = get_param_id_to_sharded_param_map(layer.sharded_state_dict(prefix="mlp."), params)
    ids = {id(p): i for i, p in enumerate(params)}
    for name in ("linear_fc1", "linear_fc2"):
        for attr in ("weight", "bias"):
            param = getattr(getattr(layer.experts, name), attr)
            assert ids[id(param)] in mapping, f"{name}.{attr} has no sharded entry for its optimizer state"
            assert mapping[ids[id(param)]].key == f"mlp.experts.experts.{name}.{attr}"


class _FakeGroup:
    """A process group stand-in for sharding metadata: only size() and rank() are read."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _fake_pg(ep=(2, 1), etp=(2, 1), edp=(1, 0)):
    return types.SimpleNamespace(ep=_FakeGroup(*ep), expt_tp=_FakeGroup(*etp), expt_dp=_FakeGroup(*edp),
                                 expt_dp_gtp_remat=_FakeGroup(*edp), tp=_FakeGroup(1, 0))


def _te_reference_shards(param_2d_list, tp_axis, glu, pg, prefix, sharded_offsets):
    """The ShardedTensors TE's grouped linear + TEGroupedMLP make, rebuilt with Megatron's helpers.

    From megatron/core/extensions/transformer_engine.py (_sharded_state_dict_grouped): one
    2-D tensor per local expert, ``make_sharded_tensors_for_checkpoint`` with the TP axis and an
    extra (ep_axis, global_expert, num_global) offset; TEGroupedMLP.sharded_state_dict wraps fc1
    weights with ``apply_swiglu_sharded_factory`` under gated linear units.
    """
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    ep_size, ep_rank = pg.ep.size(), pg.ep.rank()
    e_local = len(param_2d_list)
    out = []
    for i, t in enumerate(param_2d_list):
        offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * e_local + i, ep_size * e_local))
        sd = make_sharded_tensors_for_checkpoint({f"{i}.weight": t}, "", {f"{i}.weight": tp_axis}, offsets,
                                                 tp_group=pg.expt_tp, dp_cp_group=pg.expt_dp)
        sh = sd[f"{i}.weight"]
        sh.key = f"{prefix}weight"
        if glu:
            out.extend(apply_swiglu_sharded_factory(sh, offsets, tp_group=pg.expt_tp, dp_group=pg.expt_dp)
                       .build())
        else:
            out.append(sh)
    return out


def _chunks(entry):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("sharded_offsets", [(), ((0, 3, 8),)])
def test_sharding_metadata_matches_te_layout_under_ep_and_etp(world, glu, sharded_offsets):
    """EP=2 (rank 1) x ETP=2 (rank 1): global shapes, offsets and keys equal TE's per-expert ones."""
    act = torch.nn.functional.silu if glu else torch.nn.functional.gelu
    config = make_config(num_moe_experts=4, moe_ffn_hidden_size=16, gated_linear_unit=glu, activation_func=act,
                         expert_model_parallel_size=1)
    pg = _fake_pg()
    fc1_out = 32 if glu else 16
    fc1 = tm.TurboColumnParallelGroupedLinear(2, config.hidden_size, fc1_out, config=config, init_method=config.init_method,
                                              bias=False, skip_bias_add=False, is_expert=True, pg_collection=pg)
    fc2 = tm.TurboRowParallelGroupedLinear(2, 16, config.hidden_size, config=config, init_method=config.init_method,
                                           bias=False, skip_bias_add=True, is_expert=True, pg_collection=pg)
    assert fc1.weight.shape == (2, fc1_out // 2, config.hidden_size)  # this ETP rank's rows
    assert fc2.weight.shape == (2, config.hidden_size, 8)  # this ETP rank's columns
    p = len(sharded_offsets)
    for layer, tp_axis, is_glu in ((fc1, 0, glu), (fc2, 1, False)):
        ours = [c for c in _chunks(layer.sharded_state_dict("fc.", sharded_offsets)["fc.weight"])]
        theirs = _te_reference_shards([layer.weight[e] for e in range(2)], tp_axis, is_glu, pg, "fc.", sharded_offsets)
        assert len(ours) == (2 if is_glu else 1) and len(theirs) == 2 * len(ours)
        for t in theirs:
            # Each TE per-expert block lies inside one of ours, with the same key and global shape.
            matches = [o for o in ours if o.key == t.key and o.global_shape == t.global_shape
                       and o.global_offset[p] <= t.global_offset[p] < o.global_offset[p] + o.local_shape[p]
                       and o.global_offset[p + 1:] == t.global_offset[p + 1:]
                       # TE's blocks are 2-D with the expert axis prepended; ours are 3-D.
                       and tuple(o.local_shape[1:]) == tuple(t.local_shape)]
            assert len(matches) == 1, (t.global_offset, [o.global_offset for o in ours])
            o = matches[0]
            e = t.global_offset[p] - o.global_offset[p]
            assert torch.equal(o.data[e], t.data)
            assert o.replica_id == t.replica_id
        # Global [E, out, in] with E = EP x local experts; this rank's experts are 2 and 3.
        assert ours[0].global_shape[p] == 4 and ours[0].global_offset[p] == 2
    assert all(p_.allreduce is False for p_ in (fc1.weight, fc2.weight))  # expert-DP reduction
    assert fc1.weight.partition_dim == 1 and fc2.weight.partition_dim == 2


def test_singleton_local_shards_match_te_keys(world):
    config = make_config(num_moe_experts=4, gated_linear_unit=False, activation_func=torch.nn.functional.gelu)
    pg = _fake_pg(etp=(1, 0))
    fc2 = tm.TurboRowParallelGroupedLinear(2, config.moe_ffn_hidden_size, config.hidden_size, config=config,
                                           init_method=config.init_method, bias=False, skip_bias_add=True,
                                           is_expert=True, pg_collection=pg)
    sd = fc2.sharded_state_dict("linear_fc2.", (), {"singleton_local_shards": True, "dp_cp_group": None})
    assert sd["linear_fc2.weight1"].key == "3.linear_fc2.weight"  # TE: f"{global_expert}.{prefix}"
    assert torch.equal(sd["linear_fc2.weight1"].data, fc2.weight[1])
    assert sd["linear_fc2._extra_state1"].key == "3.linear_fc2._extra_state"


def test_two_processes_expert_parallel_and_expert_tensor_parallel(world):
    """EP=2 and ETP=2 on two gloo processes, then their checkpoints resharded into one process.

    In the workers: SequentialMLP's checkpoint loads into ours shard by shard and the real
    MoELayer matches exactly (see two_rank_worker). Here: the checkpoint *ours* saved at EP=2 /
    ETP=2 loads into Megatron's SequentialMLP at EP=1 and every expert equals the shards the
    ranks held -- for ETP with SwiGLU, gate rows from both ranks first, then the linear rows.
    """
    _needs_psutil()
    import os
    import socket

    import torch.multiprocessing as mp
    from megatron.core import dist_checkpointing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(two_rank_worker, args=(2, port, root), nprocs=2, join=True)
        for mode in TWO_RANK_MODES:
            shards = [torch.load(os.path.join(root, f"{mode}_rank{r}.pt")) for r in range(2)]
            config = make_config(num_moe_experts=4)
            seq_layer = build_sequential_moe(config)
            loaded = dist_checkpointing.load(seq_layer.sharded_state_dict(prefix="mlp."), os.path.join(root, f"{mode}_ours"))
            seq_layer.load_state_dict({k[len("mlp."):]: v for k, v in loaded.items()}, strict=True)
            fc1 = _stacked(seq_layer.experts, "linear_fc1")
            fc2 = _stacked(seq_layer.experts, "linear_fc2")
            if mode == "ep":  # rank r held experts 2r, 2r+1 whole
                assert torch.equal(fc1, torch.cat([s["linear_fc1"] for s in shards]))
                assert torch.equal(fc2, torch.cat([s["linear_fc2"] for s in shards]))
            else:  # rank r held [gate_r; linear_r] rows of fc1 and a column block of fc2
                f = config.moe_ffn_hidden_size // 2
                gate = torch.cat([s["linear_fc1"][:, :f] for s in shards], dim=1)
                linear = torch.cat([s["linear_fc1"][:, f:] for s in shards], dim=1)
                assert torch.equal(fc1, torch.cat([gate, linear], dim=1))
                assert torch.equal(fc2, torch.cat([s["linear_fc2"] for s in shards], dim=2))


# ----------------------------------------------------------------------------------------------
# main_grad accumulation and delayed wgrad
# ----------------------------------------------------------------------------------------------


def _expert_grads(experts):
    return {n: getattr(experts, n).weight.grad.clone() for n in ("linear_fc1", "linear_fc2")}


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_gradient_accumulation_fusion_adds_into_main_grad(world, fp8):
    config = make_config(num_moe_experts=4)
    plain = tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    randomize_(plain, seed=12)
    x, tpe, probs = _ragged_inputs([6, 0, 9, 2], config.hidden_size, seed=13)
    plain(x, tpe, probs)[0].square().sum().backward()
    expected = _expert_grads(plain)

    fused_config = make_config(num_moe_experts=4)
    fused_config.gradient_accumulation_fusion = True  # Megatron's DDP provides main_grad
    fused = tm.TurboMoEGroupedMLP(4, fused_config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    fused.load_state_dict(plain.state_dict())
    for p in fused.parameters():
        p.main_grad = torch.full(p.shape, 0.25, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    for _ in range(2):  # two micro-batches accumulate
        fused(x, tpe, probs)[0].square().sum().backward()
    for n in ("linear_fc1", "linear_fc2"):
        w = getattr(fused, n).weight
        torch.testing.assert_close(w.main_grad, 0.25 + 2 * expected[n].float(), rtol=1e-5, atol=1e-6)
        assert w.grad_added_to_main_grad is True
        assert w.grad is not None and w.grad.shape == w.shape  # the placeholder DDP discards


@pytest.mark.parametrize("delayed", [False, True])
def test_megatron_ddp_with_gradient_accumulation_fusion(world, delayed):
    """Megatron's own DDP (grad buffers, main_grad, its backward hooks) around our experts.

    With ``delayed``, DDP's delay_wgrad_compute registers its hooks on our linears
    (register_wgrad_accumulation_and_reduce_hooks) and backward_dw() produces the gradients.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = make_config(num_moe_experts=4)
    config.gradient_accumulation_fusion = True
    config.delay_wgrad_compute = delayed  # after __post_init__, which wants EP comm overlap for it
    layer = build_turbo_moe(config, fp8=None)
    randomize_(layer, seed=18)
    plain = build_turbo_moe(make_config(num_moe_experts=4), fp8=None)
    plain.load_state_dict(layer.state_dict())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, delay_wgrad_compute=delayed)
    ddp = DistributedDataParallel(config, ddp_config, layer)
    if delayed:
        assert len(layer.experts.linear_fc1._wgrad_accumulation_and_reduce_hooks) == 1
    hidden = torch.randn(6, 2, config.hidden_size, generator=torch.Generator().manual_seed(19))
    for step in range(2):  # two micro-batches
        ddp(hidden)[0].square().sum().backward()
        if delayed:
            if step == 0:
                assert layer.experts.linear_fc2.weight.main_grad.abs().sum() == 0  # wgrad deferred
            layer.backward_dw()  # MoELayer.backward_dw -> experts -> fc2, fc1
        plain(hidden)[0].square().sum().backward()
    for name in ("linear_fc1", "linear_fc2"):
        w = getattr(layer.experts, name).weight
        assert w.grad is None and w.grad_added_to_main_grad  # DDP dropped the placeholder
        torch.testing.assert_close(w.main_grad, getattr(plain.experts, name).weight.grad, rtol=1e-6, atol=1e-7)
        assert w.main_grad.abs().sum() > 0
    torch.testing.assert_close(layer.router.weight.main_grad, plain.router.weight.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_delayed_wgrad_matches_immediate(world, fp8):
    config = make_config(num_moe_experts=4)
    now = tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    randomize_(now, seed=14)
    x, tpe, probs = _ragged_inputs([3, 10, 0, 5], config.hidden_size, seed=15)
    x_now = x.clone().requires_grad_()
    now(x_now, tpe, probs)[0].square().sum().backward()
    expected = _expert_grads(now)

    delayed_config = make_config(num_moe_experts=4)
    delayed_config.delay_wgrad_compute = True  # set after __post_init__ (needs EP comm overlap there)
    later = tm.TurboMoEGroupedMLP(4, delayed_config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    later.load_state_dict(now.state_dict())
    fired = []
    later.linear_fc1.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append("fc1"))
    later.linear_fc2.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append("fc2"))
    assert later.linear_fc1.weight.skip_backward_post_hook is True
    x_later = x.clone().requires_grad_()
    later(x_later, tpe, probs)[0].square().sum().backward()
    assert torch.equal(x_later.grad, x_now.grad)
    assert later.linear_fc1.weight.grad is None and later.linear_fc2.weight.grad is None
    later.backward_dw()  # TEGroupedMLP.backward_dw: fc2 then fc1
    assert fired == ["fc2", "fc1"]
    for n in ("linear_fc1", "linear_fc2"):
        got = getattr(later, n).weight.grad
        if fp8 is None:
            torch.testing.assert_close(got, expected[n], rtol=1e-6, atol=1e-6)
        else:  # the same FP8 operands and kernel as the immediate backward
            torch.testing.assert_close(got, expected[n], rtol=0, atol=0)
        assert torch.count_nonzero(got[2]) == 0
    later.backward_dw()  # nothing queued: no change, no hooks
    assert fired == ["fc2", "fc1"]

    # An input that needs no gradient still defers (and later produces) the weight gradients.
    later.zero_grad(set_to_none=True)
    later(x, tpe, probs)[0].square().sum().backward()
    assert later.linear_fc2.weight.grad is None
    later.backward_dw()
    torch.testing.assert_close(later.linear_fc2.weight.grad, expected["linear_fc2"], rtol=1e-6, atol=1e-6)
