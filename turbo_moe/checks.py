"""Argument checks for the public API. Every error names the argument it is about.

What is checked where (no check may add a host sync on a GPU, or CUDA-graph capture breaks):

* shapes, dtypes, devices, contiguity: always, on the host (metadata only);
* the *values* of ``group_lens`` / ``group_offs`` (non-negative, summing to ``M``):
  - CPU tensors: on the host, raising ``ValueError``;
  - GPU tensors: on the device, by the device asserts of the one-launch offsets kernel
    (``kernels/triton/group_offsets.py``; ``torch._assert_async`` when triton is missing): the
    error surfaces at the next synchronization and leaves the CUDA context unusable, as every
    device assert does. Before the kernels see them, the offsets are clamped into ``[0, M]`` and made
    non-decreasing, so a bad routing can never make a kernel read or write out of bounds.
    Set ``TURBO_MOE_SYNC_CHECKS=1`` to check on the host instead (a sync per call, a clean
    ``ValueError``; not capturable);
  - meta tensors: no values, nothing to check (shape inference).

``check_group_offs`` is the offsets' check for every entry that takes offsets
(``resolve_group_offs``, ``grouped_gemm_fp8_with_offs``, ``grouped_wgrad_fp8``). Offsets it (or
``resolve_group_offs``) returned are remembered by identity and version: handed back unchanged
for the same ``M`` (a Megatron expert MLP resolves its routing once and gives the offsets to fc1,
fc2 and the bias), they are returned at once instead of checked and clamped again (one launch and
one allocation each); any in-place change bumps their version and they are checked again
(writes through ``.data``, which bypass the version counter, are not seen: don't edit offsets
that way between calls).
"""

from __future__ import annotations

import os
import weakref
from typing import Dict, Optional, Tuple

import torch

from . import host_plan
from ._triton_kernels import triton_kernels

__all__ = ["HIGH_PRECISION_DTYPES", "check_operands", "check_wgrad_operands", "check_group_offs", "resolve_group_offs"]

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


def check_wgrad_operands(dy: torch.Tensor, x: torch.Tensor) -> None:
    """Validate the wgrad GEMM's dy [M, N] and x [M, K] (``grouped_wgrad_fp8``)."""
    for name, t in (("dy", dy), ("x", x)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32 (it is quantized to FP8 here), got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(t.shape)}")
    if dy.device != x.device:
        raise ValueError(f"dy and x must be on the same device, got dy on {dy.device} and x on {x.device}")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy.shape[0]={dy.shape[0]} and x.shape[0]={x.shape[0]} must match (tokens)")


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
    if group_offs is not None:
        return check_group_offs(group_offs, num_groups, num_rows, device)
    name = "group_lens"
    _check_index_tensor(name, group_lens, num_groups, device, f"w has {num_groups} groups")
    kernel = _offsets_kernel(group_lens)
    if kernel is not None:  # one launch: prefix sum, device asserts, clamp (the torch path below in one)
        return _remember(_offsets_from_kernel(kernel, group_lens, num_rows, True), num_rows)
    t = group_lens.to(torch.int64)
    offs = torch.cat([t.new_zeros(1), torch.cumsum(t, 0)])
    if device.type == "meta":
        return offs

    if device.type == "cpu" or _sync_checks():
        _check_on_host(name, t, offs, num_rows)
        return _remember(offs, num_rows)
    torch._assert_async(torch.all(t >= 0), "turbo_moe: group_lens has a negative entry")
    return _remember(_assert_total_and_clamp(offs, num_rows), num_rows)


def check_group_offs(
    offs: torch.Tensor,
    num_groups: Optional[int],
    num_rows: int,
    device: torch.device,
    name: str = "group_offs",
) -> torch.Tensor:
    """Check offsets ``[G+1]`` (0, non-decreasing, ending at ``num_rows``) as the module doc says;
    return them as int64, on a GPU clamped so that no kernel can leave ``[0, num_rows)``.
    ``num_groups`` None: any G >= 1 (the offsets define it)."""
    what = f"w has {num_groups} groups" if num_groups is not None else ""
    _check_index_tensor(name, offs, None if num_groups is None else num_groups + 1, device, what)
    if _already_checked(offs, num_rows):
        return offs
    kernel = _offsets_kernel(offs)
    if kernel is not None:
        return _remember(_offsets_from_kernel(kernel, offs, num_rows, False), num_rows)
    offs = offs.to(torch.int64)
    if device.type == "meta":
        return offs  # shape inference only: no values to check
    if device.type == "cpu" or _sync_checks():
        _check_on_host(name, offs, offs, num_rows)
        return _remember(offs, num_rows)
    torch._assert_async(torch.all(offs[1:] >= offs[:-1]), f"turbo_moe: {name} is decreasing")
    torch._assert_async(offs[0] == 0, f"turbo_moe: {name}[0] != 0")
    return _remember(_assert_total_and_clamp(offs, num_rows), num_rows)


