"""Host launch plans: a hot region's GPU work recorded once, then replayed from C++.

An FP8 grouped GEMM's forward (quantize x, the GEMM) and backward (quantize dy, dgrad, wgrad) are
a few allocations and 3-4 Triton launches, but issuing them from Python costs far more host time
than the GPU work of a small layer: the Python between the launches (argument checks, dispatch,
launch-argument building) runs per call, on the slow CPUs of GPU machines at 5-10x the cost seen
on a workstation (docs/results/h100_hotpath.md). Here a :class:`Region` runs such a function of
tensors normally for its first calls of a signature; one call is *recorded*: every allocation
(``torch.empty``-like aten ops, seen through a ``TorchDispatchMode``) and every kernel launch
(through ``kernels/triton/launch.py``'s lean launcher, with each parameter's bytes at the offsets
the driver reports for the compiled kernel). Later calls of the same signature call
the plan: one C++ call (``replay`` in ``csrc/launch_plan.cpp``) allocates its buffers as the
recorded call allocated them, writes the new addresses into each launch's parameter bytes
(pointers and each TMA descriptor's global address) and launches.

What makes a replay equal to the Python path: the signature key holds everything the launches
derive from -- each input tensor's shape, strides, dtype, device and 16-byte alignment, plus the
caller's static key (recipe, backend, flags) -- and a recording is refused (the region keeps its
Python path for that signature) when anything in it is not a replayable fact:

* any aten op other than allocations and views (a torch kernel, a copy, a host sync);
* a Triton launch not through the lean launcher's direct path (a compile, a profiler hook);
* a kernel argument pointing into memory that is neither an input nor an allocation of the call;
* a parameter layout that does not match the driver's (``cuFuncGetParamInfo``), a TMA descriptor
  whose global address cannot be located and re-written bit-exactly;
* while a CUDA graph is captured, or before the signature's tuning is settled (the first
  ``RECORD_AFTER - 1`` calls run in Python).

For a region declared pure (no input is written), the plan is replayed once on the recording's
own inputs and its outputs must equal the Python run's bit for bit, or it is dropped. That check
costs no device memory beyond a call's: the Python run's outputs are compared through host copies
and freed before the replay allocates (:func:`_verify`). The GPU tests
compare replayed and Python results for every recipe. ``TURBO_MOE_HOST_PLANS=0`` turns plans off.

A replay frees as it goes: an allocation, or an input whose caller handed over its reference (a
planned layer's step), is dropped just before the first allocation whose first launch comes after
its last one, so that allocation may take its block (:func:`release_schedule`,
:func:`input_release_schedule`). A region records at most
``MAX_PLANS_PER_STATIC_KEY`` signatures of one static key; past that, new ones keep the Python path
(token counts that change call to call would otherwise be recorded at every repeat).

The C++ extension is built on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler
and ninja; 25-60 s, cached in torch's extension directory). Where it cannot be built, regions
run their Python path and :func:`status` says why.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import types
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Region", "status", "enabled", "set_enabled", "fact"]

# Calls of a signature before one is recorded: the first runs tuning and compiles; the second is
# the first settled one.
RECORD_AFTER = 2
# Recording attempts per signature before its Python path is kept for good.
MAX_ATTEMPTS = 3
# A replay's allocations are made inside the extension's replay() (ATen, one C++ call with the
# launches) rather than one torch call each from Python; TURBO_MOE_PLAN_CPP_ALLOCATIONS=0 makes
# them in Python. Same buffers, same order, same release schedule either way.
CPP_ALLOCATIONS = os.environ.get("TURBO_MOE_PLAN_CPP_ALLOCATIONS", "1") != "0"

_EXT = None
_EXT_ERROR: Optional[str] = None
_EXT_LOCK = threading.Lock()


# Signatures remembered per region (a run whose token counts change every call makes a new
# signature each time and is served by the Python path; the cap bounds what it accumulates).
_MAX_SIGNATURES = 1024
# Plans recorded per region and static key (recipe, flags) before new signatures of that key stop
# being recorded. A run whose token counts change call to call (expert parallelism with dropless
# routing) repeats some counts, and each repeat would otherwise be recorded: a host sync (the
# recording's check copies its outputs to the host) and a plan kept by the extension for good,
# again and again. Past the cap such signatures keep the Python path, as unrepeated ones do.
MAX_PLANS_PER_STATIC_KEY = 64
_ENABLED = os.environ.get("TURBO_MOE_HOST_PLANS", "1") not in ("", "0")


def enabled() -> bool:
    return _ENABLED


def set_enabled(flag: bool) -> bool:
    """Turn host plans on or off (tests, benchmarks); returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(flag)
    return previous


