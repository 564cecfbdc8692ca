"""Cases of the Triton backend run under the Triton interpreter (``TRITON_INTERPRET=1``).

Triton fixes a kernel's mode (compiled or interpreted) when the kernel is decorated, that is when
``turbo_moe.kernels.triton.grouped_gemm`` is imported, and the environment variable is global to
a process. So that no other test of the suite is forced into interpreter mode, these cases run in
one child process: ``tests/test_triton_backend.py`` starts ``python tests/triton_interpreter_cases.py``
with ``TRITON_INTERPRET=1``, reads the JSON it prints, and turns each case into a pytest result.

Importing this module (for the case names) needs torch only.

Correctness criteria, per case:
* integer-valued FP8 data (``data="int"``): every product and partial sum is a small integer, exact
  in fp32 whatever the summation order, and the scales are applied in the same order as the torch
  reference ((acc * a_scale) * b_scale, in fp32), so the kernel must equal the torch reference
  backend **bitwise**;
* real-valued FP8 data (``data="real"``): products of FP8 values are exact in fp32; only the order
  of the fp32 sums differs from the float64 reference, so
  ``|out - ref64| <= 2 * L * 2^-24 * (|a| @ |b|^T) * |scales| + |ref64| * u_out`` with L the
  contraction length and u_out the unit roundoff of the output dtype (one final rounding).
Every output comes from a NaN-poisoned allocation (so an unwritten element fails), and every case
is run twice and must be bitwise identical (determinism).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass
class Case:
    name: str
    kind: str  # "m" (M_GROUPED) or "k" (K_GROUPED)
    group_lens: List[int]
    n: int  # M_GROUPED: output columns; K_GROUPED: rows of out[g] (rows of a)
    k: int  # M_GROUPED: contraction; K_GROUPED: columns of out[g] (rows of b)
    a_dtype: torch.dtype = E4M3
    b_dtype: torch.dtype = E4M3
    rowwise: bool = False
    out_dtype: torch.dtype = torch.float32
    data: str = "int"
    num_cu: Optional[int] = None
    tma: Optional[bool] = None  # None: both the TMA and the pointer kernel
    layout: str = "fast"  # "fast" (contiguous along the contraction) or "strided"
    block: Tuple[int, int, int] = (16, 16, 32)
    group_m: int = 2
    band_cyclic: bool = True
    seed: int = 0
    extra: Dict[str, object] = field(default_factory=dict)


CASES: List[Case] = [
    # M-grouped (fwd NT / dgrad NN)
    Case("m_ragged_empty_groups_int", "m", [5, 0, 37, 16, 0, 1], 45, 70),
    Case("m_ragged_empty_groups_real", "m", [5, 0, 37, 16, 0, 1], 45, 70, data="real"),
    Case("m_one_group_bf16", "m", [50], 32, 64, out_dtype=torch.bfloat16),
    Case("m_many_groups", "m", [3, 0, 7, 12, 1, 0, 0, 9, 4, 2, 11, 0, 5, 8, 1, 6, 0, 3, 2, 10], 16, 32),
    Case("m_hybrid_rowwise_fp16", "m", [9, 23, 0, 31], 40, 96, a_dtype=E5M2, rowwise=True, out_dtype=torch.float16),
    Case("m_hybrid_rowwise_real", "m", [9, 23, 0, 31], 40, 96, a_dtype=E5M2, rowwise=True, data="real"),
    Case("m_k_n_not_multiple_of_16", "m", [7, 19, 13], 23, 37, rowwise=True),
    Case("m_strided_operands", "m", [6, 0, 21], 24, 48, layout="strided", tma=False),
    Case("m_skewed", "m", [90, 1, 2, 0, 3], 32, 32),
    Case("m_num_cu_1", "m", [17, 0, 33], 40, 32, num_cu=1),
    Case("m_num_cu_3", "m", [17, 0, 33], 40, 32, num_cu=3),
    Case("m_num_cu_7_big_tiles", "m", [17, 0, 33], 40, 64, num_cu=7, block=(32, 32, 32), group_m=3),
    Case("m_all_groups_empty", "m", [0, 0, 0], 16, 32),
    Case("m_offset_past_2_31", "m", [1, 1], 32, 64, extra={"huge_stride": True}),
    # Float8Config(accumulation="promoted"): the PROMOTE_ACC dots (fp32 either way here).
    Case("m_promoted_accumulation_real", "m", [5, 0, 37, 16], 45, 70, data="real",
         extra={"promote_accumulation": True}),
    # K-grouped (variable-K wgrad)
    Case("k_ragged_empty_groups_int", "k", [5, 0, 37, 16, 0, 1], 45, 70),
    Case("k_ragged_empty_groups_real", "k", [5, 0, 37, 16, 0, 1], 45, 70, data="real", out_dtype=torch.bfloat16),
    Case("k_one_group", "k", [64], 32, 48),
    Case("k_many_groups_aligned_tokens", "k", [16, 0, 32, 48, 16, 0, 64, 16], 16, 32),
    Case("k_hybrid_rowwise", "k", [13, 40, 0, 27], 24, 40, a_dtype=E5M2, rowwise=True, out_dtype=torch.float16),
    Case("k_hybrid_rowwise_real", "k", [13, 40, 0, 27], 24, 40, a_dtype=E5M2, rowwise=True, data="real"),
    # Token counts summing to a multiple of 16 (TMA-eligible): groups start off 16-token
    # boundaries (masked first chunk), end inside chunks (masked last chunk), or span exact chunks.
    Case("k_long_group_unaligned", "k", [3, 101, 17, 7], 20, 33, tma=True),
    Case("k_group_spans_exact_chunks", "k", [16, 32, 5, 59, 32], 24, 40, tma=True),
    Case("k_promoted_accumulation_unaligned", "k", [3, 101, 17, 7], 20, 33, data="real",
         extra={"promote_accumulation": True}),
    Case("k_strided_operands", "k", [6, 0, 21], 24, 20, layout="strided", tma=False),
    Case("k_skewed", "k", [100, 1, 2, 0, 9], 16, 16),
    Case("k_group_major_order", "k", [5, 0, 37, 22], 40, 40, band_cyclic=False, group_m=1),
    Case("k_num_cu_1", "k", [11, 0, 21], 40, 24, num_cu=1),
    Case("k_num_cu_5", "k", [11, 0, 21], 40, 24, num_cu=5),
    Case("k_all_groups_empty_gives_zeros", "k", [0, 0], 20, 20),
    # n=2: a has two rows, the second one 2^31 + 32 elements after the first.
    Case("k_offset_past_2_31", "k", [8, 8], 2, 16, extra={"huge_stride": True}),
]


# ------------------------------------------------------------------------------------------------
# Everything below runs in the child process (TRITON_INTERPRET=1).
# ------------------------------------------------------------------------------------------------


def _values(shape, dtype, data, gen):
    if data == "int":
        return torch.randint(-2, 3, shape, generator=gen).to(dtype)
    return (torch.randn(shape, generator=gen) * 1.5).to(dtype)


def _huge_row_stride_matrix(rows: int, cols: int, dtype, data, gen):
    """A [rows, cols] view whose row stride is 2^31 + 32 elements: row 1 starts past 2^31 elements.
    Its storage is a lazily-allocated 2 GiB that only two pages of which are ever touched."""
    stride = 2**31 + 32
    storage = torch.empty(stride * (rows - 1) + cols, dtype=torch.uint8)
    view = storage.view(dtype).as_strided((rows, cols), (stride, 1))
    view.copy_(_values((rows, cols), dtype, data, gen))
    return view


def _build(case: Case):
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    gen = torch.Generator().manual_seed(case.seed)
    G = len(case.group_lens)
    M = sum(case.group_lens)
    offs = torch.tensor([0] + case.group_lens, dtype=torch.int64).cumsum(0)
    if case.kind == "m":
        if case.extra.get("huge_stride"):
            a = _huge_row_stride_matrix(M, case.k, case.a_dtype, case.data, gen)
        else:
            a = _values((M, case.k), case.a_dtype, case.data, gen)
        b = _values((G, case.n, case.k), case.b_dtype, case.data, gen)
        if case.layout == "strided":
            # Neither operand contiguous along K: a column-major view, b from a [G, K, N] tensor.
            a = a.t().contiguous().t()
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        a_scale = torch.rand(M, generator=gen) + 0.5 if case.rowwise else torch.tensor(0.75)
        b_scale = torch.rand(G, case.n, generator=gen) + 0.5 if case.rowwise else torch.tensor(1.5)
        kind = GemmKind.M_GROUPED
    else:
        if case.extra.get("huge_stride"):
            a = _huge_row_stride_matrix(case.n, M, case.a_dtype, case.data, gen)
        else:
            a = _values((case.n, M), case.a_dtype, case.data, gen)
        b = _values((case.k, M), case.b_dtype, case.data, gen)
        if case.layout == "strided":
            a = a.t().contiguous().t()
            b = b.t().contiguous().t()
        a_scale = torch.rand(G, case.n, generator=gen) + 0.5 if case.rowwise else torch.tensor(0.75)
        b_scale = torch.rand(G, case.k, generator=gen) + 0.5 if case.rowwise else torch.tensor(1.5)
        kind = GemmKind.K_GROUPED
    return GroupedGemmProblem(kind, a, b, a_scale, b_scale, offs, case.out_dtype, num_cu=case.num_cu,
                              promote_accumulation=bool(case.extra.get("promote_accumulation", False)))


def _reference64(problem):
    """float64 result and the float64 sum of |products| (for the fp32 summation bound)."""
    import dataclasses

    from turbo_moe.backends.torch_backend import reference_grouped_gemm

    ref = reference_grouped_gemm(problem, torch.float64)
    magnitudes = dataclasses.replace(
        problem, a=problem.a.double().abs(), b=problem.b.double().abs(),
        a_scale=problem.a_scale.double().abs(), b_scale=problem.b_scale.double().abs(),
    )
    return ref, reference_grouped_gemm(magnitudes, torch.float64)


def _build_exact_fp32(problem, ref_out):
    """The torch reference in fp32 (before its cast to the output dtype)."""
    import dataclasses

    from turbo_moe.backends import torch_backend

    return torch_backend.BACKEND.run(dataclasses.replace(problem, out_dtype=torch.float32))


def _run_case(case: Case) -> Tuple[bool, str]:
    import dataclasses

    from turbo_moe.backends import torch_backend, triton_backend
    from turbo_moe.backends.base import GemmKind

    problem = _build(case)
    ok, why = triton_backend.BACKEND.can_handle(problem)
    if not ok:
        return False, f"can_handle declined: {why}"
    base = triton_backend.KernelConfig(*case.block, group_m=case.group_m, num_warps=1, num_stages=1, band_cyclic=case.band_cyclic)
    variants = [case.tma] if case.tma is not None else [True, False]
    details = []
    ref_torch = torch_backend.BACKEND.run(problem)
    ref64, mag = _reference64(problem) if case.data == "real" else (None, None)
    contraction = problem.a.shape[1] if problem.kind is GemmKind.M_GROUPED else max(case.group_lens + [1])
    for tma in variants:
        config = dataclasses.replace(base, tma=tma)
        tma_used = tma and not triton_backend._tma_reason(problem)
        if tma and not tma_used:
            if case.tma:  # the case exists to test the TMA kernel
                return False, f"TMA variant requested but refused: {triton_backend._tma_reason(problem)}"
            details.append(f"tma not eligible ({triton_backend._tma_reason(problem)})")
            continue
        out = triton_backend.BACKEND.run(problem, config=config)
        again = triton_backend.BACKEND.run(problem, config=config)
        label = "tma" if tma_used else "pointers"
        if out.shape != tuple(problem.out_shape) or out.dtype != problem.out_dtype:
            return False, f"{label}: wrong output {tuple(out.shape)} {out.dtype}"
        if torch.isnan(out.float()).any():
            return False, f"{label}: {int(torch.isnan(out.float()).sum())} output elements never written (NaN poison)"
        if not torch.equal(out, again):
            return False, f"{label}: two runs differ (not deterministic)"
        if problem.kind is GemmKind.K_GROUPED:
            offs = problem.group_offs.tolist()
            for g in range(problem.num_groups):
                if offs[g] == offs[g + 1] and not torch.equal(out[g], torch.zeros_like(out[g])):
                    return False, f"{label}: empty group {g} is not exactly zero"
        if case.data == "int" and problem.out_dtype == torch.bfloat16:
            # The interpreter converts fp32 -> bf16 by truncation, the GPU (and torch) round to
            # nearest even: on the CPU the two may differ by one bf16 step at exact ties. The
            # fp32 results are exact here, so the bf16 results are within one step.
            exact = _build_exact_fp32(problem, ref_torch)
            step = exact.abs() * 2.0**-7
            if ((out.float() - exact).abs() > step).any():
                return False, f"{label}: elements differ from the torch reference by more than one bf16 step"
            details.append(f"{label}: within one bf16 step of the torch reference")
        elif case.data == "int":
            if not torch.equal(out, ref_torch):
                diff = int((out != ref_torch).sum())
                return False, f"{label}: {diff} elements differ from the torch reference (integer data must match bitwise)"
            details.append(f"{label}: bitwise equal to torch reference")
        else:
            # bf16: one full step (2^-7), since the interpreter truncates where the GPU rounds.
            u_out = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}[problem.out_dtype]
            tol = 2.0 * contraction * 2.0**-24 * mag + ref64.abs() * u_out
            err = (out.double() - ref64).abs()
            if (err > tol).any():
                return False, f"{label}: {int((err > tol).sum())} elements beyond the fp32 bound, worst excess {float((err - tol).max()):.3g}"
            details.append(f"{label}: max err {float(err.max()):.3g} within bound (max tol {float(tol.max()):.3g})")
    return True, "; ".join(details)


def _check_declines() -> Dict[str, Tuple[bool, str]]:
    """Bad inputs are declined by can_handle with a reason naming the argument."""
    from turbo_moe.backends import triton_backend
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    good = _build(Case("x", "m", [3, 4], 16, 32))
    results = {}
    checks = {
        "decline_bf16_operand": (dict(a=good.a.to(torch.bfloat16)), "a must be float8"),
        "decline_int32_offsets": (dict(group_offs=good.group_offs.to(torch.int32)), "group_offs"),
        "decline_bad_scale_shape": (dict(a_scale=torch.ones(3)), "a_scale"),
        "decline_int8_out": (dict(out_dtype=torch.int8), "out_dtype"),
        "decline_mismatched_k": (dict(b=good.b[:, :, :16]), "b must be"),
    }
    for name, (change, expected) in checks.items():
        fields = {f: getattr(good, f) for f in ("kind", "a", "b", "a_scale", "b_scale", "group_offs", "out_dtype")}
        fields.update(change)
        problem = GroupedGemmProblem(**fields)
        ok, why = triton_backend.BACKEND.can_handle(problem)
        try:
            triton_backend.BACKEND.run(problem)
            raised = ""
        except ValueError as exc:
            raised = str(exc)
        passed = (not ok) and expected in why and expected in raised
        results[name] = (passed, f"can_handle -> {ok}, {why!r}; run raised {raised!r}")
    ok, why = triton_backend.BACKEND.is_available()
    results["available_under_interpreter"] = (ok, why or "available")
    return results


def interpreter_limitation() -> str:
    """Empty if this triton's interpreter runs loops with run-time bounds, else why not.

    triton 3.6's interpreter turns a loop bound into a Python int with ``int(array_of_one)``,
    which numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars");
    triton 3.9 does not. Every kernel here loops over run-time bounds, so with that combination
    the interpreter cannot run them at all (the compiled kernels are unaffected)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(out_ptr, n):
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(out_ptr + i, i)

    out = torch.zeros(4, dtype=torch.int32)
    try:
        _probe[(2,)](out, 4)
    except Exception as exc:
        if "0-dimensional" in str(exc):
            import numpy

            return (
                f"triton {triton.__version__}'s interpreter cannot run loops with run-time bounds under "
                f"numpy {numpy.__version__} ({exc}); use triton >= 3.9 or numpy < 2.4"
            )
        raise
    return ""


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    limitation = interpreter_limitation()
    if limitation:
        print("RESULTS_JSON " + json.dumps({"__unsupported__": limitation}))
        return 0
    from turbo_moe.backends import triton_backend

    # Poison every output the backend allocates, so that an element the kernel skips shows up.
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    triton_backend._new_output = poisoned
    wanted = set(sys.argv[1:])
    results = {}
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        t0 = time.time()
        try:
            ok, detail = _run_case(case)
        except Exception:
            ok, detail = False, traceback.format_exc()[-2000:]
        results[case.name] = {"ok": ok, "detail": detail, "seconds": round(time.time() - t0, 2)}
    if not wanted:
        for name, (ok, detail) in _check_declines().items():
            results[name] = {"ok": ok, "detail": detail, "seconds": 0}
    print("RESULTS_JSON " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
