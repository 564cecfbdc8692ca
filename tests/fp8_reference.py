"""Float64 references and the FP8 error bound every numerical test uses.

The bound. Round-to-nearest into an FP8 format with ``p`` mantissa bits changes a normal value by
a relative error of at most ``u = 2**-(p+1)`` (e4m3: p=3, u=1/16; e5m2: p=2, u=1/8), and a value in
the subnormal range by an absolute error of at most half the subnormal spacing (e4m3: 2**-10,
e5m2: 2**-17), in the scaled domain; values are scaled so the largest lands on the format's
largest finite value, so nothing saturates. For one output element ``y = sum_i a_i b_i`` with
``a~ = a (1 + e_a) + d_a`` and ``b~ = b (1 + e_b) + d_b``::

    |y~ - y| <= (u_a + u_b + u_a u_b) * sum_i |a_i| |b_i|
                + sum_i (|b_i| + |d_b|) |d_a| + |a_i| |d_b|  + accumulation rounding

with ``|d_a| <= sub_a / scale_a``. Accumulation is fp32 (relative 2**-24 per add, at most K adds)
and the final cast to the output dtype adds half an ulp of that dtype. ``fp8_error_bound`` returns
this bound element by element; a kernel that drops a scale, mixes groups or loses a K-block
breaks it by orders of magnitude, while correct FP8 arithmetic can never exceed it.
"""

from __future__ import annotations

import torch

FP8_UNIT_ROUNDOFF = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
FP8_HALF_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}
OUT_HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def offsets(group_lens) -> list[int]:
    offs = [0]
    for n in group_lens:
        offs.append(offs[-1] + int(n))
    return offs


def grouped_matmul_f64(x: torch.Tensor, w_nk: torch.Tensor, group_lens) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w_nk[g].T in float64."""
    offs = offsets(group_lens)
    x64, w64 = x.detach().double(), w_nk.detach().double()
    y = torch.empty(x.shape[0], w_nk.shape[1], dtype=torch.float64)
    for g in range(w_nk.shape[0]):
        y[offs[g]:offs[g + 1]] = x64[offs[g]:offs[g + 1]] @ w64[g].T
    return y


def grouped_wgrad_f64(dy: torch.Tensor, x: torch.Tensor, group_lens) -> torch.Tensor:
    """dW[g] = dy[rows of g]^T @ x[rows of g] in float64; [G, N, K]."""
    offs = offsets(group_lens)
    dy64, x64 = dy.detach().double(), x.detach().double()
    return torch.stack([dy64[offs[g]:offs[g + 1]].T @ x64[offs[g]:offs[g + 1]] for g in range(len(group_lens))])


def _scale_of(t: torch.Tensor, fp8: torch.dtype) -> float:
    amax = t.detach().abs().max().item() if t.numel() else 0.0
    return torch.finfo(fp8).max / amax if amax > 0 else 1.0


def fp8_error_bound(a, b, fp8_a, fp8_b, out_dtype, k_terms: int) -> torch.Tensor:
    """Element-wise bound for ``a @ b.T`` computed on tensorwise-quantized operands.

    ``a``: [R, K], ``b``: [C, K] (float64 views of the *unquantized* operands of one group);
    scales are those of the whole tensors they came from, passed through ``fp8_a``/``fp8_b`` as
    (dtype, scale) pairs.
    """
    (da, sa), (db, sb) = fp8_a, fp8_b
    ua, ub = FP8_UNIT_ROUNDOFF[da], FP8_UNIT_ROUNDOFF[db]
    abs_a, abs_b = a.abs(), b.abs()
    dsub_a, dsub_b = FP8_HALF_SUBNORMAL[da] / sa, FP8_HALF_SUBNORMAL[db] / sb
    prod = abs_a @ abs_b.T
    bound = (ua + ub + ua * ub) * prod
    bound += dsub_a * (abs_b.sum(1)[None, :] * (1 + ub) + k_terms * dsub_b) + dsub_b * abs_a.sum(1)[:, None] * (1 + ua)
    bound += k_terms * 2.0**-24 * prod * 1.2  # fp32 accumulation
    return bound


def assert_within_fp8_bound(actual, reference, bound, out_dtype, what: str) -> None:
    """|actual - reference| <= bound + the output cast's half ulp, everywhere; no NaN."""
    actual = actual.detach().double()
    assert not torch.isnan(actual).any(), f"{what}: NaN in output"
    allowed = bound * (1 + OUT_HALF_ULP[out_dtype]) + reference.abs() * OUT_HALF_ULP[out_dtype] * 2
    excess = (actual - reference).abs() - allowed
    worst = excess.max().item() if excess.numel() else -1.0
    assert worst <= 0, (
        f"{what}: error exceeds the FP8 bound by {worst:.3e} at {divmod(int(excess.argmax()), excess.shape[-1])}"
    )


def fresh_inputs(group_lens, n, k, dtype=torch.float32, seed=0, trans_b=True):
    """Random x [M, K] and w (non-zero, N(0,1)), new for every test."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(int(v) for v in group_lens)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(len(group_lens), n, k, generator=gen).to(dtype)
    if not trans_b:
        w = w.transpose(1, 2).contiguous()
    return x, w, torch.tensor(list(group_lens), dtype=torch.int64)
