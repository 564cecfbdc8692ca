"""turbo_moe.megatron on CPU: our experts against Megatron's SequentialMLP, and the config mapping.

References: Megatron's own SequentialMLP experts on the same weights (exactly equal with FP8 off)
and a float64 oracle of the expert MLP (FP8 within what e4m3/e5m2 rounding explains). The full
MoELayer is in test_megatron_layer.py, checkpoints in test_megatron_checkpoint.py, main_grad and
delayed wgrad in test_megatron_wgrad.py; shared set-up in _megatron_harness.py and _megatron_cpu.py.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import turbo_moe  # noqa: E402
from turbo_moe import Float8Config  # noqa: E402
from turbo_moe.config import Float8Format  # noqa: E402

from _megatron_harness import (  # noqa: E402
    expert_mlp_reference,
    make_config,
    rel_err,
)
from _megatron_cpu import (  # noqa: E402, F401 (world: a fixture)
    FP8_FWD_TOL,
    FP8_BWD_TOL,
    default_pg,
    experts_pair,
    ragged_inputs,
    stacked,
    world,
)

tm = pytest.importorskip("turbo_moe.megatron")


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
    seq_layer, turbo_layer = experts_pair(config, fp8=None)
    x, tpe, probs = ragged_inputs(tokens_per_expert, config.hidden_size, seed=num_experts)
    x_seq, x_tm = x.clone().requires_grad_(), x.clone().requires_grad_()

    out_seq, _ = seq_layer.experts(x_seq, tpe, probs)
    out_tm, bias = turbo_layer.experts(x_tm, tpe, probs)
    assert bias is None
    assert torch.equal(out_tm, out_seq)
    # And both agree with the float64 oracle (so "equal" is not equal-and-wrong).
    ref = expert_mlp_reference(x, tokens_per_expert, probs, stacked(seq_layer.experts, "linear_fc1"),
                               stacked(seq_layer.experts, "linear_fc2"))
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
    seq_layer, turbo_layer = experts_pair(config, fp8=None)
    x, tpe, probs = ragged_inputs([6, 0, 5], config.hidden_size, seed=17)
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
    seq_layer, turbo_layer = experts_pair(config, fp8=fmt, granularity=granularity)
    assert turbo_layer.experts.linear_fc1.fp8_config == Float8Config(format=fmt, granularity=granularity)
    x, tpe, probs = ragged_inputs(tokens_per_expert, config.hidden_size, seed=3)
    x_tm = x.clone().requires_grad_()
    x64 = x.double().requires_grad_()

    turbo_moe.backends.clear_recent_dispatches()
    out_tm, _ = turbo_layer.experts(x_tm, tpe, probs)
    w1 = stacked(seq_layer.experts, "linear_fc1").double().requires_grad_()
    w2 = stacked(seq_layer.experts, "linear_fc2").double().requires_grad_()
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


def _experts_fwd_bwd(experts, x, tpe, probs, grad):
    """One forward + backward of ``experts`` on fresh leaves: [output, dx, dprobs, every dW]."""
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    experts.zero_grad()
    out, _ = experts(xi, tpe, pi)
    out.backward(grad)
    return [out.detach(), xi.grad, pi.grad] + [p.grad.clone() for p in experts.parameters()]


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_fp8_fc2_fuses_the_swiglu_where_it_can(world, granularity, monkeypatch):
    """Tensorwise and rowwise: fc2 takes fc1's output and computes the weighted SwiGLU inside its
    FP8 quantization (turbo_moe.swiglu), and agrees with the unfused path (Megatron's activation,
    then fc2) to FP8 rounding of the same float32 activation. An activation option the fused path
    does not implement: the unfused path."""
    import turbo_moe.megatron.linear as linear_module

    calls = []
    real = linear_module.grouped_gemm_fp8_swiglu
    monkeypatch.setattr(linear_module, "grouped_gemm_fp8_swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = make_config(num_moe_experts=4)
    _, turbo_layer = experts_pair(config, fp8="hybrid", granularity=granularity)
    experts = turbo_layer.experts
    x, tpe, probs = ragged_inputs([7, 0, 12, 5], config.hidden_size, seed=11)
    grad = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(12))
    results = []
    for fused in (True, False):
        if not fused:
            experts._fuses_activation = lambda: False
        results.append(_experts_fwd_bwd(experts, x, tpe, probs, grad))
    assert len(calls) == 1
    for ours, unfused in zip(*results):
        # float32 activations here: the two paths quantize the same values, up to the order of
        # float32 operations (an FP8 rounding flips now and then)
        assert rel_err(ours, unfused.double()) < 0.02
    config = make_config(num_moe_experts=4, activation_func_clamp_value=0.5)
    _, clamped = experts_pair(config, fp8="hybrid")
    assert not clamped.experts._fuses_activation()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_experts_hand_dh_to_fc1_in_fp8(world, bias, monkeypatch):
    """Tensorwise experts without an fc1 bias: the fused fc2's backward writes dh straight into
    fc1's FP8 layouts (autograd.QuantizedGradHandoff: handed over once, taken once per backward),
    and every gradient is bit-identical to the path without the handoff (float32 parameters: dh is
    float32 either way). With a bias on fc1 its output gradient must reach the bias: no handoff."""
    from turbo_moe.autograd import QuantizedGradHandoff

    events = []
    real_give, real_take = QuantizedGradHandoff.give, QuantizedGradHandoff.take
    monkeypatch.setattr(QuantizedGradHandoff, "give", lambda self, *a, **k: events.append("give") or real_give(self, *a, **k))
    monkeypatch.setattr(QuantizedGradHandoff, "take",
                        lambda self, g: (lambda r: events.append("take" if r is not None else "none") or r)(real_take(self, g)))
    config = make_config(num_moe_experts=4, add_bias_linear=bias)
    _, turbo_layer = experts_pair(config, fp8="hybrid", granularity="tensorwise")
    experts = turbo_layer.experts
    assert experts._fuses_activation() and experts._hands_off_dh() == (not bias)
    x, tpe, probs = ragged_inputs([7, 0, 12, 5], config.hidden_size, seed=13)
    grad = torch.randn(24, config.hidden_size, generator=torch.Generator().manual_seed(14))
    results = []
    for handoff in (True, False):
        if not handoff:
            experts._hands_off_dh = lambda: False
        events.clear()
        results.append(_experts_fwd_bwd(experts, x, tpe, probs, grad))
        if handoff and not bias:
            assert events == ["give", "take"], events
        else:
            assert "give" not in events, events
    for ours, reference in zip(*results):
        assert torch.equal(ours, reference)


def test_experts_with_bias_match_float64(world):
    config = make_config(num_moe_experts=3, add_bias_linear=True)
    tokens_per_expert = [4, 0, 7]
    seq_layer, turbo_layer = experts_pair(config, fp8=None)
    x, tpe, probs = ragged_inputs(tokens_per_expert, config.hidden_size, seed=7)
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
    seq_layer, turbo_layer = experts_pair(config, fp8=None)
    stock = TEGroupedMLP(4, config, tm._turbo_submodules(tm.TurboMoEOptions(fp8=None)),
                         pg_collection=default_pg())
    stock.load_state_dict(turbo_layer.experts.state_dict())
    x, tpe, probs = ragged_inputs([3, 8, 0, 5], config.hidden_size, seed=11)
    out_stock, _ = stock(x, tpe, probs)
    out_tm, _ = turbo_layer.experts(x, tpe, probs)
    assert torch.equal(out_stock, out_tm)


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
    assert resolve(opts(), _ns(fp8="e4m3", fp8_recipe="blockwise")) == Float8Config(granularity="blockwise",
                                                                                   power_of_two_scales=True)
    assert resolve(opts(), _ns(fp8="hybrid", fp8_recipe="mxfp8")) == Float8Config(format="hybrid", granularity="mxfp8")
    assert resolve(opts(), _ns(fp8="e4m3", fp8_recipe="delayed")) == Float8Config(
        strategy="delayed", amax_history_len=1, amax_compute_algo="most_recent")
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
    experts = tm.TurboMoEGroupedMLP(4, config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8="hybrid"))
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
                                             bias=False, skip_bias_add=False, is_expert=True, pg_collection=default_pg())
    assert fc.fp8_config == Float8Config(format="e4m3", granularity="tensorwise")
    x = torch.randn(7, config.hidden_size, dtype=torch.bfloat16)
    y, _ = fc(x, [3, 0, 4, 0])
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)


def test_bad_inputs_name_the_argument(world):
    config = make_config(num_moe_experts=3)
    experts = tm.TurboMoEGroupedMLP(3, config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=None))
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
        tm.TurboMoEGroupedMLP(3, unsupported, pg_collection=default_pg())


def test_megatron_blockwise_recipe_runs_te_power_of_two_scales(world, monkeypatch):
    """fp8_recipe="blockwise" (TE's Float8BlockScaling in Megatron, power-of-two block scales by
    default) resolves to blockwise with power-of-two scales, and the experts run that config through
    their fused SwiGLU and fine-grained autograd: within FP8 tolerance of float64, and not the bits
    that float32 block scales give. (Megatron's layers refuse config.fp8 without Transformer Engine,
    so the experts take the resolved config explicitly here.)"""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    resolved = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8="e4m3", fp8_recipe="blockwise"))
    assert resolved == Float8Config(format="e4m3", granularity="blockwise", power_of_two_scales=True)
    config = make_config(num_moe_experts=5)
    float32 = Float8Config(format="e4m3", granularity="blockwise")
    seq_layer, pow2_layer = experts_pair(config, fp8=resolved)
    _, float32_layer = experts_pair(config, fp8=float32)  # the same seed: the same weights
    assert pow2_layer.experts.linear_fc1.fp8_config == resolved
    assert float32_layer.experts.linear_fc1.fp8_config == float32
    tokens_per_expert = [9, 0, 17, 1, 6]
    x, tpe, probs = ragged_inputs(tokens_per_expert, config.hidden_size, seed=4)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    got = _experts_fwd_bwd(pow2_layer.experts, x, tpe, probs, grad)
    other = _experts_fwd_bwd(float32_layer.experts, x, tpe, probs, grad)
    assert not torch.equal(got[0], other[0]), "power-of-two and float32 block scales gave the same output"
    w1 = stacked(seq_layer.experts, "linear_fc1").double()
    w2 = stacked(seq_layer.experts, "linear_fc2").double()
    ref = expert_mlp_reference(x.double(), tokens_per_expert, probs.double(), w1, w2)
    assert 1e-4 < rel_err(got[0], ref) < FP8_FWD_TOL
