"""Median run time of a callable on a GPU (device events) or on the CPU (host clock)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["median_ms", "warm_median_ms", "synchronize"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median milliseconds of one call of ``fn``.

    On CUDA this is ``triton.testing.do_bench``: CUDA events around each call, a warm-up first,
    and the L2 cache flushed (a 256 MB buffer zeroed) before every timed call, so no input stays in
    L2 from the previous call -- small shapes are timed cold, as a layer in a real model sees them.
    Without Triton, an event loop of our own does the same minus the flush.
    On the CPU it is the host clock around each call, a few calls, median.
    """
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_event_median(fn, warmup_ms, rep_ms)
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up: first-call allocations and lazy imports stay out of the numbers
    times = []
    budget_s = max(rep_ms, 1.0) / 1000.0
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _cuda_event_median(fn, warmup_ms: float, rep_ms: float) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / per_call))):
        fn()
    n = max(5, int(rep_ms / per_call))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def warm_median_ms(fn: Callable[[], object], reps: int = 30, inner: int = 5) -> float:
    """Median milliseconds of one CUDA call of ``fn`` with L2 warm: CUDA events around ``inner``
    back-to-back calls, ``reps`` times, after 3 warm-up calls. For kernels whose inputs a real
    step hands over hot (the casts right after the GEMM that wrote them); :func:`median_ms` times
    cold."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]
