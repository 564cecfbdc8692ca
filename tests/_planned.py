"""Helpers of the planned-layer tests (CPU and GPU)."""

import shutil

import pytest
import torch

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
