"""Argument checks for the public API. Every error names the argument it is about.

What is checked where (no check may add a host sync on a GPU, or CUDA-graph capture breaks):

* shapes, dtypes, devices, contiguity: always, on the host (metadata only);
* the *values* of ``group_lens`` / ``group_offs`` (non-negative, summing to ``M``):
  - CPU tensors: on the host, raising ``ValueError``;
  - GPU tensors: on the device with ``torch._assert_async`` (a device-side assert: the error
    surfaces at the next synchronization and leaves the CUDA context unusable, as every device
    assert does). Before the kernels see them, the offsets are clamped into ``[0, M]`` and made
    non-decreasing, so a bad routing can never make a kernel read or write out of bounds.
    Set ``TURBO_MOE_SYNC_CHECKS=1`` to check on the host instead (a sync per call, a clean
    ``ValueError``; not capturable).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

__all__ = ["HIGH_PRECISION_DTYPES", "check_operands", "resolve_group_offs"]

HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _sync_checks() -> bool:
    return os.environ.get("TURBO_MOE_SYNC_CHECKS", "0") not in ("", "0")


def check_operands(x: torch.Tensor, w: torch.Tensor, trans_b: bool) -> Tuple[int, int, int, int]:
    """Validate x [M, K] and w ([G, N, K] if trans_b else [G, K, N]); return (G, M, N, K)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32 (it is quantized to FP8 here), got {x.dtype}")
    if w.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"w must be bfloat16, float16 or float32 (it is quantized to FP8 here), got {w.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, in_features], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        layout = "[G, N, K]" if trans_b else "[G, K, N]"
        raise ValueError(f"w must be 3-D {layout} (trans_b={trans_b}), got shape {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"x and w must be on the same device, got x on {x.device} and w on {w.device}")
    num_groups = w.shape[0]
    if num_groups == 0:
        raise ValueError("w has 0 groups (w.shape[0] == 0); a grouped GEMM needs at least one group")
    n, k = (w.shape[1], w.shape[2]) if trans_b else (w.shape[2], w.shape[1])
    if x.shape[1] != k:
        raise ValueError(
            f"x.shape[1]={x.shape[1]} does not match w's contraction dim {k} "
            f"(w.shape={tuple(w.shape)}, trans_b={trans_b})"
        )
    return num_groups, x.shape[0], n, k


def resolve_group_offs(
    group_lens: Optional[torch.Tensor],
    group_offs: Optional[torch.Tensor],
    num_groups: int,
    num_rows: int,
    device: torch.device,
) -> torch.Tensor:
    """Return int64 ``[G+1]`` device offsets from either ``group_lens`` or ``group_offs``."""
    if (group_lens is None) == (group_offs is None):
        raise ValueError("pass exactly one of group_lens and group_offs")
    name, t = ("group_lens", group_lens) if group_lens is not None else ("group_offs", group_offs)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor on the data's device, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 (or int32), got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    expected = num_groups if name == "group_lens" else num_groups + 1
    if t.shape[0] != expected:
        raise ValueError(f"len({name})={t.shape[0]} but w has {num_groups} groups (expected {expected})")
    if t.device != device:
        raise ValueError(f"{name} must be on the data's device {device}, got {t.device}")
    if device.type != "cpu" and not _sync_checks():
        kernel = _offsets_kernel(t)
        if kernel is not None:  # one launch: prefix sum, device asserts, clamp (the path below in one)
            return kernel.resolve_group_offs(t, num_rows, from_lens=name == "group_lens")
    t = t.to(torch.int64)
    if name == "group_lens":
        offs = torch.cat([t.new_zeros(1), torch.cumsum(t, 0)])
    else:
        offs = t

    if device.type == "cpu" or _sync_checks():
        _check_on_host(name, t, offs, num_rows)
        return offs
    if name == "group_lens":
        torch._assert_async(torch.all(t >= 0), "turbo_moe: group_lens has a negative entry")
    else:
        torch._assert_async(torch.all(offs[1:] >= offs[:-1]), "turbo_moe: group_offs is decreasing")
        torch._assert_async(offs[0] == 0, "turbo_moe: group_offs[0] != 0")
    torch._assert_async(offs[-1] == num_rows, "turbo_moe: group sizes do not sum to x.shape[0]")
    # Keep every kernel in bounds whatever the routing says (see the module doc).
    return torch.cummax(offs.clamp(0, num_rows), 0).values


_offsets_module = None  # turbo_moe.kernels.triton.group_offsets once imported; False without triton


def _offsets_kernel(t: torch.Tensor):
    """The one-launch offsets kernel for CUDA tensors, or None (no triton, too many groups)."""
    global _offsets_module
    if not t.is_cuda:
        return None
    if _offsets_module is None:
        try:
            from turbo_moe.kernels.triton import group_offsets
        except ImportError:
            group_offsets = False
        _offsets_module = group_offsets
    if not _offsets_module or t.shape[0] > _offsets_module.MAX_GROUPS:
        return None
    return _offsets_module


def _check_on_host(name: str, t: torch.Tensor, offs: torch.Tensor, num_rows: int) -> None:
    values = t.tolist()
    if name == "group_lens":
        negative = [i for i, v in enumerate(values) if v < 0]
        if negative:
            raise ValueError(f"group_lens has negative entries at groups {negative[:8]}: {values[:16]}")
        total = sum(values)
        if total != num_rows:
            raise ValueError(f"group_lens sums to {total} but x has {num_rows} rows (x.shape[0])")
    else:
        if values[0] != 0:
            raise ValueError(f"group_offs[0] must be 0, got {values[0]}")
        bad = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
        if bad:
            raise ValueError(f"group_offs must be non-decreasing; it decreases at index {bad[0]}")
        if values[-1] != num_rows:
            raise ValueError(f"group_offs[-1]={values[-1]} but x has {num_rows} rows (x.shape[0])")
