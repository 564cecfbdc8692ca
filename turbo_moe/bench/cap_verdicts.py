"""Judgments of issue 11's targets on measured times (pure host code, unit-tested on the CPU).

* :func:`scaling_verdict`: a capped kernel's time against its cap -- monotone non-increasing
  within noise, and ``time(k) <= slack x time(all) x SMs / k`` at caps ``k >= SMs / 2``.
* :func:`overlap_verdict`: one row of the overlap benchmark -- overlapped <= 1.15 x max(GEMM,
  all-to-all), serial / overlapped >= 1.3.
* :func:`best_overlap_cap`: the measured best cap (what ``num_cu_for_comm``'s default should be).

Times are in milliseconds; a cap of None means all SMs.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional

__all__ = ["ScalingVerdict", "scaling_verdict", "OverlapVerdict", "overlap_verdict", "best_overlap_cap",
           "OVERLAP_MAX_RATIO", "OVERLAP_SPEEDUP", "SCALING_SLACK"]

OVERLAP_MAX_RATIO = 1.15  # overlapped <= 1.15 x max(all-to-all, GEMM)
OVERLAP_SPEEDUP = 1.3  # serial / overlapped >= 1.3
SCALING_SLACK = 1.1  # time(k) <= 1.1 x time(all) x SMs / k


@dataclasses.dataclass
class ScalingVerdict:
    monotone: bool
    bounded: bool
    problems: List[str]

    @property
    def ok(self) -> bool:
        return self.monotone and self.bounded


def scaling_verdict(times: Mapping[Optional[int], float], num_sms: int, noise: float = 0.05,
                    slack: float = SCALING_SLACK) -> ScalingVerdict:
    """``times``: cap -> ms (None or ``num_sms``: all SMs; must be present). ``noise``: relative
    tolerance of the monotonicity check (a larger cap may be at most ``1 + noise`` slower)."""
    if num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    by_cap: Dict[int, float] = {}
    for cap, ms in times.items():
        k = num_sms if cap is None else min(int(cap), num_sms)
        if k < 1 or not ms > 0:
            raise ValueError(f"bad measurement: cap {cap!r} -> {ms!r} ms")
        by_cap[k] = min(ms, by_cap.get(k, ms))
    if num_sms not in by_cap:
        raise ValueError("times must include the uncapped run (cap None or num_sms)")
    caps = sorted(by_cap)
    problems = []
    for small, large in zip(caps, caps[1:]):
        if by_cap[large] > by_cap[small] * (1 + noise):
            problems.append(f"not monotone: cap {large} {by_cap[large]:.4f} ms > cap {small} {by_cap[small]:.4f} ms "
                            f"(+{100 * (by_cap[large] / by_cap[small] - 1):.1f}% > {100 * noise:.0f}% noise)")
    monotone = not problems
    full = by_cap[num_sms]
    bounded = True
    for k in caps:
        if 2 * k < num_sms:
            continue
        bound = slack * full * num_sms / k
        if by_cap[k] > bound:
            bounded = False
            problems.append(f"cap {k}: {by_cap[k]:.4f} ms > {slack} x {full:.4f} x {num_sms}/{k} = {bound:.4f} ms")
    return ScalingVerdict(monotone, bounded, problems)


@dataclasses.dataclass
class OverlapVerdict:
    gemm_ms: float
    a2a_ms: float
    serial_ms: float
    overlap_ms: float

    @property
    def ratio_to_max(self) -> float:
        return self.overlap_ms / max(self.gemm_ms, self.a2a_ms)

    @property
    def speedup(self) -> float:
        return self.serial_ms / self.overlap_ms

    @property
    def ok(self) -> bool:
        return self.ratio_to_max <= OVERLAP_MAX_RATIO and self.speedup >= OVERLAP_SPEEDUP

    def describe(self) -> str:
        return (f"overlapped/max = {self.ratio_to_max:.3f} (target <= {OVERLAP_MAX_RATIO}), "
                f"serial/overlapped = {self.speedup:.3f} (target >= {OVERLAP_SPEEDUP})")


def overlap_verdict(gemm_ms: float, a2a_ms: float, serial_ms: float, overlap_ms: float) -> OverlapVerdict:
    for name, v in (("gemm_ms", gemm_ms), ("a2a_ms", a2a_ms), ("serial_ms", serial_ms), ("overlap_ms", overlap_ms)):
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
    return OverlapVerdict(gemm_ms, a2a_ms, serial_ms, overlap_ms)


def best_overlap_cap(overlap_ms: Mapping[Optional[int], float]) -> Optional[int]:
    """The cap with the least overlapped time (ties: the larger cap; None = all SMs is largest)."""
    if not overlap_ms:
        raise ValueError("no overlapped times")
    return min(overlap_ms, key=lambda cap: (overlap_ms[cap], -(float("inf") if cap is None else cap)))
