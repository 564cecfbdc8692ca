"""A lean launch path for the hot Triton kernels: ``launcher(kernel)[grid](*runtime_args, **constexprs)``.

``JITFunction.__getitem__(grid)(...)`` spends tens of microseconds of CPU per launch binding the
arguments, deriving the specialization of every argument, hashing it into a cache key and
preparing launch metadata. A MoE layer's fwd+bwd launches ~8 kernels, so that alone is most of
its host time. Here the compiled kernel is memoized on a key computed from exactly the facts
Triton specializes on, taken conservatively (a superset, so one key can never stand for two
Triton specializations):

* a tensor: its dtype and whether its address is 16-byte aligned;
* an int: whether it is 1, whether it is a multiple of 16, and whether it fits in 32 bits;
* a host tensor descriptor: its base's dtype and alignment, block shape, and the 16-divisibility
  of its shape and strides;
* anything else (floats, None, bools): its type, and for bools and None its value;
* every constexpr: its value; the launch options (num_warps, num_stages, ...): their values.

A miss (first call of a key) goes through Triton's own ``kernel[grid](...)``, which compiles if
needed and launches; the compiled kernel it returns is memoized. A hit calls the compiled
kernel's launcher directly with the current torch stream: with the Triton releases whose
launcher layout this module knows (3.5, 3.6), its C entry, skipping ``CudaLauncher.__call__``'s
per-call closures and allocator lookups; otherwise ``CompiledKernel.run``. ``launch_keyed`` lets a
call site that already holds the facts (a GEMM's launch plan, a cast of one shape) name the key
itself: one dict lookup per launch instead of one fact per argument. Launch hooks (profilers such
as proton) or the interpreter always take Triton's own path. ``TURBO_MOE_LAUNCH_CHECK=1``
re-derives Triton's key on every hit and asserts it names the memoized kernel (the GPU tests run
with it).

Host TMA descriptors: a call site of ``launch_keyed`` passes them as :class:`HostDesc` (Triton's
``TensorDescriptor`` fields plus a ``cache_key``). Triton's own path gets real ``TensorDescriptor``
objects. A direct hit skips Triton's per-launch expansion of every descriptor (a Python wrapper
around ``fill_tma_descriptor``, a few microseconds each, nine per fwd+bwd) where it can: the expanded
arguments (a ``CUtensorMap`` and the shape and strides) are made once per ``cache_key`` by Triton's
own ``make_tensordesc_arg`` and reused. The key must determine the base address, dtype, shape,
strides and block shape: a GEMM launch plan uses (its id, the slot, ``base.data_ptr()``), the plan
fixing the rest, and torch's caching allocator hands the same addresses back step after step. No
tensor is kept alive by the cache: an expanded descriptor holds the address only.

Runtime arguments are positional and come first in the kernel signature; constexprs and launch
options are keywords (every kernel of this package is written that way).
"""

from __future__ import annotations

import functools
import os
from typing import Dict, Hashable, List, NamedTuple

import torch

_cuda_get_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else None
_cuda_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None

def arg_fact(arg):
    kind = type(arg)
    if kind is int:  # most arguments: sizes and strides
        return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if arg is None or kind is bool:
        return (arg,)
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor):  # triton.tools.tensor_descriptor.TensorDescriptor
        return (
            "desc", base.dtype, base.data_ptr() % 16 == 0, tuple(arg.block_shape),
            tuple(s % 16 == 0 for s in arg.shape), tuple(s % 16 == 0 for s in arg.strides),
            getattr(arg, "padding", None), getattr(arg, "layout", None),
        )
    return (kind,)


