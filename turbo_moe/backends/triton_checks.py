"""What the Triton kernels accept: the operand contract of ``base.py`` as the Triton backend checks
it (``_validate``), and when the TMA (descriptor) kernels may load or store the operands
(``_tma_reason``, ``_tma_store_ok``); otherwise the pointer kernels run. Needs torch only."""

from __future__ import annotations

import torch

from .base import GemmKind, GroupedGemmProblem

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tma_store_ok(out: torch.Tensor) -> bool:
    """A descriptor store needs a unit last stride and 16-byte multiples for the other strides."""
    item = out.element_size()
    return (
        out.stride(-1) == 1
        and all((s * item) % 16 == 0 for s in out.stride()[:-1])
        and out.data_ptr() % 16 == 0
    )


def _tma_reason(problem: GroupedGemmProblem) -> str:
    """Empty if the TMA kernels can load these operands, else why not (then pointer kernels run)."""
    a, b = problem.a, problem.b
    if problem.device.type == "cuda":
        if torch.version.hip:
            return "TMA is an NVIDIA Hopper+ feature"
        if torch.cuda.get_device_capability(problem.device) < (9, 0):
            return "TMA needs compute capability >= 9.0"
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    if problem.kind is GemmKind.M_GROUPED:
        G, N, K = b.shape
        if a.stride(1) != 1 or b.stride(2) != 1:
            return "a and b must be K-major (unit stride along K)"
        if a.stride(0) % 16 or b.stride(1) % 16:
            return "row strides of a and b must be multiples of 16 bytes"
        if G > 1 and b.stride(0) != N * b.stride(1):
            return "b's groups must be stacked rows (stride(0) == N * stride(1))"
        if a.shape[0] >= 2**31 or G * N >= 2**31:
            return "TMA coordinates are 32-bit"
        if min(a.shape[0], G * N, K) == 0:
            return "a descriptor cannot describe an empty operand"
    else:
        if a.stride(1) != 1 or b.stride(1) != 1:
            return "a and b must be token-major (unit stride along M)"
        if a.stride(0) % 16 or b.stride(0) % 16:
            return "row strides of a and b must be multiples of 16 bytes"
        if a.shape[1] >= 2**31:
            return "TMA coordinates are 32-bit"
        if a.shape[1] == 0 or a.shape[0] == 0 or b.shape[0] == 0:
            return "a descriptor cannot describe an empty operand"
    return ""


def _validate(problem: GroupedGemmProblem) -> str:
    """Empty if the operands satisfy the contract of base.py, else the reason naming the argument."""
    a, b, offs = problem.a, problem.b, problem.group_offs
    if problem.num_cu is not None and (not isinstance(problem.num_cu, int) or problem.num_cu < 1):
        return f"num_cu must be a positive int (programs of the persistent grid) or None, got {problem.num_cu!r}"
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FP8_DTYPES:
            return f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}"
    if problem.out_dtype not in _OUT_DTYPES:
        return f"out_dtype must be bfloat16, float16 or float32, got {problem.out_dtype}"
    if offs.dtype != torch.int64 or offs.dim() != 1 or offs.shape[0] < 2:
        return f"group_offs must be a 1-D int64 tensor of G+1 >= 2 offsets, got {offs.dtype} {tuple(offs.shape)}"
    for name, t in (("b", b), ("group_offs", offs), ("a_scale", problem.a_scale), ("b_scale", problem.b_scale)):
        if t.device != a.device:
            return f"{name} is on {t.device} but a is on {a.device}"
    G = problem.num_groups
    if problem.kind is GemmKind.M_GROUPED:
        if a.dim() != 2 or b.dim() != 3:
            return f"M_GROUPED needs a [M, K] and b [G, N, K], got a {tuple(a.shape)} and b {tuple(b.shape)}"
        M, K = a.shape
        if b.shape[0] != G or b.shape[2] != K:
            return f"b must be [G={G}, N, K={K}], got {tuple(b.shape)}"
        N = b.shape[1]
        a_rowwise_shape, b_rowwise_shape = (M,), (G, N)
    elif problem.kind is GemmKind.K_GROUPED:
        if a.dim() != 2 or b.dim() != 2:
            return f"K_GROUPED needs a [N, M] and b [K, M], got a {tuple(a.shape)} and b {tuple(b.shape)}"
        N, M = a.shape
        K = b.shape[0]
        if b.shape[1] != M:
            return f"b must be [K, M={M}], got {tuple(b.shape)}"
        a_rowwise_shape, b_rowwise_shape = (G, N), (G, K)
    else:
        return f"unknown problem kind {problem.kind!r}"
    for name, t, rowwise_shape in (
        ("a_scale", problem.a_scale, a_rowwise_shape),
        ("b_scale", problem.b_scale, b_rowwise_shape),
    ):
        if t.dtype != torch.float32:
            return f"{name} must be float32, got {t.dtype}"
        if t.dim() != 0 and tuple(t.shape) != rowwise_shape:
            return f"{name} must be 0-dim (tensorwise) or {rowwise_shape} (rowwise), got {tuple(t.shape)}"
    return ""