def _extension():
    """The compiled ``launch_plan`` extension, built on first use; None (reason in ``_EXT_ERROR``)."""
    global _EXT, _EXT_ERROR
    if _EXT is not None or _EXT_ERROR is not None:
        return _EXT
    with _EXT_LOCK:
        if _EXT is None and _EXT_ERROR is None:
            try:
                from torch.utils.cpp_extension import load

                source = os.path.join(os.path.dirname(__file__), "csrc", "launch_plan.cpp")
                _EXT = load(name="turbo_moe_launch_plan", sources=[source], extra_cflags=["-O2"], verbose=False)
            except Exception as exc:  # no compiler, no ninja, no headers...
                _EXT_ERROR = f"the launch-plan extension did not build: {type(exc).__name__}: {exc}"
                warnings.warn(f"turbo_moe: {_EXT_ERROR}; FP8 GEMMs issue their launches from Python "
                              "(correct, more host time per call)", RuntimeWarning, stacklevel=3)
    return _EXT


def region_stats() -> Dict[str, tuple]:
    """``{region name: (replays, plans, first refusals)}`` of every region made so far."""
    return {r.name: (r.replays, sum(p is not _FAILED for p in r._plans.values()), r.refusals[:3]) for r in _REGIONS}


def status() -> str:
    """One line: whether host plans are in use, and if not, why."""
    if not enabled():
        return "off (TURBO_MOE_HOST_PLANS=0, or set_enabled(False))"
    if _EXT is not None:
        return "on"
    return _EXT_ERROR or "not built yet (built at the first GPU call)"


_RECORDING = threading.local()  # .effects: the list of the region being recorded on this thread


def repeat_on_replay(effect: Callable[[], None]) -> None:
    """While a region is recorded on this thread: call ``effect`` again at every replay of its
    plan (a host-side record the skipped Python would have made, e.g. a dispatch log entry)."""
    effects = getattr(_RECORDING, "effects", None)
    if effects is not None:
        effects.append(effect)


_GENERATION = 0  # bumped by clear_all: whatever was built on the plans before is stale


def generation() -> int:
    return _GENERATION


def clear_all() -> None:
    """Forget every region's plans (after something they were recorded under changed, e.g. the
    backends' dispatch decisions), and so every planned layer built on them."""
    global _GENERATION
    _GENERATION += 1
    for region in _REGIONS:
        region.clear()


class RecordingRefused(Exception):
    """Why one call could not be recorded (the region keeps its Python path for it)."""


def _checked(call):
    """The result of an extension call returning ``(error, result)``; a failure refuses the recording."""
    error, result = call
    if error:
        raise RecordingRefused(error)
    return result


def fact(t):
    """What a signature key holds of one input: shape, strides, dtype, device index and 16-byte
    alignment (None for an absent input)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16)


class _Plan:
    """A recorded region: the allocations to make, the launches (in the extension), the outputs."""

    __slots__ = ("plan_id", "tensor_positions", "allocs", "outputs", "ext", "effects")

    def __init__(self, plan_id, tensor_positions, allocs, outputs, ext, effects=()):
        self.plan_id = plan_id
        self.tensor_positions = tensor_positions  # positions of the non-None inputs
        self.allocs = allocs  # per allocation: (shape, strides, dtype, zero, allocations and inputs released before it)
        self.outputs = outputs  # per output: None, ("input", i), ("alloc", j) or ("view", j, sizes, strides, offset)
        self.ext = ext
        self.effects = effects  # repeat_on_replay's callables

    def replay(self, inputs):
        for effect in self.effects:
            effect()
        tensors = [inputs[i] for i in self.tensor_positions]
        stream = _raw_stream(tensors[0].get_device())
        if CPP_ALLOCATIONS:  # allocations and launches in one C++ call
            error, allocs = self.ext.replay(self.plan_id, tensors, stream)
        else:
            error, allocs = self._replay_allocating_in_python(tensors, stream)
        if error:  # the extension returns its errors as text (csrc/launch_plan.cpp)
            raise RuntimeError(error)
        return tuple(_output(spec, inputs, allocs) for spec in self.outputs)

    def _replay_allocating_in_python(self, tensors, stream):
        """What the extension's replay() does, with the allocations made here (CPP_ALLOCATIONS off)."""
        device = tensors[0].device
        addresses = [t.data_ptr() for t in tensors]
        allocs = []
        for shape, strides, dtype, zero, release, _ in self.allocs:  # the caller keeps its inputs
            for j in release:  # dead before this one is first used: its block may be reused (stream order)
                allocs[j] = None
            alloc = torch.zeros(shape, dtype=dtype, device=device) if zero else \
                torch.empty_strided(shape, strides, dtype=dtype, device=device)
            allocs.append(alloc)
            addresses.append(alloc.data_ptr())
        return self.ext.launch(self.plan_id, addresses, stream), allocs


