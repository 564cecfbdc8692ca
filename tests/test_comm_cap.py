"""CPU tests of issue 11's host logic: the num_cu rule for expert-parallel communication
(turbo_moe.comm_cap), Megatron's ``num_cu="comm"`` option, and the judgments of the cap-scaling
and overlap targets (turbo_moe.bench.cap_verdicts)."""

from __future__ import annotations

import pytest

import turbo_moe
from turbo_moe.bench.cap_verdicts import best_overlap_cap, overlap_verdict, scaling_verdict
from turbo_moe.comm_cap import DEFAULT_COMM_CTAS, comm_ctas_from_env, num_cu_for_comm


def test_rule_leaves_nccls_ctas_free_rounded_to_even():
    # H100 SXM: 132 SMs, NCCL's 32 channels -> 100 (the cap the issue measured by hand).
    assert num_cu_for_comm(num_sms=132, env={}) == 132 - DEFAULT_COMM_CTAS == 100
    assert num_cu_for_comm(num_sms=132, env={"NCCL_MAX_CTAS": "16"}) == 116
    assert num_cu_for_comm(num_sms=132, comm_ctas=7, env={}) == 124  # 125 rounded down to even
    assert num_cu_for_comm(num_sms=133, comm_ctas=8, env={}) == 124


def test_rule_precedence_of_nccl_variables():
    env = {"NCCL_MAX_NCHANNELS": "24", "NCCL_MAX_P2P_NCHANNELS": "12"}
    assert comm_ctas_from_env(env) == (12, "NCCL_MAX_P2P_NCHANNELS")
    assert comm_ctas_from_env(dict(env, NCCL_MAX_CTAS="4")) == (4, "NCCL_MAX_CTAS")
    assert comm_ctas_from_env({"NCCL_MAX_NCHANNELS": "24"}) == (24, "NCCL_MAX_NCHANNELS")
    assert comm_ctas_from_env({"NCCL_MAX_CTAS": " "}) == (DEFAULT_COMM_CTAS, "default")
    with pytest.raises(ValueError, match="NCCL_MAX_CTAS"):
        comm_ctas_from_env({"NCCL_MAX_CTAS": "lots"})
    with pytest.raises(ValueError, match="NCCL_MAX_P2P_NCHANNELS"):
        comm_ctas_from_env({"NCCL_MAX_P2P_NCHANNELS": "0"})


def test_rule_never_below_half_the_sms():
    assert num_cu_for_comm(num_sms=132, comm_ctas=100, env={}) == 66
    assert num_cu_for_comm(num_sms=78, comm_ctas=64, env={}) == 39


def test_user_setting_wins_and_no_comm_means_no_cap():
    assert num_cu_for_comm(90, num_sms=132, env={"TURBO_MOE_NUM_CU": "50"}) == 90
    assert num_cu_for_comm(num_sms=132, env={"TURBO_MOE_NUM_CU": "50", "NCCL_MAX_CTAS": "8"}) == 50
    assert num_cu_for_comm(num_sms=132, env={"TURBO_MOE_NUM_CU": "all"}) is None
    assert num_cu_for_comm(num_sms=132, ep_size=1, env={}) is None
    with pytest.raises(ValueError, match="num_cu"):
        num_cu_for_comm(0, num_sms=132, env={})
    with pytest.raises(ValueError, match="TURBO_MOE_NUM_CU"):
        num_cu_for_comm(num_sms=132, env={"TURBO_MOE_NUM_CU": "-3"})
    with pytest.raises(ValueError, match="ep_size"):
        num_cu_for_comm(num_sms=132, ep_size=0, env={})
    with pytest.raises(ValueError, match="num_sms"):
        num_cu_for_comm(num_sms=1, env={})
    assert turbo_moe.num_cu_for_comm is num_cu_for_comm


