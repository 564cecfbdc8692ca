"""The blockwise / MXFP8 Triton kernels on the CPU, under the Triton interpreter (in a child
process: see tests/fine_grained_interpreter_cases.py for the cases and their criteria), and the
claim behind ``triton_gemm.use_dot_scaled``: how Triton lowers ``tl.dot_scaled`` for sm_90 and
sm_100 (compiled for those targets on this machine, no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fine_grained_interpreter_cases import CASES  # noqa: E402

_results = None


def _run_cases():
    global _results
    if _results is None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fine_grained_interpreter_cases.py")],
                              env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS_JSON ")]
        assert lines, f"child failed: {proc.stderr[-3000:]}"
        _results = json.loads(lines[-1][len("RESULTS_JSON "):])
    return _results


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_case(name):
    pytest.importorskip("triton")
    result = _run_cases()[name]
    assert result["ok"], result["detail"]


def test_dot_scaled_lowering_sm90_emulated_sm100_native():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "dot_scaled_lowering.py"), "--json", "--kernels"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    # Hopper: operands upcast to bf16, scales multiplied in, bf16 wgmma: the reason the backend
    # takes the FP8 promotion loop there. Blackwell: the block-scaled tensor-core MMA.
    assert report["sm_90"]["bf16_wgmma"] > 0 and report["sm_90"]["fp8_wgmma"] == 0
    assert report["sm_100"]["tcgen05_block_scale"] > 0
    # Our block-scaled kernels (promotion loop) compile for sm_90 to FP8 wgmma, no bf16 fallback.
    for name, counts in report["block_scaled_kernels_sm_90"].items():
        assert counts["fp8_wgmma"] > 0 and counts["bf16_wgmma"] == 0, (name, counts)


def test_m_grouped_gluon_takes_what_its_tma_allows():
    """Which M-grouped blockwise problems the Gluon kernel (fwd, dgrad) takes past the device check
    (``_m_grouped_gluon_declined``, host logic only): block-major activation scales, 16-byte aligned;
    a 16-byte output row; 128 x 128 tiles; K > 0. The scales' column stride need not be a whole 16
    bytes: the kernel then loads them from global memory (``SCALES_TMA`` off in the plan)."""
    import dataclasses

    import torch

    from fine_grained_interpreter_cases import _problem
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained.triton_gemm import _GPU_DEFAULTS, _m_grouped_gluon_declined

    cfg = dataclasses.replace(_GPU_DEFAULTS[(128, False)], gluon=True)
    gen = torch.Generator().manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    fwd = _problem("m", Q.BLOCKWISE, [16, 0, 301], 712, 1040, e4m3, gen)  # 317 rows: an odd column stride
    assert fwd.a_scale.stride() == (1, 317)
    assert _m_grouped_gluon_declined(fwd, cfg, None) == ""
    assert "16-byte" in _m_grouped_gluon_declined(dataclasses.replace(fwd, out_dtype=torch.bfloat16), cfg,
                                                  torch.empty(317, 720, dtype=torch.bfloat16)[:, :712])
    assert "block-major" in _m_grouped_gluon_declined(dataclasses.replace(fwd, a_scale=fwd.a_scale.contiguous()), cfg,
                                                      None)
    assert "128 x 128" in _m_grouped_gluon_declined(fwd, dataclasses.replace(cfg, block_n=64), None)
    odd_n = dataclasses.replace(_problem("m", Q.BLOCKWISE, [16, 0, 301], 708, 1040, e4m3, gen),
                                out_dtype=torch.bfloat16)
    assert "16-byte row stride" in _m_grouped_gluon_declined(odd_n, cfg, None)  # 708 bf16: 1416 bytes a row


def test_cooperative_wgrad_takes_what_its_tma_and_flags_allow():
    """Which K-grouped blockwise problems the cooperative Gluon wgrad takes (``coop_declined``, host
    logic only): slot-major scales whose slot stride is a whole 16 bytes (its TMA boxes of a slot's
    128 scales), a bf16 dW or a float32 main_grad to add into (its consumers read ACCUMULATE off the
    output's dtype), 128 x 128 tiles; M-grouped problems never."""
    import dataclasses

    import torch

    from fine_grained_interpreter_cases import _problem
    from turbo_moe.fine_grained import quantize as Q
    from turbo_moe.fine_grained.triton_gemm import _GPU_DEFAULTS, coop_declined

    cfg = dataclasses.replace(_GPU_DEFAULTS[(128, False)], gluon=True)
    gen = torch.Generator().manual_seed(0)
    e5m2 = torch.float8_e5m2
    dw = dataclasses.replace(_problem("k", Q.BLOCKWISE, [16, 0, 300], 256, 264, e5m2, gen), out_dtype=torch.bfloat16)
    assert coop_declined(dw, cfg) == ""
    assert coop_declined(_problem("k", Q.BLOCKWISE, [16, 0, 300], 256, 264, e5m2, gen, accumulate=True), cfg) == ""
    assert "float32 main_grad" in coop_declined(dataclasses.replace(dw, out_dtype=torch.float32), cfg)
    assert "cooperative is on" in coop_declined(dw, dataclasses.replace(cfg, cooperative=False))
    assert "128 x 128" in coop_declined(dw, dataclasses.replace(cfg, block_n=64))
    odd = dataclasses.replace(_problem("k", Q.BLOCKWISE, [16, 0, 300], 256, 262, e5m2, gen), out_dtype=torch.bfloat16)
    assert "b_scale" in coop_declined(odd, cfg)  # K = 262: the slot stride is not a whole 16 bytes
    row_major = dataclasses.replace(dw, a_scale=dw.a_scale.contiguous())
    assert "a_scale" in coop_declined(row_major, cfg)
    assert "K-grouped" in coop_declined(_problem("m", Q.BLOCKWISE, [16, 0, 300], 256, 264, torch.float8_e4m3fn, gen),
                                        cfg)