def _output(spec, inputs, allocs):
    if spec is None:
        return None
    kind = spec[0]
    if kind == "alloc":
        return allocs[spec[1]]
    if kind == "input":
        return inputs[spec[1]]
    return allocs[spec[1]].as_strided(spec[2], spec[3], spec[4])


_FAILED = object()
_REGIONS: List["Region"] = []
_BY_ID: Dict[int, Tuple["Region", _Plan]] = {}  # every kept plan by its extension id
_LAYERS_USED = False  # set by planned layers (turbo_moe.planned_layer): their backwards replay in C++


def note_layer_use() -> None:
    """A planned layer ran: from now on :func:`flush_layer_replays` asks the extension."""
    global _LAYERS_USED
    _LAYERS_USED = True


def flush_layer_replays() -> None:
    """Account for the plans that planned layers' C++ backwards replayed since the last call: each
    counts as a replay of its region and repeats its host-side records (``repeat_on_replay``), in
    order. Called before anything reads or adds such records."""
    if not _LAYERS_USED or _EXT is None:
        return
    for plan_id in _EXT.take_replayed():
        found = _BY_ID.get(plan_id)
        if found is None:  # cleared since
            continue
        region, plan = found
        region._replays += 1
        for effect in plan.effects:
            effect()


_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


class Region:
    """A function of tensors whose GPU work is allocations and lean Triton launches only.

    ``region(static_key, inputs, fn, pure)``: ``fn()`` computes the outputs (a tuple of tensors or
    None) from ``inputs`` (a tuple of tensors or None: every tensor ``fn`` reads or writes that is
    not made inside it) and from whatever ``static_key`` determines. ``pure``: ``fn`` writes no
    input (its plans are then verified by a replay at recording).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        _REGIONS.append(self)
        self._plans: Dict[tuple, object] = {}
        self._calls: Dict[tuple, int] = {}
        self._recorded: Dict[object, int] = {}  # static key -> plans recorded (MAX_PLANS_PER_STATIC_KEY)
        self._saturated_keys: set = set()  # static keys whose saturation refusals already name
        self._replays = 0
        self.refusals: List[str] = []

    @property
    def replays(self) -> int:
        """Calls replayed from a plan (planned layers' C++ backwards included)."""
        flush_layer_replays()
        return self._replays

    def __call__(self, static_key, inputs: Sequence[Optional[torch.Tensor]], fn: Callable[[], tuple],
                 pure: bool) -> tuple:
        if not _ENABLED:
            return fn()
        key = (static_key, *map(fact, inputs))
        plan = self._plans.get(key)
        if plan is not None:
            if plan is _FAILED:
                return fn()
            self._replays += 1
            return plan.replay(inputs)
        calls = self._calls.get(key, 0) + 1
        if len(self._calls) >= _MAX_SIGNATURES:  # token counts that vary call to call: no plan helps
            self._calls.clear()
        self._calls[key] = calls
        if calls < RECORD_AFTER or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return fn()
        if self._saturated(static_key):
            return fn()
        ext = _extension()
        if ext is None:
            self._plans[key] = _FAILED
            return fn()
        outputs, plan, why = _record(ext, inputs, fn, pure)
        if plan is not None:
            if len(self._plans) >= _MAX_SIGNATURES:
                self._forget_plans()
            self._plans[key] = plan
            _BY_ID[plan.plan_id] = (self, plan)
            self._recorded[static_key] = self._recorded.get(static_key, 0) + 1
        else:
            if len(self.refusals) < 64:
                self.refusals.append(f"{self.name}: {why}")
            if calls - RECORD_AFTER + 1 >= MAX_ATTEMPTS:
                self._plans[key] = _FAILED
        return outputs

    def plan_for(self, key: tuple) -> Optional[_Plan]:
        """The recorded plan for a signature ``(static_key, *facts of the inputs)`` (see :func:`fact`),
        or None (not recorded yet, or refused)."""
        plan = self._plans.get(key)
        return None if plan is _FAILED else plan

    def refused(self, key: tuple) -> bool:
        """Whether this signature (``(static_key, *facts)``) keeps its Python path for good."""
        plan = self._plans.get(key)
        return plan is _FAILED or (plan is None and self._recorded.get(key[0], 0) >= MAX_PLANS_PER_STATIC_KEY)

    def _saturated(self, static_key) -> bool:
        """Whether ``static_key`` has its MAX_PLANS_PER_STATIC_KEY plans (said once in ``refusals``)."""
        count = self._recorded.get(static_key, 0)
        if count < MAX_PLANS_PER_STATIC_KEY:
            return False
        if static_key not in self._saturated_keys:  # first time: say why new signatures stay in Python
            self._saturated_keys.add(static_key)
            if len(self.refusals) < 64:
                self.refusals.append(f"{self.name}: {count} signatures of one static key recorded (token counts "
                                     "that change call to call?); new ones keep the Python path")
        return True

    def _forget_plans(self) -> None:
        for plan in self._plans.values():
            if plan is not _FAILED:
                _BY_ID.pop(plan.plan_id, None)
        self._plans.clear()

    def clear(self) -> None:
        """Forget every plan and count (tests, benchmarks)."""
        self._forget_plans()
        self._calls.clear()
        self._recorded.clear()
        self._saturated_keys.clear()
        self._replays = 0
        self.refusals = []


# ----------------------------------------------------------------------------------- recording

_ALLOC_OPS = {"empty.memory_format", "empty_strided.default", "empty.default", "new_empty.default",
              "new_empty_strided.default", "empty_like.default"}
_ZERO_ALLOC_OPS = {"zeros.default", "new_zeros.default", "zeros_like.default"}
_VIEW_OPS = {"view.default", "_unsafe_view.default", "as_strided.default", "t.default", "transpose.int",
             "permute.default", "select.int", "slice.Tensor", "unsqueeze.default", "squeeze.dim", "squeeze.default",
             "squeeze.dims", "expand.default", "alias.default", "detach.default", "reshape.default", "unbind.int",
             "lift_fresh.default",
             "split.Tensor", "narrow.default", "view_as.default", "diagonal.default"}


def _dispatch_mode_type():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _AllocationLog(TorchDispatchMode):
        """Records allocations; refuses any op that computes (it would not be replayed)."""

        def __init__(self):
            super().__init__()
            self.allocs: List[list] = []  # [tensor, zero]
            self.refused: Optional[str] = None

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = f"{func._overloadpacket.__name__}.{func._overloadname}"
            if name in _ALLOC_OPS:
                self.allocs.append([out, False])
            elif name in _ZERO_ALLOC_OPS:
                self.allocs.append([out, True])
            elif name not in _VIEW_OPS and self.refused is None:
                self.refused = f"aten op {name}"
            return out

    return _AllocationLog


_LOG_TYPE = None


class _Launch:
    __slots__ = ("memo", "grid", "args", "scratch")

    def __init__(self, memo, grid, args, scratch):
        self.memo, self.grid, self.args, self.scratch = memo, grid, args, scratch


class _LaunchLog:
    """The lean launcher's hook while a region is recorded (kernels/triton/launch.py). A launch
    from another thread meanwhile refuses the recording (it is not the region's)."""

    def __init__(self):
        self.launches: List[_Launch] = []
        self.refused: Optional[str] = None
        self.thread = threading.get_ident()

    def direct(self, memo, grid, args, scratch):
        if threading.get_ident() != self.thread:
            self.other("a launch from another thread during the recording")
            return
        self.launches.append(_Launch(memo, grid, tuple(args), scratch))

    def other(self, why: str):
        if self.refused is None:
            self.refused = why


def _record(ext, inputs, fn, pure) -> Tuple[tuple, Optional[_Plan], str]:
    """Run ``fn`` once, recorded: ``(its outputs, the plan or None, why not)``. ``fn`` runs once
    (its side effects happen once); for a pure region whose plan passed its check, the outputs are
    the check replay's, bit for bit the Python run's (:func:`_verify`)."""
    global _LOG_TYPE
    from turbo_moe.kernels.triton import launch as lean_launch
    import triton.runtime.jit as triton_jit

    if _LOG_TYPE is None:
        _LOG_TYPE = _dispatch_mode_type()
    if not _RECORD_LOCK.acquire(blocking=False):  # another thread is recording: run, unrecorded
        return fn(), None, "another recording was in progress"
    try:
        return _record_locked(ext, inputs, fn, pure, lean_launch, triton_jit)
    finally:
        _RECORD_LOCK.release()


_RECORD_LOCK = threading.Lock()


def _record_locked(ext, inputs, fn, pure, lean_launch, triton_jit):
    alloc_log, launch_log = _LOG_TYPE(), _LaunchLog()
    original_run = triton_jit.JITFunction.run

    def guarded_run(self, *args, **kwargs):  # any launch through Triton's own path
        launch_log.other(f"a launch of {getattr(self, '__name__', self)} through Triton's own path")
        return original_run(self, *args, **kwargs)

    effects = []
    lean_launch.set_record_hook(launch_log)
    triton_jit.JITFunction.run = guarded_run
    _RECORDING.effects = effects
    try:
        with alloc_log:
            outputs = fn()
    finally:
        _RECORDING.effects = None
        triton_jit.JITFunction.run = original_run
        lean_launch.set_record_hook(None)
    try:
        plan = _make_plan(ext, inputs, outputs, alloc_log, launch_log)
    except RecordingRefused as why:
        return outputs, None, str(why)
    # The logs hold every allocation of the run alive (so that no address could stand for two
    # allocations while launches were mapped to slots), intermediates included: release them now,
    # before the check allocates anything.
    alloc_log.allocs.clear()
    launch_log.launches.clear()
    if pure:
        holder = [outputs]
        del outputs  # _verify frees the Python run's outputs before its replay allocates new ones
        outputs, why = _verify(plan, inputs, holder)
        if why:
            return outputs, None, why
    plan.effects = tuple(effects)  # after the check: its replay is not a call of the region
    return outputs, plan, ""


def storage_extent(t: torch.Tensor) -> Tuple[int, int]:
    """(start address, bytes) of the memory t's elements span."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr(), span * t.element_size()


class _Sources:
    """Maps an address to (slot, offset): the slots are the inputs, then the call's allocations."""

    def __init__(self, tensors: List[torch.Tensor], allocs: List[torch.Tensor]):
        self.ranges = []
        for slot, t in enumerate(list(tensors) + list(allocs)):
            start, size = storage_extent(t)
            self.ranges.append((start, size, slot))

    def find(self, address: int, what: str) -> Tuple[int, int]:
        found = [(slot, address - start) for start, size, slot in self.ranges if start <= address < start + max(size, 1)]
        if len(found) != 1:
            raise RecordingRefused(f"{what} points {'nowhere known' if not found else 'into several tensors'}")
        return found[0]


_SCALAR_FORMATS = {"i1": "<?", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u1": "<?", "u8": "<B",
                   "u16": "<H", "u32": "<I", "u64": "<Q", "fp32": "<f", "fp64": "<d"}
_TMA_BYTES = 128


def _tensor_map_bytes(obj) -> bytes:
    """The CUtensorMap inside Triton's PyCUtensorMap object (its last 128 bytes:
    ``{PyObject_HEAD; _Alignas(...) CUtensorMap tensorMap;}``)."""
    size = type(obj).__basicsize__
    if size < _TMA_BYTES + 16:
        raise RecordingRefused(f"unknown TMA descriptor object {type(obj).__name__}")
    return ctypes.string_at(id(obj) + size - _TMA_BYTES, _TMA_BYTES)


def _descriptor_template(desc, meta, make_arg) -> Tuple[bytes, int, torch.Tensor]:
    """(the CUtensorMap bytes for desc, the byte offset of its global address, desc's base)."""
    from turbo_moe.kernels.triton.launch import HostDesc, to_descriptor

    if type(desc) is HostDesc:
        desc = to_descriptor(desc)
    base = desc.base
    address = base.data_ptr()
    blob = _tensor_map_bytes(make_arg(desc, meta)[0])
    offsets = [o for o in range(0, _TMA_BYTES - 7, 8) if int.from_bytes(blob[o:o + 8], "little") == address]
    if len(offsets) != 1:
        raise RecordingRefused("a TMA descriptor's global address is not one plain field")
    at = offsets[0]
    # The field must be all that changes with the address: encode at another address and compare.
    other = address + (1 << 21)
    fake = types.SimpleNamespace(**{k: getattr(desc, k) for k in vars(desc)})
    fake.base = types.SimpleNamespace(data_ptr=lambda: other, dtype=base.dtype)
    moved = _tensor_map_bytes(make_arg(fake, meta)[0])
    if blob[:at] + other.to_bytes(8, "little") + blob[at + 8:] != moved:
        raise RecordingRefused("a TMA descriptor changes beyond its global address when the address moves")
    return blob, at, base


def _launch_spec(ext, launch: _Launch, sources: _Sources):
    memo = launch.memo
    kernel = memo.kernel
    direct = memo.direct
    if direct is None or direct[1] or direct[2]:
        raise RecordingRefused("a launch that is not a plain direct launch (cooperative/PDL/unknown launcher)")
    if getattr(kernel.metadata, "num_ctas", 1) != 1 or getattr(kernel.metadata, "profile_scratch_size", 0):
        raise RecordingRefused("a kernel with clusters or profile scratch")
    name = getattr(kernel, "name", "a kernel")
    signature = list(kernel.src.signature.values())
    values = list(launch.args) + list(memo.constexpr_values)
    if len(signature) != len(values):
        raise RecordingRefused(f"{name}: {len(values)} arguments for {len(signature)} parameters")
    metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or [])
    make_arg = direct[4][1] if isinstance(direct[4], tuple) else None
    params = []  # (kind, value)
    desc_index = 0
    for ty, value in zip(signature, values):
        if ty == "constexpr":
            continue
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            if make_arg is None or desc_index >= len(metas) or metas[desc_index] is None:
                raise RecordingRefused("a TMA descriptor without Triton's host metadata")
            meta = metas[desc_index]
            desc_index += 1
            if meta.get("fp4_padded"):
                raise RecordingRefused("an fp4-padded descriptor")
            params.append(("tma", _descriptor_template(value, meta, make_arg)))
            params.extend(("i32", int(s)) for s in value.shape)
            params.extend(("i64", int(s)) for s in value.strides)
        elif isinstance(ty, str) and ty.startswith("*"):
            params.append(("ptr", value))
        elif ty in _SCALAR_FORMATS:
            params.append((ty, value))
        else:
            raise RecordingRefused(f"{name}: parameter type {ty!r}")
    params.append(("ptr", launch.scratch))  # global scratch
    params.append(("ptr", None))  # profile scratch
    info = _checked(ext.param_info(kernel.function))
    if len(info) != len(params):
        raise RecordingRefused(f"{name}: the driver reports {len(info)} parameters, the signature {len(params)}")
    size = max(offset + width for offset, width in info) if info else 0
    buffer = bytearray(size)
    patches = []
    for (kind, value), (offset, width) in zip(params, info):
        if kind == "ptr":
            if width != 8:
                raise RecordingRefused(f"{name}: a pointer parameter of {width} bytes")
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise RecordingRefused(f"{name}: a pointer argument of type {type(value).__name__}")
            slot, delta = sources.find(value.data_ptr(), f"{name}'s pointer argument")
            patches.append((offset, slot, delta))
        elif kind == "tma":
            blob, at, base = value
            if width != _TMA_BYTES:
                raise RecordingRefused(f"{name}: a TMA parameter of {width} bytes")
            buffer[offset:offset + _TMA_BYTES] = blob
            slot, delta = sources.find(base.data_ptr(), f"{name}'s TMA descriptor")
            patches.append((offset + at, slot, delta))
        else:
            fmt = _SCALAR_FORMATS[kind]
            if struct.calcsize(fmt) != width:
                raise RecordingRefused(f"{name}: a {kind} parameter of {width} bytes")
            buffer[offset:offset + width] = struct.pack(fmt, value)
    grid = list(launch.grid)
    block = 32 * kernel.metadata.num_warps
    return (kernel.function, grid, block, kernel.metadata.shared, bytes(buffer), [o for o, _ in info], patches)


