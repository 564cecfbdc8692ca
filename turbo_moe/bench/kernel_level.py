"""Kernel-level benchmark: the three grouped GEMMs on FP8 operands prepared once, outside the timing.

Implementations (names as they appear in tables and JSON):

* ``turbo:<backend>`` -- turbo_moe's backend, chosen through the registry
  (``select_backend(problem, name)``) and run as ``backend.run(problem)``;
* ``cutlass_fp8`` -- ``torch._scaled_grouped_mm`` (CUTLASS; rowwise scales, fast accumulation);
* ``bf16`` -- ``torch._grouped_mm`` on the dequantized operands in bf16;
* ``dense_fp8`` -- ``torch._scaled_mm`` on the dense GEMM of the same M, N, K (one weight matrix
  for all tokens): the ceiling a grouped kernel can approach.

Operand layouts per op (one buffer serves turbo_moe and the peers: the peers get views):

* fwd:   a = x_fp8 [M, K],  b = W_fp8 [G, N, K]   -> y  [M, N]
* dgrad: a = dy_fp8 [M, N], b = W^T_fp8 [G, K, N] -> dx [M, K]
* wgrad: a = dy^T [N, M],   b = x^T [K, M]        -> dW [G, N, K]  (variable K per group)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..backends import BackendUnavailable, GemmKind, GroupedGemmProblem, select_backend
from . import data
from .shapes import Case

__all__ = ["KERNEL_OPS", "KERNEL_PEERS", "Missing", "OpInputs", "prepare_case", "kernel_impls"]

KERNEL_OPS = ("fwd", "dgrad", "wgrad")
KERNEL_PEERS = ("cutlass_fp8", "bf16", "dense_fp8")


class Missing(Exception):
    """An implementation that cannot run here (library or op absent): reported, never a crash."""


@dataclass
class OpInputs:
    """One grouped GEMM problem in the contract's layout, with rowwise and tensorwise scales."""

    op: str
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    a_scale_rowwise: torch.Tensor
    b_scale_rowwise: torch.Tensor
    a_scale_tensorwise: torch.Tensor
    b_scale_tensorwise: torch.Tensor
    group_offs: torch.Tensor  # int64 [G+1] on the device
    group_ends_int32: torch.Tensor  # int32 [G]: torch's grouped-mm offsets
    offs_host: List[int]

    def scales(self, granularity: str) -> Tuple[torch.Tensor, torch.Tensor]:
        if granularity == "rowwise":
            return self.a_scale_rowwise, self.b_scale_rowwise
        return self.a_scale_tensorwise, self.b_scale_tensorwise

    @property
    def out_numel(self) -> int:
        if self.kind is GemmKind.M_GROUPED:
            return self.a.shape[0] * self.b.shape[1]
        return (len(self.offs_host) - 1) * self.a.shape[0] * self.b.shape[0]


def prepare_case(case: Case, device: torch.device, seed: int) -> Dict[str, OpInputs]:
    """Random FP8 operands and scales of the three ops of ``case`` (e4m3 throughout: the CUTLASS
    peer takes e4m3 only, so every implementation reads the same bytes)."""
    gen = data.maybe_generator(device, seed)
    fp8 = torch.float8_e4m3fn
    m, n, k, g = case.m, case.n, case.k, case.num_experts
    offs_host = data.group_offsets(case.group_sizes)
    group_offs = torch.tensor(offs_host, dtype=torch.int64, device=device)
    ends32 = torch.tensor(offs_host[1:], dtype=torch.int32, device=device)

    x = data.random_fp8((m, k), fp8, device, gen)
    w = data.random_fp8((g, n, k), fp8, device, gen)
    dy = data.random_fp8((m, n), fp8, device, gen)
    w_t = w.transpose(1, 2).contiguous()  # [G, K, N], N contiguous: dgrad's K-major B
    dy_t = dy.t().contiguous()  # [N, M], token-contiguous
    x_t = x.t().contiguous()  # [K, M], token-contiguous

    def scales(*shape):
        return data.random_scales(shape, device, gen)

    def tensorwise():
        return scales()

    common = dict(group_offs=group_offs, group_ends_int32=ends32, offs_host=offs_host)
    return {
        "fwd": OpInputs("fwd", GemmKind.M_GROUPED, x, w, scales(m), scales(g, n), tensorwise(), tensorwise(), **common),
        "dgrad": OpInputs(
            "dgrad", GemmKind.M_GROUPED, dy, w_t, scales(m), scales(g, k), tensorwise(), tensorwise(), **common
        ),
        "wgrad": OpInputs(
            "wgrad", GemmKind.K_GROUPED, dy_t, x_t, scales(g, n), scales(g, k), tensorwise(), tensorwise(), **common
        ),
    }


@dataclass
class Impl:
    """A ready-to-time callable and what its output must equal."""

    name: str
    fn: Callable[[], torch.Tensor]
    # (kind, a, b, a_scale, b_scale) the output is checked against; None: no grouped reference
    # (the dense ceiling computes a different product).
    reference: Optional[tuple]
    out_numel: int
    out_dtype: torch.dtype = torch.bfloat16


