"""The FlyDSL backend's dispatch on any machine (no device needed): why it is unavailable without a
ROCm gfx950 device (faked here), the opt-out switch, and the can_handle reasons for operands,
scales, offsets and the out / accumulate fields of GroupedGemmProblem."""

from __future__ import annotations

import pytest
import torch


# ----------------------------------------------------------------------------------------------
# Availability and can_handle reasons.
# ----------------------------------------------------------------------------------------------


def _problem(a_dtype=torch.float8_e4m3fn, a_scale=None, b_scale=None, out_dtype=torch.bfloat16, offs_dtype=torch.int64,
             transpose_a=False):
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    a = torch.randn(10, 64).to(a_dtype)
    if transpose_a:
        a = torch.randn(64, 10).to(a_dtype).T
    b = torch.randn(2, 48, 64).to(torch.float8_e4m3fn)
    return GroupedGemmProblem(
        GemmKind.M_GROUPED, a, b,
        torch.tensor(1.0) if a_scale is None else a_scale, torch.tensor(1.0) if b_scale is None else b_scale,
        torch.tensor([0, 4, 10], dtype=offs_dtype), out_dtype,
    )


def _fake_rocm(monkeypatch, arch):
    import types as _types

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: _types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-",
                                                             multi_processor_count=256))


def test_backend_is_unavailable_without_a_rocm_gfx950_device_and_says_why(monkeypatch):
    from turbo_moe.backends import flydsl_backend

    backend = flydsl_backend.BACKEND
    ok, why = backend.is_available()
    if not (torch.version.hip and torch.cuda.is_available()):
        assert not ok and why  # here: no flydsl, or no ROCm device
    _fake_rocm(monkeypatch, "gfx942")
    ok, why = backend.is_available()
    if not flydsl_backend._flydsl_import_error():
        assert not ok and "gfx942" in why and "gfx950" in why
    _fake_rocm(monkeypatch, "gfx950")
    ok, why = backend.is_available()
    assert ok == (not flydsl_backend._flydsl_import_error()), why


def test_backend_opt_out(monkeypatch):
    from turbo_moe.backends import flydsl_backend

    monkeypatch.setenv("TURBO_MOE_DISABLE_FLYDSL", "1")
    _fake_rocm(monkeypatch, "gfx950")
    assert flydsl_backend.BACKEND.is_available() == (False, "disabled by TURBO_MOE_DISABLE_FLYDSL")


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({}, "not a ROCm GPU"),
        ({"a_dtype": torch.float8_e4m3fnuz}, "a is torch.float8_e4m3fnuz"),
        ({"a_scale": torch.ones(7)}, "a_scale has shape (7,)"),
        ({"b_scale": torch.ones(2, 47)}, "b_scale has shape (2, 47)"),
        ({"a_scale": torch.ones(10, dtype=torch.float64)}, "a_scale must be a contiguous float32"),
        ({"out_dtype": torch.int32}, "out_dtype torch.int32"),
        ({"offs_dtype": torch.int32}, "group_offs must be a 1-D int64"),
        ({"transpose_a": True}, "contiguous along the contraction"),
        ({"a_scale": torch.ones(10), "b_scale": torch.ones(2, 48)}, "not a ROCm GPU"),  # rowwise is fine
    ],
)
def test_backend_can_handle_reasons(kwargs, reason):
    from turbo_moe.backends import flydsl_backend

    ok, why = flydsl_backend.BACKEND.can_handle(_problem(**kwargs))
    assert not ok and reason in why, why


def test_auto_dispatch_passes_over_flydsl_with_its_reason_on_cpu():
    from turbo_moe.backends import recent_dispatches, select_backend

    chosen = select_backend(_problem(), "auto")
    assert chosen.name != "flydsl"
    record = recent_dispatches()[-1]
    assert dict(record.passed_over)["flydsl"]


# ----------------------------------------------------------------------------------------------
# out / accumulate (GroupedGemmProblem.out, .accumulate).
# ----------------------------------------------------------------------------------------------


def _k_problem(out=None, accumulate=False, out_dtype=torch.float32):
    from turbo_moe.backends.base import GemmKind, GroupedGemmProblem

    a = torch.randn(48, 10).to(torch.float8_e4m3fn)
    b = torch.randn(32, 10).to(torch.float8_e4m3fn)
    return GroupedGemmProblem(GemmKind.K_GROUPED, a, b, torch.tensor(1.0), torch.tensor(1.0),
                              torch.tensor([0, 4, 10], dtype=torch.int64), out_dtype, out=out, accumulate=accumulate)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: _k_problem(torch.zeros(2, 48, 32), True), "not a ROCm GPU"),  # valid: reaches the device check
        (lambda: _k_problem(torch.zeros(2, 48, 32)), "not a ROCm GPU"),
        (lambda: _k_problem(None, True), "accumulate needs out"),
        (lambda: _k_problem(torch.zeros(2, 48, 32, dtype=torch.bfloat16), True, torch.bfloat16), "accumulate needs a float32"),
        (lambda: _k_problem(torch.zeros(2, 32, 48)), "out has shape (2, 32, 48), expected (2, 48, 32)"),
        (lambda: _k_problem(torch.zeros(2, 48, 32, dtype=torch.float16)), "out is torch.float16"),
        (lambda: _k_problem(torch.zeros(2, 32, 48).transpose(1, 2)), "contiguous"),
        (lambda: _problem_with_out(accumulate=True), "K_GROUPED (wgrad) problems only"),
    ],
)
def test_backend_checks_out_and_accumulate(make, reason):
    from turbo_moe.backends import flydsl_backend

    ok, why = flydsl_backend.BACKEND.can_handle(make())
    assert not ok and reason in why, why


def _problem_with_out(accumulate):
    problem = _problem(out_dtype=torch.float32)
    problem.out, problem.accumulate = torch.zeros(10, 48), accumulate
    return problem