def _make_plan(ext, inputs, outputs, alloc_log, launch_log) -> _Plan:
    if alloc_log.refused:
        raise RecordingRefused(alloc_log.refused)
    if launch_log.refused:
        raise RecordingRefused(launch_log.refused)
    if not isinstance(outputs, tuple):
        raise RecordingRefused("the region returned no tuple")
    positions = [i for i, t in enumerate(inputs) if t is not None]
    if not positions:
        raise RecordingRefused("a region without tensor inputs")
    tensors = [inputs[i] for i in positions]
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        raise RecordingRefused("inputs not all on one CUDA device")
    allocs = []
    for tensor, zero in alloc_log.allocs:
        if not isinstance(tensor, torch.Tensor) or tensor.device != device:
            raise RecordingRefused("an allocation off the inputs' device")
        if tensor.storage_offset() != 0 or tensor.data_ptr() != tensor.untyped_storage().data_ptr():
            raise RecordingRefused("an allocation that is not a fresh storage")
        allocs.append((tensor, zero))
    alloc_tensors = [a for a, _ in allocs]
    sources = _Sources(tensors, alloc_tensors)
    launches = [_launch_spec(ext, launch, sources) for launch in launch_log.launches]
    if not launches:
        raise RecordingRefused("no launch to replay")
    alloc_index = {a.untyped_storage().data_ptr(): j for j, a in enumerate(alloc_tensors)}
    out_specs = []
    for out in outputs:
        if out is None:
            out_specs.append(None)
            continue
        if not isinstance(out, torch.Tensor):
            raise RecordingRefused(f"an output of type {type(out).__name__}")
        same = [i for i in positions if inputs[i] is out]
        if same:
            out_specs.append(("input", same[0]))
            continue
        j = alloc_index.get(out.untyped_storage().data_ptr())
        if j is None:
            raise RecordingRefused("an output that is neither an input nor made in the region")
        alloc = alloc_tensors[j]
        if out.dtype != alloc.dtype:
            raise RecordingRefused("an output viewing its allocation as another dtype")
        if out is alloc or (out.shape == alloc.shape and out.stride() == alloc.stride() and out.storage_offset() == 0):
            out_specs.append(("alloc", j))
        else:
            out_specs.append(("view", j, tuple(out.shape), tuple(out.stride()), out.storage_offset()))
    plan_id = _checked(ext.add_plan(len(tensors) + len(allocs), launches))
    kept = {spec[1] for spec in out_specs if spec is not None and spec[0] in ("alloc", "view")}
    alloc_uses = [[slot - len(tensors) for _, slot, _ in launch[6] if slot >= len(tensors)] for launch in launches]
    input_uses = [[slot for _, slot, _ in launch[6] if slot < len(tensors)] for launch in launches]
    zero_filled = any(zero for _, zero in allocs)
    release = release_schedule(alloc_uses, len(allocs), kept, zero_filled)
    outputs_of_inputs = {positions.index(spec[1]) for spec in out_specs if spec is not None and spec[0] == "input"}
    release_inputs = input_release_schedule(alloc_uses, input_uses, len(tensors), len(allocs), outputs_of_inputs,
                                            zero_filled)
    alloc_specs = tuple((tuple(a.shape), tuple(a.stride()), a.dtype, zero, release[j], release_inputs[j])
                        for j, (a, zero) in enumerate(allocs))
    error = ext.set_allocs(plan_id, [(list(shape), list(strides), torch.empty(0, dtype=dtype, device=device), zero,
                                      list(drop), list(drop_inputs))
                                     for shape, strides, dtype, zero, drop, drop_inputs in alloc_specs])
    error = error or ext.set_outputs(plan_id, [_cpp_output_spec(spec, positions) for spec in out_specs])
    if error:
        raise RecordingRefused(error)
    return _Plan(plan_id, positions, alloc_specs, tuple(out_specs), ext)


