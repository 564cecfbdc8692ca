"""turbo_moe.megatron on CPU: when ``TurboMoEOptions.cache_fp8_weight`` keeps an expert weight's
FP8 copies across micro-batches, counted through ``turbo_moe.autograd.quantize_weight``, and that a
cached copy is never stale (outputs bit-equal to a layer that quantizes in every forward)."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import turbo_moe.autograd as autograd  # noqa: E402

from _megatron_harness import make_config  # noqa: E402
from _megatron_cpu import default_pg, ragged_inputs, world  # noqa: E402, F401 (world: a fixture)

tm = pytest.importorskip("turbo_moe.megatron")
main_grad_mod = pytest.importorskip("turbo_moe.megatron.main_grad")

TOKENS = [3, 5, 0, 4]
MICRO_BATCHES = 4


@pytest.fixture
def quantizations(monkeypatch):
    """Quantizations of each weight (keyed by its data_ptr), cached or inside the GEMM call."""
    counts = collections.Counter()
    real = autograd.quantize_weight

    def counting(w_nk, *args, **kwargs):
        counts[w_nk.data_ptr()] += 1
        return real(w_nk, *args, **kwargs)

    monkeypatch.setattr(autograd, "quantize_weight", counting)
    # A process-wide flag: another test in this worker may have installed the step hook.
    monkeypatch.setattr(main_grad_mod, "_step_hook_installed", [False])
    return counts


def _linear(cache, config=None, ddp=False):
    config = config or make_config(num_moe_experts=len(TOKENS))
    layer = tm.TurboColumnParallelGroupedLinear(
        len(TOKENS), config.hidden_size, 24, config=config, init_method=torch.nn.init.normal_, bias=False,
        skip_bias_add=False, is_expert=True, pg_collection=default_pg(),
        options=tm.TurboMoEOptions(fp8="e4m3", backend="torch", cache_fp8_weight=cache))
    if ddp:  # what Megatron's DistributedDataParallel gives its parameters
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    return layer


class _Checked:
    """``layer`` beside a twin that quantizes in every forward: each forward is compared bit for bit."""

    def __init__(self, layer, quantizations):
        self.layer, self.quantizations = layer, quantizations
        self.fresh = _linear(False, config=layer.config)

    def forward(self, seed):
        x, tpe, _ = ragged_inputs(TOKENS, self.layer.in_features, seed=seed)
        with torch.no_grad():
            self.fresh.weight.copy_(self.layer.weight)
        y, _ = self.layer(x.requires_grad_(), tpe)
        assert torch.equal(y, self.fresh(x, tpe)[0]), "a stale FP8 weight was used"

    def count(self):
        return self.quantizations[self.layer.weight.data_ptr()]


def test_default_is_auto_and_bad_values_raise():
    assert tm.TurboMoEOptions().cache_fp8_weight == "auto"
    for helper in (tm.get_turbo_moe_experts_spec, tm.get_turbo_moe_module_spec, tm.use_turbo_moe_experts):
        assert inspect.signature(helper).parameters["cache_fp8_weight"].default == "auto"
    for bad in ("yes", "AUTO", 1, 0, None):
        with pytest.raises(ValueError, match="cache_fp8_weight"):
            tm.TurboMoEOptions(cache_fp8_weight=bad)


def test_auto_caches_a_plain_parameter_by_its_version(world, quantizations):
    """No main_grad: torch optimizers update it in place, which bumps its version counter."""
    run = _Checked(_linear("auto"), quantizations)
    for mb in range(MICRO_BATCHES):
        run.forward(seed=mb)
    assert run.count() == 1
    with torch.no_grad():
        run.layer.weight.add_(1e-3)
    run.forward(seed=10)
    assert run.count() == 2


def test_auto_quantizes_every_forward_for_an_undriven_ddp_parameter(world, quantizations):
    """main_grad, no step hook, no schedule driving is_first_microbatch: nothing would see an
    update written through DDP's buffers, so nothing is kept."""
    run = _Checked(_linear("auto", ddp=True), quantizations)
    for mb in range(MICRO_BATCHES):
        run.forward(seed=mb)
    assert run.count() == MICRO_BATCHES
    run.layer.weight.data.copy_(run.layer.weight * 1.5)  # as Megatron's optimizer writes it: no version bump
    run.forward(seed=10)
    assert run.count() == MICRO_BATCHES + 1
    assert run.layer._fp8_weight_cache is None  # no memory held for a cache it cannot use


