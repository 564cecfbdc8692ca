"""Helpers of the planned-layer tests (CPU and GPU)."""

import contextlib
import shutil

import pytest
import torch

from turbo_moe import host_plan, planned_layer

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler")


def assert_bitwise(a, b, what):
    """Both None, or the same shape, dtype and bytes."""
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def ragged_lens(G, M, seed):
    """``G`` random group sizes summing to ``M`` on the GPU, group 1 empty."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, M + 1, (G - 1,), generator=g)).values
    lens = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([M])]))
    lens[0] += lens[1]  # an empty expert every call
    lens[1] = 0
    return lens.cuda()


@contextlib.contextmanager
def planned_layers(flag: bool):
    """Host plans on, fresh, and planned layers (and MLPs) on or off inside the block."""
    previous = planned_layer.set_enabled(flag), host_plan.set_enabled(True)
    host_plan.clear_all()
    try:
        yield
    finally:
        planned_layer.set_enabled(previous[0])
        host_plan.set_enabled(previous[1])


def compare_planned(run, names, **kwargs):
    """``run(planned, **kwargs)`` -- a list of ``(outputs, used)``, one per call -- with planned
    layers off, then on: every output bitwise equal, none planned on the first run. Returns
    whether each call of the second ran as a planned node."""
    reference = run(False, **kwargs)
    got = run(True, **kwargs)
    if host_plan.status() != "on":
        pytest.skip(f"host plans unavailable here: {host_plan.status()}")
    for i, ((a, used_a), (b, _)) in enumerate(zip(reference, got)):
        assert not used_a
        for what, ta, tb in zip(names, a, b):
            assert_bitwise(ta, tb, f"call {i}: {what}")
    return [used for _, used in got]


class LaunchlessPlans:
    """A region whose n-th lookup gets the n-th of its launch-less plans (allocations only, zero
    filled); records the keys asked for."""

    def __init__(self, ext, *plans):
        self.plans, self.keys = [], []
        for positions, allocs, outputs in plans:
            error, plan_id = ext.add_plan(len(positions) + len(allocs), [])
            assert error == ""
            strides = [planned_layer._contiguous_strides(shape) for shape, _ in allocs]
            specs = [(list(shape), list(stride), torch.empty(0, dtype=dtype), True, [], [])
                     for (shape, dtype), stride in zip(allocs, strides)]
            assert ext.set_allocs(plan_id, specs) == ""
            assert ext.set_outputs(plan_id, [host_plan._cpp_output_spec(o, positions) for o in outputs]) == ""
            allocs_t = tuple((shape, stride, dtype, True, (), ()) for (shape, dtype), stride in zip(allocs, strides))
            self.plans.append(host_plan._Plan(plan_id, positions, allocs_t, tuple(outputs), ext))

    def plan_for(self, key):
        self.keys.append(key)
        return self.plans[(len(self.keys) - 1) % len(self.plans)]

    def refused(self, key):
        return False


def mlp_python_backward_case(G, M, hidden, F, config):
    """What the MLP Python-backward tests start from (CPU, torch backend, seeded): ``(mlp, x, probs,
    offs with group 1 empty, dy, W1, W2)``."""
    from turbo_moe.mlp import GroupedSwiGLUMLPFP8

    torch.manual_seed(0)
    mlp = GroupedSwiGLUMLPFP8(G, hidden, F, config=config, backend="torch", dtype=torch.bfloat16,
                              cache_fp8_weight=False)
    x = torch.randn(M, hidden, dtype=torch.bfloat16)
    probs = torch.rand(M)
    offs = torch.tensor([0, 7, 7, M])
    dy = torch.randn(M, hidden, dtype=torch.bfloat16)
    return mlp, x, probs, offs, dy, mlp.fc1.weight.detach(), mlp.fc2.weight.detach()


def assert_mlp_grads_equal_the_module(table_module, grads, table, main, mlp, x, probs, offs, dy):
    """A planned MLP's Python backward (``grads`` per argument, ``table`` after it; ``main``: the
    ``main_grad`` buffers' values before, or None) against ``mlp``'s Python Functions on the same
    inputs: x's and the routing weights' gradients and dW bit for bit, or dW added into main_grad.
    ``table_module``: the planner whose value indices the table uses (``X``, ``W1``, ...)."""
    m = table_module
    x_ref, p_ref = x.clone().requires_grad_(), probs.clone().requires_grad_()
    mlp(x_ref, group_offs=offs, probs=p_ref).backward(dy)
    expected = {m.X: x_ref.grad, m.PROBS: p_ref.grad}
    if main is not None:
        assert grads[m.W1] is None and grads[m.W2] is None
        expected_main = (main[0] + mlp.fc1.weight.grad.float(), main[1] + mlp.fc2.weight.grad.float())
        # Accumulated in float32 from the same GEMM (the reference's dW rounded to bf16 first).
        for got, want in zip((table[m.MAIN_GRAD1], table[m.MAIN_GRAD2]), expected_main):
            assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)
    else:
        expected.update({m.W1: mlp.fc1.weight.grad, m.W2: mlp.fc2.weight.grad})
    for v, want in expected.items():
        assert_bitwise(grads[v].reshape(-1), want.reshape(-1), v)
    assert all(g is None for k, g in enumerate(grads) if k not in (m.X, m.W1, m.W2, m.PROBS))