def _cpp_output_spec(spec, positions):
    """An output spec as the extension's set_outputs takes it (kind, index, sizes, strides, offset);
    an input is named by its place among the tensor inputs (the non-None ones)."""
    if spec is None:
        return (0, 0, [], [], 0)
    if spec[0] == "input":
        return (1, positions.index(spec[1]), [], [], 0)
    if spec[0] == "alloc":
        return (2, spec[1], [], [], 0)
    return (3, spec[1], list(spec[2]), list(spec[3]), spec[4])


def release_schedule(uses: List[List[int]], num_allocs: int, kept, zero_filled: bool = False) -> List[tuple]:
    """Per allocation j, the earlier allocations to drop just before j is made: those not in
    ``kept`` (the outputs) whose last launch comes before j's first (``uses[k]``: the allocations
    launch k reads or writes). A replay makes every allocation before launching anything, so
    without this it would hold at once buffers the Python path frees between its launches (W^T's
    FP8 copy, dead once dgrad has run, before wgrad's dW); dropped before a later
    allocation, a block may be handed to it, which is safe because the launches run in the
    recorded order on one stream. Not with ``zero_filled`` allocations: their fill runs when they
    are made, before the launches, so a reused block would be written by its earlier owner's
    kernels after the fill; then nothing is dropped."""
    if zero_filled:
        return [()] * num_allocs
    first, last = _first_and_last_uses(uses, num_allocs)
    return _drops(first, last, kept, lambda j: range(j))


