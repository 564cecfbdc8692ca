"""Lazy access to the Triton kernel modules, so that importing turbo_moe needs torch alone."""

from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def triton_kernels(name: str):
    """``turbo_moe.kernels.triton.<name>``, imported on first use; None when triton is missing."""
    try:
        return importlib.import_module(f"turbo_moe.kernels.triton.{name}")
    except ImportError:
        return None
