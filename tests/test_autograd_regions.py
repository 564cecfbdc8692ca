"""Which host-plan regions an FP8 GEMM's backward goes through (``turbo_moe.autograd``).

The whole backward is one region only where nothing must be freed between dgrad and wgrad: W^T's
FP8 copy belongs to the weight cache, or there is no dgrad. Without the cache, W^T is dgrad's alone
and must be freed before wgrad allocates dW -- a replay allocates everything before its one C++
call, so a single region would hold W^T beside dW (G*N*K bytes more at the step's peak). The
routing is plain Python, the same on every device, so it is checked here on the CPU, where
``through_plan`` runs each region's function directly."""

import pytest
import torch

import turbo_moe
from turbo_moe import autograd as fp8_autograd

_THROUGH_PLAN = fp8_autograd.through_plan


def _spy_regions(monkeypatch) -> list:
    """The names of the regions ``through_plan`` is called with, from now on, in order."""
    names = []

    def spy(region, *args, **kwargs):
        names.append(region.name)
        return _THROUGH_PLAN(region, *args, **kwargs)

    monkeypatch.setattr(fp8_autograd, "through_plan", spy)
    return names


def _regions_of_one_step(cache: bool, x_grad: bool, monkeypatch):
    names = _spy_regions(monkeypatch)
    torch.manual_seed(0)
    g, t, n, k = 3, 40, 48, 64
    layer = turbo_moe.GroupedLinearFP8(g, k, n, cache_fp8_weight=cache)
    x = torch.randn(g * t, k, requires_grad=x_grad)
    lens = torch.tensor([t + 8, 0, 2 * t - 8])
    y = layer(x, lens)
    dy = torch.randn_like(y)
    y.backward(dy)
    return names, (x.grad if x_grad else None), layer.weight.grad


@pytest.mark.parametrize("cache, x_grad, expected", [
    (True, True, ["fp8 gemm forward", "fp8 gemm dgrad + wgrad"]),
    (False, True, ["fp8 gemm forward", "fp8 gemm dgrad", "fp8 gemm wgrad"]),
    (False, False, ["fp8 gemm forward", "fp8 gemm dgrad + wgrad"]),  # no dgrad: no W^T to free
    (True, False, ["fp8 gemm forward", "fp8 gemm dgrad + wgrad"]),
])
def test_backward_is_one_region_only_where_nothing_is_freed_in_between(cache, x_grad, expected, monkeypatch):
    names, _, _ = _regions_of_one_step(cache, x_grad, monkeypatch)
    assert names == expected


def test_fused_and_split_backward_give_the_same_bits(monkeypatch):
    """The cached layer (one backward region) and the uncached one (two) compute dx and dW alike."""
    split_names, split_dx, split_dw = _regions_of_one_step(False, True, monkeypatch)
    fused_names, fused_dx, fused_dw = _regions_of_one_step(True, True, monkeypatch)
    assert "fp8 gemm dgrad + wgrad" in fused_names and "fp8 gemm dgrad + wgrad" not in split_names
    assert torch.equal(split_dx.view(torch.int16), fused_dx.view(torch.int16))
    assert torch.equal(split_dw.view(torch.int16), fused_dw.view(torch.int16))


def test_deferred_wgrad_keeps_the_split_path(monkeypatch):
    """A deferred wgrad (``WgradTarget(defer=...)``: Megatron's delay_wgrad_compute) runs dgrad now
    and hands the wgrad over: the backward cannot be one region, even with the weight cached."""
    names, handed = _spy_regions(monkeypatch), []
    torch.manual_seed(0)
    g, t, n, k = 2, 32, 48, 64
    layer = turbo_moe.GroupedLinearFP8(g, k, n, cache_fp8_weight=True)
    x = torch.randn(g * t, k, requires_grad=True)
    offs = torch.tensor([0, t, 2 * t])
    target = fp8_autograd.WgradTarget(defer=handed.append)
    y = fp8_autograd._grouped_gemm_fp8_resolved(x, layer.weight, offs, w_fp8=layer._cached_fp8_weight(),
                                                wgrad_target=target)
    y.backward(torch.randn_like(y))
    assert names == ["fp8 gemm forward", "fp8 gemm dgrad"] and len(handed) == 1
    assert handed[0].compute(torch.float32).shape == layer.weight.shape