def input_release_schedule(alloc_uses: List[List[int]], input_uses: List[List[int]], num_inputs: int,
                           num_allocs: int, kept, zero_filled: bool = False) -> List[tuple]:
    """Per allocation j, the inputs to drop just before j is made: those not in ``kept`` (inputs
    that are outputs) whose last launch comes before j's first (``input_uses[k]`` / ``alloc_uses[k]``:
    the inputs / allocations launch k reads or writes). Dropping frees an input only where the
    caller handed over its reference: a planned layer's step does for what its table releases
    (``csrc/launch_plan.cpp``, run_step), so the gradient a layer's backward receives is freed once
    quantized, before dgrad's output takes memory (a Python ``Function`` holds it to the end of
    its backward). Safe for the reason of :func:`release_schedule`, with the same exception."""
    if zero_filled:
        return [()] * num_allocs
    first, _ = _first_and_last_uses(alloc_uses, num_allocs)
    _, last = _first_and_last_uses(input_uses, num_inputs)
    return _drops(first, last, kept, lambda j: range(num_inputs))


def _drops(first: List[int], last: List[int], kept, candidates) -> List[tuple]:
    """Per allocation j (``first[j]``: its first launch), the ``candidates(j)`` not in ``kept`` nor
    dropped earlier whose last launch (``last[i]``) comes before it."""
    released = set()
    schedule = []
    for j in range(len(first)):
        drop = tuple(i for i in candidates(j) if i not in kept and i not in released and last[i] < first[j])
        released.update(drop)
        schedule.append(drop)
    return schedule


