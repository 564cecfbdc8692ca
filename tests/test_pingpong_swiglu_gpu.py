"""fc1 with the SwiGLU amax epilogue (the ping-pong's SWIGLU tiles) on an sm_90 GPU.

The fused problem must give fc1's output ``h`` with the plain GEMM's bits, and amax partials whose
maximum is bit for bit the SwiGLU amax pass's ``max |silu(gate) * linear * probs|`` over the same
``h`` (``swiglu_fp8.swiglu_amax``), so that the SwiGLU's FP8 cast takes the same scale either way.
Ragged groups (a group's last rows written by masked stores and kept out of the amax), empty
groups, one group; every amax slot written (poisoned with NaN first).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from turbo_moe.backends.base import GemmKind, GroupedGemmProblem
from turbo_moe.backends.triton_backend import SWIGLU_CANDIDATES, swiglu_reason

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


def _backend_or_skip(problem):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    from turbo_moe.backends.triton_backend import BACKEND

    why = swiglu_reason(problem)
    if why:
        pytest.skip(why)
    return BACKEND


@pytest.mark.parametrize("lens", [[0, 1500, 0, 1, 777, 16, 333, 2049, 0], [3000], [128] * 64],
                         ids=["ragged", "one-group", "64-groups"])
def test_fc1_swiglu_amax_equals_plain_gemm_and_amax_pass(lens):
    g = torch.Generator(device="cuda").manual_seed(len(lens)) if torch.cuda.is_available() else None
    if g is None:
        pytest.skip("no CUDA device")
    M, G, F, K = sum(lens), len(lens), 512, 1024
    x = (torch.randn(M, K, device="cuda", generator=g) * 2).to(E4M3)
    w = torch.randn(G, 2 * F, K, device="cuda", generator=g).to(E4M3)
    sx, sw = torch.tensor(0.05, device="cuda"), torch.tensor(0.03, device="cuda")
    offs = torch.tensor([0] + lens, device="cuda").cumsum(0)
    probs = torch.rand(M, device="cuda", generator=g)
    plain = GroupedGemmProblem(GemmKind.M_GROUPED, x, w, sx, sw, offs, torch.bfloat16)
    slots = torch.full((512,), float("nan"), device="cuda")
    fused = dataclasses.replace(plain, swiglu_probs=probs, swiglu_amax=slots)
    backend = _backend_or_skip(fused)
    assert backend.can_handle(fused)[0]
    h_plain = backend.run(plain)
    h = backend.run(fused, SWIGLU_CANDIDATES[0])
    assert torch.equal(h.view(torch.int16), h_plain.view(torch.int16)), "h differs from the plain GEMM's"
    assert not torch.isnan(slots).any(), "an amax slot was not written"
    from turbo_moe.kernels.triton import swiglu_fp8

    expected = swiglu_fp8.swiglu_amax(h_plain, probs)
    assert torch.equal(slots.max().view(torch.int32), expected.view(torch.int32)), (slots.max(), expected)