class HostDesc(NamedTuple):
    """A host TMA descriptor argument of ``launch_keyed``: ``TensorDescriptor(base, shape, strides,
    block_shape)`` plus ``cache_key``, which must determine ``base``'s address and dtype, the shape,
    the strides and the block shape (the descriptor's every input; see the module docstring).
    ``layout``: for a Gluon kernel, the shared-memory layout of its Gluon ``TensorDescriptor``
    (fixed by the call site with the block shape); None for a ``@triton.jit`` kernel."""

    base: torch.Tensor
    shape: List[int]
    strides: List[int]
    block_shape: List[int]
    cache_key: Hashable
    layout: object = None


@functools.lru_cache(maxsize=None)
def _tensor_descriptor_type():
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor


def to_descriptor(desc: HostDesc):
    """The Triton descriptor object ``desc`` stands for: a Gluon ``TensorDescriptor`` when it has a
    layout, else ``triton.tools.tensor_descriptor.TensorDescriptor``."""
    if desc.layout is not None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout)
    return _tensor_descriptor_type()(desc.base, desc.shape, desc.strides, desc.block_shape)


def triton_args(args) -> tuple:
    """``args`` with every :class:`HostDesc` made the descriptor object it stands for (what
    Triton's own path, its binder and its launcher wrapper take)."""
    if not any(type(a) is HostDesc for a in args):
        return args
    return tuple(to_descriptor(a) if type(a) is HostDesc else a for a in args)


_RUNTIME_KNOBS = None


def _runtime_knobs():
    """``triton.knobs.runtime``, imported once (an import statement costs microseconds per launch)."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        from triton import knobs

        _RUNTIME_KNOBS = knobs.runtime
    return _RUNTIME_KNOBS


class _Memo:
    """A compiled kernel and how to launch it: the constexpr values appended to the runtime
    arguments, Triton's C launch entry when its launcher object is one this module knows, and the
    descriptors' expansions made so far (``cache_key`` -> expanded arguments)."""

    __slots__ = ("kernel", "constexpr_values", "direct", "expanded")

    def __init__(self, kernel, constexpr_values):
        self.kernel = kernel
        self.constexpr_values = constexpr_values
        self.direct = _direct_launch(kernel.run)
        self.expanded: Dict[Hashable, tuple] = {}

    def run(self, grid, device, args):
        kernel = self.kernel
        grid_size = len(grid)
        grid_x, grid_y, grid_z = grid[0], grid[1] if grid_size > 1 else 1, grid[2] if grid_size > 2 else 1
        stream = _cuda_raw_stream(device)
        direct = self.direct
        recorder = _RECORD_HOOK
        if recorder is not None:
            if direct is None:
                recorder.other(f"{self.kernel.name} launched through CompiledKernel.run")
            launched_args = args
        if direct is None:
            kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *triton_args(args), *self.constexpr_values)
            return
        c_launch, cooperative, pdl, scratch_bytes, descriptors = direct
        if descriptors is _WRAPPED:  # Triton's descriptor wrapper, called as is
            args = triton_args(args)
        elif descriptors is not None:  # the wrapper unwrapped: the expansions made here, cached
            args = self._expand(args, descriptors)
        # What CudaLauncher.__call__ does, less its per-call closures and allocator lookups: the
        # global scratch (device-side TMA descriptors) is a stream-ordered torch allocation, as
        # the allocator the backend hands Triton (triton.set_allocator) would make it.
        scratch = (torch.empty(grid_x * grid_y * grid_z * scratch_bytes, dtype=torch.int8, device=device)
                   if scratch_bytes else None)
        c_launch(grid_x, grid_y, grid_z, stream, kernel.function, cooperative, pdl, scratch, None,
                 kernel.packed_metadata, None, None, None, *args, *self.constexpr_values)
        if recorder is not None:
            recorder.direct(self, (grid_x, grid_y, grid_z), launched_args, scratch)

    def _expand(self, args, descs):
        """``args`` with each descriptor replaced by what Triton's wrapper would put there
        (``make_tensordesc_arg``'s list), made once per ``HostDesc.cache_key``."""
        positions, make_arg = descs
        expanded = self.expanded
        flat = []
        start = 0
        for pos, meta in positions:
            desc = args[pos]
            if type(desc) is HostDesc:
                parts = expanded.get(desc.cache_key)
                if parts is None:
                    if len(expanded) >= _MAX_EXPANDED:
                        expanded.clear()
                    parts = expanded[desc.cache_key] = tuple(make_arg(to_descriptor(desc), meta))
            else:  # a TensorDescriptor (an unkeyed launch): no key to cache it under
                parts = make_arg(desc, meta)
            flat.extend(args[start:pos])
            flat.extend(parts)
            start = pos + 1
        flat.extend(args[start:])
        return flat


