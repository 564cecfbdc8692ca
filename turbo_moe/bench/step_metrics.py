"""Hot-path measurements of one forward+backward step: host time, GPU launches, CUDA-graph time,
and the micro-batch mode (the weight changes once per optimizer step, not once per call).

Each function takes ``step``, a callable that issues one fwd+bwd and returns its outputs. The
GPU-only ones raise :class:`NotAvailable` with the reason on a CPU or when the step cannot be
measured that way (e.g. it cannot be captured in a CUDA graph); the benchmark prints that
reason as ``n/a: ...``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Dict, Iterable, Optional

import torch

from .timing import median_ms, synchronize

__all__ = [
    "NotAvailable",
    "host_issue_us",
    "count_kernel_launches",
    "gpu_activity_counts",
    "classify_gpu_activity",
    "cuda_graph_ms",
    "microbatch_ms",
]

Step = Callable[[], object]


class NotAvailable(Exception):
    """This measurement cannot be made here; the message says why."""


def _require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise NotAvailable(f"{what} needs a CUDA device")


# ------------------------------------------------------------------------------- host time


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond (measured: the clock varies)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # first call: module load
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / max(start.elapsed_time(end), 1e-3)


def host_issue_us(step: Step, device: torch.device, target_ms: float = 60.0, max_steps: int = 50) -> Dict[str, object]:
    """Microseconds of host (CPU) time to issue one ``step``, with the GPU kept busy.

    CUDA: after a warm-up call, the stream is given a ``torch.cuda._sleep`` kernel long enough to
    outlast the whole timed loop, then ``n`` steps are issued back to back and timed on the host
    clock, with no synchronization inside the loop. Because the GPU is still asleep when the loop
    ends, nothing in the loop could have waited for the GPU, unless the step itself synchronizes
    (``.item()``, ``.tolist()``, a blocking copy): that is detected (the sleep had already ended when
    the loop finished) and reported as ``synchronizes=True``, the time then including the wait.
    CPU: the median wall time of a call (the work itself runs on the host there).

    Returns ``{"us": mean µs per step over the n steps, "steps": n, "synchronizes": bool}``.
    """
    if device.type != "cuda":
        step()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return {"us": statistics.median(times) * 1e6, "steps": len(times), "synchronizes": False}
    step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    one_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    n = int(max(5, min(max_steps, target_ms / max(one_ms, 1e-3))))
    cycles_per_ms = _sleep_cycles_per_ms()
    result = None
    for attempt in range(2):
        # A second try issues fewer steps: more than ~1000 pending launches fill the CUDA launch
        # queue, and the host then blocks until the (sleeping) GPU drains it.
        n = n if attempt == 0 else max(2, n // 4)
        sleep_ms = 2.0 * n * one_ms + 20.0 + 100.0 * attempt
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        asleep = torch.cuda.Event()
        asleep.record()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        elapsed = time.perf_counter() - t0
        woke_early = asleep.query()  # the sleep already over: the loop may have waited on the GPU
        torch.cuda.synchronize(device)
        result = {"us": elapsed / n * 1e6, "steps": n, "synchronizes": bool(woke_early)}
        if not woke_early:
            break
    return result


# ------------------------------------------------------------------------------- launches


def classify_gpu_activity(name: str) -> str:
    """``memcpy``, ``memset`` or ``kernel`` for a CUPTI device activity's name."""
    lowered = name.lower()
    if lowered.startswith("memcpy"):
        return "memcpy"
    if lowered.startswith("memset"):
        return "memset"
    return "kernel"


def _count_device_events(events: Iterable) -> Dict[str, int]:
    from torch.autograd import DeviceType

    counts = {"kernel": 0, "memset": 0, "memcpy": 0}
    for evt in events:
        if evt.device_type == DeviceType.CUDA:
            counts[classify_gpu_activity(evt.name)] += 1
    return counts


def gpu_activity_counts(step: Step, device: Optional[torch.device] = None) -> Dict[str, int]:
    """GPU activities one call of ``step`` issues: ``{"kernel", "memset", "memcpy", "total"}``.

    Counted from torch.profiler's CUDA (CUPTI) device activities: one per kernel launch (torch,
    Triton or library kernels alike), per ``cudaMemsetAsync`` and per device copy. Call it after
    a warm-up (first calls compile, autotune and allocate).
    """
    device = torch.device("cuda") if device is None else device
    _require_cuda(device, "counting kernel launches")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = step()
        torch.cuda.synchronize(device)
    del outs
    counts = _count_device_events(prof.events())
    counts["total"] = sum(counts.values())
    return counts


def count_kernel_launches(step: Step, device: Optional[torch.device] = None) -> int:
    """Kernel launches (memsets and device copies included) of one call of ``step`` on the GPU."""
    return gpu_activity_counts(step, device)["total"]


# ------------------------------------------------------------------------------- CUDA graph


def _first_tensor(outs) -> Optional[torch.Tensor]:
    if isinstance(outs, torch.Tensor):
        return outs
    if isinstance(outs, (tuple, list)) and outs and isinstance(outs[0], torch.Tensor):
        return outs[0]
    return None


def cuda_graph_ms(step: Step, device: torch.device, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median ms of replaying ``step`` captured in a ``torch.cuda.CUDAGraph``.

    Warm-up runs on a side stream (as ``torch.cuda.graph`` wants), then one capture; the replay's
    first output must match an eager call's (relative error below 1e-3), otherwise the capture
    did not record the same work. Raises :class:`NotAvailable` with the reason when capture fails.
    """
    _require_cuda(device, "CUDA-graph capture")
    eager = _first_tensor(step())
    eager = None if eager is None else eager.detach().clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = step()
    except Exception as exc:
        del graph
        torch.cuda.synchronize(device)
        raise NotAvailable(f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    try:
        graph.replay()
        torch.cuda.synchronize(device)
        out = _first_tensor(captured)
        if eager is not None and out is not None:
            den = float(eager.double().norm()) or 1.0
            err = float((out.double() - eager.double()).norm()) / den
            if not err < 1e-3:
                raise NotAvailable(f"replayed output differs from eager (rel err {err:.2g})")
        return median_ms(graph.replay, device, warmup_ms, rep_ms)
    finally:
        del captured, graph
        gc.collect()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- micro-batches


def microbatch_ms(step: Step, weight: torch.Tensor, micro_batches: int, device: torch.device,
                  warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median ms per micro-batch of an optimizer step made of ``micro_batches`` calls of ``step``.

    Before each group of calls the weight's version counter is bumped (what ``optimizer.step()``'s
    in-place update does, without its kernel), so a layer that caches its FP8 weight re-quantizes
    once per group, as under gradient accumulation; a layer without a cache does the same work on
    every call. ``micro_batches=1`` is the one-micro-batch-per-optimizer-step case.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")

    def optimizer_step():
        torch.autograd.graph.increment_version(weight)
        for _ in range(micro_batches):
            step()

    synchronize(device)
    return median_ms(optimizer_step, device, warmup_ms, rep_ms) / micro_batches
