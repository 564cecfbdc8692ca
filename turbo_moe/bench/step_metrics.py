"""Hot-path measurements of one forward+backward step: host time, GPU launches, CUDA-graph time,
the micro-batch mode (the weight changes once per optimizer step, not once per call), and where
the GPU time goes (quantization kernels, GEMM kernels, the rest).

Each function takes ``step``, a callable that issues one fwd+bwd and returns its outputs. The
GPU-only ones raise :class:`NotAvailable` with the reason on a CPU or when the step cannot be
measured that way (e.g. it cannot be captured in a CUDA graph); the benchmark prints that
reason as ``n/a: ...``.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from .timing import median_ms, synchronize

__all__ = [
    "NotAvailable",
    "host_issue_us",
    "count_kernel_launches",
    "gpu_activity_counts",
    "classify_gpu_activity",
    "GPU_TIME_CLASSES",
    "QUANT_KERNELS",
    "gpu_time_by_class",
    "gpu_time_breakdown",
    "cuda_graph_ms",
    "optimizer_step",
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


# turbo_moe's quantization kernels, by the name the profiler shows (Triton names a kernel after its
# jitted function): the fused tensorwise/rowwise casts (kernels/triton/fp8_cast.py), the group
# offsets of every call (kernels/triton/group_offsets.py: part of preparing the operands, so it is
# counted with them), delayed scaling's cast (kernels/triton/amax_history.py) and the fine-grained
# casts (kernels/triton/blockwise_cast.py).
QUANT_KERNELS = (
    "amax_partials_kernel", "fp8_cast_kernel", "fp8_rowwise_cast_kernel", "fp8_colwise_grouped_cast_kernel",
    "resolve_group_offs_kernel", "fp8_cast_delayed_kernel",
    "zero_f32_kernel", "rowwise_layouts_stats_kernel", "rowwise_layouts_cast_kernel", "rowwise_layouts_straddle_kernel",
    "block_cast_rows_kernel", "block_cast_weight_kernel", "block_cast_tokens_kernel",
)
# GEMM kernels: turbo_moe's Triton and Gluon grouped GEMMs (kernels/triton/grouped_gemm*.py,
# blockwise_gemm*.py: "block_scaled" names the blockwise ones) and the library GEMMs of the peers and
# of torch (CUTLASS, cuBLAS/cuBLASLt incl. Hopper's nvjet).
_GEMM_MARKERS = ("gemm", "grouped_mm", "block_scaled", "cutlass", "cublas", "nvjet", "xmma", "wgmma")
_QUANT_NAME = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(QUANT_KERNELS) + r")(?![A-Za-z0-9_])")

# What classify_gpu_activity returns; "kernel" is any kernel that is neither quantization nor a GEMM.
GPU_TIME_CLASSES = ("quant", "gemm", "kernel", "memset", "memcpy")
_KERNEL_CLASSES = ("quant", "gemm", "kernel")


def classify_gpu_activity(name: str) -> str:
    """What a CUPTI device activity is, by its name: ``memcpy``, ``memset``, ``quant`` (one of
    :data:`QUANT_KERNELS`, matched as a whole identifier so that ``fp8_cast_kernel`` is not found
    inside ``fp8_rowwise_cast_kernel``), ``gemm`` (turbo_moe's grouped GEMMs, CUTLASS, cuBLAS), or
    ``kernel`` (every other kernel: torch's elementwise and reduction kernels, the optimizer...).
    Quantization is tested first: no quantization kernel name contains ``gemm``.
    """
    lowered = name.lower()
    if lowered.startswith("memcpy"):
        return "memcpy"
    if lowered.startswith("memset"):
        return "memset"
    if _QUANT_NAME.search(name):
        return "quant"
    if any(marker in lowered for marker in _GEMM_MARKERS):
        return "gemm"
    return "kernel"


def gpu_activities(events: Iterable) -> list:
    """torch.profiler's GPU activities (kernels, memsets, copies) among ``events``.

    Not the ``gpu_user_annotation`` spans: every ``record_function`` range (ours, Megatron's) also
    appears on the GPU timeline as an event covering the kernels it launched. Counted as activity
    it doubles their time and, linked to no op, looked like unattributed GPU time (H100 run of
    2026-11-23: 1.1 of 1.3 ms in a one-layer step).
    """
    return [e for e in events if getattr(e.device_type, "name", None) == "CUDA"
            and not getattr(e, "is_user_annotation", False)]


def _device_activities(events: Iterable) -> Iterable[Tuple[str, float]]:
    """``(name, µs)`` of every GPU activity among torch.profiler's events."""
    for evt in gpu_activities(events):
        yield evt.name, evt.time_range.elapsed_us()


def _count_device_events(events: Iterable) -> Dict[str, int]:
    counts = {"kernel": 0, "memset": 0, "memcpy": 0}
    for name, _ in _device_activities(events):
        kind = classify_gpu_activity(name)
        counts["kernel" if kind in _KERNEL_CLASSES else kind] += 1
    return counts


def gpu_time_by_class(activities: Iterable[Tuple[str, float]]) -> Dict[str, float]:
    """Sums ``(name, µs)`` GPU activities by :func:`classify_gpu_activity`, in milliseconds.

    Returns ``{"quant_ms", "gemm_ms", "other_ms", "total_ms", "quant_share", "quant_launches",
    "gemm_launches", "other_launches"}``: ``other`` is every other kernel plus memsets and copies;
    ``quant_share`` is ``quant_ms / total_ms`` (None when nothing ran).
    """
    ms = {"quant": 0.0, "gemm": 0.0, "other": 0.0}
    launches = {"quant": 0, "gemm": 0, "other": 0}
    for name, us in activities:
        kind = classify_gpu_activity(name)
        kind = kind if kind in ("quant", "gemm") else "other"
        ms[kind] += us / 1e3
        launches[kind] += 1
    total = sum(ms.values())
    out = {f"{k}_ms": v for k, v in ms.items()}
    out.update({f"{k}_launches": v for k, v in launches.items()})
    out.update(total_ms=total, quant_share=ms["quant"] / total if total > 0 else None)
    return out


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


def gpu_time_breakdown(step: Step, device: Optional[torch.device] = None, calls: int = 1) -> Dict[str, float]:
    """GPU time of ``step`` split by :func:`gpu_time_by_class`, per call, from one profiled run.

    ``step`` is called once under torch.profiler (CUPTI activities, kernel durations as the GPU
    ran them, back to back with no L2 flush between kernels) and the sums are divided by ``calls``:
    pass ``optimizer_step(step, weight, 4)`` with ``calls=4`` for the per-micro-batch split of a
    4-micro-batch optimizer step. Call it after a warm-up.
    """
    device = torch.device("cuda") if device is None else device
    _require_cuda(device, "the profiler's GPU-time breakdown")
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = step()
        torch.cuda.synchronize(device)
    del outs
    split = gpu_time_by_class(_device_activities(prof.events()))
    for key in list(split):
        if key.endswith("_ms"):
            split[key] /= calls
        elif key.endswith("_launches"):
            split[key] = split[key] / calls
    return split


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


def optimizer_step(step: Step, weight: torch.Tensor, micro_batches: int) -> Step:
    """A callable that runs one optimizer step's worth of ``step``: the weight's version counter
    bumped (what ``optimizer.step()``'s in-place update does, without its kernel), then
    ``micro_batches`` calls. A layer that caches its FP8 weight re-quantizes once per such call,
    as under gradient accumulation; a layer without a cache does the same work on every call."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")

    def run():
        torch.autograd.graph.increment_version(weight)
        for _ in range(micro_batches):
            step()

    return run


def microbatch_ms(step: Step, weight: torch.Tensor, micro_batches: int, device: torch.device,
                  warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median ms per micro-batch of an optimizer step made of ``micro_batches`` calls of ``step``
    (:func:`optimizer_step`). ``micro_batches=1`` is the one-micro-batch-per-optimizer-step case.
    """
    run = optimizer_step(step, weight, micro_batches)
    synchronize(device)
    return median_ms(run, device, warmup_ms, rep_ms) / micro_batches