def test_megatron_option_accepts_comm():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from turbo_moe.megatron.options import TurboMoEOptions, resolve_num_cu

    assert TurboMoEOptions(num_cu="comm").num_cu == "comm"
    with pytest.raises(ValueError, match="num_cu"):
        TurboMoEOptions(num_cu="auto")
    assert resolve_num_cu(77, ep_size=2) == 77
    assert resolve_num_cu(None, ep_size=2) is None


def test_megatron_resolve_comm_on_a_gpu(monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import torch

    from turbo_moe.megatron.options import resolve_num_cu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("turbo_moe.comm_cap._device_sms", lambda: 132)
    monkeypatch.setenv("NCCL_MAX_CTAS", "20")
    monkeypatch.delenv("TURBO_MOE_NUM_CU", raising=False)
    assert resolve_num_cu("comm", ep_size=2) == 112
    assert resolve_num_cu("comm", ep_size=1) is None


def test_megatron_linear_resolves_comm_cap(monkeypatch):
    """The linear resolves "comm" once, with its expert-parallel size, and its kernels get it."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from _megatron_harness import build_turbo_moe, make_config, megatron_world

    seen = []

    def spy(num_cu, ep_size):
        seen.append((num_cu, ep_size))
        return num_cu_for_comm(num_sms=132, ep_size=2, comm_ctas=20, env={})  # as if on a GPU at EP=2

    monkeypatch.setattr("turbo_moe.megatron.linear.resolve_num_cu", spy)
    with megatron_world("cpu"):
        layer = build_turbo_moe(make_config(num_moe_experts=4), fp8=None, num_cu="comm")
    assert seen == [("comm", 1), ("comm", 1)]  # fc1 and fc2, EP=1 in this one-process world
    assert layer.experts.linear_fc1.num_cu == layer.experts.linear_fc2.num_cu == 112


def test_scaling_verdict():
    ok = scaling_verdict({None: 1.0, 120: 1.08, 100: 1.3, 66: 1.95, 40: 3.5}, num_sms=132)
    assert ok.ok, ok.problems
    # The issue's autotuned forward: cap 116 slower than cap 100.
    bad = scaling_verdict({None: 0.60, 116: 1.03, 100: 0.66}, num_sms=132)
    assert not bad.monotone and any("cap 116" in p for p in bad.problems)
    assert not bad.bounded  # 1.03 > 1.1 x 0.60 x 132/116
    within_noise = scaling_verdict({None: 1.0, 100: 0.98}, num_sms=132, noise=0.05)
    assert within_noise.monotone
    slow = scaling_verdict({None: 1.0, 66: 2.3, 40: 9.0}, num_sms=132)
    assert slow.monotone and not slow.bounded and len(slow.problems) == 1  # cap 40 < half: not judged
    with pytest.raises(ValueError, match="uncapped"):
        scaling_verdict({100: 1.0}, num_sms=132)
    with pytest.raises(ValueError, match="bad measurement"):
        scaling_verdict({None: 1.0, 100: 0.0}, num_sms=132)


def test_overlap_verdict_and_best_cap():
    # The issue's H200 numbers: overlapped never beat serial.
    issue = overlap_verdict(gemm_ms=0.93, a2a_ms=0.50, serial_ms=1.09, overlap_ms=1.16)
    assert not issue.ok and issue.speedup < 1
    target = overlap_verdict(gemm_ms=0.60, a2a_ms=0.55, serial_ms=1.15, overlap_ms=0.66)
    assert target.ok and "1.15" in target.describe()
    assert not overlap_verdict(1.0, 1.0, 2.0, 1.2).ok  # 1.2 > 1.15 x 1.0
    with pytest.raises(ValueError, match="overlap_ms"):
        overlap_verdict(1.0, 1.0, 2.0, 0)
    assert best_overlap_cap({None: 1.2, 116: 1.1, 100: 1.0, 80: 1.05}) == 100
    assert best_overlap_cap({None: 1.0, 100: 1.0}) is None
