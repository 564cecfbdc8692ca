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

With ``out`` given, the result goes into that tensor (shape ``out_shape``, dtype ``out_dtype``);
with ``accumulate`` (K_GROUPED, float32 ``out``), the fp32 result is added to ``out``'s values in
the kernel epilogue -- never rounded to a narrower dtype first, no separate add kernel -- and a
group with no tokens leaves ``out[g]`` unchanged (an fp32 ``main_grad`` over micro-batches).

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
    # Float8Config(accumulation="promoted"): add partial sums into fp32 every K block where the
    # hardware's FP8 accumulator is narrower (Hopper); a no-op where products accumulate in fp32.
    promote_accumulation: bool = False
    # M_GROUPED with N = 2F, tensorwise (an expert MLP's fc1): also reduce, in the epilogue, the
    # amax of the routing-weighted SwiGLU of the output, silu(out[:, :F]) * out[:, F:] *
    # swiglu_probs[row] ([M]), as the values of float32 ``swiglu_amax`` (1-D: the maximum is the
    # maximum of its entries, every one written), for the SwiGLU's FP8 cast to take its scale from.
    # Only backends that fuse it take such a problem (the Triton one); the others refuse it.
    swiglu_probs: Optional[torch.Tensor] = None
    swiglu_amax: Optional[torch.Tensor] = None

    def signature(self) -> tuple:
        """Everything a backend's ``can_handle`` and launch plan depend on, as a hashable key: the
        kind, dtypes, devices, shapes, strides and 16-byte alignment of every tensor, the cap, the
        role, the accumulation mode, and whether a CUDA graph is being captured. Two problems with
        one signature get the same dispatch decision and the same kernel configuration, so both
        are cached on it.
        Computed once per problem object: treat a problem as a value once it was dispatched (to
        change a field, build a new one with ``dataclasses.replace``, which recomputes it)."""
        cached = self.__dict__.get("_signature")  # dispatch and the backend's plan cache both ask
        if cached is not None:
            return cached
        a, b, sa, sb, offs = self.a, self.b, self.a_scale, self.b_scale, self.group_offs
        # torch.cuda.is_current_stream_capturing() less its Python wrapper (a is a CUDA tensor).
        capturing = a.is_cuda and torch._C._cuda_isCurrentStreamCapturing()
        self.__dict__["_signature"] = signature = (
            self.kind, self.role, self.out_dtype, self.num_cu, capturing, a.device,
            a.dtype, a.shape, a.stride(), a.data_ptr() % 16,
            b.dtype, b.device, b.shape, b.stride(), b.data_ptr() % 16,
            sa.dtype, sa.device, sa.shape, sb.dtype, sb.device, sb.shape,
            offs.dtype, offs.device, offs.shape,
            self.accumulate, self.promote_accumulation, None if self.out is None else
            (self.out.dtype, self.out.device, self.out.shape, self.out.stride(), self.out.data_ptr() % 16),
            None if self.swiglu_probs is None else _fused_swiglu_facts(self.swiglu_probs, self.swiglu_amax),
        )
        return signature

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

    def out_reason(self) -> str:
        """Empty if ``out`` / ``accumulate`` are consistent with the problem, else why not."""
        out = self.out
        if out is None:
            return "accumulate=True needs an out tensor to add into" if self.accumulate else ""
        if not isinstance(out, torch.Tensor):
            return f"out must be a torch.Tensor, got {type(out).__name__}"
        if tuple(out.shape) != self.out_shape:
            return f"out must have shape {self.out_shape}, got {tuple(out.shape)}"
        if out.dtype != self.out_dtype:
            return f"out has dtype {out.dtype} but out_dtype is {self.out_dtype}"
        if out.device != self.a.device:
            return f"out is on {out.device} but a is on {self.a.device}"
        if self.accumulate:
            if self.kind is not GemmKind.K_GROUPED:
                return "accumulate=True is for K_GROUPED (wgrad) problems only"
            if out.dtype != torch.float32:
                return f"accumulate=True needs a float32 out (an fp32 main_grad), got {out.dtype}"
        return ""

    def swiglu_reason(self) -> str:
        """Empty if the SwiGLU amax epilogue's operands (``swiglu_probs``, ``swiglu_amax``) are
        consistent with the problem, or absent; else why not, naming the argument."""
        probs, amax = self.swiglu_probs, self.swiglu_amax
        if probs is None and amax is None:
            return ""
        if probs is None or amax is None:
            return "swiglu_probs and swiglu_amax go together"
        if self.kind is not GemmKind.M_GROUPED or self.rowwise or self.b.dim() != 3 or self.b.shape[1] % 2:
            return "the SwiGLU amax epilogue is for tensorwise M_GROUPED problems with an even N (2F)"
        if not probs.dtype.is_floating_point or probs.dim() != 1 or probs.shape[0] != self.a.shape[0] \
                or probs.stride(0) != 1:
            return f"swiglu_probs must be a contiguous float [M={self.a.shape[0]}] tensor, got {probs.dtype} " \
                   f"{tuple(probs.shape)}"
        if amax.dtype != torch.float32 or amax.dim() != 1 or amax.numel() == 0 or amax.stride(0) != 1:
            return f"swiglu_amax must be a contiguous non-empty 1-D float32 tensor, got {amax.dtype} {tuple(amax.shape)}"
        if probs.device != self.a.device or amax.device != self.a.device:
            return f"swiglu_probs and swiglu_amax must be on a's device {self.a.device}"
        return ""

    def describe(self) -> str:
        g = self.num_groups
        m, n, k = self.mnk
        scales = "rowwise" if self.rowwise else "tensorwise"
        return (
            f"{self.role or self.kind.value} G={g} M={m} N={n} K={k} "
            f"{str(self.a.dtype).replace('torch.', '')}x{str(self.b.dtype).replace('torch.', '')} "
            f"{scales}{' promoted-acc' if self.promote_accumulation else ''} -> "
            f"{'+= ' if self.accumulate else ''}{str(self.out_dtype).replace('torch.', '')} on {self.device.type}"
            f"{' + SwiGLU amax' if self.swiglu_probs is not None else ''}"
        )


def _fused_swiglu_facts(probs: torch.Tensor, amax: Optional[torch.Tensor]) -> tuple:
    """The signature's part for the SwiGLU amax epilogue's tensors."""
    return (probs.dtype, probs.device, probs.shape, probs.stride(), probs.data_ptr() % 16,
            None if amax is None else (amax.dtype, amax.device, amax.shape, amax.stride(), amax.data_ptr() % 16))


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
        """Compute the problem; returns ``problem.out`` when given (written, or added into under
        ``accumulate``: an empty group then leaves ``out[g]`` unchanged), else a new tensor of
        ``problem.out_shape``."""
