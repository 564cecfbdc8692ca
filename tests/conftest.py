"""Shared test configuration.

Tests marked ``gpu`` need a CUDA/ROCm device and are skipped, with the reason, where none is
present (the CPU CI); ``scripts/gpu_check.sh`` runs them on the lent GPU. Tests marked
``multigpu`` need two devices (skipped with fewer); ``scripts/ep_check.sh`` runs them.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none visible to torch)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA/ROCm GPUs ({gpus} visible to torch)")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _fresh_dispatch_decisions():
    """Dispatch decisions are cached per problem signature; tests that fake a device or flip an
    environment switch must not see a decision cached by an earlier test."""
    from turbo_moe.backends import clear_dispatch_cache

    clear_dispatch_cache()
    yield


@pytest.fixture(scope="module")
def plan_ext():
    """The host-plan extension (turbo_moe/csrc/launch_plan.cpp) for CPU checks whose plans launch
    nothing (tests/test_planned_*.py)."""
    from turbo_moe import host_plan

    if torch.cuda.is_available():
        pytest.skip("a CPU-only check: its plans launch nothing")
    extension = host_plan._extension()
    if extension is None:
        pytest.skip(host_plan.status())
    return extension
