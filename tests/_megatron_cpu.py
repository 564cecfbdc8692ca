"""Shared by the CPU Megatron tests (test_megatron*.py): the one-process Megatron world as a pytest
fixture, the FP8 tolerances, and input and model-pair builders. Model builders and the world
itself are in _megatron_harness.py (shared with the GPU tests)."""

from __future__ import annotations

import pytest
import torch

from _megatron_harness import build_sequential_moe, build_turbo_moe, copy_sequential_into_turbo, megatron_world, randomize_

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


def ragged_inputs(tokens_per_expert, hidden, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    m = sum(tokens_per_expert)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    probs = torch.rand(m, generator=gen).to(dtype) * 0.9 + 0.1
    return x, torch.tensor(tokens_per_expert, dtype=torch.int64), probs


def experts_pair(config, seed=1, **options):
    """Megatron's MoELayer with SequentialMLP experts and ours, ours holding a copy of the same fresh
    weights (drawn from ``seed``)."""
    seq_layer = build_sequential_moe(config)
    randomize_(seq_layer, seed=seed)
    turbo_layer = build_turbo_moe(config, **options)
    copy_sequential_into_turbo(seq_layer, turbo_layer)
    return seq_layer, turbo_layer


def stacked(experts, name, attr="weight"):
    return torch.stack([getattr(getattr(e, name), attr).detach() for e in experts.local_experts])


def needs_psutil():
    # Megatron's distributed-checkpoint writer imports psutil to log memory (not a declared dep).
    pytest.importorskip("psutil", reason="Megatron's dist-checkpoint writer needs psutil (pip install psutil)")


def default_pg():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()
