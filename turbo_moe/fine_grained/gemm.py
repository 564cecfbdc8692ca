"""The block-scaled grouped GEMM problems, their torch reference and the backend choice.

The two problems of ``turbo_moe/backends/base.py`` with scales that vary along the contraction
(block size ``B = recipe.block``; stored scales as ``turbo_moe.fine_grained.quantize`` returns)::

    M_GROUPED  a [M, K], b [G, N, K] -> out [M, N]
               a_scale [M, cdiv(K, B)];  b_scale [G, cdiv(N, W), cdiv(K, B)]  (W = recipe.weight_block:
               128 for blockwise weights -- 128x128 blocks --, 1 for mxfp8)
    K_GROUPED  a [N, M], b [K, M] -> out [G, N, K] (contraction over each group's tokens)
               a_scale [N, M // B + G];  b_scale [K, M // B + G]  (token-block slots, see token_slots)

    out = sum over contraction blocks kb, in order, in fp32:
          (a[.., kb] @ b[.., kb]^T) * (a_scale[:, kb, None] * b_scale[None, :, kb])

A group with no tokens gives exact zeros (K_GROUPED: out[g] = 0, or left as is with accumulate).
``out`` / ``accumulate`` mean what they mean in base.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.base import BackendUnavailable, GemmKind
from .quantize import FineRecipe, dequantize_scales, token_slots

__all__ = ["BlockScaledProblem", "pow2_blockwise_as_mxfp8", "reference_block_scaled_gemm", "run_block_scaled",
           "select_block_scaled_backend"]


@dataclass
class BlockScaledProblem:
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    a_scale: torch.Tensor
    b_scale: torch.Tensor
    group_offs: torch.Tensor
    out_dtype: torch.dtype
    recipe: FineRecipe
    num_cu: Optional[int] = None
    role: str = ""
    out: Optional[torch.Tensor] = None
    accumulate: bool = False

    @property
    def num_groups(self) -> int:
        return self.group_offs.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.a.device

    @property
    def out_shape(self) -> tuple:
        if self.kind is GemmKind.M_GROUPED:
            return (self.a.shape[0], self.b.shape[1])
        return (self.num_groups, self.a.shape[0], self.b.shape[0])

    @property
    def mnk(self) -> tuple:
        if self.kind is GemmKind.M_GROUPED:
            return self.a.shape[0], self.b.shape[1], self.a.shape[1]
        return self.a.shape[1], self.a.shape[0], self.b.shape[0]

    def signature(self) -> tuple:
        """Everything ``reason``, the backend choice and a launch plan read from the problem: dtypes,
        shapes, strides, devices, the 16-byte alignment of the operands and of the activation scales
        (a TMA operand of the M-grouped Gluon kernel), and of ``out`` when given,
        the recipe, ``num_cu``, ``accumulate``, and the MXFP8 ``tl.dot_scaled`` override. Problems
        of one signature are checked and planned once (``run_block_scaled``)."""
        a, b, sa, sb, offs, out = self.a, self.b, self.a_scale, self.b_scale, self.group_offs, self.out
        tensors = (a, b, sa, sb, offs) if out is None else (a, b, sa, sb, offs, out)
        return (self.kind, self.recipe, self.out_dtype, self.accumulate, self.num_cu,
                os.environ.get("TURBO_MOE_MX_DOT_SCALED"), a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0,
                sa.data_ptr() % 16 == 0, out is None or out.data_ptr() % 16 == 0,
                *((t.dtype, t.shape, t.stride(), t.device) for t in tensors))

    def describe(self) -> str:
        m, n, k = self.mnk
        recipe = "mxfp8" if self.recipe.e8m0 else "blockwise"
        return f"{self.role or self.kind.value} {recipe} G={self.num_groups} M={m} N={n} K={k} on {self.device.type}"

    def expected_scale_shapes(self) -> tuple:
        r = self.recipe
        m, n, k = self.mnk
        g = self.num_groups
        if self.kind is GemmKind.M_GROUPED:
            nb = -(-k // r.block)
            return (m, nb), (g, -(-n // r.weight_block), nb)
        slots = m // r.block + g
        return (n, slots), (k, slots)

    def reason(self) -> str:
        """Empty if the problem is well-formed, else why not (naming the argument)."""
        a, b = self.a, self.b
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        for name, t in (("a", a), ("b", b)):
            if t.dtype not in fp8:
                return f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}"
        if self.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"out_dtype must be bfloat16, float16 or float32, got {self.out_dtype}"
        offs = self.group_offs
        if offs.dtype != torch.int64 or offs.dim() != 1 or offs.shape[0] < 2:
            return f"group_offs must be a 1-D int64 tensor of G+1 >= 2 offsets, got {offs.dtype} {tuple(offs.shape)}"
        if self.kind is GemmKind.M_GROUPED:
            if a.dim() != 2 or b.dim() != 3 or b.shape[0] != self.num_groups or b.shape[2] != a.shape[1]:
                return f"M_GROUPED needs a [M, K] and b [G, N, K], got a {tuple(a.shape)}, b {tuple(b.shape)}"
        elif a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
            return f"K_GROUPED needs a [N, M] and b [K, M], got a {tuple(a.shape)}, b {tuple(b.shape)}"
        for name, t, shape in (("a_scale", self.a_scale, self.expected_scale_shapes()[0]),
                               ("b_scale", self.b_scale, self.expected_scale_shapes()[1])):
            if t.dtype != self.recipe.scale_dtype:
                return f"{name} must be {self.recipe.scale_dtype} for this recipe, got {t.dtype}"
            if tuple(t.shape) != shape:
                return f"{name} must have shape {shape}, got {tuple(t.shape)}"
        for name, t in (("b", b), ("group_offs", offs), ("a_scale", self.a_scale), ("b_scale", self.b_scale)):
            if t.device != a.device:
                return f"{name} is on {t.device} but a is on {a.device}"
        out = self.out
        if out is None:
            return "accumulate=True needs an out tensor to add into" if self.accumulate else ""
        if tuple(out.shape) != self.out_shape or out.dtype != self.out_dtype or out.device != a.device:
            return f"out must be {self.out_shape} {self.out_dtype} on {a.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        if self.accumulate and (self.kind is not GemmKind.K_GROUPED or out.dtype != torch.float32):
            return "accumulate=True is for K_GROUPED problems into a float32 out"
        return ""


def pow2_blockwise_as_mxfp8(problem: BlockScaledProblem, compute: bool = True) -> BlockScaledProblem:
    """The same GEMM as an ``mxfp8`` problem, for a blockwise problem with power-of-two scales
    (``Float8Config(power_of_two_scales=True)``: UE8M0 blockwise, as DeepSeek-V3.1 ships).

    A power-of-two float32 dequantization factor ``2**e`` is the e8m0 byte ``e + 127`` (its float32
    exponent field; NaN and inf give 255, e8m0's NaN). Every 1x128 block's scale becomes the scale
    of its four 1x32 MX blocks and every 128x128 weight block's of its 128 rows' (K-grouped: group
    g's MX token block j takes blockwise slot ``offs[g] // 128 + g + j // 4``, gathered on the
    device, no host sync), in the storage layouts ``quantize_rows`` / ``quantize_tokens`` return
    for MXFP8. The FP8 operands are shared as they are. Products are exact and the scales powers of
    two, so both problems have the same value; only fp32 summation order differs (per 32 instead
    of per 128 products). ``compute=False``: the scales are allocated, not filled (layout checks)."""
    r = problem.recipe
    if r.e8m0 or not r.pow2 or r.block != 128 or r.weight_block != 128:
        raise ValueError(f"pow2_blockwise_as_mxfp8 takes blockwise power-of-two problems, got recipe {r}")
    from .quantize import MXFP8, _fp32_bits

    m, n, k = problem.mnk
    g = problem.num_groups
    mx = MXFP8.block
    per = r.block // mx  # MX blocks per blockwise block
    dev = problem.device

    def e8m0(stored: torch.Tensor) -> torch.Tensor:
        return ((_fp32_bits(stored) >> 23) & 0xFF).to(torch.uint8)

    if problem.kind is GemmKind.M_GROUPED:
        k32 = -(-k // mx)
        if not compute:
            sa = torch.empty((k32, m), dtype=torch.uint8, device=dev).T
            sb = torch.empty((g, k32, n), dtype=torch.uint8, device=dev).transpose(1, 2)
        else:
            sa = e8m0(problem.a_scale.T).repeat_interleave(per, 0)[:k32].contiguous().T  # [M, K32] block-major
            rows = e8m0(problem.b_scale).repeat_interleave(r.weight_block, 1)[:, :n]  # [G, N, KB]
            sb = rows.repeat_interleave(per, 2)[:, :, :k32].transpose(1, 2).contiguous().transpose(1, 2)
    else:
        slots32 = m // mx + g
        if not compute:
            sa = torch.empty((slots32, n), dtype=torch.uint8, device=dev).T
            sb = torch.empty((slots32, k), dtype=torch.uint8, device=dev).T
        else:
            offs = problem.group_offs
            first32 = offs[:-1] // mx + torch.arange(g, device=dev)
            slot = torch.arange(slots32, device=dev)
            group = (torch.searchsorted(first32, slot, right=True) - 1).clamp_(0, g - 1)
            source = offs[group] // r.block + group + (slot - first32[group]) // per
            source = source.clamp_(0, problem.a_scale.shape[1] - 1)  # slots of no group: never read
            sa = e8m0(problem.a_scale.T)[source].T  # [N, slots32] view of slot-major storage
            sb = e8m0(problem.b_scale.T)[source].T
    return dataclasses.replace(problem, a_scale=sa, b_scale=sb, recipe=MXFP8)


def reference_block_scaled_gemm(problem: BlockScaledProblem, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The problem's semantics in ``compute_dtype`` (float32: the backend; float64: tests).

    Operands may be given in a high-precision dtype (tests pass ``|a|``, ``|b|`` and float scales
    to get the magnitudes of the products for error bounds)."""
    r = problem.recipe
    a, b = problem.a.to(compute_dtype), problem.b.to(compute_dtype)
    sa, sb = (dequantize_scales(s).to(compute_dtype) for s in (problem.a_scale, problem.b_scale))
    offs = problem.group_offs.tolist()
    out = torch.zeros(problem.out_shape, dtype=compute_dtype, device=problem.device)
    if problem.kind is GemmKind.M_GROUPED:
        n, k = b.shape[1], b.shape[2]
        sb_rows = sb.repeat_interleave(r.weight_block, dim=1)[:, :n]  # [G, N, KB]
        for g in range(problem.num_groups):
            lo, hi = offs[g], offs[g + 1]
            for kb in range(-(-k // r.block)):
                ks = slice(kb * r.block, (kb + 1) * r.block)
                part = a[lo:hi, ks] @ b[g, :, ks].T
                out[lo:hi] += part * (sa[lo:hi, kb, None] * sb_rows[g, None, :, kb])
        return out
    for g, slots in enumerate(token_slots(offs, r.block)):
        for j, slot in enumerate(slots):
            ts = slice(offs[g] + j * r.block, min(offs[g] + (j + 1) * r.block, offs[g + 1]))
            part = a[:, ts] @ b[:, ts].T
            out[g] += part * (sa[:, slot, None] * sb[None, :, slot])
    return out


def _run_torch(problem: BlockScaledProblem) -> torch.Tensor:
    from ..backends.torch_backend import run_reference

    return run_reference(problem, reference_block_scaled_gemm)


def select_block_scaled_backend(problem: BlockScaledProblem, backend: str = "auto") -> str:
    """``"flydsl"``, ``"triton"`` or ``"torch"`` for this problem; raises BackendUnavailable naming why.

    FlyDSL runs the MXFP8 M-grouped problems its MX variant takes (``backends/flydsl_mx.py``) where
    the FlyDSL backend is available (a ROCm gfx950 device, not ``TURBO_MOE_DISABLE_FLYDSL=1``);
    ``"auto"`` prefers it there and otherwise chooses as before: triton, else torch."""
    if backend not in ("auto", "triton", "torch", "flydsl"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'flydsl', 'triton', 'torch'")
    if backend in ("auto", "flydsl"):
        flydsl_why = _flydsl_reason(problem)
        if not flydsl_why:
            return "flydsl"
        if backend == "flydsl":
            raise BackendUnavailable(f"backend='flydsl' cannot run {problem.describe()}: {flydsl_why}")
    capturing = problem.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    triton_why = _triton_reason(problem)
    if backend == "triton" and triton_why:
        raise BackendUnavailable(f"backend='triton' cannot run {problem.describe()}: {triton_why}")
    if backend == "torch" or (backend == "auto" and triton_why):
        if capturing:
            raise BackendUnavailable(f"no backend can run {problem.describe()} under CUDA graph capture: the torch "
                                     f"reference reads group offsets on the host; triton: {triton_why}")
        return "torch"
    return "triton"


def _flydsl_reason(problem: BlockScaledProblem) -> str:
    """Why FlyDSL's MX variant cannot run ``problem`` here ("" if it can): first what it does not
    take on any machine, then the backend's availability, then the launch plan's checks."""
    from ..backends import _load, flydsl_mx

    why = flydsl_mx.unsupported_reason(problem)
    if why:
        return why
    fly = _load("flydsl")
    if isinstance(fly, str):
        return fly
    ok, why = fly.is_available()
    if not ok:
        return why
    try:
        flydsl_mx.plan(problem)
    except ValueError as exc:
        return str(exc)
    return ""


def _triton_reason(problem: BlockScaledProblem) -> str:
    try:
        from ..backends import triton_backend
        from . import triton_gemm

        triton_gemm.kernels()
        return triton_backend.BACKEND._device_reason(problem.device)
    except Exception as exc:  # triton missing or broken
        return f"triton does not import: {type(exc).__name__}: {exc}"


def run_block_scaled(problem: BlockScaledProblem, backend: str = "auto") -> torch.Tensor:
    """Compute ``problem`` (returns ``problem.out`` when given)."""
    signature = problem.signature() if problem.device.type != "meta" else None
    chosen = _CHOSEN.get((signature, backend)) if signature is not None else None
    if chosen is None:
        why = problem.reason()
        if why:
            raise ValueError(f"cannot run {problem.describe()}: {why}")
        if problem.device.type == "meta":
            return problem.out if problem.out is not None else torch.empty(problem.out_shape,
                                                                           dtype=problem.out_dtype, device="meta")
        chosen = select_block_scaled_backend(problem, backend)
        if signature is not None and chosen != "torch":  # torch's answer depends on graph capture
            if len(_CHOSEN) >= 4096:
                _CHOSEN.clear()
            _CHOSEN[(signature, backend)] = chosen
    if chosen == "torch":
        return _run_torch(problem)
    if chosen == "flydsl":
        from ..backends import flydsl_mx

        return flydsl_mx.run(problem)
    from . import triton_gemm

    return triton_gemm.run(problem, signature=signature)


# (BlockScaledProblem.signature(), backend) -> the backend run_block_scaled chose for a problem that
# passed its checks: a problem of a known signature skips reason() and the selection (both
# read only what the signature holds). The torch fallback is not kept: it is refused under graph
# capture, a state the signature does not hold.
_CHOSEN: dict = {}


def with_fields(problem: BlockScaledProblem, **changes) -> BlockScaledProblem:
    return dataclasses.replace(problem, **changes)