def turbo_impl(inputs: OpInputs, backend: str, granularity: str, num_cu: Optional[int]) -> Impl:
    a_scale, b_scale = inputs.scales(granularity)
    problem = GroupedGemmProblem(
        inputs.kind, inputs.a, inputs.b, a_scale, b_scale, inputs.group_offs, torch.bfloat16, num_cu, inputs.op
    )
    try:
        chosen = select_backend(problem, backend)
    except BackendUnavailable as exc:
        raise Missing(str(exc)) from None
    return Impl(
        f"turbo:{chosen.name}",
        lambda: chosen.run(problem),
        (inputs.kind, inputs.a, inputs.b, a_scale, b_scale),
        inputs.out_numel,
    )


def cutlass_fp8_impl(inputs: OpInputs) -> Impl:
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise Missing(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
    if inputs.a.device.type != "cuda":
        raise Missing("torch._scaled_grouped_mm runs on CUDA only")
    sa, sb = inputs.a_scale_rowwise, inputs.b_scale_rowwise
    ends = inputs.group_ends_int32
    if inputs.kind is GemmKind.M_GROUPED:
        # mat_b must be column-major [G, contracted, out]: a transposed view of the K-major buffer.
        def fn():
            return torch._scaled_grouped_mm(
                inputs.a, inputs.b.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True
            )

    else:
        # 2D x 2D with offsets over the contracted (token) dim: scales are flat [G * rows], group-major.
        sa_flat, sb_flat = sa.reshape(-1), sb.reshape(-1)

        def fn():
            return torch._scaled_grouped_mm(
                inputs.a, inputs.b.t(), sa_flat, sb_flat, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True
            )

    return Impl("cutlass_fp8", fn, (inputs.kind, inputs.a, inputs.b, sa, sb), inputs.out_numel)


def bf16_impl(inputs: OpInputs) -> Impl:
    if not hasattr(torch, "_grouped_mm"):
        raise Missing(f"torch {torch.__version__} has no torch._grouped_mm")
    sa, sb = inputs.a_scale_rowwise, inputs.b_scale_rowwise
    ends = inputs.group_ends_int32
    bf16 = torch.bfloat16
    if inputs.kind is GemmKind.M_GROUPED:
        a = data.dequantize_m_operand(inputs.a, sa, bf16)
        b = data.dequantize_weight(inputs.b, sb, bf16)

        def fn():
            return torch._grouped_mm(a, b.transpose(-2, -1), offs=ends)

    else:
        a = data.dequantize_k_operand(inputs.a, sa, inputs.offs_host, bf16)
        b = data.dequantize_k_operand(inputs.b, sb, inputs.offs_host, bf16)

        def fn():
            return torch._grouped_mm(a, b.t(), offs=ends)

    # Checked against the FP8 operands' reference: bf16 rounding of the dequantized inputs stays
    # far inside the tolerance.
    return Impl("bf16", fn, (inputs.kind, inputs.a, inputs.b, sa, sb), inputs.out_numel)


def dense_fp8_impl(inputs: OpInputs) -> Impl:
    if not hasattr(torch, "_scaled_mm"):
        raise Missing(f"torch {torch.__version__} has no torch._scaled_mm")
    if inputs.kind is GemmKind.M_GROUPED:
        a = inputs.a  # [M, contracted]
        b = inputs.b[0].t()  # [contracted, out], column-major view of expert 0
        sa = inputs.a_scale_rowwise[:, None].contiguous()
        sb = inputs.b_scale_rowwise[0][None, :].contiguous()
    else:
        a = inputs.a  # [N, M]
        b = inputs.b.t()  # [M, K] column-major
        sa = inputs.a_scale_rowwise[0][:, None].contiguous()
        sb = inputs.b_scale_rowwise[0][None, :].contiguous()

    def fn():
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=a.device.type == "cuda")

    return Impl("dense_fp8", fn, None, a.shape[0] * b.shape[1])


def kernel_impls(
    inputs: OpInputs, backends: List[str], peers: List[str], granularity: str, num_cu: Optional[int]
) -> List[Tuple[str, object]]:
    """``(label, Impl or Missing)`` for every requested implementation, turbo_moe first."""
    out: List[Tuple[str, object]] = []
    seen = set()
    for backend in backends:
        try:
            impl = turbo_impl(inputs, backend, granularity, num_cu)
        except Missing as exc:
            out.append((f"turbo:{backend}", exc))
            continue
        if impl.name not in seen:  # "auto" and the backend it resolves to are one implementation
            seen.add(impl.name)
            out.append((impl.name, impl))
    makers = {"cutlass_fp8": cutlass_fp8_impl, "bf16": bf16_impl, "dense_fp8": dense_fp8_impl}
    return out + peer_impls(makers, inputs, peers)


def peer_impls(makers, inputs, peers) -> list:
    """``(peer, impl or Missing)`` for each requested peer this level knows (others are skipped)."""
    out = []
    for peer in peers:
        if peer not in makers:
            continue
        try:
            out.append((peer, makers[peer](inputs)))
        except Missing as exc:
            out.append((peer, exc))
    return out


def release(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
