"""Shared test configuration.

Tests marked ``gpu`` need a CUDA/ROCm device and are skipped, with the reason, where none is
present (the CPU CI); ``scripts/gpu_check.sh`` runs them on the lent GPU.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none visible to torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dispatch_decisions():
    """Dispatch decisions are cached per problem signature; tests that fake a device or flip an
    environment switch must not see a decision cached by an earlier test."""
    from turbo_moe.backends import clear_dispatch_cache

    clear_dispatch_cache()
    yield
