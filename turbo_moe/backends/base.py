"""The seam between the autograd layer and the kernels.

Every backend computes the same two kernel-level problems on FP8 operands; the autograd layer
(``turbo_moe.autograd``) decides which operands and which layouts to hand in, and a backend knows
nothing of autograd.

``M_GROUPED`` (the NT forward and the NN dgrad)::

    out[offs[g]:offs[g+1], :] = (a[offs[g]:offs[g+1], :] @ b[g].T) * a_scale * b_scale[g]
    a: [M, K]   b: [G, N, K]   out: [M, N]

    forward: a = x_fp8 [M, K],  b = W_fp8 [G, N, K]           -> y  [M, N]
    dgrad:   a = dy_fp8 [M, N], b = W_fp8^T [G, K, N] (K-major) -> dx [M, K]

``K_GROUPED`` (the variable-K TN wgrad; the contraction runs over the tokens of each group)::

    out[g] = (a[:, offs[g]:offs[g+1]] @ b[:, offs[g]:offs[g+1]].T) * a_scale * b_scale
    a: [N, M]   b: [K, M]   out: [G, N, K]      (a = dy_fp8^T, b = x_fp8^T; token-contiguous)

    A group with no tokens gets an exactly zero out[g].

Operands may have any strides (the kernels take strides); the layouts above, contiguous along the
contracted dimension, are the fast ones because Hopper's FP8 wgmma and gfx950's FP8 MFMA want both
operands K-major. Scales are float32 on the operands' device:

* tensorwise: ``a_scale`` and ``b_scale`` are 0-dim tensors;
* rowwise (per output row / column): M_GROUPED ``a_scale`` is ``[M]`` and ``b_scale`` ``[G, N]``;
  K_GROUPED ``a_scale`` is ``[G, N]`` and ``b_scale`` ``[G, K]``.

The scales are *dequantization* factors (multiply the FP8 product by them). ``group_offs`` is an
int64 ``[G+1]`` tensor on the operands' device, ``offs[0] == 0``, non-decreasing, ``offs[G] == M``;
kernels read it on the device only, so the call is capturable in a CUDA/HIP graph.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["GemmKind", "GroupedGemmProblem", "GroupedGemmBackend", "BackendUnavailable"]


class GemmKind(str, enum.Enum):
    M_GROUPED = "m_grouped"
    K_GROUPED = "k_grouped"


class BackendUnavailable(RuntimeError):
    """A backend was named explicitly but cannot run this call; the message says why."""


@dataclass
class GroupedGemmProblem:
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor
    group_offs: torch.Tensor
    out_dtype: torch.dtype
    num_cu: Optional[int] = None
    # What the call is for ("fwd", "dgrad", "wgrad"): for logs and per-op tuning only.
    role: str = ""
    out: Optional[torch.Tensor] = None      # write the result into this tensor (shape out_shape)
    accumulate: bool = False                # K_GROUPED only: out += result (out must be float32)

    @property
    def num_groups(self) -> int:
        return self.group_offs.shape[0] - 1

    @property
    def rowwise(self) -> bool:
        return self.a_scale.dim() > 0 or self.b_scale.dim() > 0

    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.kind is GemmKind.M_GROUPED:
            return (self.a.shape[0], self.b.shape[1])
        return (self.num_groups, self.a.shape[0], self.b.shape[0])

    @property
    def mnk(self) -> tuple[int, int, int]:
        """(M, N, K) of the problem: M tokens, out[.., N, K] for K_GROUPED, out[M, N] contracted over K."""
        if self.kind is GemmKind.M_GROUPED:
            return self.a.shape[0], self.b.shape[1], self.a.shape[1]
        return self.a.shape[1], self.a.shape[0], self.b.shape[0]

    def describe(self) -> str:
        g = self.num_groups
        m, n, k = self.mnk
        scales = "rowwise" if self.rowwise else "tensorwise"
        return (
            f"{self.role or self.kind.value} G={g} M={m} N={n} K={k} "
            f"{str(self.a.dtype).replace('torch.', '')}x{str(self.b.dtype).replace('torch.', '')} "
            f"{scales} -> {str(self.out_dtype).replace('torch.', '')} on {self.device.type}"
        )


class GroupedGemmBackend(abc.ABC):
    """One implementation of the two grouped FP8 GEMM problems."""

    name: str = ""

    @abc.abstractmethod
    def is_available(self) -> tuple[bool, str]:
        """Whether the backend's libraries import and a device it targets is present (and why not)."""

    @abc.abstractmethod
    def can_handle(self, problem: GroupedGemmProblem) -> tuple[bool, str]:
        """Whether this backend computes ``problem`` (and, if not, why)."""

    @abc.abstractmethod
    def run(self, problem: GroupedGemmProblem) -> torch.Tensor:
        """Compute the problem; returns a new ``out`` tensor of ``problem.out_shape``."""
