"""turbo_moe.megatron on CPU, weight gradients: gradient_accumulation_fusion into main_grad (alone and
under Megatron's own DDP) and delay_wgrad_compute (backward_dw), against the plain backward.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from _megatron_harness import (  # noqa: E402
    build_turbo_moe,
    make_config,
    randomize_,
)
from _megatron_cpu import (  # noqa: E402, F401 (world: a fixture)
    default_pg,
    ragged_inputs,
    world,
)

tm = pytest.importorskip("turbo_moe.megatron")


def _expert_grads(experts):
    return {n: getattr(experts, n).weight.grad.clone() for n in ("linear_fc1", "linear_fc2")}


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_gradient_accumulation_fusion_adds_into_main_grad(world, fp8):
    config = make_config(num_moe_experts=4)
    plain = tm.TurboMoEGroupedMLP(4, config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    randomize_(plain, seed=12)
    x, tpe, probs = ragged_inputs([6, 0, 9, 2], config.hidden_size, seed=13)
    plain(x, tpe, probs)[0].square().sum().backward()
    expected = _expert_grads(plain)

    fused_config = make_config(num_moe_experts=4)
    fused_config.gradient_accumulation_fusion = True  # Megatron's DDP provides main_grad
    fused = tm.TurboMoEGroupedMLP(4, fused_config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
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


@pytest.mark.parametrize("fp8", [None, "hybrid", "hybrid-delayed-scaling"])
def test_delayed_wgrad_matches_immediate(world, fp8):
    if fp8 == "hybrid-delayed-scaling":  # fp8_recipe="delayed": the deferred wgrad's dy was cast from its history
        from turbo_moe import Float8Config

        fp8 = Float8Config(format="hybrid", strategy="delayed", amax_history_len=2)
    config = make_config(num_moe_experts=4)
    now = tm.TurboMoEGroupedMLP(4, config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    randomize_(now, seed=14)
    x, tpe, probs = ragged_inputs([3, 10, 0, 5], config.hidden_size, seed=15)
    x_now = x.clone().requires_grad_()
    now(x_now, tpe, probs)[0].square().sum().backward()
    expected = _expert_grads(now)

    delayed_config = make_config(num_moe_experts=4)
    delayed_config.delay_wgrad_compute = True  # set after __post_init__ (needs EP comm overlap there)
    later = tm.TurboMoEGroupedMLP(4, delayed_config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
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


@pytest.mark.parametrize("fp8", [None, "hybrid", "hybrid-delayed-scaling"])
def test_delayed_wgrad_with_interleaved_micro_batches(world, fp8):
    """1F1B order with delayed wgrad: F1, F2, B1, backward_dw, B2, backward_dw. Each backward's
    wgrad is queued when that backward runs (not where its forward ran), so none is lost; the sum
    equals the immediate backward of both micro-batches. Under delayed scaling the amax histories
    see the same casts in the same order (x: F1, F2; dy: B1, B2) in both schedules."""
    if fp8 == "hybrid-delayed-scaling":
        from turbo_moe import Float8Config

        fp8 = Float8Config(format="hybrid", strategy="delayed", amax_history_len=2)
    config = make_config(num_moe_experts=4)
    now = tm.TurboMoEGroupedMLP(4, config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    randomize_(now, seed=16)
    batches = [ragged_inputs(lens, config.hidden_size, seed=17 + i) for i, lens in enumerate(([4, 0, 7, 3], [2, 6, 1, 0]))]
    for x, tpe, probs in batches:
        now(x, tpe, probs)[0].square().sum().backward()
    expected = _expert_grads(now)

    delayed_config = make_config(num_moe_experts=4)
    delayed_config.delay_wgrad_compute = True
    later = tm.TurboMoEGroupedMLP(4, delayed_config, pg_collection=default_pg(), options=tm.TurboMoEOptions(fp8=fp8))
    # the weights only: ``now``'s amax histories (its _extra_state) would scale ``later``'s first casts
    later.load_state_dict({k: v for k, v in now.state_dict().items() if "_extra_state" not in k})
    losses = [later(x, tpe, probs)[0].square().sum() for x, tpe, probs in batches]  # F1, F2
    losses[0].backward()  # B1
    from turbo_moe.autograd import DeferredWgrad

    queued = later.linear_fc1._pending_wgrads
    assert len(queued) == 1 and isinstance(queued[0], DeferredWgrad)
    # FP8: the FP8 copies backward made (half the bytes of x and dy), not the high-precision pair
    held = [a for a in queued[0]._run.args if isinstance(a, torch.Tensor) and a.dim() == 2 and a.is_floating_point()]
    fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert len(held) == 2 and all((t.dtype in fp8_dtypes) == (fp8 is not None) for t in held), [t.dtype for t in held]
    later.backward_dw()
    losses[1].backward()  # B2, after a backward_dw that came after its forward
    later.backward_dw()
    for n in ("linear_fc1", "linear_fc2"):
        torch.testing.assert_close(getattr(later, n).weight.grad, expected[n], rtol=1e-5, atol=1e-5)