# turbo_moe.host_plan's recorder while it records a region (None otherwise): told of every launch
# (``direct(memo, grid, arguments, global scratch)``, or ``other(why)`` for one it cannot replay).
_RECORD_HOOK = None


def set_record_hook(hook) -> None:
    global _RECORD_HOOK
    _RECORD_HOOK = hook


# Expanded descriptors kept per memoized kernel (addresses seen: activations move between steps
# only when the allocator's pattern changes; the cap bounds a long run's churn).
_MAX_EXPANDED = 1024
_WRAPPED = "wrapped"  # a direct entry whose launch is Triton's descriptor wrapper, not unwrapped


# CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function, *args) calling
# self.launch(gridX, gridY, gridZ, stream, function, launch_cooperative_grid, launch_pdl,
# global_scratch, profile_scratch, *args): the layout of the Triton releases this was written
# against (3.5, 3.6). Other layouts (3.9 passes hooks and signatures separately) keep kernel.run.
_DIRECT_LAYOUT = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
# The arguments before the kernel's own in that C launch: grid (3), stream, function, cooperative,
# pdl, global scratch, profile scratch, packed metadata, launch metadata, enter and exit hooks.
_BASE_ARGS = 13


@functools.lru_cache(maxsize=None)
def _launcher_layout_known(launcher_type) -> bool:
    import inspect

    if launcher_type.__name__ != "CudaLauncher":
        return False
    try:
        params = tuple(inspect.signature(launcher_type.__call__).parameters)
    except (TypeError, ValueError):
        return False
    return params == _DIRECT_LAYOUT


def _unwrap_descriptor_launch(launch):
    """``(C launch, ((position, metadata), ...), make_tensordesc_arg)`` when ``launch`` is Triton
    3.5/3.6's ``wrap_handle_tensordesc`` closure (``inner``) with TMA metadata for every descriptor;
    None otherwise (then the wrapper itself is called, with ``TensorDescriptor`` arguments)."""
    code = getattr(launch, "__code__", None)
    if code is None or getattr(launch, "__name__", "") != "inner" or not launch.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__)))
    c_launch, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    make_arg = launch.__globals__.get("make_tensordesc_arg")
    if (c_launch is None or make_arg is None or not indices or metas is None or len(metas) != len(indices)
            or any(meta is None for meta in metas) or launch.__globals__.get("_BASE_ARGS_FORMAT_LEN") != _BASE_ARGS):
        return None  # no metadata: Triton decomposes the descriptor into the tensor itself (not cacheable)
    # The wrapper hands the metadata out in the order of the descriptors' positions.
    return c_launch, tuple(zip(sorted(indices), metas)), make_arg


