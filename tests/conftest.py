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