def test_auto_follows_megatrons_first_microbatch_signal(world, quantizations):
    """Megatron's schedules call set_is_first_microbatch() before micro-batch 0 of every step.
    Step 0: the layer has not yet seen the flag driven, so it quantizes every micro-batch (4); from
    step 1 on, once per step, through updates the version counter does not see."""
    from megatron.core.transformer.module import MegatronModule

    class Model(MegatronModule):
        def __init__(self, config, experts):
            super().__init__(config)
            self.experts = experts

    config = make_config(num_moe_experts=len(TOKENS))
    config.fp8 = "e4m3"  # Megatron drives the flag only under a quantized config
    model = Model(config, _linear("auto", ddp=True))
    run = _Checked(model.experts, quantizations)
    counts = []
    for step in range(3):
        model.set_is_first_microbatch()
        for mb in range(MICRO_BATCHES):
            run.forward(seed=10 * step + mb)
        counts.append(run.count() - sum(counts))
        run.layer.weight.data.copy_(run.layer.weight * 0.9 + 0.01)  # the optimizer step
    assert counts == [MICRO_BATCHES, 1, 1]


def test_auto_trusts_the_step_hook_for_a_ddp_parameter(world, quantizations, monkeypatch):
    monkeypatch.setattr(main_grad_mod, "_step_hook_installed", [True])
    run = _Checked(_linear("auto", ddp=True), quantizations)
    for mb in range(MICRO_BATCHES):
        run.forward(seed=mb)
    assert run.count() == 1
    run.layer.weight.data.copy_(run.layer.weight * 1.5)
    tm.invalidate_fp8_weight_caches()  # what the wrapped optimizer.step does
    run.forward(seed=10)
    assert run.count() == 2


def test_auto_never_caches_under_disable_parameter_transpose_cache(world, quantizations):
    config = make_config(num_moe_experts=len(TOKENS), disable_parameter_transpose_cache=True)
    run = _Checked(_linear("auto", config=config), quantizations)
    for mb in range(MICRO_BATCHES):
        run.layer.is_first_microbatch = mb == 0  # even when driven
        run.forward(seed=mb)
    assert run.count() == MICRO_BATCHES


def test_true_and_false_keep_their_behaviour(world, quantizations):
    cached, plain = _Checked(_linear(True), quantizations), _Checked(_linear(False), quantizations)
    for mb in range(MICRO_BATCHES):
        plain.layer.is_first_microbatch = cached.layer.is_first_microbatch = mb == 0  # both ignore it
        cached.forward(seed=mb)
        plain.forward(seed=mb)
    assert (cached.count(), plain.count()) == (1, MICRO_BATCHES)
    x, tpe, _ = ragged_inputs(TOKENS, 40)
    with pytest.raises(RuntimeError, match="invalidate_fp8_weight_cache_on_step"):
        _linear(True, ddp=True)(x, tpe)


def test_auto_does_not_trust_the_version_counter_across_processes(world, quantizations, monkeypatch):
    """With several processes a parameter without main_grad may still be refilled behind its
    version counter (torch FSDP2's all-gather, ZeRO-style flat buffers): "auto" then keeps
    nothing unless Megatron's micro-batch flag or the step hook says when the weights change."""
    run = _Checked(_linear("auto"), quantizations)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args, **kwargs: 2)
    for mb in range(MICRO_BATCHES):
        run.forward(seed=mb)
    assert run.count() == MICRO_BATCHES
    assert run.layer._fp8_weight_cache is None