def _direct_launch(runner):
    """``(C launch, cooperative, pdl, scratch bytes per program, descriptors)`` of Triton's launcher
    object when its layout is the known one and it needs no profile scratch; None otherwise
    (kernel.run). ``descriptors``: None when the launch is the C entry itself (no descriptor
    arguments); ``(positions with metadata, make_tensordesc_arg)`` when the C entry was unwrapped
    from Triton's descriptor wrapper; ``_WRAPPED`` when the wrapper is called as is."""
    if os.environ.get("TURBO_MOE_DIRECT_LAUNCH", "1") in ("", "0") or not _launcher_layout_known(type(runner)):
        return None
    try:
        if runner.profile_scratch_size:
            return None
        launch = runner.launch
        scratch = runner.global_scratch_size * runner.num_ctas
        common = (runner.launch_cooperative_grid, runner.launch_pdl, scratch)
    except AttributeError:
        return None
    if getattr(launch, "__code__", None) is None:  # the C entry itself: no descriptor arguments
        return (launch, *common, None)
    unwrapped = _unwrap_descriptor_launch(launch)
    if unwrapped is None:
        return (launch, *common, _WRAPPED)
    c_launch, positions, make_arg = unwrapped
    return (c_launch, *common, (positions, make_arg))


_LAUNCHERS = []
_MAX_KEYED = 4096


def launch_stats() -> dict:
    """``{kernel name: (lean hits, misses through Triton's path, memoized kernels launched through
    Triton's C entry directly / all memoized kernels)}`` of every lean launcher."""
    return {
        launcher.fn.__name__: (launcher.hits, launcher.misses,
                               f"{sum(m.direct is not None for m in launcher._memo.values())}/{len(launcher._memo)} direct")
        for launcher in _LAUNCHERS
    }