def _first_and_last_uses(uses: List[List[int]], count: int) -> Tuple[List[int], List[int]]:
    """Per index 0..count-1, the first and last launch using it (len(uses) and -1 for none)."""
    first = [len(uses)] * count
    last = [-1] * count
    for k, used in enumerate(uses):
        for j in used:
            first[j] = min(first[j], k)
            last[j] = max(last[j], k)
    return first, last


def _verify(plan: _Plan, inputs, holder: list) -> Tuple[tuple, str]:
    """Replay a pure region's new plan on the recording's inputs: every output must equal the
    Python run's (``holder[0]``), bit for bit (NaN payloads included). Returns ``(the outputs to
    hand back, why the plan is refused or "")``.

    Memory: the Python run's outputs are copied to the host and freed before the replay allocates
    its own, which are handed back when they match (the same bits), so recording costs no more
    device memory than a call (a region's outputs can be a large weight's FP8 copies). On a
    mismatch the Python run's values come back from the host copies."""
    outputs = holder.pop()
    made = [i for i, spec in enumerate(plan.outputs) if spec is not None and spec[0] != "input"]
    # A copy even where the outputs are on the host already (tests): the originals must be freed.
    host = {i: outputs[i].to("cpu", copy=True) for i in made}  # synchronizes: never under capture
    strides = {i: outputs[i].stride() for i in made}
    device = next(t.device for t in inputs if t is not None)
    outputs = tuple(None if i in host else out for i, out in enumerate(outputs))  # the rest are inputs
    again = plan.replay(inputs)
    why = ""
    for i, (out, replayed) in enumerate(zip(outputs, again)):
        if i not in host:
            if out is not replayed:
                why = "the replay's outputs differ in kind"
            continue
        expected = host[i]
        if expected.shape != replayed.shape or expected.dtype != replayed.dtype or strides[i] != replayed.stride():
            why = "the replay's outputs differ in shape, dtype or strides"
        elif expected.numel() and not torch.equal(expected.contiguous().reshape(-1).view(torch.uint8),
                                                  replayed.to("cpu").contiguous().reshape(-1).view(torch.uint8)):
            why = "the replay's outputs differ from the Python run's"
        if why:
            break
    if not why:
        return again, ""
    restored = tuple(
        out if i not in host else
        torch.empty_strided(host[i].shape, strides[i], dtype=host[i].dtype, device=device).copy_(host[i])
        for i, out in enumerate(outputs))
    return restored, why