# id(offsets) -> (weak reference, version, M) of the int64 offsets this module returned (module doc).
_checked: Dict[int, Tuple[weakref.ref, int, int]] = {}


def _remember(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Record ``offs`` (checked and clamped for ``num_rows`` rows) and return it."""
    if offs.dtype == torch.int64 and not offs.is_inference():  # inference tensors have no version
        key = id(offs)
        # The callback runs when offs is freed, before its id can name another tensor.
        _checked[key] = (weakref.ref(offs, lambda _, key=key: _checked.pop(key, None)), offs._version, num_rows)
    return offs


def _already_checked(offs: torch.Tensor, num_rows: int) -> bool:
    entry = _checked.get(id(offs))
    # A live entry is for this very tensor, never an inference one (those are not remembered).
    return entry is not None and entry[0]() is offs and entry[2] == num_rows and entry[1] == offs._version


def _offsets_kernel(t: torch.Tensor):
    """The one-launch offsets kernel for CUDA tensors checked on the device, or None (CPU, meta,
    TURBO_MOE_SYNC_CHECKS, no triton, more groups than one program holds)."""
    if not t.is_cuda or _sync_checks():
        return None
    module = triton_kernels("group_offsets")
    if module is None or t.shape[0] > module.MAX_GROUPS:
        return None
    return module


# The offsets kernel's launch as a host-plan region: replayed from C++ like the GEMM's regions,
# and a step of a planned layer (turbo_moe.planned_layer) when group_lens come with the call.
OFFSETS_REGION = host_plan.Region("group offsets")


def offsets_region_key(num_rows: int, from_lens: bool) -> tuple:
    return ("group offsets", num_rows, from_lens)  # M is a kernel argument (and specializes it)


def _offsets_from_kernel(kernel, src: torch.Tensor, num_rows: int, from_lens: bool) -> torch.Tensor:
    (offs,) = OFFSETS_REGION(offsets_region_key(num_rows, from_lens), (src,),
                             lambda: (kernel.resolve_group_offs(src, num_rows, from_lens=from_lens),), pure=True)
    return offs


def _assert_total_and_clamp(offs: torch.Tensor, num_rows: int) -> torch.Tensor:
    torch._assert_async(offs[-1] == num_rows, "turbo_moe: group sizes do not sum to x.shape[0]")
    # Keep every kernel in bounds whatever the routing says (see the module doc).
    return torch.cummax(offs.clamp(0, num_rows), 0).values


def _check_index_tensor(name: str, t, expected_len: Optional[int], device: torch.device, what: str) -> None:
    """Metadata of group_lens / group_offs: an int64/int32 1-D tensor of the expected length on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor on the data's device, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 (or int32), got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if expected_len is None:
        if t.shape[0] < 2:
            raise ValueError(f"len({name})={t.shape[0]}: offsets of at least one group need 2 entries [0, M]")
    elif t.shape[0] != expected_len:
        raise ValueError(f"len({name})={t.shape[0]} but {what} (expected {expected_len})")
    if not _same_device(t.device, device):
        raise ValueError(f"{name} must be on the data's device {device}, got {t.device}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` (no index: the current device) and ``cuda:0`` name one device when 0 is current."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else None
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


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
            raise ValueError(f"{name}[0] must be 0, got {values[0]}")
        bad = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
        if bad:
            raise ValueError(f"{name} must be non-decreasing; it decreases at index {bad[0]}")
        if values[-1] != num_rows:
            raise ValueError(f"{name}[-1]={values[-1]} but x has {num_rows} rows (x.shape[0])")