class LeanLauncher:
    """Wraps one ``@triton.jit`` kernel; see the module docstring."""

    def __init__(self, fn) -> None:
        _LAUNCHERS.append(self)
        self.fn = fn
        self._memo: Dict[tuple, _Memo] = {}
        self._keyed: Dict[tuple, _Memo] = {}  # launch_keyed: (device, caller's key) -> memo
        self._num_runtime = None
        self._check = os.environ.get("TURBO_MOE_LAUNCH_CHECK", "0") not in ("", "0")
        self._unsupported = False  # set when this Triton's objects do not offer what a lean launch needs
        self.hits = 0
        self.misses = 0

    def __getitem__(self, grid):
        # A C-level partial, not a lambda: one Python frame less per launch.
        return functools.partial(self.launch, grid)

    def _hooked(self) -> bool:
        """Whether a profiler's launch hook is set (launches then take Triton's own path)."""
        runtime = _RUNTIME_KNOBS if _RUNTIME_KNOBS is not None else _runtime_knobs()
        # Triton >= 3.5 keeps launch hooks in a HookChain (never None; its ``calls`` empty when unused).
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        return (enter is not None and bool(getattr(enter, "calls", True))) or (
            exit_ is not None and bool(getattr(exit_, "calls", True)))

    def launch(self, grid, *args, **kwargs):
        if self._hooked():
            return self.fn[grid](*args, **kwargs)  # a profiler's hook: Triton's own path
        # torch.cuda.current_device() without its lazy-init checks: the arguments are CUDA
        # tensors, so CUDA is initialized already.
        device = _cuda_get_device()
        return self._launch_memoized(self._full_key(device, args, kwargs), grid, device, args, kwargs)

    @staticmethod
    def _full_key(device, args, kwargs):
        # kwargs in call order: a call site always passes them in one order, and another order
        # only makes another key (one more miss), never a wrong hit.
        return (device, tuple(map(arg_fact, args)), tuple(kwargs.items()))

    def _launch_memoized(self, key, grid, device, args, kwargs):
        memo = self._memo.get(key)
        if memo is None:
            return self._first_launch(key, grid, args, kwargs)
        return self._hit(memo, grid, device, args, kwargs)

    def _hit(self, memo, grid, device, args, kwargs):
        self.hits += 1
        if self._check:
            self._assert_same_kernel(memo.kernel, triton_args(args), kwargs)
        memo.run(grid, device, args)
        return memo.kernel

    def launch_keyed(self, grid, key, *args, **kwargs):
        """``launch`` with the memo key supplied by the caller, for call sites that launch one
        specialization many times (a GEMM's launch plan, a cast of one shape).

        ``key`` must be hashable and determine every fact ``arg_fact`` derives from ``args`` and
        every value of ``kwargs``: e.g. the shapes, strides and dtypes the call site derives its
        integer arguments from, plus the 16-byte alignment of each tensor argument. A hit then
        costs one dict lookup instead of one ``arg_fact`` per argument. The first launch of a key
        takes ``launch``'s path and binds the key to the kernel that path memoized; with
        ``TURBO_MOE_LAUNCH_CHECK=1`` every hit is checked against Triton's own dispatch, so a key
        that misses a fact fails the GPU tests instead of launching the wrong specialization.
        """
        if self._hooked():
            return self.fn[grid](*triton_args(args), **kwargs)
        device = _cuda_get_device()
        memo = self._keyed.get((device, key))
        if memo is None:
            args = triton_args(args)
            full = self._full_key(device, args, kwargs)
            kernel = self._launch_memoized(full, grid, device, args, kwargs)
            memo = self._memo.get(full)
            if memo is not None:
                if len(self._keyed) >= _MAX_KEYED:  # keys of plans made during captures, tuning...
                    self._keyed.clear()
                self._keyed[(device, key)] = memo
            return kernel
        return self._hit(memo, grid, device, args, kwargs)

    def _first_launch(self, key, grid, args, kwargs):
        """A miss: Triton's own path (compiles if needed, launches); memoize what it returns."""
        self.misses += 1
        kernel = self.fn[grid](*args, **kwargs)
        if kernel is not None and not hasattr(kernel, "result") and not self._unsupported:
            try:  # never memoize an async compile; a Triton whose kernel objects differ keeps its own path
                kernel.run  # noqa: B018  (the launcher this path calls must exist)
                self._memo[key] = _Memo(kernel, self._constexpr_values(args, kwargs))
            except (AttributeError, TypeError):
                self._memo.pop(key, None)
                self._unsupported = True
        return kernel

    def _constexpr_values(self, args, kwargs):
        """The values of every parameter after the runtime ones, in signature order (defaults
        applied): what Triton's bound arguments hold there."""
        values = []
        for param in self.fn.params[len(args):]:
            if not param.is_constexpr:
                raise TypeError(f"{self.fn.__name__}: runtime argument {param.name!r} must be positional")
            if param.name in kwargs:
                values.append(kwargs[param.name])
            elif param.has_default:
                values.append(param.default)
            else:
                raise TypeError(f"{self.fn.__name__}: constexpr {param.name!r} has no value")
        return tuple(values)

    def _assert_same_kernel(self, kernel, args, kwargs):
        from triton import knobs
        from triton.runtime.jit import compute_cache_key

        caches = self.fn.device_caches[torch.cuda.current_device()]
        kernel_cache, kernel_key_cache, _, _, binder = caches
        full = dict(kwargs)
        full["debug"] = full.get("debug", self.fn.debug) or knobs.runtime.debug
        if hasattr(knobs.compilation, "instrumentation_mode"):
            full["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        _, specialization, options = binder(*args, **full)
        found = kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, options))
        assert found is kernel, f"lean launch of {self.fn.__name__} memoized a different specialization"


class _TritonPath:
    """A kernel launched through Triton's own ``kernel[grid](...)`` (the interpreter), with the
    launcher's interface."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn[grid]

    def launch(self, grid, *args, **kwargs):
        return self.fn[grid](*args, **kwargs)

    def launch_keyed(self, grid, key, *args, **kwargs):
        return self.fn[grid](*triton_args(args), **kwargs)


def lean(fn):
    """``fn`` wrapped for lean launches (``launcher[grid](*args, **kw)`` or
    ``launcher.launch(grid, *args, **kw)``); under the interpreter (CPU tensors) Triton's own path."""
    if type(fn).__name__ == "InterpretedFunction":
        return _TritonPath(fn)
    return LeanLauncher(fn)
